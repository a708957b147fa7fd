"""What the installed torch's Dynamo can trace, for the tests that assert a step compiles whole.

Several rules take gradients inside their step (`h.detach().requires_grad_(True)`, then
`torch.autograd.grad`): EP's and pc's relaxations, the bridges' value pass, local losses. torch 2.13
traces that into one graph; torch 2.11 (the one on the lent H100) stops at `requires_grad_()`, and
the trainer then trains the rule eagerly with a warning (methods/base.py). A test that asserts the
step compiles whole skips on such a torch, and only for that reason: `compiled_call` re-raises any
other failure, and on a torch that traces the probe below it re-raises that one too.
"""
from __future__ import annotations

import functools

import pytest
import torch


@functools.cache
def dynamo_traces_inner_gradients() -> bool:
    """Whether a fullgraph compile of a function that makes a leaf and takes its gradient works."""
    def f(x):
        leaf = x.detach().requires_grad_(True)
        return torch.autograd.grad((leaf * leaf).sum(), leaf)[0]
    try:
        torch._dynamo.reset()
        torch.compile(f, backend="eager", fullgraph=True)(torch.ones(3))
        return True
    except Exception:  # noqa: BLE001 — any failure means: this torch cannot
        return False
    finally:
        torch._dynamo.reset()


def compiled_call(step, *args):
    """`step(*args)`, skipping the test when the step stops at `requires_grad_()` on a torch whose
    Dynamo cannot trace gradients taken inside a compiled function."""
    try:
        return step(*args)
    except torch._dynamo.exc.Unsupported as err:
        if "requires_grad_" in str(err) and not dynamo_traces_inner_gradients():
            pytest.skip(f"torch {torch.__version__}'s Dynamo cannot trace requires_grad_() inside a compiled "
                        "step: this rule trains eagerly on it")
        raise
