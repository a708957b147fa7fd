"""The benchmark scripts import and run their core on tiny data, so they cannot rot unnoticed
(their timings are never asserted: speed claims come from running them, not from tests)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("*.py")))
def test_benchmark_imports(name):
    assert callable(_load(name).main)


@pytest.mark.parametrize("method", ["bp", "dfa-penalty"])
def test_epoch_speed_core_runs(method):
    bench = _load("epoch_speed")
    data = bench.random_cifar(256, torch.device("cpu"))
    assert bench.own_epoch(method, data, torch.device("cpu")) > 0


@pytest.mark.parametrize("arch", ["vit-mini", "resnet-small"])
def test_stack_archs_speed_core_runs(arch):
    bench = _load("stack_archs_speed")
    sizes = {"vit-mini": dict(width=8, blocks=1, options={"heads": 2, "patch": 4}),
             "resnet-small": dict(width=4, blocks=1)}[arch]
    r, ms = bench.ratio(arch, "bp", k=2, batch=4, steps=1, repeats=1, shape=(3, 8, 8), sizes=sizes)
    assert r > 0 and ms > 0
