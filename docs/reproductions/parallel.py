"""Several `creditaudit reproduce RULE` at once on one machine, inside a wall-clock deadline: for a
lent GPU, where time is counted and every rule's runs fit on the card together.

Each rule runs as its own process group (`reproduce RULE --out audits/reproduce/RULE --jobs J`).
After `--probe` seconds the script reads each rule's slowest main run's pace (its
metrics.jsonl, one record per epoch, the first epoch's start-up left out) and projects the rule's
finish. A rule that would not finish
inside the deadline is stopped and started again at the epochs that fit (a stated reduced budget:
the audit says so). At the deadline whatever still runs is stopped; a rule's audit.json exists only
when its audit finished. The last lines are one row per rule: epochs, exit status, wall time.

    python docs/reproductions/parallel.py --data-dir data --deadline 480 \\
        kolen-pollack dfa fa ep=25 local-loss --jobs 4 --device cuda

Then `python docs/reproductions/regenerate.py --page-only` after copying each audit.json to
docs/reproductions/RULE.json (`--collect` does the copy).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AUDIT_SECONDS = 45          # the audit after training: gate, diagnoses, report (measured on a CPU: 20–40 s)


def progress(out: Path, rule: str) -> tuple[int, float] | None:
    """(epochs done, seconds per epoch) of the rule's slowest main run, from its metrics.jsonl
    (one record per epoch, each with the run's cumulative training `wall_time`), or None before
    one has two epochs past its first. The first epoch is left out of the rate: it holds the
    start-up (data on the device, compiling the step)."""
    slowest = None
    for run in (out / "runs").glob(f"{rule}-none-s*"):
        records = []
        try:
            with open(run / "metrics.jsonl") as f:
                records = [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError):
            continue                       # not started, or a line being written
        times = {r["epoch"]: r.get("wall_time") for r in records}
        last = max(times, default=0)
        if last < 3 or times.get(1) is None or times.get(last) is None:
            continue
        seen = (last, (times[last] - times[1]) / (last - 1))
        slowest = seen if slowest is None or seen[1] > slowest[1] else slowest
    return slowest


def plan(done: int, per_epoch: float, epochs: int, waves: int, left: float) -> tuple[float, int | None]:
    """(seconds the rule still needs, the epochs that fit in `left` seconds when it does not fit,
    else None): `waves` rounds of its heavy runs at `per_epoch`, then its audit. A restart leaves
    a margin of 15 % and 5 s; 0 epochs fit when not even one does."""
    finish = waves * per_epoch * (epochs - done) + AUDIT_SECONDS
    if finish <= left:
        return finish, None
    return finish, max(0, int((left - AUDIT_SECONDS - 5) / (waves * per_epoch) * 0.85))


def launch(rule: str, epochs: int | None, args, logs: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "creditaudit", "reproduce", rule, "--seeds", *args.seeds,
               "--device", args.device, "--jobs", str(args.jobs), "--data-dir", args.data_dir,
               "--out", str(Path(args.out_root) / rule), "--quiet"]
    if epochs is not None:
        command += ["--epochs", str(epochs)]
    if args.no_compile:
        command.append("--no-compile")
    log = open(logs / f"{rule}.log", "a")
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rules", nargs="+", metavar="RULE[=EPOCHS]")
    p.add_argument("--seeds", nargs="+", default=["42"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--jobs", type=int, default=4, help="workers per rule")
    p.add_argument("--data-dir", default="data")
    p.add_argument("--deadline", type=float, default=480.0, help="seconds from start for everything")
    p.add_argument("--probe", type=float, default=90.0, help="seconds before the finish is projected")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--out-root", default="audits/reproduce", help="each rule's audit goes to OUT_ROOT/RULE")
    p.add_argument("--logs", default="audits/reproduce/logs")
    p.add_argument("--collect", action="store_true", help="copy each finished audit.json to docs/reproductions/")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    from creditaudit.papers import PAPERS

    start = time.time()
    logs = ROOT / args.logs
    logs.mkdir(parents=True, exist_ok=True)
    planned: dict[str, int] = {}
    for item in args.rules:
        rule, _, n = item.partition("=")
        if rule not in PAPERS:
            p.error(f"no paper setting for {rule!r}; known: {', '.join(PAPERS)}")
        planned[rule] = int(n) if n else PAPERS[rule].epochs
    epochs = dict(planned)
    procs = {rule: launch(rule, epochs[rule], args, logs) for rule in planned}
    began = {rule: start for rule in planned}
    probed: set[str] = set()
    ended: dict[str, tuple[int, float]] = {}
    heavy_waves = math.ceil(4 * len(args.seeds) / args.jobs)   # rule, bp and their frozen controls
    while procs:
        time.sleep(2)
        now = time.time()
        for rule, proc in list(procs.items()):
            if proc.poll() is not None:
                ended[rule] = (proc.returncode, now - began[rule])
                del procs[rule]
                continue
            if rule not in probed and now - began[rule] >= args.probe:
                seen = progress(ROOT / args.out_root / rule, rule)
                if seen is None:
                    continue
                done, per_epoch = seen
                left = args.deadline - (now - start)
                finish, fit = plan(done, per_epoch, epochs[rule], heavy_waves, left)
                probed.add(rule)
                print(f"{rule}: {done} epochs, {per_epoch:.2f} s/epoch; "
                      f"projected {finish:.0f} s more, {left:.0f} s left", flush=True)
                if fit is not None:
                    if fit < 1:
                        print(f"{rule}: nothing fits; stopped", flush=True)
                        stop(proc)
                        ended[rule] = (-1, now - began[rule])
                        del procs[rule]
                        continue
                    print(f"{rule}: restarted at {fit} of {planned[rule]} epochs (a reduced budget)", flush=True)
                    stop(proc)
                    shutil.rmtree(ROOT / args.out_root / rule, ignore_errors=True)   # the stopped runs
                    epochs[rule] = fit
                    procs[rule] = launch(rule, fit, args, logs)
                    began[rule] = time.time()
        if now - start > args.deadline:
            for rule, proc in list(procs.items()):
                print(f"{rule}: deadline reached; stopped", flush=True)
                stop(proc)
                ended[rule] = (-2, now - began[rule])
                del procs[rule]
    print(f"{'rule':<16}{'epochs':>12}{'exit':>6}{'wall s':>9}  audit")
    for rule in planned:
        code, wall = ended[rule]
        audit = ROOT / args.out_root / rule / "audit.json"
        fresh = audit.exists() and audit.stat().st_mtime >= start
        print(f"{rule:<16}{f'{epochs[rule]}/{planned[rule]}':>12}{code:>6}{wall:>9.0f}  "
              f"{'written' if fresh else 'none'}")
        if fresh and args.collect:
            shutil.copyfile(audit, ROOT / "docs" / "reproductions" / f"{rule}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
