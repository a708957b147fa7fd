"""Measurements of docs/PROTOCOL.md as pure functions of (model, batch[, credit]).

Every function takes a `ResidualStream` (or a model with `.stream()`, such as ResidualMLP) and
returns plain numbers or small dataclasses. Conventions, from docs/PROTOCOL.md:
  * norms are per-sample L2 along the feature dimension, `t.norm(dim=-1)`, reported as the median
    over samples;
  * g_l = ∂CE/∂h_l with CE mean-reduced over the eval batch (the floor threshold assumes it);
  * everything is computed in the model's dtype (float32, or float64 if the model is), never fp16;
    Γ, s_l and every ratio are computed in float64 from those tensors, and ρ and the nudging test
    run on a float64 copy of the model when it can be made (see `_exact_stream`);
  * non-finite hidden states give NaN/inf values, never an exception: the protocol turns them into a
    "non-finite" finding;
  * measurements run on the device of their inputs, and per-layer statistics are gathered as one
    tensor and read back to the host once (`medians`, `monitor_snapshot`, `gradient_cosine`,
    `cross_batch_stability_from`), not once per layer.
"""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .model import ResidualStream, as_stream
from .seeding import derived_generator, from_one_state


def per_sample_norm(t: torch.Tensor) -> torch.Tensor:
    """‖t_i‖₂ along the feature dimension, one value per sample."""
    return t.flatten(1).norm(dim=-1)


def median(t: torch.Tensor) -> float:
    """Median over samples as a Python float: the mean of the two middle values for an even
    count (numpy's convention, so independent re-implementations agree); NaN-propagating."""
    return medians([t])[0]


def _median_tensor(t: torch.Tensor) -> torch.Tensor:
    """`median` as a 0-d float64 tensor on t's device (torch.quantile propagates NaN)."""
    return t.detach().double().flatten().quantile(0.5)


def medians(ts: Sequence[torch.Tensor]) -> list[float]:
    """`median` of each tensor, computed on their device and read back to the host in one go."""
    if not ts:
        return []
    return torch.stack([_median_tensor(t) for t in ts]).tolist()


@dataclass
class BPGradients:
    """One forward/backward through the stream: h_l, g_l = ∂CE/∂h_l, ∂CE/∂logits, logits, CE."""

    hidden: list[torch.Tensor]
    grads: list[torch.Tensor]
    logit_grad: torch.Tensor
    logits: torch.Tensor
    loss: float


