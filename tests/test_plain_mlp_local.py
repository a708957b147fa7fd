"""dfa, dfa-penalty, drtp and pepita on the plain MLP (arch mlp) as in their papers: each hidden
weight's update written out by hand with plain tensor ops and compared with the rule's, and each
rule trained and diagnosed on digits with a hidden width other than the input's."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from creditaudit.errors import CreditAuditError
from creditaudit.methods import MethodSettings, method_class
from creditaudit.model import build_model
from creditaudit.protocol import diagnose

D_IN, WIDTH, C, N = 6, 5, 3, 7


def _mlp(blocks: int, activation: str = "tanh", loss: str = "ce", seed: int = 0):
    torch.manual_seed(seed)
    return build_model("mlp", (D_IN,), C, width=WIDTH, blocks=blocks, activation=activation,
                       options={"loss": loss}).double()


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D_IN, generator=g, dtype=torch.float64), torch.randint(0, C, (N,), generator=g)


def _hand_forward(model, x):
    """z_l and h_l of every hidden layer and the logits, by hand: h_{l+1} = tanh(h_l W_lᵀ + b_l)."""
    h, zs, hs = x, [], [x]
    for block in model.blocks:
        z = h @ block.linear.weight.T + block.linear.bias
        h = torch.tanh(z)
        zs.append(z)
        hs.append(h)
    return zs, hs, h @ model.out_head.weight.T + model.out_head.bias


@pytest.mark.parametrize("loss", ["ce", "bce"])
def test_dfa_hidden_gradients_are_noklands_rule(loss):
    """grad W_l = ((e·B_lᵀ) ⊙ f'(z_l))ᵀ h_l / N per hidden layer, the readout on e ⊗ h_L / N, with
    e = softmax − onehot (CE) or σ − onehot (BCE); option normalise = 0 (Nøkland's signal)."""
    model = _mlp(2, loss=loss)
    x, y = _batch()
    method = method_class("dfa")(model, MethodSettings(epochs=1, clip=1e12, trainable_blocks=(0, 1),
                                                       options={"normalise": 0}))
    method.clear_gradients()
    method.gradients(x, y)
    zs, hs, logits = _hand_forward(model, x)
    onehot = F.one_hot(y, C).double()
    e = (logits.sigmoid() if loss == "bce" else logits.softmax(-1)) - onehot
    for l, block in enumerate(model.blocks):
        delta = (e @ method.feedback[l].T) * (1 - torch.tanh(zs[l]) ** 2)       # (B_l e) ⊙ f'(z_l)
        torch.testing.assert_close(block.linear.weight.grad, delta.T @ hs[l] / N, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(block.linear.bias.grad, delta.mean(0), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(model.out_head.weight.grad, e.T @ hs[-1] / N, rtol=1e-12, atol=1e-14)
    assert method.feedback[0].shape == (WIDTH, C)               # B shaped for the hidden width


def test_dfa_credit_on_the_mlp_has_each_positions_shape():
    """a_{l+1} = e·B_lᵀ at each hidden layer, a_0 the credit pulled back through layer 0 (input's shape)."""
    model = _mlp(2)
    x, y = _batch()
    method = method_class("dfa")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1),
                                                       options={"normalise": 0}))
    credit = method.credit(x, y)
    assert [tuple(a.shape) for a in credit] == [(N, D_IN), (N, WIDTH), (N, WIDTH)]
    zs, _, logits = _hand_forward(model, x)
    e = logits.softmax(-1) - F.one_hot(y, C).double()
    torch.testing.assert_close(credit[2], e @ method.feedback[1].T)
    pulled = ((e @ method.feedback[0].T) * (1 - torch.tanh(zs[0]) ** 2)) @ model.blocks[0].linear.weight
    torch.testing.assert_close(credit[0], pulled)


@pytest.mark.parametrize("feedback", ["normal", "reference"])
def test_drtp_hidden_gradients_use_the_target_in_place_of_e(feedback):
    """DRTP: Nøkland's rule with −onehot(y) in place of e. "normal": rms-normalised, batch mean;
    "reference" (ChFrenkel's code): B ~ U(±√(6/d)), unnormalised, summed over the batch, the BCE
    readout's gradient divided by C, nothing clipped."""
    model = _mlp(2, loss="bce")
    x, y = _batch()
    clip = 1e-9 if feedback == "reference" else 1e12          # the reference clips nothing
    method = method_class("drtp")(model, MethodSettings(epochs=1, clip=clip, trainable_blocks=(0, 1),
                                                        options={"feedback": feedback}))
    method.clear_gradients()
    method.gradients(x, y)
    zs, hs, logits = _hand_forward(model, x)
    onehot = F.one_hot(y, C).double()
    for l, block in enumerate(model.blocks):
        a = -onehot @ method.feedback[l].T
        if feedback == "normal":
            a = a / (a.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6)
        delta = a * (1 - torch.tanh(zs[l]) ** 2)
        by_hand = delta.T @ hs[l] if feedback == "reference" else delta.T @ hs[l] / N
        torch.testing.assert_close(block.linear.weight.grad, by_hand, rtol=1e-12, atol=1e-14)
    e = logits.sigmoid() - onehot
    head = e.T @ hs[-1] / N / (C if feedback == "reference" else 1)
    torch.testing.assert_close(model.out_head.weight.grad, head, rtol=1e-12, atol=1e-14)
    if feedback == "reference":
        bound = math.sqrt(6 / WIDTH)
        assert all(b.abs().max() <= bound for b in method.feedback)
        assert any(b.abs().max() > 0.8 * bound for b in method.feedback)


def test_pepita_step_is_the_reference_update():
    """One step on a 2-layer mlp (one hidden layer + readout) equals the reference notebook's
    arithmetic, written out here: x_mod = x + error @ Bᵀ (B = 0.05·U(±√(6/D_in))),
    Δw = −(h − h_mod)ᵀ x_mod, Δw_out = −(out_mod − onehot)ᵀ h_mod, w += η·Δw / batch; no bias moves."""
    model = _mlp(1, activation="relu")
    x, y = _batch()
    method = method_class("pepita")(model, MethodSettings(epochs=1, trainable_blocks=(0,)))
    eta = method.recipe.lr
    w0, b0 = model.blocks[0].linear.weight.detach().clone(), model.blocks[0].linear.bias.detach().clone()
    w1, b1 = model.out_head.weight.detach().clone(), model.out_head.bias.detach().clone()
    B = 0.05 * method.feedback                                      # the reference's "B" (its F)
    assert B.shape == (D_IN, C) and method.feedback.abs().max() <= math.sqrt(6 / D_IN)

    onehot = F.one_hot(y, C).double()
    h = torch.relu(x @ w0.T + b0)
    out = torch.softmax(h @ w1.T + b1, -1)
    x_mod = x + (out - onehot) @ B.T
    h_mod = torch.relu(x_mod @ w0.T + b0)
    out_mod = torch.softmax(h_mod @ w1.T + b1, -1)
    dw0 = -(h - h_mod).T @ x_mod
    dw1 = -(out_mod - onehot).T @ h_mod
    method.train_step(x, y)                  # the first momentum step is a plain SGD step
    torch.testing.assert_close(model.blocks[0].linear.weight, w0 + eta * dw0 / N, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(model.out_head.weight, w1 + eta * dw1 / N, rtol=1e-12, atol=1e-15)
    assert torch.equal(model.blocks[0].linear.bias, b0) and torch.equal(model.out_head.bias, b1)
    assert not torch.equal(model.blocks[0].linear.weight, w0)


def test_pepita_mlp_refuses_dropout_and_the_backprop_rule():
    torch.manual_seed(0)
    model = build_model("mlp", (D_IN,), C, width=WIDTH, blocks=1, options={"dropout": 0.1})
    with pytest.raises(CreditAuditError, match="dropout 0"):
        method_class("pepita")(model, MethodSettings(epochs=1, trainable_blocks=(0,)))
    with pytest.raises(CreditAuditError, match="rule"):
        method_class("pepita")(_mlp(1), MethodSettings(epochs=1, trainable_blocks=(0,),
                                                       options={"rule": "backprop"}))


def _digits_batches(digits, n: int = 128):
    return [(digits.x_train[i:i + n].float(), digits.y_train[i:i + n])
            for i in range(0, len(digits.y_train) - n + 1, n)]


@pytest.mark.parametrize("name", ["dfa", "dfa-penalty", "drtp", "pepita"])
def test_rules_train_on_the_mlp_and_have_finite_deep_gamma(name, digits):
    """1 epoch on digits (64 inputs, hidden width 32, 2 hidden layers), then Γ_l finite at 1 … L;
    the frozen control (no trainable block) leaves every hidden layer bit-identical."""
    batches = _digits_batches(digits)
    for trainable in ((0, 1), ()):
        torch.manual_seed(0)
        model = build_model("mlp", (1, 8, 8), 10, width=32, blocks=2, activation="relu")
        init = [p.detach().clone() for p in model.blocks.parameters()]
        head = [p.detach().clone() for p in model.out_head.parameters()]
        method = method_class(name)(model, MethodSettings(epochs=1, trainable_blocks=trainable))
        model.train()
        losses = [float(method.train_step(x, y)) for x, y in batches]
        model.eval()
        assert all(math.isfinite(v) for v in losses)
        moved = [not torch.equal(p, q) for p, q in zip(model.blocks.parameters(), init)]
        assert any(not torch.equal(p, q) for p, q in zip(model.out_head.parameters(), head))
        if trainable:
            assert any(moved)
            report = diagnose(model, batches[:8], method=method, null=False)
            assert len(report.gamma) == 3 and all(math.isfinite(g) for g in report.gamma[1:])
        else:
            assert not any(moved)
