"""fa — feedback alignment (Lillicrap et al. 2016) on the pre-LN residual MLP.

Every Linear y = W·x + b inside the residual blocks keeps its forward pass and its weight gradient,
but sends the error backward through a fixed random matrix B (same shape as W) instead of Wᵀ:

    δx = δy · B              (BP: δy · W)
    ∂W = δyᵀ · x,  ∂b = Σ_i δy_i                      the usual weight gradient

Everything else backpropagates exactly: the skip connections, the LayerNorms, GELU, and the readout
(out_ln, out_head), so a_L = g_L. The credit a_l is the FA-propagated error at h_l, i.e. the
"gradient" of the mean CE at h_l under these rules; θ ← AdamW(θ, ∂CE/∂θ|_FA).

Choices (SPEC is silent):
  * B ~ U(−1/√fan_in, 1/√fan_in), the distribution nn.Linear initialises W from (W2's own small
    N(0, w2_std²) init is not copied: that would make the feedback path vanish).
  * embed gets no B: its error would only go on to the input x, which has nothing to train, so the
    embedding's update is the plain weight gradient δh_0ᵀ·x with δh_0 = a_0.
  * frozen blocks (not in settings.trainable_blocks) still pass the error down through their B;
    their weights are used detached, so no gradient is even computed for them.
B is drawn once from `self.gen` (derived from the seed) and saved in `extra_state`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..model import ACTIVATIONS
from .base import Method


class FeedbackLinear(torch.autograd.Function):
    """y = x·Wᵀ + b whose backward sends δx = δy·B instead of δy·W (x: (N, in), W, B: (out, in))."""

    @staticmethod
    def forward(ctx, x, weight, bias, feedback):
        ctx.save_for_backward(x, feedback)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, feedback = ctx.saved_tensors
        grad_x = grad_out @ feedback if ctx.needs_input_grad[0] else None    # δx = δy · B
        grad_w = grad_out.T @ x if ctx.needs_input_grad[1] else None         # ∂W = δyᵀ · x
        grad_b = grad_out.sum(0) if ctx.needs_input_grad[2] else None        # ∂b = Σ_i δy_i
        return grad_x, grad_w, grad_b, None


def draw_feedback(model, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """One B per block Linear, B ~ U(−1/√fan_in, 1/√fan_in), shape of W."""
    feedback = []
    for block in model.blocks:
        pair = {}
        for name in ("w1", "w2"):
            w = getattr(block, name).weight
            bound = 1.0 / math.sqrt(w.shape[1])
            b = (torch.rand(w.shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound
            pair[name] = b.to(device=w.device, dtype=w.dtype)
        feedback.append(pair)
    return feedback


class FA(Method):
    name = "fa"
    random_feedback = True

    def __init__(self, model, settings):
        super().__init__(model, settings)
        self.feedback = draw_feedback(model, self.gen)
        self.opt = self.add_optimizer(self.embed_params() + self.trainable_block_params()
                                      + self.head_params())

    def forward(self, h0: torch.Tensor, feedback, train: bool) -> list[torch.Tensor]:
        """[h_0, …, h_L] with every block Linear routed through FeedbackLinear.

        train=False (or a frozen block) uses detached parameters, so only the states carry grad.
        """
        act = ACTIVATIONS[self.model.blocks[0].activation] if self.model.n_blocks else None
        hidden = [h0]
        for l, block in enumerate(self.model.blocks):
            p = (lambda t: t) if (train and self.trainable(l)) else (lambda t: t.detach())
            z = F.layer_norm(hidden[-1], hidden[-1].shape[-1:], p(block.ln.weight), p(block.ln.bias),
                             block.ln.eps)
            z = act(FeedbackLinear.apply(z, p(block.w1.weight), p(block.w1.bias), feedback[l]["w1"]))
            f = FeedbackLinear.apply(z, p(block.w2.weight), p(block.w2.bias), feedback[l]["w2"])
            hidden.append(hidden[-1] + f)                                      # h_{l+1} = h_l + f_l(h_l)
        return hidden

    def train_step(self, x, y):
        hidden = self.forward(self.model.embed_input(x), self.feedback, train=True)
        loss = F.cross_entropy(self.model.readout(hidden[-1]), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()                                   # δ flows through B; ∂W = δᵀx as usual
        self.opt.step()
        return loss.detach()

    def _credit(self, x, y, feedback) -> list[torch.Tensor]:
        with torch.enable_grad():
            h0 = self.model.embed_input(x).detach().requires_grad_(True)
            hidden = self.forward(h0, feedback, train=False)
            logits = self.model.readout(hidden[-1])
            grads = torch.autograd.grad(F.cross_entropy(logits, y), hidden)
        return [g.detach() for g in grads]

    def credit(self, x, y):
        """a_l = ∂CE/∂h_l with the error carried through B instead of Wᵀ (a_L = g_L exactly)."""
        return self._credit(x, y, self.feedback)

    def fresh_feedback_credit(self, x, y, gen):
        return self._credit(x, y, draw_feedback(self.model, gen))

    def extra_state(self):
        return {"feedback": {f"block{l}": dict(pair) for l, pair in enumerate(self.feedback)}}

    def load_extra_state(self, state):
        saved = state.get("feedback", {})
        for l, pair in enumerate(self.feedback):
            for name in pair:
                pair[name].copy_(saved[f"block{l}"][name])
