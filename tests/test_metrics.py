"""Tests for the SPEC §6 measurements in creditaudit.metrics."""
from __future__ import annotations

import math
import statistics

import pytest
import torch
import torch.nn.functional as F

from creditaudit import metrics as M
from creditaudit.model import ResidualMLP, ResidualStream
from creditaudit.verdict import Thresholds, fires_d


@pytest.fixture(scope="module")
def trained(digits):
    """A small ResidualMLP trained with plain AdamW on digits (~98 % test accuracy)."""
    torch.manual_seed(0)
    model = ResidualMLP(digits.d_in, d=64, n_blocks=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        idx = torch.randint(0, len(digits.y_train), (128,), generator=gen)
        loss = F.cross_entropy(model(digits.x_train[idx]), digits.y_train[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert M.accuracy(model, [digits.eval_batch(0, 360)]) > 0.9
    return model


@pytest.fixture(scope="module")
def fresh(digits):
    torch.manual_seed(1)
    return ResidualMLP(digits.d_in, d=64, n_blocks=4)


# ---------------------------------------------------------------------------------------------
# Γ
# ---------------------------------------------------------------------------------------------

def test_gamma_is_exact_at_the_floor_where_cosine_similarity_is_not():
    gen = torch.Generator().manual_seed(0)
    n, d = 64, 256
    g_dir = F.normalize(torch.randn(n, d, generator=gen), dim=-1)
    other = torch.randn(n, d, generator=gen)
    other = F.normalize(other - (other * g_dir).sum(-1, keepdim=True) * g_dir, dim=-1)
    a = 0.6 * g_dir + 0.8 * other                       # unit, cos(a, g) = 0.6 exactly
    g = 1e-10 * g_dir                                   # floor-level reference, like exploded DFA
    gamma = M.gradient_cosine([a], [g])[0]
    assert gamma == pytest.approx(0.6, abs=1e-6)
    clamped = float(F.cosine_similarity(a, g, dim=-1).mean())
    assert clamped < 0.6 / 50                           # the clamp shrinks it ~100×
    # and at ordinary scales the two agree
    assert M.gradient_cosine([a], [g_dir])[0] == pytest.approx(
        float(F.cosine_similarity(a, g_dir, dim=-1).mean()), abs=1e-6)


def test_gamma_zero_rows_are_left_out_and_non_finite_is_nan():
    g = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 2.0]])
    a = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, -1.0]])
    assert M.gradient_cosine([a], [g]) == [pytest.approx(0.0)]     # (1 + (−1)) / 2, row 1 out
    assert math.isnan(M.gradient_cosine([a], [torch.zeros_like(g)])[0])
    bad = g.clone()
    bad[0, 0] = float("nan")
    assert math.isnan(M.gradient_cosine([a], [bad])[0])


# ---------------------------------------------------------------------------------------------
# ρ
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["fresh", "trained"])
@pytest.mark.parametrize("layer", [0, 2, 4])
def test_rho_controls(request, digits, which, layer):
    model = request.getfixturevalue(which)
    x, y = digits.eval_batch(0, 128)
    r = M.perturbation_with_controls(model, x, y, layer, gen=torch.Generator().manual_seed(layer))
    assert r.bp > 0.95
    assert abs(r.random) < 0.05
    assert r.dtype == "float64"


def test_rho_of_a_credit_follows_its_direction(trained, digits):
    x, y = digits.eval_batch(0, 128)
    g = M.bp_gradients(trained, x, y).grads
    rho = lambda a: M.perturbation_correlation(trained, x, y, 2, a,
                                               gen=torch.Generator().manual_seed(0))
    assert rho(g) > 0.95
    assert rho([-t for t in g]) < -0.95
    assert rho(1e6 * g[2]) == pytest.approx(rho(g), abs=1e-9)          # scale-free in a


