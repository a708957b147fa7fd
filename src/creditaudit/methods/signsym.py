"""sign-symmetry — feedback that shares only the signs of the forward weights (Liao, Leibo & Poggio
2016; Moskovitz, Litwin-Kumar & Abbott 2018), in the three variants BioTorch ships.

Routed exactly like fa (methods/fa.py: every routed Linear/Conv2d keeps its forward pass and its
weight gradient, and sends the error backward through B instead of W; the routed modules are the
blocks', and on a plain network the readout's too), with B rebuilt before every step from the
current W:

    Linear  y = x·Wᵀ + b:   δx = δy · B_t,    ∂W = δyᵀ · x,  ∂b = Σ δy          (as fa)
    B_t = M_t ∘ sign(W_t)                                                      per routed module
        uSF  (variant "usf"):   M_t = s,  s = √(2 / (fan_in + fan_out))         a constant per layer
        brSF (variant "brsf"):  M_t = |R_t|, R_t ~ U(−a, a) redrawn every step  a = √(6 / (fan_in + fan_out))
        frSF (variant "frsf"):  M_t = |R|,   R ~ U(−a, a) drawn once per seed

s and a are the Xavier std and bound of the layer, so ‖B‖ is of the order of an initial W (BioTorch
scales uSF by s and draws M Xavier-uniform, then takes |M|). fan_in = in_features (conv:
in_channels/groups · k_h · k_w), fan_out = out_features (conv: out_channels · k_h · k_w).
R (frSF once, after fa's B; brSF again before every step, in `prepare_step`) is one draw for all
modules, in unit order (blocks, then a plain network's readout), from the method's CPU generator,
derived from (seed, "method:sign-symmetry"), copied to the device at once
(`seeding.draw_on_host`): a seed gives the same magnitudes on any device.
On residual models the embedding, the readout and the skips backpropagate exactly, as in fa, so
a_L = g_L there. On the plain MLP the readout's error reaches h_L through B_out = M ∘ sign(W_out),
as every layer's does in the originals, so no position is exact.

Credit: a_l = ∂ℓ/∂h_l with the error carried through B_t instead of Wᵀ (fa's `credit`), B_t built
from the weights as they are now (brSF: with the magnitudes of the last step). Sign convention:
the direction of increasing loss, as BP's g_l.

Γ's null (`random_feedback`): only frSF has a fixed random part, its magnitudes R; its null redraws
R (same distribution; B_out's too on a plain network) and keeps sign(W_t), so Γ − null says how
much the trained weights aligned to *their* magnitudes beyond the signs they share with B. uSF has
nothing random, and brSF redraws R every step, so a fresh R is a draw from the very distribution
in use (Γ − null ≈ 0 by construction): both have no null (`random_feedback` False for them).

Published recipe (`recipe`): BioTorch's benchmark config for its sign-symmetry variants
(jsalbert/biotorch at 74fad0d, benchmark_configs/cifar10/resnet_20/sgd/usf.yaml:32-46, the same in
brsf.yaml and frsf.yaml): SGD, lr 0.1, momentum 0.9, weight decay 1e-4, batch 128, lr × 0.1 at
epochs 100, 150, 200 of 250. It is the recipe of the implementation these variants follow (Sanfiz
& Akrout 2021, "Benchmarking the accuracy and robustness of feedback alignment algorithms"), not
one of Liao et al.'s: they tune SGD per data set (15 of them) with Batch Manhattan or batch norm,
so no single recipe of theirs transfers. The step milestones scale to the run's length (the same
fractions of training, `recipe.milestone_epochs`).

Where it differs from the originals (Liao, Leibo & Poggio 2016 trained sign-symmetric feedback with
batch manipulation and batch normalisation on every layer; Moskovitz et al. 2018 scaled it for
ImageNet; the three variants' magnitudes and the recipe follow BioTorch):
  * on residual models only the block Linear/Conv2d modules use sign-symmetric feedback; the
    embedding, readout, skips, LayerNorms and activations backpropagate exactly (fa's routing),
    so a_L = g_L. On the plain MLP every layer, the readout included, does.
  * no batch manipulation; the magnitudes are Xavier-scaled per layer (BioTorch's choice).
  * the recipe is BioTorch's CIFAR-10 ResNet-20 one (above), carried to the audit's MNIST-1D
    ResMLP with its milestones scaled to the run's epochs.
"""
from __future__ import annotations

import math

import torch

from ..seeding import draw_on_host
from .fa import FA, feedback_layers, state_key
from .recipe import Recipe, step_at

VARIANTS = ("usf", "brsf", "frsf")


def xavier(weight: torch.Tensor) -> tuple[float, float]:
    """(s, a): the Xavier-normal std √(2/(fan_in + fan_out)) and uniform bound √(6/(fan_in + fan_out))."""
    receptive = weight[0][0].numel()
    fans = (weight.shape[0] + weight.shape[1]) * receptive
    return math.sqrt(2.0 / fans), math.sqrt(6.0 / fans)


