"""The frozen control of a run in a user's own loop (the (d) yardstick): built from the run's
recorded initial weights with every block frozen (`frozen_control`), checked to be that run's
control when its own Monitor starts (`check_control_of`), and measured when it is sealed for
what the evidence gate reads (`control_check`). This module measures; evidence.py judges."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from . import evidence
from .adapter import Adapter, block_modules
from .errors import CreditAuditError
from .evidence import ControlEvidence
from .metrics import branch_ratios
from .model import ResidualStream
from .model.stream import parameter_roles


def frozen_control(model: torch.nn.Module, init: dict[str, torch.Tensor],
                   adapter: Adapter | None) -> torch.nn.Module:
    """A copy of `model` at the state `init` with every block parameter frozen."""
    control = copy.deepcopy(model)
    control.load_state_dict(init)
    for block in block_modules(control, adapter):
        for p in block.parameters():
            p.requires_grad_(False)
    return control


def check_control_of(model: torch.nn.Module, adapter: Adapter | None, out: Path, init_sha256: str,
                     main_dir: Path, main_info: dict, method: str | None) -> tuple[str, str, str | None]:
    """(main folder, main run id, method) once the gate admitted `model` (monitored into `out`)
    as the control of the run recorded by `main_info`, as it starts: the same initial weights,
    its blocks frozen, a run with an id; one line otherwise. The control trains next."""
    main_sha, main_id = main_info["init_sha256"], main_info.get("run_id")
    if method is not None and method != main_info.get("method"):
        raise CreditAuditError(f"method={method!r}, but {main_dir} trains "
                               f"{main_info.get('method')!r}; a control takes its run's method "
                               "(leave method= out)")
    trainable = [n for b in block_modules(model, adapter) for n, p in b.named_parameters()
                 if p.requires_grad]
    mismatch = None
    if main_sha != init_sha256:
        mismatch = (f"this model does not start from the initial weights of {main_dir}; build "
                    "the control with that Monitor's frozen_control()")
    elif trainable:
        mismatch = "its blocks still require grad; build it with mon.frozen_control(), which freezes them"
    elif main_id is None:
        mismatch = f"{main_dir} was written by an older creditaudit (no run id); monitor the run again"
    evidence.gate(evidence.Evidence(str(main_dir), None, ControlEvidence(str(out), mismatch, finished=False)))
    return str(main_dir), main_id, main_info.get("method")


def control_check(model: torch.nn.Module, init: dict[str, torch.Tensor], adapter: Adapter | None,
                  stream: ResidualStream, x: torch.Tensor) -> dict[str, bool]:
    """What a control shows the evidence gate when it is sealed: whether its block parameters
    still equal the snapshot `init`, whether the embedding and the readout each moved (two groups:
    `model.stream.parameter_roles`), whether its weights and its logits on the eval batch `x` are finite, and how far its
    blocks move the stream (`metrics.branch_ratios`, max over blocks: 0 when every block is the
    identity)."""
    in_blocks = {id(p) for b in block_modules(model, adapter) for p in b.parameters()}
    same = {n: torch.equal(p.detach().cpu(), init[n].cpu())
            for n, p in model.named_parameters() if n in init}
    ids = {n: id(p) for n, p in model.named_parameters()}
    blocks = [same[n] for n in same if ids[n] in in_blocks]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = stream.forward_from(0, stream.embed(x))
        # the embedding and the readout each its own group (evidence.py)
        roles = parameter_roles(stream, dict(model.named_parameters()), x)
        finite = all(bool(p.isfinite().all()) for p in model.parameters()) and bool(logits.isfinite().all())
        # whether its blocks are the identity (zero-initialised branches): then it is the shallow network
        ratio = max(branch_ratios(stream, x), default=None) if finite else None
    finally:
        model.train(was)
    outside = {n for n in same if ids[n] not in in_blocks}

    def moved(part: str) -> bool:
        # a part with no parameters has nothing to train (vacuously moved); with no parameter
        # outside the blocks at all, nothing trained
        mine = [n for n in roles[part] if n in outside]
        return bool(outside) and (not mine or not all(same[n] for n in mine))
    return {"blocks_at_init": all(blocks), "embedding_moved": moved("embedding"),
            "readout_moved": moved("readout"), "finite": finite, "branch_ratio": ratio}