def test_rho_is_one_batched_forward(fresh, digits):
    """The M perturbed copies go through the network as one (N + M·N, d) batch, not M forwards."""
    calls: list[int] = []
    base = fresh.stream()

    def counting(step):
        def run(h):
            calls.append(len(h))
            return step(h)
        return run

    stream = ResidualStream(base.embed, [counting(s) for s in base.steps], base.readout)
    x, y = digits.eval_batch(0, 128)
    M.perturbation_correlation(stream, x, y, 1, torch.randn(128, 64), m=8,
                               gen=torch.Generator().manual_seed(0))
    # stream.hidden(x): 4 calls of 128 rows; forward_from(1): 3 calls of 128 + 8·128 rows
    assert calls == [128] * 4 + [128 * 9] * 3


def test_rho_is_zero_when_the_change_is_below_1e_12(fresh, digits):
    x, y = digits.eval_batch(0, 128)
    assert M.perturbation_correlation(fresh, x, y, 2, torch.zeros(128, 64)) == 0.0


# ---------------------------------------------------------------------------------------------
# (c) cross-batch stability
# ---------------------------------------------------------------------------------------------

def test_stability_is_one_for_a_sample_invariant_gradient(fresh, digits):
    x0, y0 = digits.eval_batch(0, 1)                      # one sample, (1, *input_shape)
    same = lambda n: x0.expand(n, *x0.shape[1:]).clone()
    batches = [(same(32), y0.repeat(32)) for _ in range(8)]
    s = M.cross_batch_stability(fresh, batches)
    assert len(s) == 5
    assert min(s) > 0.999
    # nearly identical inputs, one label: still dominated by the shared direction
    gen = torch.Generator().manual_seed(0)
    near = [(same(32) + 1e-2 * torch.randn(32, *x0.shape[1:], generator=gen), y0.repeat(32))
            for _ in range(8)]
    assert min(M.cross_batch_stability(fresh, near)) > 0.9


def test_stability_is_near_zero_for_noise_and_random_labels(fresh, digits):
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(128, digits.d_in, generator=gen),
                torch.randint(0, 10, (128,), generator=gen)) for _ in range(8)]
    s = M.cross_batch_stability(fresh, batches)
    assert max(abs(v) for v in s) < 0.1
    assert M.cross_batch_stability(fresh, batches, layers=[2]) == [pytest.approx(s[2])]


def test_stability_needs_two_batches(fresh, digits):
    assert math.isnan(M.cross_batch_stability(fresh, [digits.eval_batch(0, 128)])[0])


# ---------------------------------------------------------------------------------------------
# Null calibration
# ---------------------------------------------------------------------------------------------

class _ToyDFA:
    """A DFA-like credit a_l = e · B_lᵀ, B_l ~ N(0, 1/C), redrawn from `gen` for the null."""

    random_feedback = True

    def __init__(self, model, seed=0):
        self.model = model
        self.b = self._draw(torch.Generator().manual_seed(seed))

    def _draw(self, gen):
        d, c = self.model.d, self.model.n_classes
        return [torch.randn(d, c, generator=gen) / c ** 0.5 for _ in range(self.model.n_blocks + 1)]

    def _credit(self, x, y, b):
        with torch.no_grad():
            logits = self.model(x)
        e = logits.softmax(-1) - F.one_hot(y, logits.shape[-1]).float()
        return [e @ bl.T for bl in b]

    def credit(self, x, y):
        return self._credit(x, y, self.b)

    def fresh_feedback_credit(self, x, y, gen):
        return self._credit(x, y, self._draw(gen))


