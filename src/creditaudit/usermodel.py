"""Models trained elsewhere, audited from the command line:

    creditaudit diagnose --model PKG.MODULE:FACTORY --weights FILE.safetensors --dataset NAME \\
        [--frozen-control FROZEN.safetensors] [--init-weights INIT.safetensors]

The protocol a model must follow (docs/ADD_A_METHOD.md, "Your own model"): FACTORY() takes no
arguments and returns a torch.nn.Module that exposes its residual stream, either by subclassing
`creditaudit.model.ResidualModel` or by having a `.stream()` method returning a
`creditaudit.ResidualStream` (embed, steps, readout). Its forward must accept the dataset's
prepared inputs (images (N, C, H, W) or features (N, D)) and return logits (N, C) with C the
dataset's class count; a model that does not is refused in one line before anything is measured.
Weights are read with safetensors only, so loading cannot run code.

The frozen control is the same FACTORY with its blocks left at initialisation and the rest trained;
its weights give (d). The weights at initialisation, when given, give (a′) its growth-since-init
part, and make the control checkable: its block parameters must equal the initial ones exactly, and
its embedding and its head must each differ from them, and its weights and logits must be finite
(a control that fails any is refused by the evidence gate in one line, exit 2 — passing the initial
weights, or the trained weights, as the control is caught).
Without the initial weights the control cannot be checked: (d) is then "not evaluated" (its
accuracy and gap are reported in a note, not judged), so the verdict is at best "incomplete".
Weights identical to --weights are refused as a control either way.
"""
from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import torch

from .errors import CreditAuditError
from .evidence import ControlEvidence, gate_yardstick, weights_distance
from .metrics import accuracy, branch_ratios, monitor_snapshot
from .model import ResidualStream
from .model.stream import parameter_roles
from .verdict import Thresholds



def import_factory(spec: str):
    """The callable named by PKG.MODULE:FACTORY, imported from the user's package."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CreditAuditError(f"--model must be PKG.MODULE:FACTORY, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 — any failure of the user's import is theirs to fix
        raise CreditAuditError(f"cannot import {module_name!r} for --model {spec} "
                               f"({type(err).__name__}: {err}); put its package on PYTHONPATH") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CreditAuditError(f"{spec}: {module_name} has no callable {attr!r}")
    return factory


def build_user_model(spec: str) -> torch.nn.Module:
    factory = import_factory(spec)
    try:
        model = factory()
    except Exception as err:  # noqa: BLE001
        raise CreditAuditError(f"{spec}() raised {type(err).__name__}: {err}") from None
    stream = getattr(model, "stream", None)
    if not isinstance(model, torch.nn.Module) or not callable(stream):
        raise CreditAuditError(f"{spec}() returned a {type(model).__name__}; it must return a "
                               "torch.nn.Module with a .stream() method (subclass "
                               "creditaudit.model.ResidualModel, or see docs/ADD_A_METHOD.md)")
    try:
        stream = model.stream()
    except Exception as err:  # noqa: BLE001
        raise CreditAuditError(f"{spec}(): .stream() raised {type(err).__name__}: {err}; it must return "
                               "a creditaudit.ResidualStream") from None
    if not isinstance(stream, ResidualStream):
        raise CreditAuditError(f"{spec}(): .stream() must return a creditaudit.ResidualStream, "
                               f"got {type(stream).__name__}")
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise CreditAuditError(f"{spec}() returned a model on the meta device (shapes without "
                               "values); build it on the CPU — its weights come from --weights")
    return model


def in_eval_mode(model: torch.nn.Module, spec: str) -> torch.nn.Module:
    """`model.eval()`, refused in one line when a module stays in training mode (a `train()` that
    ignores its argument): BatchNorm or dropout in training mode make every measurement depend on
    the batch it is measured on, and BatchNorm's running statistics change while it is measured."""
    model.eval()
    training = [name or type(model).__name__ for name, m in model.named_modules() if m.training]
    if training:
        raise CreditAuditError(f"{spec}(): {', '.join(training[:3])} stay{'s' if len(training) == 1 else ''} in "
                               "training mode after model.eval(); the diagnosis measures a model in "
                               "eval mode — let train(False) switch every module off training mode")
    return model


