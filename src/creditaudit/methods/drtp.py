"""drtp — direct random target projection (Frenkel, Lefebvre & Bol 2021), with a knob towards DFA.

DFA projects the output error e = ∂ℓ/∂logits to every block through a fixed random matrix. DRTP
projects the *target* alone, so a block's credit needs no forward result at all:

    s       = (1 − mix) · (−onehot(y)) + mix · e            mix = 0: DRTP, mix = 1: DFA   (N, C)
    B_l     shape (d, C), one per hidden layer/block, drawn once from the method's seeded generator
              feedback "normal" (default):    B_l ~ N(0, 1/C), a = rms_normalise(s · B_lᵀ)
              feedback "reference":           B_l ~ U(±√(6/d)), a = s · B_lᵀ   (see below)
    a_{l+1} = the projected signal at block l's output h_{l+1}

    block l:  (f_l(h_l.detach()) · a_{l+1}).sum(-1).mean()         (LocalMethod.local_gradients)
    embed:    (embed(x) · a_0).sum(-1).mean(),  a_0 = a_1            (residual models: DFA's mapping)
    readout:  ℓ(readout(h_L.detach()), y)                           the true gradient

On the plain MLP (arch mlp) a block is one layer h_{l+1} = act(W_l h_l + b_l), so the local loss's
gradient is the paper's rule: ∂/∂W_l = mean_i ((a_{l+1} ⊙ f'(z_l)) ⊗ h_l)_i, δ_l = (B_l s) ⊙ f'(z_l);
the input h_0 = x has no parameters, and `credit` reports a_0 as dfa does (`dfa.position_credit`:
a_1 pulled back through layer 0; the protocol's deep Γ skips position 0).

−onehot(y) points in the direction of increasing loss for the true class's logit (as e does), so
the sign convention of `credit` is the protocol's. The reference code projects +onehot(y) (its hook
returns labels·B as the layer's output gradient): with B's law symmetric about 0, −onehot·B and
+onehot·(−B) are the same rule. Γ's null redraws every B_l (same distribution), as dfa's.

The reference's own setting (ChFrenkel/DirectRandomTargetProjection, read at its HEAD): fully
connected tanh hidden layers (main.py --hidden-act tanh), sigmoid outputs trained with BCE
(--output-act sigmoid, --loss BCE; train.py: F.binary_cross_entropy, mean over N·C), the output
layer on the true gradient (models.py: the output block trains as "BP"), B per hidden layer drawn
by torch.nn.init.kaiming_uniform_ on a (C, d) tensor (module.py TrainingHook.reset_weights:
U(±√(6/d))), NAG (SGD, momentum 0.9, Nesterov) at lr 1e-4, batch 100, 100 epochs, constant lr
(the published recipe below). It runs here as

    creditaudit train --method drtp --arch mlp --arch-option loss=bce --activation tanh \
        --option feedback=reference ...

where feedback = "reference" is the reference's arithmetic, not only its draw:
  * B_l ~ U(±√(6/d)) (kaiming_uniform_'s law: fan_in d, gain √2), the projection not normalised;
  * each hidden layer's update is summed over the batch (the reference's hook returns s_i·B per
    sample as the layer's output gradient, with no 1/N), and no gradient is clipped;
  * under the BCE loss the readout's gradient is divided by C (torch's binary_cross_entropy
    averages over the C classes too; the model's BCE sums them, model/stream.py).
Remaining differences from the reference on the mlp: nn.Linear's default init U(±1/√fan_in) for
weights and biases (the reference's layers are nn.Linear too: the same law), dropout (off in both
by default) acts on a layer's output here and on its input there; the random draws differ.

Where the default (feedback "normal", and every run on the ResMLP) differs from the original:
  * the projected target is rms-normalised per sample, as dfa's credit (a constant per class, so
    only B's overall scale is lost); B_l ~ N(0, 1/C); updates are batch means.
  * on the residual models the projected target does not pass through a saturating nonlinearity: it
    is delivered at each residual block's output h_{l+1} and drives the linear residual branch f_l
    (W2 has no activation), whose parameters learn by backprop of it through the block. In the
    original the tanh derivative f' shrinks a unit's update as the unit saturates in the target's
    direction, which is what bounds DRTP's layers; here nothing does, and the stream grows with
    training (docs/RULES.md: ‖h_L‖ grows like dfa's). The embedding reuses B_0 (dfa's mapping).
  * the ResMLP's loss is softmax CE, its activation GELU, its readout out_ln + out_head trained on
    the true CE (the original's sigmoid output layer on the BCE error); per-block clip at
    settings.clip (the reference clips nothing); the optimiser is the
    published recipe (NAG, lr 1e-4, constant) unless --recipe shared gives the audit's AdamW.

The worked example of docs/WRITING_A_RULE.md:

    creditaudit audit --methods drtp dfa bp --dataset mnist1d --epochs 15 --out audits/drtp
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .dfa import dfa_credit, draw_feedback, position_credit
from .local import LocalMethod, sample_dot
from .recipe import Recipe
from .setting import PaperSetting, Reported


def draw_reference_feedback(model, gen: torch.Generator) -> list[torch.Tensor]:
    """B_l ~ U(±√(6/d)), shape (d, C), one per block: the law of the reference's
    kaiming_uniform_ on its (C, d) feedback tensor (fan_in d, gain √2), drawn in float64 on the CPU
    from `gen`, then moved to the model's device and dtype."""
    d, c = math.prod(model.stream_shape), model.n_classes
    bound = math.sqrt(6.0 / d)
    like = model.head_parameters()[0]
    return [((torch.rand(d, c, generator=gen, dtype=torch.float64) * 2 - 1) * bound)
            .to(device=like.device, dtype=like.dtype) for _ in range(max(model.n_blocks, 1))]


