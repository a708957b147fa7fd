"""kolen-pollack — feedback learned alongside the forward weights (Kolen & Pollack 1994; Akrout,
Wilson, Humphreys, Lillicrap & Tweed 2019), routed like fa.

Every block Linear/Conv2d sends the error backward through its own B (fa's routing,
methods/fa.py), and B receives the very update W receives:

    Linear  y = x·Wᵀ + b:   δx = δy · B                                   (fa's backward)
            ∂W = δyᵀ · x                                                  the usual weight gradient
            ∂B = ∂W                                                       Kolen–Pollack: the same update
    θ ← AdamW(θ, ∂θ) for θ ∈ {W, B}, with the run's lr, schedule, and the decay λ_KP on W and B

Akrout et al. write B in the transposed layout of the backward pass (ΔB = ΔWᵀ); fa stores B in W's
own layout (δx = δy · B), so there the same update is ∂B = ∂W. With AdamW and identical gradient
streams, W and B get identical Adam steps, so their difference only decays:

    W_t − B_t = (W_0 − B_0) · Π_s (1 − lr_s · λ_KP)                        (exact; tested)

B starts as fa's draw U(−1/√fan_in, 1/√fan_in). Only the B of trainable blocks learn (a frozen block
keeps W and B, so the frozen control stays bit-identical); the embedding, readout and skips
backpropagate exactly, so a_L = g_L.

The decay is what aligns B with W, and how far it gets is a budget: after T steps
‖W_T − B_T‖ = ‖W_0 − B_0‖ · Π_s (1 − lr_s·λ). The routed block weights W and their B decay with the
option `decay` (λ_KP, default 10) in place of the run's weight decay (biases, LayerNorms, embedding
and head keep the run's λ_wd). Why 10: under the run's λ_wd = 0.01 with lr 1e-3 (cosine) the zoo's
MNIST-1D run (15 epochs × 32 steps, Σ lr_s ≈ 0.26) multiplies W − B by 0.997 — B never approaches
W, and cos(W, B) ends at 0.2–0.4, so what an audit of that run measured was shared updates on
independent random B, not Kolen–Pollack's B → W. With λ_KP = 10 the same budget gives
Π(1 − lr_s·λ) ≈ e^{−2.57} = 0.077 (measured), in the regime of Akrout et al. (their B converge to W);
the measured alignment is in docs/RULES.md. A longer run contracts further (CIFAR-10, 100 epochs:
e^{−195}); `decay` = the run's weight decay gives the former behaviour.

Where it differs from the original (Akrout et al. 2019, SGD with momentum on ResNet-18/50, weight
decay 1e-4, ~90 ImageNet epochs):
  * the optimizer is AdamW with decoupled decay (W ← W(1 − lr·λ) then the Adam step), not SGD with
    λ added to the gradient; since W and B see identical gradients their Adam states and steps are
    identical, so W − B contracts exactly as under SGD (the factor Π(1 − lr_s·λ) is the same;
    tested under torch.optim.SGD too).
  * the decay on W and B is the method's λ_KP, stronger than the run's λ_wd, so that the short
    runs this tool audits reach the aligned regime (above); the published runs reach it through
    their length.
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


class KolenPollack(FA):
    """fa whose feedback B learns with W's own update while W and B decay by λ_KP, so W − B contracts."""

    name = "kolen-pollack"
    paper = False                       # fa's subclass, not one of the paper's seven
    summary = ("Kolen–Pollack (Akrout et al. 2019): fa's routing, B learns W's update; W and B decay "
               "by λ_KP so W − B contracts")
    random_feedback = True              # the null: B from its initial distribution (module docstring)
    null_note = ("B is learned, so the null draws B from its initial distribution: Γ − null is what "
                 "learning the feedback bought over a feedback that had stayed random")

    option_defaults = {"decay": 10.0}
    option_ranges = {"decay": (0.0, 1e4)}
    option_help = {"decay": "weight decay λ_KP of the routed block weights W and their B: W − B "
                            "contracts by (1 − lr·λ_KP) per step (module docstring: why 10)"}
    trainable_only_options = {"decay": 10.0}    # it acts on trainable blocks' W and B only

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
        # B's own optimizer: the run's lr and schedule, decay λ_KP, as W's
        self.feedback_opt = self.add_optimizer([b for _, b in self.pairs]) if self.pairs else None
        if self.feedback_opt is not None:
            self.feedback_opt.param_groups[0]["weight_decay"] = decay

    def gradients(self, x, y):
        loss = super().gradients(x, y)                  # fa: δ flows through B, ∂W = δᵀx
        for weight, feedback in self.pairs:
            feedback.grad = weight.grad                  # ∂B = ∂W (read-only for AdamW)
        return loss
