"""A stack of K members on the one trainer (`train.train_runs`) equals K lone runs member by member.

float64 end to end (default dtype + a dataset whose batches come out in float64), so the only
difference between a stacked member and its serial run is floating-point reassociation of batched
vs plain matmuls: the bound checked is 1e-9 relative (measured ≤ 5e-16 after 3 epochs).
"""
from __future__ import annotations

import pytest
import torch

from creditaudit import store
from creditaudit.config import RunConfig
from member_reference import f64_synthetic
from creditaudit.runs import load_run, read_status
from creditaudit.experiments.common import StackJob, stack_job
from creditaudit.train import can_stack, group_stacks, stack_key, train_run, train_runs

TINY = dict(dataset="synthetic", width=16, blocks=2, epochs=3, batch_size=128)
RTOL = 1e-9


@pytest.fixture
def f64(device):
    """float64 for one test (function scope: the default dtype never leaks into another test), on
    the test device."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield f64_synthetic(device)
    torch.set_default_dtype(before)


def train_stack(configs, dirs, data):
    """The records a worker's stack job returns, for a stack trained on `data` (train.train_runs)."""
    trained = train_runs(configs, dirs, data=data, progress=False)
    return [{"status": t.run.status["status"], "trained": t.trained, "stacked": t.stack_size > 1,
             "stack_size": t.stack_size} for t in trained]


def _members(method: str) -> list[RunConfig]:
    base = RunConfig(method=method, **TINY)
    return [base, base.replace(seed=123), base.replace(trainable_blocks=0),
            base.replace(trainable_blocks=1)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.cpu(), b.cpu()                  # a loaded run's weights are on the CPU, a live run's on the test device
    return float((a - b).norm() / max(b.norm(), 1e-300))


def _without_time(history):
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in history]


def _close_records(a: list[dict], b: list[dict]) -> None:
    for ra, rb in zip(_without_time(a), _without_time(b), strict=True):
        assert ra.keys() == rb.keys()
        for key in ra:
            va, vb = ra[key], rb[key]
            numbers = isinstance(va, dict) and all(isinstance(v, float) for v in va.values())
            if isinstance(va, list) or numbers:     # (weight_alignment: on CUDA the last digit may differ)
                assert va == pytest.approx(vb, rel=1e-7, abs=1e-12), key
            elif isinstance(va, float):
                assert va == pytest.approx(vb, rel=1e-7, abs=1e-12), key
            else:
                assert va == vb, key


@pytest.mark.parametrize("method", ["bp", "fa", "dfa", "dfa-penalty"])
def test_stack_equals_serial(tmp_path, f64, method):
    configs = _members(method)
    assert all(can_stack(c) for c in configs) and len({stack_key(c) for c in configs}) == 1
    serial = [train_run(c, tmp_path / f"serial{i}", data=f64, progress=False)
              for i, c in enumerate(configs)]
    dirs = [tmp_path / f"stack{i}" for i in range(len(configs))]
    records = train_stack(configs, dirs, data=f64)
    assert [r["status"] for r in records] == ["finished"] * 4
    assert all(r["stacked"] and r["stack_size"] == 4 for r in records)
    worst = 0.0
    for c, d, s in zip(configs, dirs, serial):
        run = load_run(d)
        assert run.finished and run.status["epochs_completed"] == c.epochs
        assert run.model.state_dict()["embed.weight"].dtype == torch.float64
        sw, rw = s.model.state_dict(), run.model.state_dict()
        for name in sw:
            worst = max(worst, _rel(rw[name], sw[name]))
        # frozen blocks: bit-identical to the serial run's (= init)
        for l in range(c.blocks):
            if l not in c.trainable_block_ids:
                for name in sw:
                    if name.startswith(f"blocks.{l}."):
                        assert torch.equal(rw[name].cpu(), sw[name].cpu()), name
        # the same test accuracy and monitor lines as the serial run
        assert run.test_acc == s.test_acc
        # the per-example record (d)'s test-set variance reads: bit-identical, line by line
        assert [r["test_correct"] for r in run.history] == [r["test_correct"] for r in s.history]
        _close_records(run.history, s.history)
        # optimizer moments and schedules map back onto the member's serial Method
        ms, mr = s.method.state_dict(), run.method.state_dict()
        assert [x["param_groups"] for x in mr["optimizers"]] == [x["param_groups"] for x in ms["optimizers"]]
        assert mr["schedulers"] == ms["schedulers"]
        assert torch.equal(mr["gen"], ms["gen"])
        for os_, or_ in zip(ms["optimizers"], mr["optimizers"]):
            assert os_["state"].keys() == or_["state"].keys()
            for i in os_["state"]:
                for key in os_["state"][i]:
                    a, b = or_["state"][i][key], os_["state"][i][key]
                    if key == "step":
                        assert torch.equal(a.cpu(), b.cpu())
                    else:
                        worst = max(worst, _rel(a, b))
        ss, sr = store.load_checkpoint(s.run_dir)[1], store.load_checkpoint(d)[1]
        assert torch.equal(ss["data_gen"], sr["data_gen"])
        assert torch.equal(ss["torch_rng"], sr["torch_rng"])
    print(f"{method}: worst relative difference stacked vs serial = {worst:.2e}")
    assert worst < RTOL


