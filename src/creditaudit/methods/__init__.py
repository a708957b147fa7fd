"""Credit-assignment methods, by name. Adding one: a new file with a `Method` subclass, and its class
in `_BUILT_IN` below; every list of methods elsewhere (presets, --help, validation) comes from here."""
from __future__ import annotations

import importlib
from typing import Any

from ..errors import CreditAuditError
from .base import Method, MethodSettings
from .bp import BP
from .bridges import CreditBridge, StateBridge
from .dfa import DFA, DFAPenalty
from .drtp import DRTP
from .ep import EP
from .fa import FA
from .kolen_pollack import KolenPollack
from .local import LocalMethod, output_error, rms_normalise
from .local_losses import LocalLosses
from .node_perturbation import NodePerturbation
from .pepita import PEPITA
from .predictive_coding import PredictiveCoding
from .signsym import SignSymmetry

# the paper's seven first (`Method.paper`), then the zoo (issue 24)
_BUILT_IN: tuple[type[Method], ...] = (BP, FA, DFA, DFAPenalty, EP, StateBridge, CreditBridge,
                                       SignSymmetry, KolenPollack, DRTP, NodePerturbation,
                                       LocalLosses, PEPITA, PredictiveCoding)
METHODS: dict[str, type[Method]] = {cls.name: cls for cls in _BUILT_IN}
REFERENCE_METHOD = BP.name        # the method every other is compared with (Γ = 1 by construction)


def method_class(name: str) -> type[Method]:
    """The class of a built-in method, or of a user's method given as PKG.MODULE:CLASS (imported
    from the user's own package, which must be importable, e.g. on PYTHONPATH)."""
    if name in METHODS:
        return METHODS[name]
    if isinstance(name, str) and ":" in name:
        return _user_method(name)
    raise CreditAuditError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}, "
                           "or give your own as PKG.MODULE:CLASS")


def resolve_method_name(name: str) -> str:
    """`name` checked: a built-in name, or PKG.MODULE:CLASS naming a Method subclass."""
    method_class(name)
    return name


def _user_method(spec: str) -> type[Method]:
    module_name, _, class_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 — any import failure of user code is the user's to fix
        raise CreditAuditError(f"cannot import {module_name!r} for method {spec!r} "
                               f"({type(err).__name__}: {err}); put its package on PYTHONPATH") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise CreditAuditError(f"{spec!r} is not a creditaudit Method subclass; subclass "
                               "creditaudit.methods.Method (docs/ADD_A_METHOD.md)")
    if not cls.name:
        raise CreditAuditError(f"{spec!r}: set a class attribute name = \"...\" on the method")
    return cls


def methods_with_option(option: str) -> list[str]:
    """The methods that declare `option` (e.g. the penalty λ, "lam")."""
    return [name for name, cls in METHODS.items() if option in cls.option_defaults]


def sweep_defaults() -> dict[str, tuple[str, tuple[Any, ...]]]:
    """method → (option, values) for the methods that declare a sweep (`creditaudit penalty-sweep`)."""
    return {name: next(iter(cls.sweep.items())) for name, cls in METHODS.items() if cls.sweep}


__all__ = ["METHODS", "REFERENCE_METHOD", "LocalMethod", "Method", "MethodSettings", "method_class",
           "methods_with_option", "output_error", "resolve_method_name", "rms_normalise",
           "sweep_defaults"]
