"""The training-time monitor, logged where researchers already look: TensorBoard, W&B, MLflow.

One scalar per monitor number and flag, per epoch (step = epoch; epoch 0 = at initialisation):

    creditaudit/h_norm/l{l}        median ‖h_l‖, l = 0 … L                       (a)
    creditaudit/grad_norm/l{l}     median ‖g_l‖ = ‖∂CE/∂h_l‖                     (b)
    creditaudit/max_growth         max_l ‖h_{l+1}‖/‖h_l‖                          (a)
    creditaudit/init_growth        max_l ‖h_l‖/‖h_l at epoch 0‖                   (a′)
    creditaudit/stack_growth       ‖h_L‖/‖h_0‖                                    (a′)
    creditaudit/gain               readout gain ‖g_L‖/‖∂CE/∂logits‖               (b′)
    creditaudit/test_acc, creditaudit/train_loss, creditaudit/eval_batch_acc, creditaudit/eval_batch_loss
    creditaudit/flag/{a,a_prime,b,b_prime}   1 while the flag holds at that epoch, else 0

The flags are decided by verdict.py's rules, on the same record the verdict reads. Needs the
`tensorboard` package (`pip install "creditaudit[tensorboard]"`); without it, asking for a log
is one clear error. A `SummaryWriter` of the user's own may be handed over instead of a folder.

W&B (`WandbLog`, the `wandb` extra) and MLflow (`MLflowLog`, the `mlflow` extra) get the same
names plus `creditaudit/epoch` to plot them against, the run's settings once (`run_params`: W&B
config, MLflow params, TensorBoard text), and at the end of a run its status and verdicts
(`end_tags`); so do Lightning's loggers and any `on_epoch` callback (`epoch_scalars`).

One verdict per name, so a tracker never contradicts the audit: `creditaudit/verdict` and
`creditaudit/paper_verdict` are the audit's verdicts on the run's method (its seeds pooled), given
only where an audit judged the run; `creditaudit/run_verdict` and `creditaudit/run_paper_verdict`
are this run's own diagnosis (one seed, its own control), which can differ. A control gets no
verdict: it is evidence for its run, not a claim.
Each tracker's library is imported only when that tracker is asked for. The Monitor takes tracker
objects (`trackers=`); `creditaudit audit --tracker KIND[:WHERE]` and `audit_own_runs(trackers=)`
log every judged run folder after the audit (`log_judged_runs`).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Sequence

from .errors import CreditAuditError
from .store import as_path
from .store import json_number as _num
from .verdict import (Thresholds, fires_a, fires_a_prime, fires_b, fires_b_prime, growth_since_init,
                      stack_growth)

PREFIX = "creditaudit"
MONITOR_FLAGS = ("a", "a_prime", "b", "b_prime")


def epoch_flags(row: dict, init_h_norms: Sequence | None, t: Thresholds = Thresholds()) -> dict[str, bool]:
    """Whether each monitor flag holds on one monitor record (the rules of verdict.py)."""
    h = [_num(v) for v in row["h_norms"]]
    init = [_num(v) for v in init_h_norms] if init_h_norms else None
    return {"a": fires_a(row["max_growth"], t),
            "a_prime": bool(fires_a_prime(growth_since_init(h, init), stack_growth(h), t)),
            "b": fires_b(row["g_norms"][-1], t),
            "b_prime": fires_b_prime(row["gain"], t)}


def scalars(row: dict, init_h_norms: Sequence | None, t: Thresholds = Thresholds()) -> dict[str, float]:
    """Every scalar of one monitor record under its TensorBoard name (non-finite values kept)."""
    h = [_num(v) for v in row["h_norms"]]
    out = {f"{PREFIX}/h_norm/l{l}": v for l, v in enumerate(h)}
    out.update({f"{PREFIX}/grad_norm/l{l}": _num(v) for l, v in enumerate(row["g_norms"])})
    out[f"{PREFIX}/max_growth"] = _num(row["max_growth"])
    out[f"{PREFIX}/init_growth"] = growth_since_init(h, [_num(v) for v in init_h_norms] if init_h_norms else None)
    out[f"{PREFIX}/stack_growth"] = stack_growth(h)
    out[f"{PREFIX}/gain"] = _num(row["gain"])
    for key in ("test_acc", "train_loss", "eval_batch_acc", "eval_batch_loss"):
        if row.get(key) is not None:
            out[f"{PREFIX}/{key}"] = _num(row[key])
    out.update({f"{PREFIX}/flag/{k}": float(v) for k, v in epoch_flags(row, init_h_norms, t).items()})
    return {k: v for k, v in out.items() if not math.isnan(v)}


def epoch_scalars(history: Sequence[dict], t: Thresholds = Thresholds()) -> dict[str, float]:
    """The scalars of a monitor history's last record (`scalars`, against the history's epoch-0
    record for (a′)) and its epoch as `creditaudit/epoch`: one call of a tracker per epoch."""
    init = history[0]["h_norms"] if history and int(history[0]["epoch"]) == 0 else None
    row = history[-1]
    return {**scalars(row, init, t), f"{PREFIX}/epoch": float(row["epoch"])}


def is_writer(obj) -> bool:
    """Whether `obj` is a SummaryWriter (torch's or tensorboardX's: anything with add_scalar)."""
    return callable(getattr(obj, "add_scalar", None)) and callable(getattr(obj, "flush", None))


def check_log_dir(log_dir) -> Path:
    """`log_dir` as a Path, refused in one line before any training when it cannot become a log
    folder: not a path, a file (or under one), or in a folder this process cannot write to.
    Nothing is created here, so a command refused later leaves no empty log folder behind."""
    try:
        import tensorboard  # noqa: F401 — SummaryWriter needs it; say so before training, not after
    except ImportError:
        raise CreditAuditError("TensorBoard logging needs the tensorboard package: "
                               "pip install \"creditaudit[tensorboard]\"") from None
    path = as_path(log_dir, "the TensorBoard log folder")
    existing = next(p for p in (path, *path.parents) if p.exists())   # "." or "/" at the latest
    if not existing.is_dir():
        raise CreditAuditError(f"cannot log to TensorBoard in {path}: {existing} is a file, not a "
                               "folder; give a folder for the log")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CreditAuditError(f"cannot log to TensorBoard in {path}: {existing} is not writable; "
                               "give a writable folder for the log")
    return path


class TensorBoardLog:
    """Writes monitor records to a TensorBoard log as they come (`log(history)` logs the records
    it has not seen yet, so the trainer and the Monitor can hand it the whole history).

    log_dir: a folder (a SummaryWriter is opened on it and closed by `close`), or the user's own
    SummaryWriter, which is only flushed: its owner closes it."""

    def __init__(self, log_dir, thresholds: Thresholds = Thresholds()):
        self.thresholds = thresholds
        self._logged = -1
        self._owned = not is_writer(log_dir)
        if not self._owned:
            self.writer = log_dir
            return
        self.log_dir = check_log_dir(log_dir)
        from torch.utils.tensorboard import SummaryWriter
        try:
            self.writer = SummaryWriter(log_dir=str(self.log_dir))
        except OSError as err:
            raise CreditAuditError(f"cannot log to TensorBoard in {self.log_dir} "
                                   f"({err.strerror or err}); give a writable folder") from None

    def log(self, history: Sequence[dict]) -> None:
        init = history[0]["h_norms"] if history and int(history[0]["epoch"]) == 0 else None
        for row in history:
            epoch = int(row["epoch"])
            if epoch <= self._logged:
                continue
            for name, value in scalars(row, init, self.thresholds).items():
                self.writer.add_scalar(name, value, epoch)
            self._logged = epoch
        self.writer.flush()

    __call__ = log

    def params(self, params: dict) -> None:
        """The run's settings (`run_params`) as one text at step 0."""
        import json
        self.writer.add_text(f"{PREFIX}/params", json.dumps(params, sort_keys=True, default=str), 0)

    def end(self, tags: dict[str, str], final: bool = True) -> None:
        """The run's status and verdicts (`end_tags`) as text at its last epoch, then `close`."""
        for key, text in tags.items():
            self.writer.add_text(key, text, max(self._logged, 0))
        self.close()

    def close(self) -> None:
        if self._owned:
            self.writer.close()
        else:
            self.writer.flush()