def test_frozen_member_blocks_bit_identical_to_init(tmp_path, f64):
    base = RunConfig(method="dfa", **TINY)
    configs = [base, base.replace(trainable_blocks=0), base.replace(trainable_blocks=1)]
    dirs = [tmp_path / f"m{i}" for i in range(3)]
    train_stack(configs, dirs, data=f64)
    from creditaudit.runs import build_model
    for c, d in zip(configs, dirs):
        init = build_model(c, f64.input_shape, f64.n_classes).state_dict()
        final = load_run(d).model.state_dict()
        for l in range(c.blocks):
            same = all(torch.equal(final[k], init[k]) for k in init if k.startswith(f"blocks.{l}."))
            assert same == (l not in c.trainable_block_ids), (c.label, l)
        assert not torch.equal(final["embed.weight"], init["embed.weight"])


def test_stacked_folder_is_reused_and_finished_members_skipped(tmp_path, f64):
    configs = _members("bp")[:2]
    dirs = [tmp_path / "a", tmp_path / "b"]
    first = train_stack(configs, dirs, data=f64)
    assert all(r["trained"] for r in first)
    before = (dirs[0] / "status.json").read_text()
    run = train_run(configs[0], dirs[0], data=f64, progress=False)
    assert run.status["status"] == "finished" and read_status(dirs[0])["status"] == "finished"
    assert (dirs[0] / "status.json").read_text() == before       # returned at once, nothing rewritten
    again = train_stack(configs, dirs, data=f64)
    assert [r["trained"] for r in again] == [False, False]


def test_members_with_later_checkpoints_resume(tmp_path, f64, monkeypatch, every_epoch):
    """A stack killed after its members saved epoch 1 resumes each member from its own last
    checkpoint (members at one epoch stacked again) and ends exactly like a lone run."""
    configs = _members("bp")[:3]
    dirs = [tmp_path / f"m{i}" for i in range(3)]
    real_save = store.save_checkpoint

    def dying_save(run_dir, epoch, *args, **kwargs):
        real_save(run_dir, epoch, *args, **kwargs)
        if epoch == 1 and run_dir.name == "m1":
            raise KeyboardInterrupt
    monkeypatch.setattr(store, "save_checkpoint", dying_save)
    with pytest.raises(KeyboardInterrupt):
        train_stack(configs, dirs, data=f64)
    monkeypatch.setattr(store, "save_checkpoint", real_save)
    records = train_stack(configs, dirs, data=f64)
    assert [r["status"] for r in records] == ["finished"] * 3
    # m0 and m1 resume from their epoch-1 checkpoints as one stack; m2 (epoch 0 only) alone
    assert [r["stacked"] for r in records] == [True, True, False]
    for i in range(3):
        serial = train_run(configs[i], tmp_path / f"serial{i}", data=f64, progress=False)
        got = load_run(dirs[i]).model.state_dict()
        for name, w in serial.model.state_dict().items():
            assert _rel(got[name], w) < RTOL


def test_grouping():
    base = RunConfig(method="dfa", **TINY)
    configs = [base, base.replace(seed=1), base.replace(method="bp", options={}), base.replace(trainable_blocks=0),
               base.replace(blocks=0), base.replace(method="drtp", options={}), base.replace(stop_when_flagged=2),
               base.replace(method="bp", options={}, seed=5)]
    assert not can_stack(configs[5]) and not can_stack(configs[6])
    assert group_stacks(configs) == [[0, 1, 3], [2, 7], [4], [5], [6]]
    assert group_stacks(configs, max_size=2) == [[0, 1], [3], [2, 7], [4], [5], [6]]


