"""Architectures and the residual-stream interface the protocol audits them through."""
from .base import ResidualModel
from .resmlp import ACTIVATIONS, Block, ResidualMLP
from .stream import ResidualStream, as_stream

__all__ = ["ACTIVATIONS", "Block", "ResidualMLP", "ResidualModel", "ResidualStream", "as_stream"]
