"""Credit-assignment methods, by name. Adding one: a new file with a `Method` subclass, and its class
in `_BUILT_IN` below; every list of methods elsewhere (presets, --help, validation) comes from here."""
from __future__ import annotations

from typing import Any

from ..errors import CreditAuditError
from .base import Method, MethodSettings
from .bp import BP
from .bridges import CreditBridge, StateBridge
from .dfa import DFA, DFAPenalty
from .ep import EP
from .fa import FA
from .local import LocalMethod, output_error, rms_normalise

_BUILT_IN: tuple[type[Method], ...] = (BP, FA, DFA, DFAPenalty, EP, StateBridge, CreditBridge)
METHODS: dict[str, type[Method]] = {cls.name: cls for cls in _BUILT_IN}
REFERENCE_METHOD = BP.name        # the method every other is compared with (Γ = 1 by construction)


def method_class(name: str) -> type[Method]:
    if name not in METHODS:
        raise CreditAuditError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[name]


def methods_with_option(option: str) -> list[str]:
    """The methods that declare `option` (e.g. the penalty λ, "lam")."""
    return [name for name, cls in METHODS.items() if option in cls.option_defaults]


def sweep_defaults() -> dict[str, tuple[str, tuple[Any, ...]]]:
    """method → (option, values) for the methods that declare a sweep (`creditaudit penalty-sweep`)."""
    return {name: next(iter(cls.sweep.items())) for name, cls in METHODS.items() if cls.sweep}


__all__ = ["METHODS", "REFERENCE_METHOD", "LocalMethod", "Method", "MethodSettings", "method_class",
           "methods_with_option", "output_error", "rms_normalise", "sweep_defaults"]
