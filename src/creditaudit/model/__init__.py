"""Architectures and the residual-stream interface the protocol audits them through.

    build_model("resmlp", (40,), 10, width=256, blocks=4)              # docs/PROTOCOL.md primary architecture
    build_model("vit-mini", (3, 32, 32), 10, width=256, blocks=4)     # images only
    build_model("resnet-small", (3, 32, 32), 10, width=64, blocks=4)  # images only
    build_model("mlp", (1, 28, 28), 10, width=1000, blocks=1, activation="tanh")   # a paper's 784-1000-10
"""
from __future__ import annotations

import math
from typing import Any, Callable

from ..errors import CreditAuditError
from .base import ResidualModel
from .plain import Layer, PlainMLP
from .resmlp import ACTIVATIONS, Block, ResidualMLP
from .resnet import BasicBlock, SmallResNet
from .stream import ResidualStream, as_stream
from .vit import TransformerBlock, ViTMini

IMAGE_DATASETS = "cifar10, cifar100, mnist or mnist-01, fashion-mnist or fashion-mnist-01, or digits"

# Architecture-specific knobs and their defaults (the shared ones — width, blocks, activation,
# w2_std — are build_model's own arguments). The config layer validates against this table.
ARCH_OPTIONS: dict[str, dict[str, Any]] = {
    "resmlp": {},
    "vit-mini": {"patch": 4, "heads": 4, "mlp_ratio": 2},
    "resnet-small": {"stem_stride": 0},          # 0: automatic (2 for images ≥ 16 px, else 1)
    "mlp": {"dropout": 0.0, "loss": "ce", "init": "torch", "bias": 1, "norm": "none"},
}

ARCH_OPTION_HELP: dict[str, dict[str, str]] = {
    "resmlp": {},
    "vit-mini": {"patch": "patch side p (image sides must be divisible by p)",
                 "heads": "attention heads (width must be divisible by it)",
                 "mlp_ratio": "MLP hidden width = mlp_ratio · width"},
    "resnet-small": {"stem_stride": "stride of the 3×3 stem conv: 1, 2, or 0 = automatic "
                                    "(2 when the smaller image side is ≥ 16, else 1)"},
    "mlp": {"dropout": "dropout probability on each hidden layer's output in training, in [0, 1)",
            "loss": "output loss: ce (softmax + cross-entropy) or bce (sigmoid + per-class BCE)",
            "init": "weights: torch (nn.Linear's default), he-uniform (U(±√(6/fan_in)), b = 0), "
                    "fan-sum-normal (N(0, 1/(fan_in + fan_out))), fan-in-normal (N(0, 1/fan_in), b = 0) or "
                    "xavier-normal (N(0, 2/(fan_in + fan_out)), b = 0)",
            "bias": "1: every layer has biases; 0: none",
            "norm": "none, or rms: every layer's input and the readout's length-normalised per sample "
                    "(h / rms(h): Hinton's Forward-Forward network)"},
}

# the allowed values of an architecture option that is a word
ARCH_OPTION_CHOICES: dict[str, dict[str, tuple[str, ...]]] = {
    "mlp": {"loss": ("ce", "bce"),
            "init": ("torch", "he-uniform", "fan-sum-normal", "fan-in-normal", "xavier-normal"),
            "norm": ("none", "rms")}}
# integer architecture options: their inclusive range (others: ≥ 1)
ARCH_OPTION_RANGES: dict[str, tuple[int, int]] = {"stem_stride": (0, 2 ** 31), "bias": (0, 1)}


