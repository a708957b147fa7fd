"""SmallResNet (docs/PROTOCOL.md): a conv stem, L constant-width BasicBlock branches, global pool, Linear head.

    h_0     = ReLU(BN(conv3×3_s(x)))                    x (N, C_in, H, W) → h_0 (N, width, H', W')
    f_l(h)  = BN2(conv3×3(ReLU(BN1(conv3×3(h)))))      ← blocks[l], the BasicBlock's residual branch
    h_{l+1} = h_l + f_l(h_l)                            identity skip, NO ReLU after the addition
    logits  = head(mean_{H',W'}(h_L))                   global average pool, Linear; no terminal LN

Choices (the paper is silent or leaves them open):
  * No ReLU after the skip addition (the original BasicBlock has one). With it the stream would not
    be additive: h_{l+1} = ReLU(h_l + f_l(h_l)) is not h_l + (a branch), so "the residual branch f_l"
    and the per-block growth ‖h_{l+1}‖/‖h_l‖ would no longer mean what they mean for the ResMLP and
    ViT. Without it h_{l+1} = h_l + f_l(h_l) holds exactly, like every ResidualModel (the
    "pre-activation-free" identity-stream variant). The stem's ReLU keeps h_0 ≥ 0.
  * Stem stride: 2 when the smaller image side is ≥ 16 (CIFAR 32×32 → 16×16 maps, MNIST 28×28 →
    14×14), 1 for small inputs (digits 8×8 stay 8×8). The option `stem_stride` (1 or 2) overrides it;
    0 means this automatic choice.
  * The last BN of each branch has its scale γ initialised to the constant `w2_std` (bias 0), the
    "zero-init residual" trick made small rather than exactly zero (so branches and their gradients
    are not exactly zero at init): a fresh stack is near the identity, like the ResMLP's small W2.
  * Convolutions have no bias (each is followed by BatchNorm). The head has no terminal LayerNorm:
    SPEC's point is that the floor check (b) then behaves differently.
  * BatchNorm running statistics are buffers, not parameters: a frozen block's weights stay bit-
    identical, but in training mode its BN still uses batch statistics and tracks running ones.

The model accepts images (N, C, H, W); a batch flattened to (N, C·H·W) is viewed back as images.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import CreditAuditError
from .base import ResidualModel, check_arguments
from .vit import as_images


def auto_stem_stride(height: int, width: int) -> int:
    """2 for images whose smaller side is ≥ 16 (CIFAR, MNIST), else 1 (8×8 digits)."""
    return 2 if min(height, width) >= 16 else 1


class BasicBlock(nn.Module):
    """The residual branch of a BasicBlock, conv3×3-BN-ReLU-conv3×3-BN (the skip is added by the caller)."""

    def __init__(self, width: int, w2_std: float = 0.01):
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        nn.init.constant_(self.bn2.weight, w2_std)    # small γ: a fresh stack is near the identity
        nn.init.zeros_(self.bn2.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(h)))))


class SmallResNet(ResidualModel):
    """Conv stem, L constant-width BasicBlock branches (identity skips), global average pool, head."""

    def __init__(self, input_shape: tuple[int, int, int], width: int = 64, n_blocks: int = 4,
                 n_classes: int = 10, stem_stride: int = 0, w2_std: float = 0.01):
        super().__init__()
        check_arguments("resnet-small", input_shape, w2_std, width=width, n_blocks=n_blocks,
                        n_classes=n_classes)
        c, hgt, wid = (int(s) for s in input_shape)
        if stem_stride not in (0, 1, 2):
            raise CreditAuditError(f"resnet-small: stem_stride must be 0 (automatic), 1 or 2, "
                                   f"got {stem_stride!r}")
        stride = stem_stride or auto_stem_stride(hgt, wid)
        self.input_shape, self.width, self.n_classes, self.stem_stride = (c, hgt, wid), width, n_classes, stride
        out_h, out_w = (hgt - 1) // stride + 1, (wid - 1) // stride + 1   # 3×3, padding 1
        self.stream_shape = (width, out_h, out_w)
        self.stem = nn.Conv2d(c, width, 3, stride=stride, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(width)
        self.blocks = nn.ModuleList(BasicBlock(width, w2_std) for _ in range(n_blocks))
        self.out_head = nn.Linear(width, n_classes)

    def embed_input(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.stem_bn(self.stem(as_images(x, self.input_shape))))

    def readout(self, h_last: torch.Tensor) -> torch.Tensor:
        """logits = out_head(global average pool of h_L)."""
        return self.out_head(h_last.mean((2, 3)))

    def embed_parameters(self) -> list[nn.Parameter]:
        return list(self.stem.parameters()) + list(self.stem_bn.parameters())

    def head_parameters(self) -> list[nn.Parameter]:
        return list(self.out_head.parameters())
