"""kolen-pollack — feedback learned alongside the forward weights (Kolen & Pollack 1994; Akrout,
Wilson, Humphreys, Lillicrap & Tweed 2019), routed like fa.

Every block Linear/Conv2d sends the error backward through its own B (fa's routing,
methods/fa.py), and B receives the very update W receives:

    Linear  y = x·Wᵀ + b:   δx = δy · B                                   (fa's backward)
            ∂W = δyᵀ · x                                                  the usual weight gradient
            ∂B = ∂W                                                       Kolen–Pollack: the same update
    θ ← optimiser(θ, ∂θ) for θ ∈ {W, B}, with the run's recipe (lr, schedule); W and B decay by the
    option λ_KP (`decay`), every other parameter by the recipe's λ_wd

Akrout et al. write B in the transposed layout of the backward pass (ΔB = ΔWᵀ); fa stores B in W's
own layout (δx = δy · B), so there the same update is ∂B = ∂W. With identical gradient streams the
difference D = W − B moves by the weight decay alone (exact; tested):

    AdamW (the shared recipe):  D_t = D_0 · Π_s (1 − lr_s · λ_KP)
    SGD, momentum μ, L2 decay (the published recipe, `recipe` below; as Akrout et al.'s
    ImageNet training):         v ← μ·v + λ_KP·D,  D ← D − lr·v   (plain SGD, μ = 0: Π_s (1 − lr_s·λ_KP))

B starts as fa's draw U(−1/√fan_in, 1/√fan_in). Only the B of trainable blocks learn (a frozen block
keeps W and B, so the frozen control stays bit-identical); the embedding, readout and skips
backpropagate exactly, so a_L = g_L.

The decay is what aligns B with W, and how far it gets is a budget. The routed block weights W
and their B decay with the option `decay` (λ_KP, default 0.02) in place of the recipe's weight
decay (biases, LayerNorms, embedding and head keep the recipe's λ_wd). Under SGD with momentum μ,
D contracts at the rate lr_s·λ_KP/(1 − μ) per step once the momentum has built up, so over a run
‖D_T‖ ≈ ‖D_0‖·exp(−Σ_s lr_s·λ_KP/(1 − μ)).
  * Akrout et al.'s own regime: λ = 1e-4 over ~450k ImageNet steps at lr 0.1 → 0.001 gives
    Σ lr_s·λ/(1 − μ) ≈ 17, so D shrinks to ~e^{−17}: B ≈ W.
  * The zoo's MNIST-1D budget (15 epochs × 32 steps under the published recipe, Σ lr_s ≈ 17.8) with
    their λ = 1e-4 gives a factor 0.98 only; λ_KP = 0.02 gives ≈ e^{−3.6} ≈ 0.03, in the regime
    (B near W): hence the default.
  * Under the shared recipe (AdamW, lr 1e-3 cosine, Σ lr_s ≈ 0.26 on the same budget) λ_KP = 0.02
    leaves D at 0.995 of its size: there Kolen–Pollack is *out of its regime*, and what an audit
    of it measures is shared updates on an independent random B. `--option decay=10` puts it in
    the regime under AdamW (≈ e^{−2.6}). docs/RULES.md states which was audited.
A longer run contracts further; `decay` = the recipe's weight decay gives Akrout et al.'s λ.

Where it differs from the original (Akrout et al. 2019, SGD with momentum on ResNet-18/50, weight
decay 1e-4, ~90 ImageNet epochs):
  * the decay on W and B is the method's λ_KP, stronger than the paper's 1e-4, so that the short
    runs this tool audits reach the aligned regime (above); the published runs reach it through
    their length. Under the shared AdamW the decay is decoupled (W ← W(1 − lr·λ) then the Adam
    step); W and B see identical gradients, so their Adam steps are identical and W − B contracts
    by Π(1 − lr_s·λ) exactly (tested, and under torch.optim.SGD too).
  * B lives in W's layout (∂B = ∂W rather than ΔB = ΔWᵀ): the same rule.
  * the embedding and readout have no B (exact gradients), like every fa-family rule here; the
    paper's networks send feedback through every layer.

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
    """fa whose feedback B learns with W's own update while W and B decay by λ_KP, so W − B contracts."""

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
    summary = ("Kolen–Pollack (Akrout et al. 2019): fa's routing, B learns W's update; W and B decay "
               "by λ_KP so W − B contracts")
    random_feedback = True              # the null: B from its initial distribution (module docstring)
    null_note = ("B is learned, so the null draws B from its initial distribution: Γ − null is what "
                 "learning the feedback bought over a feedback that had stayed random")

    option_defaults = {"decay": 0.02}
    option_ranges = {"decay": (0.0, 1e4)}
    option_help = {"decay": "weight decay λ_KP of the routed block weights W and their B: W − B "
                            "contracts by lr·λ_KP/(1 − momentum) per step (module docstring: why 0.02, and the "
                            "shared recipe, where it needs ~10)"}
    trainable_only_options = {"decay": 0.02}    # it acts on trainable blocks' W and B only

    def __init__(self, model, settings):
        super().__init__(model, settings)             # B ~ fa's draw; one optimizer over embed, W, head
        decay = float(self.option(settings.options, "decay"))
        self.pairs = [(module.weight, self.feedback[l][name])
                      for l, block in enumerate(model.blocks) if self.trainable(l)
                      for name, module in routed_modules(block)]
        weights = {id(w) for w, _ in self.pairs}
        for opt in self.optimizers:                   # W moves to a group of its own with decay λ_KP
            for group in opt.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in weights]
            if self.pairs:
                opt.add_param_group({"params": [w for w, _ in self.pairs], "weight_decay": decay})
        # B's own optimizer: the recipe's lr and schedule, decay λ_KP, as W's
        self.feedback_opt = self.add_optimizer([b for _, b in self.pairs]) if self.pairs else None
        if self.feedback_opt is not None:
            self.feedback_opt.param_groups[0]["weight_decay"] = decay

    def gradients(self, x, y):
        loss = super().gradients(x, y)                  # fa: δ flows through B, ∂W = δᵀx
        for weight, feedback in self.pairs:
            feedback.grad = weight.grad                  # ∂B = ∂W (read-only for AdamW)
        return loss