def test_null_calibration(trained, digits):
    x, y = digits.eval_batch(0, 128)
    dfa = _ToyDFA(trained)
    null = M.null_calibration(dfa, trained, x, y, k=10, seed=3)
    assert len(null.mean) == len(null.std) == 5 and len(null.draws) == 10
    assert all(s > 0 for s in null.std)
    assert all(abs(m) < 0.3 for m in null.mean)
    again = M.null_calibration(dfa.fresh_feedback_credit, trained, x, y, k=10, seed=3)
    assert again.mean == null.mean                                     # reproducible from seed
    bp_gamma = M.gradient_cosine(M.bp_gradients(trained, x, y).grads,
                                 M.bp_gradients(trained, x, y).grads)
    assert min(null.z(bp_gamma)) > 3                                   # BP is far outside the null
    pooled = M.null_calibration(dfa, trained, [(x, y), digits.eval_batch(1, 128)], k=3, seed=3)
    assert len(pooled.mean) == 5


def test_one_null_draw_is_one_feedback_on_every_batch(trained, digits):
    """A draw of the null is Γ under one fresh feedback, as the method's Γ is under its one: every
    eval batch of draw k sees the same feedback, and different draws see different ones. Drawn
    afresh per batch, a draw averaged B's over the batches and its spread shrank (z inflated)."""
    dfa = _ToyDFA(trained)
    batches = [digits.eval_batch(i, 64) for i in range(4)]
    seen: list[torch.Tensor] = []

    def recording(x, y, gen):
        b = dfa._draw(gen)
        seen.append(b[0].flatten()[:4].clone())
        return dfa._credit(x, y, b)
    M.null_calibration(recording, trained, batches, k=3, seed=3)
    per_draw = [seen[i:i + 4] for i in range(0, 12, 4)]
    assert all(torch.equal(d[0], b) for d in per_draw for b in d[1:])       # one B per draw
    assert not torch.equal(per_draw[0][0], per_draw[1][0])                   # fresh across draws
    # the spread over draws is that of one B's Γ: as wide as the null of a single batch, not ~√4 narrower
    one = M.null_calibration(dfa, trained, *batches[0], k=10, seed=3)
    pooled = M.null_calibration(dfa, trained, batches, k=10, seed=3)
    assert statistics.fmean(pooled.std[1:4]) > 0.6 * statistics.fmean(one.std[1:4])


# ---------------------------------------------------------------------------------------------
# Nudging test
# ---------------------------------------------------------------------------------------------

def test_nudging_test(trained, digits):
    x, y = digits.eval_batch(0, 128)
    g = M.bp_gradients(trained, x, y).grads
    same = M.nudging_test(trained, x, y, 2, g)
    assert same.delta_ce_bp < 0
    assert same.relative == pytest.approx(1.0, abs=1e-6)
    assert M.nudging_test(trained, x, y, 2, [-t for t in g]).relative == pytest.approx(-1.0, abs=0.05)
    rand = torch.randn(g[2].shape, generator=torch.Generator().manual_seed(0))
    assert abs(M.nudging_test(trained, x, y, 2, rand).relative) < 0.3
    # the rescale to ‖g_i‖ makes the result independent of the credit's scale
    assert M.nudging_test(trained, x, y, 2, 1e3 * g[2]).relative == pytest.approx(1.0, abs=1e-6)


# ---------------------------------------------------------------------------------------------
# Identity check, depth utility, dtype
# ---------------------------------------------------------------------------------------------

def test_identity_check_at_init(digits):
    x, _ = digits.eval_batch(0, 128)
    state = torch.random.get_rng_state()
    check = M.identity_check(lambda seed: ResidualMLP(digits.d_in, d=64, n_blocks=4), [0, 1, 2], x)
    assert torch.equal(state, torch.random.get_rng_state())           # caller's RNG untouched
    assert len(check.block_ratio_mean) == 4
    assert all(0 < r < 0.5 for r in check.block_ratio_mean)           # w2_std = 0.01: near identity
    assert check.stack_cos_mean > 0.9
    assert check.stack_change_std > 0                                 # seeds really differ
    big = M.identity_check(lambda s: ResidualMLP(digits.d_in, d=64, n_blocks=4, w2_std=1.0),
                           [0, 1], x)
    assert big.block_ratio_mean[0] > 5 * check.block_ratio_mean[0]


