"""The training-time monitor, logged where researchers already look: TensorBoard.

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

Other trackers (W&B, MLflow, Lightning's loggers) get the same names from `epoch_scalars`, plus
`creditaudit/epoch` to plot them against (the Monitor's `on_epoch`, the Lightning callback).
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
