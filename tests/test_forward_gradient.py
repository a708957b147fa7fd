"""The forward-gradient family (methods/forward_gradient.py): fg-w's estimate is unbiased for the
weight gradient and one draw's cosine with it falls as 1/√n; fg-a's and lg-fg-a's activity estimates
are unbiased for ∂ℓ_i/∂h_l (global and local); every rule trains on the ResMLP and the plain MLP and
is diagnosed; a step is reproducible from the seed and the frozen control leaves blocks alone."""
from __future__ import annotations

import math

import pytest
import torch

from creditaudit.config import RunConfig
from creditaudit.errors import CreditAuditError
from creditaudit.methods import MethodSettings, method_class
from creditaudit.metrics import bp_gradients
from creditaudit.model.plain import PlainMLP
from creditaudit.model.resmlp import ResidualMLP
from creditaudit.model.vit import ViTMini
from creditaudit.protocol import diagnose
from creditaudit.train import train_run

from rule_steps import check_step_reproducible_and_frozen_blocks_stay

RULES = ("fg-w", "fg-a", "lg-fg-a")


def _flat_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    return float(a @ b / (a.norm() * b.norm()))


def _fg_w_draws(width: int, draws: int, seed: int = 0):
    """(true gradient of the mean loss over θ, the step's gradient for each of `draws` tangents),
    flattened over θ, on a float64 plain MLP 4-width-10 with one hidden layer (θ = its W, b:
    n = 5·width; the readout is not perturbed). No clip, so the step's gradient is d·v itself."""
    torch.manual_seed(seed)
    model = PlainMLP(4, width, n_blocks=1, n_classes=10, activation="tanh").double()
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 10, (16,))
    method = method_class("fg-w")(model, MethodSettings(epochs=1, seed=seed, trainable_blocks=(0,),
                                                        clip=math.inf))
    theta = list(method.theta.values())
    true = torch.cat([g.flatten() for g in torch.autograd.grad(model.loss(model(x), y), theta)])
    est = []
    for _ in range(draws):
        method.clear_gradients()
        method.prepare_step()
        method.gradients(x, y)
        est.append(torch.cat([p.grad.flatten() for p in theta]))
    return true, torch.stack(est)


def test_fg_w_estimate_is_unbiased():
    """mean_v (∇J·v)·v → ∇J: n = 40 weights, 4000 tangents; the mean's relative error is about
    √(n/K) ≈ 0.1, so cos > 0.99 — while single draws sit near √(2/π)/√n ≈ 0.13."""
    true, est = _fg_w_draws(width=8, draws=4000)
    assert true.numel() == 40
    assert _flat_cos(est.mean(0), true) > 0.99
    singles = [_flat_cos(e, true) for e in est[:200]]
    assert 0.05 < sum(singles) / len(singles) < 0.3


def test_fg_w_single_draw_cosine_falls_as_one_over_root_n():
    """E[cos(d·v, ∇J)] = E|v₁|/‖v‖ = Γ(n/2)/(√π Γ((n+1)/2)) ≈ √(2/π)/√n. Measured with 1500 draws
    at n = 40 and n = 640 (16× the weights): the ratio of the means is √16 = 4 (exactly 3.98 from
    the Γ-function formula). A single cosine's relative spread is ≈ √(1 − 2/π)/√(2/π) ≈ 0.76, so each
    mean carries a relative standard error 0.76/√1500 ≈ 2 %, their ratio ≈ 2.8 %: a 10 % tolerance
    is 3.5 standard errors, and a rule with a width-independent cosine would miss it by a factor 4."""
    def exact(n):
        return math.exp(math.lgamma(n / 2) - math.lgamma((n + 1) / 2)) / math.sqrt(math.pi)
    means = {}
    for width in (8, 128):
        true, est = _fg_w_draws(width, draws=1500, seed=1)
        n = true.numel()
        cos = (est @ true) / (est.norm(dim=1) * true.norm())
        assert float(cos.min()) > 0          # ⟨d·v, ∇J⟩ = d² ≥ 0: never a negative cosine
        means[n] = float(cos.mean())
        assert abs(means[n] / exact(n) - 1) < 0.08, (n, means[n], exact(n))
    (n1, c1), (n2, c2) = sorted(means.items())
    assert (n1, n2) == (40, 640)
    assert abs((c1 / c2) / math.sqrt(n2 / n1) - 1) < 0.10, (c1, c2)


