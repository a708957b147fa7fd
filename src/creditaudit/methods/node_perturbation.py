"""node-perturbation — credit from the loss change under noise on the states (Williams 1992;
Flower & Jabri 1993; Werfel, Xie & Seung 2005).

Two forward passes per step: the clean one (`local_forward`) and one with Gaussian noise added at
every residual position, the embedding's output h_0 and each block's output h_{l+1}:

    h̃_0     = h_0 + ξ_0,   h̃_{l+1} = h̃_l + f_l(h̃_l) + ξ_{l+1},   ξ_l ~ N(0, σ² I), per sample
    ΔL_i    = ℓ_i(h̃) − ℓ_i(h)                                   per-sample CE, noisy − clean
    a_l     = ΔL_i · ξ_{l,i} / σ²                                credit at h_l, l = 0 … L

On the plain MLP (arch mlp, no skip: h̃_{l+1} = f_l(h̃_l) + ξ_{l+1}) the noise goes at h_1 … h_L only,
each ξ_l of its position's shape (d,): h_0 is the input x, which has no parameters to train, so
noise there would only add variance to every other position's estimate. Its credit is reported as
a_0 = ∂f_0(x)ᵀ a_1 (`local.input_credit`; the step passes 0, nothing trains with it).

To first order ΔL_i = Σ_k ⟨∂ℓ_i/∂h_k, ξ_k⟩, and the ξ_k are independent with E[ξ ξᵀ] = σ² I, so
E[a_l] = ∂ℓ_i/∂h_l: an unbiased (to O(σ)) but noisy estimate of the per-sample BP gradient, in the
direction of increasing loss. (Per-sample ∂ℓ_i, the scale `local_gradients` expects: its batch mean
of ⟨f_l, a_{l+1}⟩ is then the mean CE's gradient.)

Γ's chance level. Each sample's estimate is one draw, so Γ measures the credit the method trains
with, not its expectation. Write g_k = ∂ℓ_i/∂h_k and u_k = ⟨g_k, ξ_k⟩/σ ~ N(0, ‖g_k‖²), independent
over k. To first order cos(a_l, g_l) = sign(Σ_k u_k) · u_l / (‖ξ_l‖/σ · ‖g_l‖), and ‖ξ_l‖/σ ≈ √D
for D features per sample; for jointly Gaussian (u_l, S = Σ_k u_k), E[sign(S)·u_l] =
√(2/π)·Cov(u_l, S)/std(S) = √(2/π)·‖g_l‖²/√(Σ_k ‖g_k‖²). So

    E[Γ_l] ≈ √(2/π) · mean_i ‖g_l,i‖ / (√D_l · √(Σ_k ‖g_k,i‖²))              (`chance_gamma`)
           ≈ √(2/π) / √(D·(L + 1))        when the L + 1 positions carry gradients of one size

(D_l the features of h_l; k over the noised positions: 0 … L, or 1 … L on the plain MLP, where it
is ≈ √(2/π)/√(d·L))

because the single loss change ΔL is shared by the noise of all L + 1 positions: the noise at the
other positions is noise in every position's estimate. (MNIST-1D, D = 256, L = 4: 0.022, measured
0.021; the earlier √(2/π)/√D = 0.050 left out the other positions.) Tested on a small model.

    block l:  (f_l(h_l.detach()) · a_{l+1}).sum(-1).mean()       (LocalMethod.local_gradients,
    embed:    (embed(x) · a_0).sum(-1).mean()                     per-block clip at settings.clip)
    head:     CE(readout(h_L.detach()), y)                        (the true gradient, as dfa's head)

Noise: drawn in `prepare_step` (eagerly, a compiled graph cannot hold a generator) for
settings.batch_size samples from the method's CPU generator, derived from (seed,
"method:node-perturbation"), and copied to the device without a host sync (`seeding.draw_on_host`):
a seed gives the same noise on any device. A smaller last batch takes the first rows. `credit`
(the audit's a_l) draws its noise from a generator rebuilt from a seed the method keeps in its
state, so it neither advances the training stream nor differs between calls. No random feedback:
no null of Γ.

Where it differs from the original (Williams 1992's REINFORCE for stochastic units; Flower & Jabri
1993 / Werfel et al. 2005's node perturbation, which perturbs every unit of a layered network and
correlates the scalar loss change with each unit's own noise to update its incoming weights):
  * the noise goes on the residual stream only (h_0 … h_L), not on every unit: a block's hidden
    units (W1's outputs) are not perturbed, and inside a block W1 learns by backprop of a_{l+1}
    through W2 (`LocalMethod.local_gradients`), as dfa's blocks do. On the plain MLP every hidden
    unit is perturbed, as theirs, but at its output act(u) rather than its input u, so W_l learns
    (a_{l+1} ⊙ act′(u_l)) h_lᵀ, not ΔL·ξ_u h_lᵀ/σ² directly; the readout is not perturbed;
  * the estimate is per sample (ΔL_i from the sample's own CE), the batch mean of the local losses
    then averages it; no baseline is subtracted beyond the clean pass (ΔL is noisy − clean);
  * σ = 1e-2 on a stream of norm ~10 (`sigma`); the head trains on the true CE gradient;
  * the optimiser is the shared AdamW recipe (the method's `recipe` says why: no one published
    recipe fits this model).

The noisy pass only measures ΔL: it leaves every buffer of the model as the clean pass left it
(BatchNorm's running statistics and batch counters are copied before it and written back once the
step's backward has run), while its BatchNorm still normalises with the (noisy) batch's statistics,
as the clean pass does in training mode — so ΔL is the loss change of the function being trained,
and the running statistics are those of the clean forward alone.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..errors import CreditAuditError
from ..seeding import draw_on_host
from .base import refuse_dropout
from .local import LocalMethod, input_credit
from .recipe import no_published_recipe


def chance_gamma(grads: list[torch.Tensor], noised: Sequence[int] | None = None) -> list[float]:
    """E[Γ_l] of the one-draw estimate at the noised positions l, from the BP gradients g_0 … g_L
    (each (N, …)): √(2/π) · mean_i ‖g_l,i‖ / (√D_l · √(Σ_{k noised} ‖g_k,i‖²)), D_l the features
    per sample at h_l (module docstring). noised: the positions that carry noise (default all
    L + 1; 1 … L on the plain MLP); NaN at the others, whose credit is not a one-draw estimate."""
    noised = range(len(grads)) if noised is None else noised
    norms = torch.stack([g.detach().flatten(1).double().norm(dim=-1) for g in grads])   # (L + 1, N)
    total = norms[list(noised)].pow(2).sum(0).sqrt()
    return [((2 / torch.pi) ** 0.5 * norms[l] / (grads[l][0].numel() ** 0.5 * total)).mean().item()
            if l in noised else float("nan") for l in range(len(grads))]


class NodePerturbation(LocalMethod):
    """Local losses on a_l = ΔL · ξ_l / σ², ΔL the per-sample loss change under noise ξ on every h_l."""

    name = "node-perturbation"
    recipe = no_published_recipe(
        "Williams 1992 and Hiratani, Mehta, Lillicrap & Latham 2022 (NeurIPS; the modern reference "
        "analysis) use plain SGD with a constant step scaled to the width of the teacher-student "
        "nets they study; no lr, schedule or batch size transfers to this model")
    summary = "node perturbation (Williams 1992): a_l = ΔL·ξ_l/σ² from a second forward with noise ξ"
    null_note = ("no feedback matrices, no null; Γ is the cosine of one noise draw's estimate per "
                 "sample, not of its expectation: at chance it is ≈ √(2/π)/√(D·(L+1)) (D features per "
                 "sample, one loss change shared by the L + 1 positions' noise; L on the plain "
                 "MLP, which has none at its input), far below 1 even "
                 "for an unbiased estimate")
    option_defaults = {"sigma": 1e-2}
    option_ranges = {"sigma": (1e-6, 1.0)}
    option_help = {"sigma": "std σ of the Gaussian noise ξ_l added at every position h_l (h_1 … h_L on arch mlp)"}

    def __init__(self, model, settings):
        super().__init__(model, settings)
        refuse_dropout(model, self.name, "ΔL compares a clean and a noisy forward pass of one network")
        self.sigma = float(self.option(settings.options, "sigma"))     # read once, not per step
        self.opt = self.add_optimizer(self.local_param_groups())      # embed, trainable blocks, head
        self.credit_seed = int(torch.randint(2 ** 62, (1,), generator=self.gen))
        # the positions that carry noise: h_0 … h_L, or h_1 … h_L on the plain MLP (h_0 = x)
        self.noised = tuple(range(0 if model.residual else 1, model.n_blocks + 1))
        self._noise: torch.Tensor | None = None

    def _draw(self, n: int, gen: torch.Generator, like: torch.Tensor) -> torch.Tensor:
        """σ·ε, ε ~ N(0, I) from the CPU generator `gen`, shaped (P, n, *stream_shape) on `like`'s
        device and dtype: ξ_l for n samples at the P noised positions (`noised`)."""
        shape = (len(self.noised), n) + tuple(self.model.stream_shape)
        return draw_on_host(torch.randn, shape, gen, like).mul_(self.sigma)

    def prepare_step(self):
        self._noise = self._draw(self.settings.batch_size, self.gen, self.model.head_parameters()[0])

    def _perturbed_credit(self, hidden: list[torch.Tensor], logits: torch.Tensor, y: torch.Tensor,
                          noise: torch.Tensor) -> list[torch.Tensor]:
        """[a_0 … a_L] from the clean states h_0 … h_L and logits and the noise ξ (P, N, …) at the
        noised positions; a position without noise (the plain MLP's input h_0) gets a = 0 here.
        The noisy pass may update buffers (BatchNorm's running statistics): the caller keeps them
        (`_keep_buffers`) and writes them back (`_restore_buffers`)."""
        xi = dict(zip(self.noised, noise))
        with torch.no_grad():
            h = hidden[0] + xi[0] if 0 in xi else hidden[0]                  # h̃_0 = h_0 + ξ_0
            for l, block in enumerate(self.model.blocks):
                h = self.model.advance(h, block(h)) + xi[l + 1]             # h̃_{l+1}
            delta = (self.model.loss(self.model.readout(h), y, reduction="none")
                     - self.model.loss(logits, y, reduction="none"))        # ΔL_i, (N,)
            scale = (delta / self.sigma ** 2).view((-1,) + (1,) * (noise.dim() - 2))
            return [scale * xi[l] if l in xi else torch.zeros_like(hidden[l])    # a_l = ΔL · ξ_l / σ²
                    for l in range(len(hidden))]

    def _keep_buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(buffer, a copy of it) for every buffer of the model, as the clean pass left them."""
        return [(b, b.clone()) for b in self.model.buffers()]

    @staticmethod
    @torch.no_grad()
    def _restore_buffers(kept: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for buffer, saved in kept:
            buffer.copy_(saved)

    def gradients(self, x, y):
        n = x.shape[0]
        if n > self._noise.shape[1]:
            raise CreditAuditError(f"node-perturbation drew noise for batches of {self._noise.shape[1]}; "
                                   f"got {n} samples (set the method's batch_size)")
        fwd = self.local_forward(x)
        kept = self._keep_buffers()
        credit = self._perturbed_credit(fwd.hidden, fwd.logits.detach(), y, self._noise[:, :n])
        loss = self.local_gradients(y, fwd, credit)
        # written back after the backward: the clean pass's BatchNorm saved its running statistics
        # for it, and an in-place write before would bump their version (autograd refuses then)
        self._restore_buffers(kept)
        return loss

    @torch.no_grad()
    def credit(self, x, y):
        logits, hidden = self.model(x, return_hidden=True)
        noise = self._draw(len(y), torch.Generator().manual_seed(self.credit_seed), logits)
        kept = self._keep_buffers()
        credit = self._perturbed_credit(hidden, logits, y, noise)
        self._restore_buffers(kept)
        if 0 not in self.noised:                              # a_0 = ∂f_0(x)ᵀ a_1 (local.input_credit)
            credit[0] = input_credit(self.model, x, credit[1])
        return credit

    def extra_state(self):
        return {"credit_seed": self.credit_seed}

    def load_extra_state(self, state):
        self.credit_seed = int(state["credit_seed"])