def load_weights(model: torch.nn.Module, path: str | Path, what: str = "weights") -> torch.nn.Module:
    """Load a safetensors file into `model` (strict); any mismatch is one line naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    path = Path(path)
    if path.is_dir():
        raise CreditAuditError(f"{what} file {path} is a folder; give the .safetensors file itself")
    if not path.is_file():
        raise CreditAuditError(f"{what} file {path} not found")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise CreditAuditError(f"{path} is not a readable safetensors file ({err}); save the "
                               "state_dict with safetensors.torch.save_file") from None
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        detail = " ".join(str(err).split())
        raise CreditAuditError(f"{what} in {path} do not fit the model: {detail[:300]}") from None
    return model


def check_model_fits_data(model: torch.nn.Module, spec: str, x: torch.Tensor, n_classes: int) -> None:
    """Refuse, in one line, a model whose forward (or residual stream) cannot take the dataset's
    prepared inputs or does not return (N, n_classes) logits — before any measurement needs it."""
    shape = tuple(x.shape)
    try:
        with torch.no_grad():
            logits = model(x)
            stream = model.stream()
            streamed = stream.forward_from(0, stream.embed(x))
    except NotImplementedError:
        raise CreditAuditError(f"{spec}() returned a {type(model).__name__} without a forward; "
                               "define forward(x) returning logits (N, classes)") from None
    except Exception as err:  # noqa: BLE001 — the user's forward failing on our inputs is theirs to fix
        detail = " ".join(str(err).split())[:200]
        raise CreditAuditError(f"{spec}(): the forward on the dataset's prepared inputs {shape} raised "
                               f"{type(err).__name__}: {detail}; make the model accept inputs of "
                               f"shape (N, {', '.join(map(str, shape[1:]))})") from None
    for what, out in (("forward", logits), (".stream() readout", streamed)):
        if not isinstance(out, torch.Tensor) or out.dim() != 2 or tuple(out.shape) != (shape[0], n_classes):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise CreditAuditError(f"{spec}(): its {what} returns {got} for {shape[0]} inputs, but the "
                                   f"dataset has {n_classes} classes; it must return logits "
                                   f"({shape[0]}, {n_classes})")


def _step_module(step) -> torch.nn.Module | None:
    """The module behind one residual step: the step itself, its `.block`, or a bound method's owner."""
    for candidate in (step, getattr(step, "block", None), getattr(step, "__self__", None)):
        if isinstance(candidate, torch.nn.Module):
            return candidate
    return None


def parameter_groups(model: torch.nn.Module, x: torch.Tensor | None = None) -> dict[str, set[str]] | None:
    """Parameter names of the model's blocks, embedding and head (None when the blocks' parameters
    cannot be told apart from the rest: a `.stream()` whose steps are not modules of the model).

    A ResidualModel names its embedding and head parameters; for a `.stream()` model they are the
    parameters outside the blocks that its embed (its readout) uses on the batch `x`
    (`model.stream.parameter_roles`); without `x`, everything outside the blocks counts as one
    group "embedding and head"."""
    names = {id(p): n for n, p in model.named_parameters()}
    stream = model.stream()
    modules = [_step_module(s) for s in stream.steps]
    if any(m is None or m is model for m in modules):
        modules = [_step_module(b) for b in stream.branches or []]
        if not modules or any(m is None or m is model for m in modules):
            return None
    blocks = {names[id(p)] for m in modules for p in m.parameters() if id(p) in names}
    rest = set(names.values()) - blocks
    embed_params = getattr(model, "embed_parameters", None)
    head_params = getattr(model, "head_parameters", None)
    try:
        groups = {"embedding": {names[id(p)] for p in embed_params()},
                  "head": {names[id(p)] for p in head_params()}}
    except Exception:  # noqa: BLE001 — not a ResidualModel: found through its stream
        if x is None:
            groups = {"embedding and head": rest}
        else:
            roles = parameter_roles(stream, dict(model.named_parameters()), x)
            groups = {"embedding": roles["embedding"] & rest, "head": roles["readout"] & rest}
    return {"blocks": blocks, **groups}


