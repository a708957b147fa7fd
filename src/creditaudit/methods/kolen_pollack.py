"""kolen-pollack — Kolen–Pollack feedback learning (Akrout, Wilson, Humphreys, Lillicrap & Tweed
2019, NeurIPS, "Deep learning without weight transport"; after Kolen & Pollack 1994).

fa with a learning B: every routed Linear/Conv2d sends the error backward through its own B (fa's
routing, methods/fa.py: the block modules, and on a plain network the readout too), and B
receives the very update W receives:

    Linear  y = x·Wᵀ + b:   δx = δy · B                                   (fa's backward)
            ∂W = δyᵀ · x                                                  the usual weight gradient
            ∂B = ∂W                                                       Kolen–Pollack: the same update
    W ← W − lr·(∂W + λ_KP·W),   B ← B − lr·(∂B + λ_KP·B)                  (the published plain SGD)

λ_KP is the option `decay`; every other parameter decays by the recipe's weight decay (0 in the
published recipe). Akrout et al. write B in the transposed layout of the backward pass (ΔB = ΔWᵀ,
their code: fcnn/FCNN_KP.py:72-73 updates B with delwᵀ); fa stores B in W's own layout
(δx = δy · B), so here the same update is ∂B = ∂W. With identical gradient streams the difference
D = W − B moves by the decay alone (exact; tested):

    plain SGD (the published recipe):   D_{t+1} = (1 − lr_t·λ_KP) · D_t
    SGD with momentum μ, L2 decay:      v ← μ·v + λ_KP·D,  D ← D − lr·v
    AdamW (--recipe shared):            D_{t+1} = (1 − lr_t·λ_KP) · D_t   (decoupled; the Adam
                                        steps of W and B are identical)

so ‖D_T‖ = ‖D_0‖·Π_t (1 − lr_t·λ_KP) ≈ ‖D_0‖·exp(−Σ_t lr_t·λ_KP) (÷(1 − μ) in the exponent with
momentum). Which B learn: every B of a trainable block, and on a plain network the readout's
B_out whenever some block trains (below). A frozen block keeps W and B, so the frozen control stays
bit-identical.

Published recipe (`recipe`), from the authors' released code (makrout/Deep-Learning-without-
Weight-Transport at 688f47a, "a Python version of the TensorFlow/TPU code" the paper links):
  * fcnn/FCNN_KP.py:64-73: plain SGD, W ← wd·W − (lr/batch)·Σ_batch ΔW and B likewise with ΔWᵀ;
    fcnn/FCNN_KP.py:30 defaults wd = 1 (a multiplicative factor: no decay) and main.py:122 calls
    train() without it, so the released runs have no weight decay and a constant lr;
  * run.sh:15: MNIST, 784-500-10, lr 0.3, batch 128, 400 epochs.
So: SGD, lr 0.3, momentum 0, no weight decay, constant lr, batch 128.
Default decay λ_KP = 1e-4: the paper's KP update carries a decay term λ on W and B alike (its
KP section, the equations the code comments at FCNN_KP.py:68-71 call "update equations 16 and
17"), and the value it trains with is that of its ImageNet experiments (ImageNet, ResNet-18/50:
weight decay 1e-4, the paper's experiments section and supplement). The ImageNet recipe's other
numbers (SGD with momentum, its lr schedule and batch) are ImageNet's and are not used here.

How far the decay gets on the audit's budget (MNIST-1D, 15 epochs × 32 steps, lr 0.3 constant):
Σ_t lr_t·λ_KP = 0.3·480·1e-4 ≈ 0.014, so W − B shrinks by ~1.4 % only. There, as in the released
MNIST code (no decay at all), B aligns with W through the shared updates, which grow W and B by the
same amount while D stays near D_0, not through the decay. `--option decay=0.02` contracts D by
≈ e^{−2.9} on that budget (the regime of Akrout et al.'s ~450k ImageNet steps, Σ lr·λ/(1 − μ) ≈
17). Measured (ResMLP d 256, L 4, MNIST-1D, 15 epochs, seed 42, CPU, one seed): λ_KP = 1e-4 test
accuracy 63.7 %, cos(W, B) 0.25–0.53; λ_KP = 0.02 50.4 %, cos 0.91–0.94; bp under this recipe
56.7 %. docs/RULES.md states which was audited.

Where it differs from the original (Akrout et al. 2019; ImageNet ResNets in the paper, a
sigmoid MLP on MNIST/CIFAR-10 in the released code):
  * on residual models (ResMLP, ViT, ResNet) only the block Linear/Conv2d modules have a B; the
    embedding, skips, LayerNorms and the readout backpropagate exactly, so a_L = g_L there. On
    the plain MLP (arch mlp) every layer, the readout included, sends its error through its B,
    as in the released code (fcnn/FCNN_FA.py:135: δ ← B·δ ⊙ σ′ from the output layer down).
  * the audit trains the ResMLP on MNIST-1D for 15 epochs, not 784-500-10 on MNIST for 400: the
    recipe is carried over unchanged (lr 0.3, batch 128, constant), the epoch count is the audit's.
  * the model's own loss (CE; the plain MLP may take per-class BCE, the released code's sigmoid
    output) and init (torch's U(±1/√fan_in) for W; B ~ fa's U(±1/√fan_in)), not the code's
    N(0, 1/(fan_in + fan_out)) for W, B and biases (fcnn/FCNN_BP.py:29-32, FCNN_FA.py:30).
  * biases step with the batch-mean gradient at lr; the released code divides the batch-mean
    bias gradient by the batch size once more (FCNN_KP.py:66-67 with FCNN_FA.py:136's mean).
  * B lives in W's layout (∂B = ∂W rather than ΔB = ΔWᵀ): the same rule.
  * on a plain network with every block frozen (the frozen control) B_out does not learn and
    W_out keeps the recipe's decay: B_out then carries error to nothing that trains, and the
    control stays the same run whatever λ_KP (`trainable_only_options`, runs.canonical_control).

Credit: a_l = ∂ℓ/∂h_l with the error carried through the current B (fa's `credit`); sign
convention: the direction of increasing loss, as BP's g_l. Positions exact by construction:
{L} on residual models, none on a plain network (fa's `exact_positions`).

Γ's null (`random_feedback` True): K fresh B drawn from B's *initial* distribution (fa's draw,
the readout's B_out included on a plain network), at the trained weights. For fa the null asks
whether the weights aligned to their own fixed B beyond chance; here B itself has learned towards
W, so Γ − null measures what learning the feedback (and the weights' alignment to it) bought over
a feedback that had stayed random.
"""
from __future__ import annotations

