"""The diagnosis of a monitored run at `Monitor.finish()`: the run's training status and its
frozen control's evidence (monitored.control_evidence) go to the evidence gate, then
`protocol.diagnose` measures the model through its residual stream — the last (finite) checkpoint
when the run diverged or is diagnosed again with a control — and the sealed diagnosis.json is
written beside the run.

It reads the run through `MonitoredRun`, the few attributes a `Monitor` has, and never imports
monitor.py: the Monitor calls down into this module, never the other way round."""
from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from . import evidence, store
from .adapter import stream_of
from .monitored import DIVERGED, control_evidence
from .runs import write_diagnosis

if TYPE_CHECKING:
    from .adapter import Adapter
    from .protocol import Report
    from .verdict import Thresholds


class MonitoredRun(Protocol):
    """What the diagnosis reads of a monitored run (a `Monitor` after `finish` sealed it)."""

    model: torch.nn.Module
    adapter: "Adapter | None"
    credit: Callable | None
    out: Path
    label: str
    info: dict[str, Any]
    status: dict[str, Any]
    history: list[dict]
    epochs: int
    thresholds: "Thresholds"
    frozen_control_dir: Path | None

    @property
    def epochs_completed(self) -> int: ...


def diagnose_monitored(mon: MonitoredRun, batches: list[tuple[torch.Tensor, torch.Tensor]],
                       from_checkpoint: bool = False) -> "Report":
    """Gate the evidence of the sealed run of `mon`, diagnose it on `batches` and write it."""
    from .protocol import diagnose
    status = mon.status["status"]
    training = {"status": status, "epochs_completed": mon.epochs_completed, "epochs_planned": mon.epochs}
    control = None if mon.frozen_control_dir is None else control_evidence(mon.frozen_control_dir, mon.info)
    if control is not None and mon.history and mon.history[0].get("epoch") == 0:
        # the untrained model's accuracy (epoch 0): a control must beat it by the margin
        control = replace(control, init_acc=mon.history[0].get("test_acc"))
    admitted = evidence.gate(evidence.Evidence(mon.label, training, control,
                                               depth_margin=mon.thresholds.depth_margin))
    model = mon.model
    if status == DIVERGED or from_checkpoint:
        # the last (finite) checkpoint, as the trainer's run folder keeps it; the model in
        # memory may have changed since the run was sealed
        model = copy.deepcopy(mon.model)
        model.load_state_dict(store.load_checkpoint(mon.out)[1]["model"])
    stream = stream_of(model, mon.adapter)
    was = model.training
    model.eval()
    try:
        report = diagnose(stream, batches, method=mon.credit, frozen_acc=admitted.frozen_acc,
                          depth_unevaluated=admitted.depth_why, weak_control=admitted.weak,
                          test_acc=mon.history[-1]["test_acc"], thresholds=mon.thresholds,
                          monitor_history=mon.history, label=mon.label,
                          diverged=mon.status["message"] if status == DIVERGED else None,
                          training=training)
    finally:
        model.train(was)
    if admitted.note:                 # what the control is, when it is not what (d) assumes
        report.notes.append(admitted.note)
    write_diagnosis(mon.out, report.to_dict())
    return report
