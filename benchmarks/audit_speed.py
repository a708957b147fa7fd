"""Wall time of the quick audit as a whole command, in units of one BP training run.

Times, in one invocation and each in a fresh output folder,
  1. `python -m creditaudit audit --preset quick --out <tmp> --quiet [--methods …] [--epochs N]`
     as a whole command (data, training, diagnoses, report), with a per-method breakdown: each
     run's training wall time (`wall_time` of its status.json, the runs listed in audit.json),
     summed per method, with the number of runs;
  2. `python -m creditaudit train --method bp --dataset mnist1d --epochs 15 --threads 1 --quiet
     --out <tmp>` as a whole command, --unit-repeats times (default 4), each into a fresh folder,
     half of them before the audit(s) and half after: the unit is their median. This machine's
     speed drifts over minutes (one lone BP run's training took 7.0–8.5 s within half an hour, the
     whole command 10.4–14.8 s), and units taken only after the audit read whatever minute
     followed it. One thread, as each of the audit's workers trains its runs: left
     to `train`'s default the unit took the cores the load average left idle when it started —
     on a 2-core machine 2 threads on a quiet one (10.9–11.5 s) and 1 after the audit had
     loaded it (12.2 s), so the ratio moved by 10 % with the load of the minute before;
and where its wall time went (`phases`: training, gate + diagnoses, tables, report, from when
their files were written), and prints as the last line

    audit_cost_in_bp_runs=<audit seconds / bp run seconds>

    python benchmarks/audit_speed.py                          # the whole quick audit (slow on CPU)
    python benchmarks/audit_speed.py --methods bp dfa --epochs 3
    python benchmarks/audit_speed.py --device cpu --jobs 2
    python benchmarks/audit_speed.py --methods bp dfa --epochs 3 --stack both

--stack on|off passes --stack / --no-stack to the audit (default: the audit's own rule, stacks on
CUDA only); --stack both times the audit stacked and lone in the same invocation (stacked first)
and prints `audit_cost_in_bp_runs_lone=…` before the last line, which is then the stacked one.

Runs trained in one stack (train.train_runs, K > 1) record the stack's elapsed time as their
wall_time, so a stacked method's per-run times overlap: its sum over-counts its share, and the
breakdown says "stacked" when the runs of a method report equal times.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path


def run_command(args: list[str], ok: tuple[int, ...] = (0,)) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "creditaudit", *args], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode not in ok:
        sys.exit(f"command failed ({proc.returncode}): creditaudit {' '.join(args)}\n"
                 f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return seconds


def breakdown(out: Path) -> dict[str, list[float]]:
    """method → [wall_time of each of its runs], from audit.json's runs and their status.json."""
    audit = json.loads((out / "audit.json").read_text())
    per: dict[str, list[float]] = defaultdict(list)
    for run in audit.get("runs", []):
        wall = None
        status = Path(run.get("run_dir", "")) / "status.json"
        if not status.is_absolute():
            status = Path.cwd() / status
        if status.exists():
            wall = json.loads(status.read_text()).get("wall_time")
        per[run["method"]].append(float(wall) if isinstance(wall, (int, float)) else float("nan"))
    return per