from .fa import FA, feedback_layers
from .recipe import Recipe
from .setting import AKROUT, AKROUT_DEVIATIONS, AKROUT_NETWORK, PaperSetting, Reported

DECAY = 1e-4      # λ_KP: the paper's ImageNet weight decay (module docstring)


class KolenPollack(FA):
    """fa whose feedback B learns with W's own update while W and B decay by λ_KP, so W − B contracts."""

    name = "kolen-pollack"
    # the authors' released code: plain SGD, lr 0.3, batch 128, no decay, constant lr (docstring)
    recipe = Recipe(
        optimizer="sgd", lr=0.3, momentum=0.0, weight_decay=0.0, schedule="constant", batch_size=128,
        citation="Akrout et al. 2019 (NeurIPS), their released code makrout/Deep-Learning-without-"
                 "Weight-Transport: fcnn/FCNN_KP.py:64-73 plain SGD on W and B (no momentum), "
                 "FCNN_KP.py:30 weight_decay=1 (a factor: no decay; main.py:122 does not set it), "
                 "run.sh:15 MNIST lr 0.3, batch 128, 400 epochs, constant lr. The KP decay λ on W "
                 "and B is the option decay (default 1e-4, the paper's ImageNet weight decay)")
    paper = False                       # fa's subclass, not one of the paper's seven
    summary = ("Kolen–Pollack (Akrout et al. 2019): fa's routing, B learns W's update; W and B decay "
               "by λ_KP so W − B contracts")
    random_feedback = True              # the null: B from its initial distribution (module docstring)
    null_note = ("B is learned, so the null draws B from its initial distribution: Γ − null is what "
                 "learning the feedback bought over a feedback that had stayed random")

    option_defaults = {"decay": DECAY}
    option_ranges = {"decay": (0.0, 1e4)}
    option_help = {"decay": "weight decay λ_KP of the routed weights W and their B: W − B contracts by "
                            "lr·λ_KP per SGD step (default 1e-4, the paper's ImageNet value; the module "
                            "docstring says how little that contracts in a short run, and 0.02)"}
    trainable_only_options = {"decay": DECAY}   # it acts on trainable units' W and B only

    # the paper's own setting, for `creditaudit reproduce` (methods/setting.py)
    paper_setting = PaperSetting(
        citation="Akrout et al. 2019 (NeurIPS), its MNIST code",
        code=f"{AKROUT}: run.sh:15, fcnn/FCNN_KP.py:30, 64-73",
        **AKROUT_NETWORK,
        options={"decay": 0.0},
        recipe=Recipe(optimizer="sgd", lr=0.3, weight_decay=0.0, schedule="constant", batch_size=128,
                      citation=f"{AKROUT}, run.sh:15 (plain SGD, lr 0.3, batch 128, 400 epochs, no decay)"),
        bp_recipe=Recipe(optimizer="sgd", lr=0.2, weight_decay=0.0, schedule="constant", batch_size=128,
                         citation=f"{AKROUT}, run.sh:7 (bp's run: lr 0.2)"),
        reported=Reported(1.55, "experiments/mnist/kp-V0/log.txt:2408 of the reference code (epoch 400)",
                          seeds=1, selection="final epoch"),
        bp=Reported(1.50, "experiments/mnist/bp-V0/log.txt:1211 of the reference code (epoch 400)",
                    seeds=1, selection="final epoch"),
        deviations=("the paper reports ImageNet only; its MNIST code applies no weight decay to W or "
                    "B (FCNN_KP.py:30), so λ_KP = 0 here",
                    "weights drawn N(0, 1/(fan_in + fan_out)) as the reference (init fan-sum-normal); "
                    "B drawn from U(±1/√fan_in), the reference draws it N(0, 1/(fan_in + fan_out))",
                    *AKROUT_DEVIATIONS))

    def __init__(self, model, settings):
        super().__init__(model, settings)             # B ~ fa's draw; one optimizer over embed, W, head
        decay = float(self.option(settings.options, "decay"))
        learns = [self.trainable(l) for l in range(model.n_blocks)]
        if not model.residual:      # the readout's B_out learns when its error reaches a trained block
            learns.append(any(learns))
        self.pairs = [(module.weight, self.feedback[l][name])
                      for l, modules in enumerate(feedback_layers(model)) if learns[l]
                      for name, module in modules]
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
            feedback.grad = weight.grad                  # ∂B = ∂W (read-only for the optimiser)
        return loss
