"""The audit protocol inside the researcher's own training loop.

    mon = creditaudit.Monitor(model, eval_batch, out="runs/mine", epochs=E)   # snapshots the init
    for epoch in range(E):
        for x, y in loader:
            ...; opt.step()
            mon.step(loss, len(y))          # a device-side running sum: no host sync
        mon.epoch_end(test_acc=acc)          # the monitor line: (a), (a′), (b), (b′), accuracy
    report = mon.finish()                    # seals the run folder and diagnoses the model

Every epoch the Monitor records exactly the line `creditaudit train` records (metrics.monitor_snapshot
on one fixed eval batch, the same fields; Γ_l over training at the trainer's alignment epochs only
when `credit=` is given, and no cos(W, B): it sees no feedback weights), checkpoints the model beside its initial weights, and
reports a flag's first fire as a `FlagFired` warning (and to `on_flag`). With
`stop_when_flagged=N` it ends the run once a flag held N epochs (verdict.stop_rule) by raising
`StopRun`; a non-finite loss or stream ends it as "diverged" the same way. Inside a `with` block
a StopRun ends the block quietly (the folder is sealed); any other exception seals the run as
"interrupted".

The Monitor measures; the rest lives beside it: the folder's format, sealing and reading back
(monitored.py: a run that was not `finish`ed after all its planned epochs is never "trustworthy":
status "ended-early", "interrupted", or none at all — still training, or the script died), the
frozen control (monitor_control.py) and the diagnosis at `finish()` (monitor_diagnosis.py), which
hands the evidence to the gate (evidence.py).

The frozen control: `mon.frozen_control()` is the model at its recorded init with every block
parameter frozen; the user trains it with their own code under `Monitor(..., control_of=mon)`.
`audit_own_runs` then judges the runs and controls over the user's seeds with the audit's own
rules (verdict.method_verdict, experiments.audit.summarize_method) and writes the audit's report.
"""
from __future__ import annotations

import hashlib
import math
import numbers
import time
import uuid
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np
import torch

from . import __version__, evidence, store
from .adapter import Adapter, check_reproduces, check_residual, stream_of
from .errors import CreditAuditError, CreditAuditWarning
from .data.tensors import batches_digest
from .metrics import MonitorSnapshot, alignment_every, correctness, credit_alignment, monitor_snapshot
from .monitor_control import check_control_of, control_check, frozen_control
from .monitor_diagnosis import diagnose_monitored
# the folder's format, sealing and reading back live in monitored.py; its public names stay
# importable from here (creditaudit.load_monitored, monitor.control_accuracy, ...)
from .monitored import (DIVERGED, ENDED_EARLY, FINISHED, INTERRUPTED, RUN_FILE, RUN_FILES,  # noqa: F401
                        SOURCE, STOPPED, MonitoredRun, StoredDiagnosis, control_accuracy,
                        control_evidence, is_user_loop_run, load_monitored, read_run_info, seal,
                        stored_diagnosis)
from .verdict import FLAG_NAMES, Thresholds, first_fire_epochs, stop_rule

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

# the fields of a monitor line the monitor measures (train._record's): user logs never overwrite them
MEASURED_FIELDS = ("epoch", "train_loss", "test_acc", "test_digest", "wall_time", "gamma", "weight_alignment",
                   *MonitorSnapshot([], [], 0.0, 0.0, 0.0, 0.0).to_dict())


class FlagFired(CreditAuditWarning):
    """A monitor flag ((a), (a′), (b) or (b′)) fired for the first time in this run."""


