"""Scheduling stacks (SPEC §8, experiments/sizing.py): how large a stack may be from measured
memory per member and free memory (the measurement injected: no GPU needed), what a unit of work
asks Ray for, and two stacks trained at once in two worker processes giving exactly the audit of
one stack at a time."""
from __future__ import annotations

import json

import pytest
import torch

from creditaudit.config import RunConfig, audit_config_from_dict
from creditaudit.experiments import audit
from creditaudit.data import load_dataset
from creditaudit.experiments.sizing import (CONTEXT_BYTES, MARGIN, cpu_sizing, gpu_share, plan_stacks,
                                            probe_step, size_stacks)
from creditaudit.report.tables import schedule_line
from creditaudit.train import group_stacks

MiB = 2 ** 20


def same_numbers(fragment) -> str:
    """An audit.json fragment as text, every number exactly (NaN as NaN), wall times left out."""
    drop = lambda v: ({k: drop(x) for k, x in v.items() if k not in ("wall_time", "run_dir")} if isinstance(v, dict)
                      else [drop(x) for x in v] if isinstance(v, list) else v)
    return json.dumps(drop(fragment), sort_keys=True, default=str)


@pytest.mark.parametrize("per, fixed, free, workers, n, want", [
    (100 * MiB, 0, 10_000 * MiB, 1, 1000, (MARGIN * 10_000 * MiB - CONTEXT_BYTES) // (100 * MiB)),
    (100 * MiB, 1000 * MiB, 10_000 * MiB, 1, 1000, (MARGIN * 10_000 * MiB - CONTEXT_BYTES - 1000 * MiB) // (100 * MiB)),
    (100 * MiB, 0, 10_000 * MiB, 4, 1000, (MARGIN * 10_000 * MiB / 4 - CONTEXT_BYTES) // (100 * MiB)),
    (1 * MiB, 0, 80_000 * MiB, 1, 12, 12),                  # never more than the runs there are
    (100 * MiB, 0, 600 * MiB, 1, 12, 1),                    # no room beyond the context: alone
    (5000 * MiB, 0, 8000 * MiB, 2, 12, 1),                  # not even one member fits a share: alone
])
def test_stack_size_fits_each_workers_share_of_free_memory(per, fixed, free, workers, n, want):
    sizing = size_stacks(per, fixed, free, workers, n)
    assert sizing.max_size == int(want) and sizing.max_size >= 1
    # the size really fits: its members, the fixed part and the context inside the share
    if sizing.max_size > 1:
        assert sizing.max_size * per + fixed + CONTEXT_BYTES <= MARGIN * free / workers
        assert sizing.max_size == n or (sizing.max_size + 1) * per + fixed + CONTEXT_BYTES > MARGIN * free / workers
    assert f"{per / MiB:.0f} MiB per member" in sizing.why and f"{workers} worker" in sizing.why
    assert sizing.to_dict()["per_member_bytes"] == per


@pytest.mark.parametrize("args", [(0, 0, 1, 1, 1), (-1, 0, 1, 1, 1), (1, 0, -1, 1, 1), (1, 0, 1, 0, 1),
                                  (1, 0, 1, 1, 0)])
def test_impossible_sizing_inputs_are_refused(args):
    with pytest.raises(ValueError):
        size_stacks(*args)


def test_the_plan_probes_each_stackable_shape_once_and_takes_the_tightest():
    base = RunConfig(method="bp", dataset="synthetic", width=16, blocks=2, epochs=1)
    wide = base.replace(width=64)
    configs = [base, base.replace(seed=1), base.replace(trainable_blocks=0), wide, wide.replace(seed=1),
               base.replace(method="drtp", options={})]                 # drtp: not on the member axis
    probed = []

    def measure(c):
        probed.append(c.width)
        return (10 * MiB if c.width == 16 else 100 * MiB), 0

    sizing = plan_stacks(configs, 1, 2000 * MiB, measure)
    assert sorted(probed) == [16, 64]
    assert sizing.max_size == size_stacks(100 * MiB, 0, 2000 * MiB, 1, 3).max_size == 3   # 3 runs of the base shape
    assert sizing.per_member_bytes == 100 * MiB and "tightest of 2 shapes" in sizing.why
    assert plan_stacks(configs[-1:], 1, 2000 * MiB, measure) is None

    def fails_wide(c):
        if c.width == 64:
            raise RuntimeError("CUDA out of memory")
        return measure(c)

    failed = plan_stacks(configs, 1, 2000 * MiB, fails_wide)
    assert failed.max_size == 1 and "probe step of bp failed (RuntimeError: CUDA out of memory)" in failed.why


def test_a_shape_with_few_runs_does_not_cap_another_shapes_stacks():
    """Where memory is ample, the limit is the largest shape's count: the audit's 2 shallow controls
    (blocks = 0) must not split the 4 runs of the main shape into stacks of 2 (seen on an H100)."""
    base = RunConfig(method="bp", dataset="synthetic", width=16, blocks=2, epochs=1)
    configs = [base, base.replace(seed=1), base.replace(trainable_blocks=0),
               base.replace(seed=1, trainable_blocks=0), base.replace(blocks=0), base.replace(blocks=0, seed=1)]
    sizing = plan_stacks(configs, 1, 80_000 * MiB, lambda c: (1 * MiB, 0))
    assert sizing.max_size == 4 and "stacks of at most 4" in sizing.why
    assert group_stacks(configs, max_size=sizing.max_size) == [[0, 1, 2, 3], [4, 5]]


@pytest.mark.parametrize("arch, method, sizes", [
    ("resmlp", "bp", {}), ("vit-mini", "dfa", {"arch_options": {"heads": 2, "patch": 4}}),
    ("resnet-small", "ep", {"width": 8})])
def test_the_probe_step_is_a_training_step_of_the_stack(arch, method, sizes, tmp_path):
    """What the CUDA probe measures is one real step of 1 and of 2 members (here on the CPU): a
    finite loss per member, member 0's the same alone and stacked (same seed, same batch)."""
    data = load_dataset("digits", tmp_path, "cpu")
    config = RunConfig(method=method, dataset="digits", arch=arch, width=16, blocks=2, epochs=1,
                       batch_size=64).replace(**sizes)
    alone, stacked = probe_step(config, data, torch.device("cpu"), 1), probe_step(config, data, torch.device("cpu"), 2)
    assert alone.shape == (1,) and stacked.shape == (2,) and bool(stacked.isfinite().all())
    assert float(stacked[0]) == pytest.approx(float(alone[0]), rel=1e-5)


def test_a_unit_of_work_asks_ray_for_a_share_of_a_gpu_only_on_cuda():
    assert gpu_share(torch.device("cuda"), 1) == 1.0
    assert gpu_share(torch.device("cuda"), 4) == 0.25
    assert gpu_share(torch.device("cpu"), 4) == 0.0
    assert cpu_sizing(7, 2).max_size == 4 and cpu_sizing(7, 1).max_size == 7


def test_two_stacks_at_once_in_two_workers_equal_one_at_a_time(tmp_path, capsys):
    """--jobs 2 --stack on a CPU: the audit's stacks train in two worker processes at once, and its
    tables and every run's numbers equal those of --jobs 1 (the same stacks, one after another)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                   # --jobs 1 trains in this process: one thread like a worker
    try:
        results = {jobs: audit(audit_config_from_dict({
            "dataset": "digits", "methods": ["bp", "dfa"], "seeds": [42], "epochs": 1, "jobs": jobs,
            "stack": True, "out": str(tmp_path / str(jobs)), "device": "cpu",
            "model": {"width": 16, "blocks": 2}}), progress=False) for jobs in (1, 2)}
    finally:
        torch.set_num_threads(threads)
    capsys.readouterr()
    one, two = results[1], results[2]
    stacks = lambda res: sorted(tuple(sorted(r["label"] for r in res["runs"] if r["stack"]["id"] == i))
                                for i in {r["stack"]["id"] for r in res["runs"]})
    assert stacks(one) == stacks(two)
    assert sum(len(s) > 1 for s in stacks(two)) >= 2           # two stacks, so two at once
    assert two["runs_trained_now"] == one["runs_trained_now"] == len(one["runs"])
    assert same_numbers(one["methods"]) == same_numbers(two["methods"])
    assert [same_numbers({k: r[k] for k in ("label", "status", "test_acc", "report", "monitor")})
            for r in one["runs"]] == [same_numbers({k: r[k] for k in ("label", "status", "test_acc", "report",
                                                                      "monitor")}) for r in two["runs"]]
    assert [m["verdict"] for m in one["methods"]] == [m["verdict"] for m in two["methods"]]
    n = len(two["runs"])
    assert all(r["stack"]["sizing"]["max_size"] == -(-n // 2) for r in two["runs"])
    assert two["schedule"] == two["runs"][0]["stack"]["sizing"] and two["schedule"]["workers"] == 2
    assert schedule_line(two).endswith(f"stack size: CPU: at most {-(-n // 2)} runs per stack, "
                                       "one stack per worker (2)")


def test_on_cuda_run_all_sizes_by_the_probe_and_gives_every_worker_a_stack(monkeypatch, tmp_path):
    """run_all's sizing on CUDA (`common.stack_sizing`), the GPU's numbers injected: the probe's
    fit, then at most ⌈runs / workers⌉ so that `--jobs N` workers each get a stack."""
    from creditaudit.experiments import common
    base = RunConfig(method="bp", dataset="digits", width=16, blocks=2, epochs=1)
    configs = [base.replace(seed=s) for s in range(8)]
    monkeypatch.setattr(common, "cuda_free_bytes", lambda dev: 4000 * MiB)
    monkeypatch.setattr(common, "probe_member_bytes", lambda c, data, dev: (100 * MiB, 0))
    cuda = torch.device("cuda")
    alone = common.stack_sizing(configs, cuda, 1, str(tmp_path))
    assert alone.max_size == 8 and alone.free_bytes == 4000 * MiB       # (0.8·4000 − 512) / 100 = 26 ≥ 8 runs
    shared = common.stack_sizing(configs, cuda, 3, str(tmp_path))
    assert shared.max_size == 3 and "each of the 3 workers gets a stack" in shared.why
    monkeypatch.setattr(common, "probe_member_bytes", lambda c, data, dev: (1000 * MiB, 0))
    tight = common.stack_sizing(configs, cuda, 2, str(tmp_path))
    assert tight.max_size == 1 and "no room for more than 1" in tight.why   # 0.8·2000 − 512 < 1000·2
    # a run alone because no second member fit says so, not "no other run of its shape"
    why = common._alone_because(configs[0], {"trained": True, "status": "finished"}, 1, True,
                                common.Execution(), tight.max_size)
    assert why == "stacks limited to 1 run (stack size)"
    assert common._alone_because(configs[0], {"trained": True, "status": "finished"}, 1, True,
                                 common.Execution(), 8) == "no other run of its shape"
