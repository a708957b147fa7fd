"""The researcher's own tools: a Monitor logging into the user's SummaryWriter and per-epoch
callback (W&B, MLflow), `audit_own_runs` over several methods, and docs/YOUR_OWN_LOOP.md's
example over a model that is not a creditaudit class, run as written."""
from __future__ import annotations

import warnings

import pytest
import torch

import creditaudit
from creditaudit.data import load_dataset
from creditaudit.errors import CreditAuditError


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def _epochs(mon, n, loss=1.5):
    for _ in range(n):
        mon.step(torch.tensor(loss), 10)
        mon.epoch_end(test_acc=0.25)


def test_monitor_logs_into_the_users_writer_and_callback(tmp_path, digits):
    """tensorboard= takes an open SummaryWriter (kept open: its owner closes it); on_epoch gets
    each record's scalars under the TensorBoard names, the same values, with creditaudit/epoch."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(str(tmp_path / "tb"))
    writer.add_scalar("mine/loss", 3.0, 0)
    seen = []
    torch.manual_seed(0)
    model = creditaudit.ResidualMLP(64, d=16, n_blocks=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", creditaudit.FlagFired)
        with creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "run", epochs=2,
                                 tensorboard=writer, on_epoch=seen.append) as mon:
            _epochs(mon, 2)
    writer.add_scalar("mine/loss", 2.0, 1)          # still open after the run was sealed
    writer.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("mine/loss")] == [3.0, 2.0]
    gains = [e.value for e in acc.Scalars("creditaudit/gain")]
    assert gains == pytest.approx([r["gain"] for r in mon.history], rel=1e-6)
    assert [r["creditaudit/epoch"] for r in seen] == [0.0, 1.0, 2.0]
    assert [r["creditaudit/gain"] for r in seen] == pytest.approx(gains, rel=1e-6)
    assert [r["creditaudit/h_norm/l2"] for r in seen] == pytest.approx(
        [r["h_norms"][2] for r in mon.history], rel=1e-6)
    assert all(isinstance(v, float) for r in seen for v in r.values())   # what trackers take
    assert {"creditaudit/flag/a", "creditaudit/flag/b_prime", "creditaudit/train_loss"} <= set(seen[-1])
    assert "creditaudit/train_loss" not in seen[0]                          # none at init
    with pytest.raises(CreditAuditError, match="on_epoch must be a function"):
        creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "bad", epochs=1, on_epoch=3)
