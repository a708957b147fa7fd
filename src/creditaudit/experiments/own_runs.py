"""The audit of runs trained in the user's own loop: monitored runs + their frozen controls over
the user's seeds → the same method verdict, audit.json and report as `creditaudit audit`.

Each run folder was written by `creditaudit.Monitor` (its diagnosis made at `finish()`); each
control by a Monitor with `control_of=` that run. Runs and controls are paired by the sha256 of
their initial weights (the control starts where its run started), so the order of the lists does
not matter. The verdict is `verdict.method_verdict` through `audit.summarize_method`: nothing is
judged here.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from .. import __version__, store
from ..errors import CreditAuditError
from ..monitor import FINISHED, MonitoredRun, control_accuracy, load_monitored
from ..verdict import Thresholds, flag_table, seed_noise, threshold_sensitivity
from .audit import STRATEGIES, method_evidence, read_audit, reporting_strategies, summarize_method
from .common import Outcome


@dataclass(frozen=True)
class OwnRunConfig:
    """What the audit's tables read from a run's config, for a run from the user's loop."""

    method: str
    seed: int
    control: str
    epochs: int
    init_sha256: str
    label: str
    lam: float = 0.0
    trainable_blocks: int | None = None

    @property
    def run_key(self) -> str:
        return self.init_sha256[:12]

    def to_dict(self) -> dict:
        return {"method": self.method, "seed": self.seed, "control": self.control,
                "epochs": self.epochs, "init_sha256": self.init_sha256, "source": "user-loop"}


def _outcome(run: MonitoredRun, method: str, seed: int) -> Outcome:
    info = run.info
    control = info.get("control", "none")
    label = f"{method}{'/' + control if control != 'none' else ''}/s{seed}"
    config = OwnRunConfig(method, seed, control, int(info["epochs"]), info["init_sha256"], label,
                          trainable_blocks=0 if control == "frozen" else None)
    status = run.status.get("status", "unfinished")
    message = run.status.get("message", "no status: the loop never called finish()")
    report = run.diagnosis if control == "none" else None
    return Outcome(config, run.run_dir, status, message, trained=False, test_acc=run.test_acc,
                   history=run.history, report=report)


