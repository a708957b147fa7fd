"""fa — feedback alignment (Lillicrap et al. 2016) on any ResidualModel.

Every routed nn.Linear and nn.Conv2d keeps its forward pass and its weight gradient, but sends the
error backward through a fixed random matrix / kernel B (same shape as its weight W) instead of W:

    Linear  y = x·Wᵀ + b:      δx = δy · B                   (BP: δy · W)
                               ∂W = δyᵀ · x,  ∂b = Σ δy      the usual weight gradient
    Conv2d  y = W ⋆ x + b:     δx = conv2d_input(B, δy)      (BP: the same with W)
                               ∂W = conv2d_weight(x, δy),  ∂b = Σ δy

The routed modules (`feedback_layers`) are the Linear/Conv2d inside the blocks, and on a plain
network (`model.residual` False: the plain MLP, arch mlp) also the readout's Linear (out_head),
as in the original: every layer's error, the output layer's included, goes down through B, so the
last hidden layer's credit is a_L = e·B_out, not e·W_out. On residual models (ResMLP, ViT, ResNet)
everything else backpropagates exactly: the skips, LayerNorm, BatchNorm, attention's softmax, the
activations, and the readout, so a_L = g_L there. The credit a_l is the FA-propagated error at h_l,
i.e. the "gradient" of the mean loss ℓ at h_l under these rules; θ ← optimiser(θ, ∂ℓ/∂θ|_FA)
with the run's recipe (fa keeps the shared AdamW recipe, methods/recipe.py).

Mechanism (no per-architecture code): while FA runs the model, the `forward` of each routed
Linear/Conv2d is temporarily replaced (`route_through_feedback`, a context manager that always
restores it) by one that calls the autograd Function `FeedbackLinear` / `FeedbackConv2d` with that
module's B. Weights used outside a Linear/Conv2d module's own forward (functional calls on a bare
Parameter, nn.MultiheadAttention's packed projections) would not be routed; FA refuses models where
a routed Linear/Conv2d is never called through its forward, blocks holding other conv types, and a
plain network whose readout holds no Linear/Conv2d.

Choices (the paper is silent):
  * B ~ U(−1/√fan_in, 1/√fan_in) (fan_in = in_features, or in_channels/groups · k_h · k_w), the
    distribution torch initialises W from (a small init of W, like the ResMLP's W2, is not copied:
    that would make the feedback path vanish).
  * a residual model's embedding gets no B: its error would only go on to the input x, which has
    nothing to train, so the embedding's update is the plain weight gradient with δh_0 = a_0. (The
    plain MLP's first layer is block 0 and has a B; the error it sends to x is a_0, used by no
    update.)
  * frozen blocks (not in settings.trainable_blocks) still pass the error down through their B;
    they run with detached parameters (torch.func.functional_call), so no gradient is even computed
    for them. BatchNorm running statistics are buffers and still update in training mode.
Feedback layout: `self.feedback[l]` is a dict {qualified module name inside block l: B}, e.g.
{"w1": B1, "w2": B2} for the ResMLP, {"qkv", "proj", "fc1", "fc2"} for the ViT,
{"conv1", "conv2"} for the ResNet and {"linear"} for a plain MLP layer; a plain network has one
more entry, self.feedback[L] = {"out_head": B_out} (name in the model). B is looked up at call time,
so assigning `fa.feedback[l][name] = W` takes effect at the next step. B is drawn once from
`self.gen` (derived from the seed) in unit and module order (so a residual model's draws are those
of the blocks alone), and saved in `extra_state` ("block{l}", and "head" for unit L).
Γ's null draws every B afresh, B_out included on a plain network.

Where it differs from the original (Lillicrap, Cownden, Tweed & Akerman 2016, feedback alignment on
plain MLPs, every layer's error sent down through a fixed random B):
  * on residual models only the Linear/Conv2d modules inside the blocks send their error through
    B; the skips, LayerNorms, activations and the readout (out_ln, out_head) backpropagate exactly,
    so the error entering the stream at h_L is the true ∂ℓ/∂h_L (a_L = g_L) and the skips carry it
    to every block unchanged. In the original the top layer's error already reaches the last
    hidden layer through B, and there are no skips: that is what fa does on the plain MLP.
  * B ~ U(±1/√fan_in), torch's init range for W (the paper draws B uniformly at a scale chosen per
    task); a residual model's embedding has no B (its input error would go nowhere).
  * the optimizer is the shared recipe's AdamW with a cosine schedule and weight decay, not the
    paper's plain SGD (fa is one of the audit paper's seven, which train under its recipe).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from ..errors import CreditAuditError
from ..model.members import member_cross_entropy, member_linear
from ..model.resmlp import ResidualMLP
from ..model.resnet import SmallResNet
from ..model.vit import ViTMini
from .recipe import Recipe
from .setting import AKROUT, AKROUT_DEVIATIONS, AKROUT_NETWORK, PaperSetting, Reported
from .base import Method

ROUTED = (nn.Linear, nn.Conv2d)


class FeedbackLinear(torch.autograd.Function):
    """y = x·Wᵀ + b whose backward sends δx = δy·B instead of δy·W (x: (…, in), W, B: (out, in))."""

    @staticmethod
    def forward(ctx, x, weight, bias, feedback):
        ctx.save_for_backward(x, feedback)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, feedback = ctx.saved_tensors
        grad_x = grad_out @ feedback if ctx.needs_input_grad[0] else None    # δx = δy · B
        if x.dim() != 2:                                                     # (…, in) → (M, in)
            x, grad_out = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        grad_w = grad_out.T @ x if ctx.needs_input_grad[1] else None         # ∂W = δyᵀ · x
        grad_b = grad_out.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None  # ∂b = Σ δy
        return grad_x, grad_w, grad_b, None


class FeedbackConv2d(torch.autograd.Function):
    """y = conv2d(x, W, b) whose backward computes δx with the kernel B instead of W."""

    @staticmethod
    def forward(ctx, x, weight, bias, feedback, stride, padding, dilation, groups):
        ctx.save_for_backward(x, feedback)
        ctx.conv = (stride, padding, dilation, groups)
        ctx.weight_shape, ctx.has_bias = weight.shape, bias is not None
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad_out):
        x, feedback = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:                                          # δx through B
            grad_x = torch.nn.grad.conv2d_input(x.shape, feedback, grad_out, *ctx.conv)
        if ctx.needs_input_grad[1]:                                          # the usual ∂W
            grad_w = torch.nn.grad.conv2d_weight(x, ctx.weight_shape, grad_out, *ctx.conv)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.sum((0, 2, 3))
        return grad_x, grad_w, grad_b, None, None, None, None, None


class MemberFeedbackLinear(torch.autograd.Function):
    """`FeedbackLinear` per member: x (K, B, in), W, B (K, out, in), b (K, out);
    y = x·Wᵀ + b, δx = δy·B, ∂W = δyᵀ·x, ∂b = Σ δy, each member with its own W and B."""

    @staticmethod
    def forward(ctx, x, weight, bias, feedback):
        ctx.save_for_backward(x, feedback)
        return member_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, feedback = ctx.saved_tensors
        grad_x = torch.bmm(grad_out, feedback) if ctx.needs_input_grad[0] else None          # δy · B
        grad_w = torch.bmm(grad_out.transpose(1, 2), x) if ctx.needs_input_grad[1] else None  # δyᵀ · x
        grad_b = grad_out.sum(1) if ctx.needs_input_grad[2] else None                         # Σ δy
        return grad_x, grad_w, grad_b, None


def member_feedback_layer(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          feedback: torch.Tensor) -> torch.Tensor:
    """`model.members.member_layer` with the input error sent through `feedback` (W's shape):
    a linear (W (K, out, in), x (K, …, in)) through `MemberFeedbackLinear`, a conv (W (K, out, in,
    kh, kw), x grouped (B, K·in, H, W)) through `FeedbackConv2d` with groups = K."""
    if weight.dim() == 3:
        k = x.shape[0]
        y = MemberFeedbackLinear.apply(x.reshape(k, -1, x.shape[-1]), weight, bias, feedback)
        return y.view(x.shape[:-1] + (weight.shape[1],))
    return FeedbackConv2d.apply(x, weight.flatten(0, 1), None if bias is None else bias.flatten(),
                                feedback.flatten(0, 1), 1, weight.shape[-1] // 2, 1, weight.shape[0])


def _linear_forward(module: nn.Linear, feedback: dict[str, torch.Tensor], name: str, called: set):
    def forward(x):
        called.add(id(module))
        return FeedbackLinear.apply(x, module.weight, module.bias, feedback[name])
    return forward


def _conv_forward(module: nn.Conv2d, feedback: dict[str, torch.Tensor], name: str, called: set):
    if isinstance(module.padding, str):
        raise CreditAuditError(f"fa: Conv2d {name!r} uses padding={module.padding!r}; "
                               "fa supports integer padding only")

    def forward(x):
        called.add(id(module))
        padding = module.padding
        if module.padding_mode != "zeros":            # as nn.Conv2d._conv_forward does
            x, padding = F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode), 0
        return FeedbackConv2d.apply(x, module.weight, module.bias, feedback[name], module.stride,
                                    padding, module.dilation, module.groups)
    return forward


def routed_modules(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The block's Linear/Conv2d modules in registration order, by qualified name inside the block."""
    found = []
    for name, module in block.named_modules():
        if isinstance(module, nn.MultiheadAttention) or (
                isinstance(module, nn.modules.conv._ConvNd) and type(module) is not nn.Conv2d):
            raise CreditAuditError(f"fa cannot route {type(module).__name__} {name!r}: it supports "
                                   "nn.Linear and nn.Conv2d (called through their forward)")
        if isinstance(module, ROUTED):
            found.append((name, module))
    return found


def readout_modules(model) -> list[tuple[str, nn.Module]]:
    """A plain network's readout Linear/Conv2d modules (those holding `head_parameters`), by
    qualified name in the model: ("out_head", W_out) for the plain MLP."""
    head = {id(p) for p in model.head_parameters()}
    found = [(name, module) for name, module in model.named_modules()
             if isinstance(module, ROUTED) and id(module.weight) in head]
    if not found:
        raise CreditAuditError(f"fa: the readout of {type(model).__name__} (residual False) holds no "
                               "nn.Linear/nn.Conv2d; fa sends a plain network's output error through "
                               "B, so give its readout an nn.Linear")
    return found


def feedback_layers(model) -> list[list[tuple[str, nn.Module]]]:
    """The routed modules per feedback unit l: blocks 0 … L-1 (`routed_modules`), and on a plain
    network (`model.residual` False) unit L, the readout (`readout_modules`): as in Lillicrap et
    al. 2016, the output layer's error reaches the last hidden layer through its B too."""
    layers = [routed_modules(block) for block in model.blocks]
    if not model.residual:
        layers.append(readout_modules(model))
    return layers


def unit_name(model, l: int) -> str:
    """Feedback unit l's name in `feedback_pairs`: the block index, or "head" (a plain network's
    unit L)."""
    return "head" if l == model.n_blocks else str(l)


def state_key(model, l: int) -> str:
    """Feedback unit l's key in a checkpoint's extra state: "block{l}", or "head"."""
    return "head" if l == model.n_blocks else f"block{l}"


@contextlib.contextmanager
def route_through_feedback(layers: list[list[tuple[str, nn.Module]]],
                           feedback: list[dict[str, torch.Tensor]]) -> Iterator[None]:
    """Within the context, every module of unit l (`feedback_layers`) computes its input error
    with feedback[l][name]; on exit the modules' own forwards are restored. Raises if a routed
    module was never called (its weight must have been used some other way, which FA would not see)."""
    patched, called = [], set()
    try:
        for modules, fb in zip(layers, feedback):
            for name, module in modules:
                make = _linear_forward if isinstance(module, nn.Linear) else _conv_forward
                patched.append((name, module, module.__dict__.get("forward")))
                module.forward = make(module, fb, name, called)
        yield
    finally:
        for _, module, own in patched:
            if own is None:
                del module.forward
            else:
                module.forward = own
    missed = [name for name, module, _ in patched if id(module) not in called]
    if missed:
        raise CreditAuditError(f"fa: module(s) {', '.join(sorted(set(missed)))} were not called "
                               "through their forward; fa cannot route their error through B")


def draw_feedback(model, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """One B per routed Linear/Conv2d (`feedback_layers`: the blocks', then a plain network's
    readout), in module order, B ~ U(−1/√fan_in, 1/√fan_in), shape of W."""
    feedback = []
    for modules in feedback_layers(model):
        pair = {}
        for name, module in modules:
            w = module.weight
            bound = 1.0 / math.sqrt(w[0].numel())         # fan_in: in_features or in/groups·k_h·k_w
            b = (torch.rand(w.shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound
            pair[name] = b.to(device=w.device, dtype=w.dtype)
        feedback.append(pair)
    return feedback


class FA(Method):
    reads_clip = False                  # its step clips nothing (settings.clip)
    name = "fa"
    paper = True
    random_feedback = True
    member_archs = (ResidualMLP, ViTMini, SmallResNet)

    # the paper's own setting, for `creditaudit reproduce` (methods/setting.py)
    paper_setting = PaperSetting(
        citation="Lillicrap et al. 2016, as run in Akrout et al. 2019's MNIST code",
        code=f"{AKROUT}: run.sh:7, fcnn/FCNN_FA.py:30",
        **AKROUT_NETWORK,
        options={},
        recipe=Recipe(optimizer="sgd", lr=0.2, weight_decay=0.0, schedule="constant", batch_size=128,
                      citation=f"{AKROUT}, run.sh:7 (plain SGD, lr 0.2, batch 128, 400 epochs)"),
        reported=Reported(2.20, "experiments/mnist/fa-V0/log.txt:2408 of the reference code (epoch 400)",
                          seeds=1, selection="final epoch"),
        bp=Reported(1.50, "experiments/mnist/bp-V0/log.txt:1211 of the reference code (epoch 400)",
                    seeds=1, selection="final epoch"),
        deviations=("Lillicrap et al.'s own MNIST figure (784-1000-10) could not be read here; this "
                    "setting is the feedback-alignment run of Akrout et al.'s code, whose log gives "
                    "the number",
                    "weights drawn N(0, 1/(fan_in + fan_out)) as the reference (init fan-sum-normal); "
                    "B drawn from U(±1/√fan_in), the reference draws it N(0, 1/(fan_in + fan_out))",
                    *AKROUT_DEVIATIONS))

    def __init__(self, model, settings):
        super().__init__(model, settings)
        self.feedback = draw_feedback(model, self.gen)
        self.opt = self.add_optimizer(self.embed_params() + self.trainable_block_params()
                                      + self.head_params())
        self._routing: contextlib.AbstractContextManager | None = None

    def prepare_step(self):
        """Route the blocks through B for the step, here, eagerly: patching a module's forward is
        not something a compiled graph can do (`gradients` then runs on the patched blocks)."""
        self._routing = route_through_feedback(feedback_layers(self.model), self.feedback)
        self._routing.__enter__()

    def end_step(self):
        routing, self._routing = self._routing, None
        if routing is not None:
            routing.__exit__(None, None, None)

    def forward(self, h0: torch.Tensor, feedback, train: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        """([h_0, …, h_L], logits) with every routed Linear/Conv2d (`feedback_layers`: the
        blocks', and on a plain network the readout's) sending its error through its B.

        train=False (or a frozen block) runs the block on detached parameters, so only the states
        carry grad. Inside a step the routing is already in place (`prepare_step`).
        """
        hidden = [h0]
        routed = self._routing is not None
        with contextlib.nullcontext() if routed else route_through_feedback(feedback_layers(self.model),
                                                                           feedback):
            for l, block in enumerate(self.model.blocks):
                if train and self.trainable(l):
                    f = block(hidden[-1])
                else:
                    params = {k: p.detach() for k, p in block.named_parameters()}
                    f = functional_call(block, params, (hidden[-1],))
                hidden.append(self.model.advance(hidden[-1], f))   # h_{l+1} = h_l + f_l(h_l), or f_l(h_l)
            logits = self.model.readout(hidden[-1])     # plain network: out_head routed through B_out
        return hidden, logits

    def gradients(self, x, y):
        _, logits = self.forward(self.model.embed_input(x), self.feedback, train=True)
        loss = self.model.loss(logits, y)
        loss.backward()                                   # δ flows through B; ∂W = δᵀx as usual
        return loss.detach()

    def member_feedback(self):
        return {f"{l}.{name}": b for l, pair in enumerate(self.feedback) for name, b in pair.items()}

    def member_gradients(self, stack, x, y):
        """The step on the member axis: each block Linear/Conv2d of member k (W1, W2 of the ResMLP;
        qkv, proj, fc1, fc2 of the ViT; conv1, conv2 of the ResNet) sends δ back through that
        member's B (`member_feedback_layer`); a member's frozen block computes (and the stack
        discards) a weight gradient, but its error still flows through its B as in the lone step."""
        net = stack.net
        h = net.embed_input(x)
        for l in range(net.n_blocks):
            def routed(z, w, b, name, l=l):
                return member_feedback_layer(z, w, b, stack.feedback[f"{l}.{name}"])
            h = h + net.block(l, h, routed)
        ce = member_cross_entropy(net.readout(h), y)
        ce.sum().backward()
        return ce.detach()

    def _credit(self, x, y, feedback) -> list[torch.Tensor]:
        with torch.enable_grad():
            h0 = self.model.embed_input(x).detach().requires_grad_(True)
            hidden, logits = self.forward(h0, feedback, train=False)
            grads = torch.autograd.grad(self.model.loss(logits, y), hidden)
        return [g.detach() for g in grads]

    def credit(self, x, y):
        """a_l = ∂ℓ/∂h_l with the error carried through B instead of Wᵀ (on residual models
        a_L = g_L exactly; on a plain network a_L = e·B_out)."""
        return self._credit(x, y, self.feedback)

    def fresh_feedback(self, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
        """Every B drawn afresh from `gen`, as at initialisation: Γ's null."""
        return draw_feedback(self.model, gen)

    def fresh_feedback_credit(self, x, y, gen):
        return self._credit(x, y, self.fresh_feedback(gen))

    def fresh_feedback_credits(self, batches, gen):
        """One draw for every batch, drawn once (a draw is two fan-sized float64 matrices per
        block: drawn again for every eval batch, it was about a third of fa's null calibration).
        A subclass with its own `fresh_feedback_credit` gets it, batch by batch."""
        if not self._reproduces(FA, "fresh_feedback_credit"):
            return super().fresh_feedback_credits(batches, gen)
        feedback = self.fresh_feedback(gen)
        return [self._credit(x, y, feedback) for x, y in batches]

    def exact_positions(self, n_blocks):
        """On residual models {L}: out_ln and the head backpropagate with their true weights, so
        a_L = g_L. On a plain network none: the readout's error reaches h_L through B_out."""
        return frozenset({n_blocks}) if self.model.residual else frozenset()

    def feedback_pairs(self):
        """(unit.module, W, B) of every routed Linear/Conv2d, unit a block index or "head" (B as
        the backward pass uses it; sign-symmetry's B is rebuilt from W before each step and credit)."""
        return [(f"{unit_name(self.model, l)}.{name}", module.weight, self.feedback[l][name])
                for l, modules in enumerate(feedback_layers(self.model)) for name, module in modules]

    def extra_state(self):
        return {"feedback": {state_key(self.model, l): dict(pair) for l, pair in enumerate(self.feedback)}}

    def load_extra_state(self, state):
        saved = state.get("feedback", {})
        for l, pair in enumerate(self.feedback):
            for name in pair:
                pair[name].copy_(saved[state_key(self.model, l)][name])