def control_evidence(model: torch.nn.Module, control: torch.nn.Module, init: torch.nn.Module | None,
                     control_path: str, x: torch.Tensor) -> ControlEvidence:
    """What the weights `control` show as `model`'s frozen-blocks control, for `evidence.gate`.

    Weights identical to the model's are no control (a depth gap of 0 by construction). With the
    initial weights: whether every block parameter equals init and whether the embedding and the
    head each moved. Without them (or when the blocks' parameters cannot be told apart) those stay
    unchecked and `unverified` says why. Always: whether its weights and its logits on `x` are
    finite. Measures only; the gate decides."""
    mine, theirs = dict(model.named_parameters()), dict(control.named_parameters())
    with torch.no_grad():
        finite = (all(bool(p.isfinite().all()) for p in theirs.values())
                  and bool(control(x).isfinite().all()))
    if all(torch.equal(mine[n], theirs[n]) for n in mine):
        return ControlEvidence(control_path, mismatch="it holds the same weights as --weights (a depth "
                               "gap of 0 by construction); give the weights of the model trained with its "
                               "blocks left at initialisation", finite=finite)
    groups = parameter_groups(control, x)
    if init is None:
        return ControlEvidence(control_path, finite=finite, unverified=(
            "without --init-weights its blocks cannot be checked against initialisation; give "
            "--init-weights INIT.safetensors"))
    if groups is None:
        return ControlEvidence(control_path, finite=finite, unverified=(
            "the model's .stream() steps are not modules of the model, so its block parameters "
            "cannot be compared with --init-weights; make each step an nn.Module (or its .block)"))
    start = dict(init.named_parameters())
    # a part with no parameters has nothing to train (vacuously moved); with no parameter outside
    # the blocks at all, nothing trained
    outside = set().union(*(names for part, names in groups.items() if part != "blocks"))
    moved = lambda part: bool(outside) and (not groups.get(part) or
                                            not all(torch.equal(theirs[n], start[n]) for n in groups[part]))
    return ControlEvidence(
        control_path, finite=finite, branch_ratio=max(branch_ratios(control, x), default=None) if finite else None,
        blocks_at_init=all(torch.equal(theirs[n], start[n]) for n in groups["blocks"]),
        # each of the embedding and the head its own group: a trained readout on an untouched
        # embedding is refused
        embedding_moved=moved("embedding"), readout_moved=moved("head"))


def user_model_evidence(spec: str, weights: str, data, batches, *, frozen: str | None = None,
                        init: str | None = None, device: torch.device | None = None,
                        yardstick: str | None = None, margin: float = Thresholds().depth_margin) -> dict:
    """The model and what `protocol.diagnose` needs beside it: its test accuracy, the frozen
    control's evidence (`control`: a ControlEvidence for `evidence.gate`, or None), and a two-row
    monitor history (init, now) when `init` is given. The models are put on `device`, by default
    where the data are. `yardstick`: weights of the same model, blocks at init, embedding and
    readout trained by backprop; it must pass the gate as a control would (so `init` is needed to
    check it), beat the untrained model by the (d) `margin` and hold weights of its own, not the
    control's (`evidence.gate_yardstick`); its accuracy is the control's yardstick_acc. The
    control is still checked against the untrained model (`evidence.weakness`)."""
    if yardstick and not (frozen and init):
        raise CreditAuditError("--yardstick needs --frozen-control (the control it measures) and "
                               "--init-weights (to check that its blocks are at initialisation)")
    device = data.device if device is None else device
    model = in_eval_mode(load_weights(build_user_model(spec), weights).to(device), spec)
    x, y = batches[0]
    check_model_fits_data(model, spec, x, data.n_classes)
    test_acc = accuracy(model, data.eval_batches("test", 1000))
    start = None
    if init:
        start = in_eval_mode(load_weights(build_user_model(spec), init, "initial weights").to(device), spec)
    control_ev = None
    if frozen:
        control = in_eval_mode(load_weights(build_user_model(spec), frozen, "frozen-control weights").to(device), spec)
        control_ev = dataclasses.replace(
            control_evidence(model, control, start, frozen, x),
            acc=accuracy(control, data.eval_batches("test", 1000)),
            # the untrained model's accuracy: without a yardstick, a control must beat it by the margin
            init_acc=None if start is None else accuracy(start, data.eval_batches("test", 1000)))
        if yardstick:
            yard = in_eval_mode(load_weights(build_user_model(spec), yardstick, "yardstick weights").to(device), spec)
            # the yardstick is evidence too (evidence.gate_yardstick): checked as a control is, and
            # it must beat the untrained model by the margin and not be the control's own weights
            yard_ev = dataclasses.replace(
                control_evidence(model, yard, start, yardstick, x), role="yardstick",
                acc=accuracy(yard, data.eval_batches("test", 1000)), init_acc=control_ev.init_acc,
                control_distance=weights_distance(yard.state_dict(), control.state_dict()))
            control_ev = dataclasses.replace(control_ev, yardstick_acc=gate_yardstick(yard_ev, margin))
    history = None
    if start is not None:
        history = [{"epoch": 0, "test_acc": None, **monitor_snapshot(start, x, y).to_dict()},
                   {"epoch": 1, "test_acc": test_acc, **monitor_snapshot(model, x, y).to_dict()}]
    return {"model": model, "test_acc": test_acc, "control": control_ev, "history": history}