def _tiny_resmlp(seed: int = 0):
    torch.manual_seed(seed)
    model = ResidualMLP(5, 4, 2, 3, w2_std=0.5).double()
    x, y = torch.randn(3, 5, dtype=torch.float64), torch.randint(0, 3, (3,))
    return model, x, y


def _mean_estimate(method, x, y, copies: int):
    """The credit averaged over `copies` independent tangent draws per sample: the batch repeated
    `copies` times (each row draws its own tangent), one jvp."""
    n = len(y)
    credit = method.fresh_feedback_credit(x.repeat(copies, 1), y.repeat(copies),
                                          torch.Generator().manual_seed(3))
    return [a.view(copies, n, -1).mean(0) for a in credit]


def test_fg_a_activity_estimate_is_unbiased():
    """mean_u (Σ_k ⟨∂ℓ_i/∂h_k, u_k⟩)·u_l → ∂ℓ_i/∂h_l at every position (per sample: N·∂J/∂h_l of the
    mean loss J), float64, 20000 draws per sample (12 perturbed values per sample, so the relative
    error of the mean is about √(12/20000) ≈ 0.03)."""
    model, x, y = _tiny_resmlp()
    method = method_class("fg-a")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1)))
    truth = [len(y) * g for g in bp_gradients(model, x, y).grads]
    mean = _mean_estimate(method, x, y, 20000)
    for l, (m, g) in enumerate(zip(mean, truth)):
        assert _flat_cos(m, g) > 0.99, l
        assert float((m - g).norm() / g.norm()) < 0.15, l         # the units too, not only the direction
    one = method.credit(x, y)                                     # a single draw is far from it
    assert max(_flat_cos(a, g) for a, g in zip(one, truth)) < 0.95


def test_lg_fg_a_estimate_is_unbiased_for_the_local_gradient():
    """Each position's estimate averages to its own local classifier's gradient ∂ℓ_aux,l/∂h_l (the
    readout's at h_L), not to the end-to-end one."""
    model, x, y = _tiny_resmlp(1)
    method = method_class("lg-fg-a")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1)))
    hidden = [h.detach().requires_grad_(True) for h in model(x, return_hidden=True)[1]]
    # the local losses' exact per-sample gradients, from autograd (the aux heads and the readout)
    losses = [torch.nn.functional.cross_entropy(
        method.aux[l](torch.nn.functional.layer_norm(hidden[l], (4,))), y, reduction="sum")
        for l in (0, 1)] + [model.loss(model.readout(hidden[2]), y, reduction="sum")]
    local = [torch.autograd.grad(loss, h)[0] for loss, h in zip(losses, hidden)]
    mean = _mean_estimate(method, x, y, 20000)
    for l, (m, g) in enumerate(zip(mean, local)):
        assert _flat_cos(m, g) > 0.99, l
    bp = bp_gradients(model, x, y).grads
    assert _flat_cos(mean[0], bp[0]) < 0.95      # the local gradient is not the end-to-end one


@pytest.mark.parametrize("arch", ["resmlp", "mlp"])
@pytest.mark.parametrize("name", RULES)
def test_rule_trains_and_is_diagnosed(name, arch, tmp_path, digits):
    config = RunConfig(method=name, dataset="digits", arch=arch, width=32, blocks=2, epochs=2)
    run = train_run(config, tmp_path / "run", data=digits, progress=False)
    assert run.status["status"] == "finished"
    losses = [h["train_loss"] for h in run.history if h["train_loss"] is not None]
    assert len(losses) == 2 and losses[-1] < losses[0], losses
    x, y = digits.prepare(digits.x_test[:96]), digits.y_test[:96]
    run.model.eval()
    report = diagnose(run.model, [(x[:48], y[:48]), (x[48:], y[48:])], method=run.method,
                      test_acc=run.test_acc, frozen_acc=0.1, null_k=4)
    assert len(report.gamma) == 3 and all(math.isfinite(g) for g in report.gamma[1:]), report.gamma


