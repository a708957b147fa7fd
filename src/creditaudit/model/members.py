"""K lone models of one shape as one model with a leading member axis (horizontal fusion, HFTA).

Every parameter of the K lone models is stacked into one leaf tensor (K, *shape), every buffer
(BatchNorm's running statistics) into one tensor (K, *shape); a batch is (K, B, …), member k's
samples in row k, and so is every residual state h_l: (K, B, *stream_shape). Each layer is the
lone layer applied per member:

    linear      y_k = x_k · W_kᵀ + b_k          W (K, out, in), b (K, out): one baddbmm over
                                                x (K, …, in) (tokens flattened into the batch)
    conv        y = conv2d(x, W, groups=K)      x in the grouped layout (B, K·C, H, W), member k's
                                                channels in group k; W (K, out, in, kh, kw)
    layer norm  LN(h_k) · γ_k + β_k             γ, β (K, d): the normalisation is per sample (and
                                                token), the affine per member
    batch norm  per channel of (B, K·C, H, W)   so per member and channel: batch statistics,
                                                running buffers (K, C) (momentum, eps, train/eval
                                                as the lone BatchNorm2d), γ, β (K, C)
    attention   SDPA over (K·B, heads, T, d/h)  each sample attends over its own tokens

so member k's forward reads only member k's parameters, buffers and samples: members never mix.
The K models are built as lone models (`runs.build_model` with each seed) and then stacked
(`stack_models(models)`), so initialisation is identical by construction; `unstack_into(k, model)`
copies member k (parameters and buffers) back into a lone model (checkpoints, diagnosis, run
folders).

A member net has the lone model's residual-stream interface with a member axis in front, which is
all a method's member step reads: `embed_input(x)` → `block(l, h, layer)` (the branch f_l alone,
the caller adds the skip) → `readout(h)`, `block_params(l)`, `n_blocks`. `layer(x, W, b, name)`
applies every weight layer inside a block (`member_layer`: a linear for a 3-dim W, a stride-1
"same" conv for a 5-dim W), so a method that changes how a layer passes its error back (fa) does
it once for every architecture.

Grouped convolution rather than torch.func.vmap for the ResNet: vmap of conv2d over batched
inputs and weights lowers to a grouped conv itself, and on one CPU thread the two were within
noise of each other (forward + backward of one 3×3 conv over K stacked members, the explicit form
including its layout transposes; vmap/grouped time 0.83–1.13 over (K, B, C, side) = (4, 128, 16, 8),
(4, 128, 32, 16), (8, 64, 32, 8), best of 5, on 2 shared cores at load ≈ 10). The grouped layout
also lets BatchNorm be the lone F.batch_norm on (B, K·C, H, W), its running buffers updated in
place through views of the (K, C) stacks, which vmap cannot write into.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .resmlp import ACTIVATIONS, ResidualMLP
from .resnet import SmallResNet
from .vit import ViTMini, as_images

Layer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, str], torch.Tensor]
Linear = Layer


def member_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, name: str = "") -> torch.Tensor:
    """y = x·Wᵀ + b per member: x (K, B, …, in), W (K, out, in), b (K, out) → (K, B, …, out).
    (`name`, the module's name inside its block, is for layers that route by it, e.g. fa's.)"""
    if x.dim() == 3:
        return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))
    y = torch.baddbmm(bias.unsqueeze(1), x.reshape(x.shape[0], -1, x.shape[-1]), weight.transpose(1, 2))
    return y.view(x.shape[:-1] + (weight.shape[1],))


def member_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, name: str = "",
                  stride: int = 1) -> torch.Tensor:
    """conv2d per member: x (B, K·in, H, W) in the grouped layout, W (K, out, in, kh, kw), b (K, out)
    or None → (B, K·out, H', W'); padding kh // 2 ("same" for odd kernels at stride 1)."""
    return F.conv2d(x, weight.flatten(0, 1), None if bias is None else bias.flatten(), stride,
                    weight.shape[-1] // 2, 1, weight.shape[0])


def member_layer(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, name: str = "") -> torch.Tensor:
    """A block's weight layer per member: `member_linear` for W (K, out, in), `member_conv2d`
    for W (K, out, in, kh, kw) (the layer a method's hook replaces, e.g. fa's feedback routing)."""
    if weight.dim() == 3:
        return member_linear(x, weight, bias, name)
    return member_conv2d(x, weight, bias, name)


def member_layer_norm(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim of h (K, B, …, d) with member k's affine γ_k, β_k (K, d)."""
    shape = (h.shape[0],) + (1,) * (h.dim() - 2) + (h.shape[-1],)
    return F.layer_norm(h, h.shape[-1:], eps=eps) * weight.view(shape) + bias.view(shape)


def to_groups(h: torch.Tensor) -> torch.Tensor:
    """(K, B, C, H, W) → the grouped layout (B, K·C, H, W)."""
    k, b, c = h.shape[:3]
    return h.transpose(0, 1).reshape((b, k * c) + h.shape[3:])


def from_groups(g: torch.Tensor, k: int) -> torch.Tensor:
    """The grouped layout (B, K·C, H, W) → (K, B, C, H, W)."""
    return g.view((g.shape[0], k, g.shape[1] // k) + g.shape[2:]).transpose(0, 1)


class MemberNet:
    """K lone models of one class and shape as stacked leaf tensors `params` {name: (K, *shape)}
    and stacked buffers `buffers` {name: (K, *shape)}, named as in the lone model's state dict, so
    member k of `params[name]` is model k's `name`. Subclasses write the forward per member."""

    lone_class: type = nn.Module

    def __init__(self, models: Sequence[nn.Module]):
        models = list(models)
        first = models[0]
        if not all(isinstance(m, self.lone_class) for m in models):
            raise TypeError(f"{type(self).__name__} stacks {self.lone_class.__name__}s only")
        shapes = {tuple((n, tuple(t.shape)) for n, t in m.state_dict().items()) for m in models}
        if len(shapes) != 1 or len({self._signature(m) for m in models}) > 1:
            raise ValueError(f"{type(self).__name__} needs models of one shape")
        self.params = {name: torch.stack([dict(m.named_parameters())[name].detach() for m in models])
                       .clone().requires_grad_(True) for name, _ in first.named_parameters()}
        self.buffers = {name: torch.stack([dict(m.named_buffers())[name] for m in models]).clone()
                        for name, _ in first.named_buffers()}
        self.n_members, self.n_blocks, self.n_classes = len(models), first.n_blocks, first.n_classes
        self.stream_shape = tuple(first.stream_shape)           # per sample, as the lone model's
        self.training = True        # built to train, like a fresh nn.Module (a resumed lone model's
        #                             mode is whatever its last use left); `train(False)` for eval
        names = {id(p): n for n, p in first.named_parameters()}
        self.embed_names = [names[id(p)] for p in first.embed_parameters()]
        self.head_names = [names[id(p)] for p in first.head_parameters()]

    @staticmethod
    def _signature(model: nn.Module) -> tuple:
        """What besides tensor shapes must agree between members (activations, eps, …)."""
        return tuple((type(m).__name__, getattr(m, "eps", None), getattr(m, "momentum", None),
                      getattr(m, "activation", None), getattr(m, "heads", None), getattr(m, "stride", None))
                     for m in model.modules())

    @property
    def device(self) -> torch.device:
        return next(iter(self.params.values())).device

    def train(self, mode: bool = True) -> "MemberNet":
        """Training (batch statistics, running buffers updated) or eval mode, as nn.Module.train."""
        self.training = mode
        return self

    def block_params(self, l: int) -> list[torch.Tensor]:
        """The stacked parameters of block l."""
        return [p for name, p in self.params.items() if name.startswith(f"blocks.{l}.")]

    def embed_params(self) -> list[torch.Tensor]:
        """The stacked parameters of the lone model's `embed_parameters()`, in its order."""
        return [self.params[n] for n in self.embed_names]

    def head_params(self) -> list[torch.Tensor]:
        """The stacked parameters of the lone model's `head_parameters()`, in its order."""
        return [self.params[n] for n in self.head_names]

    def embed_input(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def block(self, l: int, h: torch.Tensor, layer: Layer = member_layer) -> torch.Tensor:
        raise NotImplementedError

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def unstack_into(self, k: int, model: nn.Module) -> None:
        """Copy member k's parameters and buffers into the lone `model` (of this shape)."""
        for name, p in model.named_parameters():
            p.copy_(self.params[name][k])
        self.restack_buffers(k, model, into_model=True)

    @torch.no_grad()
    def restack_buffers(self, k: int, model: nn.Module, into_model: bool = False) -> None:
        """Member k's buffers from the lone `model` (or, into_model=True, into it)."""
        for name, b in model.named_buffers():
            if into_model:
                b.copy_(self.buffers[name][k])
            else:
                self.buffers[name][k] = b


class MemberResMLP(MemberNet):
    """K ResidualMLPs of one shape on the member axis."""

    lone_class = ResidualMLP

    def __init__(self, models: Sequence[ResidualMLP]):
        super().__init__(models)
        first = models[0]
        self.act = ACTIVATIONS[first.blocks[0].activation] if first.n_blocks else None
        self.block_eps = [b.ln.eps for b in first.blocks]
        self.out_eps = first.out_ln.eps

    def embed_input(self, x: torch.Tensor) -> torch.Tensor:
        """h_0 = embed(x): x (K, B, …) flattened per sample → (K, B, d)."""
        return member_linear(x.flatten(2), self.params["embed.weight"], self.params["embed.bias"])

    def block(self, l: int, h: torch.Tensor, linear: Layer = member_linear) -> torch.Tensor:
        """f_l(h) = W2 · act(W1 · LN(h)) per member; `linear` applies W1 and W2 (by name)."""
        p, pre = self.params, f"blocks.{l}."
        z = member_layer_norm(h, p[pre + "ln.weight"], p[pre + "ln.bias"], self.block_eps[l])
        z = self.act(linear(z, p[pre + "w1.weight"], p[pre + "w1.bias"], "w1"))
        return linear(z, p[pre + "w2.weight"], p[pre + "w2.bias"], "w2")

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """logits = out_head(out_ln(h_L)) per member, (K, B, C)."""
        z = member_layer_norm(h, self.params["out_ln.weight"], self.params["out_ln.bias"], self.out_eps)
        return member_linear(z, self.params["out_head.weight"], self.params["out_head.bias"])


def member_images(x: torch.Tensor, input_shape: tuple[int, int, int]) -> torch.Tensor:
    """A member batch x (K, B, …) as images (K, B, C, H, W) (a flattened batch is viewed back)."""
    k, b = x.shape[:2]
    return as_images(x.reshape((k * b,) + x.shape[2:]), input_shape).view((k, b) + tuple(input_shape))


class MemberViTMini(MemberNet):
    """K ViTMinis of one shape on the member axis: per-member patch embedding, positions, attention
    and MLP weights, LayerNorm affines and head; states (K, B, T, d)."""

    lone_class = ViTMini

    def __init__(self, models: Sequence[ViTMini]):
        super().__init__(models)
        first = models[0]
        self.input_shape, self.patch, self.n_tokens = first.input_shape, first.patch, first.n_tokens
        self.heads = first.blocks[0].heads if first.n_blocks else 1
        self.act = ACTIVATIONS[first.blocks[0].activation] if first.n_blocks else None
        self.block_eps = [(b.ln1.eps, b.ln2.eps) for b in first.blocks]
        self.out_eps = first.out_ln.eps

    def embed_input(self, x: torch.Tensor) -> torch.Tensor:
        """h_0 = patch_embed(patches(x)) + pos per member: x (K, B, …) → (K, B, T, d)."""
        x = member_images(x, self.input_shape)
        k, b, c, hgt, wid = x.shape
        p = self.patch
        x = x.reshape(k, b, c, hgt // p, p, wid // p, p).permute(0, 1, 3, 5, 2, 4, 6)
        patches = x.reshape(k, b, self.n_tokens, c * p * p)
        h = member_linear(patches, self.params["patch_embed.weight"], self.params["patch_embed.bias"])
        return h + self.params["pos"].unsqueeze(1)

    def attn(self, l: int, h: torch.Tensor, layer: Layer = member_layer) -> torch.Tensor:
        """attn(LN1(h)) per member, (K, B, T, d) → (K, B, T, d)."""
        p, pre = self.params, f"blocks.{l}."
        k, b, t, d = h.shape
        z = member_layer_norm(h, p[pre + "ln1.weight"], p[pre + "ln1.bias"], self.block_eps[l][0])
        qkv = layer(z, p[pre + "qkv.weight"], p[pre + "qkv.bias"], "qkv")
        q, kk, v = qkv.reshape(k * b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, kk, v)                 # (K·B, heads, T, d/heads)
        return layer(out.transpose(1, 2).reshape(k, b, t, d), p[pre + "proj.weight"], p[pre + "proj.bias"], "proj")

    def mlp(self, l: int, u: torch.Tensor, layer: Layer = member_layer) -> torch.Tensor:
        """fc2(act(fc1(LN2(u)))) per member."""
        p, pre = self.params, f"blocks.{l}."
        z = member_layer_norm(u, p[pre + "ln2.weight"], p[pre + "ln2.bias"], self.block_eps[l][1])
        z = self.act(layer(z, p[pre + "fc1.weight"], p[pre + "fc1.bias"], "fc1"))
        return layer(z, p[pre + "fc2.weight"], p[pre + "fc2.bias"], "fc2")

    def block(self, l: int, h: torch.Tensor, layer: Layer = member_layer) -> torch.Tensor:
        """f_l(h) = a + mlp(LN2(h + a)), a = attn(LN1(h)): the block's total update, as the lone
        TransformerBlock computes it."""
        a = self.attn(l, h, layer)
        return a + self.mlp(l, h + a, layer)

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """logits = out_head(mean over tokens of out_ln(h_L)) per member, (K, B, C)."""
        z = member_layer_norm(h, self.params["out_ln.weight"], self.params["out_ln.bias"], self.out_eps)
        return member_linear(z.mean(2), self.params["out_head.weight"], self.params["out_head.bias"])


class MemberSmallResNet(MemberNet):
    """K SmallResNets of one shape on the member axis: convolutions grouped by member, BatchNorm
    per member and channel with each member's running buffers; states (K, B, C, H, W)."""

    lone_class = SmallResNet

    def __init__(self, models: Sequence[SmallResNet]):
        super().__init__(models)
        first = models[0]
        self.input_shape, self.stem_stride = first.input_shape, first.stem_stride
        self.bn = {name: (m.momentum, m.eps) for name, m in first.named_modules()
                   if isinstance(m, nn.BatchNorm2d)}
        if any(m.momentum is None or not m.track_running_stats or not m.affine for m in first.modules()
               if isinstance(m, nn.BatchNorm2d)):
            raise ValueError("MemberSmallResNet stacks affine BatchNorms with running statistics "
                             "and a momentum")

    def batch_norm(self, name: str, g: torch.Tensor) -> torch.Tensor:
        """The lone BatchNorm2d `name` per member on the grouped layout (B, K·C, H, W): in
        training mode batch statistics per member and channel, each member's running buffers
        updated in place with the lone momentum (and its num_batches_tracked counted); in eval
        mode the running statistics."""
        momentum, eps = self.bn[name]
        p, b = self.params, self.buffers
        if self.training:
            b[name + ".num_batches_tracked"].add_(1)
        return F.batch_norm(g, b[name + ".running_mean"].view(-1), b[name + ".running_var"].view(-1),
                            p[name + ".weight"].reshape(-1), p[name + ".bias"].reshape(-1),
                            self.training, momentum, eps)

    def embed_input(self, x: torch.Tensor) -> torch.Tensor:
        """h_0 = ReLU(BN(conv3×3_s(x))) per member: x (K, B, …) → (K, B, width, H', W')."""
        g = to_groups(member_images(x, self.input_shape))
        g = member_conv2d(g, self.params["stem.weight"], None, "stem", self.stem_stride)
        return from_groups(torch.relu(self.batch_norm("stem_bn", g)), self.n_members)

    def block(self, l: int, h: torch.Tensor, layer: Layer = member_layer) -> torch.Tensor:
        """f_l(h) = BN2(conv2(ReLU(BN1(conv1(h))))) per member; `layer` applies conv1 and conv2
        on the grouped layout."""
        p, pre = self.params, f"blocks.{l}."
        g = layer(to_groups(h), p[pre + "conv1.weight"], None, "conv1")
        g = torch.relu(self.batch_norm(pre + "bn1", g))
        g = self.batch_norm(pre + "bn2", layer(g, p[pre + "conv2.weight"], None, "conv2"))
        return from_groups(g, self.n_members)

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """logits = out_head(global average pool of h_L) per member, (K, B, C)."""
        return member_linear(h.mean((3, 4)), self.params["out_head.weight"], self.params["out_head.bias"])


class FlatMembers:
    """A member net seen with every state flattened per sample, (K, B, D), D = prod(stream_shape):
    for a method whose member arithmetic is written on flat states (sb's and cb's probes read h_l
    as D values, as their lone steps do). The same parameters, buffers and forward; only views."""

    def __init__(self, net: MemberNet):
        self.net, self.params, self.buffers = net, net.params, net.buffers
        self.n_members, self.n_blocks, self.n_classes = net.n_members, net.n_blocks, net.n_classes
        self.stream_shape = (math.prod(net.stream_shape),)

    def _stream(self, h: torch.Tensor) -> torch.Tensor:
        return h.reshape(h.shape[:2] + self.net.stream_shape)

    def block_params(self, l: int) -> list[torch.Tensor]:
        return self.net.block_params(l)

    def embed_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.embed_input(x).flatten(2)

    def block(self, l: int, h: torch.Tensor, layer: Layer = member_layer) -> torch.Tensor:
        return self.net.block(l, self._stream(h), layer).flatten(2)

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        return self.net.readout(self._stream(h))


def flat_members(net: MemberNet) -> MemberNet | FlatMembers:
    """`net` with flat states (`FlatMembers`); a net whose states are flat already (the ResMLP's)
    as it is."""
    return net if len(net.stream_shape) == 1 else FlatMembers(net)


MEMBER_NETS: dict[type, type[MemberNet]] = {ResidualMLP: MemberResMLP, ViTMini: MemberViTMini,
                                            SmallResNet: MemberSmallResNet}


def stack_models(models: Sequence[nn.Module]) -> MemberNet:
    """The member net of K lone models of one architecture class (`MEMBER_NETS`)."""
    models = list(models)
    cls = next((MEMBER_NETS[c] for c in type(models[0]).__mro__ if c in MEMBER_NETS), None)
    if cls is None:
        raise TypeError(f"no member-axis form of {type(models[0]).__name__}; "
                        f"stackable: {', '.join(c.__name__ for c in MEMBER_NETS)}")
    return cls(models)


def member_cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean CE of each member over its own batch: logits (K, B, C), y (K, B) → (K,)."""
    k, b, c = logits.shape
    return F.cross_entropy(logits.reshape(k * b, c), y.reshape(k * b), reduction="none").view(k, b).mean(1)
