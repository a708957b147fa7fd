"""pepita — "present the error to perturb the input" (Dellaferrera & Kreiman 2022, "Error-driven input
modulation: solving the credit assignment problem without a backward pass"), on the residual stream.

The original, for an MLP h_l = σ(W_l h_{l−1}) with h_0 = x: a clean forward gives the output error e;
a second forward from the modulated input x + F·e (F a fixed random (D_in, C) matrix) gives h_l^mod;
then ΔW_l = (h_l − h_l^mod) ⊗ h_{l−1}^mod for the hidden layers (h_0^mod = x + F·e), ΔW_out = e ⊗ h^mod
of the last hidden layer, W ← W − η·ΔW. No backward pass, no weight transport.

Adapted to the residual stream (this tool sees a model only through embed → blocks → readout):

    e        = softmax(readout(h_L)) − onehot(y)                 clean forward, (N, C)
    h_0^mod  = h_0 + F·e                                          F = scale · B, B ~ N(0, 1/C), (D, C)
    h_{l+1}^mod = h_l^mod + f_l(h_l^mod)                          modulated forward (no gradient)
    a_l      = (h_l − h_l^mod) / scale                            l = 0 … L   (a_0 = −B·e)

    block l:  (f_l(h_l^mod.detach()) · a_{l+1}).sum(-1).mean()   ΔW = a_{l+1} ⊗ (the layer's input in
              the modulated pass): for W2 of the ResMLP block exactly PEPITA's (h − h^mod) ⊗ h^mod
              of a hidden layer, divided by scale and averaged over the batch
    embed:    (embed(x) · a_0).sum(-1).mean()                    ΔW_embed = −(B·e) ⊗ x
    head:     CE(readout(h_L.detach()), y)                       the true gradient, as for every method

Where it differs from the original, and why:
  * the modulation enters at h_0, the input of the residual stream, not at the raw input x: a method
    here sees no input layout (images, tokens, features), while every stream has D = prod(stream_shape)
    values per sample. The embedding is then PEPITA's first layer with the roles of input and output
    swapped: its own output difference is the modulation itself, so it learns DFA-style from −B·e.
  * the readout trains on the CE gradient of the clean pass (the original: e ⊗ h^mod of the last
    hidden layer) — every method of this tool trains the head on the true CE.
  * the credit is divided by `scale`, so it stays O(1) whatever the modulation strength and tends,
    as scale → 0, to the linearised PEPITA signal a_l = −(∂h_l/∂h_0)·B·e.
  * the skip connections carry the modulation to every depth: a_{l+1} = a_l − (f_l(h_l^mod) − f_l(h_l))/scale,
    so on a near-identity stack every block's credit is ≈ −B·e, one shared random projection of the
    error (DFA with one matrix for all blocks) corrected by the blocks' Jacobians. The audit's Γ null
    redraws B.
  * the original draws F from a small uniform distribution scaled to the input; here B is DFA's
    N(0, 1/C) and `scale` sets the strength (default 0.05): |F·e| per feature ≈ scale · ‖e‖/√C.
The per-block clip at settings.clip applies as for the other local methods.

Measured (MNIST-1D, d = 256, L = 4, batch 128, seed 42, one thread, 5 epochs): test accuracy 0.306
(bp 0.610), Γ per layer on test batch 0 0.11 / 0.13 / 0.12 / 0.09 / 0.07, CPU time per epoch 1.1 s
(bp 0.79 s): two forwards, one local backward.
"""
from __future__ import annotations

import math

import torch

from .local import LocalForward, LocalMethod, output_error
from .recipe import Recipe, step_at


def draw_modulation(model, gen: torch.Generator) -> torch.Tensor:
    """B ~ N(0, 1/C), shape (D, C), D = prod(model.stream_shape): drawn in float64 on the CPU from
    `gen` (the same draw on every device), then moved to the model's device and dtype."""
    d, c = math.prod(model.stream_shape), model.n_classes
    like = model.head_parameters()[0]
    return (torch.randn(d, c, generator=gen, dtype=torch.float64) / math.sqrt(c)).to(
        device=like.device, dtype=like.dtype)


class PEPITA(LocalMethod):
    name = "pepita"
    # SGD with momentum 0.9, no weight decay, η × 0.1 at epochs 60 and 90 of 100, batch 64
    recipe = Recipe(
        optimizer="sgd", lr=0.01, momentum=0.9, weight_decay=0.0, schedule="step",
        milestones=step_at((60, 90), of=100), gamma=0.1, batch_size=64,
        citation="Dellaferrera & Kreiman 2022 (ICML), fully connected experiments, and their "
                 "reference code GiorgiaD/PEPITA: functions.py (update_type mom: momentum 0.9; eta × 0.1 "
                 "at epochs 60 and 90 of 100), README (batch 64; lr 0.1 in its MNIST example, 0.01 the "
                 "CIFAR setting and main_pytorch.py's default), no weight decay")
    random_feedback = True
    option_defaults = {"scale": 0.05}
    option_ranges = {"scale": (1e-6, 10.0)}
    option_help = {"scale": "modulation strength: F = scale · B, B ~ N(0, 1/C); the credit is "
                            "(h − h^mod)/scale"}

    def __init__(self, model, settings):
        super().__init__(model, settings)
        self.scale = float(self.option(settings.options, "scale"))     # a Python number, read once
        self.feedback = draw_modulation(model, self.gen)                 # B
        self.opt = self.add_optimizer(self.local_param_groups())

    def _passes(self, h0: torch.Tensor, y: torch.Tensor, feedback: torch.Tensor):
        """The clean pass and the modulated one (`local_stack`, with the local losses' graph):
        returns (clean h_0 … h_L, detached; the modulated LocalForward; the clean logits, whose
        graph (when grad is on) reaches the head only)."""
        with torch.no_grad():
            clean = [h0.detach()]
            for block in self.model.blocks:
                clean.append(clean[-1] + block(clean[-1]))
        logits = self.model.readout(clean[-1])
        e = output_error(logits.detach(), y)                             # e = softmax − onehot
        shift = (e @ feedback.T).view(h0.shape) * self.scale            # F·e
        return clean, self.local_stack(h0, clean[0] + shift), logits

    def _credit(self, clean, modulated) -> list[torch.Tensor]:
        """a_l = (h_l − h_l^mod)/scale, l = 0 … L (detached)."""
        return [(c - m).detach() / self.scale for c, m in zip(clean, modulated)]

    def gradients(self, x, y):
        h0 = self.model.embed_input(x)
        clean, mod, logits = self._passes(h0, y, self.feedback)
        credit = self._credit(clean, mod.hidden)
        # the head trains on the clean pass's readout of h_L.detach() (graph to the head only)
        fwd = LocalForward(logits, mod.hidden, h0, mod.branches)
        return self.local_gradients(y, fwd, credit)

    @torch.no_grad()
    def _credit_with(self, x, y, feedback):
        clean, mod, _ = self._passes(self.model.embed_input(x), y, feedback)
        return self._credit(clean, mod.hidden)

    def credit(self, x, y):
        return self._credit_with(x, y, self.feedback)

    def fresh_feedback_credit(self, x, y, gen):
        return self._credit_with(x, y, draw_modulation(self.model, gen))

    def extra_state(self):
        return {"feedback": {"B": self.feedback}}

    def load_extra_state(self, state):
        self.feedback.copy_(state["feedback"]["B"])
