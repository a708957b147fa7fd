"""creditaudit: train non-backprop credit-assignment methods on one pre-LN residual architecture
and audit whether their reported numbers (accuracy, gradient cosine Γ) mean anything."""
from .errors import CreditAuditError
from .model import ResidualMLP, ResidualStream, as_stream

__version__ = "0.1.0"

__all__ = ["CreditAuditError", "ResidualMLP", "ResidualStream", "as_stream", "__version__"]
