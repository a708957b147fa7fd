"""K ResidualMLPs of one shape as one model with a leading member axis (horizontal fusion, HFTA).

Every parameter of the K lone models is stacked into one leaf tensor (K, *shape); a batch is
(K, B, …), member k's samples in row k. Each layer is the lone layer applied per member:

    linear      y_k = x_k · W_kᵀ + b_k          W (K, out, in), b (K, out): one baddbmm
    layer norm  LN(h_k) · γ_k + β_k             γ, β (K, d): the normalisation is per sample,
                                                the affine per member

so member k's forward reads only member k's parameters and samples: members never mix. The K
models are built as lone models (`runs.build_model` with each seed) and then stacked
(`MemberResMLP(models)`), so initialisation is identical by construction; `unstack_into(k, model)`
copies member k back into a lone model (checkpoints, diagnosis, run folders).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .resmlp import ACTIVATIONS, ResidualMLP

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, str], torch.Tensor]


def member_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, name: str = "") -> torch.Tensor:
    """y = x·Wᵀ + b per member: x (K, B, in), W (K, out, in), b (K, out) → (K, B, out).
    (`name`, the module's name inside its block, is for linears that route by it, e.g. fa's.)"""
    return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))


def member_layer_norm(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim of h (K, B, d) with member k's affine γ_k, β_k (K, d)."""
    return F.layer_norm(h, h.shape[-1:], eps=eps) * weight.unsqueeze(1) + bias.unsqueeze(1)


class MemberResMLP:
    """K ResidualMLPs of one shape as stacked leaf tensors `params` {name: (K, *shape)}, named as
    in the lone model's state dict, so member k of `params[name]` is model k's `name`."""

    def __init__(self, models: Sequence[ResidualMLP]):
        models = list(models)
        first = models[0]
        if not all(isinstance(m, ResidualMLP) for m in models):
            raise TypeError("MemberResMLP stacks ResidualMLPs only")
        shapes = {tuple((n, tuple(p.shape)) for n, p in m.named_parameters()) for m in models}
        if len(shapes) != 1 or len({b.activation for m in models for b in m.blocks}) > 1:
            raise ValueError("MemberResMLP needs models of one shape and activation")
        self.params = {name: torch.stack([dict(m.named_parameters())[name].detach() for m in models])
                       .clone().requires_grad_(True) for name, _ in first.named_parameters()}
        self.n_members, self.n_blocks, self.n_classes = len(models), first.n_blocks, first.n_classes
        self.act = ACTIVATIONS[first.blocks[0].activation] if first.n_blocks else None
        self.block_eps = [b.ln.eps for b in first.blocks]
        self.out_eps = first.out_ln.eps

    def block_params(self, l: int) -> list[torch.Tensor]:
        """The stacked parameters of block l."""
        return [p for name, p in self.params.items() if name.startswith(f"blocks.{l}.")]

    def embed_input(self, x: torch.Tensor) -> torch.Tensor:
        """h_0 = embed(x): x (K, B, …) flattened per sample → (K, B, d)."""
        return member_linear(x.flatten(2), self.params["embed.weight"], self.params["embed.bias"])

    def block(self, l: int, h: torch.Tensor, linear: Linear = member_linear) -> torch.Tensor:
        """f_l(h) = W2 · act(W1 · LN(h)) per member; `linear` applies W1 and W2 (by name)."""
        p, pre = self.params, f"blocks.{l}."
        z = member_layer_norm(h, p[pre + "ln.weight"], p[pre + "ln.bias"], self.block_eps[l])
        z = self.act(linear(z, p[pre + "w1.weight"], p[pre + "w1.bias"], "w1"))
        return linear(z, p[pre + "w2.weight"], p[pre + "w2.bias"], "w2")

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """logits = out_head(out_ln(h_L)) per member, (K, B, C)."""
        z = member_layer_norm(h, self.params["out_ln.weight"], self.params["out_ln.bias"], self.out_eps)
        return member_linear(z, self.params["out_head.weight"], self.params["out_head.bias"])

    @torch.no_grad()
    def unstack_into(self, k: int, model: ResidualMLP) -> None:
        """Copy member k's parameters into the lone `model` (of this shape)."""
        for name, p in model.named_parameters():
            p.copy_(self.params[name][k])


def member_cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean CE of each member over its own batch: logits (K, B, C), y (K, B) → (K,)."""
    k, b, c = logits.shape
    return F.cross_entropy(logits.reshape(k * b, c), y.reshape(k * b), reduction="none").view(k, b).mean(1)
