"""The pre-LN ResidualMLP of docs/PROTOCOL.md and the residual-stream interface the protocol audits.

    h_0     = embed(x)                              x flattened to (N, D_in)
    f_l(h)  = W2 · act(W1 · LN(h))                  W2 ~ N(0, w2_std²), bias 0: a fresh stack ≈ identity
    h_{l+1} = h_l + f_l(h_l)                        l = 0 … L-1
    logits  = out_head(out_ln(h_L))

The protocol never touches `ResidualMLP` directly: it works on a `ResidualStream` (model/stream.py).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import CreditAuditError
from .base import ResidualModel, check_arguments

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "tanh": torch.tanh,
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
}


class Block(nn.Module):
    """One residual branch f_l(h) = W2 · act(W1 · LN(h)); the skip is added by the caller."""

    def __init__(self, d: int, activation: str = "gelu", w2_std: float = 0.01):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise CreditAuditError(
                f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)}")
        self.activation = activation
        self.ln = nn.LayerNorm(d)
        self.w1 = nn.Linear(d, d)
        self.w2 = nn.Linear(d, d)
        nn.init.normal_(self.w2.weight, std=w2_std)
        nn.init.zeros_(self.w2.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.w2(ACTIVATIONS[self.activation](self.w1(self.ln(h))))


class ResidualMLP(ResidualModel):
    """Pre-LN residual MLP: Linear embed, L residual blocks, terminal LayerNorm, Linear head."""

    def __init__(self, d_in: int, d: int = 256, n_blocks: int = 4, n_classes: int = 10,
                 activation: str = "gelu", w2_std: float = 0.01):
        super().__init__()
        check_arguments("ResidualMLP", w2_std=w2_std, d_in=d_in, d=d, n_blocks=n_blocks,
                        n_classes=n_classes)
        self.d_in, self.d, self.n_classes = d_in, d, n_classes
        self.stream_shape = (d,)
        self.embed = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d, activation, w2_std) for _ in range(n_blocks))
        self.out_ln = nn.LayerNorm(d)
        self.out_head = nn.Linear(d, n_classes)

    def embed_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x.flatten(1))

    def readout(self, h_last: torch.Tensor) -> torch.Tensor:
        """logits = out_head(out_ln(h_L))."""
        return self.out_head(self.out_ln(h_last))

    def embed_parameters(self) -> list[nn.Parameter]:
        return list(self.embed.parameters())

    def head_parameters(self) -> list[nn.Parameter]:
        return list(self.out_ln.parameters()) + list(self.out_head.parameters())
