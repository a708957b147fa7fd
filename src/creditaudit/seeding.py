"""Seeds and the generators derived from them (docs/PROTOCOL.md).

A run's seed fixes `torch.manual_seed` / `numpy.random.seed` (model init) and, through
`derived_generator(seed, purpose)`, one independent CPU generator per purpose ("data" for batch
order and augmentation, "feedback" for feedback matrices, …), so each stream of random numbers can
be rebuilt on its own and does not shift when another part of the code draws more numbers.
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


def seed_everything(seed: int) -> None:
    """Seed the global RNGs used for model initialisation."""
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)
