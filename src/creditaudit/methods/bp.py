"""bp — end-to-end backpropagation of the mean cross-entropy (the reference method).

    θ ← AdamW(θ, ∂CE/∂θ)            for embed, trainable blocks, out_ln, out_head
    a_l = g_l = ∂CE/∂h_l            (so Γ_l = 1 by construction)

On the member axis (K runs of one ResMLP shape): one backward of Σ_k CE_k gives each member
exactly ∂CE_k/∂θ_k, members sharing no parameter.
Where it differs from the original (backpropagation, Rumelhart, Hinton & Williams 1986): nothing in
the rule — autograd's gradient of the mean CE. The optimizer is this tool's (AdamW, cosine
schedule to 0, weight decay 0.01), as for every method; no gradient clipping.
"""
from __future__ import annotations

import torch.nn.functional as F

from ..metrics import bp_gradients
from ..model.members import member_cross_entropy
from ..model.resmlp import ResidualMLP
from ..model.resnet import SmallResNet
from ..model.vit import ViTMini
from .base import Method


class BP(Method):
    reads_clip = False                  # its step clips nothing (settings.clip)
    name = "bp"
    paper = True
    member_archs = (ResidualMLP, ViTMini, SmallResNet)

    def __init__(self, model, settings):
        super().__init__(model, settings)
        self.opt = self.add_optimizer(self.embed_params() + self.trainable_block_params()
                                      + self.head_params())
        # a frozen block's weights need no gradient: backward then skips forming it (a third of
        # that block's backward; the frozen control's). The error still flows through the block
        # to the embedding. (requires_grad, not autograd.grad over a list: backward() is what
        # the compiled step already traces on every torch it compiles on.)
        for l in range(self.model.n_blocks):
            if not self.trainable(l):
                for p in self.block_params(l):
                    p.requires_grad_(False)

    def gradients(self, x, y):
        loss = self.model.loss(self.model(x), y)
        loss.backward()
        return loss.detach()

    def credit(self, x, y):
        return bp_gradients(self.model, x, y).grads

    def exact_positions(self, n_blocks):
        """Every position: bp's credit is the reference itself, so its Γ_l = 1 everywhere and its
        deep Γ is "n/a (exact by construction)" — a Γ of 1 is no finding about bp."""
        return frozenset(range(n_blocks + 1))

    def member_gradients(self, stack, x, y):
        net = stack.net
        h = net.embed_input(x)
        for l in range(net.n_blocks):
            h = h + net.block(l, h)                       # h_{l+1} = h_l + f_l(h_l), per member
        ce = member_cross_entropy(net.readout(h), y)      # (K,)
        ce.sum().backward()
        return ce.detach()