def log_history(history: Sequence[dict], log_dir: str | Path, thresholds: Thresholds = Thresholds()) -> None:
    """Write a whole finished monitor history (e.g. a run folder's metrics) to `log_dir`."""
    log = TensorBoardLog(log_dir, thresholds)
    try:
        log.log(history)
    finally:
        log.close()


def log_runs(runs: Sequence[dict], log_dir: str | Path, thresholds: Thresholds = Thresholds()) -> None:
    """Every run of an audit (audit.json's "runs") to `log_dir/<run folder name>`, from each run
    folder's metrics.jsonl (every field of every epoch; runs that never trained are skipped)."""
    import json
    for run in runs:
        metrics = Path(run["run_dir"]) / "metrics.jsonl"
        if not metrics.exists():
            continue
        history = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if history:
            log_history(history, Path(log_dir) / Path(run["run_dir"]).name, thresholds)


# -- W&B and MLflow: the same names, one tracker run per creditaudit run -------------------------
# A tracker is any object with `log(history)` (logs the records it has not seen), `end(tags)` (the
# run's status and verdict as W&B summary fields / MLflow tags, then closes what it opened; called
# again with a newer verdict, it updates them) and `close()`. TensorBoardLog, WandbLog, MLflowLog.

KINDS = ("tensorboard", "wandb", "mlflow")