def judge_own_runs(runs: Sequence[str | Path], controls: Sequence[str | Path] = (), *,
                   out: str | Path, n_test: int, method: str = "my-method",
                   thresholds: Thresholds = Thresholds()) -> dict:
    """Judge the user's monitored runs (one per seed) with their frozen controls, like an audit.

    n_test: the number of test samples every accuracy was measured on — (d)'s test-set noise floor
    (binomial), as the audit takes it from its data set; with 1–3 seeds the seed spread alone can
    look far too certain. Writes <out>/audit.json (sealed) and returns the audit as read back
    (`api.audit_own_runs` adds the report); `creditaudit check OUT` then gives the verdict as an
    exit code. A run without a finished control of its own keeps the verdict from "trustworthy".
    """
    if isinstance(n_test, bool) or not isinstance(n_test, int) or n_test < 1:
        raise CreditAuditError(f"n_test must be the number of test samples your accuracies were "
                               f"measured on (a positive integer), got {n_test!r}")
    if not runs:
        raise CreditAuditError("audit_own_runs needs at least one run folder")
    mains = [load_monitored(r) for r in runs]
    ctrls = [load_monitored(c) for c in controls]
    seen: dict[str, Path] = {}
    for run in mains:
        if run.info.get("thresholds") != asdict(thresholds):
            raise CreditAuditError(f"{run.run_dir} was diagnosed with other thresholds "
                                   f"({run.info.get('thresholds')}); pass the same thresholds= here")
        if run.info.get("control") != "none":
            raise CreditAuditError(f"{run.run_dir} is a control; pass it in controls=, not runs=")
        if run.diagnosis is None and run.status.get("status") in (FINISHED, "stopped", "diverged"):
            raise CreditAuditError(f"{run.run_dir} has no diagnosis.json; its Monitor's finish() "
                                   "did not complete — call it again")
        sha = run.info["init_sha256"]
        if sha in seen:
            raise CreditAuditError(f"{run.run_dir} and {seen[sha]} start from the same initial "
                                   "weights: they are one seed twice")
        seen[sha] = run.run_dir
    seeds = {}
    for i, run in enumerate(mains):
        seed = run.info.get("seed")
        seeds[run.info["init_sha256"]] = seed if seed is not None else i
    outcomes = [_outcome(r, method, seeds[r.info["init_sha256"]]) for r in mains]
    controlled: dict[str, Path] = {}
    for c in ctrls:
        sha = c.info["init_sha256"]
        if sha not in seeds:
            raise CreditAuditError(f"the control {c.run_dir} belongs to none of the runs given "
                                   "(its initial weights match no run)")
        main = next(r for r in mains if r.info["init_sha256"] == sha)
        # the evidence gate: a frozen control, its own run's, trained like it, blocks at init,
        # embedding and readout trained, finite — else refused in one line
        control_accuracy(c.run_dir, main.info)
        if sha in controlled:
            raise CreditAuditError(f"{c.run_dir} and {controlled[sha]} are both controls of "
                                   f"{main.run_dir}; pass one control per run")
        controlled[sha] = c.run_dir
        outcomes.append(_outcome(c, method, seeds[sha]))
    if len({o.config.seed for o in outcomes if o.config.control == "none"}) < len(mains):
        raise CreditAuditError("two runs carry the same seed; give each Monitor its own seed=")

    t0 = time.perf_counter()
    noise = seed_noise([method_evidence(method, outcomes, n_test)])
    row = summarize_method(method, outcomes, thresholds, noise, n_test)
    row["strategies"] = reporting_strategies(row)
    reports = [o.report for o in outcomes if o.report and o.config.control == "none"]
    out = Path(out)
    result = {
        "creditaudit_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": "user-loop",
        "header": (f"your own training loop: {method}, seed{'s' if len(mains) > 1 else ''} "
                   f"{', '.join(str(o.config.seed) for o in outcomes if o.config.control == 'none')}; "
                   f"controls: {'frozen' if ctrls else 'none'}"),
        "config": {"methods": [method], "seeds": sorted(seeds.values()),
                   "runs": [str(r) for r in runs], "controls": [str(c) for c in controls]},
        "thresholds": asdict(thresholds),
        "wall_time": time.perf_counter() - t0,
        "runs_trained_now": 0,
        "strategies": list(STRATEGIES),
        "methods": [row],
        "strategy_totals": {s: int(row["strategies"][s] == "walk back") for s in STRATEGIES},
        # (d)'s row from the across-seeds decision, as `audit` and `creditaudit thresholds` read it
        "sensitivity": threshold_sensitivity(reports, thresholds, depth={method: row["depth"]})[0]
        if reports else None,
        "runs": [o.to_dict() for o in outcomes],
        "flag_table": flag_table(), "seed_noise": noise.to_dict(), "n_test": n_test,
    }
    if out.exists() and not out.is_dir():
        raise CreditAuditError(f"out={out} is a file; give a folder for the audit")
    if (out / "audit.json").exists():         # never replace the report of another audit
        old = read_audit(out)
        same = lambda k: store.json_safe(old.get(k)) == store.json_safe(result[k])
        if old.get("source") != "user-loop" or not all(map(same, ("config", "n_test", "thresholds"))):
            raise CreditAuditError(f"{out} already holds the report of another audit; give this one "
                                   "its own out=, or delete that folder to replace it")
    try:
        out.mkdir(parents=True, exist_ok=True)
        store.write_sealed_json(out / "audit.json", store.json_safe(result))
    except OSError as err:
        raise CreditAuditError(f"cannot write the audit to {out} ({err.strerror or err}); choose a "
                               "writable out=") from None
    return read_audit(out)
