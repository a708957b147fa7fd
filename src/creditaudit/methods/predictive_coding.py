"""pc — predictive coding (Whittington & Bogacz 2017, "An approximation of the error backpropagation
algorithm in a predictive coding network with local Hebbian synaptic plasticity"), and with option
`incremental` its incremental variant iPC (Salvatori et al., "A stable, fast, and fully automatic
learning algorithm for predictive coding networks", arXiv 2022, ICLR 2024), on the chain energy
of `ep` (a residual stream, or the plain MLP).

Each state h_l predicts the next one, h_{l+1} ≈ h_l + f_l(h_l); the prediction error at h_{l+1} is
ε_{l+1} = h_{l+1} − h_l − f_l(h_l) (= r_l in ep.py), and the network's energy is EP's, with the output
clamped to the label through the CE (the top term; mean-reduced, strength β):

    F(h) = ½ Σ_l Σ_i ‖ε_{l+1,i}‖² + β · CE(readout(h_L), y)            h_0 = embed(x) clamped

On the plain MLP (arch mlp, no skip) the prediction is f_l(h_l) alone, ε_{l+1} = h_{l+1} − f_l(h_l),
read ∂f_l for (I + ∂f_l) below, and h_0 = x, the input (no parameters: a_0 trains nothing there and
is ∂f_0(x)ᵀ a_1, of the input's shape, for the protocol only). Tested: a_l → g_l as β → 0, h_0
included (cos > 0.99 per sample, tanh 20-16-16-5, tests/test_plain_mlp_energy.py).

Inference (the PC network dynamics, gradient descent on the states, from the feed-forward pass where
every ε = 0):

    h_l ← h_l − α·β · ∂(F/β)/∂h_l,   ∂F/∂h_l = ε_l − (I + ∂f_l(h_l))ᵀ ε_{l+1}   (l < L)
                                     ∂F/∂h_L = ε_L + β · ∂CE/∂h_L
    for `steps` steps. Each step is local: state l sees only its own error and the next one's
    through block l's Jacobian (one VJP per block, no backward through the chain), so the output
    error reaches h_l only after L − l steps and the slowest mode contracts by 1 − α·(2 − 2cos(π/(2L+1)))
    per step (identity blocks). A fixed step diverges once the blocks' Jacobians make the energy's
    curvature exceed 2/α (seen at init with w2_std = 0.5: residual ~1e6 after 300 steps), so each
    step is a trial, per sample: kept where it does not raise F_i, else undone and that sample's α_i
    halved (a masked update, as in ep; tested). plain pc only: iPC takes Salvatori et al.'s fixed
    step, since its weights move between two evaluations and their F_i are not comparable.
    The credit the diagnosis reads (`credit`) takes the same steps on a float64 copy of the model,
    and counts a rise of F_i within its rounding error as none (`ep.rounding_margin`): in float32
    that test is decided by rounding for a confident sample, which then kept or lost whole steps
    from one machine or thread count to the next (docs/PROTOCOL.md §3.13). Training keeps the
    float32 strict test, so a run computes what it did; `trained_credit` is the credit exactly as
    the step infers it, and the diagnosis reports its Γ beside (`gamma_trained`; MNIST-1D d = 256
    L = 4 seed 42, 5 epochs: deep Γ 0.8687, as trained 0.8684).

Credit (in the units of g_l = ∂CE/∂h_l of the mean CE, like ep; "direction of increasing loss"):

    a_l = −ε_l/β                        l = 1 … L,   at the states after inference
    a_0 = (1/β) ∂F/∂h_0 = (I + ∂f_0(h_0))ᵀ a_1      the force on the clamped h_0

At the equilibrium ∂F/∂h = 0 this is a_L = ∂CE/∂h_L(h_L), a_l = (I + ∂f_l(h_l))ᵀ a_{l+1}: backprop at
the inferred states, hence a_l → g_l = ∂CE/∂h_l as β → 0 (PC ≈ BP in the weak-nudge limit; tested,
cos > 0.99 per layer in float64).

Weight update: gradient descent on F/β at the inferred states (states detached):

    block l:  −(1/β) Σ_i ε_{l+1,i} · ∂f_l(h_l)_i/∂θ = Σ_i a_{l+1,i} · ∂f_l(h_l)_i/∂θ   (Hebbian: error ⊗ input)
    embed:    Σ_i a_{0,i} · ∂h_{0,i}/∂θ
    head:     ∂CE(readout(h_L.detach()), y)/∂θ

Where it differs from `ep`:
  * EP: two phases (free, nudged) and the contrastive estimator −(1/β)(∂E/∂θ(h^β) − ∂E/∂θ(h^free)),
    exact as β → 0. On this energy the free phase is the feed-forward pass with E = 0 and ∂E/∂θ = 0,
    so the estimator keeps only its nudged term, which is the PC update above: at the same
    equilibrium, pc and ep compute the same credit and the same update (tested). What differs is the
    inference: ep solves the nudged equilibrium with per-sample quasi-Newton steps in the residual
    coordinates, each one a full backward through the chain; pc runs the network's own local
    dynamics, so with few steps its credit is the truncated, depth-damped signal a PC network would
    use. One phase, errors as credit: PC.
  * iPC (`incremental` = 1): the weights are updated at every inference step, from the same energy
    evaluation as the states (∂F/∂θ and ∂F/∂h at once, then one optimizer step and one state step),
    `steps` optimizer steps per batch, with h_0 = embed(x) recomputed under the current weights;
    there is no separate "after convergence" update. The batch's first step is at the feed-forward
    states, where every ε = 0: it updates the head only (and applies weight decay). iPC's credit
    (`credit`) is taken after the same `steps` fixed-length steps at the current weights, not after
    plain pc's trial steps, which may reject steps iPC takes.

Convergence (`epoch_log`): pc_residual = ‖∂F/∂h(h_T)‖ / ‖∂F/∂h(h^free)‖ (norms over the batch and h_1 … h_L;
1 = nothing relaxed, 0 = equilibrium) at the states the update uses, averaged over the epoch's steps
(plain pc only).

Compilation: plain pc's `gradients` compiles whole (fullgraph). iPC interleaves `steps` optimizer
steps with the state updates inside one batch, and the optimizer step stays outside the compiled
region (base.Method.step_function), so iPC overrides `train_step` and trains uncompiled.

Options: "beta" β = 1, "steps" = 10, "alpha" = 0.5 (stable for α < 2/λ_max, λ_max < 4 for
identity blocks), "incremental" = 0. No gradient clipping (the update approximates the BP gradient).
Measured (MNIST-1D, d = 256, L = 4, batch 128, seed 42, one thread, 5 epochs): pc_residual on test
batch 0 at init 0.36 (steps 10), 0.14 (steps 30), 0.49 (steps 10, α = 0.25); logged over epoch 5
0.88 — the truncated PC signal, yet Γ per layer 0.81 / 0.82 / 0.85 / 0.87 / 0.98; test accuracy
0.557 (bp 0.610, iPC 0.528); CPU time per epoch 7.6 s (bp 0.79 s, iPC 9.2 s).
Where it differs from the originals (Whittington & Bogacz 2017: value nodes x_l with errors
ε_l = x_l − W_{l−1} f(x_{l−1}), the output clamped to the target, inference to convergence, then
the Hebbian ΔW_l ∝ ε_{l+1} f(x_l)ᵀ; Salvatori et al.'s iPC updates the weights at every inference step):
  * the prediction is the residual step h_l + f_l(h_l), and the output is nudged by β·CE of the
    readout instead of being clamped to the label (β = 1 by default).
  * each block's parameters learn by backprop of a_{l+1} = −ε_{l+1}/β through the block's two
    layers (the error at the block's output times the block's input-to-parameter Jacobian), not a
    Hebbian product per single weight matrix; every node's precision is 1. On the plain MLP a block
    is one layer, so the update is the Hebbian product itself, ΔW_l ∝ (a_{l+1} ⊙ act′(W_l h_l + b_l))
    h_lᵀ, but of the prediction act(W_l h_l + b_l) (nonlinearity after the weights) rather than
    their W_l f(x_l) (before), hence the act′ factor. A plain MLP with dropout is refused (each
    energy evaluation would draw its own mask: the trial test would compare two networks).
  * inference runs a fixed number of steps (10) with a per-sample step-halving safeguard (plain pc),
    not to convergence; the embedding learns from the force on the clamped h_0.
  * AdamW with a cosine schedule; no gradient clipping.
"""
from __future__ import annotations