def _need(module: str, extra: str, what: str):
    """Import a tracker's library when it is first asked for (never at import of creditaudit)."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise CreditAuditError(f"logging to {what} needs the {module} package: "
                               f"pip install \"creditaudit[{extra}]\"") from None


def end_tags(status: dict | None, report=None, method: dict | None = None) -> dict[str, str]:
    """What a tracker records when its run ends: the run's status; `report`: its own diagnosis,
    as `run_verdict` / `run_paper_verdict` (None for a control: it gets no verdict); `method`: the
    audit's row of the run's method, whose verdicts are `verdict` / `paper_verdict`."""
    tags = {f"{PREFIX}/status": str((status or {}).get("status", "unfinished"))}
    if report is not None:
        r = report if isinstance(report, dict) else report.to_dict()
        tags[f"{PREFIX}/run_verdict"] = str(r["verdict"])
        tags[f"{PREFIX}/run_paper_verdict"] = str(r["paper_verdict"])
    if method is not None:
        tags[f"{PREFIX}/verdict"] = str(method["verdict"])
        tags[f"{PREFIX}/paper_verdict"] = str(method["paper_verdict"])
    return tags


# what names a run in a tracker: the settings a dashboard groups runs by
PARAM_KEYS = ("method", "seed", "control", "recipe", "options", "lam", "dataset", "arch", "width",
              "blocks", "epochs", "trainable_blocks", "model", "label", "control_of")


def run_params(config: dict) -> dict[str, str | int | float | bool]:
    """A run's settings as one flat dict of plain values (W&B config, MLflow params): the
    `PARAM_KEYS` it has (a run folder's config.json, a monitored run's run.json), nested
    dicts flattened with "." (recipe.optimizer, options.lam), lists joined, None left out."""
    out: dict = {}

    def put(key, value):
        if isinstance(value, dict):
            for k, v in value.items():
                put(f"{key}.{k}", v)
        elif isinstance(value, (list, tuple)):
            out[key] = ", ".join(map(str, value))
        elif value is not None:
            out[key] = value
    for key in PARAM_KEYS:
        put(key, config.get(key))
    return out


def set_params(trackers: Sequence, params: dict) -> None:
    """The run's settings to each tracker that takes them (`params(dict)`), once."""
    for t in trackers:
        if callable(getattr(t, "params", None)):
            t.params(params)


def _takes_final(tracker) -> bool:
    """Whether a tracker's `end` takes `final` (ours do; a tracker of the user's own may not)."""
    import inspect
    try:
        return "final" in inspect.signature(tracker.end).parameters
    except (TypeError, ValueError):
        return False


def _new_rows(history: Sequence[dict], logged: int, t: Thresholds):
    """(epoch, scalars incl. creditaudit/epoch) of each record after epoch `logged`."""
    init = history[0]["h_norms"] if history and int(history[0]["epoch"]) == 0 else None
    for row in history:
        if int(row["epoch"]) > logged:
            yield int(row["epoch"]), {**scalars(row, init, t), f"{PREFIX}/epoch": float(row["epoch"])}


