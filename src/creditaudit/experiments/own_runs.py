"""The audit of runs trained in the user's own loop: monitored runs of one or more methods + their
frozen controls over the user's seeds → the same method verdicts, audit.json and report as
`creditaudit audit`.

Each run folder was written by `creditaudit.Monitor` (its diagnosis made at `finish()`); each
control by a Monitor with `control_of=` that run. A run's method is the name its Monitor recorded
(`Monitor(method=...)`); a control is paired with its run by the run id it recorded (runs of two
methods from one seed share their initial weights), so the order of the lists does not matter.
The table is the audit's own (`audit.tabulate`: (d) decided for every method together, each
method's verdict by `verdict.method_verdict`): nothing is judged here.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from .. import __version__, evidence, store
from ..errors import CreditAuditError, CreditAuditWarning
from ..methods import resolve_method_name
from ..monitor import FINISHED, MonitoredRun, control_accuracy, load_monitored
from ..monitored import test_digest
from ..runs import refuse_run_folder
from ..verdict import Thresholds
from .audit import read_audit, tabulate
from .common import Outcome

DEFAULT_METHOD = "my-method"      # the name of runs whose Monitor recorded no method=


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
    run_id: str = ""

    @property
    def recipe_record(self) -> None:
        """The optimiser and schedule of a run from the user's own loop are the user's: not known here."""
        return None

    @property
    def run_key(self) -> str:
        """Unique per run folder: runs of two methods may share their initial weights."""
        return (self.run_id or self.init_sha256)[:12]

    def to_dict(self) -> dict:
        return {"method": self.method, "seed": self.seed, "control": self.control,
                "epochs": self.epochs, "init_sha256": self.init_sha256, "source": "user-loop"}


def _beats_untrained(control: MonitoredRun, main: MonitoredRun, thresholds: Thresholds) -> bool:
    """Whether the frozen control's accuracy clears its run's untrained model (the main run's
    epoch-0 accuracy) by the (d) margin (`evidence.weakness`, without a yardstick); True when the
    untrained accuracy was not recorded (nothing to compare: the gate's other checks stand)."""
    first = main.history[0] if main.history else {}
    init, acc = first.get("test_acc"), control.test_acc
    if first.get("epoch") != 0 or init is None or acc is None:
        return True
    return acc >= init + thresholds.depth_margin


def _outcome(run: MonitoredRun, method: str, seed: int) -> Outcome:
    info = run.info
    control = info.get("control", "none")
    label = f"{method}{'/' + control if control != 'none' else ''}/s{seed}"
    config = OwnRunConfig(method, seed, control, int(info["epochs"]), info["init_sha256"], label,
                          trainable_blocks=0 if control == "frozen" else None,
                          run_id=str(info.get("run_id") or ""))
    status = run.status.get("status", "unfinished")
    message = run.status.get("message", "no status: the loop never called finish()")
    report = run.diagnosis if control == "none" else None
    return Outcome(config, run.run_dir, status, message, trained=False, test_acc=run.test_acc,
                   history=run.history, report=report)


def _one_name(name: str | None) -> str | None:
    """A rule's one name: any spelling of a built-in or of one class (PKG:CLASS) gives the same
    (`methods.resolve_method_name`); a free name of the user's loop ("my-method") stays as it is."""
    if not isinstance(name, str) or ":" not in name:
        return name
    try:
        return resolve_method_name(name)
    except CreditAuditError:
        return name


def _method_of(run: MonitoredRun, method: str | None) -> str:
    """The method a run trains: the name its Monitor recorded, else `method` (else DEFAULT_METHOD)."""
    recorded = _one_name(run.info.get("method"))
    method = _one_name(method)
    if recorded is None:
        return method or DEFAULT_METHOD
    if method is not None and method != recorded:
        raise CreditAuditError(f"{run.run_dir} records method {recorded!r}, not method={method!r}; "
                               "leave method= out (each run's Monitor(method=...) names its method)")
    return recorded


def _yardsticks(folders: Sequence[str | Path], mains: Sequence[MonitoredRun], controls: Sequence[MonitoredRun],
                seeds: dict[int, int], thresholds: Thresholds) -> dict[str, Outcome]:
    """initial weights (init_sha256) → the user's yardstick (as an Outcome: its accuracy and
    per-example record), so that it serves only the runs that start where it started: Monitor folders of frozen controls (blocks at
    init, embedding and readout each trained, finite, finished — the evidence gate's checks) that
    start from the initial weights of the runs of one seed, plan their epochs and were measured on
    their test set, their embedding and readout trained by exact gradients (backprop). Each is
    evidence itself (`evidence.gate_yardstick`): it must beat the untrained model (its run's
    epoch-0 accuracy) by the (d) margin and hold weights of its own, not a control's. How a loop
    the tool did not run trained is the user's word; that it is frozen, trained and this seed's is
    checked."""
    out: dict[str, Outcome] = {}
    for folder in folders:
        run = load_monitored(folder)
        mine = [m for m in mains if m.info.get("init_sha256") == run.info.get("init_sha256")]
        if run.info.get("control") != "frozen" or not mine:
            raise CreditAuditError(f"the yardstick {run.run_dir} is not a frozen control of any run given "
                                   "(train it under Monitor(mon.frozen_control(), ..., control_of=mon) "
                                   "from a run of that seed, its embedding and readout by backprop)")
        if run.info.get("epochs") != mine[0].info.get("epochs"):
            raise CreditAuditError(f"the yardstick {run.run_dir} plans {run.info.get('epochs')} epochs, the "
                                   f"runs of its seed {mine[0].info.get('epochs')}; train it on the same budget")
        check = run.status.get("control_check") or {}
        weights = store.load_checkpoint(run.run_dir)[1]["model"]
        # the nearest control of its seed: a control passed again as the yardstick is no yardstick
        same_seed = [c for c in controls if c.info.get("init_sha256") == run.info.get("init_sha256")]
        distance = min((evidence.weights_distance(weights, store.load_checkpoint(c.run_dir)[1]["model"])
                        for c in same_seed), default=None)
        first = mine[0].history[0] if mine[0].history else {}
        acc = evidence.gate_yardstick(evidence.ControlEvidence(
            str(run.run_dir), None, run.finished, run.test_acc, check.get("blocks_at_init"),
            check.get("embedding_moved"), check.get("readout_moved"), check.get("finite"),
            role="yardstick", test_digest=test_digest(run), run_test_digest=mine[0].info.get("test_digest"),
            check_digest=True, control_distance=distance,
            init_acc=first.get("test_acc") if first.get("epoch") == 0 else None), thresholds.depth_margin)
        seed, init = seeds[id(mine[0])], run.info["init_sha256"]
        if init in out:
            raise CreditAuditError(f"two yardsticks for the runs of seed {seed}; pass one per seed")
        out[init] = _outcome(run, "yardstick", seed)
    return out


def _one_test_set(mains: Sequence[MonitoredRun]) -> None:
    """Refuse runs measured on different test sets (their test digests differ): the audit compares
    their accuracies, and (d)'s noise floor takes one n_test for all. A run without a digest (a
    claimed accuracy, an older folder) is compared with nothing here; its control is unverified."""
    digests = {m.run_dir: test_digest(m) for m in mains}
    known = {d: r for r, d in digests.items() if d is not None}
    if len(known) > 1:
        (d1, r1), (d2, r2) = list(known.items())[:2]
        raise CreditAuditError(f"{r1} and {r2} were measured on different test sets (test digests "
                               f"{d1[:12]} and {d2[:12]}); give every run's Monitor the same test_batches")


def judge_own_runs(runs: Sequence[str | Path], controls: Sequence[str | Path] = (), *,
                   out: str | Path, n_test: int, method: str | None = None,
                   thresholds: Thresholds = Thresholds(),
                   yardsticks: Sequence[str | Path] = ()) -> dict:
    """Judge the user's monitored runs (one per method and seed) with their frozen controls, like
    an audit: one row per method, (d) decided for every method together (`audit.tabulate`).

    runs: the run folders of every method; each run's method is the name its Monitor recorded
    (`Monitor(method=...)`), or `method` (default "my-method") for runs that recorded none.
    controls: their frozen controls, each paired with its own run by the run id it recorded.
    n_test: the number of test samples every accuracy was measured on — (d)'s test-set noise floor
    (binomial), as the audit takes it from its data set; with 1–3 seeds the seed spread alone can
    look far too certain. Writes <out>/audit.json (sealed) and returns the audit as read back
    (`api.audit_own_runs` adds the report); `creditaudit check OUT` then gives the verdict as an
    exit code. A run without a finished control of its own keeps the verdict from "trustworthy".
    yardsticks: optional, one per seed — the frozen control of a run of that seed with embedding
    and readout trained by backprop under the runs' recipe (docs/PROTOCOL.md "The yardstick"); (d)
    then clears only when the runs beat both their own controls and the yardstick by the margin,
    and the control's shortfall to it is reported. Without one, a control
    that does not beat the untrained model (its run's epoch-0 accuracy) by the margin is weak.
    """
    refuse_run_folder(store.as_path(out, "out"), "audit_own_runs")
    if isinstance(n_test, bool) or not isinstance(n_test, int) or n_test < 1:
        raise CreditAuditError(f"n_test must be the number of test samples your accuracies were "
                               f"measured on (a positive integer), got {n_test!r}")
    if not isinstance(thresholds, Thresholds):
        raise CreditAuditError(f"thresholds must be a creditaudit.verdict.Thresholds, got "
                               f"{type(thresholds).__name__} (e.g. Thresholds(growth=2.0))")
    if isinstance(runs, (str, Path)) or isinstance(controls, (str, Path)) or isinstance(yardsticks, (str, Path)):
        raise CreditAuditError("runs=, controls= and yardsticks= are lists of run folders; wrap a "
                               "single one in a list")
    if not runs:
        raise CreditAuditError("audit_own_runs needs at least one run folder")
    mains = [load_monitored(r) for r in runs]
    ctrls = [load_monitored(c) for c in controls]
    _one_test_set(mains)
    method_of = {id(run): _method_of(run, method) for run in mains}
    seen: dict[tuple[str, str], Path] = {}
    seeds: dict[int, int] = {}                 # id(run) → its seed (else its place in its method)
    for i, run in enumerate(mains):
        if run.info.get("thresholds") != asdict(thresholds):
            raise CreditAuditError(f"{run.run_dir} was diagnosed with other thresholds "
                                   f"({run.info.get('thresholds')}); pass the same thresholds= here")
        if run.info.get("control") != "none":
            raise CreditAuditError(f"{run.run_dir} is a control; pass it in controls=, not runs=")
        if run.diagnosis is None and run.status.get("status") in (FINISHED, "stopped", "diverged"):
            raise CreditAuditError(f"{run.run_dir} has no diagnosis.json; its Monitor's finish() "
                                   "did not complete — call it again")
        name = method_of[id(run)]
        key = (name, run.info["init_sha256"])
        if key in seen:
            raise CreditAuditError(f"{run.run_dir} and {seen[key]} ({name}) start from the same "
                                   "initial weights: they are one seed twice")
        seen[key] = run.run_dir
        seed = run.info.get("seed")
        seeds[id(run)] = seed if seed is not None else len(
            [r for r in mains[:i] if method_of[id(r)] == name])
    outcomes = [_outcome(r, method_of[id(r)], seeds[id(r)]) for r in mains]
    methods = list(dict.fromkeys(o.config.method for o in outcomes))
    for name in methods:
        mine = [o.config.seed for o in outcomes if o.config.method == name]
        if len(set(mine)) < len(mine):
            raise CreditAuditError(f"two runs of {name} carry the same seed; give each Monitor its "
                                   "own seed=")
    by_id = {r.info.get("run_id"): r for r in mains if r.info.get("run_id")}
    controlled: dict[str, Path] = {}
    for c in ctrls:
        if c.info.get("control") != "frozen":
            raise CreditAuditError(f"{c.run_dir} is not a frozen control (train it under "
                                   "Monitor(mon.frozen_control(), ..., control_of=mon))")
        main = by_id.get(c.info.get("control_of_id"))
        if main is None:
            raise CreditAuditError(f"the frozen control {c.run_dir} was built for another run "
                                   f"({c.info.get('control_of')}), none of the runs given; pass "
                                   "its run too, or train each run's own control")
        # the evidence gate: a frozen control, its own run's, trained like it, blocks at init,
        # embedding and readout trained, finite — else refused in one line
        control_accuracy(c.run_dir, main.info)
        yardstick_given = any(load_monitored(y).info.get("init_sha256") == main.info.get("init_sha256")
                              for y in yardsticks)
        if not yardstick_given and not _beats_untrained(c, main, thresholds):
            # without a yardstick a control must beat the untrained model (its run's epoch 0) by
            # the (d) margin; one that does not is no control to clear (d) against: left out, so
            # that seed's (d) is not evaluated (the gate's `weakness`)
            warnings.warn(f"the frozen control {c.run_dir} does not beat its run's untrained model by "
                          f"the (d) margin: it is left out, so (d) is not evaluated for that seed; "
                          "train it longer, or give yardsticks=", CreditAuditWarning, stacklevel=2)
            continue
        if main.info["run_id"] in controlled:
            raise CreditAuditError(f"{c.run_dir} and {controlled[main.info['run_id']]} are both "
                                   f"controls of {main.run_dir}; pass one control per run")
        controlled[main.info["run_id"]] = c.run_dir
        outcomes.append(_outcome(c, method_of[id(main)], seeds[id(main)]))

    t0 = time.perf_counter()
    by_init = _yardsticks(yardsticks, mains, ctrls, seeds, thresholds)
    table = tabulate(methods, outcomes, thresholds, n_test,
                     yardstick_of=lambda o: by_init.get(getattr(o.config, "init_sha256", None)),
                     yardsticks_expected=bool(yardsticks))
    out = Path(out)
    per_method = "; ".join(
        f"{name} (seed{'s' if len(ss) > 1 else ''} {', '.join(map(str, ss))})"
        for name in methods for ss in [[o.config.seed for o in outcomes
                                        if o.config.method == name and o.config.control == "none"]])
    result = {
        "creditaudit_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": "user-loop",
        "header": f"your own training loop: {per_method}; controls: {'frozen' if ctrls else 'none'}",
        "config": {"methods": methods, "seeds": sorted(set(seeds.values())),
                   "runs": [str(r) for r in runs], "controls": [str(c) for c in controls],
                   **({"yardsticks": [str(y) for y in yardsticks]} if yardsticks else {})},
        "thresholds": asdict(thresholds),
        "wall_time": time.perf_counter() - t0,
        "runs_trained_now": 0,
        **table,
        "runs": [o.to_dict() for o in outcomes],
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
