"""The monitor in TensorBoard: the event files written by the Monitor, `train --tensorboard` and
`audit --tensorboard` are read back and hold every monitor scalar and flag, per epoch."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

import creditaudit  # noqa: E402
from creditaudit.cli import main  # noqa: E402
from creditaudit.data import load_dataset  # noqa: E402


def _events(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_monitor_logs_every_scalar_and_flag(tmp_path):
    data = load_dataset("digits")
    torch.manual_seed(0)
    model = creditaudit.ResidualMLP(64, d=16, n_blocks=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", creditaudit.FlagFired)
        with creditaudit.Monitor(model, data.eval_batch(0), tmp_path / "run", epochs=2,
                                 tensorboard=tmp_path / "tb") as mon:
            for epoch in range(2):
                mon.step(torch.tensor(1.5), 10)
                with torch.no_grad():           # epoch 2: one block blows the stream up
                    model.blocks[1].w2.weight.mul_(1.0 if epoch == 0 else 1e4)
                mon.epoch_end(test_acc=0.25)
    ev = _events(tmp_path / "tb")
    expected = {f"creditaudit/h_norm/l{l}" for l in range(3)} | {f"creditaudit/grad_norm/l{l}" for l in range(3)}
    expected |= {f"creditaudit/{k}" for k in ("max_growth", "init_growth", "stack_growth", "gain",
                                               "test_acc", "train_loss", "eval_batch_acc", "eval_batch_loss")}
    expected |= {f"creditaudit/flag/{k}" for k in ("a", "a_prime", "b", "b_prime")}
    assert expected <= set(ev)
    for l in range(3):
        assert [s for s, _ in ev[f"creditaudit/h_norm/l{l}"]] == [0, 1, 2]
        assert [v for _, v in ev[f"creditaudit/h_norm/l{l}"]] == pytest.approx(
            [r["h_norms"][l] for r in mon.history], rel=1e-6)
    assert [v for _, v in ev["creditaudit/gain"]] == pytest.approx([r["gain"] for r in mon.history], rel=1e-6)
    assert [v for _, v in ev["creditaudit/flag/a"]] == [0.0, 0.0, 1.0]
    assert [v for _, v in ev["creditaudit/train_loss"]] == pytest.approx([1.5, 1.5])   # none at init
    assert mon.report.first_fire["a"] == 2


def test_train_and_audit_log_to_tensorboard(tmp_path):
    args = ["--dataset", "digits", "--epochs", "2", "--device", "cpu", "--quiet"]
    assert main(["train", *args, "--width", "16", "--blocks", "2", "--out", str(tmp_path / "run"),
                 "--tensorboard", str(tmp_path / "tb")]) == 0
    ev = _events(tmp_path / "tb")
    history = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [v for _, v in ev["creditaudit/h_norm/l2"]] == pytest.approx([r["h_norms"][2] for r in history], rel=1e-6)
    assert [v for _, v in ev["creditaudit/test_acc"]] == pytest.approx([r["test_acc"] for r in history], rel=1e-6)
    assert [s for s, _ in ev["creditaudit/flag/b_prime"]] == [0, 1, 2]

    code = main(["audit", *args, "--methods", "bp", "--seeds", "42", "--jobs", "1", "--no-stack",
                 "--out", str(tmp_path / "audit"), "--tensorboard", str(tmp_path / "tba")])
    assert code in (0, 3)
    logged = sorted(p.name for p in (tmp_path / "tba").iterdir())
    runs = sorted(p.name for p in (tmp_path / "audit" / "runs").iterdir())
    assert logged == runs and len(runs) == 3                # the run, its frozen and shallow controls
    for name in runs:
        rows = (tmp_path / "audit" / "runs" / name / "metrics.jsonl").read_text().splitlines()
        assert [s for s, _ in _events(tmp_path / "tba" / name)["creditaudit/gain"]] == list(range(len(rows)))
