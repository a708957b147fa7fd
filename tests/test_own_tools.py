"""The researcher's own tools: a Monitor logging into the user's SummaryWriter and per-epoch
callback (W&B, MLflow), `audit_own_runs` over several methods, and docs/YOUR_OWN_LOOP.md's
example over a model that is not a creditaudit class, run as written."""
from __future__ import annotations

import re
import warnings
from pathlib import Path

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


def _bp_loop(model, mon, data, epochs, lr, seed):
    import torch.nn.functional as F
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for x, y in data.train_batches(128, gen):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss.detach(), len(y))
        mon.epoch_end()


def test_audit_own_runs_pools_several_methods_into_one_report(tmp_path, digits, capsys):
    """Two methods × two seeds from one loop (the same seed gives both methods the same initial
    weights: controls pair by run id), one audit.json with a row per method, (d)'s seed noise
    pooled over both as `audit` pools it, and the terminal table of `creditaudit audit` printed."""
    import statistics
    from creditaudit.depth import DepthDecision, depth_decision
    from creditaudit.report import compact_table
    from creditaudit.verdict import Thresholds
    test = [digits.eval_batch(0, 360)]
    runs, controls = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", creditaudit.FlagFired)
        for method, lr in (("fast-bp", 1e-2), ("slow-bp", 1e-3)):
            for seed in (0, 1):
                torch.manual_seed(seed)
                model = creditaudit.ResidualMLP(64, d=16, n_blocks=2)
                watch = dict(epochs=2, seed=seed, test_batches=test)
                with creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / f"{method}-{seed}",
                                         method=method, **watch) as mon:
                    _bp_loop(model, mon, digits, 2, lr, seed)
                runs.append(mon.out)
                with creditaudit.Monitor(mon.frozen_control(), digits.eval_batch(0),
                                         tmp_path / f"{method}-{seed}-frozen", control_of=mon,
                                         **watch) as ctrl:
                    _bp_loop(ctrl.model, ctrl, digits, 2, lr, seed)
                assert ctrl.info["method"] == method          # a control takes its run's method
                controls.append(ctrl.out)
    capsys.readouterr()
    audit = creditaudit.audit_own_runs(runs, controls[::-1], out=tmp_path / "audit", n_test=360)
    printed = capsys.readouterr().out
    # the table `creditaudit audit` prints (its closing `next:` line names the real folder)
    assert compact_table(audit).split("\nnext:")[0] in printed
    assert [r["method"] for r in audit["methods"]] == ["fast-bp", "slow-bp"]
    assert audit["config"]["methods"] == ["fast-bp", "slow-bp"] and audit["config"]["seeds"] == [0, 1]
    assert sorted((r["method"], r["control"], r["seed"]) for r in audit["runs"]) == sorted(
        (m, c, s) for m in ("fast-bp", "slow-bp") for c in ("none", "frozen") for s in (0, 1))
    assert len({r["key"] for r in audit["runs"]}) == 8

    # a loop's recipe is unknown to the tool, so each method's seed spread is its own (pooling is
    # only over methods known to share a recipe); Holm runs over the two methods tested
    for row in audit["methods"]:
        d = DepthDecision.from_dict(row["depth"])
        assert d.control.seed_source == "this method's own seed spread" and d.family == 2
        gaps = [row["per_seed"][s]["gap"] for s in ("0", "1")]
        assert d.control.seed_var == pytest.approx(statistics.variance(gaps), rel=1e-9, abs=1e-15)
        # the per-example records of run and control (measured on test=) enter the test-set term
        assert d.control.example_source.startswith("per-example") and d.control.n_examples == 360
        again = depth_decision(d.gaps, Thresholds().depth_margin)   # the same gaps, as one claim
        assert again.per_claim == d.per_claim
        assert row["n_paired_with_frozen"] == 2
    # the own-runs sensitivity re-decides the across-seed (d), as `creditaudit thresholds` does
    assert set(audit["sensitivity"]["depth_margin"]["per_run"]) == {"fast-bp", "slow-bp"}

    with pytest.raises(CreditAuditError, match="records method 'fast-bp', not method='x'"):
        creditaudit.audit_own_runs(runs, out=tmp_path / "other", n_test=360, method="x")
    with pytest.raises(CreditAuditError, match="was built for another run"):
        creditaudit.audit_own_runs(runs[:1], controls[1:2], out=tmp_path / "other", n_test=360)
    with pytest.raises(CreditAuditError, match="lists of run folders"):
        creditaudit.audit_own_runs(runs[0], out=tmp_path / "other", n_test=360)
    with pytest.raises(CreditAuditError, match="one seed twice"):
        creditaudit.audit_own_runs([runs[0], runs[0]], out=tmp_path / "other", n_test=360)


def _verdict_lines(text: str) -> list[str]:
    """The verdict lines of a terminal table: the count, then each method's verdicts (a wrapped
    line joined to the line it continues)."""
    lines = []
    for line in text.splitlines():
        if line.startswith("    ") and lines:
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    return [l for l in lines if re.match(r"(Of \d+ methods?, |my-\w+: |  - paper's rule: )", l)]


def test_doc_example_with_a_model_of_its_own(tmp_path, monkeypatch, capsys):
    """docs/YOUR_OWN_LOOP.md's example over a model that is not a creditaudit class (blocks that
    add their own skip, its own data, backprop and a hand-written DFA, controls by the same loop)
    runs as written and prints the verdict lines the doc shows."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from test_monitor import doc_section
    code, shown = doc_section("A complete example: your own model"), doc_section(
        "A complete example: your own model", "text")
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "__doc__"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", creditaudit.FlagFired)
        exec(compile(code, "docs/YOUR_OWN_LOOP.md", "exec"), scope)
    printed = capsys.readouterr().out
    expected = _verdict_lines(shown)
    assert len(expected) == 5                         # the count, two methods × (verdict, paper's rule)
    assert _verdict_lines(printed) == expected
    audit = scope["audit"]
    assert [r["method"] for r in audit["methods"]] == ["my-bp", "my-dfa"]
    assert all(r["n_paired_with_frozen"] == 2 for r in audit["methods"])
    assert (tmp_path / "audits" / "own-model" / "report.html").exists()
    run = creditaudit.load_monitored(tmp_path / "runs" / "my-dfa-s0")
    assert run.info["adapter"]["skip"] is False and run.info["model"] == "Net"
