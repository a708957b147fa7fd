"""The pre-LN ResidualMLP of SPEC §2 and the residual-stream interface the protocol audits.

    h_0     = embed(x)                              x flattened to (N, D_in)
    f_l(h)  = W2 · act(W1 · LN(h))                  W2 ~ N(0, w2_std²), bias 0: a fresh stack ≈ identity
    h_{l+1} = h_l + f_l(h_l)                        l = 0 … L-1
    logits  = out_head(out_ln(h_L))

The protocol never touches `ResidualMLP` directly: it works on a `ResidualStream` (embed → blocks →
readout), so any model that can say how to get h_0, how to go from h_l to h_{l+1}, and how to read
logits off h_L can be audited (see README, "Auditing your own model").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import CreditAuditError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "tanh": torch.tanh,
    "silu": F.silu,
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


class ResidualMLP(nn.Module):
    """Pre-LN residual MLP: Linear embed, L residual blocks, terminal LayerNorm, Linear head."""

    def __init__(self, d_in: int, d: int = 256, n_blocks: int = 4, n_classes: int = 10,
                 activation: str = "gelu", w2_std: float = 0.01):
        super().__init__()
        self.d_in, self.d, self.n_classes = d_in, d, n_classes
        self.embed = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d, activation, w2_std) for _ in range(n_blocks))
        self.out_ln = nn.LayerNorm(d)
        self.out_head = nn.Linear(d, n_classes)

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    def readout(self, h_last: torch.Tensor) -> torch.Tensor:
        """logits = out_head(out_ln(h_L))."""
        return self.out_head(self.out_ln(h_last))

    def forward(self, x: torch.Tensor, return_hidden: bool = False):
        h = self.embed(x.flatten(1))
        hidden = [h]
        for block in self.blocks:
            h = h + block(h)
            hidden.append(h)
        logits = self.readout(h)
        return (logits, hidden) if return_hidden else logits

    def stream(self) -> "ResidualStream":
        """This model seen through the protocol's residual-stream interface."""
        steps = [_SkipStep(block) for block in self.blocks]
        return ResidualStream(embed=lambda x: self.embed(x.flatten(1)), steps=steps,
                              readout=self.readout, branches=list(self.blocks))


class _SkipStep:
    """h_l ↦ h_l + f_l(h_l) for one block (a named class rather than a lambda, for readable reprs)."""

    def __init__(self, block: nn.Module):
        self.block = block

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.block(h)


@dataclass
class ResidualStream:
    """What the audit protocol needs from a model, and nothing more.

    embed:    x ↦ h_0, shape (N, d)
    steps:    one callable per block, h_l ↦ h_{l+1} (the full block, skip connection included)
    readout:  h_L ↦ logits (N, C); for a pre-LN model this contains the terminal LayerNorm
    branches: optional, one callable per block giving the residual branch f_l(h_l) alone; the
              frozen-init identity check uses it, and falls back to step(h) − h without it.

    Hidden states must be (N, d) per sample; a token model pools or flattens its tokens first.
    """

    embed: Callable[[torch.Tensor], torch.Tensor]
    steps: Sequence[Callable[[torch.Tensor], torch.Tensor]]
    readout: Callable[[torch.Tensor], torch.Tensor]
    branches: Sequence[Callable[[torch.Tensor], torch.Tensor]] | None = None

    @property
    def n_blocks(self) -> int:
        return len(self.steps)

    def hidden(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[h_0, …, h_L] for a batch."""
        h = self.embed(x)
        hidden = [h]
        for step in self.steps:
            h = step(h)
            hidden.append(h)
        return hidden

    def forward_from(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Logits of the rest of the network when the residual stream at position `layer` is h."""
        for step in self.steps[layer:]:
            h = step(h)
        return self.readout(h)

    def branch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """f_l(h): the residual branch of block `layer` alone."""
        if self.branches is not None:
            return self.branches[layer](h)
        return self.steps[layer](h) - h


def as_stream(model) -> ResidualStream:
    """Accept a ResidualStream, or any model with a `.stream()` method returning one."""
    if isinstance(model, ResidualStream):
        return model
    if hasattr(model, "stream"):
        return model.stream()
    raise CreditAuditError(
        f"cannot audit a {type(model).__name__}: pass a creditaudit.ResidualStream(embed=..., "
        "steps=[...], readout=...) built from your model, or give the model a .stream() method")
