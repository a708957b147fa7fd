"""fa, kolen-pollack and sign-symmetry on the plain MLP (arch mlp) as their authors ran them: every
layer's error, the readout's included, goes down through its B (Lillicrap et al. 2016), so the last
hidden layer's credit is e·B_out, not W_outᵀe; Kolen–Pollack learns B_out with W_out's update and
contracts W − B by the decay; sign-symmetry's B_out is M ∘ sign(W_out). Residual models keep their
exact readout (a_L = g_L; tests/test_gamma_exact.py measures it)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from creditaudit.methods import METHODS, MethodSettings
from creditaudit.methods.fa import draw_feedback
from creditaudit.methods.signsym import xavier
from creditaudit.metrics import bp_gradients
from creditaudit.model import PlainMLP, ResidualMLP, build_model
from creditaudit.protocol import diagnose

RULES = ("fa", "kolen-pollack", "sign-symmetry")


def _mlp(blocks=1, d_in=6, d=7, n_classes=4, seed=0, activation="tanh"):
    torch.manual_seed(seed)
    return PlainMLP(d_in, d, blocks, n_classes, activation=activation).double()


def _method(name, model, trainable=None, options=None, **settings):
    trainable = tuple(range(model.n_blocks)) if trainable is None else trainable
    return METHODS[name](model, MethodSettings(epochs=2, seed=0, trainable_blocks=trainable,
                                               options=dict(options or {}), **settings))


def _batch(n=9, d_in=6, n_classes=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d_in, generator=g, dtype=torch.float64),
            torch.randint(0, n_classes, (n,), generator=g))


def _grads(method, x, y):
    """The gradients one step of `method` leaves (the step's own path, without the optimizer step)."""
    method.clear_gradients()
    method.prepare_step()
    try:
        method.gradients(x, y)
    finally:
        method.end_step()
    return {n: p.grad.clone() for n, p in method.model.named_parameters() if p.grad is not None}


def test_fa_on_one_hidden_layer_mlp_is_the_original_rule():
    """h = tanh(x·W_0ᵀ + b_0), logits = h·W_outᵀ + b_out, e = (softmax − onehot)/N:
    FA's ∂W_0 = ((e·B_out) ⊙ tanh′(z))ᵀ·x, BP's uses W_out instead; the head's own gradient is eᵀ·h
    under both; the credit at h_1 is e·B_out and no position is exact."""
    model = _mlp()
    x, y = _batch()
    fa = _method("fa", model)
    b_out = fa.feedback[1]["out_head"]
    assert b_out.shape == model.out_head.weight.shape and not torch.equal(b_out, model.out_head.weight)
    with torch.no_grad():
        z = model.blocks[0].linear(x)
        h = torch.tanh(z)
        e = (torch.softmax(model.out_head(h), -1) - F.one_hot(y, 4)) / len(y)
        fa_dw0 = ((e @ b_out) * (1 - h ** 2)).T @ x
        bp_dw0 = ((e @ model.out_head.weight) * (1 - h ** 2)).T @ x
    grads = _grads(fa, x, y)
    torch.testing.assert_close(grads["blocks.0.linear.weight"], fa_dw0, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads["out_head.weight"], e.T @ h, rtol=1e-12, atol=1e-14)
    assert (fa_dw0 - bp_dw0).abs().max() > 1e-3 * bp_dw0.abs().max()      # not bp's update
    bp = _method("bp", model)
    torch.testing.assert_close(_grads(bp, x, y)["blocks.0.linear.weight"], bp_dw0, rtol=1e-12, atol=1e-14)
    credit = fa.credit(x, y)
    torch.testing.assert_close(credit[1], e @ b_out, rtol=1e-12, atol=1e-14)
    assert fa.exact_positions(1) == frozenset()
    assert [name for name, _, _ in fa.feedback_pairs()] == ["0.linear", "head.out_head"]


def test_fa_residual_models_keep_their_exact_readout():
    """On the ResMLP the readout stays exact: L units of feedback (no head B), a_L = g_L."""
    torch.manual_seed(0)
    model = ResidualMLP(6, 8, 2, 4, w2_std=0.5).double()
    fa = _method("fa", model)
    assert len(fa.feedback) == 2 and fa.exact_positions(2) == frozenset({2})
    assert all(not name.startswith("head") for name, _, _ in fa.feedback_pairs())
    x, y = _batch()
    torch.testing.assert_close(fa.credit(x, y)[-1], bp_gradients(model, x, y).grads[-1], rtol=1e-10, atol=1e-14)


def test_gammas_null_redraws_the_heads_feedback_on_the_mlp():
    """fa's null draws B_out afresh: a fresh draw changes a_L (= e·B_out), the trained B_out does not."""
    model = _mlp(blocks=2)
    fa = _method("fa", model)
    fresh = draw_feedback(model, torch.Generator().manual_seed(5))
    assert len(fresh) == 3 and fresh[2]["out_head"].shape == model.out_head.weight.shape
    x, y = _batch()
    own, null = fa.credit(x, y), fa.fresh_feedback_credit(x, y, torch.Generator().manual_seed(5))
    assert not torch.allclose(own[2], null[2])


@pytest.mark.parametrize("decay", [0.0, 0.05])
def test_kolen_pollack_update_on_the_mlp_includes_the_head(decay):
    """One step of the published plain SGD: ∂B = ∂W for every pair, the head's included;
    W ← W − lr·(∂W + λW), B ← B − lr·(∂B + λB), so W − B ← (1 − lr·λ)(W − B) exactly."""
    model = _mlp(blocks=2)
    kp = _method("kolen-pollack", model, options={"decay": decay})
    assert kp.recipe.optimizer == "sgd" and kp.recipe.momentum == 0 and kp.recipe.weight_decay == 0
    lr = kp.recipe.lr
    pairs = {name: (w, b) for name, w, b in kp.feedback_pairs()}
    assert set(pairs) == {"0.linear", "1.linear", "head.out_head"}
    assert {id(w) for w, _ in kp.pairs} == {id(w) for w, _ in pairs.values()}
    before = {name: (w.detach().clone(), b.clone()) for name, (w, b) in pairs.items()}
    x, y = _batch()
    kp.train_step(x, y)
    for name, (w, b) in pairs.items():
        w0, b0 = before[name]
        assert b.grad is w.grad is not None                                  # ∂B = ∂W
        torch.testing.assert_close(w.detach(), w0 - lr * (w.grad + decay * w0), rtol=0, atol=1e-15)
        torch.testing.assert_close(b, b0 - lr * (w.grad + decay * b0), rtol=0, atol=1e-15)
        torch.testing.assert_close(w.detach() - b, (1 - lr * decay) * (w0 - b0), rtol=0, atol=1e-15)
        if decay == 0:
            assert not torch.equal(b, b0)            # B learned with W's update


def test_kolen_pollack_frozen_control_on_the_mlp_is_the_random_features_readout():
    """No block trains: the blocks stay bit-identical, B_out does not learn, and the run is the
    same whatever λ_KP (it acts only when a block trains: trainable_only_options)."""
    heads = []
    for decay in (1e-4, 0.5):
        model = _mlp(blocks=2)
        blocks = [p.detach().clone() for p in model.blocks.parameters()]
        kp = _method("kolen-pollack", model, trainable=(), options={"decay": decay})
        b_out = kp.feedback[2]["out_head"].clone()
        assert kp.pairs == []
        for seed in range(3):
            kp.train_step(*_batch(seed=seed))
        assert all(torch.equal(p, q) for p, q in zip(model.blocks.parameters(), blocks))
        assert torch.equal(kp.feedback[2]["out_head"], b_out)
        heads.append([p.detach().clone() for p in model.out_head.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*heads))


@pytest.mark.parametrize("variant", ["usf", "frsf"])
def test_sign_symmetry_on_the_mlp_uses_the_sign_of_w_out(variant):
    """B_out = M ∘ sign(W_out) (uSF: M = s, Xavier std of W_out), rebuilt from W_out after a step;
    the credit at h_L is e·B_out."""
    model = _mlp(blocks=2)
    ss = _method("sign-symmetry", model, options={"variant": variant})
    w_out = model.out_head.weight
    b_out = ss.feedback[2]["out_head"]
    assert torch.equal(torch.sign(b_out), torch.sign(w_out))
    if variant == "usf":
        assert torch.equal(b_out, xavier(w_out)[0] * torch.sign(w_out.detach()))
    x, y = _batch()
    ss.train_step(x, y)
    ss.credit(x, y)                                       # rebuilds B from the stepped W
    assert torch.equal(ss.feedback[2]["out_head"], ss.magnitude[2]["out_head"] * torch.sign(w_out.detach()))
    with torch.no_grad():
        hidden = model(x, return_hidden=True)[1]
        e = (torch.softmax(model.out_head(hidden[-1]), -1) - F.one_hot(y, 4)) / len(y)
    torch.testing.assert_close(ss.credit(x, y)[2], e @ ss.feedback[2]["out_head"], rtol=1e-12, atol=1e-14)
    assert ss.exact_positions(2) == frozenset()


@pytest.mark.parametrize("name", RULES)
def test_each_rule_trains_the_mlp_on_digits_and_is_diagnosed(name, digits):
    """One epoch on digits, arch mlp (width 32, 2 hidden layers), then the protocol: Γ finite at
    positions 1 … L, no position exact, cos(W, B) recorded for the head too."""
    torch.manual_seed(0)
    model = build_model("mlp", (digits.d_in,), 10, width=32, blocks=2, activation="relu")
    method = _method(name, model, batch_size=64)
    x_test = digits.prepare(digits.x_test)

    def test_loss():
        with torch.no_grad():
            return float(model.loss(model(x_test), digits.y_test))
    before = test_loss()
    g = torch.Generator().manual_seed(0)
    for x, y in digits.train_batches(64, g):
        loss = method.train_step(x, y)
        assert math.isfinite(float(loss))
    method.end_epoch()
    assert method.exact_positions(model.n_blocks) == frozenset()
    assert "head.out_head" in {n for n, _, _ in method.feedback_pairs()}
    batches = [digits.eval_batch(i, 64) for i in range(2)]
    report = diagnose(model, batches, method=method, null_k=2)
    assert report.gamma_exact == []
    assert all(math.isfinite(v) for v in report.gamma[1:]), report.gamma
    assert test_loss() < before - 0.005, (before, test_loss())  # one epoch (≈ 23 steps) learns
