"""The energy-based and local rules on the plain MLP (arch mlp): ep and pc tend to BP as β → 0,
every rule trains and is diagnosed, and the Γ of ep's and pc's credit as trained is reported beside
the reproducible float64 one (docs/PROTOCOL.md §3.13)."""
from __future__ import annotations

import math

import pytest
import torch

from creditaudit.config import RunConfig
from creditaudit.errors import CreditAuditError
from creditaudit.methods import MethodSettings, method_class
from creditaudit.methods.ep import _Chain
from creditaudit.methods.node_perturbation import chance_gamma
from creditaudit.metrics import bp_gradients, gradient_cosine, per_sample_cosine
from creditaudit.model.plain import PlainMLP
from creditaudit.protocol import diagnose
from creditaudit.train import train_run


def _small_mlp(seed: int = 0):
    torch.manual_seed(seed)
    model = PlainMLP(20, 16, n_blocks=2, n_classes=5, activation="tanh").double()
    x = torch.randn(32, 20, dtype=torch.float64)
    y = torch.randint(0, 5, (32,))
    return model, x, y


@pytest.mark.parametrize("name, options", [("ep", {"beta": 1e-4, "steps": 30}),
                                           ("pc", {"beta": 1e-4, "steps": 200})])
def test_energy_credit_tends_to_bp_on_plain_mlp(name, options):
    """a_l → g_l = ∂CE/∂h_l as β → 0 at every position, h_0 = x included (a_0 = ∂f_0ᵀ a_1, the
    force on the clamped input), in float64; a finite β that is not small leaves a gap."""
    model, x, y = _small_mlp()
    grads = bp_gradients(model, x, y).grads
    method = method_class(name)(model, MethodSettings(epochs=1, trainable_blocks=(0, 1), options=options))
    credit = method.credit(x, y)
    assert [tuple(a.shape) for a in credit] == [(32, 20), (32, 16), (32, 16)]
    for l, (a, g) in enumerate(zip(credit, grads)):
        cos = per_sample_cosine(a, g)
        assert float(cos.min()) > 0.99, (name, l, cos.min())
        # the units too: a_l ≈ g_l, not only its direction
        assert float((a - g).norm() / g.norm()) < 0.05, (name, l)
    far = method_class(name)(model, MethodSettings(epochs=1, trainable_blocks=(0, 1),
                                                   options={**options, "beta": 30.0}))
    assert float((far.credit(x, y)[1] - grads[1]).norm() / grads[1].norm()) > 0.05


def test_ep_step_on_plain_mlp_is_the_bp_step_at_small_beta():
    """The EP weight update (the local loss on a_{l+1} at h^β) equals BP's gradient as β → 0."""
    model, x, y = _small_mlp(1)
    ep = method_class("ep")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1),
                                                  options={"beta": 1e-5, "steps": 30}))
    ep.gradients(x, y)
    got = [p.grad.clone() for p in model.parameters()]
    ep.apply_gradients()                               # logs the step's stationarity residual
    # ∂F/∂h_l = −β(a_l − ∂f_lᵀ a_{l+1}) without a skip: relaxed, so near 0 (≈ 1 if the skip's
    # identity were counted)
    assert ep.epoch_log()["ep_residual"] < 1e-3
    bp = PlainMLP(20, 16, n_blocks=2, n_classes=5, activation="tanh").double()
    bp.load_state_dict(_small_mlp(1)[0].state_dict())
    bp.loss(bp(x), y).backward()
    for g, p in zip(got, bp.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-3, atol=1e-8)


def _mlp_config(method: str) -> RunConfig:
    return RunConfig(method=method, dataset="digits", arch="mlp", width=32, blocks=2, epochs=1)


@pytest.mark.parametrize("name", ["ep", "pc", "local-loss", "node-perturbation"])
def test_rule_trains_and_is_diagnosed_on_plain_mlp(name, tmp_path, digits):
    run = train_run(_mlp_config(name), tmp_path / name, data=digits, progress=False)
    assert run.status["status"] == "finished" and run.test_acc > 0.1
    x, y = digits.prepare(digits.x_test[:96]), digits.y_test[:96]
    run.model.eval()
    report = diagnose(run.model, [(x[:48], y[:48]), (x[48:], y[48:])], method=run.method)
    assert len(report.gamma) == 3 and all(math.isfinite(g) for g in report.gamma[1:])
    assert report.gamma_interpretable
    credit = run.method.credit(x[:8], y[:8])
    assert [tuple(a.shape) for a in credit] == [(8, 64), (8, 32), (8, 32)]
    if name in ("ep", "pc"):        # a rule that reaches the BP gradient at β = 1 after one epoch
        assert min(report.gamma[1:]) > 0.9 and min(report.gamma_trained[1:]) > 0.9
    else:
        assert report.gamma_trained is None and "gamma_trained" in report.to_dict()


@pytest.mark.parametrize("name", ["sb", "cb"])
def test_bridges_refuse_plain_mlp_before_training(name, tmp_path, digits):
    with pytest.raises(CreditAuditError, match=f"'{name}' does not train arch mlp: .*h_0 is the input"):
        train_run(_mlp_config(name), tmp_path / name, data=digits, progress=False)
    assert not (tmp_path / name / "checkpoint.json").exists()


