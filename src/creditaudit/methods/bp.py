"""bp — end-to-end backpropagation of the mean cross-entropy (the reference method).

    θ ← AdamW(θ, ∂CE/∂θ)            for embed, trainable blocks, out_ln, out_head
    a_l = g_l = ∂CE/∂h_l            (so Γ_l = 1 by construction)
"""
from __future__ import annotations

import torch.nn.functional as F

from ..metrics import bp_gradients
from .base import Method


class BP(Method):
    name = "bp"
    paper = True

    def __init__(self, model, settings):
        super().__init__(model, settings)
        self.opt = self.add_optimizer(self.embed_params() + self.trainable_block_params()
                                      + self.head_params())

    def gradients(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss.detach()

    def credit(self, x, y):
        return bp_gradients(self.model, x, y).grads
