"""The Monitor as a PyTorch Lightning callback (the `[lightning]` extra).

    cb = CreditAuditCallback(eval_batch, out="runs/mine", adapter=Adapter(...), test_batches=test)
    lightning.Trainer(max_epochs=E, callbacks=[cb]).fit(module, loader)
    cb.report                       # the diagnosis made when fitting ended

When fitting starts the callback builds a `Monitor` on the LightningModule (planned epochs =
`trainer.max_epochs`; the module's weights then are the run's initialisation); after each training
batch it counts the step's loss (`training_step` returning the loss, or a dict with "loss"); at each
training epoch's end it records the monitor line, with the test accuracy from `test_batches`
(computed through the residual stream, so the module needs no `forward()`) or from the logged
metric `test_acc_key` (with both, the measured one is recorded and a logged one that disagrees
beyond rounding is refused); when fitting ends it seals the run. Every recorded epoch's monitor numbers
and flags go to each of the trainer's loggers (`trainer.loggers`: TensorBoardLogger, CSVLogger,
WandbLogger, MLFlowLogger, …) under the names of trackers.py, at the trainer's global step, with
`creditaudit/epoch` beside them. A StopRun (a flag held
`stop_when_flagged` epochs, or divergence) sets `trainer.should_stop`; an exception seals the run
"interrupted". `frozen_control()` gives the (d) control module, fitted under
`CreditAuditCallback(..., control_of=this_callback)`. A fit whose epochs do not see all the
training data (`fast_dev_run`, `limit_train_batches` below one epoch) is sealed "ended-early",
never "finished".
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import store
from .errors import CreditAuditError
from .monitor import Monitor, StopRun

try:
    import lightning as L
except ImportError:  # pragma: no cover — the extra is not installed
    raise CreditAuditError("the Lightning callback needs the lightning package: "
                           "pip install \"creditaudit[lightning]\"") from None


def _partial_epochs(trainer) -> str | None:
    """Why this fit's epochs do not each see all the training data (None when they do): a
    `fast_dev_run`, or `limit_train_batches` below one epoch (a fraction < 1, or fewer batches than
    the training loader holds). Such a fit is no finished run, whatever `max_epochs` says."""
    if trainer.fast_dev_run:
        return f"Trainer(fast_dev_run={trainer.fast_dev_run!r}) trains a few batches only"
    limit = trainer.limit_train_batches
    if isinstance(limit, float) and limit < 1.0:
        return f"Trainer(limit_train_batches={limit:g}) trains only part of each epoch"
    if isinstance(limit, int):
        try:
            full = len(trainer.train_dataloader)
        except TypeError:               # an iterable without a length: the limit cannot be checked
            full = None
        if full is None or limit < full:
            return (f"Trainer(limit_train_batches={limit}) trains {limit} batches of "
                    f"{'an unknown number' if full is None else full} per epoch")
    return None


class CreditAuditCallback(L.Callback):
    """Run a creditaudit `Monitor` inside `lightning.Trainer.fit` (see the module docstring).

    eval_batch, out and every keyword of `Monitor` (adapter, test_batches, diagnose_batches, seed,
    label, method, frozen_control, credit, thresholds, stop_when_flagged, on_flag, on_epoch,
    tensorboard, trackers) are passed on; control_of may be another CreditAuditCallback. test_acc_key: the
    name of a logged metric holding the test accuracy (a fraction): recorded when no test_batches
    are given, else checked against the accuracy measured on them. The trainer's loggers receive every epoch's scalars (`on_epoch` too, when given).
    """

    def __init__(self, eval_batch, out: str | Path, *, test_acc_key: str | None = None,
                 control_of: "CreditAuditCallback | Monitor | str | Path | None" = None, **monitor: Any):
        super().__init__()
        self.eval_batch, self.out, self.test_acc_key = eval_batch, store.as_path(out, "out"), test_acc_key
        self.control_of, self.kwargs = control_of, monitor
        self.monitor: Monitor | None = None

    @property
    def report(self):
        return None if self.monitor is None else self.monitor.report

    def frozen_control(self) -> torch.nn.Module:
        if self.monitor is None:
            raise CreditAuditError("frozen_control() needs the run's initial weights: fit the run first")
        return self.monitor.frozen_control()

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.monitor is not None:
            raise CreditAuditError(f"this callback already monitored a run into {self.out}; use a "
                                   "new CreditAuditCallback (with another out=) for each fit")
        epochs = trainer.max_epochs
        if epochs is None or epochs < 1:
            raise CreditAuditError("CreditAuditCallback needs Trainer(max_epochs=N): the planned "
                                   "epochs decide whether the run finished")
        control_of = self.control_of.monitor if isinstance(self.control_of, CreditAuditCallback) \
            else self.control_of
        user_on_epoch = self.kwargs.get("on_epoch")
        if user_on_epoch is not None and not callable(user_on_epoch):
            raise CreditAuditError(f"on_epoch must be a function of the epoch's scalars, got "
                                   f"{type(user_on_epoch).__name__}")

        def on_epoch(scalars: dict[str, float]) -> None:
            for logger in trainer.loggers:      # empty with Trainer(logger=False)
                logger.log_metrics(scalars, step=trainer.global_step)
            if user_on_epoch is not None:
                user_on_epoch(scalars)
        self.monitor = Monitor(pl_module, self.eval_batch, self.out, epochs=epochs,
                               control_of=control_of, **{**self.kwargs, "on_epoch": on_epoch})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is None:
            raise CreditAuditError("training_step must return the loss (or a dict with \"loss\") "
                                   "for CreditAuditCallback to record it")
        n = len(batch[1]) if isinstance(batch, (tuple, list)) and len(batch) == 2 else None
        self.monitor.step(loss, n)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.monitor.status:
            return
        partial = _partial_epochs(trainer)
        if partial is not None:
            self.monitor.partial_epochs = partial
        # the logged accuracy is a claim: with test_batches the Monitor measures its own and
        # refuses a logged one that disagrees (Monitor._test_acc)
        test_acc = trainer.callback_metrics.get(self.test_acc_key) if self.test_acc_key else None
        if test_acc is None and self.monitor.test_batches is None:
            raise CreditAuditError(f"no test accuracy for epoch {trainer.current_epoch}: give "
                                   "CreditAuditCallback test_batches=, or log it and name it "
                                   "with test_acc_key=")
        try:
            self.monitor.epoch_end(trainer.current_epoch, test_acc=test_acc)
        except StopRun:
            trainer.should_stop = True          # the folder is sealed; Lightning ends the fit

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.monitor is not None:
            self.monitor.finish()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.monitor is not None:
            self.monitor.__exit__(type(exception), exception, None)
