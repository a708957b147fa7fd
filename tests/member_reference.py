"""Fingerprints of lone runs, to compare the one trainer's stack of one with the lone trainer it
replaced. `tests/data/lone_runs_main.json` holds them as main's `train.train_run` produced them at
commit 0ea89ac (before the member axis), recorded on the CPU in float64 with one thread:

    PYTHONPATH=src python tests/member_reference.py tests/data/lone_runs_main.json

and `tests/data/lone_runs_stage2.json` those of the methods of the second stage (sb, cb, ep:
STAGE2_CONFIGS), as main's trainer produced them at commit 7278b3d, before those methods moved
onto the member axis:

    PYTHONPATH=src python tests/member_reference.py tests/data/lone_runs_stage2.json stage2

A fingerprint is, per tensor, (Σ t, ‖t‖, ⟨t, r⟩, n) with r a fixed N(0, 1) vector (generator
seed 0) and n the number of elements, for the final weights and AdamW moments, plus every number
of every metrics line, plus (stage 2) the method's extra state (auxiliary nets, EMA copies) and
its generator's state. Σ t and ⟨t, r⟩ are compared on the tensor's own scale ‖t‖·√n (both are
at most about that, and a sum of gradients can be 0 analytically, so only its rounding is left):
agreeing to 1e-9 in all three means agreeing in the tensor itself but for a change orthogonal to
both 1 and r, which no real difference is.
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from creditaudit import store
from creditaudit.config import RunConfig
from creditaudit.data import ArrayDataset, load_dataset

ALIGNMENT_FIELDS = ("gamma", "weight_alignment")   # train._alignment's, recorded every k-th epoch
TINY = dict(dataset="synthetic", width=16, blocks=2, epochs=3, batch_size=128)
METHOD_NAMES = ("bp", "fa", "dfa", "dfa-penalty")   # the methods of the member axis' first stage
# the second stage's, with small probes (and λ = 1e-2, the audit presets' SB/CB) to keep them fast
STAGE2_OPTIONS = {"sb": {"hidden": 16, "t_dim": 4, "lam": 1e-2},
                  "cb": {"hidden": 16, "t_dim": 4, "lam": 1e-2}, "ep": {}}


def _configs(methods) -> dict[str, RunConfig]:
    out = {}
    for method in methods:
        base = RunConfig(method=method, **TINY, options=STAGE2_OPTIONS.get(method, {}))
        for tag, c in (("main", base), ("seed123", base.replace(seed=123)),
                       ("frozen", base.replace(trainable_blocks=0)),
                       ("rung1", base.replace(trainable_blocks=1)), ("shallow", base.replace(blocks=0)),
                       ("shallow123", base.replace(blocks=0, seed=123))):
            out[f"{method}/{tag}"] = c
    return out


CONFIGS = _configs(METHOD_NAMES)
STAGE2_CONFIGS = _configs(STAGE2_OPTIONS)


@dataclass
class F64Dataset(ArrayDataset):
    """The same batches as ArrayDataset, in float64."""

    def prepare(self, x, train=False, gen=None, draws=None):
        return super().prepare(x, train, gen, draws).double()


def f64_synthetic(device="cpu") -> F64Dataset:
    """1024 train / 500 test samples of the synthetic teacher: 8 batches per epoch."""
    d = load_dataset("synthetic")
    return F64Dataset(d.name, d.x_train[:1024], d.y_train[:1024], d.x_test, d.y_test,
                      d.n_classes).to(device)


def _triple(t: torch.Tensor) -> list[float]:
    t = t.detach().double().flatten().cpu()
    r = torch.randn(t.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return [float(t.sum()), float(t.norm()), float(t @ r), t.numel()]


def _tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested dict/list (a method's extra state), by dotted path."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    out = {}
    for k, v in items:
        out.update({f"{prefix}{k}": v} if isinstance(v, torch.Tensor) else _tensors(v, f"{prefix}{k}."))
    return out


def fingerprint(run) -> dict:
    """What a lone run ends with: weights, optimizer moments and steps, schedules, RNG states
    (sha256, the method's generator included), the method's extra state (auxiliary nets), and
    every metrics line but its wall time."""
    state = store.load_checkpoint(run.run_dir)[1]
    method = run.method.state_dict()
    moments = [{str(i): {k: ([float(v)] if k == "step" else _triple(v)) for k, v in s.items()}
                for i, s in opt["state"].items()} for opt in method["optimizers"]]
    return {
        "weights": {k: _triple(v) for k, v in run.model.state_dict().items()},
        "moments": moments,
        "lr": [[g["lr"] for g in opt["param_groups"]] for opt in method["optimizers"]],
        "rng": {k: hashlib.sha256(state[k].numpy().tobytes()).hexdigest() for k in ("torch_rng", "data_gen")},
        "method_gen": hashlib.sha256(method["gen"].numpy().tobytes()).hexdigest(),
        "extra": {k: _triple(v) for k, v in _tensors(method["extra"]).items()},
        # the alignment fields came after the reference runs (TRAINING_CODE_VERSION 3; probing
        # never changes a run's weights or RNG, so the rest still matches): test_members compares
        # them between a stack's members and their lone runs
        "history": [{k: v for k, v in r.items() if k not in ("wall_time", *ALIGNMENT_FIELDS)}
                    for r in run.history],
        "status": run.status["status"],
    }


def worst_difference(got: dict, ref: dict) -> float:
    """The largest relative difference between two fingerprints (tensors on their own scale,
    metrics relative to their value); non-numbers (statuses, RNG digests, steps) must be equal."""
    worst = 0.0
    assert got["weights"].keys() == ref["weights"].keys()
    worst = max([worst] + [_tensor_diff(got["weights"][n], ref["weights"][n]) for n in ref["weights"]])
    assert len(got["moments"]) == len(ref["moments"])
    for mg, mr in zip(got["moments"], ref["moments"]):
        assert mg.keys() == mr.keys()
        for i in mr:
            assert mg[i].keys() == mr[i].keys()
            for k in mr[i]:
                if k == "step":
                    assert mg[i][k] == mr[i][k], "AdamW step count"
                else:
                    worst = max(worst, _tensor_diff(mg[i][k], mr[i][k]))
    assert got["lr"] == ref["lr"] and got["rng"] == ref["rng"] and got["status"] == ref["status"]
    if "extra" in ref:                      # recorded since stage 2 (the stage-1 file lacks them)
        assert got["method_gen"] == ref["method_gen"] and got["extra"].keys() == ref["extra"].keys()
        worst = max([worst] + [_tensor_diff(got["extra"][n], ref["extra"][n]) for n in ref["extra"]])
    assert len(got["history"]) == len(ref["history"])
    for rg, rr in zip(got["history"], ref["history"]):
        # records made after the reference file carry the test set's digest and per-example
        # correctness (issues 33, 34) beside the accuracy: the rest must be as the reference
        assert set(rg) - {"test_correct", "test_digest"} == set(rr) - {"test_correct", "test_digest"}
        for k in set(rr) & set(rg):
            a, b = (rg[k], rr[k]) if isinstance(rr[k], list) else ([rg[k]], [rr[k]])
            for x, y in zip(a, b, strict=True):
                if isinstance(y, float):
                    worst = max(worst, abs(x - y) / max(abs(y), 1e-12))
                else:
                    assert x == y, k
    return worst


def _tensor_diff(a: list[float], b: list[float]) -> float:
    scale = max(b[1] * b[3] ** 0.5, 1e-300)
    return max(abs(a[0] - b[0]) / scale, abs(a[1] - b[1]) / max(b[1], 1e-300), abs(a[2] - b[2]) / scale)


def _record(path: str, configs: dict[str, RunConfig]) -> None:
    from creditaudit.train import train_run
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    data = f64_synthetic()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in configs.items():
            out[name] = fingerprint(train_run(config, Path(tmp) / name.replace("/", "_"), data=data,
                                              progress=False))
    Path(path).write_text(json.dumps(store.json_safe(out), sort_keys=True) + "\n")


if __name__ == "__main__":
    _record(sys.argv[1], STAGE2_CONFIGS if sys.argv[2:] == ["stage2"] else CONFIGS)
