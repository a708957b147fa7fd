"""The verdict's rules on constructed cases: (a′) sees growth the paper's (a) misses, "trustworthy"
needs every flag evaluated on a finished run, a fired flag walks back anyway, (d) across seeds
uses the paired interval, each reason's sentence matches the numbers it cites, and the report is a
view of audit.json alone."""
from __future__ import annotations

import re
import shutil

import pytest
import torch
import torch.nn as nn

from creditaudit.config import RunConfig, audit_config_from_dict
from creditaudit.data import load_dataset
from creditaudit.experiments import audit, eval_batches
from creditaudit.experiments.common import diagnose_run
from creditaudit.metrics import monitor_snapshot
from creditaudit.model import ResidualStream
from creditaudit.protocol import diagnose
from creditaudit.report import write_report
from creditaudit.train import train_run
from creditaudit.depth import depth_decision
from creditaudit.verdict import (SeedEvidence, Thresholds, decide, interval,
                                 method_verdict)


def _stream(embed_scale: float, step_gain: float, d_in: int = 16, d: int = 12, blocks: int = 3):
    torch.manual_seed(0)
    embed, head, ln = nn.Linear(d_in, d), nn.Linear(d, 10), nn.LayerNorm(d)
    step = (lambda h: h + 0.01 * torch.tanh(h)) if step_gain == 1 else (lambda h: step_gain * h)
    return ResidualStream(embed=lambda x: embed_scale * embed(x), steps=[step] * blocks,
                          readout=lambda h: head(ln(h)))


def _batches(n: int = 8, size: int = 64, d_in: int = 16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, d_in, generator=g), torch.randint(0, 10, (size,), generator=g))
            for _ in range(n)]


def _history(init, now, x, y):
    return [{"epoch": 0, "test_acc": None, **monitor_snapshot(init, x, y).to_dict()},
            {"epoch": 1, "test_acc": None, **monitor_snapshot(now, x, y).to_dict()}]


def test_embedding_x30_and_blocks_x15_fire_a_prime_but_not_the_papers_a():
    """The measured CIFAR pattern: the embedding grows the stream ~30×, each block ~15×; no single
    block reaches 50×, so (a) is silent — (a′) is not."""
    batches = _batches()
    init, grown = _stream(1.0, 1), _stream(30.0, 15.0)
    history = _history(init, grown, *batches[0])
    report = diagnose(grown, batches, monitor_history=history, frozen_acc=0.0, test_acc=0.5)
    assert report.max_growth == pytest.approx(15.0, rel=1e-3)
    assert report.flags["a"] is False and report.flags["a_prime"] is True
    assert report.init_growth == pytest.approx(30 * 15 ** 3, rel=0.05)
    assert report.stack_growth == pytest.approx(15 ** 3, rel=1e-3)
    assert report.paper_verdict.startswith("trustworthy") or "(a)" not in report.paper_verdict
    assert "(a′) GROWN" in report.verdict
    reason = next(r for r in report.reasons if r.startswith("(a′)"))
    assert f"{report.stack_growth:.3g}×" in reason and f"{report.init_growth:.3g}×" in reason


def test_healthy_stream_fires_neither_a_nor_a_prime():
    batches = _batches()
    init = _stream(1.0, 1)
    report = diagnose(init, batches, monitor_history=_history(init, init, *batches[0]),
                      frozen_acc=0.0, test_acc=0.5)
    assert report.flags["a"] is False and report.flags["a_prime"] is False


def test_without_recorded_init_a_prime_is_not_evaluated_unless_the_stack_fires():
    batches = _batches()
    quiet = diagnose(_stream(1.0, 1), batches, frozen_acc=0.0, test_acc=0.5)
    assert quiet.flags["a_prime"] is None and "a_prime" in quiet.not_evaluated
    assert quiet.verdict.startswith("incomplete") and "(a′) not evaluated" in quiet.verdict
    loud = diagnose(_stream(1.0, 15.0), batches, frozen_acc=0.0, test_acc=0.5)
    assert loud.flags["a_prime"] is True and loud.verdict.startswith("walk back")


@pytest.mark.parametrize("dataset", ["digits", "mnist1d", "synthetic"])
def test_bp_runs_fire_neither_a_nor_a_prime(dataset, tmp_path, device):
    config = RunConfig(method="bp", dataset=dataset, epochs=3, width=32, blocks=2)
    run = train_run(config, tmp_path / "run", data_dir=tmp_path / "data", device=device, progress=False)
    data = load_dataset(dataset, tmp_path / "data", device)
    report = diagnose_run(run, eval_batches(data, 8), run_data=data)
    assert report.flags["a"] is False and report.flags["a_prime"] is False
    assert report.training == {"status": "finished", "epochs_completed": 3, "epochs_planned": 3}


def test_readout_gain_falls_as_the_stream_grows_as_the_b_prime_reason_says():
    """(b′)'s sentence: the loss moves ~1/gain times less through the readout. For a terminal
    LayerNorm the gain is ∝ 1/‖h_L‖: scaling the stream by 1000 divides it by ~1000."""
    batches = _batches()
    base = diagnose(_stream(1.0, 1), batches)
    scaled = diagnose(_stream(1000.0, 1), batches)
    assert scaled.readout_gain == pytest.approx(base.readout_gain / 1000, rel=0.05)
    assert scaled.flags["b_prime"] and not base.flags["b_prime"]
    reason = next(r for r in scaled.reasons if r.startswith("(b′)"))
    assert f"{scaled.readout_gain:.3g}" in reason
    assert f"{1 / scaled.readout_gain:.3g}×" in reason