class DRTP(LocalMethod):
    """Direct random target projection; option `mix` blends in the output error (1 = DFA)."""

    name = "drtp"
    # SGD with Nesterov momentum 0.9 ("NAG"), lr 1e-4, constant, no weight decay, batch 100, 100 epochs
    recipe = Recipe(
        optimizer="sgd", lr=1e-4, momentum=0.9, nesterov=True, weight_decay=0.0,
        schedule="constant", batch_size=100,
        citation="Frenkel, Lefebvre & Bol 2021 (Front. Neurosci. 15:629892) and their reference code "
                 "ChFrenkel/DirectRandomTargetProjection: main.py defaults (--optimizer NAG, --lr 1e-4, "
                 "--batch-size 100, --epochs 100, --loss BCE, --hidden-act tanh, --output-act sigmoid) "
                 "and train.py (NAG = SGD, momentum 0.9, Nesterov; no weight decay, no LR schedule)")
    random_feedback = True                      # Γ gets its null: fresh_feedback_credit below
    summary = "direct random target projection (Frenkel et al. 2021): dfa's mapping of −onehot(y)"
    option_defaults = {"mix": 0.0, "feedback": "normal"}
    option_ranges = {"mix": (0.0, 1.0)}
    option_choices = {"feedback": ("normal", "reference")}
    option_help = {"mix": "0 = project the target only (DRTP), 1 = project the output error (DFA)",
                   "feedback": "normal: B ~ N(0, 1/C), rms-normalised, batch-mean updates; reference: "
                               "the reference code's arithmetic (B ~ U(±√(6/d)), unnormalised, hidden "
                               "updates summed over the batch, the BCE readout's gradient / C)"}

    # the paper's own setting, for `creditaudit reproduce` (methods/setting.py)
    paper_setting = PaperSetting(
        citation="Frenkel, Lefebvre & Bol 2021 (Frontiers in Neuroscience)",
        code="ChFrenkel/DirectRandomTargetProjection (commit b84e3fe): main.py:53-67, module.py:97, "
             "function.py:57-62",
        dataset="mnist-01",                # pixels in [0, 1], as the reference reads them
        width=500,
        blocks=1,
        activation="tanh",
        loss="bce",
        options={"feedback": "reference"},
        epochs=100,
        recipe=Recipe(optimizer="sgd", lr=1e-4, momentum=0.9, nesterov=True, weight_decay=0.0,
                      schedule="constant", batch_size=100,
                      citation="ChFrenkel/DirectRandomTargetProjection main.py:53-67 (the code's defaults: "
                               "Nesterov momentum 0.9, lr 1e-4, batch 100, 100 epochs)"),
        reported=Reported(4.58, "the authors' slides in the reference repository, talks/LightOnAIMeetUp.pdf, "
                                "slide 18, row 784-500-10", sd=0.12),
        bp=Reported(1.72, "the same slide, row 784-500-10, BP", sd=0.08),
        deviations=("the number comes from the authors' slides of the preprint; the journal's table "
                    "could not be read here, nor its per-rule learning rates",
                    "the recipe is the reference code's default, not necessarily the paper's tuned one",
                    "bp's loss sums the ten per-class binary cross-entropies, where the reference's "
                    "F.binary_cross_entropy also averages over the classes (train.py:72), so under SGD "
                    "bp steps 10× the reference's BP at the same lr; drtp's readout divides by the "
                    "class count as the reference does"))

    def __init__(self, model, settings):
        super().__init__(model, settings)
        options = self.resolve_options(settings.options)
        self.mix = float(options["mix"])                             # read once, not per step
        self.reference = options["feedback"] == "reference"
        draw = draw_reference_feedback if self.reference else draw_feedback
        self.draw = draw
        self.feedback = draw(model, self.gen)                         # B_l from (seed, "method:drtp")
        self.opt = self.add_optimizer(self.local_param_groups())     # embed, trainable blocks, head

    def _signal(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """s = (1 − mix) · (−onehot(y)) + mix · e."""
        target = -F.one_hot(y, logits.shape[-1]).to(logits.dtype)
        return target if self.mix == 0.0 else (1 - self.mix) * target + self.mix * self.model.output_error(logits, y)

    def _credit(self, logits, y, feedback, x=None) -> list[torch.Tensor]:
        credit = dfa_credit(self._signal(logits, y), feedback, self.model.n_blocks,
                            self.model.stream_shape, normalise=not self.reference)
        return position_credit(self.model, credit, x)     # the mlp: a_0 at the input (dfa's)

    def gradients(self, x, y):
        fwd = self.local_forward(x)                  # one forward: the model's and every local graph
        credit = self._credit(fwd.logits.detach(), y, self.feedback)
        if not self.reference:
            return self.local_gradients(y, fwd, credit)   # fused, per-block-clipped
        return self._reference_gradients(y, fwd, credit)

    def _reference_gradients(self, y, fwd, credit) -> torch.Tensor:
        """feedback = "reference": one backward of

            J = ℓ(readout(h_L.detach()), y) / (C under BCE, else 1)     torch's BCE means over N·C
              + Σ_i ⟨embed(x)_i, a_0,i⟩ + Σ_{l trainable} Σ_i ⟨f_l(h_l.detach())_i, a_{l+1,i}⟩

        — each hidden layer's output gradient is s_i·B_l per sample, summed over the batch with no
        1/N (the reference's hook), and nothing is clipped (the reference clips nothing)."""
        a = [t.detach() for t in credit]
        ce = self.model.loss(fwd.logits, y)
        total = ce / self.model.n_classes if self.model.loss_name == "bce" else ce
        total = total + sample_dot(fwd.h0, a[0]).sum()
        for l, f in fwd.branches.items():
            total = total + sample_dot(f, a[l + 1]).sum()
        total.backward()
        return ce.detach()

    @torch.no_grad()
    def credit(self, x, y):
        return self._credit(self.model(x), y, self.feedback, x)

    @torch.no_grad()
    def fresh_feedback_credit(self, x, y, gen):
        return self._credit(self.model(x), y, self.draw(self.model, gen), x)

    def fresh_feedback_draws(self, batches, gens):
        """Γ's null: the forward pass does not depend on B, so each batch's logits are computed
        once for every draw; each draw's B is drawn once for every batch (the same values as
        drawing it again per batch from the same generator state). Only for drtp's own null, on
        a model in eval mode; else draw after draw."""
        if self.model.training or not self._reproduces(DRTP, "fresh_feedback_credit", "fresh_feedback_credits"):
            yield from super().fresh_feedback_draws(batches, gens)
            return
        with torch.no_grad():
            outputs = [(x, self.model(x), y) for x, y in batches]
        for gen in gens:
            feedback = self.draw(self.model, gen)
            with torch.no_grad():
                credits = [self._credit(logits, y, feedback, x) for x, logits, y in outputs]
            yield credits

    def extra_state(self):
        return {"feedback": {f"B{l}": b for l, b in enumerate(self.feedback)}}

    def load_extra_state(self, state):
        for l, b in enumerate(self.feedback):
            b.copy_(state["feedback"][f"B{l}"])