def test_stack_job(tmp_path, device):
    """The worker function run_all's integration hook maps over stacks (float32, real loader)."""
    base = RunConfig(method="fa", dataset="synthetic", width=16, blocks=2, epochs=1, batch_size=256)
    configs = [base, base.replace(seed=7)]
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    res = stack_job(StackJob([c.to_dict() for c in configs], dirs, "data", str(device), 1))
    assert [r["stack_size"] for r in res["members"]] == [2, 2]
    assert [r["status"] for r in res["members"]] == ["finished", "finished"]
    assert all(r["stacked"] for r in res["members"])
    assert load_run(dirs[1]).finished


def test_a_small_audit_gives_the_same_verdicts_stacked_and_serial(tmp_path, device, capsys):
    """The audit's `stack` knob changes how runs execute, not what they conclude; each run's
    record says which stack it trained in and its size (or why it trained alone), audit.md says
    in one line how the audit was scheduled, and `--stack` on a CPU says once that it does not
    pay there."""
    from creditaudit.config import audit_config_from_dict
    from creditaudit.experiments import audit
    from creditaudit.experiments.common import CPU_STACK_NOTE
    from creditaudit.report import write_report
    from creditaudit.report.tables import schedule_line
    results = {}
    for stack in (True, False):
        config = audit_config_from_dict({
            "dataset": "digits", "methods": ["bp", "dfa"], "seeds": [42, 123], "epochs": 2,
            "jobs": 1, "stack": stack, "out": str(tmp_path / str(stack)), "device": str(device),
            "model": {"width": 16, "blocks": 2}})
        results[stack] = audit(config, progress=False)
        write_report(results[stack], tmp_path / str(stack))
    assert capsys.readouterr().err.count(CPU_STACK_NOTE) == (device.type == "cpu")
    # stacked: per method, 2 main runs + 2 ladder-free frozen controls share a shape; 2 shallow
    # controls another (blocks = 0): bp and dfa each one stack of 4 and one of 2
    stacked_runs = results[True]["runs"]
    assert all(r["stack"]["size"] > 1 and r["stack"]["alone"] is None for r in stacked_runs)
    by_id = {}
    for r in stacked_runs:
        by_id.setdefault(r["stack"]["id"], set()).add(r["method"])
        assert sum(q["stack"]["id"] == r["stack"]["id"] for q in stacked_runs) == r["stack"]["size"]
    assert all(len(methods) == 1 for methods in by_id.values())
    sizes = sorted(r["stack"]["size"] for r in stacked_runs)
    line = schedule_line(results[True])
    # then how large a stack may be: on a CPU one per worker; on CUDA measured by a probe step
    sizing = (f"CPU: at most {len(stacked_runs)} runs per stack, one stack per worker (1)"
              if device.type == "cpu" else "")
    assert line.startswith(f"stacked: {len(by_id)} stacks of {sizes[0]}–{sizes[-1]} runs; stack size: {sizing}"), line
    assert device.type == "cpu" or "per member (probe step)" in line
    assert line in (tmp_path / "True" / "audit.md").read_text()
    assert all(r["stack"] == {"id": r["stack"]["id"], "size": 1, "alone": "stacking off (--no-stack)"}
               for r in results[False]["runs"])
    assert schedule_line(results[False]) == (f"stacked: none; {len(results[False]['runs'])} runs alone "
                                             "(stacking off (--no-stack))")
    stacked = {m["method"]: m for m in results[True]["methods"]}
    serial = {m["method"]: m for m in results[False]["methods"]}
    for name in serial:
        assert stacked[name]["verdict"] == serial[name]["verdict"]
        assert stacked[name]["paper_verdict"] == serial[name]["paper_verdict"]
        assert abs(stacked[name]["acc"] - serial[name]["acc"]) < 2e-3


def test_the_schedule_line_counts_stacks_and_says_why_runs_trained_alone():
    from creditaudit.report.tables import schedule_line
    runs = ([{"stack": {"id": 0, "size": 3, "alone": None}}] * 3 + [{"stack": {"id": 1, "size": 6, "alone": None}}] * 6
            + [{"stack": {"id": 2, "size": 1, "alone": "user rule not on the member axis"}}]
            + [{"stack": {"id": 3, "size": 1, "alone": "finished before, reused"}}] * 2)
    assert schedule_line({"runs": runs}) == ("stacked: 2 stacks of 3–6 runs; 3 runs alone "
                                             "(2: finished before, reused; 1: user rule not on the member axis)")
    assert schedule_line({"runs": runs[-3:-2]}) == "stacked: none; 1 run alone (user rule not on the member axis)"
    assert schedule_line({"runs": [{"label": "an audit.json from before"}]}) == ""
