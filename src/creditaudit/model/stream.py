"""The residual-stream interface: all the audit protocol needs from a model.

Any model that can say how to get h_0 from x, how to go from h_l to h_{l+1}, and how to read logits
off h_L can be audited (see docs/USAGE.md, "Auditing your own model").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..errors import CreditAuditError


def cross_entropy_loss(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """ℓ_i = CE(softmax(z_i), y_i), the loss every architecture trains on unless it says otherwise;
    its gradient at the logits is e = softmax(z) − onehot(y) (÷N for the mean)."""
    return torch.nn.functional.cross_entropy(logits, y, reduction=reduction)


def binary_cross_entropy_loss(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean"
                              ) -> torch.Tensor:
    """ℓ_i = Σ_c BCE(σ(z_ic), onehot(y)_ic): sigmoid outputs, one binary cross-entropy per class
    summed over the classes (Frenkel et al. 2021's output loss), so that its gradient at the logits
    is e = σ(z) − onehot(y), the same form as softmax + CE (÷N for the mean). torch's
    binary_cross_entropy averages over the classes too, which divides e by C: the sum keeps one
    step size meaning the same thing under both losses."""
    target = torch.nn.functional.one_hot(y, logits.shape[-1]).to(logits.dtype)
    per_sample = torch.nn.functional.binary_cross_entropy_with_logits(
        logits, target, reduction="none").sum(-1)
    if reduction == "none":
        return per_sample
    return per_sample.sum() if reduction == "sum" else per_sample.mean()


LOSSES = {"ce": cross_entropy_loss, "bce": binary_cross_entropy_loss}


def output_error(logits: torch.Tensor, y: torch.Tensor, loss: str = "ce") -> torch.Tensor:
    """e = ∂ℓ_i/∂z_i per sample: softmax(z) − onehot(y) for "ce", σ(z) − onehot(y) for "bce"."""
    p = logits.sigmoid() if loss == "bce" else logits.softmax(-1)
    return p - torch.nn.functional.one_hot(y, logits.shape[-1]).to(logits.dtype)


@dataclass
class ResidualStream:
    """What the audit protocol needs from a model, and nothing more.

    embed:    x ↦ h_0, shape (N, d), (N, T, d) (a token stream) or (N, C, H, W) (a feature map)
    steps:    one callable per block, h_l ↦ h_{l+1} (the full block, skip connection included)
    readout:  h_L ↦ logits (N, C); for a pre-LN model this contains the terminal LayerNorm
    branches: optional, one callable per block giving the residual branch f_l(h_l) alone; the
              frozen-init identity check uses it, and falls back to step(h) − h without it.
    residual: False for a network without a residual stream (the plain MLP): h_{l+1} = f_l(h_l),
              the "stream" is the layer activations (they may change width from h_0 = x to h_1),
              and there is no branch to compare with h_l.
    loss:     the training loss ℓ(logits, y, reduction) (`LOSSES`); every reference gradient
              g_l = ∂ℓ/∂h_l is taken of it. Cross-entropy unless the model says otherwise.

    In a residual stream every h_l keeps one shape: (N, d), (N, T, d) or (N, C, H, W). Per-sample norms, cosines and
    gradients flatten everything after the batch dimension, so a token stream or a feature map is
    measured as one vector per sample (SPEC §2); nothing needs pooling first.
    """

    embed: Callable[[torch.Tensor], torch.Tensor]
    steps: Sequence[Callable[[torch.Tensor], torch.Tensor]]
    readout: Callable[[torch.Tensor], torch.Tensor]
    branches: Sequence[Callable[[torch.Tensor], torch.Tensor]] | None = None
    residual: bool = True
    loss: Callable[..., torch.Tensor] = cross_entropy_loss

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
        if not self.residual:
            raise CreditAuditError("a network without a residual stream has no residual branch f_l "
                                   "to compare with h_l")
        if self.branches is not None:
            return self.branches[layer](h)
        return self.steps[layer](h) - h


def parameter_roles(stream: ResidualStream, params: dict[str, torch.nn.Parameter],
                    x: torch.Tensor) -> dict[str, set[str]]:
    """Which of `params` (name → parameter) the embedding and the readout use, found by autograd on
    one batch `x`: "embedding" — those h_0 = embed(x) depends on; "readout" — those the logits
    readout(h_L) depend on with h_L held fixed. Works for any stream (a `.stream()` model or an
    adapter), so the embedding and the readout can be checked each as its own group."""
    named = list(params.items())
    tensors = [p for _, p in named]
    flags = [p.requires_grad for p in tensors]      # a frozen control's blocks may not require grad
    try:
        for p in tensors:
            p.requires_grad_(True)
        with torch.enable_grad():
            h = stream.embed(x)
            reached = torch.autograd.grad(h.float().sum(), tensors, allow_unused=True)
            embedding = {n for (n, _), g in zip(named, reached) if g is not None}
            with torch.no_grad():
                for step in stream.steps:
                    h = step(h)
            logits = stream.readout(h.detach())
            reached = torch.autograd.grad(logits.float().sum(), tensors, allow_unused=True)
            readout = {n for (n, _), g in zip(named, reached) if g is not None}
    finally:
        for p, flag in zip(tensors, flags):
            p.requires_grad_(flag)
    return {"embedding": embedding, "readout": readout}


def as_stream(model) -> ResidualStream:
    """Accept a ResidualStream, or any model with a `.stream()` method returning one."""
    if isinstance(model, ResidualStream):
        return model
    if hasattr(model, "stream"):
        return model.stream()
    raise CreditAuditError(
        f"cannot audit a {type(model).__name__}: pass a creditaudit.ResidualStream(embed=..., "
        "steps=[...], readout=...) built from your model, or give the model a .stream() method")