def ce_gradient(rest: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, y: torch.Tensor,
                reduction: str = "mean", loss: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference gradient at one residual position: (CE, ∂CE/∂h), CE = CE(rest(h), y).

    `rest` maps the state h (N, …) to logits — the readout for h_L, or the remaining blocks plus
    the readout for an inner position. reduction "mean" is the paper's convention (g_l, ÷N);
    "sum" and "none" give per-sample units ∂ℓ_i/∂h_i (for "none" the loss comes back per sample
    and the gradient is that of their sum). Every ∂CE/∂h in the package comes from here or from
    `bp_gradients` (all positions at once). `loss`: the model's training loss (its stream's
    `loss`, e.g. the plain MLP's per-class BCE); cross-entropy when None.
    """
    criterion = F.cross_entropy if loss is None else loss
    with torch.enable_grad():
        leaf = h.detach().requires_grad_(True)
        loss = criterion(rest(leaf), y, reduction=reduction)
        (grad,) = torch.autograd.grad(loss.sum() if reduction == "none" else loss, leaf)
    return loss.detach(), grad.detach()


def bp_gradients(model, x: torch.Tensor, y: torch.Tensor) -> BPGradients:
    """True BP gradients at every residual position for the mean-reduced CE of this batch.

    h_0 is detached and made a leaf, so this works whether or not the parameters require grad
    (frozen blocks, a model in inference mode) and never touches parameter .grad fields.
    """
    stream: ResidualStream = as_stream(model)
    with torch.enable_grad():
        h = stream.embed(x).detach()
        if h.dtype == torch.float16:          # never fp16: floor-level gradients underflow it
            h = h.float()
        h.requires_grad_(True)
        hidden = [h]
        for step in stream.steps:
            h = step(h)
            hidden.append(h)
        logits = stream.readout(h)
        loss = stream.loss(logits if logits.dtype != torch.float16 else logits.float(), y)
        grads = torch.autograd.grad(loss, hidden + [logits], allow_unused=True)
    grads = [torch.zeros_like(hh) if g is None else g for g, hh in zip(grads, hidden + [logits])]
    return BPGradients([t.detach() for t in hidden], [g.detach() for g in grads[:-1]],
                       grads[-1].detach(), logits.detach(), float(loss.detach()))


@torch.no_grad()
def residual_norms(model, x: torch.Tensor) -> list[float]:
    """(a) median ‖h_l‖ for l = 0 … L."""
    return medians([per_sample_norm(h) for h in as_stream(model).hidden(x)])


@torch.no_grad()
def branch_ratios(model, x: torch.Tensor) -> list[float]:
    """Per block l, max_i ‖f_l(h_l,i)‖ / ‖h_l,i‖ on the batch: how far the residual branch alone
    moves the stream. All 0 when every block is the identity (a zero-initialised residual branch,
    as ResNets' zero-γ and many transformers start): a frozen control of such a model is then
    exactly the shallow network embed → readout. Empty for a network without a residual stream
    (nothing to compare a layer's output with)."""
    stream = as_stream(model)
    if not stream.residual:
        return []
    hidden = stream.hidden(x)
    return [float((per_sample_norm(stream.branch(l, h)) / per_sample_norm(h).clamp_min(1e-30)).max())
            for l, h in enumerate(hidden[:-1])]


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
    return medians([per_sample_norm(g) for g in bp_gradients(model, x, y).grads])


def _readout_gain_tensor(bp: BPGradients) -> torch.Tensor:
    """`readout_gain_from` as a 0-d float64 tensor on the batch's device (no host read)."""
    num = per_sample_norm(bp.grads[-1]).double()
    den = per_sample_norm(bp.logit_grad).double()
    gain = torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float64).tiny),
                       torch.full_like(num, float("nan")))
    gain = torch.where(torch.isfinite(gain), gain, torch.full_like(gain, float("nan")))
    # the lower middle value of the finite gains (torch.median's convention), NaN if there are none
    # or if any ‖g_L,i‖ is NaN
    return torch.where(torch.isnan(num).any(), torch.full_like(gain[:1], float("nan"))[0],
                       gain.nanmedian())


def readout_gain_from(bp: BPGradients) -> float:
    """(b′) median over samples of ‖g_{L,i}‖ / ‖∂CE/∂logits_i‖ (the 1/N of the mean cancels)."""
    return float(_readout_gain_tensor(bp))


def readout_gain(model, x: torch.Tensor, y: torch.Tensor) -> float:
    """(b′) readout gain: how much the readout attenuates the error on its way into h_L."""
    return readout_gain_from(bp_gradients(model, x, y))


@dataclass
class MonitorSnapshot:
    """The cheap per-epoch diagnostics on one fixed eval batch (docs/PROTOCOL.md-time monitor)."""

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
    n = len(bp.hidden)
    stats = torch.stack([_median_tensor(per_sample_norm(t)) for t in bp.hidden + bp.grads]
                        + [_readout_gain_tensor(bp),
                           (bp.logits.argmax(-1) == y).double().mean()]).tolist()   # one host read
    h_norms, g_norms = stats[:n], stats[n:2 * n]
    return MonitorSnapshot(h_norms, g_norms, max_block_growth(h_norms), stats[-2], stats[-1], bp.loss)


def alignment_every(epochs: int) -> int:
    """How often the training-time monitor records the alignment over training (Γ_l, cos(W, B)):
    every k-th epoch, k = ⌈epochs/20⌉, so a run gets about 20 points (every epoch up to 20 epochs);
    the monitors add epoch 0 and the last epoch."""
    return max(1, math.ceil(epochs / 20))