def resolve_arch_options(arch: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """ARCH_OPTIONS[arch] overridden by `options`; an unknown key or a non-integer value is a user error."""
    if arch not in ARCH_OPTIONS:
        raise CreditAuditError(f"unknown architecture {arch!r}; choose one of: {', '.join(ARCH_OPTIONS)}")
    options = dict(options or {})
    defaults = ARCH_OPTIONS[arch]
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise CreditAuditError(f"architecture {arch} has no option(s) {', '.join(unknown)}; "
                               f"its options: {', '.join(defaults) or 'none'}")
    for key, value in options.items():
        default = defaults[key]
        if isinstance(default, str):
            choices = ARCH_OPTION_CHOICES.get(arch, {}).get(key, ())
            if value not in choices:
                raise CreditAuditError(f"option {key} of architecture {arch} must be one of "
                                       f"{', '.join(choices)}, got {value!r}")
            continue
        if isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or not 0 <= value < 1:
                raise CreditAuditError(f"option {key} of architecture {arch} must be a number in "
                                       f"[0, 1), got {value!r}")
            options[key] = float(value)
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise CreditAuditError(f"option {key} of architecture {arch} must be an integer, got {value!r}")
        low, high = ARCH_OPTION_RANGES.get(key, (1, 2 ** 31))
        if value < low:
            raise CreditAuditError(f"option {key} of architecture {arch} must be ≥ {low}, got {value!r}")
        if value > high:
            raise CreditAuditError(f"option {key} of architecture {arch} must be ≤ {high}, got {value!r}")
    return {**defaults, **options}


def _needs_images(arch: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise CreditAuditError(f"architecture {arch} needs image data (C, H, W); dataset input is "
                               f"{tuple(input_shape)} — use {IMAGE_DATASETS}")
    return tuple(int(s) for s in input_shape)          # type: ignore[return-value]


def _resmlp(input_shape, n_classes, width, blocks, activation, w2_std, opts) -> ResidualModel:
    return ResidualMLP(math.prod(input_shape), d=width, n_blocks=blocks, n_classes=n_classes,
                       activation=activation, w2_std=w2_std)


def _vit(input_shape, n_classes, width, blocks, activation, w2_std, opts) -> ResidualModel:
    return ViTMini(_needs_images("vit-mini", input_shape), d=width, n_blocks=blocks,
                   n_classes=n_classes, heads=opts["heads"], mlp_ratio=opts["mlp_ratio"],
                   patch=opts["patch"], activation=activation, w2_std=w2_std)


def _resnet(input_shape, n_classes, width, blocks, activation, w2_std, opts) -> ResidualModel:
    return SmallResNet(_needs_images("resnet-small", input_shape), width=width, n_blocks=blocks,
                       n_classes=n_classes, stem_stride=opts["stem_stride"], w2_std=w2_std)


def _mlp(input_shape, n_classes, width, blocks, activation, w2_std, opts) -> ResidualModel:
    return PlainMLP(math.prod(input_shape), d=width, n_blocks=blocks, n_classes=n_classes,
                    activation=activation, dropout=opts["dropout"], loss=opts["loss"], init=opts["init"],
                    bias=bool(opts["bias"]), norm=opts["norm"])


ARCHITECTURES: dict[str, Callable[..., ResidualModel]] = {
    "resmlp": _resmlp,
    "vit-mini": _vit,
    "resnet-small": _resnet,
    "mlp": _mlp,
}


# the class each architecture builds (what a method's member axis is written for)
ARCH_CLASSES: dict[str, type[ResidualModel]] = {
    "resmlp": ResidualMLP,
    "vit-mini": ViTMini,
    "resnet-small": SmallResNet,
    "mlp": PlainMLP,
}


def build_model(arch: str, input_shape: tuple[int, ...], n_classes: int, *, width: int, blocks: int,
                activation: str = "gelu", w2_std: float = 0.01,
                options: dict[str, Any] | None = None) -> ResidualModel:
    """The architecture `arch` for inputs of per-sample shape `input_shape` ((D,) for features,
    (C, H, W) for images) and `n_classes` classes.

    width:      ResMLP/ViT stream width d; ResNet channel count; the plain MLP's hidden width.
    blocks:     number of residual blocks L (the plain MLP: hidden layers, ≥ 1).
    activation: the ResMLP's block activation and the ViT's MLP activation. resnet-small always
                uses ReLU (the BasicBlock of docs/PROTOCOL.md) and does not read it.
    w2_std:     near-identity start — std of the last projection of every branch (ResMLP W2; ViT
                attention `proj` and MLP `fc2`); for resnet-small the constant γ of each branch's
                last BatchNorm.
    options:    architecture-specific knobs, see ARCH_OPTIONS (validated; unknown keys are an error).

    "resmlp" builds exactly ResidualMLP(prod(input_shape), …) (same parameter init order, so seeded
    results are unchanged); "vit-mini" and "resnet-small" need image input.
    """
    opts = resolve_arch_options(arch, options)
    return ARCHITECTURES[arch](tuple(input_shape), n_classes, width, blocks, activation, w2_std, opts)


__all__ = ["ACTIVATIONS", "ARCHITECTURES", "ARCH_CLASSES", "ARCH_OPTIONS", "ARCH_OPTION_CHOICES", "ARCH_OPTION_HELP",
           "BasicBlock", "Block", "Layer", "PlainMLP",
           "ResidualMLP", "ResidualModel", "ResidualStream", "SmallResNet", "TransformerBlock",
           "ViTMini", "as_stream", "build_model", "resolve_arch_options"]
