"""Wall time of `diagnose` on 10 eval batches of 128 for the default ResidualMLP (d=256, L=4).

    python benchmarks/diagnose_speed.py                  # fresh bp and dfa models on MNIST-1D
    python benchmarks/diagnose_speed.py --run RUN_DIR    # a trained run instead

Batches come from MNIST-1D's training split (its test split has 1000 samples, fewer than
10 × 128). Three settings are timed, each the median of --repeats: the diagnostics alone
((a)–(c), no credit); with the method's credit (Γ, plus its 20-draw null for random-feedback
methods); and with ρ and the nudging test at layers 1…L as well.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from creditaudit.config import RunConfig
from creditaudit.data import load_dataset
from creditaudit.protocol import diagnose
from creditaudit.runs import build_method, build_model, load_run


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", default=[], help="run folder(s) to diagnose")
    p.add_argument("--data-dir", default="data")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    data = load_dataset("mnist1d", args.data_dir)
    batches = [data.eval_batch(i, 128, split="train") for i in range(10)]
    subjects = []
    for run_dir in args.run:
        run = load_run(run_dir)
        subjects.append((run.config.label, run.model, run.method))
    if not subjects:
        for name in ("bp", "dfa"):
            config = RunConfig(method=name)
            model = build_model(config, data.input_shape, data.n_classes)
            subjects.append((f"{name} (fresh)", model, build_method(config, model)))
    print(f"diagnose on {len(batches)} batches × 128, torch threads {torch.get_num_threads()}")
    for label, model, method in subjects:
        plain = timed(lambda: diagnose(model, batches), args.repeats)
        credit = timed(lambda: diagnose(model, batches, method=method), args.repeats)
        full = timed(lambda: diagnose(model, batches, method=method, rho=True), args.repeats)
        print(f"{label:<18} diagnostics {plain:.3f} s | + Γ{' + null' if method.random_feedback else ''} "
              f"{credit:.3f} s | + ρ + nudge {full:.3f} s")


if __name__ == "__main__":
    main()