def credit_alignment(model, credit, x: torch.Tensor, y: torch.Tensor) -> list[float] | None:
    """Γ_l, l = 0 … L, of a credit [a_0 … a_L] on the batch (x, y) against ∂CE/∂h_l
    (`gradient_cosine`, as the diagnosis measures it); one host read. None when `credit` is not
    a list of L + 1 tensors shaped like h_0 … h_L (the diagnosis says what is wrong with it)."""
    bp = bp_gradients(model, x, y)
    if not (isinstance(credit, (list, tuple)) and len(credit) == len(bp.hidden) and all(
            isinstance(a, torch.Tensor) and a.shape == h.shape for a, h in zip(credit, bp.hidden))):
        return None
    return gradient_cosine(credit, bp.grads)


def weight_alignment(pairs: Sequence[tuple[str, torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """cos(W, B) = ⟨vec W, vec B⟩ / (‖vec W‖ ‖vec B‖) per (name, W, B) pair, in float64: how far a
    rule's feedback weights B have aligned with the forward weights W they stand in for (Lillicrap
    et al. 2016's "align, then learn"; 1 when B = W, as for backprop). One host read. A zero W or B
    gives NaN (no direction to compare)."""
    if not pairs:
        return {}
    cos = [torch.dot(w.detach().flatten().double(), b.detach().flatten().double())
           / (w.detach().double().norm() * b.detach().double().norm()) for _, w, b in pairs]
    return dict(zip([name for name, _, _ in pairs], torch.stack(cos).tolist()))


@contextlib.contextmanager
def predicting(model):
    """The model as it predicts, within: an nn.Module in eval mode (dropout off, BatchNorm on its
    running statistics), its own mode restored after; any other callable as it is. A model read
    back from a checkpoint is built in training mode: a dropout network's accuracy measured so
    would be a random draw below the one training recorded."""
    module = model if isinstance(model, torch.nn.Module) else None
    was_training = module.training if module is not None else False
    if module is not None:
        module.eval()
    try:
        yield model
    finally:
        if module is not None:
            module.train(was_training)


@torch.no_grad()
def accuracy(model, batches) -> float:
    """Top-1 accuracy over an iterable of (x, y) batches, of the model as it predicts (`predicting`)."""
    correct, total = 0, 0
    with predicting(model):
        for x, y in batches:
            correct += int((model(x).argmax(-1) == y).sum())
            total += len(y)
    return correct / max(total, 1)


@torch.no_grad()
def correctness(model, batches) -> torch.Tensor:
    """Top-1 correctness per example over an iterable of (x, y) batches, in their order, of the model
    as it predicts (`predicting`): a bool vector on the CPU whose mean is `accuracy` (what (d)'s
    variance over the test set needs)."""
    with predicting(model):
        hits = [(model(x).argmax(-1) == y).to("cpu") for x, y in batches]
    return torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool)


# ---------------------------------------------------------------------------------------------
# Helpers shared by the measurements below
# ---------------------------------------------------------------------------------------------

def _layer_credit(credit, layer: int) -> torch.Tensor:
    """A credit argument may be the full list [a_0 … a_L] or the one tensor a_l."""
    return credit[layer] if isinstance(credit, (list, tuple)) else credit


def _exact_stream(model, x: torch.Tensor) -> tuple[ResidualStream, torch.Tensor]:
    """The model's stream and input in float64 when that is possible without touching the caller's
    model.

    An nn.Module with a `.stream()` (ResidualMLP, or a user model following the same pattern) is
    deep-copied and cast to float64; a bare ResidualStream is built from closures we cannot cast,
    so it is used as given (its own dtype — hand it a float64 stream for float64 measurements).
    """
    if isinstance(model, torch.nn.Module) and hasattr(model, "stream"):
        return copy.deepcopy(model).double().stream(), x.double()
    return as_stream(model), x


def _per_sample_ce(logits: torch.Tensor, y: torch.Tensor, loss: Callable | None = None) -> torch.Tensor:
    """ℓ_i per sample: the stream's training loss `loss` (cross-entropy when None)."""
    return (F.cross_entropy if loss is None else loss)(logits, y, reduction="none")


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population std (ddof = 0, numpy's default) of a list of floats; NaN-propagating."""
    t = torch.tensor(values, dtype=torch.float64)
    if len(t) == 0:
        return float("nan"), float("nan")
    std = float(t.std(unbiased=False)) if len(t) > 1 else 0.0
    return float(t.mean()), std


# ---------------------------------------------------------------------------------------------
# Γ_l — gradient cosine, unclamped
# ---------------------------------------------------------------------------------------------

def per_sample_cosine(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """cos(a_i, g_i) = ⟨a_i, g_i⟩ / (‖a_i‖·‖g_i‖) per sample, in float64, denominator NOT clamped.

    torch's cosine_similarity clamps ‖a‖·‖g‖ at 1e-8, which shrinks the cosine ~100× exactly when the
    reference gradient sits at the floor (‖g‖ ~ 1e-10); float64 keeps ‖g‖² ~ 1e-20 representable.
    Rows where either vector has zero norm have no direction: they come back NaN. Non-finite
    inputs give NaN rows.
    """
    a, g = a.detach().flatten(1).double(), g.detach().flatten(1).double()
    na, ng = a.norm(dim=-1), g.norm(dim=-1)
    denom = na * ng
    cos = (a * g).sum(-1) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.where(denom > 0, cos, torch.full_like(cos, float("nan")))


def gradient_cosine(credit, grads) -> list[float]:
    """Γ_l = mean over samples of cos(a_l,i, g_l,i), l = 0 … L (see `per_sample_cosine`).

    A sample whose reference g_l,i is exactly zero has no direction to be compared with and is
    left out; a sample the method gives no credit (a_l,i = 0) counts as cos = 0, so withholding
    credit is never rewarded. A layer where every sample is left out gives NaN, and so does any
    non-finite value in a layer — never a silently partial mean.
    """
    gammas = []
    for a, g in zip(credit, grads):
        finite = torch.isfinite(a).all() & torch.isfinite(g).all()
        has_ref = per_sample_norm(g) > 0
        cos = torch.nan_to_num(per_sample_cosine(a, g), nan=0.0)
        mean = torch.where(has_ref, cos, 0.0).sum() / has_ref.sum()       # 0/0 = NaN: no reference
        gammas.append(torch.where(finite, mean, torch.full_like(mean, float("nan"))))
    return torch.stack(gammas).tolist() if gammas else []               # one host read


# ---------------------------------------------------------------------------------------------
# (c) cross-batch stability
# ---------------------------------------------------------------------------------------------

def cross_batch_stability_from(grads_per_batch: list[list[torch.Tensor]],
                               layers: Sequence[int] | None = None) -> list[float]:
    """s_l from precomputed BP gradients: grads_per_batch[j][l] = g_l on batch j (N_j, d).

        u_i = g_i / ‖g_i‖,   ū_j = mean_i∈batch j u_i,   s_l = mean_{j<k} ⟨ū_j, ū_k⟩

    Samples with ‖g_i‖ = 0 have no direction and are left out of ū_j. NaN with fewer than two
    batches, or if any gradient at that layer is non-finite.
    """
    n_layers = len(grads_per_batch[0]) if grads_per_batch else 0
    layers = list(range(n_layers)) if layers is None else list(layers)
    k = len(grads_per_batch)
    if k < 2:
        return [float("nan")] * len(layers)
    out = []
    for l in layers:
        means, finite = [], []
        for grads in grads_per_batch:
            g = grads[l].detach().flatten(1).double()
            finite.append(torch.isfinite(g).all())
            n = g.norm(dim=-1, keepdim=True)
            keep = n > 0
            unit = torch.where(keep, g / torch.where(keep, n, torch.ones_like(n)), 0.0)
            means.append(unit.sum(0) / keep.sum())                        # 0/0 = NaN: no direction
        u = torch.stack(means)                                             # (K, d)
        gram = u @ u.T
        iu = torch.triu_indices(k, k, offset=1, device=u.device)
        s = gram[iu[0], iu[1]].mean()
        out.append(torch.where(torch.stack(finite).all(), s, torch.full_like(s, float("nan"))))
    return torch.stack(out).tolist() if out else []                        # one host read


def cross_batch_stability(model, batches, layers: Sequence[int] | None = None) -> list[float]:
    """(c) s_l for l in `layers` (default 0 … L) over K disjoint eval batches [(x, y), …].

    docs/PROTOCOL.md asks for K ≥ 8. Each batch's g is ∂CE/∂h of that batch's mean-reduced CE (the 1/N
    does not matter: only directions enter). ≈ 0 for sample-specific credit, ≈ 1 when one
    sample-invariant direction dominates.
    """
    grads = [bp_gradients(model, x, y).grads for x, y in batches]
    return cross_batch_stability_from(grads, layers)


# ---------------------------------------------------------------------------------------------
# Null calibration of Γ
# ---------------------------------------------------------------------------------------------

@dataclass
class NullCalibration:
    """Γ_l under K fresh feedback draws: per-layer mean and population std (ddof = 0)."""

    mean: list[float]
    std: list[float]
    draws: list[list[float]]          # draws[k][l] = Γ_l with the k-th fresh feedback
    seed: int

    def z(self, gamma: Sequence[float]) -> list[float]:
        """z_l = (Γ_l − mean_l) / std_l, in units of the null std; NaN where std_l = 0."""
        return [(g - m) / s if s > 0 else float("nan")
                for g, m, s in zip(gamma, self.mean, self.std)]

    def to_dict(self) -> dict:
        return {"mean": self.mean, "std": self.std, "k": len(self.draws), "seed": self.seed}


def _draws_credits(method_or_fn):
    """(batches, gens) → for each generator, each batch's credit under that one feedback draw: a
    Method's `fresh_feedback_draws`, or a callable (x, y, gen) given each `gen` at the same state
    per batch."""
    if hasattr(method_or_fn, "fresh_feedback_draws"):
        return method_or_fn.fresh_feedback_draws
    if hasattr(method_or_fn, "fresh_feedback_credits"):
        return lambda batches, gens: (method_or_fn.fresh_feedback_credits(batches, gen) for gen in gens)
    fresh = getattr(method_or_fn, "fresh_feedback_credit", method_or_fn)
    if not callable(fresh):
        raise TypeError("null_calibration needs a Method with random feedback or a callable "
                        "(x, y, gen) -> [a_0, …, a_L]")
    return lambda batches, gens: (from_one_state(fresh, batches, gen) for gen in gens)


def null_calibration(method_or_fn, model, x, y=None, k: int = 20, seed: int = 0
                     ) -> NullCalibration:
    """Γ_l recomputed with K fresh feedback draws (docs/PROTOCOL.mdΓ).

    `method_or_fn` is a Method (its `fresh_feedback_credit(x, y, gen)` is called) or any callable
    with that signature. Draw k uses `derived_generator(seed, f"null:{k}")`, so the null is
    reproducible and independent of the method's own generator. x, y is one batch; or pass the
    eval batches as a list [(x, y), …] in `x` (y = None), and Γ pools every sample of every batch
    (each batch's credit and g computed on that batch, as in `diagnose`).

    One draw is one feedback, as the method's Γ is one: every batch of draw k is given the
    generator at the same state, so a rule drawing its feedback from `gen` draws the same one for
    each batch (`Method.fresh_feedback_credits`; fa and dfa draw it once and reuse it; dfa also
    runs each batch's forward once for all draws, `Method.fresh_feedback_draws`). (Drawn
    afresh per batch, a draw's Γ averaged one feedback per eval batch — 8 in an audit —: its spread
    over draws shrank about √8-fold, and z grew as much: fa's z 31 against 8 on one trained run.)
    """
    batches = x if y is None else [(x, y)]
    grads = pool_samples([bp_gradients(model, xb, yb).grads for xb, yb in batches])
    gens = (derived_generator(seed, f"null:{i}") for i in range(k))
    draws = [gradient_cosine(pool_samples(credits), grads)
             for credits in _draws_credits(method_or_fn)(batches, gens)]
    per_layer = list(zip(*draws)) if draws else []
    stats = [_mean_std(list(col)) for col in per_layer]
    return NullCalibration([m for m, _ in stats], [s for _, s in stats], draws, seed)


def pool_samples(per_batch: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """[[a_0 … a_L] per batch] → [a_0 … a_L] with all batches' samples concatenated."""
    return [torch.cat([b[l].detach() for b in per_batch]) for l in range(len(per_batch[0]))]


# ---------------------------------------------------------------------------------------------
# ρ_l — perturbation correlation
# ---------------------------------------------------------------------------------------------

@dataclass
class PerturbationCorrelation:
    """ρ_l of one credit signal, with the two controls of docs/PROTOCOL.md on the same directions v."""

    layer: int
    method: float | None              # None when no credit was given (controls only)
    bp: float                         # control: a = BP gradient (should be ≈ 1)
    random: float                     # control: a = N(0, I) vector (should be ≈ 0)
    m: int
    eps: float
    dtype: str
    bp_model_precision: float | None = None   # the BP control in the model's own dtype (fp32)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _pearson(p: torch.Tensor, q: torch.Tensor) -> float:
    """Pearson correlation over all entries; 0 if either std < 1e-12, NaN if non-finite."""
    p, q = p.flatten().double(), q.flatten().double()
    if not (torch.isfinite(p).all() and torch.isfinite(q).all()):
        return float("nan")
    sp, sq = p.std(unbiased=False), q.std(unbiased=False)
    if sp < 1e-12 or sq < 1e-12:
        return 0.0
    return float(((p - p.mean()) * (q - q.mean())).mean() / (sp * sq))


class _Perturbation:
    """The shared part of ρ: h_l, the M unit directions v and the true ΔL, computed once.

    ΔL_i = ℓ_i(h_l + εv) − ℓ_i(h_l), ℓ_i the per-sample CE of the rest of the network from h_l.
    One batched forward of (N + M·N, d) states: the unperturbed rows ride in the same batch so
    base and perturbed losses share one rounding path. Computed in float64 (see `_exact_stream`):
    with ε = 1e-3 the true change of a confident sample is ~1e-7 of a loss whose float32 rounding
    is ~1e-7 — float32 ΔL would be mostly noise for a trained model.
    """

    def __init__(self, model, x, y, layer: int, m: int, eps: float, gen: torch.Generator | None,
                 exact: bool = True, draws: torch.Tensor | None = None):
        self.stream, xin = _exact_stream(model, x) if exact else (as_stream(model), x)
        with torch.no_grad():
            h = self.stream.hidden(xin)[layer].detach()
        if h.dtype == torch.float16:
            h = h.float()
        n, shape = h.shape[0], tuple(h.shape[1:])     # a state may be (d,), (T, d) or (C, H, W)
        # the directions' raw float64 normal draws, from `gen` (or another _Perturbation's `draws`:
        # the same directions, which the same generator state would draw again)
        self.draws = draws if draws is not None else torch.randn((m, n) + shape, generator=gen,
                                                                 dtype=torch.float64)
        v = self.draws.to(h.device, h.dtype)
        v = v / v.flatten(2).norm(dim=-1).view((m, n) + (1,) * len(shape))
        states = torch.cat([h, (h.unsqueeze(0) + eps * v).reshape((m * n,) + shape)])
        with torch.no_grad():
            loss = _per_sample_ce(self.stream.forward_from(layer, states).double(),
                                  y.repeat(m + 1), self.stream.loss)
        self.delta = (loss[n:].reshape(m, n) - loss[:n].unsqueeze(0))      # (M, N)
        self.h, self.y, self.v, self.layer, self.eps = h, y, v, layer, eps

    def rho(self, a: torch.Tensor) -> float:
        """ρ for credit a (N, d): Pearson(ε⟨a_i, v_mi⟩, ΔL_mi) over all M × N pairs."""
        pred = self.eps * (a.detach().to(self.v.device).double().unsqueeze(0)
                           * self.v.double()).flatten(2).sum(-1)
        return _pearson(pred, self.delta)

    def bp_gradient(self) -> torch.Tensor:
        """∂ℓ_i/∂h_l,i per sample (sum-reduced CE), in the same float64 copy the ΔL come from.

        Per-sample units, like ΔL: ρ is scale-free, but the mean-reduced g (÷N) of a floor-level
        model would put ε⟨g, v⟩ below the 1e-12 std cutoff and read the control as 0.
        """
        rest = lambda h: self.stream.forward_from(self.layer, h)
        return ce_gradient(rest, self.h, self.y, reduction="sum", loss=self.stream.loss)[1]


def perturbation_correlation(model, x: torch.Tensor, y: torch.Tensor, layer: int, credit,
                             m: int = 32, eps: float = 1e-3,
                             gen: torch.Generator | None = None) -> float:
    """ρ_l: does the credit predict how the loss actually changes when h_l is moved?

        v_mi ~ N(0, I), ‖v_mi‖ = 1;   ΔL_mi = ℓ_i(h_l + ε v_mi) − ℓ_i(h_l);   pred_mi = ε⟨a_l,i, v_mi⟩
        ρ_l = Pearson(pred, ΔL) over the M × N pairs  (0 if either std < 1e-12)

    `credit` is a_l (N, d) or the list [a_0 … a_L]. ΔL is the forward difference of docs/PROTOCOL.md
    float64 when the model can be cast (an nn.Module with .stream()). Scale-free in a: the 1/N
    of a mean-reduced gradient does not matter. Non-finite states give NaN.
    """
    gen = gen if gen is not None else derived_generator(0, "rho")
    return _Perturbation(model, x, y, layer, m, eps, gen).rho(_layer_credit(credit, layer))


def perturbation_with_controls(model, x: torch.Tensor, y: torch.Tensor, layer: int, credit=None,
                               m: int = 32, eps: float = 1e-3,
                               gen: torch.Generator | None = None) -> PerturbationCorrelation:
    """ρ_l of `credit` (optional) beside its two controls, all on the same M directions:
    a = BP gradient (expected ≈ 1; paper 0.9965) and a = N(0, I) random vector (≈ 0; paper 0.0056).
    """
    gen = gen if gen is not None else derived_generator(0, "rho")
    pert = _Perturbation(model, x, y, layer, m, eps, gen)
    method = None if credit is None else pert.rho(_layer_credit(credit, layer))
    random_a = torch.randn(pert.h.shape, generator=gen, dtype=torch.float64).to(pert.h.device)
    result = PerturbationCorrelation(layer, method, pert.rho(pert.bp_gradient()), pert.rho(random_a),
                                     m, eps, str(pert.h.dtype).replace("torch.", ""))
    # The same directions, with ΔL and g computed in the model's own precision: is the reference
    # numerically meaningful as the model itself computes it (a floor-level g in fp32)?
    own = _Perturbation(model, x, y, layer, m, eps, None, exact=False, draws=pert.draws)
    result.bp_model_precision = own.rho(own.bp_gradient())
    return result


# ---------------------------------------------------------------------------------------------
# Nudging test
# ---------------------------------------------------------------------------------------------

@dataclass
class NudgeResult:
    """ΔCE (mean-reduced, this batch) after h_l ← h_l − η·â_l, for the method and for BP."""

    layer: int
    eta: float
    delta_ce_method: float
    delta_ce_bp: float
    relative: float                   # delta_ce_method / delta_ce_bp; 1 = as good as BP

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def nudging_test(model, x: torch.Tensor, y: torch.Tensor, layer: int, credit,
                 eta: float = 0.01) -> NudgeResult:
    """Move h_l against the credit and see whether the loss drops as it does along BP.

        â_i = a_i · ‖g_i‖ / ‖a_i‖       per-sample rescale to the BP gradient's norm (â_i = 0 if a_i = 0)
        ΔCE_method = CE(h_l − η â) − CE(h_l),   ΔCE_bp = CE(h_l − η g) − CE(h_l)
        relative   = ΔCE_method / ΔCE_bp

    The rescale makes the two nudges the same size sample by sample, so `relative` measures
    direction only: to first order it is the ‖g_i‖²-weighted mean of cos(a_i, g_i). Float64 when
    the model can be cast. NaN if the BP nudge changes nothing or anything is non-finite.
    """
    stream, xin = _exact_stream(model, x)
    with torch.no_grad():
        h = stream.hidden(xin)[layer].detach()
    loss0, g = ce_gradient(lambda s: stream.forward_from(layer, s), h, y, loss=stream.loss)
    a = _layer_credit(credit, layer).detach().to(h.device, h.dtype)
    per_sample = lambda t: t.flatten(1).norm(dim=-1).view((-1,) + (1,) * (t.dim() - 1))
    na, ng = per_sample(a), per_sample(g)
    a_hat = torch.where(na > 0, a * ng / torch.where(na > 0, na, torch.ones_like(na)),
                        torch.zeros_like(a))
    with torch.no_grad():
        ce = lambda s: float(stream.loss(stream.forward_from(layer, s), y))
        base = float(loss0)
        d_method, d_bp = ce(h - eta * a_hat) - base, ce(h - eta * g) - base
    ok = all(math.isfinite(t) for t in (d_method, d_bp)) and d_bp != 0
    return NudgeResult(layer, eta, d_method, d_bp, d_method / d_bp if ok else float("nan"))


# ---------------------------------------------------------------------------------------------
# Frozen-init identity check
# ---------------------------------------------------------------------------------------------

@dataclass
class IdentityCheck:
    """At random init: how close is the residual stack to the identity? mean ± std over seeds."""

    seeds: list[int]
    block_ratio_mean: list[float]     # per block, median_i ‖f_l(h_l,i)‖ / ‖h_l,i‖
    block_ratio_std: list[float]
    stack_change_mean: float          # median_i ‖h_L,i − h_0,i‖ / ‖h_0,i‖
    stack_change_std: float
    stack_cos_mean: float             # median_i cos(h_L,i, h_0,i)
    stack_cos_std: float
    per_seed: list[dict]

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def identity_check(model_factory, seeds: Sequence[int], x: torch.Tensor) -> IdentityCheck:
    """Build a fresh model per seed and measure how far its blocks move the stream (docs/PROTOCOL.md).

    `model_factory(seed)` returns a model or ResidualStream; it runs under `torch.manual_seed(seed)`
    inside a forked RNG, so the caller's global random state is left as it was. Std is ddof = 0.
    """
    rows = []
    for seed in seeds:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            stream = as_stream(model_factory(seed))
        with torch.no_grad():
            hidden = stream.hidden(x)
            ratios = [median(per_sample_norm(stream.branch(l, h)) / per_sample_norm(h))
                      for l, h in enumerate(hidden[:-1])]
            h0, hl = hidden[0], hidden[-1]
            change = median(per_sample_norm(hl - h0) / per_sample_norm(h0))
            cos = median(per_sample_cosine(hl, h0))
        rows.append({"seed": seed, "block_ratio": ratios, "stack_change": change, "stack_cos": cos})
    per_block = [_mean_std([r["block_ratio"][l] for r in rows])
                 for l in range(len(rows[0]["block_ratio"]))] if rows else []
    change, cos = (_mean_std([r[k] for r in rows]) for k in ("stack_change", "stack_cos"))
    return IdentityCheck(list(seeds), [m for m, _ in per_block], [s for _, s in per_block],
                         change[0], change[1], cos[0], cos[1], rows)


# ---------------------------------------------------------------------------------------------
# (d) depth utility
# ---------------------------------------------------------------------------------------------

@dataclass
class DepthUtility:
    """(d)'s measurement: accuracy against the frozen-blocks control. Whether the gap is enough is
    the verdict's call (`verdict.fires_d`); `margin` and `undercut` record that call."""

    acc: float
    frozen_acc: float
    margin: float
    gap: float                        # acc − frozen_acc
    undercut: bool | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def depth_utility(acc: float, frozen_acc: float, margin: float = 0.02) -> DepthUtility:
    """acc − frozen_acc (accuracies as fractions: 0.02 = 2 points); `undercut` is left to the verdict."""
    return DepthUtility(float(acc), float(frozen_acc), margin, float(acc) - float(frozen_acc))
