"""Models trained elsewhere, audited from the command line:

    creditaudit diagnose --model PKG.MODULE:FACTORY --weights FILE.safetensors --dataset NAME \\
        [--frozen-control FROZEN.safetensors] [--init-weights INIT.safetensors]

The protocol a model must follow (docs/ADD_A_METHOD.md, "Your own model"): FACTORY() takes no
arguments and returns a torch.nn.Module that exposes its residual stream, either by subclassing
`creditaudit.model.ResidualModel` or by having a `.stream()` method returning a
`creditaudit.ResidualStream` (embed, steps, readout). Its forward must accept the dataset's
prepared inputs (images (N, C, H, W) or features (N, D)). Weights are read with safetensors only, so
loading cannot run code. The frozen control is the same FACTORY with its blocks left at
initialisation and the rest trained; its weights give (d). The weights at initialisation, when
given, give (a′) its growth-since-init part.
"""
from __future__ import annotations

import importlib
from pathlib import Path

import torch

from .errors import CreditAuditError
from .metrics import accuracy, monitor_snapshot
from .model import ResidualStream


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
    if not isinstance(model.stream(), ResidualStream):
        raise CreditAuditError(f"{spec}(): .stream() must return a creditaudit.ResidualStream, "
                               f"got {type(model.stream()).__name__}")
    return model


def load_weights(model: torch.nn.Module, path: str | Path, what: str = "weights") -> torch.nn.Module:
    """Load a safetensors file into `model` (strict); any mismatch is one line naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    path = Path(path)
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


def user_model_evidence(spec: str, weights: str, data, batches, *, frozen: str | None = None,
                        init: str | None = None, device: torch.device | None = None) -> dict:
    """The model and what `protocol.diagnose` needs beside it: its test accuracy, the frozen
    control's accuracy (or None), and a two-row monitor history (init, now) when `init` is given.
    The models are put on `device`, by default where the data are."""
    device = data.device if device is None else device
    model = load_weights(build_user_model(spec), weights).to(device).eval()
    test_acc = accuracy(model, data.eval_batches("test", 1000))
    frozen_acc = None
    if frozen:
        control = load_weights(build_user_model(spec), frozen, "frozen-control weights").to(device).eval()
        frozen_acc = accuracy(control, data.eval_batches("test", 1000))
    history = None
    if init:
        start = load_weights(build_user_model(spec), init, "initial weights").to(device).eval()
        x, y = batches[0]
        history = [{"epoch": 0, "test_acc": None, **monitor_snapshot(start, x, y).to_dict()},
                   {"epoch": 1, "test_acc": test_acc, **monitor_snapshot(model, x, y).to_dict()}]
    return {"model": model, "test_acc": test_acc, "frozen_acc": frozen_acc, "history": history}