class WandbLog:
    """Monitor records to a Weights & Biases run: each scalar of `epoch_scalars` per epoch, plotted
    against `creditaudit/epoch`; the run's settings as its config; at the end the status and
    verdicts as summary fields.

    run: your own run (`wandb.init(...)`: logged to, never finished here); or None: a run is
    started with `wandb.init(project=, dir=, name=)` and finished at the end. With WANDB_MODE=offline
    it writes only under `dir` (upload later with `wandb sync`). An end that is not `final` (a run
    whose frozen control may still come and change its (d)) updates the summary and keeps the run
    open — finished by the final end, `close`, or at exit — so the control's verdict lands in the
    same run, not in a second folder of the same id. W&B does not capture the console
    (console="off"): another library's log lines (MLflow's) stay out of the run's output."""

    def __init__(self, run=None, *, project: str | None = None, dir: str | Path | None = None,
                 name: str | None = None, thresholds: Thresholds = Thresholds()):
        self.wandb = _need("wandb", "wandb", "Weights & Biases")
        self.thresholds, self._logged, self._owned, self._ended = thresholds, -1, run is None, False
        self._waiting = False
        self.dir = None if dir is None else str(_log_folder(dir, "Weights & Biases"))
        if run is None:
            if self.dir is not None:
                Path(self.dir).mkdir(parents=True, exist_ok=True)
            run = self.wandb.init(project=project, dir=self.dir, name=name, reinit="create_new",
                                  settings=self.wandb.Settings(silent=True, console="off"))
        self.run = run
        self.run.define_metric(f"{PREFIX}/*", step_metric=f"{PREFIX}/epoch")

    def log(self, history: Sequence[dict]) -> None:
        for epoch, values in _new_rows(history, self._logged, self.thresholds):
            self.run.log(values)
            self._logged = epoch

    __call__ = log

    def params(self, params: dict) -> None:
        self.run.config.update(params, allow_val_change=True)

    def end(self, tags: dict[str, str], final: bool = True) -> None:
        if self._ended and self._owned:      # closed early by hand: resumed by id to take the update
            self.run = self.wandb.init(id=self.run.id, project=self.run.project, dir=self.dir,
                                       name=self.run.name, resume="allow", reinit="create_new",
                                       settings=self.wandb.Settings(silent=True, console="off"))
            self._ended = False
        self.run.summary.update(tags)
        if final:
            self.close()
        elif self._owned and not self._waiting:
            import atexit
            atexit.register(self.close)      # no control came: the run ends with the process
            self._waiting = True

    def close(self) -> None:
        if self._owned and not self._ended:
            self.run.finish()
        self._ended = True


class MLflowLog:
    """Monitor records to an MLflow run: each scalar of `epoch_scalars` as a metric with
    step = epoch; at the end the status and verdicts as tags.

    run_id: a run of yours (logged to, never ended here); None: the active run
    (`with mlflow.start_run():`) when there is one and `tracking_uri` is not given, else a new run
    named `name` in `experiment` (created when missing), ended at the end. tracking_uri: e.g.
    "sqlite:///mlflow.db" (MLflow 3's local store, no server) or "http://host:5000"; default:
    MLFLOW_TRACKING_URI, else MLflow's own default. A folder store ("file:…") needs
    MLFLOW_ALLOW_FILE_STORE=true in MLflow 3. Logged through MlflowClient, so several runs can be
    open at once (a run and its control)."""

    def __init__(self, run_id: str | None = None, *, experiment: str | None = None,
                 tracking_uri: str | None = None, name: str | None = None,
                 thresholds: Thresholds = Thresholds()):
        mlflow = _need("mlflow", "mlflow", "MLflow")
        from mlflow.tracking import MlflowClient
        self.thresholds, self._logged = thresholds, -1
        active = mlflow.active_run() if run_id is None and tracking_uri is None else None
        self._owned = run_id is None and active is None
        with _mlflow_errors(tracking_uri):
            self.client = MlflowClient(tracking_uri)
            if active is not None:
                run_id = active.info.run_id
            elif run_id is None:
                exp = self.client.get_experiment_by_name(experiment or "creditaudit")
                exp_id = exp.experiment_id if exp is not None else \
                    self.client.create_experiment(experiment or "creditaudit")
                run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        self.run_id = run_id

    def log(self, history: Sequence[dict]) -> None:
        from mlflow.entities import Metric
        import time
        now = int(time.time() * 1000)
        metrics = []
        for epoch, values in _new_rows(history, self._logged, self.thresholds):
            metrics += [Metric(k, v, now, epoch) for k, v in values.items()]
            self._logged = epoch
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    __call__ = log

    def params(self, params: dict) -> None:
        """The run's settings as MLflow params (strings; logged once: MLflow keeps params fixed)."""
        from mlflow.entities import Param
        self.client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in params.items()])

    def end(self, tags: dict[str, str], final: bool = True) -> None:
        """Tags (a later end updates them; MLflow allows tags on an ended run), then `close`."""
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)
        self.close()

    def close(self) -> None:
        if self._owned:
            self.client.set_terminated(self.run_id)


