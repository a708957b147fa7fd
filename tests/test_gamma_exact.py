"""Positions where a rule's credit equals the true gradient by construction (SPEC §6, Γ_l): each
built-in declaration is measured, and the project's deep Γ, its null and z leave those positions
out while the paper's mean over 1 … L stays available."""
from __future__ import annotations

import statistics

import pytest
import torch

from creditaudit.errors import CreditAuditError
from creditaudit.methods import METHODS, Method, MethodSettings, method_class
from creditaudit.metrics import bp_gradients, gradient_cosine
from creditaudit.model import ResidualMLP
from creditaudit.protocol import deep_gamma, diagnose
from creditaudit.report.format import _gamma_cells

L = 3


def _trained(name: str, steps: int = 3, dtype=torch.float64):
    """A small random ResidualMLP (blocks far from the identity) and `name` after a few steps."""
    torch.manual_seed(0)
    model = ResidualMLP(12, 16, L, 5, w2_std=0.5).to(dtype)
    method = method_class(name)(model, MethodSettings(epochs=2, seed=0, trainable_blocks=tuple(range(L)),
                                                      batch_size=32))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 12, generator=g, dtype=dtype), torch.randint(0, 5, (32,), generator=g)
    for _ in range(steps):
        method.train_step(x, y)
    return model, method


def _batches(n=2, dtype=torch.float64):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(32, 12, generator=g, dtype=dtype), torch.randint(0, 5, (32,), generator=g))
            for _ in range(n)]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_declared_exact_positions_measure_gamma_one(name):
    """Every built-in rule that declares a position exact has Γ_l = 1 there (to 1e-6), measured on
    a small random model after a few training steps."""
    model, method = _trained(name)
    exact = method.exact_positions(L)
    assert all(0 <= l <= L for l in exact)
    if not exact:
        return
    x, y = _batches(1)[0]
    gamma = gradient_cosine(method.credit(x, y), bp_gradients(model, x, y).grads)
    for l in exact:
        assert gamma[l] == pytest.approx(1.0, abs=1e-6), (name, l, gamma)


def test_which_rules_declare_what():
    """The declarations the audit relies on: bp every position, the rules whose readout
    backpropagates exactly position L, cb none (its a_L only learns to match ∂ℓ/∂h_L)."""
    declared = {name: set(_trained(name, steps=0)[1].exact_positions(L)) for name in METHODS}
    assert declared["bp"] == set(range(L + 1))
    for name in ("fa", "sign-symmetry", "kolen-pollack", "sb", "local-loss"):
        assert declared[name] == {L}, name
    for name in ("cb", "dfa", "ep"):
        assert declared[name] == set(), name
    model, cb = _trained("cb")
    x, y = _batches(1)[0]
    assert gradient_cosine(cb.credit(x, y), bp_gradients(model, x, y).grads)[L] < 1 - 1e-3


def test_fa_deep_gamma_leaves_out_position_L():
    """fa: deep Γ = mean over 1 … L−1, the paper's = mean over 1 … L; null and z over 1 … L−1."""
    model, fa = _trained("fa")
    rep = diagnose(model, _batches(), method=fa, null_k=4)
    d = rep.to_dict()
    assert d["gamma_exact"] == [L] and not d["gamma_deep_exact"]
    assert d["gamma"][L] == pytest.approx(1.0, abs=1e-6)
    assert d["gamma_deep"] == pytest.approx(statistics.fmean(d["gamma"][1:L]))
    assert d["gamma_deep_paper"] == pytest.approx(statistics.fmean(d["gamma"][1:L + 1]))
    assert d["gamma_deep"] < d["gamma_deep_paper"]          # the exact layer lifted the paper's mean
    assert d["null_deep_mean"] == pytest.approx(statistics.fmean(d["null"]["mean"][1:L]))
    assert d["null_deep_std"] == pytest.approx(statistics.fmean(d["null"]["std"][1:L]))
    assert d["gamma_deep_z"] == pytest.approx((d["gamma_deep"] - d["null_deep_mean"]) / d["null_deep_std"])
    text = str(rep)
    assert "exact" in text and "left out (exact by construction)" in text and "paper's deep Γ" in text
    from creditaudit.report.tables import calibration_table
    table = calibration_table(d)
    row_L = next(line for line in table.splitlines() if line.startswith(f"| {L} "))
    assert "exact (+1.000)" in row_L                       # shown as exact, with no null or z
    assert f"the paper's deep Γ, mean over l = 1 … L: {d['gamma_deep_paper']:+.3f}" in table


class _BPCreditOwnRule(Method):
    """A user's rule whose credit happens to be the BP gradient, declaring no exact position."""

    name = "own-bp-credit"

    def __init__(self, model, settings):
        super().__init__(model, settings)
        self.add_optimizer(model.parameters())

    def gradients(self, x, y):
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        return loss.detach()

    def credit(self, x, y):
        return bp_gradients(self.model, x, y).grads


