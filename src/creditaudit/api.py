"""Python entry points that, like the command line, run an experiment and write its report.

`audit_own_runs` judges the runs of a researcher's own training loop (docs/YOUR_OWN_LOOP.md): the
verdict comes from `experiments.own_runs`, the report from `report` — this module only joins them,
as `cli.py` does for `creditaudit audit`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .experiments.own_runs import judge_own_runs
from .report import compact_table, write_report
from .trackers import check_trackers, log_judged_runs
from .verdict import Thresholds


def audit_own_runs(runs: Sequence[str | Path], controls: Sequence[str | Path] = (), *,
                   out: str | Path, n_test: int, method: str | None = None,
                   thresholds: Thresholds = Thresholds(), quiet: bool = False,
                   trackers: Sequence[str] = (), tracker_project: str | None = None,
                   yardsticks: Sequence[str | Path] = ()) -> dict:
    """Judge the user's monitored runs (every method, one run per method and seed) with their
    frozen controls, like an audit: one row per method, (d) decided for them together (Holm).

    Each run's method is the name its `Monitor(method=...)` recorded; `method` names the runs that
    recorded none (default "my-method"). n_test: the number of test samples each accuracy was
    measured on ((d)'s test-set noise floor). Writes <out>/audit.json (sealed) plus audit.md,
    report.html and the figures, prints the terminal table `creditaudit audit` prints (unless
    `quiet`), and returns the audit as read back; `creditaudit check OUT` then gives the verdicts
    as an exit code. A run without a finished control of its own keeps its method from "trustworthy".

    trackers: as `creditaudit audit --tracker`, e.g. ["wandb:wandb_dir", "mlflow:sqlite:///mlflow.db",
    "tensorboard:tb"]: each run's monitor history, one tracker run per run folder, with its status,
    its verdicts and its method's verdict at the end; tracker_project: the W&B project / MLflow
    experiment (default: the name of `out`). yardsticks: optional frozen controls trained by
    backprop, one per seed, that every control is checked against (`judge_own_runs`).
    """
    if isinstance(trackers, str):
        trackers = [trackers]
    check_trackers(trackers)              # a missing extra is refused before anything is written
    audit = judge_own_runs(runs, controls, out=out, n_test=n_test, method=method, thresholds=thresholds,
                           yardsticks=yardsticks)
    write_report(audit, Path(out))
    if trackers:
        log_judged_runs(audit, trackers, tracker_project or Path(out).name, thresholds)
    if not quiet:
        print(compact_table(audit, out=str(out)))
        print(f"\nfull table, per-seed values and reasons: {Path(out) / 'audit.md'}")
    return audit