def phases(out: Path, started: float, ended: float) -> dict[str, float]:
    """Where the audit's wall time went, from when its files were written (seconds): "start → last
    run trained" (start-up, data, training: the last status.json), "gate + diagnoses" (to the last
    diagnosis.json), "tables" (to audit.json), "report" (to the command's end: figures, HTML, the
    terminal). A phase with nothing new to write (a re-run) reads 0."""
    runs = list((out / "runs").glob("*/"))
    last = lambda name: max((f.stat().st_mtime for d in runs for f in [d / name] if f.exists()), default=None)
    trained = last("status.json") or started
    diagnosed = max(last("diagnosis.json") or trained, trained)
    tabled = max((out / "audit.json").stat().st_mtime, diagnosed)
    return {"start → last run trained": trained - started, "gate + diagnoses": diagnosed - trained,
            "tables": tabled - diagnosed, "report": ended - tabled}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=None, help="audit only these methods")
    ap.add_argument("--epochs", type=int, default=None, help="epochs per audit run (quick: 15)")
    ap.add_argument("--bp-epochs", type=int, default=15, help="epochs of the bp reference run")
    ap.add_argument("--unit-repeats", type=int, default=4,
                    help="bp reference runs, half before the audit and half after; the unit is their median")
    ap.add_argument("--device", default=None, help="passed to both commands (default: theirs)")
    ap.add_argument("--jobs", type=int, default=None, help="passed to the audit")
    ap.add_argument("--keep", metavar="DIR",
                    help="write the audit(s) into DIR (kept) instead of a temp folder")
    ap.add_argument("--stack", choices=("default", "on", "off", "both"), default="default",
                    help="the audit's stacking: its default rule, --stack, --no-stack, or both")
    args = ap.parse_args(argv)

    modes = {"default": [None], "on": ["--stack"], "off": ["--no-stack"], "both": ["--stack", "--no-stack"]}
    with tempfile.TemporaryDirectory(prefix="audit_speed_") as tmp:
        tmp = Path(tmp)
        repeats = max(1, args.unit_repeats)
        units: list[float] = []

        def unit_runs(n: int) -> None:
            for _ in range(n):
                bp_args = ["train", "--method", "bp", "--dataset", "mnist1d", "--epochs", str(args.bp_epochs),
                           "--threads", "1", "--quiet", "--out", str(tmp / f"bp{len(units)}")]
                if args.device:
                    bp_args += ["--device", args.device]
                units.append(run_command(bp_args))

        unit_runs(repeats // 2)
        audits = []
        for flag in modes[args.stack]:
            audit_dir = Path(args.keep) / (flag or "audit").lstrip("-") if args.keep else tmp / f"audit{flag}"
            if audit_dir.exists():
                sys.exit(f"{audit_dir} exists: the timing needs a fresh folder")
            audit_args = ["audit", "--preset", "quick", "--out", str(audit_dir), "--quiet"]
            if args.methods:
                audit_args += ["--methods", *args.methods]
            if args.epochs:
                audit_args += ["--epochs", str(args.epochs)]
            if args.device:
                audit_args += ["--device", args.device]
            if args.jobs is not None:
                audit_args += ["--jobs", str(args.jobs)]
            if flag:
                audit_args.append(flag)
            started = time.time()
            seconds = run_command(audit_args, ok=(0, 3))  # 3: some method incomplete, still a full audit
            audits.append((flag, seconds, breakdown(audit_dir), phases(audit_dir, started, time.time())))

        before = len(units)
        unit_runs(repeats - before)
        bp_s = statistics.median(units)

    for flag, audit_s, per, parts in audits:
        print(f"audit (quick preset{', methods ' + ' '.join(args.methods) if args.methods else ''}"
              f"{', ' + str(args.epochs) + ' epochs' if args.epochs else ''}{', ' + flag if flag else ''}): "
              f"{audit_s:.1f} s as a whole command")
        print(f"{'method':<14}{'runs':>6}{'sum wall_time s':>18}{'mean per run s':>16}")
        for method, walls in sorted(per.items(), key=lambda kv: -sum(kv[1])):
            note = "  (stacked: shared times)" if len(walls) > 1 and len(set(walls)) < len(walls) else ""
            print(f"{method:<14}{len(walls):>6}{sum(walls):>18.1f}{sum(walls) / len(walls):>16.1f}{note}")
        print("phases (from the files' times): " + "; ".join(f"{k} {v:.1f} s" for k, v in parts.items()))
    print(f"bp run ({args.bp_epochs} epochs, mnist1d, one thread): {bp_s:.1f} s as a whole command, the median "
          f"of {', '.join(f'{u:.1f}' for u in units[:before]) or 'none'} before the audit and "
          f"{', '.join(f'{u:.1f}' for u in units[before:])} after")
    for flag, audit_s, _, _ in reversed(audits):
        print(f"audit_cost_in_bp_runs{'_lone' if flag == '--no-stack' and len(audits) > 1 else ''}"
              f"={audit_s / bp_s:.2f}")


if __name__ == "__main__":
    main()
