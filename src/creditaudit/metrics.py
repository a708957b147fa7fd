"""Measurements of SPEC §6 as pure functions of (model, batch[, credit]).

Every function takes a `ResidualStream` (or a model with `.stream()`, such as ResidualMLP) and
returns plain numbers or small dataclasses. Conventions, from SPEC §6:
  * norms are per-sample L2 along the feature dimension, `t.norm(dim=-1)`, reported as the median
    over samples;
  * g_l = ∂CE/∂h_l with CE mean-reduced over the eval batch (the floor threshold assumes it);
  * everything is computed in float32 (or float64 if the model is), never fp16;
  * non-finite hidden states give NaN/inf values, never an exception: the protocol turns them into a
    "non-finite" finding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .model import ResidualStream, as_stream


def per_sample_norm(t: torch.Tensor) -> torch.Tensor:
    """‖t_i‖₂ along the feature dimension, one value per sample."""
    return t.flatten(1).norm(dim=-1)


def median(t: torch.Tensor) -> float:
    """Median over samples as a Python float (NaN-propagating: a non-finite sample shows)."""
    t = t.detach().double()
    if torch.isnan(t).any():
        return float("nan")
    return float(t.median())


@dataclass
class BPGradients:
    """One forward/backward through the stream: h_l, g_l = ∂CE/∂h_l, ∂CE/∂logits, logits, CE."""

    hidden: list[torch.Tensor]
    grads: list[torch.Tensor]
    logit_grad: torch.Tensor
    logits: torch.Tensor
    loss: float


def bp_gradients(model, x: torch.Tensor, y: torch.Tensor) -> BPGradients:
    """True BP gradients at every residual position for the mean-reduced CE of this batch.

    h_0 is detached and made a leaf, so this works whether or not the parameters require grad
    (frozen blocks, a model in inference mode) and never touches parameter .grad fields.
    """
    stream: ResidualStream = as_stream(model)
    with torch.enable_grad():
        h = stream.embed(x).detach().float().requires_grad_(True)
        hidden = [h]
        for step in stream.steps:
            h = step(h)
            hidden.append(h)
        logits = stream.readout(h)
        loss = F.cross_entropy(logits.float(), y)
        grads = torch.autograd.grad(loss, hidden + [logits], allow_unused=True)
    grads = [torch.zeros_like(hh) if g is None else g for g, hh in zip(grads, hidden + [logits])]
    return BPGradients([t.detach() for t in hidden], [g.detach() for g in grads[:-1]],
                       grads[-1].detach(), logits.detach(), float(loss.detach()))


@torch.no_grad()
def residual_norms(model, x: torch.Tensor) -> list[float]:
    """(a) median ‖h_l‖ for l = 0 … L."""
    return [median(per_sample_norm(h)) for h in as_stream(model).hidden(x)]


def max_block_growth(norms: list[float]) -> float:
    """(a) statistic: max_l ‖h_{l+1}‖ / ‖h_l‖, the largest single-block amplification.

    Computed on the medians of adjacent layers. NaN if any norm is non-finite; 1.0 with no blocks.
    """
    if len(norms) < 2:
        return 1.0
    ratios = [b / a if a > 0 else float("inf") for a, b in zip(norms[:-1], norms[1:])]
    return float("nan") if any(r != r for r in ratios) else max(ratios)


def bp_grad_norms(model, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """(b) median ‖g_l‖ for l = 0 … L (mean-reduced CE over the batch)."""
    return [median(per_sample_norm(g)) for g in bp_gradients(model, x, y).grads]


def readout_gain_from(bp: BPGradients) -> float:
    """(b′) median over samples of ‖g_{L,i}‖ / ‖∂CE/∂logits_i‖ (the 1/N of the mean cancels)."""
    num = per_sample_norm(bp.grads[-1]).double()
    den = per_sample_norm(bp.logit_grad).double()
    gain = torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float64).tiny),
                       torch.full_like(num, float("nan")))
    finite = gain[torch.isfinite(gain)]
    if torch.isnan(num).any():
        return float("nan")
    return float(finite.median()) if len(finite) else float("nan")


def readout_gain(model, x: torch.Tensor, y: torch.Tensor) -> float:
    """(b′) readout gain: how much the readout attenuates the error on its way into h_L."""
    return readout_gain_from(bp_gradients(model, x, y))


@dataclass
class MonitorSnapshot:
    """The cheap per-epoch diagnostics on one fixed eval batch (SPEC §6, training-time monitor)."""

    h_norms: list[float]
    g_norms: list[float]
    max_growth: float
    gain: float
    acc: float
    loss: float

    def to_dict(self) -> dict:
        return {"h_norms": self.h_norms, "g_norms": self.g_norms, "max_growth": self.max_growth,
                "gain": self.gain, "eval_batch_acc": self.acc, "eval_batch_loss": self.loss}


def monitor_snapshot(model, x: torch.Tensor, y: torch.Tensor) -> MonitorSnapshot:
    """(a), (b), (b′) and accuracy on one batch, from a single forward/backward."""
    bp = bp_gradients(model, x, y)
    h_norms = [median(per_sample_norm(h)) for h in bp.hidden]
    g_norms = [median(per_sample_norm(g)) for g in bp.grads]
    acc = float((bp.logits.argmax(-1) == y).float().mean())
    return MonitorSnapshot(h_norms, g_norms, max_block_growth(h_norms), readout_gain_from(bp),
                           acc, bp.loss)


@torch.no_grad()
def accuracy(model, batches) -> float:
    """Top-1 accuracy over an iterable of (x, y) batches."""
    correct, total = 0, 0
    for x, y in batches:
        correct += int((model(x).argmax(-1) == y).sum())
        total += len(y)
    return correct / max(total, 1)