class _mlflow_errors:
    """MLflow's refusal of a store (a folder store without MLFLOW_ALLOW_FILE_STORE, a bad URI) as
    one line."""

    def __init__(self, uri):
        self.uri = uri

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        from mlflow.exceptions import MlflowException
        if exc is None or not isinstance(exc, MlflowException):
            return False
        text = " ".join(str(exc).split())
        fix = ("set MLFLOW_ALLOW_FILE_STORE=true for a folder store, or use the local store "
               "sqlite:///mlflow.db" if "MLFLOW_ALLOW_FILE_STORE" in text else
               "give a tracking URI MLflow accepts, e.g. sqlite:///mlflow.db")
        raise CreditAuditError(f"cannot log to MLflow at {self.uri or 'its default store'} "
                               f"({text[:160]}); {fix}") from None


def _log_folder(path, what: str) -> Path:
    """A folder a tracker may write into, refused in one line when it cannot become one."""
    path = as_path(path, f"the {what} folder")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise CreditAuditError(f"cannot log to {what} in {path}: {existing} is "
                               f"{'a file' if not existing.is_dir() else 'not writable'}; give a "
                               "writable folder")
    return path


def as_trackers(trackers, thresholds: Thresholds | None = None) -> list:
    """The Monitor's `trackers=`: one tracker or a list of them (each with log, end, close). The
    Monitor's `thresholds` decide the flags each tracker logs, as they decide the run's verdict."""
    if trackers is None:
        return []
    items = list(trackers) if isinstance(trackers, (list, tuple)) else [trackers]
    for t in items:
        if not all(callable(getattr(t, m, None)) for m in ("log", "end", "close")):
            raise CreditAuditError(f"trackers= takes creditaudit.trackers.TensorBoardLog, WandbLog or "
                                   f"MLflowLog objects, got {type(t).__name__}")
        if thresholds is not None and isinstance(getattr(t, "thresholds", None), Thresholds):
            t.thresholds = thresholds
    return items


def log_epoch(trackers: Sequence, history: Sequence[dict]) -> None:
    for t in trackers:
        t.log(history)


def end_runs(trackers: Sequence, status: dict | None, report=None, final: bool = True) -> None:
    """Each tracker's end with the run's status and its own verdicts (`end_tags`); `final` False
    for a run whose (d) a frozen control may still change (W&B keeps that run open)."""
    tags = end_tags(status, report)
    for t in trackers:
        t.end(tags, final=final) if _takes_final(t) else t.end(tags)


# -- the command line's and audit_own_runs' trackers: KIND[:WHERE], one tracker run per run -------
def parse_tracker(text: str) -> tuple[str, str | None]:
    """"KIND[:WHERE]" → (kind, where): tensorboard:DIR, wandb[:DIR], mlflow[:TRACKING_URI]."""
    if not isinstance(text, str):
        raise CreditAuditError(f"a tracker is KIND[:WHERE] with KIND one of {', '.join(KINDS)}, got {text!r}")
    kind, _, where = text.partition(":")
    if kind not in KINDS:
        raise CreditAuditError(f"unknown tracker {kind!r} in {text!r}: use one of {', '.join(KINDS)} "
                               "(e.g. tensorboard:tb, wandb:wandb_dir, mlflow:sqlite:///mlflow.db)")
    if kind == "tensorboard" and not where:
        raise CreditAuditError(f"{text!r}: TensorBoard needs a log folder, e.g. tensorboard:tb")
    return kind, where or None