class StopRun(CreditAuditError):
    """The monitored run has ended: a flag held `stop_when_flagged` epochs (status "stopped") or
    the loss/stream went non-finite (status "diverged"). The folder is already sealed; stop
    training. `status` and `message` say which."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter and buffer, kept in host memory (not the accelerator's)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict's names, dtypes, shapes and bytes (identifies an initialisation)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _device_of(model: torch.nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _batch(batch, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        raise CreditAuditError(f"{what} must be a pair of tensors (x, y), got {type(batch).__name__}")
    x, y = batch
    if x.dim() == 0 or len(x) != len(y) or len(y) == 0:
        raise CreditAuditError(f"{what}: x has shape {tuple(x.shape)} and y {tuple(y.shape)}; give a "
                               "batch of samples with one label per sample")
    if y.dim() != 1 or y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
        raise CreditAuditError(f"{what}: y must be a 1-D tensor of integer class indices, got shape "
                               f"{tuple(y.shape)} and dtype {y.dtype} (e.g. y.long() for float labels)")
    if x.is_meta or y.is_meta:
        raise CreditAuditError(f"{what} is on the meta device (shapes without values); pass real tensors")
    if (x.is_floating_point() or x.is_complex()) and not bool(torch.isfinite(x).all()):
        raise CreditAuditError(f"{what}: x holds NaN or ±inf; the monitor measures on it, so a "
                               "non-finite input would read as a diverged run — give finite inputs")
    return x, y


def _check_model(model) -> None:
    """What the monitor's measurements need of the model: a module with real float32/float64
    weights (the monitor line is measured in the model's own precision, and the (b) floor is
    float32's)."""
    if not isinstance(model, torch.nn.Module):
        raise CreditAuditError(f"Monitor needs a torch.nn.Module, got {type(model).__name__}")
    state = list(model.parameters()) + list(model.buffers())
    if any(t.is_meta for t in state):
        raise CreditAuditError("the model is on the meta device (shapes without values); "
                               "materialise it (model.to_empty(device=...) and load or init the "
                               "weights) before monitoring it")
    low = sorted({str(t.dtype) for t in state if t.is_floating_point()
                  and t.dtype not in (torch.float32, torch.float64)})
    if low:
        raise CreditAuditError(f"the model's weights are {', '.join(low)}; the Monitor measures in "
                               "float32 or float64 — keep float32 weights and train in mixed "
                               "precision with torch.autocast")


# a claimed accuracy may differ from the measured one by rounding to two decimals (0.69 for 0.686)
ACC_ROUNDING = 0.005


def real_number(value, what: str) -> float:
    """A plain float from a number the user hands in — a Python int/float, a numpy scalar, or a
    one-element numpy array or tensor (e.g. a torchmetrics result) — or one line naming `what`."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        size = value.numel() if isinstance(value, torch.Tensor) else value.size
        if size != 1:
            raise CreditAuditError(f"{what} must be one number, got a {type(value).__name__} of "
                                   f"shape {tuple(value.shape)} (reduce it, e.g. .mean())")
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise CreditAuditError(f"{what} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def _loss_value(loss) -> torch.Tensor:
    """`step`'s loss as a 0-d tensor (kept on its device: no host sync), or one clear line."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1 or loss.is_complex():
            raise CreditAuditError(f"step(loss): loss must be the batch's mean loss, one number; got "
                                   f"a tensor of shape {tuple(loss.shape)} (reduce it, e.g. loss.mean())")
        return loss.detach().reshape(()).float() if not loss.is_floating_point() else loss.detach().reshape(())
    if isinstance(loss, bool) or not isinstance(loss, numbers.Real):
        raise CreditAuditError(f"step(loss): loss must be the batch's mean loss (a tensor or a "
                               f"number), got {type(loss).__name__}")
    return torch.tensor(float(loss))


class Monitor:
    """The training-time monitor for a user's own loop, writing a sealed creditaudit run folder.

    model:            the network being trained (its initial weights are snapshot now).
    eval_batch:       (x, y), the fixed batch of the monitor; use 128 held-out samples (the (b)
                      floor assumes a mean over 128), e.g. `data.eval_batch(0)`.
    out:              the run folder (refused if it holds a run already).
    epochs:           how many epochs the loop will train; fewer by `finish()` = "ended-early".
    adapter:          how to reach the residual stream of a model that is not a creditaudit class;
                      its stream must reproduce model(eval x) to 1e-5 + 1e-4·|logit| (float32;
                      adapter.check_reproduces), else the Monitor refuses in one line.
    test_batches:     iterable of (x, y): the Monitor measures the test accuracy on them and records
                      what it measured (a claimed `epoch_end(test_acc=)` must agree to rounding).
    diagnose_batches: eval batches of the final diagnosis (the protocol wants K ≥ 8 disjoint
                      batches of 128); default [eval_batch].
    seed, label:      recorded; the label names the run in reports.
    method:           the name of the method this run trains, recorded: `audit_own_runs` makes one
                      row per method (a control takes its run's).
    control_of:       this run is the frozen control of that Monitor (or its run folder).
    frozen_control:   a finished control's run folder, so `finish` can judge (d).
    credit:           fn(x, y) -> [a_0 … a_L], the method's credit, for Γ in the diagnosis.
    stop_when_flagged: end the run (StopRun) once (a), (a′) or (b′) held this many epochs.
    on_flag:          callback(flag, epoch, record) at each flag's first fire.
    on_epoch:         callback(scalars) after each recorded epoch (epoch 0 = the init): every
                      monitor number and flag under its tracker name, plus `creditaudit/epoch`
                      (trackers.epoch_scalars) — e.g. `wandb.log`, or `mlflow.log_metrics`.
    tensorboard:      a log folder, or your own SummaryWriter (flushed, never closed here): every
                      monitor scalar and flag, per epoch (trackers.py).
    trackers:         trackers.TensorBoardLog / WandbLog / MLflowLog (one or a list): every
                      monitor scalar and flag per epoch, the status and verdict at the end.
    threads:          torch's CPU thread count for your loop, as `creditaudit` commands set it
                      (threads.guard_threads): "auto" (default) lowers torch's count to the cores
                      the machine's load leaves idle, with a CreditAuditWarning saying so (a busy
                      machine at every core can run a small model 20× slower); N sets N; None
                      leaves torch's setting alone.
    """

    def __init__(self, model: torch.nn.Module, eval_batch, out: str | Path, *, epochs: int,
                 adapter: Adapter | None = None, test_batches: Iterable | None = None,
                 diagnose_batches: Sequence | None = None, seed: int | None = None,
                 label: str | None = None, method: str | None = None,
                 control_of: "Monitor | str | Path | None" = None,
                 frozen_control: str | Path | None = None,
                 credit: Callable | None = None, thresholds: Thresholds = Thresholds(),
                 stop_when_flagged: int | None = None,
                 on_flag: Callable[[str, int, dict], None] | None = None,
                 on_epoch: Callable[[dict[str, float]], None] | None = None,
                 tensorboard: "str | Path | SummaryWriter | None" = None, trackers=None,
                 threads: int | str | None = "auto"):
        _check_model(model)
        out = store.as_path(out, "out")
        if not isinstance(thresholds, Thresholds):
            raise CreditAuditError(f"thresholds must be a creditaudit.verdict.Thresholds, got "
                                   f"{type(thresholds).__name__} (e.g. Thresholds(growth=2.0))")
        for name, value in (("test_batches", test_batches), ("diagnose_batches", diagnose_batches)):
            if value is not None and not isinstance(value, Iterable):
                raise CreditAuditError(f"{name} must be an iterable of (x, y) batches, got "
                                       f"{type(value).__name__}")
        if control_of is not None and not isinstance(control_of, Monitor):
            store.as_path(control_of, "control_of")       # a Monitor or the main run's folder
        if tensorboard is not None:        # refused before the run folder is written
            from .trackers import check_log_dir, is_writer
            if not is_writer(tensorboard):
                check_log_dir(tensorboard)
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise CreditAuditError(f"epochs must be the number of epochs your loop trains (≥ 1), got {epochs!r}")
        if stop_when_flagged is not None and (isinstance(stop_when_flagged, bool) or
                                              not isinstance(stop_when_flagged, int) or stop_when_flagged < 1):
            raise CreditAuditError(f"stop_when_flagged must be ≥ 1 epoch, got {stop_when_flagged!r}")
        if method is not None and (not isinstance(method, str) or not method.strip()):
            raise CreditAuditError(f"method must name your method (a non-empty string), got {method!r}")
        if on_epoch is not None and not callable(on_epoch):
            raise CreditAuditError(f"on_epoch must be a function of the epoch's scalars, got "
                                   f"{type(on_epoch).__name__}")
        self.model, self.adapter, self.out = model, adapter, Path(out)
        self.on_epoch = on_epoch
        from . import trackers as _trackers
        self._trackers = _trackers.as_trackers(trackers, thresholds)
        self.epochs, self.thresholds, self.on_flag, self.credit = epochs, thresholds, on_flag, credit
        self.x, self.y = _batch(eval_batch, "eval_batch")
        floats = [p for p in model.parameters() if p.is_floating_point()]
        if floats and self.x.is_floating_point():    # float64 inputs to a float32 model: its precision
            self.x = self.x.to(floats[0].dtype)
        # a one-shot iterator would be empty from the second epoch on: keep its batches
        self.test_batches = list(test_batches) if test_batches is not None and \
            iter(test_batches) is test_batches else test_batches
        self._test_digest: str | None = None       # of the test batches last measured on
        self.diagnose_batches = [_batch(b, "each of diagnose_batches") for b in diagnose_batches] \
            if diagnose_batches is not None else None
        self.stream = stream_of(model, adapter)
        dev = _device_of(model)
        was_training = model.training
        model.eval()
        try:
            evidence.check_depth(self.stream.n_blocks)
            check_residual(self.stream, self.x.to(dev), self.y.to(dev))
            check_reproduces(model, self.stream, self.x.to(dev), adapter)    # the adapter proves itself
        finally:
            model.train(was_training)
        self._stop = stop_rule(stop_when_flagged, thresholds)
        self.frozen_control_dir = store.as_path(frozen_control, "frozen_control") \
            if frozen_control is not None else None

        existing = [n for n in RUN_FILES if (self.out / n).exists()]
        if existing:
            raise CreditAuditError(f"{self.out} already holds a run ({', '.join(existing)}); choose "
                                   "another out= or delete that folder (nothing in it was changed)")
        self.init = _state(model)
        self.init_sha256 = state_sha256(self.init)
        self.control_of, self._main, main_id = None, None, None
        if control_of is not None:
            self.control_of, main_id, method = self._check_control(control_of, method)
        self.label = label or self.out.name
        self.info = {"source": SOURCE, "creditaudit_version": __version__, "label": self.label,
                     "seed": seed, "method": method, "epochs": epochs, "model": type(model).__name__,
                     "adapter": adapter.describe() if adapter is not None else None,
                     "n_blocks": self.stream.n_blocks, "init_sha256": self.init_sha256,
                     "control": "frozen" if self.control_of else "none",
                     "control_of": self.control_of, "run_id": uuid.uuid4().hex,
                     "control_of_id": main_id,
                     "stop_when_flagged": stop_when_flagged, "thresholds": asdict(thresholds)}
        _trackers.set_params(self._trackers, _trackers.run_params(self.info))   # once, before epoch 0
        from .threads import guard_threads
        advice = guard_threads(threads)
        if advice:
            warnings.warn(f"creditaudit.Monitor: {advice}", CreditAuditWarning, stacklevel=2)
        self.history: list[dict] = []
        self.status: dict[str, Any] = {}
        # set by an integration whose epochs do not see all the training data (Lightning's
        # fast_dev_run, limit_train_batches < 1 epoch): why, so `finish` never calls it finished
        self.partial_epochs: str | None = None
        self.report = None
        self._epoch_offset: int | None = None
        self._steps = 0
        self._loss_sum: torch.Tensor | None = None
        self._count = 0
        self._fired: dict[str, int | None] = {}
        self._t0 = time.perf_counter()
        self._tb = None
        if tensorboard is not None:
            from .trackers import TensorBoardLog
            self._tb = TensorBoardLog(tensorboard, thresholds)
        first = self._record(0, None, None, {})     # measured before anything is written: a
        # the run's test set (None without test_batches: its accuracies are the user's claim); a
        # control is compared with its run on it (monitored.control_evidence)
        self.info["test_digest"] = first["test_digest"]
        try:                                         # refusal here leaves no run.json behind
            self.out.mkdir(parents=True, exist_ok=True)
            store.atomic_write_json(self.out / RUN_FILE, self.info)
        except OSError as err:
            raise CreditAuditError(f"cannot write to {self.out} ({err.strerror or err}); choose a "
                                   "writable out=") from None
        self._append(first)

    # -- the frozen control (monitor_control.py) -----------------------------------------------
    def _check_control(self, main: "Monitor | str | Path", method: str | None) -> tuple[str, str, str | None]:
        """The main run this control belongs to (its folder, run id and method), after the gate
        admitted this model as that run's control as it starts (monitor_control.check_control_of)."""
        if isinstance(main, Monitor):
            main_dir, main_info = main.out, main.info
            self._main = main
        else:
            main_dir = Path(main)
            main_info = read_run_info(main_dir)
        return check_control_of(self.model, self.adapter, self.out, self.init_sha256, main_dir,
                                main_info, method)

    def frozen_control(self) -> torch.nn.Module:
        """A copy of the model at this run's initial weights (every parameter and buffer) with
        every block parameter frozen (requires_grad False): the (d) control, trained like the run
        by the user's own code under `Monitor(control, ..., control_of=this_monitor)`. Build its
        optimizer from the parameters that require grad."""
        return frozen_control(self.model, self.init, self.adapter)

    # -- the loop ------------------------------------------------------------------------------
    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            if not self.status:
                self.finish()
            return False
        if isinstance(exc, StopRun) and self.status:
            return True                     # the run ended on purpose; its folder is sealed
        if not self.status:
            self._seal(INTERRUPTED, f"the training loop raised {exc_type.__name__} at epoch "
                                    f"{self.epochs_completed}")
            from .trackers import end_runs
            end_runs(self._trackers, self.status)
        return False

    def end_trackers(self) -> None:
        """End the trackers' runs now. A finished run without its frozen control keeps its W&B run
        open for the control's (d) — until that control finishes, or the process exits; call this
        to end it sooner (a control finishing later then resumes it by id)."""
        for t in self._trackers:
            t.close()

    @property
    def epochs_completed(self) -> int:
        return int(self.history[-1]["epoch"]) if self.history else 0

    def step(self, loss, n: int | None = None) -> None:
        """Count one training step. `loss` is the batch's mean loss (a tensor is kept on its
        device: no host sync); `n` its number of samples, so the epoch's train loss is the
        per-sample mean exactly as `creditaudit train` records it."""
        self._check_open()
        if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral) or n <= 0):
            raise CreditAuditError(f"step(loss, n): n is the batch's number of samples, a positive "
                                   f"integer (e.g. len(y)), got {n!r}")
        weight = 1 if n is None else int(n)
        value = _loss_value(loss)
        if self._loss_sum is None:
            self._loss_sum = torch.zeros((), device=value.device, dtype=value.dtype)
        self._loss_sum += value * weight
        self._count += weight
        self._steps += 1

    def epoch_end(self, epoch: int | None = None, test_acc: float | None = None,
                  **logs: float) -> dict:
        """Record the monitor line of the epoch that just ended; returns it.

        epoch:    your loop's epoch index, 0- or 1-based (checked for skips and repeats); None =
                  counted here. test_acc: the headline accuracy as a fraction (a number, numpy
                  scalar or one-element tensor); with `test_batches` the Monitor measures it
                  itself and records that, refusing a test_acc that disagrees beyond rounding
                  (±0.005). logs: extra numbers for the line (each one number).
        Raises StopRun when the run ended here (diverged, or a flag held `stop_when_flagged`).
        """
        self._check_open()
        logs = {k: real_number(v, f"epoch_end({k}=...)") for k, v in logs.items()}
        clash = sorted(set(logs) & set(MEASURED_FIELDS))
        if clash:
            raise CreditAuditError(f"epoch_end() logs {', '.join(clash)}, which the monitor measures "
                                   "itself; give your numbers other names (e.g. my_" + clash[0] + ")")
        k = self.epochs_completed + 1
        if self._steps == 0:
            raise CreditAuditError(f"epoch_end() for epoch {k} came before any step(): call "
                                   "mon.step(loss) after each optimizer step of the epoch")
        if epoch is not None:
            if self._epoch_offset is None:
                if epoch not in (k - 1, k):
                    raise CreditAuditError(f"epoch_end(epoch={epoch}) but this is the monitor's "
                                           f"epoch {k}; pass your loop's epoch counter (0- or 1-based)")
                self._epoch_offset = k - epoch
            if epoch + self._epoch_offset != k:
                raise CreditAuditError(f"epoch_end(epoch={epoch}) does not follow epoch "
                                       f"{k - 1 - self._epoch_offset}: call epoch_end once per epoch")
        if k > self.epochs:
            raise CreditAuditError(f"epoch {k} is beyond the epochs={self.epochs} this Monitor was "
                                   "told; pass the loop's real epoch count (the run so far is kept)")
        test_acc = self._test_acc(test_acc)
        train_loss = float(self._loss_sum) / max(self._count, 1)   # the epoch's one host sync
        self._steps, self._loss_sum, self._count = 0, None, 0
        record = self._record(k, train_loss, test_acc, logs)
        finite = lambda v: isinstance(v, (int, float)) and math.isfinite(v)
        if not (finite(train_loss) and all(finite(v) for v in record["h_norms"])):
            bad = store.json_safe(record)
            message = (f"non-finite values at epoch {k} (train loss {train_loss}, ‖h_l‖ "
                       f"{bad['h_norms']}); kept the checkpoint of epoch {k - 1}")
            self._seal(DIVERGED, message, record["wall_time"])
            self.finish()
            warnings.warn(FlagFired(f"{self.label}: training diverged — {message}"), stacklevel=2)
            raise StopRun(DIVERGED, f"{self.label}: {message}")
        self._append(record)
        message = self._stop(self.history) if self._stop is not None else None
        if message:
            self._seal(STOPPED, message)
            self.finish()
            raise StopRun(STOPPED, f"{self.label}: {message}")
        return record

    def finish(self, frozen_control: str | Path | None = None):
        """Seal the run ("finished" after all planned epochs, else "ended-early") and diagnose it
        (protocol.diagnose on `diagnose_batches`, with the monitor history for first fires and
        (a′), and the frozen control's accuracy for (d) when a control folder was given here or
        to the Monitor). Writes diagnosis.json and returns the Report. Called again with a
        control, it re-diagnoses the run's last checkpoint with (d). A control monitored with
        `control_of=` this Monitor calls that itself when it finishes."""
        if not self.status:
            done = self.epochs_completed
            if self.partial_epochs is not None:
                self._seal(ENDED_EARLY, f"{self.partial_epochs}: no epoch saw all the training data, "
                                        "so this is not a finished run")
            elif done >= self.epochs:
                self._seal(FINISHED, f"trained {self.epochs} epochs in the user's loop")
            else:
                self._seal(ENDED_EARLY, f"finish() after {done} of {self.epochs} planned epochs")
        again = frozen_control is not None and self.report is not None
        if frozen_control is not None:
            control_accuracy(frozen_control, self.info)     # refused here: the run keeps its old (d)
            self.frozen_control_dir = Path(frozen_control)
        if self.report is None or again:
            self.report = self._diagnose(from_checkpoint=again)
            main = self._main
            from .trackers import end_runs
            # a control is evidence for its run, not a claim: no verdict of its own in a tracker;
            # a finished run without its control yet may still gain (d): its W&B run stays open
            control = self.info["control"] != "none"
            end_runs(self._trackers, self.status, None if control else self.report,
                     final=control or self.frozen_control_dir is not None
                     or self.status["status"] != FINISHED)
            if main is not None and self.status["status"] == FINISHED and main.report is not None:
                main.finish(frozen_control=self.out)     # the run this controls gains its (d)
        return self.report

    # -- internals -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.status:
            raise CreditAuditError(f"the run in {self.out} has ended ({self.status['status']}); "
                                   "start a new Monitor with another out= to train further")

    def _test_acc(self, test_acc) -> float:
        """The epoch's test accuracy: measured on `test_batches` when the Monitor has them (a
        claimed `test_acc` must then agree with it to rounding, `ACC_ROUNDING`), else the claimed
        one, checked to be a fraction."""
        claimed = None if test_acc is None else real_number(test_acc, "test_acc")
        if claimed is not None and not 0 <= claimed <= 1:
            raise CreditAuditError(f"test_acc must be a fraction in [0, 1], got {test_acc!r}")
        if self.test_batches is None:
            if claimed is None:
                raise CreditAuditError("epoch_end() needs the test accuracy: pass test_acc=... "
                                       "or give the Monitor test_batches=")
            return claimed
        measured = self._measure_test_acc()
        if claimed is not None and abs(claimed - measured) > ACC_ROUNDING:
            raise CreditAuditError(f"epoch_end(test_acc={claimed:.4g}), but the Monitor measured "
                                   f"{measured:.4f} on its test_batches; it records what it "
                                   "measures — leave test_acc out, or measure it on the same batches")
        return measured

    def _measure_test_acc(self) -> float:
        was = self.model.training
        self.model.eval()
        dev = _device_of(self.model)
        # through the stream, as every other measurement: a module needs no forward() of its own
        logits = lambda x: self.stream.forward_from(0, self.stream.embed(x))
        try:
            batches = list(self.test_batches)
            # what this accuracy was measured on: a control is compared on the same test set only
            self._test_digest = batches_digest(batches)
            with torch.no_grad():
                correct = correctness(logits, ((x.to(dev), y.to(dev)) for x, y in batches))
            # one bit per test example beside the accuracy (store.pack_correct): (d)'s variance
            # over the shared test set reads it (depth.py)
            self._last_correct = store.pack_correct(correct.numpy())
            return int(correct.sum()) / max(len(correct), 1)
        except Exception as err:  # noqa: BLE001 — a batch the model cannot take is the caller's
            raise CreditAuditError(f"the test accuracy on test_batches failed ({type(err).__name__}: "
                                   f"{' '.join(str(err).split())[:200]}); give (x, y) batches the "
                                   "model takes, like eval_batch") from None
        finally:
            self.model.train(was)

    def _record(self, epoch: int, train_loss, test_acc, logs: dict) -> dict:
        """The trainer's metrics line (train._record's fields) for the user's model."""
        was = self.model.training
        self.model.eval()
        dev = _device_of(self.model)
        align = {}
        try:
            snap = monitor_snapshot(self.stream, self.x.to(dev), self.y.to(dev))
            # with a credit function, Γ_l over training as the trainer records it: every k-th
            # epoch, under a forked RNG (probing never changes the user's run)
            if self.credit is not None and all(math.isfinite(v) for v in snap.h_norms) and (
                    epoch in (0, self.epochs) or epoch % alignment_every(self.epochs) == 0):
                with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
                    credit = self.credit(self.x.to(dev), self.y.to(dev))
                gamma = credit_alignment(self.stream, credit, self.x.to(dev), self.y.to(dev))
                if gamma is None:         # refused at the first line, not after the user's training
                    raise CreditAuditError(f"credit must return [a_0, …, a_L]: {len(snap.h_norms)} "
                                           "tensors shaped like h_0 … h_L on the eval batch")
                align = {"gamma": gamma}
        finally:
            self.model.train(was)
        if epoch == 0 and test_acc is None and self.test_batches is not None:
            test_acc = self._measure_test_acc()
        # the digest of the batches test_acc was measured on (None: a claimed accuracy)
        digest = self._test_digest if self.test_batches is not None and test_acc is not None else None
        if epoch > 0 and digest != self.info.get("test_digest"):
            raise CreditAuditError("test_batches changed during the run (they hold other samples or "
                                   "labels than at its start): every accuracy of a run is measured on "
                                   "one test set — give the Monitor a fixed list of test batches")
        correct = getattr(self, "_last_correct", None) if digest is not None else None
        self._last_correct = None
        return {"epoch": epoch, "train_loss": train_loss, "test_acc": test_acc, "test_digest": digest,
                **snap.to_dict(), **align,
                **logs, "wall_time": time.perf_counter() - self._t0,
                **({"test_correct": correct} if correct is not None else {})}

    def _append(self, record: dict) -> None:
        self.history.append(record)
        try:
            store.save_checkpoint(self.out, record["epoch"], {
                "model": self.model.state_dict(), "init": self.init, "history": self.history},
                {"label": self.label, "source": SOURCE}, self.info)
            store.write_metrics(self.out, self.history)
        except OSError as err:
            kept = record["epoch"] - 1
            raise CreditAuditError(f"cannot write to {self.out} ({err.strerror or err}); the "
                                   f"checkpoint of epoch {kept} is kept") from None
        if self._tb is not None:
            self._tb.log(self.history)
        from .trackers import log_epoch
        log_epoch(self._trackers, self.history)
        if self.on_epoch is not None:
            from .trackers import epoch_scalars
            self.on_epoch(epoch_scalars(self.history, self.thresholds))
        self._report_first_fires(record)

    def _report_first_fires(self, record: dict) -> None:
        fired = first_fire_epochs(self.history, self.thresholds)
        for key, epoch in fired.items():
            if epoch is not None and self._fired.get(key) is None:
                cause = ("" if epoch != 0 else
                         "; it fired at epoch 0, before any training: a likely cause is the adapter "
                         "(does it describe the model? blocks that add their own skip need "
                         "Adapter(skip=False))" if self.adapter is not None else
                         "; it fired at epoch 0, before any training: the model's initialisation "
                         "(or its .stream()) is the likely cause")
                warnings.warn(FlagFired(f"{self.label}: {FLAG_NAMES[key]} fired at epoch {epoch} "
                                        f"(‖h_L‖ {record['h_norms'][-1]:.3g}, ‖g_L‖ "
                                        f"{record['g_norms'][-1]:.3g}, gain {record['gain']:.3g}){cause}"),
                              stacklevel=4)
                if self.on_flag is not None:
                    self.on_flag(key, epoch, record)
        self._fired = fired

    def _seal(self, status: str, message: str, wall: float | None = None) -> None:
        last = self.history[-1]
        self.status = {"status": status, "message": message, "epochs_completed": last["epoch"],
                       "epochs_planned": self.epochs, "test_acc": last["test_acc"],
                       "test_digest": last.get("test_digest"),
                       "wall_time": last["wall_time"] if wall is None else wall,
                       "source": SOURCE, "checkpoint": store.checkpoint_digest(self.out)}
        if self.info["control"] == "frozen":       # measured here; the gate judges it (evidence.py)
            self.status["control_check"] = control_check(self.model, self.init, self.adapter,
                                                         self.stream, self.x.to(_device_of(self.model)))
        seal(self.out, self.status)
        if self._tb is not None:
            self._tb.close()

    def _diagnose(self, from_checkpoint: bool = False):
        batches = self.diagnose_batches or [(self.x, self.y)]
        dev = _device_of(self.model)
        return diagnose_monitored(self, [(x.to(dev), y.to(dev)) for x, y in batches], from_checkpoint)
