"""Credit-assignment methods by name. Adding one: a new file with a `Method` subclass, one line here."""
from __future__ import annotations

from ..errors import CreditAuditError
from .base import Method, MethodSettings, bp_credit, output_error, rms_normalise
from .bp import BP
from .bridges import CreditBridge, StateBridge
from .dfa import DFA, DFAPenalty
from .ep import EP
from .fa import FA

METHODS: dict[str, type[Method]] = {
    "bp": BP,
    "fa": FA,
    "dfa": DFA,
    "dfa-penalty": DFAPenalty,
    "ep": EP,
    "sb": StateBridge,
    "cb": CreditBridge,
}


def method_class(name: str) -> type[Method]:
    if name not in METHODS:
        raise CreditAuditError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[name]


__all__ = ["METHODS", "Method", "MethodSettings", "bp_credit", "method_class", "output_error",
           "rms_normalise"]
