"""pepita — "present the error to perturb the input" (Dellaferrera & Kreiman 2022, "Error-driven input
modulation: solving the credit assignment problem without a backward pass"; Srinivasan et al. 2023,
"Forward learning with top-down feedback"), on the residual stream.

The original, for an MLP h_l = σ(W_l h_{l−1}) with h_0 = x: a clean forward gives the output error e;
a second forward from the modulated input x + F·e (F a fixed random (D_in, C) matrix,
F = 0.05 · U(−√(6/D_in), √(6/D_in)) in the reference code, GiorgiaD/PEPITA) gives h_l^mod; then, with
no backward pass and no weight transport,

    ΔW_l   = mean_i (h_l − h_l^mod)_i ⊗ (h_{l−1}^mod)_i          every hidden layer (h_0^mod = x + F·e)
    ΔW_out = mean_i e^mod_i ⊗ (h_{L−1}^mod)_i                   the last layer,  W ← W − η·ΔW

where h_l is a layer's output after its nonlinearity. Here, on embed → blocks → readout, with the
ResidualMLP's block f_l(h) = W2·u_l + b2, u_l = act(W1·LN(h) + b1):

    e           = softmax(readout(h_L)) − onehot(y)                clean forward, (N, C)
    F           = scale · B,  B ~ U(−√(6/D), √(6/D)), (D, C)       D = prod(stream_shape); scale = 0.05
    h_0^mod     = h_0 + F·e                                         the modulation enters at h_0
    h_{l+1}^mod = h_l^mod + f_l(h_l^mod)                            modulated forward (no gradient)
    a_l         = (h_l − h_l^mod) / scale                           l = 0 … L   (a_0 = −B·e)

    block l, rule "pepita" (default), PEPITA's own per-layer rule inside the block:
        ΔW1 = mean_i ((u_l − u_l^mod)/scale)_i ⊗ LN(h_l^mod)_i,     Δb1 = mean_i ((u_l − u_l^mod)/scale)_i
        ΔW2 = mean_i (a_{l+1})_i ⊗ (u_l^mod)_i,                      Δb2 = mean_i (a_{l+1})_i
        (W2's output enters the stream, so its "layer activity" is h_{l+1}; the LayerNorm's gain and
        bias, which the original has no counterpart of, get no update and keep their initial 1, 0)
    block l, rule "backprop" (an option, not PEPITA): the local loss
        (f_l(h_l^mod) · a_{l+1}).sum(-1).mean() — W2's update as above, W1 and the LayerNorm trained
        by backpropagating a_{l+1} through W2 inside the block
    embed:    (embed(x) · a_0).sum(-1).mean()                       ΔW_embed = −(B·e) ⊗ x
    head:     CE(readout(h_L.detach()), y)                          the true gradient, as for every method

Where it differs from the original, and why:
  * the modulation enters at h_0 = embed(x), the input of the residual stream, not at the raw input x:
    a method here sees no input layout (images, tokens, features), while every stream has
    D = prod(stream_shape) values per sample; F's published scale is kept with the stream's D in place
    of D_in. The embedding is then PEPITA's first layer with the roles of input and output swapped:
    its own output difference is the modulation itself, so it learns DFA-style from −B·e ⊗ x.
  * the skip connections carry the modulation to every depth: a_{l+1} = a_l − (f_l(h_l^mod) − f_l(h_l))/scale,
    so on a near-identity stack every block's credit is ≈ −B·e, one shared random projection of the
    error corrected by the blocks' Jacobians (in the original each layer's difference comes only
    through the layers below it, with no skip). The audit's Γ null redraws B.
  * the readout trains on the CE gradient of the clean pass (the original: e^mod ⊗ h^mod of the last
    hidden layer) — every method of this tool trains the head on the true CE.
  * the update is divided by `scale` (the credit stays O(1) whatever the modulation strength and
    tends, as scale → 0, to the linearised signal a_l = −(∂h_l/∂h_0)·B·e); the original's η absorbs it.
  * the optimizer is the run's (AdamW, cosine schedule, per-block clip at settings.clip), not the
    reference's SGD with momentum 0.9 and step decay; the activation is the model's (GELU by default,
    ReLU in the reference); no dropout (the reference shares one mask between its two passes).
  * the rule "pepita" is written for the ResidualMLP's block (W1, activation, W2); other block types
    (ViT, ResNet) train with rule "backprop", which is a choice of this tool, not PEPITA.

Measured (MNIST-1D, d = 256, L = 4, batch 128, seed 42, one thread, 15 epochs, F at the published
scale): rule "pepita" test accuracy 0.396, median ‖h_L‖/‖h_0‖ 8.4, Γ per layer on 512 test samples
0.13 / 0.22 / 0.22 / 0.20 / 0.17; rule "backprop" 0.360, 10.7, 0.08 / 0.14 / 0.13 / 0.11 / 0.09
(bp 0.697 ± 0.006 over three seeds, docs/RULES.md). Before training code 3 (rule "backprop",
B ~ N(0, 1/C): a modulation 3.6× the published one) 5 epochs gave 0.306 (bp 0.610). Two forwards
and one local backward per step.
"""
from __future__ import annotations

import math

import torch

from ..errors import CreditAuditError
from ..model.resmlp import ACTIVATIONS, Block
from .local import LocalForward, LocalMethod, output_error
from .recipe import Recipe, step_at