def test_local_loss_heads_sized_per_position():
    """Aux classifiers at h_1 … h_{L−1} of the plain MLP (none at the input), zero-initialised as
    Nøkland & Eidnes' decoder_y; a residual stream keeps h_0 … h_{L−1}."""
    model = PlainMLP(20, 16, n_blocks=3, n_classes=5)
    ll = method_class("local-loss")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1, 2)))
    assert ll.positions == (1, 2) and [h.in_features for h in ll.aux] == [16, 16]
    assert all(float(h.weight.detach().abs().max()) == 0 for h in ll.aux)


def test_node_perturbation_noise_skips_the_input():
    """No noise at h_0 = x on the plain MLP: a_1 … a_L are ΔL·ξ_l/σ² at each hidden layer, and
    the chance level of Γ counts only the L noised positions."""
    model, x, y = _small_mlp()
    model = model.float()
    np_ = method_class("node-perturbation")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1),
                                                                   batch_size=32))
    assert np_.noised == (1, 2)
    np_.prepare_step()
    assert tuple(np_._noise.shape) == (2, 32, 16)
    grads = [torch.ones(4, 20), torch.ones(4, 16), torch.ones(4, 16)]
    chance = chance_gamma(grads, np_.noised)
    assert math.isnan(chance[0])
    assert chance[1] == pytest.approx((2 / math.pi) ** 0.5 / (16 ** 0.5 * 2 ** 0.5))


@pytest.mark.parametrize("name", ["ep", "pc"])
def test_gamma_as_trained_is_the_float32_strict_relaxation(name, tmp_path, digits):
    """The diagnosis' `gamma_trained` is Γ of the credit recomputed by hand with training's own
    relaxation: the float32 model, the strict acceptance test, no rounding margin."""
    run = train_run(_mlp_config(name), tmp_path / name, data=digits, progress=False)
    model, method = run.model.eval(), run.method
    x = digits.prepare(digits.x_test[:128])
    batches = [(x[:64], digits.y_test[:64]), (x[64:], digits.y_test[64:128])]
    report = diagnose(model, batches, method=method)
    by_hand = []
    for x, y in batches:
        if name == "ep":
            rel = method._relax(_Chain(model), x, y, with_margin=False)
            with torch.enable_grad():
                (a0,) = torch.autograd.grad(rel.branches[0], rel.leaves[0], rel.credit[0])
            by_hand.append([a0] + rel.credit)
        else:
            h0 = model.embed_input(x)
            states = method.infer(h0, y)[0]
            errors, _, grads = method.evaluate(h0, states, y, [])
            by_hand.append([grads[0]] + [-e / method.beta for e in errors])
    assert all(a.dtype == torch.float32 for a in by_hand[0])
    pooled = [torch.cat([b[l] for b in by_hand]) for l in range(3)]
    ref = [torch.cat([bp_gradients(model, x, y).grads[l] for x, y in batches]) for l in range(3)]
    expected = gradient_cosine(pooled, ref)
    assert report.gamma_trained == pytest.approx(expected, abs=1e-6)
    d = report.to_dict()
    assert d["gamma_trained"] == pytest.approx(expected, abs=1e-6)
    assert d["gamma_deep_trained"] == pytest.approx(sum(expected[1:]) / 2, abs=1e-6)
    assert "Γ trained" in str(report)


@pytest.mark.parametrize("name", ["ep", "pc", "node-perturbation"])
def test_rules_comparing_forward_passes_refuse_dropout(name):
    """ep's sweeps, pc's trial steps and node perturbation's ΔL compare forward passes of one
    network: with dropout each pass would be another network, so an mlp with dropout is refused."""
    model = PlainMLP(20, 16, n_blocks=2, n_classes=5, dropout=0.1)
    with pytest.raises(CreditAuditError, match=f"method '{name}' does not train with dropout .*set the "
                                               "mlp's dropout to 0"):
        method_class(name)(model, MethodSettings(epochs=1, trainable_blocks=(0, 1)))
    method_class("local-loss")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1)))   # theirs uses it


def test_audit_tables_show_the_trained_gamma_beside():
    from creditaudit.report.tables import _credit_cells
    row = {"method": "ep", "gamma_deep": 0.999, "gamma_deep_paper": 0.999, "gamma_deep_trained": 0.952}
    assert _credit_cells(row)[1] == "+0.999 (as trained +0.952)"
    assert _credit_cells({**row, "gamma_deep_trained": None})[1] == "+0.999"


def test_a_gap_between_the_two_gammas_is_a_note():
    """Samples the trained relaxation left with a = 0 count cos 0 in the trained Γ; a gap of more
    than 0.01 to the reported Γ is named in the report's notes with their number."""
    model, x, y = _small_mlp(2)

    class Rule:
        def credit(self, x, y):
            return bp_gradients(model, x, y).grads

        def trained_credit(self, x, y):
            grads = [g.clone() for g in self.credit(x, y)]
            for g in grads:
                g[:4] = 0                                     # 4 per batch: 8 of 32 samples
            return grads

    report = diagnose(model, [(x[:16], y[:16]), (x[16:], y[16:])], method=Rule())
    assert report.gamma[1:] == pytest.approx([1.0, 1.0])
    assert report.gamma_trained[1:] == pytest.approx([0.75, 0.75])
    assert any("left 8 of 32 samples without any credit" in n for n in report.notes)
