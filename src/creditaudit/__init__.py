"""creditaudit: train non-backprop credit-assignment methods on one pre-LN residual architecture
and audit whether their reported numbers (accuracy, gradient cosine Γ) mean anything."""
__version__ = "0.1.0"

from .errors import CreditAuditError, CreditAuditWarning

# The model classes, the monitor for a user's own loop (docs/YOUR_OWN_LOOP.md) and the protocol's
# `diagnose` (docs/USAGE.md, "Auditing your own model"), imported on first use so that `import creditaudit`
# (and with it `creditaudit --help`) imports no torch: name → module that defines it.
_LAZY = {"Monitor": "monitor", "StopRun": "monitor", "FlagFired": "monitor",
         "load_monitored": "monitor", "Adapter": "adapter",
         "audit_own_runs": "api", "diagnose": "protocol",
         "ResidualMLP": "model", "ResidualStream": "model", "as_stream": "model"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'creditaudit' has no attribute {name!r}")


__all__ = ["Adapter", "CreditAuditError", "CreditAuditWarning", "FlagFired", "Monitor",
           "ResidualMLP", "ResidualStream", "StopRun", "__version__", "as_stream",
           "audit_own_runs", "diagnose", "load_monitored"]