def draw_modulation(model, gen: torch.Generator) -> torch.Tensor:
    """B ~ U(−√(6/D), √(6/D)), shape (D, C), D = prod(model.stream_shape) (the reference's He-uniform
    draw; F = scale · B): drawn in float64 on the CPU from `gen` (the same draw on every device), then
    moved to the model's device and dtype."""
    d, c = math.prod(model.stream_shape), model.n_classes
    bound = math.sqrt(6.0 / d)
    like = model.head_parameters()[0]
    return ((torch.rand(d, c, generator=gen, dtype=torch.float64) * 2 - 1) * bound).to(
        device=like.device, dtype=like.dtype)


def hidden_units(block: Block, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(LN(h), u = act(W1·LN(h) + b1)): W1's input and output in the ResidualMLP's block."""
    z = block.ln(h)
    return z, ACTIVATIONS[block.activation](block.w1(z))


class PEPITA(LocalMethod):
    name = "pepita"
    summary = "PEPITA (Dellaferrera & Kreiman 2022): a second forward from the input modulated by the output error; no backward pass"
    # SGD with momentum 0.9, no weight decay, η × 0.1 at epochs 60 and 90 of 100, batch 64
    recipe = Recipe(
        optimizer="sgd", lr=0.01, momentum=0.9, weight_decay=0.0, schedule="step",
        milestones=step_at((60, 90), of=100), gamma=0.1, batch_size=64,
        citation="Dellaferrera & Kreiman 2022 (ICML), fully connected experiments, and their "
                 "reference code GiorgiaD/PEPITA: functions.py (update_type mom: momentum 0.9; eta × 0.1 "
                 "at epochs 60 and 90 of 100), README (batch 64; lr 0.1 in its MNIST example, 0.01 the "
                 "CIFAR setting and main_pytorch.py's default), no weight decay")
    random_feedback = True
    option_defaults = {"scale": 0.05, "rule": "pepita"}
    option_ranges = {"scale": (1e-6, 10.0)}
    option_choices = {"rule": ("pepita", "backprop")}
    option_help = {"scale": "modulation strength: F = scale · B, B ~ U(±√(6/D)) (0.05: the published "
                            "F); the credit is (h − h^mod)/scale",
                   "rule": "pepita: every block layer by PEPITA's (h − h^mod) ⊗ h_in^mod (published); "
                           "backprop: W1 by backprop through W2 inside the block (not PEPITA)"}
    trainable_only_options = {"rule": "pepita"}     # the rule acts only on trainable blocks

    def __init__(self, model, settings):
        super().__init__(model, settings)
        options = self.resolve_options(settings.options)
        self.scale = float(options["scale"])                              # a Python number, read once
        self.per_layer = options["rule"] == "pepita"
        if self.per_layer:
            other = sorted({type(model.blocks[l]).__name__ for l in settings.trainable_blocks
                            if not isinstance(model.blocks[l], Block)})
            if other:
                raise CreditAuditError(f"pepita's rule 'pepita' is written for the ResidualMLP's block, "
                                       f"not {', '.join(other)}; set option rule = \"backprop\"")
        self.feedback = draw_modulation(model, self.gen)                 # B
        self.opt = self.add_optimizer(self.local_param_groups())

    def _passes(self, h0: torch.Tensor, y: torch.Tensor, feedback: torch.Tensor):
        """The clean pass and the modulated one (`local_stack`, with the local losses' graph):
        returns (clean h_0 … h_L, detached; the modulated LocalForward; the clean logits, whose
        graph (when grad is on) reaches the head only)."""
        with torch.no_grad():
            clean = [h0.detach()]
            for block in self.model.blocks:
                clean.append(self.model.advance(clean[-1], block(clean[-1])))
        logits = self.model.readout(clean[-1])
        e = self.model.output_error(logits.detach(), y)                  # e = softmax − onehot
        shift = (e @ feedback.T).view(h0.shape) * self.scale            # F·e
        return clean, self.local_stack(h0, clean[0] + shift), logits

    def _credit(self, clean, modulated) -> list[torch.Tensor]:
        """a_l = (h_l − h_l^mod)/scale, l = 0 … L (detached)."""
        return [(c - m).detach() / self.scale for c, m in zip(clean, modulated)]

    @torch.no_grad()
    def _per_layer_gradients(self, clean, mod, credit) -> None:
        """PEPITA's rule on each trainable block's two layers (module docstring): W1 from its own
        units' difference u − u^mod at its modulated input LN(h^mod), W2 from the stream's
        a_{l+1} at its modulated input u^mod; batch means, in the per-scale units of the credit."""
        n = clean[0].shape[0]
        for l in mod.branches:
            block = self.model.blocks[l]
            z_mod, u_mod = hidden_units(block, mod.hidden[l])
            c1 = (hidden_units(block, clean[l])[1] - u_mod) / self.scale       # (u − u^mod)/scale
            a = credit[l + 1]
            block.w1.weight.grad = c1.T @ z_mod / n                             # ΔW1
            block.w1.bias.grad = c1.mean(0)
            block.w2.weight.grad = a.T @ u_mod / n                              # ΔW2
            block.w2.bias.grad = a.mean(0)
            torch.nn.utils.clip_grad_norm_(self.block_params(l), self.settings.clip)

    def gradients(self, x, y):
        h0 = self.model.embed_input(x)
        clean, mod, logits = self._passes(h0, y, self.feedback)
        credit = self._credit(clean, mod.hidden)
        # the head trains on the clean pass's readout of h_L.detach() (graph to the head only)
        if self.per_layer:
            loss = self.local_gradients(y, LocalForward(logits, mod.hidden, h0, {}), credit)
            self._per_layer_gradients(clean, mod, credit)
            return loss
        return self.local_gradients(y, LocalForward(logits, mod.hidden, h0, mod.branches), credit)

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