@pytest.mark.parametrize("kind", ["method", "callable"])
def test_rule_declaring_no_exact_position_keeps_every_position(kind):
    model, _ = _trained("bp", steps=0)
    rule = _BPCreditOwnRule(model, MethodSettings(epochs=1))
    method = rule if kind == "method" else (lambda x, y: rule.credit(x, y))
    d = diagnose(model, _batches(), method=method).to_dict()
    assert d["gamma_exact"] == [] and not d["gamma_deep_exact"]
    assert d["gamma_deep"] == pytest.approx(statistics.fmean(d["gamma"][1:])) == pytest.approx(1.0)
    assert d["gamma_deep_paper"] == d["gamma_deep"]


def test_bp_deep_gamma_is_not_a_number():
    """bp's credit is the reference: deep Γ is "n/a (exact by construction)", never 1.000."""
    model, bp = _trained("bp")
    rep = diagnose(model, _batches(), method=bp)
    d = rep.to_dict()
    assert d["gamma_deep"] is None and d["gamma_deep_exact"] and d["gamma_exact"] == list(range(L + 1))
    assert d["gamma_deep_paper"] == pytest.approx(1.0)
    assert "deep Γ: n/a (exact by construction)" in str(rep)
    assert _gamma_cells({"gamma_deep": None, "gamma_deep_exact": True}) == ("n/a (exact by construction)", "—")


def test_deep_gamma_reads_stored_values():
    """protocol.deep_gamma on JSON values: None is NaN (no partial mean), all-exact is n/a."""
    assert deep_gamma([0.3, 0.2, None, 1.0], exact=[3])["gamma_deep"] is None
    out = deep_gamma([0.3, 0.2, 0.4, 1.0], exact=[3], null={"mean": [0, 0.1, 0.1, 1], "std": [0, 0.05, 0.05, 0]})
    assert out["gamma_deep"] == pytest.approx(0.3) and out["gamma_deep_paper"] == pytest.approx(1.6 / 3)
    assert out["gamma_deep_z"] == pytest.approx((0.3 - 0.1) / 0.05)
    assert deep_gamma([0.5, 1.0], exact=[1])["gamma_deep_exact"] and deep_gamma(None)["gamma_deep"] is None


@pytest.mark.parametrize("bad", [{5}, {-1}, {True}, {1.0}])
def test_exact_positions_out_of_range_is_refused(bad):
    model, rule = _trained("bp", steps=0)[0], None
    rule = _BPCreditOwnRule(model, MethodSettings(epochs=1))
    rule.exact_positions = lambda n_blocks: bad
    with pytest.raises(CreditAuditError, match="exact_positions"):
        diagnose(model, _batches(1), method=rule)


def _raises(n_blocks):
    raise KeyError("n_blocks")


@pytest.mark.parametrize("bad, needle", [
    (lambda n: None, r"returned a NoneType"), (lambda n: {0, "L"}, r"holds 'L' \(str\)"),
    (lambda n: "012", r"returned a str"), (lambda n: 3, r"returned a int"),
    (_raises, r"raised KeyError"), (lambda n: {0.0}, r"holds 0.0 \(float\)")])
def test_exact_positions_of_the_wrong_type_or_raising_is_refused_in_one_line(bad, needle):
    """Issue 34 item 6: these used to end in a TypeError from sorting or comparing; each is now one
    CreditAuditError line naming exact_positions and the fix."""
    model = _trained("bp", steps=0)[0]
    rule = _BPCreditOwnRule(model, MethodSettings(epochs=1))
    rule.exact_positions = bad
    with pytest.raises(CreditAuditError, match=needle) as err:
        diagnose(model, _batches(1), method=rule)
    assert "exact_positions" in str(err.value) and "\n" not in str(err.value)
    assert "return a set of residual positions 0 … 3" in str(err.value)


def test_numpy_integer_positions_are_accepted():
    """`{np.int64(2)}` is a position like 2: accepted, stored as a plain int."""
    import numpy as np
    model = _trained("bp", steps=0)[0]
    rule = _BPCreditOwnRule(model, MethodSettings(epochs=1))
    rule.exact_positions = lambda n_blocks: {np.int64(2), np.int32(3)}
    rep = diagnose(model, _batches(1), method=rule, rho=False)
    assert rep.gamma_exact == [2, 3] and all(type(l) is int for l in rep.gamma_exact)


def test_a_false_exact_declaration_is_measured_and_refused():
    """A rule (dfa: its credit is not ∂CE/∂h_l below the readout) declaring every position exact
    had deep Γ "n/a (exact by construction)" while its Γ was far from 1; the claim is measured on
    the eval batches and refused, naming the positions and their Γ."""
    model, method = _trained("dfa")
    honest = diagnose(model, _batches(2), method=method, rho=False)
    false = [l for l in range(L + 1) if l not in honest.gamma_exact]
    assert false and all(abs(1 - honest.gamma[l]) > 1e-3 for l in false)
    method.exact_positions = lambda n_blocks: frozenset(range(n_blocks + 1))
    with pytest.raises(CreditAuditError, match="exact_positions declares position") as err:
        diagnose(model, _batches(2), method=method, rho=False)
    assert f"Γ_{false[0]} = " in str(err.value)
