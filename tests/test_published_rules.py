"""Issue 27 item 2: rules as their authors published them, checked against the published equations
written out here independently, in float64 — dfa without normalisation is Nøkland 2016's DFA, and
node perturbation's Γ at chance is the derived √(2/π)·‖g_l‖/(√D·√Σ_k‖g_k‖²), measured. (PEPITA,
predsim and Kolen–Pollack have theirs in tests/test_zoo_b.py and tests/test_zoo.py.)"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from creditaudit.methods import MethodSettings, method_class
from creditaudit.methods.node_perturbation import chance_gamma
from creditaudit.metrics import bp_gradients, gradient_cosine
from creditaudit.model import ResidualMLP

TOL = dict(rtol=1e-10, atol=1e-12)


def test_dfa_without_normalisation_is_noklands_rule():
    """normalise = 0: a_{l+1} = e·B_lᵀ with e = softmax − onehot, no per-sample rms division; block l
    learns ΔW = ∂/∂W of mean_i ⟨f_l(h_l)_i, a_{l+1,i}⟩, the embedding from a_0 = e·B_0ᵀ, the head
    from the CE. Written out with one autograd call on the explicit objective."""
    torch.manual_seed(0)
    model = ResidualMLP(5, 8, 2, 3, w2_std=0.3).double()
    method = method_class("dfa")(model, MethodSettings(epochs=1, clip=1e9, trainable_blocks=(0, 1),
                                                        options={"normalise": 0}))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(7, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (7,), generator=g)
    with torch.no_grad():
        h = [model.embed_input(x)]
        for block in model.blocks:
            h.append(h[-1] + block(h[-1]))
        e = model.readout(h[-1]).softmax(-1) - F.one_hot(y, 3).double()
    b = method.feedback
    want = [e @ b[0].T, e @ b[0].T, e @ b[1].T]                          # a_0, a_1 (both B_0), a_2
    for got, w in zip(method.credit(x, y), want):
        torch.testing.assert_close(got, w, **TOL)
    objective = (F.cross_entropy(model.readout(h[-1]), y) + (model.embed_input(x) * want[0]).sum(-1).mean()
                 + sum((blk(hl) * a).sum(-1).mean() for blk, hl, a in zip(model.blocks, h, want[1:])))
    names = [n for n, _ in model.named_parameters()]
    expected = dict(zip(names, torch.autograd.grad(objective, list(model.parameters()))))
    method.clear_gradients()
    method.gradients(x, y)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], **TOL, msg=n)
    normalised = method_class("dfa")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1)))
    rms = want[2].pow(2).mean(-1, keepdim=True).sqrt()
    torch.testing.assert_close(normalised.credit(x, y)[2], want[2] / (rms + 1e-6), **TOL)  # the script's


def test_node_perturbation_gamma_at_chance_is_the_derived_formula():
    """Γ_l of one noise draw per sample, measured on 4000 samples of a width-64, 2-block ResMLP,
    equals √(2/π)·mean_i ‖g_l,i‖/(√D·√Σ_k‖g_k,i‖²) to within sampling error (SE ≈ 0.002), and
    not the formula that left out the other positions' noise, √(2/π)/√D ≈ 0.100."""
    torch.manual_seed(0)
    d, n = 64, 4000
    model = ResidualMLP(5, d, 2, 3, w2_std=0.3).double()
    method = method_class("node-perturbation")(model, MethodSettings(
        epochs=1, trainable_blocks=(0, 1), options={"sigma": 1e-5}))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)
    grads = bp_gradients(model, x, y).grads
    measured = gradient_cosine(method.credit(x, y), grads)
    predicted = chance_gamma(grads)
    old = math.sqrt(2 / math.pi) / math.sqrt(d)
    for m, p in zip(measured, predicted):
        assert abs(m - p) < 0.01, (measured, predicted)
    assert old - sum(measured) / 3 > 0.03, (measured, old)
    # the positions' gradients are of similar size here, so the mean is near √(2/π)/√(D·(L+1))
    assert abs(sum(predicted) / 3 - old / math.sqrt(3)) < 0.01, predicted
