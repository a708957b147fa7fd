"""The plain MLP of the rules' own papers: no residual stream, no LayerNorm.

    h_0     = x                                     flattened to (N, D_in); no parameters
    f_l(h)  = dropout(act(W_l · n(h) + b_l))        l = 0 … L-1, W_0: (d, D_in), W_l: (d, d)
    h_{l+1} = f_l(h_l)                              no skip
    logits  = out_head(n(h_L))                      W_out: (C, d)
    n(h)    = h                                     norm "none" (the default)
            = h / (rms(h) + 1e-8)                   norm "rms": every layer's input, and the readout's,
                                                    length-normalised per sample (Hinton's ffnormrows,
                                                    the Forward-Forward network)
    loss    = CE(softmax(logits), y)  or  Σ_c BCE(σ(logits_c), onehot(y)_c)   (`loss` option)

So "784-1000-10" is `blocks = 1, width = 1000`, and Nøkland's "7×240 tanh" `blocks = 7, width = 240,
activation = tanh`; `blocks = 0` (the audit's shallow control) is a linear classifier on x. Every hidden layer is a block; the readout is the last Linear. The protocol
reads it as it reads a residual model (model/stream.py with `residual = False`):

  * the positions h_1 … h_L are the hidden layers' activations (h_0 is the input itself);
  * the frozen control keeps every hidden layer at its initialisation and trains the readout
    alone: the random-features classifier of the same width (nothing else has parameters);
  * there is no residual branch, so the branch ratio and the frozen-init identity check are not
    measured (docs/PROTOCOL.md, "Networks without a residual stream").

Initialisation (`init`): "torch", nn.Linear's default W, b ~ U(±1/√fan_in); "he-uniform",
W ~ U(±√(6/fan_in)) and b = 0 (PEPITA's reference code); "fan-sum-normal", W, b ~ N(0, 1/(fan_in +
fan_out)) (Akrout et al.'s MNIST code for fa and Kolen–Pollack); "fan-in-normal", W ~ N(0, 1/fan_in)
and b = 0 (Hinton's Forward-Forward code, ffnew.m:79-80); "xavier-normal", W ~ N(0, 2/(fan_in + fan_out))
and b = 0 (torch's xavier_normal_, Meulemans et al.'s target-propagation code). `bias = 0` builds
every layer without biases (PEPITA's reference has none).
Dropout (Nøkland & Eidnes 2019's MLP uses 0.1 in its MNIST commands) acts in training mode only, on
each hidden layer's output, never on the input. A plain MLP trains lone: no rule's member axis
(model/members.py) is written for it, so stacking leaves its runs alone.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import CreditAuditError
from .base import ResidualModel, check_arguments
from .resmlp import ACTIVATIONS
from .stream import LOSSES


INITS = ("torch", "he-uniform", "fan-sum-normal", "fan-in-normal", "xavier-normal")
NORMS = ("none", "rms")
NORM_EPS = 1e-8


@torch.no_grad()
def initialised(layer: nn.Linear, init: str) -> nn.Linear:
    """`layer` with its weights drawn as `init` says (module docstring), from torch's global RNG."""
    if init == "he-uniform":
        bound = (6.0 / layer.in_features) ** 0.5
        layer.weight.uniform_(-bound, bound)
        if layer.bias is not None:
            layer.bias.zero_()
    elif init == "fan-sum-normal":
        std = (1.0 / (layer.in_features + layer.out_features)) ** 0.5
        layer.weight.normal_(0.0, std)
        if layer.bias is not None:
            layer.bias.normal_(0.0, std)
    elif init == "fan-in-normal":
        layer.weight.normal_(0.0, (1.0 / layer.in_features) ** 0.5)
        if layer.bias is not None:
            layer.bias.zero_()
    elif init == "xavier-normal":
        layer.weight.normal_(0.0, (2.0 / (layer.in_features + layer.out_features)) ** 0.5)
        if layer.bias is not None:
            layer.bias.zero_()
    elif init != "torch":
        raise CreditAuditError(f"mlp: init must be one of {', '.join(INITS)}, got {init!r}")
    return layer


def length_normalised(h: torch.Tensor) -> torch.Tensor:
    """h / (rms(h) + 1e-8) per sample (each row's mean square made 1: Hinton's ffnormrows; its
    e^−100 guard is 0 in float32, so an all-zero row would give 0/0 there)."""
    return h / (h.pow(2).mean(-1, keepdim=True).sqrt() + NORM_EPS)


class Layer(nn.Module):
    """One hidden layer f(h) = dropout(act(W·n(h) + b)) (a block of the plain MLP); n the length
    normalisation with norm "rms", else the identity."""

    def __init__(self, d_in: int, d_out: int, activation: str, dropout: float, init: str = "torch",
                 bias: bool = True, norm: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise CreditAuditError(
                f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)}")
        self.activation = activation
        self.linear = initialised(nn.Linear(d_in, d_out, bias=bias), init)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.norm = norm

    def layer_input(self, h: torch.Tensor) -> torch.Tensor:
        """What W sees: n(h)."""
        return length_normalised(h) if self.norm else h

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.dropout(ACTIVATIONS[self.activation](self.linear(self.layer_input(h))))


class PlainMLP(ResidualModel):
    """D_in → d → … → d → C, `n_blocks` hidden layers of width d, no skips (see the module docstring)."""

    residual = False

    def __init__(self, d_in: int, d: int = 256, n_blocks: int = 1, n_classes: int = 10,
                 activation: str = "relu", dropout: float = 0.0, loss: str = "ce", init: str = "torch",
                 bias: bool = True, norm: str = "none"):
        super().__init__()
        check_arguments("mlp", d_in=d_in, d=d, n_blocks=n_blocks, n_classes=n_classes)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise CreditAuditError(f"mlp: dropout must be a number in [0, 1), got {dropout!r}")
        if loss not in LOSSES:
            raise CreditAuditError(f"mlp: loss must be one of {', '.join(LOSSES)}, got {loss!r}")
        if norm not in NORMS:
            raise CreditAuditError(f"mlp: norm must be one of {', '.join(NORMS)}, got {norm!r}")
        self.d_in, self.d, self.n_classes = d_in, d, n_classes
        self.loss_name, self.dropout_p = loss, float(dropout)
        self.norm = norm == "rms"
        self.stream_shape = (d,)
        self.blocks = nn.ModuleList(Layer(d_in if l == 0 else d, d, activation, dropout, init, bias,
                                          self.norm)
                                    for l in range(n_blocks))
        # with no hidden layer (the audit's shallow control) the readout reads the input itself:
        # a linear classifier on x
        self.out_head = initialised(nn.Linear(d if n_blocks else d_in, n_classes, bias=bias), init)

    def position_shape(self, layer: int) -> tuple[int, ...]:
        """h_0 is the input (D_in,); every hidden layer's activation is (d,)."""
        return (self.d_in,) if layer == 0 else (self.d,)

    def embed_input(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)

    def readout(self, h_last: torch.Tensor) -> torch.Tensor:
        """logits = out_head(n(h_L))."""
        return self.out_head(self.readout_input(h_last))

    def readout_input(self, h_last: torch.Tensor) -> torch.Tensor:
        """What W_out sees: n(h_L)."""
        return length_normalised(h_last) if self.norm else h_last

    def embed_parameters(self) -> list[nn.Parameter]:
        return []

    def head_parameters(self) -> list[nn.Parameter]:
        return list(self.out_head.parameters())