def check_trackers(specs: Sequence[str]) -> list[tuple[str, str | None]]:
    """Parse and check each tracker before any training: its library is installed, its folder can
    be written."""
    parsed = [parse_tracker(s) for s in specs]
    for kind, where in parsed:
        if kind == "tensorboard":
            check_log_dir(where)
        elif kind == "wandb":
            _need("wandb", "wandb", "Weights & Biases")
            if where is not None:
                _log_folder(where, "Weights & Biases")
        else:
            _need("mlflow", "mlflow", "MLflow")
            from mlflow.tracking import MlflowClient
            with _mlflow_errors(where):            # the store refused now, not after the audit
                MlflowClient(where).search_experiments(max_results=1)
    return parsed


def open_tracker(kind: str, where: str | None, *, run: str, project: str | None,
                 thresholds: Thresholds = Thresholds()):
    """A tracker for one run named `run` (TensorBoard: the subfolder WHERE/run; W&B: a run of
    `project` under WHERE; MLflow: a run of the experiment `project` at the tracking URI WHERE)."""
    if kind == "tensorboard":
        return TensorBoardLog(Path(where) / run, thresholds)
    if kind == "wandb":
        return WandbLog(project=project, dir=where, name=run, thresholds=thresholds)
    return MLflowLog(experiment=project, tracking_uri=where, name=run, thresholds=thresholds)


def log_judged_runs(result: dict, specs: Sequence[str], project: str | None,
                    thresholds: Thresholds = Thresholds()) -> None:
    """An audit in each tracker: one tracker run per run folder, from its metrics.jsonl, with its
    settings (`run_params`) and, at the end, its status and — a main run — the audit's verdicts on
    its method beside its own (`end_tags`; a control gets none); then one summary run of the whole
    audit (`log_audit_summary`). Runs that never trained are skipped."""
    import json
    parsed = check_trackers(specs)
    rows = {m["method"]: m for m in result.get("methods", [])}
    for run in result["runs"]:
        metrics = Path(run["run_dir"]) / "metrics.jsonl"
        if not metrics.exists():
            continue
        history = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if not history:
            continue
        main = run.get("control") == "none"
        tags = end_tags({"status": run["status"]}, run.get("report") if main else None,
                        rows.get(run["method"]) if main else None)
        params = run_params({**(run.get("config") or {}), "method": run["method"], "seed": run.get("seed"),
                             "control": run.get("control"), "label": run.get("label")})
        for kind, where in parsed:
            tracker = open_tracker(kind, where, run=Path(run["run_dir"]).name, project=project,
                                   thresholds=thresholds)
            tracker.params(params)
            tracker.log(history)
            tracker.end(tags)
    log_audit_summary(result, parsed, project)


SUMMARY_RUN = "audit-summary"


def _key(text: str) -> str:
    """A method's name as part of a tracker key (MLflow allows letters, digits, _ - . / and space)."""
    import re
    return re.sub(r"[^\w\-. /]", "_", str(text))


def log_audit_summary(result: dict, parsed: Sequence[tuple[str, str | None]], project: str | None) -> None:
    """One tracker run per audit, named `SUMMARY_RUN`: the audit's settings as its params, and at
    its end each method's verdicts (`creditaudit/verdict/<method>`, `creditaudit/paper_verdict/
    <method>`) and the count of each outcome (`creditaudit/n_walk_back`, …)."""
    from .verdict import verdict_of
    config = result.get("config") or {}
    params = {k: (", ".join(map(str, v)) if isinstance(v, (list, tuple)) else v)
              for k, v in config.items() if k in ("dataset", "methods", "seeds", "epochs", "recipe", "preset",
                                                   "controls", "runs") and v not in (None, [], "")}
    params.update({f"model.{k}": v for k, v in (config.get("model") or {}).items()})
    params["source"] = result.get("source", "audit")
    tags: dict[str, str] = {}
    counts = {"trustworthy": 0, "walk back": 0, "incomplete": 0}
    for row in result.get("methods") or []:
        name = _key(row.get("rule_name") or row["method"])
        tags[f"{PREFIX}/verdict/{name}"] = str(row["verdict"])
        tags[f"{PREFIX}/paper_verdict/{name}"] = str(row["paper_verdict"])
        try:
            counts[verdict_of(row).outcome] += 1
        except (ValueError, KeyError, TypeError):
            pass
    tags.update({f"{PREFIX}/n_{k.replace(' ', '_')}": str(v) for k, v in counts.items()})
    for kind, where in parsed:
        tracker = open_tracker(kind, where, run=SUMMARY_RUN, project=project)
        tracker.params(params)
        tracker.end(tags)