def test_trustworthy_needs_every_flag_on_a_finished_run():
    batches = _batches()
    init = _stream(1.0, 1)
    history = _history(init, init, *batches[0])
    full = dict(monitor_history=history, frozen_acc=0.0, test_acc=0.5)
    assert diagnose(init, batches, **full,
                    training={"status": "finished", "epochs_completed": 3, "epochs_planned": 3}
                    ).verdict == "trustworthy"
    no_control = diagnose(init, batches, monitor_history=history)
    assert no_control.verdict.startswith("incomplete") and "(d) not evaluated" in no_control.verdict
    assert no_control.flags["d"] is None and "d" in no_control.not_evaluated
    killed = diagnose(init, batches, **full,
                      training={"status": None, "epochs_completed": 7, "epochs_planned": 30})
    assert killed.verdict.startswith("incomplete") and "7/30 epochs" in killed.verdict
    # a fired flag is evidence enough, even when something else is missing
    undercut = diagnose(init, batches, monitor_history=history, frozen_acc=0.99, test_acc=0.5,
                        training={"status": None, "epochs_completed": 7, "epochs_planned": 30})
    assert undercut.verdict == "walk back: (d) UNDERCUT"
    assert any("7/30" in n for n in undercut.notes)


def test_decide_rules():
    keys = ("a", "a_prime", "b_prime", "d")
    assert decide(dict.fromkeys(keys, False), "project").text == "trustworthy"
    v = decide({**dict.fromkeys(keys, False), "d": None}, "project")
    assert v.outcome == "incomplete" and v.text == "incomplete: (d) not evaluated"
    v = decide({**dict.fromkeys(keys, None), "a": True}, "project")
    assert v.walks_back and v.fired == ("a",) and v.text == "walk back: (a) EXPLODED"
    assert decide({"a": False, "b": False, "d": False, "b_prime": True}, "paper").trustworthy  # (b′) is not the paper's
    assert decide(dict.fromkeys(keys, False), "project", missing=["x"]).text == "incomplete: x"


def test_depth_across_seeds_is_a_one_sided_decision():
    t = Thresholds()
    assert depth_decision([0.30, 0.31, 0.29], t.depth_margin).fires is False        # clearly above the margin
    assert depth_decision([-0.03, -0.04, -0.035], t.depth_margin).fires is True     # clearly below
    d = depth_decision([0.00, 0.06, 0.03], t.depth_margin)                           # straddles +2 points
    assert d.fires is None and d.outcome == "undetermined" and d.lower < 0.02 < d.upper
    assert "undetermined" in d.explain() and d.seeds_needed is None or d.seeds_needed > 3
    five = interval([0.30, 0.31, 0.29, 0.33, 0.28])
    lo, hi = five["bootstrap_interval"]
    assert lo < five["mean"] < hi and five["t_interval"][0] < lo       # BCa is tighter than t here


def _evidence(label, status, acc, frozen, flags=None):
    report = None if status == "failed" else {
        "flags": {"a": False, "a_prime": False, "b": False, "b_prime": False, "c": False,
                  **(flags or {})}, "reasons": [],
        "training": {"status": status, "epochs_completed": 3, "epochs_planned": 3}}
    return SeedEvidence(label, status, report, acc, frozen)


def test_method_verdict_over_seeds():
    t = Thresholds()
    good = [_evidence(f"m/s{s}", "finished", 0.70 + s / 1000, 0.40) for s in range(3)]
    assert method_verdict(good, t)["verdict"] == "trustworthy"
    failed = good[:2] + [_evidence("m/s2", "failed", None, 0.40)]
    assert method_verdict(failed, t)["verdict"].startswith("incomplete")
    no_control = [_evidence(f"m/s{s}", "finished", 0.70, None) for s in range(3)]
    judged = method_verdict(no_control, t)
    assert judged["verdict"] == "incomplete: (d) not evaluated"
    assert judged["verdicts"]["project"]["outcome"] == judged["verdicts"]["paper"]["outcome"] == "incomplete"
    exploded = failed[:1] + [_evidence("m/s1", "finished", 0.7, 0.4, {"a": True})] + failed[2:]
    assert method_verdict(exploded, t)["verdict"] == "walk back: (a) EXPLODED"


def test_report_is_rebuilt_byte_identical_from_audit_json_alone(tmp_path):
    out = tmp_path / "audit"
    config = audit_config_from_dict({"dataset": "digits", "methods": ["bp", "dfa"], "seeds": [42, 123],
                                     "epochs": 2, "jobs": 1, "out": str(out),
                                     "model": {"width": 16, "blocks": 2}})
    write_report(audit(config, progress=False), out)
    written = (out / "audit.md").read_bytes()
    shutil.rmtree(out / "runs")                                   # the run folders are gone
    from creditaudit.cli import main
    assert main(["report", str(out)]) == 0
    assert (out / "audit.md").read_bytes() == written
    assert re.search(rb"\| bp +\|", written)


def test_nan_thresholds_and_an_inconsistent_finished_status_are_no_evidence():
    """A NaN threshold makes every comparison false (nothing could fire): refused. A run called
    "finished" after 1 of 100 planned epochs is unfinished."""
    import math as _math
    from creditaudit.errors import CreditAuditError
    from creditaudit.verdict import Thresholds, training_gaps
    with pytest.raises(CreditAuditError, match="threshold growth must be a number"):
        Thresholds(growth=_math.nan)
    with pytest.raises(CreditAuditError, match="training must be a dict"):
        training_gaps("finished")
    assert training_gaps({"status": "finished", "epochs_completed": 1, "epochs_planned": 100})
    assert training_gaps({"status": "finished", "epochs_completed": 100, "epochs_planned": 100}) == []