def test_depth_utility():
    """depth_utility measures the gap; whether it undercuts is the verdict's call (fires_d)."""
    undercut = lambda acc, frozen, margin=0.02: fires_d(M.depth_utility(acc, frozen, margin).gap,
                                                         Thresholds(depth_margin=margin))
    assert M.depth_utility(0.37, 0.35).undercut is None                # not decided here
    assert not undercut(0.37, 0.35)                                     # exactly 2 points clears
    assert undercut(0.3699, 0.35)
    assert undercut(0.306, 0.349)                                       # the paper's DFA
    assert M.depth_utility(0.615, 0.349).gap == pytest.approx(0.266)
    assert math.isnan(M.depth_utility(float("nan"), 0.3).gap)
    assert undercut(float("nan"), 0.3) is None                          # no gap: not measured
    assert not undercut(0.36, 0.35, margin=0.01)
    assert M.depth_utility(0.36, 0.35, margin=0.01).margin == 0.01


def test_float64_model_stays_float64(digits):
    model = ResidualMLP(digits.d_in, d=32, n_blocks=2).double()
    x, y = digits.eval_batch(0, 16)
    bp = M.bp_gradients(model, x.double(), y)
    assert bp.grads[-1].dtype == torch.float64


def test_gamma_counts_withheld_credit_as_zero_not_as_missing():
    g = torch.randn(4, 8, dtype=torch.float64)
    a = g.clone()
    a[2:] = 0.0                       # the method gives half the samples no credit at all
    assert M.gradient_cosine([a], [g])[0] == pytest.approx(0.5)
    g[3] = 0.0                        # a sample with no reference direction is left out
    assert M.gradient_cosine([a], [g])[0] == pytest.approx(2 / 3)


def test_rho_bp_control_survives_a_floor_level_reference():
    """With ‖g‖ ~ 1e-9 the mean-reduced ε⟨g, v⟩ is below the 1e-12 std cutoff; the control
    must still read ≈ 1 (it is computed in per-sample units)."""
    torch.manual_seed(0)
    model = ResidualMLP(16, d=32, n_blocks=2).double()
    with torch.no_grad():
        model.embed.weight.mul_(1e8)  # ‖h‖ ~ 1e8 → the readout attenuates g to the floor
    x, y = torch.randn(64, 16, dtype=torch.float64), torch.randint(0, 10, (64,))
    assert M.bp_grad_norms(model, x, y)[-1] < 1e-7
    rho = M.perturbation_with_controls(model, x, y, 1, gen=torch.Generator().manual_seed(0))
    assert rho.bp > 0.95 and abs(rho.random) < 0.1


def test_ce_gradient_is_the_reference_gradient_at_any_position(trained, digits):
    """ce_gradient(rest, h, y): the one ∂CE/∂h of the package, in mean / sum / per-sample units."""
    x, y = digits.eval_batch(0, 64)
    trained.zero_grad(set_to_none=True)
    bp = M.bp_gradients(trained, x, y)
    stream = trained.stream()
    loss, g_last = M.ce_gradient(trained.readout, bp.hidden[-1], y)
    assert loss.item() == pytest.approx(bp.loss, rel=1e-6)
    torch.testing.assert_close(g_last, bp.grads[-1])
    _, g_mid = M.ce_gradient(lambda h: stream.forward_from(2, h), bp.hidden[2], y)
    torch.testing.assert_close(g_mid, bp.grads[2])
    total, g_sum = M.ce_gradient(trained.readout, bp.hidden[-1], y, reduction="sum")
    torch.testing.assert_close(g_sum, bp.grads[-1] * len(y))
    per_sample, g_none = M.ce_gradient(trained.readout, bp.hidden[-1], y, reduction="none")
    assert per_sample.shape == (len(y),)
    assert per_sample.sum().item() == pytest.approx(total.item(), rel=1e-6)
    torch.testing.assert_close(g_none, g_sum)
    assert not g_none.requires_grad and all(p.grad is None for p in trained.parameters())
