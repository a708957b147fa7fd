"""Seeds and the generators derived from them (docs/PROTOCOL.md).

A run's seed fixes `torch.manual_seed` / `numpy.random.seed` (model init) and, through
`derived_generator(seed, purpose)`, one independent CPU generator per purpose ("data" for batch
order and augmentation, "feedback" for feedback matrices, …), so each stream of random numbers can
be rebuilt on its own and does not shift when another part of the code draws more numbers.
Every random number a run uses is drawn on the CPU and copied to the device (`draw_on_host` for a
method's per-step draws, `ArrayDataset.train_batches` for an epoch's order and augmentation), so a
seed gives the same numbers on any device.
"""
from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def derived_seed(seed: int, purpose: str) -> int:
    """A 63-bit seed that depends only on (seed, purpose)."""
    digest = hashlib.sha256(f"{seed}:{purpose}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def derived_generator(seed: int, purpose: str) -> torch.Generator:
    """A fresh CPU generator for one purpose of one run."""
    return torch.Generator().manual_seed(derived_seed(seed, purpose))


def draw_on_host(sampler, shape: tuple[int, ...], gen: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """`sampler(shape)` (torch.rand: U[0, 1), torch.randn: N(0, 1)) drawn from the CPU generator
    `gen`, then moved to `like`'s device and dtype: the numbers depend on the seed alone, not on
    the device. Drawn in float64 for a float64 `like`, else in float32 (then cast). For CUDA the draw
    lands in pinned memory and the copy is asynchronous (non_blocking: no host sync; the caching
    host allocator keeps the block until the copy has run). A generator on another device is refused
    by the sampler itself (it draws a CPU tensor)."""
    dtype = like.dtype if like.dtype in (torch.float32, torch.float64) else torch.float32
    out = sampler(shape, generator=gen, dtype=dtype, pin_memory=like.device.type == "cuda")
    return out.to(device=like.device, dtype=like.dtype, non_blocking=True)


def from_one_state(fn, batches, gen: torch.Generator) -> list:
    """[fn(x, y, gen) for each (x, y) of `batches`], each call given `gen` at its state on entry: a
    function that draws from `gen` first draws the same for every batch (Γ's null: one draw of a
    rule's feedback is one feedback on every eval batch)."""
    start = gen.get_state()
    out = []
    for x, y in batches:
        gen.set_state(start)
        out.append(fn(x, y, gen))
    return out


def seed_everything(seed: int) -> None:
    """Seed the global RNGs used for model initialisation."""
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)
