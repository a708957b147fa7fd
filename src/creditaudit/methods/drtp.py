"""drtp — direct random target projection (Frenkel, Lefebvre & Bol 2021), with a knob towards DFA.

DFA projects the output error e = softmax(logits) − onehot(y) to every block through a fixed random
matrix. DRTP projects the *target* alone, so a block's credit needs no forward result at all:

    s       = (1 − mix) · (−onehot(y)) + mix · e            mix = 0: DRTP, mix = 1: DFA   (N, C)
    B_l     ~ N(0, 1/C), shape (D, C), drawn once from the method's seeded generator
    a_{l+1} = rms_normalise(s · B_lᵀ),  a_0 = rms_normalise(s · B_0ᵀ)     (DFA's credit mapping)

    block l:  (f_l(h_l.detach()) · a_{l+1}).sum(-1).mean()         (LocalMethod.local_gradients)
    embed:    (embed(x) · a_0).sum(-1).mean()
    head:     CE(readout(h_L.detach()), y)

−onehot(y) points in the direction of increasing loss for the true class's logit (as e does), so
the sign convention of `credit` is the protocol's. Γ's null redraws every B_l (same
distribution), as dfa's. The worked example of docs/WRITING_A_RULE.md:

    creditaudit audit --methods drtp dfa bp --dataset mnist1d --epochs 15 --out audits/drtp
Where it differs from the original (Frenkel, Lefebvre & Bol 2021, "Learning without feedback", on
plain MLPs/CNNs with saturating tanh (or sigmoid) hidden units: hidden layer k gets
δ_k = (B_k y*) ⊙ f'(a_k), ΔW_k ∝ −δ_k h_{k−1}ᵀ, the output layer trains on e):
  * the projected target does not pass through a saturating nonlinearity: it is delivered at each
    residual block's output h_{l+1} and drives the linear residual branch f_l (W2 has no
    activation), whose parameters learn by backprop of it through the block. In the original the
    tanh derivative f' shrinks a unit's update as the unit saturates in the target's direction,
    which is what bounds DRTP's layers; here nothing does, and the stream grows with training
    (docs/RULES.md: ‖h_L‖ grows like dfa's).
  * the projected target is rms-normalised per sample, as dfa's credit (a constant per class, so
    only B's overall scale is lost); B_l ~ N(0, 1/C); the embedding reuses B_0 (dfa's mapping).
  * the readout trains on the true CE (the original's output layer on e: the same for a linear
    softmax head); per-block clip; AdamW with a cosine schedule.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dfa import dfa_credit, draw_feedback
from .local import LocalMethod, output_error
from .recipe import Recipe, step_at


class DRTP(LocalMethod):
    """Direct random target projection; option `mix` blends in the output error (1 = DFA)."""

    name = "drtp"
    # SGD with Nesterov momentum 0.9 ("NAG"), lr 1e-4, constant, no weight decay, batch 100
    recipe = Recipe(
        optimizer="sgd", lr=1e-4, momentum=0.9, nesterov=True, weight_decay=0.0,
        schedule="constant", batch_size=100,
        citation="Frenkel, Lefebvre & Bol 2021 (Front. Neurosci. 15:629892) and their reference code "
                 "ChFrenkel/DirectRandomTargetProjection: main.py defaults (--optimizer NAG, --lr 1e-4, "
                 "--batch-size 100) and train.py (NAG = SGD, momentum 0.9, Nesterov; no weight decay, "
                 "no LR schedule)")
    random_feedback = True                      # Γ gets its null: fresh_feedback_credit below
    summary = "direct random target projection (Frenkel et al. 2021): dfa's mapping of −onehot(y)"
    option_defaults = {"mix": 0.0}
    option_ranges = {"mix": (0.0, 1.0)}
    option_help = {"mix": "0 = project the target only (DRTP), 1 = project the output error (DFA)"}

    def __init__(self, model, settings):
        super().__init__(model, settings)
        self.mix = float(self.option(settings.options, "mix"))       # read once, not per step
        self.feedback = draw_feedback(model, self.gen)                # B_l from (seed, "method:drtp")
        self.opt = self.add_optimizer(self.local_param_groups())     # embed, trainable blocks, head

    def _signal(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """s = (1 − mix) · (−onehot(y)) + mix · e."""
        target = -F.one_hot(y, logits.shape[-1]).to(logits.dtype)
        return target if self.mix == 0.0 else (1 - self.mix) * target + self.mix * self.model.output_error(logits, y)

    def _credit(self, logits, y, feedback) -> list[torch.Tensor]:
        return dfa_credit(self._signal(logits, y), feedback, self.model.n_blocks, self.model.stream_shape)

    def gradients(self, x, y):
        fwd = self.local_forward(x)                  # one forward: the model's and every local graph
        credit = self._credit(fwd.logits.detach(), y, self.feedback)
        return self.local_gradients(y, fwd, credit)  # fused, per-block-clipped; the trainer steps the optimizer

    @torch.no_grad()
    def credit(self, x, y):
        return self._credit(self.model(x), y, self.feedback)

    @torch.no_grad()
    def fresh_feedback_credit(self, x, y, gen):
        return self._credit(self.model(x), y, draw_feedback(self.model, gen))

    def extra_state(self):
        return {"feedback": {f"B{l}": b for l, b in enumerate(self.feedback)}}

    def load_extra_state(self, state):
        for l, b in enumerate(self.feedback):
            b.copy_(state["feedback"][f"B{l}"])
