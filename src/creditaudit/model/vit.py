"""ViT-Mini (docs/PROTOCOL.md): a small pre-LN vision transformer seen as one residual stream of tokens.

    h_0     = patch_embed(patches(x)) + pos             x (N, C, H, W) → h_0 (N, T, d), T = (H/p)(W/p)
    u       = h + attn(LN1(h))                          the first residual branch (self-attention)
    h'      = u + mlp(LN2(u))                           the second residual branch (MLP)
    f_l(h)  = attn(LN1(h)) + mlp(LN2(u)) = h' − h       ← blocks[l]: the block's TOTAL residual update
    h_{l+1} = h_l + f_l(h_l)                            l = 0 … L-1 (the skip is added by ResidualModel)
    logits  = head(mean_T(out_ln(h_L)))                 terminal LayerNorm per token, mean-pool, Linear

A residual position h_l is the stream after a whole transformer block (both of its branches), so the
audit sees L + 1 positions of shape (T, d), as docs/PROTOCOL.md asks. Because ResidualModel adds the skip
itself, each block module returns the block's combined update f_l(h) = a + m with a = attn(LN1(h))
and m = mlp(LN2(h + a)); then h_{l+1} = h_l + f_l(h_l) is, in exact arithmetic, the usual
h_l → (h_l + a) + m of a pre-LN transformer block (in floating point the two sums differ only in
the order of one addition: h + (a + m) instead of (h + a) + m).

Attention is torch's scaled_dot_product_attention (no mask, no dropout). The last projection of each
branch (attention output `proj`, MLP `fc2`) is initialised small, weight ~ N(0, w2_std²), bias 0,
like the ResidualMLP's W2, so a fresh stack is near the identity. Learned position embeddings are
initialised N(0, 0.02²) (the usual ViT choice); every other Linear keeps torch's default init.

The model accepts images (N, C, H, W); a batch flattened to (N, C·H·W) is viewed back as images.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import CreditAuditError
from .base import ResidualModel, check_arguments
from .resmlp import ACTIVATIONS


def as_images(x: torch.Tensor, input_shape: tuple[int, int, int]) -> torch.Tensor:
    """x as a batch of images of `input_shape`; a flattened batch (N, C·H·W) is viewed back."""
    if x.dim() == 2 and x.shape[1] == math.prod(input_shape):
        return x.view((x.shape[0],) + tuple(input_shape))
    if tuple(x.shape[1:]) != tuple(input_shape):
        raise CreditAuditError(f"the model expects inputs of shape (N, {', '.join(map(str, input_shape))}), "
                               f"got {tuple(x.shape)}")
    return x


class TransformerBlock(nn.Module):
    """One pre-LN transformer block as ONE residual branch: forward(h) = a + mlp(LN2(h + a)),
    a = attn(LN1(h)), the block's total update (the skip h is added by the caller)."""

    def __init__(self, d: int, heads: int, mlp_ratio: int, activation: str = "gelu",
                 w2_std: float = 0.01):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise CreditAuditError(
                f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)}")
        if d % heads:
            raise CreditAuditError(f"vit-mini: width {d} is not divisible by heads={heads}")
        self.heads, self.activation = heads, activation
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, mlp_ratio * d)
        self.fc2 = nn.Linear(mlp_ratio * d, d)
        for last in (self.proj, self.fc2):          # near-identity start, like the ResMLP's W2
            nn.init.normal_(last.weight, std=w2_std)
            nn.init.zeros_(last.bias)

    def attn(self, h: torch.Tensor) -> torch.Tensor:
        """Multi-head self-attention branch attn(LN1(h)), (N, T, d) → (N, T, d)."""
        n, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)                  # (N, heads, T, d/heads)
        return self.proj(out.transpose(1, 2).reshape(n, t, d))

    def mlp(self, u: torch.Tensor) -> torch.Tensor:
        """MLP branch fc2(act(fc1(LN2(u))))."""
        return self.fc2(ACTIVATIONS[self.activation](self.fc1(self.ln2(u))))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a = self.attn(h)
        return a + self.mlp(h + a)                  # f(h) = (h + a + m) − h, computed without cancellation


class ViTMini(ResidualModel):
    """Patch embedding + positions, L pre-LN transformer blocks, terminal LN, mean-pool, Linear head."""

    def __init__(self, input_shape: tuple[int, int, int], d: int = 256, n_blocks: int = 4,
                 n_classes: int = 10, heads: int = 4, mlp_ratio: int = 2, patch: int = 4,
                 activation: str = "gelu", w2_std: float = 0.01):
        super().__init__()
        check_arguments("vit-mini", input_shape, w2_std, d=d, n_blocks=n_blocks, n_classes=n_classes, heads=heads,
                        mlp_ratio=mlp_ratio, patch=patch)
        c, hgt, wid = (int(s) for s in input_shape)
        if patch < 1 or hgt % patch or wid % patch:
            raise CreditAuditError(f"vit-mini: image size {hgt}×{wid} is not divisible by patch={patch}")
        self.input_shape, self.patch, self.d, self.n_classes = (c, hgt, wid), patch, d, n_classes
        self.n_tokens = (hgt // patch) * (wid // patch)
        self.stream_shape = (self.n_tokens, d)
        self.patch_embed = nn.Linear(c * patch * patch, d)
        self.pos = nn.Parameter(torch.empty(self.n_tokens, d))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList(TransformerBlock(d, heads, mlp_ratio, activation, w2_std)
                                    for _ in range(n_blocks))
        self.out_ln = nn.LayerNorm(d)
        self.out_head = nn.Linear(d, n_classes)

    def patches(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) → (N, T, C·p·p): non-overlapping p×p patches in row-major order."""
        x = as_images(x, self.input_shape)
        n, c, hgt, wid = x.shape
        p = self.patch
        x = x.reshape(n, c, hgt // p, p, wid // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(n, self.n_tokens, c * p * p)

    def embed_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.patch_embed(self.patches(x)) + self.pos

    def readout(self, h_last: torch.Tensor) -> torch.Tensor:
        """logits = out_head(mean over tokens of out_ln(h_L))."""
        return self.out_head(self.out_ln(h_last).mean(1))

    def embed_parameters(self) -> list[nn.Parameter]:
        return list(self.patch_embed.parameters()) + [self.pos]

    def head_parameters(self) -> list[nn.Parameter]:
        return list(self.out_ln.parameters()) + list(self.out_head.parameters())
