"""What a re-run with nothing to do costs, against the first run of the same audit.

Runs, in one invocation and one fresh output folder, the same small audit twice as whole commands:

    python -m creditaudit audit --config <tmp>/small.toml --out <tmp>/audit --quiet

(bp and fa on digits, 2 seeds, 2 epochs, width 16, 2 blocks, unless changed below): the first run
trains and diagnoses every run; the second finds every run finished and every diagnosis reusable.
Each command's wall time and CPU time (its own and its children's: worker processes) are printed,
then as the last line

    rerun_over_first=<second wall time / first wall time>

(the issue's target: ≤ 0.35, measured on a quiet machine; the load average is printed beside, since
a loaded machine stretches the process start-ups a re-run is made of).

    python benchmarks/rerun_cost.py
    python benchmarks/rerun_cost.py --methods bp fa dfa --seeds 1 2 3 --epochs 2 --jobs 2
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(args: list[str]) -> tuple[float, float]:
    """(wall s, CPU s of the command and its children) of `python -m creditaudit ARGS`; an exit
    other than 0 or 3 (incomplete: expected of a 2-epoch audit) stops the benchmark."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "creditaudit", *args], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 3):
        sys.exit(f"command failed ({proc.returncode}): creditaudit {' '.join(args)}\n"
                 f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["bp", "fa"])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--dataset", default="digits")
    p.add_argument("--jobs", type=int, default=0, help="the audit's --jobs (0: one worker per core)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="rerun-cost-") as tmp:
        # the model's size goes through TOML, which every version of the audit reads
        toml = Path(tmp) / "small.toml"
        toml.write_text(f'dataset = "{a.dataset}"\nmethods = {list(a.methods)!r}\nseeds = {list(a.seeds)!r}\n'
                        f'epochs = {a.epochs}\n[model]\nwidth = {a.width}\nblocks = {a.blocks}\n'
                        .replace("'", '"'))
        args = ["audit", "--config", str(toml), "--out", str(Path(tmp) / "audit"), "--quiet",
                "--jobs", str(a.jobs)]
        load = os.getloadavg()[0]
        first = timed(args)
        second = timed(args)
        print(f"cores {os.cpu_count()}, load average before {load:.2f}, after {os.getloadavg()[0]:.2f}")
        print(f"first run:  {first[0]:6.2f} s wall, {first[1]:6.2f} s CPU")
        print(f"re-run:     {second[0]:6.2f} s wall, {second[1]:6.2f} s CPU")
        print(f"rerun_over_first={second[0] / first[0]:.3f}")


if __name__ == "__main__":
    main()
