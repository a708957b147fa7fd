"""What every trainable architecture shares: embed → residual blocks → readout.

    h_0     = embed_input(x)
    h_{l+1} = h_l + blocks[l](h_l)          blocks[l] is the residual branch f_l alone
    logits  = readout(h_L)

Methods train a model only through this class (its three parts and their parameters), and the
protocol measures it only through `stream()`, so a method or a measurement written once works on
every architecture. A hidden state h_l may be (N, d), a token stream (N, T, d) or a feature map
(N, C, H, W): per-sample quantities flatten everything after the batch dimension.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import CreditAuditError
from .stream import LOSSES, ResidualStream, output_error


def check_arguments(arch: str, input_shape=None, w2_std=None, **sizes) -> None:
    """An architecture's constructor arguments, each refused in one line naming it (not a torch
    error from deep inside nn.Linear): `sizes` are integers ≥ 1 (n_blocks ≥ 0), `input_shape`
    a (C, H, W) of positive integers, `w2_std` a finite number ≥ 0."""
    import math
    import numbers
    for name, value in sizes.items():
        low = 0 if name == "n_blocks" else 1
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise CreditAuditError(f"{arch}: {name} must be an integer ≥ {low}, got {value!r}")
    if input_shape is not None and not (
            isinstance(input_shape, (tuple, list, torch.Size)) and len(input_shape) == 3
            and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1
                    for v in input_shape)):
        raise CreditAuditError(f"{arch}: input_shape must be (C, H, W), three positive integers, "
                               f"got {input_shape!r}")
    if w2_std is not None and (isinstance(w2_std, bool) or not isinstance(w2_std, (int, float))
                               or not math.isfinite(w2_std) or w2_std < 0):
        raise CreditAuditError(f"{arch}: w2_std must be a finite number ≥ 0, got {w2_std!r}")


class ResidualModel(nn.Module):
    """Base class of the architectures: subclasses define `embed_input`, `blocks`, `readout`,
    `embed_parameters` and `head_parameters`, and set `n_classes` and `stream_shape`."""

    n_classes: int
    blocks: nn.ModuleList
    stream_shape: tuple[int, ...]     # per-sample shape of every h_l: (d,), (T, d) or (C, H, W)
    # False: a plain network, h_{l+1} = f_l(h_l) (model/plain.py); its h_0 may differ in shape
    residual: bool = True
    loss_name: str = "ce"             # the training loss, a key of `model.stream.LOSSES`

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    def embed_input(self, x: torch.Tensor) -> torch.Tensor:
        """h_0 for a batch of raw inputs."""
        raise NotImplementedError

    def readout(self, h_last: torch.Tensor) -> torch.Tensor:
        """h_L ↦ logits (N, C)."""
        raise NotImplementedError

    def embed_parameters(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def head_parameters(self) -> list[nn.Parameter]:
        """The readout's parameters: trained on the true CE gradient by every method."""
        raise NotImplementedError

    def position_shape(self, layer: int) -> tuple[int, ...]:
        """The per-sample shape of h_layer: `stream_shape` everywhere in a residual stream."""
        return tuple(self.stream_shape)

    def advance(self, h: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """h_{l+1} from h_l and the block's output f = f_l(h_l): h + f, or f without a skip."""
        return h + f if self.residual else f

    def loss(self, logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The training loss ℓ (cross-entropy, or the plain MLP's per-class BCE)."""
        return LOSSES[self.loss_name](logits, y, reduction)

    def output_error(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """e = ∂ℓ_i/∂logits_i: softmax − onehot for CE, σ − onehot for BCE."""
        return output_error(logits, y, self.loss_name)

    def forward(self, x: torch.Tensor, return_hidden: bool = False):
        h = self.embed_input(x)
        hidden = [h]
        for block in self.blocks:
            h = self.advance(h, block(h))
            hidden.append(h)
        logits = self.readout(h)
        return (logits, hidden) if return_hidden else logits

    def stream(self) -> ResidualStream:
        """This model seen through the protocol's residual-stream interface."""
        if not self.residual:
            return ResidualStream(embed=self.embed_input, steps=list(self.blocks), readout=self.readout,
                                  residual=False, loss=LOSSES[self.loss_name])
        return ResidualStream(embed=self.embed_input, steps=[_SkipStep(b) for b in self.blocks],
                              readout=self.readout, branches=list(self.blocks),
                              loss=LOSSES[self.loss_name])


class _SkipStep:
    """h_l ↦ h_l + f_l(h_l) for one block (a named class rather than a lambda, for readable reprs)."""

    def __init__(self, block: nn.Module):
        self.block = block

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.block(h)
