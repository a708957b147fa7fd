"""kolen-pollack — feedback learned alongside the forward weights (Kolen & Pollack 1994; Akrout,
Wilson, Humphreys, Lillicrap & Tweed 2019), routed like fa.

Every block Linear/Conv2d sends the error backward through its own B (fa's routing,
methods/fa.py), and B receives the very update W receives:

    Linear  y = x·Wᵀ + b:   δx = δy · B                                   (fa's backward)
            ∂W = δyᵀ · x                                                  the usual weight gradient
            ∂B = ∂W                                                       Kolen–Pollack: the same update
    θ ← optimiser(θ, ∂θ) for θ ∈ {W, B}, with the run's recipe (lr, weight decay λ_wd, schedule)

Akrout et al. write B in the transposed layout of the backward pass (ΔB = ΔWᵀ); fa stores B in W's
own layout (δx = δy · B), so there the same update is ∂B = ∂W. With identical gradient streams the
difference D = W − B moves by the weight decay alone (exact; tested):

    AdamW (the shared recipe):  D_t = D_0 · Π_s (1 − lr_s · λ_wd)
    SGD, momentum μ, L2 decay (the published recipe, `recipe` below; as Akrout et al.'s
    ImageNet training):         v ← μ·v + λ_wd·D,  D ← D − lr·v

B starts as fa's draw U(−1/√fan_in, 1/√fan_in) and tends to W as the weight decay acts. Only the
B of trainable blocks learn (a frozen block keeps W and B, so the frozen control stays
bit-identical); the embedding, readout and skips backpropagate exactly, so a_L = g_L.

Credit: a_l = ∂CE/∂h_l with the error carried through the current B (fa's `credit`); sign
convention: the direction of increasing loss, as BP's g_l.

Γ's null (`random_feedback` True): K fresh B drawn from B's *initial* distribution (fa's draw), at
the trained weights. For fa the null asks whether the weights aligned to their own fixed B beyond
chance; here B itself has learned towards W, so Γ − null measures what learning the feedback (and
the weights' alignment to it) bought over a feedback that had stayed random.
"""
from __future__ import annotations

from .fa import FA, routed_modules
from .recipe import Recipe, step_at


class KolenPollack(FA):
    """fa whose feedback B learns with W's own update and weight decay, so B → W over training."""

    name = "kolen-pollack"
    # the ImageNet ResNet recipe: SGD momentum 0.9, lr 0.1, weight decay 1e-4 (on W and B alike:
    # KP's decay is what pulls B to W), lr × 0.1 at epochs 30 and 60 of 90
    recipe = Recipe(
        optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=1e-4, schedule="step",
        milestones=step_at((30, 60), of=90), gamma=0.1,
        citation="Akrout et al. 2019 (NeurIPS), ImageNet ResNet-18/50 experiments: SGD momentum 0.9, "
                 "lr 0.1, weight decay 1e-4, lr × 0.1 every 30 of 90 epochs (the standard ResNet "
                 "ImageNet recipe; its batch 256 is not carried over). Their MNIST/CIFAR MLP code "
                 "(makrout/Deep-Learning-without-Weight-Transport fcnn/FCNN_KP.py) uses plain SGD, "
                 "lr 0.3, batch 128")
    paper = False                       # fa's subclass, not one of the paper's seven
    summary = "Kolen–Pollack (Akrout et al. 2019): fa's routing, B learns W's update and decay, B → W"
    random_feedback = True              # the null: B from its initial distribution (module docstring)
    null_note = ("B is learned, so the null draws B from its initial distribution: Γ − null is what "
                 "learning the feedback bought over a feedback that had stayed random")

    def __init__(self, model, settings):
        super().__init__(model, settings)             # B ~ fa's draw; AdamW over embed, W, head
        self.pairs = [(module.weight, self.feedback[l][name])
                      for l, block in enumerate(model.blocks) if self.trainable(l)
                      for name, module in routed_modules(block)]
        # B's own AdamW: the run's lr, weight decay and cosine schedule, as W's
        self.feedback_opt = self.add_optimizer([b for _, b in self.pairs]) if self.pairs else None

    def gradients(self, x, y):
        loss = super().gradients(x, y)                  # fa: δ flows through B, ∂W = δᵀx
        for weight, feedback in self.pairs:
            feedback.grad = weight.grad                  # ∂B = ∂W (read-only for AdamW)
        return loss