@pytest.mark.parametrize("name", RULES)
def test_step_is_reproducible_and_frozen_blocks_stay(name):
    check_step_reproducible_and_frozen_blocks_stay(name, lambda: ResidualMLP(16, 8, 2, 10))


@pytest.mark.parametrize("name", RULES)
def test_other_architectures_refused_in_one_line(name):
    model = ViTMini((3, 8, 8), d=8, n_blocks=1, n_classes=10, heads=2, patch=4)
    with pytest.raises(CreditAuditError, match="resmlp or mlp only"):
        method_class(name)(model, MethodSettings(epochs=1, trainable_blocks=(0,)))


def test_credit_does_not_advance_the_training_tangents():
    model, x, y = _tiny_resmlp()
    method = method_class("fg-a")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1)))
    state = method.gen.get_state()
    first = method.credit(x, y)
    assert all(torch.equal(a, b) for a, b in zip(first, method.credit(x, y)))
    assert torch.equal(state, method.gen.get_state())


def test_fg_w_credit_averages_to_the_tangent_kernel_times_the_gradient():
    """fg-w's a_{l,i} = d_i·(∂h_{l,i}/∂θ·v) averages over tangents to J_{l,i} ∇_θ ℓ_i = K_{l,i} g_{l,i}
    (J = ∂h_{l,i}/∂θ): computed here per sample by one jvp along ∇_θ ℓ_i, against 4000 draws on a
    float64 ResMLP with 24 perturbed weights (relative error of the mean ≈ √(24/4000) ≈ 0.08)."""
    torch.manual_seed(2)
    model = ResidualMLP(3, 2, 1, 3, w2_std=0.5).double()
    x, y = torch.randn(2, 3, dtype=torch.float64), torch.tensor([0, 2])
    method = method_class("fg-w")(model, MethodSettings(epochs=1, trainable_blocks=(0,)))
    names, theta = list(method.theta), list(method.theta.values())
    assert sum(p.numel() for p in theta) == 24
    gen = torch.Generator().manual_seed(0)
    draws = [method.fresh_feedback_credit(x, y, gen) for _ in range(4000)]
    for i in range(len(y)):
        grad_i = torch.autograd.grad(model.loss(model(x[i:i + 1]), y[i:i + 1]), theta)

        def hidden(*params):
            return tuple(torch.func.functional_call(model, dict(zip(names, params)), (x[i:i + 1],),
                                                    {"return_hidden": True})[1])
        _, kg = torch.func.jvp(hidden, tuple(p.detach() for p in theta), grad_i)
        for l in (0, 1):                 # h_0 = embed(x) and h_1, the block's output
            mean = torch.stack([d[l][i] for d in draws]).mean(0)
            assert _flat_cos(mean, kg[l][0]) > 0.99, (i, l)


def test_fg_a_gamma_sits_at_node_perturbations_chance_level():
    """fg-a is node perturbation's σ → 0 limit, so one draw's per-sample cosine averages to
    `chance_gamma`: √(2/π)·‖g_l‖/(√D·√Σ_k‖g_k‖²) (D = 32 features, L + 1 = 3 positions, ≈ 0.08 when
    the positions carry gradients of one size). Measured over 64 samples × 100 draws: the mean of
    6400 cosines of spread ≈ 0.14 has a standard error ≈ 0.002, 2.5 % of the level; the formula's
    ‖u‖ ≈ √D costs ~1/(4D) < 1 %: a 10 % tolerance."""
    from creditaudit.methods.node_perturbation import chance_gamma
    from creditaudit.metrics import per_sample_cosine
    torch.manual_seed(4)
    model = ResidualMLP(10, 32, 2, 10, w2_std=0.3).double()
    x, y = torch.randn(64, 10, dtype=torch.float64), torch.randint(0, 10, (64,))
    method = method_class("fg-a")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1)))
    copies = 100
    xs, ys = x.repeat(copies, 1), y.repeat(copies)
    grads = bp_gradients(model, xs, ys).grads
    credit = method.fresh_feedback_credit(xs, ys, torch.Generator().manual_seed(5))
    chance = chance_gamma(grads)
    for l in range(3):
        measured = float(per_sample_cosine(credit[l], grads[l]).mean())
        assert abs(measured / chance[l] - 1) < 0.10, (l, measured, chance[l])
