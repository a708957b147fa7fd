"""Sign-concordant feedback alignment (Liao, Leibo & Poggio 2016) as a creditaudit plug-in.

Like FA, every Linear/Conv2d in the residual blocks sends the error back through a feedback matrix
instead of its weight; here the feedback has the SIGN of the current forward weight and a fixed
random MAGNITUDE:

    B_t = sign(W_t) ∘ |R|,     R drawn once per seed (FA's draw)      δx = δy · B_t

Use it from the command line with this file's folder on PYTHONPATH:

    PYTHONPATH=docs/examples creditaudit audit --methods scfa:SignConcordantFA bp --seeds 42
"""
from __future__ import annotations

import torch

from creditaudit.methods.fa import FA, draw_feedback


class SignConcordantFA(FA):
    name = "scfa"                         # seeds its generator; labels use the PKG.MODULE:CLASS spec
    random_feedback = True
    option_defaults = {"magnitude": 1.0}  # options are validated like a built-in's
    option_ranges = {"magnitude": (1e-6, 1e6)}
    option_help = {"magnitude": "scale of the random magnitudes |R|"}

    def __init__(self, model, settings):
        super().__init__(model, settings)                        # draws R into self.feedback
        scale = float(self.option(settings.options, "magnitude"))
        self.magnitude = [{k: b.abs() * scale for k, b in pair.items()} for pair in self.feedback]
        self._sync_signs(self.feedback, self.magnitude)

    def _sync_signs(self, feedback, magnitude) -> None:
        """B ← sign(W) ∘ |R| for every routed module, with W as it is now."""
        for l, block in enumerate(self.model.blocks):
            modules = dict(block.named_modules())
            for name in feedback[l]:
                feedback[l][name] = torch.sign(modules[name].weight.detach()) * magnitude[l][name]

    def train_step(self, x, y):
        self._sync_signs(self.feedback, self.magnitude)           # signs follow W step by step
        return super().train_step(x, y)

    def credit(self, x, y):
        self._sync_signs(self.feedback, self.magnitude)
        return super().credit(x, y)

    def fresh_feedback_credit(self, x, y, gen):
        """The null: fresh random magnitudes, the same (current) signs."""
        fresh = draw_feedback(self.model, gen)
        magnitude = [{k: b.abs() for k, b in pair.items()} for pair in fresh]
        self._sync_signs(fresh, magnitude)
        return self._credit(x, y, fresh)

    def extra_state(self):
        return {**super().extra_state(),
                "magnitude": {f"block{l}": dict(m) for l, m in enumerate(self.magnitude)}}

    def load_extra_state(self, state):
        super().load_extra_state(state)
        for l, m in enumerate(self.magnitude):
            for name in m:
                m[name].copy_(state["magnitude"][f"block{l}"][name])