import copy
import math

import torch

from ..metrics import ce_gradient
from .base import Method, refuse_dropout
from .ep import float64_copy, rounding_margin
from .recipe import Recipe, no_published_recipe
from .setting import PaperSetting, Reported


class PredictiveCoding(Method):
    reads_clip = False                  # its step clips nothing (settings.clip)
    name = "pc"
    summary = "predictive coding (Whittington & Bogacz 2017): inference relaxes the states, then the weights step at them (the default); option incremental = 1 gives iPC"
    recipe = no_published_recipe(
        "Whittington & Bogacz 2017 (Neural Comput.) train small MLPs with a plain constant-rate "
        "update and Salvatori et al. (iPC, ICLR 2024) tune optimiser and rates per task and model; "
        "no one recipe to follow")
    null_note = ("nothing random in its credit, no null; Γ compares the prediction errors after a "
                 "finite inference with the true gradient, which they equal only as β → 0 at "
                 "convergence")
    option_defaults = {"beta": 1.0, "steps": 10, "alpha": 0.5, "incremental": 0}
    # steps: each inference step is one pass through the blocks per batch; published PC trains
    # with T of tens to a few hundred, so 1000 (100× the default) bounds a plan, not a typo
    option_ranges = {"beta": (1e-12, math.inf), "steps": (1, 1000), "alpha": (1e-6, 1.0),
                     "incremental": (0, 1)}
    option_help = {"beta": "strength β of the output clamp: F = E + β·CE",
                   "steps": "inference steps (gradient descent on the states) per batch",
                   "alpha": "inference step size on the states (pc: per sample, halved where a step "
                            "would raise F_i; iPC: fixed)",
                   "incremental": "1: iPC, the weights are updated at every inference step (uncompiled)"}

    # the paper's own setting, for `creditaudit reproduce` (methods/setting.py)
    paper_setting = PaperSetting(
        citation="Pinchetti et al. 2024 (\"Benchmarking predictive coding networks — made simple\", PCX)",
        code="liukidar/pcx (commit 5aa614d): examples/discriminative_experiments/MLP/mnist/L_PC_CE_mnist.yaml",
        dataset="mnist",
        width=128,
        blocks=3,
        activation="gelu",
        loss="ce",
        options={},
        epochs=25,
        recipe=Recipe(optimizer="adamw", lr=3.0e-4, weight_decay=3.3e-3, schedule="cosine", batch_size=128,
                      citation="liukidar/pcx L_PC_CE_mnist.yaml (AdamW, lr 3.0e-4, weight decay 3.3e-3, "
                               "warm-up cosine, batch 128, 25 epochs)"),
        reported=None,
        bp=None,
        deviations=("PCX's MNIST accuracy could not be read here: no paper number is compared; the "
                    "paper reports the best epoch per seed over the best 5 of 7 seeds",
                    "cosine schedule to 0 without PCX's 10 % warm-up and its floor at 0.1 × lr",
                    "the state updates use this tool's relaxation (methods/predictive_coding.py), "
                    "not PCX's SGD with momentum on the states (T = 5, x_lr 0.018)",
                    "inputs are standardised with MNIST's mean and std; PCX scales them to [−1, 1]"))

    def __init__(self, model, settings):
        super().__init__(model, settings)
        refuse_dropout(model, self.name, "its inference compares the energy F_i of one network "
                       "across trial steps")
        opts = self.resolve_options(settings.options)
        self.beta, self.steps, self.alpha = float(opts["beta"]), int(opts["steps"]), float(opts["alpha"])
        self.incremental = bool(opts["incremental"])
        self.opt = self.add_optimizer(self.embed_params() + self.trainable_block_params()
                                      + self.head_params())
        self._step_log: torch.Tensor | None = None
        self._res_sum: torch.Tensor | None = None
        self._count = 0

    # -- the energy and the inference ----------------------------------------------------------------
    def evaluate(self, h0: torch.Tensor, states: list[torch.Tensor], y: torch.Tensor,
                 params: list[torch.Tensor]):
        """F/β at the states h_1 … h_L with h_0 = h0 (its value; clamped), and its gradients
        (∂/∂h_0, ∂/∂h_1 … ∂/∂h_L, ∂/∂params). Returns (ε_1 … ε_L detached, F_i/β per sample
        (N,) detached, the gradients); F/β = Σ_i F_i/β."""
        with torch.enable_grad():
            h0_leaf = h0.detach().requires_grad_(True)
            leaves = [s.detach().requires_grad_(True) for s in states]
            below = [h0_leaf] + leaves[:-1]
            errors = [h - self.model.advance(hb, block(hb)) for h, hb, block in zip(leaves, below, self.model.blocks)]
            energy = self.model.loss(self.model.readout(leaves[-1]), y, reduction="none") / len(y)
            for eps in errors:
                energy = energy + 0.5 * eps.pow(2).flatten(1).sum(-1) / self.beta          # ½‖ε_i‖²/β
            grads = torch.autograd.grad(energy.sum(), [h0_leaf] + leaves + params)
        return [eps.detach() for eps in errors], energy.detach(), grads

    def _free(self, h0: torch.Tensor):
        """The feed-forward pass from h0 (every ε = 0): (h_1 … h_L, logits), detached."""
        with torch.no_grad():
            states, h = [], h0.detach()
            for block in self.model.blocks:
                h = self.model.advance(h, block(h))
                states.append(h)
            return states, self.model.readout(h)

    def _state_step(self, states, grads, length: torch.Tensor | float):
        """h_l ← h_l − α_i·β·∂(F/β)/∂h_l, l = 1 … L (grads: the state part of `evaluate`'s;
        length: α, or per sample (N,))."""
        if isinstance(length, torch.Tensor):
            length = length.view((-1,) + (1,) * (states[0].dim() - 1))
        return [s - (length * self.beta) * g for s, g in zip(states, grads)]

    def infer(self, h0: torch.Tensor, y: torch.Tensor, with_margin: bool = False):
        """`steps` inference steps from the feed-forward pass, each a trial step of length α_i per
        sample that is kept only where it does not raise F_i (else α_i is halved: a masked update,
        no host sync). Returns (h_1 … h_L after them, the free logits, ‖∂(F/β)/∂h‖ at the free
        states, = ‖∂CE/∂h_L‖ of the mean CE over the batch: the unit of pc_residual).
        with_margin: a rise of F_i within its rounding error (`ep.rounding_margin`) counts as no
        rise (the diagnosis' inference, `credit`); False keeps training's strict test."""
        states, logits = self._free(h0)
        margin = rounding_margin(logits) if with_margin else None
        _, energy, grads = self.evaluate(h0, states, y, [])
        grads = list(grads[1:])
        scale = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        length = torch.full_like(energy, self.alpha)
        slack = 1 + 16 * torch.finfo(energy.dtype).eps
        for _ in range(self.steps):
            trial = self._state_step(states, grads, length)
            _, trial_energy, trial_grads = self.evaluate(h0, trial, y, [])
            bound = energy * slack if margin is None else energy * slack + margin
            ok = trial_energy <= bound                                              # F_i did not rise
            keep = ok.view((-1,) + (1,) * (states[0].dim() - 1))
            states = [torch.where(keep, t, s) for t, s in zip(trial, states)]
            grads = [torch.where(keep, t, g) for t, g in zip(trial_grads[1:], grads)]
            energy = torch.where(ok, trial_energy, energy)
            length = torch.where(ok, length, length / 2)
        return states, logits, scale

    def _fixed_steps(self, h0: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        """iPC's state dynamics at the current weights: `steps` steps of the fixed length α from the
        feed-forward pass (no trial, as `train_step` takes them), h_1 … h_L after them."""
        states, _ = self._free(h0)
        for _ in range(self.steps):
            states = self._state_step(states, self.evaluate(h0, states, y, [])[2][1:], self.alpha)
        return states

    # -- the update and the credit ------------------------------------------------------------------
    def _set_gradients(self, h0, states, y):
        """The weight gradients of F/β at `states` (module docstring); returns the state gradients."""
        params = self.trainable_block_params() + self.head_params()
        _, _, grads = self.evaluate(h0, states, y, params)
        a0, state_grads = grads[0], grads[1:len(states) + 1]
        embed = self.embed_params()
        for p, g in zip(params + embed, grads[len(states) + 1:]
                        + (torch.autograd.grad(h0, embed, a0, allow_unused=True)         # Σ a_0·∂h_0/∂θ
                           if embed else ())):                          # (the plain MLP has none)
            p.grad = g
        return state_grads

    def gradients(self, x, y):
        if not self.model.n_blocks:
            return self._shallow_gradients(x, y)
        h0 = self.model.embed_input(x)
        states, logits, scale = self.infer(h0, y)
        state_grads = self._set_gradients(h0, states, y)
        with torch.no_grad():
            residual = torch.stack([g.pow(2).sum() for g in state_grads]).sum().sqrt()
            self._step_log = residual / scale.clamp_min(torch.finfo(scale.dtype).tiny)
        return self.model.loss(logits, y).detach()

    def _shallow_gradients(self, x, y):
        """No blocks: no state to infer; a_0 = ∂CE/∂h_0 and the step is BP's."""
        loss = self.model.loss(self.model(x), y)
        loss.backward()
        return loss.detach()

    def train_step(self, x, y):
        """Plain pc: the base class's step (`gradients`, then the optimizer). iPC: `steps` times,
        one energy evaluation → a weight step and a state step (module docstring)."""
        if not self.incremental or not self.model.n_blocks:
            return super().train_step(x, y)
        with torch.no_grad():
            states, logits = self._free(self.model.embed_input(x))
        for _ in range(self.steps):
            self.clear_gradients()
            state_grads = self._set_gradients(self.model.embed_input(x), states, y)
            self.apply_gradients()
            states = self._state_step(states, state_grads, self.alpha)
        return self.model.loss(logits, y).detach()

    def compilable(self) -> bool:
        return not self.incremental

    def credit(self, x, y):
        """[a_0 … a_L] at the states after inference (module docstring), detached: plain pc's
        trial steps (`infer`), or for iPC the fixed steps its training takes (`_fixed_steps`; its
        weights held where they are, so the credit is that of the inference iPC runs, not plain pc's).

        Computed as the diagnosis must reproduce it (as ep's `credit`): on a float64 copy of the
        model, plain pc's trials judged with the rounding margin, returned in the model's dtype.
        Training's float32 test decides a confident sample's trials by rounding, and the states
        it keeps then differ by whole steps between machines, thread counts or the last bit of a
        weight (Γ moved by up to 4e-3 on a 1-ulp move of a zoo run's weights)."""
        twin = copy.copy(self)                     # the same method, reading the float64 model
        twin.model, x, dtype = float64_copy(self.model, x)
        return [a.to(dtype) for a in twin._credit(x, y, with_margin=True)]

    def trained_credit(self, x, y):
        """[a_0 … a_L] exactly as a training step infers them: the model itself, in its own
        dtype, plain pc's trials judged by training's strict test (F_i ≤ F_i·(1 + 16 eps)); iPC's
        fixed steps as in `credit`. The diagnosis reports its Γ beside `credit`'s
        (docs/PROTOCOL.md §3.13)."""
        return self._credit(x, y, with_margin=False)

    def _credit(self, x, y, with_margin: bool):
        h0 = self.model.embed_input(x).detach()
        if not self.model.n_blocks:
            return [ce_gradient(self.model.readout, h0, y)[1]]
        states = (self._fixed_steps(h0, y) if self.incremental
                  else self.infer(h0, y, with_margin=with_margin)[0])
        errors, _, grads = self.evaluate(h0, states, y, [])
        return [grads[0].detach()] + [(-eps / self.beta).detach() for eps in errors]

    # -- convergence log ----------------------------------------------------------------------------
    def apply_gradients(self):
        super().apply_gradients()
        if self._step_log is not None:          # eagerly, outside a compiled step (see ep.py)
            ratio, self._step_log = self._step_log, None
            self._res_sum = ratio.double() if self._res_sum is None else self._res_sum + ratio
            self._count += 1

    def epoch_log(self) -> dict[str, float]:
        """{"pc_residual": the mean relative stationarity residual at the updated states} over
        the steps since the last call; empty when none was logged."""
        if not self._count:
            return {}
        out = {"pc_residual": float(self._res_sum) / self._count}
        self._res_sum, self._count = None, 0
        return out