class SignSymmetry(FA):
    """Feedback B_t = M_t ∘ sign(W_t), routed like fa; option `variant` picks M_t (uSF, brSF, frSF)."""

    name = "sign-symmetry"
    # BioTorch's benchmark recipe for its usf/brsf/frsf layers (module docstring)
    recipe = Recipe(
        optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=1e-4, schedule="step",
        milestones=step_at((100, 150, 200), of=250), gamma=0.1, batch_size=128,
        citation="BioTorch (Sanfiz & Akrout 2021), the implementation whose uSF/brSF/frSF these "
                 "variants follow: benchmark_configs/cifar10/resnet_20/sgd/usf.yaml (and brsf.yaml, "
                 "frsf.yaml) — SGD, lr 0.1, momentum 0.9, weight decay 1e-4, batch 128, lr × 0.1 at "
                 "epochs 100, 150, 200 of 250 (CIFAR-10 ResNet-20); Liao, Leibo & Poggio 2016 tune "
                 "SGD per data set, with no one recipe to follow")
    paper = False                       # fa's subclass, not one of the paper's seven
    summary = "sign-symmetry (Liao et al. 2016): fa's routing with B = M ∘ sign(W), variant usf/brsf/frsf"
    random_feedback = True              # per instance: frSF only (see the module docstring)
    null_note = ("a null only for frSF (fresh random magnitudes, the current signs); uSF has nothing "
                 "random, and brSF redraws its magnitudes every step, so a fresh draw is the "
                 "distribution already in use")
    option_defaults = {"variant": "usf"}
    option_choices = {"variant": VARIANTS}
    option_help = {"variant": "usf: B = s·sign(W); brsf: |R|∘sign(W), R redrawn each step; "
                              "frsf: |R|∘sign(W), R fixed (s, R ~ Xavier; Liao et al. 2016)"}

    def __init__(self, model, settings):
        super().__init__(model, settings)             # self.feedback: storage for B, one per module
        self.variant = str(self.option(settings.options, "variant"))
        self.random_feedback = self.variant == "frsf"
        self.magnitude = self._magnitudes(self.gen)
        self._sync(self.feedback, self.magnitude)

    def _magnitudes(self, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
        """M per feedback unit and routed module: s everywhere (uSF), or |R| with R ~ U(−a, a)
        (brSF, frSF). The R of all modules are one draw of U[0, 1) from the CPU generator `gen`,
        in unit and module order, copied to the device at once (`draw_on_host`), then scaled by each a."""
        modules = feedback_layers(self.model)
        if self.variant == "usf":
            return [{name: torch.full_like(m.weight.detach(), xavier(m.weight)[0]) for name, m in mods}
                    for mods in modules]
        sizes = [m.weight.numel() for mods in modules for _, m in mods]
        flat = draw_on_host(torch.rand, (sum(sizes),), gen, self.model.head_parameters()[0])
        draws = iter(flat.split(sizes))
        return [{name: next(draws).view_as(m.weight).mul(xavier(m.weight)[1])   # |U(−a, a)| = U(0, a)
                 for name, m in mods} for mods in modules]

    def _sync(self, feedback, magnitude) -> None:
        """B ← M ∘ sign(W) in place (the routed forwards look B up by identity at call time)."""
        with torch.no_grad():
            for modules, fb, mag in zip(feedback_layers(self.model), feedback, magnitude):
                for name, module in modules:
                    torch.mul(torch.sign(module.weight), mag[name], out=fb[name])

    def prepare_step(self):
        """Eagerly, before the (compilable) step: brSF redraws M, every variant rebuilds B from the
        current W; then fa's routing."""
        if self.variant == "brsf":
            self.magnitude = self._magnitudes(self.gen)
        self._sync(self.feedback, self.magnitude)
        super().prepare_step()

    def credit(self, x, y):
        """a_l = ∂ℓ/∂h_l through B = M ∘ sign(W) of the current weights (a_L = g_L exactly on
        residual models; e·B_out on a plain network)."""
        self._sync(self.feedback, self.magnitude)
        return super().credit(x, y)

    def fresh_feedback(self, gen):
        """frSF's null: fresh magnitudes |R'| from `gen`, the current signs."""
        fresh = self._magnitudes(gen)
        feedback = [{name: torch.empty_like(b) for name, b in pair.items()} for pair in self.feedback]
        self._sync(feedback, fresh)
        return feedback

    def extra_state(self):
        return {**super().extra_state(),
                "magnitude": {state_key(self.model, l): dict(m) for l, m in enumerate(self.magnitude)}}

    def load_extra_state(self, state):
        super().load_extra_state(state)
        for l, mag in enumerate(self.magnitude):
            for name in mag:
                mag[name].copy_(state["magnitude"][state_key(self.model, l)][name])
