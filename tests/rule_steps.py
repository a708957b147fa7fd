"""What every rule's lone step must do, checked the same way for each family's tests: the step is a
function of the seed (the same seed twice gives the same weights, another seed other blocks), and
the frozen control leaves the blocks bit-identical at their initialisation while the readout trains.
"""
from __future__ import annotations

from typing import Callable

import torch

from creditaudit.methods import MethodSettings, method_class


def check_step_reproducible_and_frozen_blocks_stay(name: str, make_model: Callable[[], torch.nn.Module],
                                                   options: dict | None = None, steps: int = 3) -> None:
    """Three steps of rule `name` on `make_model()` (built after torch.manual_seed(0)), 16 inputs,
    10 classes, batches of 32, with `options`."""
    def trained(trainable, seed=5):
        torch.manual_seed(0)
        model = make_model()
        method = method_class(name)(model, MethodSettings(epochs=1, seed=seed, trainable_blocks=trainable,
                                                          batch_size=32, options=dict(options or {})))
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            method.train_step(torch.randn(32, 16, generator=g), torch.randint(0, 10, (32,), generator=g))
        return model
    a, b, other = trained((0, 1)), trained((0, 1)), trained((0, 1), seed=6)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.blocks.parameters(), other.blocks.parameters()))
    torch.manual_seed(0)
    init = make_model()
    frozen = trained(())
    assert all(torch.equal(p, q) for p, q in zip(frozen.blocks.parameters(), init.blocks.parameters()))
    assert not torch.equal(frozen.out_head.weight, init.out_head.weight)
