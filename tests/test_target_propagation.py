"""Target propagation (methods/target_propagation.py): with exact inverses of orthogonal layers dtp's
implied update is the gradient's direction, and of general invertible layers the Gauss–Newton
direction; the difference correction removes an inverse's reconstruction error exactly; feedback
training lowers the reconstruction loss while pre-training leaves the forward weights alone; both
rules train on the ResMLP and the plain MLP and are diagnosed; other architectures are refused."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from creditaudit.config import RunConfig
from creditaudit.errors import CreditAuditError
from creditaudit.methods import MethodSettings, method_class
from creditaudit.metrics import bp_gradients
from creditaudit.model import build_model
from creditaudit.model.plain import PlainMLP
from creditaudit.model.resmlp import ResidualMLP
from creditaudit.model.vit import ViTMini
from creditaudit.protocol import diagnose
from creditaudit.train import train_run

from rule_steps import check_step_reproducible_and_frozen_blocks_stay

RULES = ("dtp", "ddtp-linear")


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-sample cosine, unclamped."""
    a, b = a.flatten(1).double(), b.flatten(1).double()
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))


class ExactLayerInverse(nn.Module):
    """g(v) = W⁻¹(atanh(v) − b): the exact inverse of v = tanh(W h + b)."""

    def __init__(self, linear: nn.Linear, tanh: bool = True):
        super().__init__()
        self.w_inv = torch.linalg.inv(linear.weight.detach().double())
        self.b, self.tanh = linear.bias.detach().double(), tanh

    def forward(self, v):
        a = torch.atanh(v) if self.tanh else v
        return (a - self.b) @ self.w_inv.T


def _invertible_mlp(orthogonal: bool, seed: int = 0) -> PlainMLP:
    """8 → 8 → 8 → 8 tanh layers and an 8-class readout: every layer square, so exact inverses exist."""
    torch.manual_seed(seed)
    model = PlainMLP(8, 8, n_blocks=3, n_classes=8, activation="tanh").double()
    with torch.no_grad():
        for layer in [b.linear for b in model.blocks] + [model.out_head]:
            w = torch.randn(8, 8, dtype=torch.float64)
            general = w / math.sqrt(8) + 0.5 * torch.eye(8, dtype=torch.float64)     # well conditioned
            layer.weight.copy_(torch.linalg.qr(w)[0] if orthogonal else general)
            layer.bias.zero_()
    return model


def _exact_inverses(model: PlainMLP) -> nn.ModuleDict:
    inv = nn.ModuleDict({"out": ExactLayerInverse(model.out_head, tanh=False)})
    for l in range(1, model.n_blocks):
        inv[str(l)] = ExactLayerInverse(model.blocks[l].linear)
    return inv


def test_exact_inverses_of_orthogonal_layers_give_the_gradient_direction():
    """Orthogonal W and pre-activations ≈ 1e-3 (tanh' ≈ 1): every layer's Jacobian is orthogonal, so
    J⁻¹ = Jᵀ and dtp's a_l = (h_l − ĥ_l)·N/η is the gradient's direction at a small target step."""
    model = _invertible_mlp(orthogonal=True)
    x, y = 1e-3 * torch.randn(16, 8, dtype=torch.float64), torch.randint(0, 8, (16,))
    method = method_class("dtp")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1, 2),
                                                       options={"target_step": 1e-3}))
    credit = method._credit_with(x, y, _exact_inverses(model))
    grads = bp_gradients(model, x, y).grads
    for l in (1, 2, 3):
        assert float(_cos(credit[l], grads[l]).min()) > 0.99, l


def test_exact_inverses_of_general_layers_give_the_gauss_newton_direction_not_the_gradient():
    """Non-orthogonal invertible W in tanh's nonlinear range: with exact inverses the implied update
    is the Gauss–Newton chain a_L = W_out⁻¹ e, a_l = J_l⁻¹ a_{l+1} (J_l = diag(1 − h_{l+1}²) W_l),
    Meulemans et al.'s result — and visibly not the gradient's Jᵀ chain."""
    model = _invertible_mlp(orthogonal=False, seed=1)
    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randint(0, 8, (16,))
    method = method_class("dtp")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1, 2),
                                                       options={"target_step": 1e-4}))
    credit = method._credit_with(x, y, _exact_inverses(model))
    with torch.no_grad():
        logits, hidden = model(x, return_hidden=True)
    gn = {3: model.output_error(logits, y) @ torch.linalg.inv(model.out_head.weight.detach()).T}
    for l in (2, 1):
        jac = (1 - hidden[l + 1].pow(2)).unsqueeze(-1) * model.blocks[l].linear.weight.detach()  # (N, d, d)
        gn[l] = torch.linalg.solve(jac, gn[l + 1]).detach()
    grads = bp_gradients(model, x, y).grads
    for l in (3, 2, 1):
        assert float(_cos(credit[l], gn[l]).min()) > 0.999, l
        assert float((credit[l] - gn[l]).norm() / gn[l].norm()) < 1e-2, l        # the units too
    assert float(_cos(credit[1], grads[1]).mean()) < 0.95


@pytest.mark.parametrize("arch", ["mlp", "resmlp"])
@pytest.mark.parametrize("name", RULES)
def test_difference_correction_removes_the_reconstruction_error(name, arch):
    """With untrained (imperfect) feedback, ĥ_l = h_l exactly when the output target is the output
    itself; and each dtp step is literally ĥ_l = g_l(ĥ_{l+1}) + h_l − g_l(h_{l+1})."""
    torch.manual_seed(0)
    model = (PlainMLP(6, 8, 3, 5, activation="tanh") if arch == "mlp"
             else ResidualMLP(6, 8, 3, 5, w2_std=0.5)).double()
    method = method_class(name)(model, MethodSettings(epochs=1, trainable_blocks=(0, 1, 2)))
    x, y = torch.randn(10, 6, dtype=torch.float64), torch.randint(0, 5, (10,))
    with torch.no_grad():
        logits, hidden = model(x, return_hidden=True)
    deltas = method._deltas(hidden, logits, torch.zeros_like(logits), method.feedback)
    assert sorted(deltas) == list(range(0 if arch == "resmlp" else 1, 4))
    assert all(torch.equal(d, torch.zeros_like(d)) for d in deltas.values())
    if name == "dtp":
        g = method.feedback["2"]
        with torch.no_grad():
            assert float((g(hidden[3]) - hidden[2]).norm()) > 0.1          # the inverse is far from exact
        with torch.no_grad():
            dz = method._output_step(logits, y)
            deltas = method._deltas(hidden, logits, dz, method.feedback)
            target3 = hidden[3] + deltas[3]
            target2 = g(target3) + hidden[2] - g(hidden[3])
        torch.testing.assert_close(hidden[2] + deltas[2], target2, rtol=0, atol=1e-12)


def test_ddtp_linear_credit_is_the_direct_feedback_of_the_output_error():
    """ddtp-linear's a_l = (h_l − ĥ_l)·N/η = Q_l e, exactly (the bias of g cancels)."""
    torch.manual_seed(0)
    model = PlainMLP(6, 8, 2, 5, activation="tanh").double()
    method = method_class("ddtp-linear")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1)))
    x, y = torch.randn(10, 6, dtype=torch.float64), torch.randint(0, 5, (10,))
    credit = method.credit(x, y)
    e = model.output_error(model(x), y)
    for l in (1, 2):
        torch.testing.assert_close(credit[l], e @ method.feedback[str(l)].T, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("arch", ["mlp", "resmlp"])
@pytest.mark.parametrize("name", RULES)
def test_pretraining_trains_the_feedback_only_and_lowers_the_reconstruction_loss(name, arch):
    """fb_pretrain = 1: through the first epoch every step moves the feedback weights and no forward
    weight (bit-identical), and the reconstruction loss (on fixed noise) falls; the next epoch trains
    the forward weights too. (A faster feedback Adam than the published one, to see it in 60 steps;
    ddtp-linear's loss cannot reach 0: Q_l (D × C) reconstructs only a C-dimensional part of the noise.)"""
    torch.manual_seed(0)
    model = PlainMLP(12, 16, 2, 10, activation="tanh") if arch == "mlp" else ResidualMLP(12, 16, 2, 10)
    init = [p.detach().clone() for p in model.parameters()]
    method = method_class(name)(model, MethodSettings(epochs=2, trainable_blocks=(0, 1), batch_size=32,
                                                      options={"fb_pretrain": 1, "lr_fb": 1e-2, "fb_beta1": 0.9}))
    fb_init = [p.detach().clone() for p in method.feedback.parameters()]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 12, generator=g), torch.randint(0, 10, (32,), generator=g)
    noise = {l: torch.randn(32, 16, generator=g) for l in method._noise_positions()}

    def reconstruction() -> float:
        with torch.no_grad():
            logits, hidden = model(x, return_hidden=True)
            return float(method._reconstruction(hidden, logits, noise))
    before = reconstruction()
    for _ in range(60):
        method.train_step(x, y)
    assert reconstruction() < 0.7 * before, (before, reconstruction())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), init))
    assert not all(torch.equal(p, q) for p, q in zip(method.feedback.parameters(), fb_init))
    method.end_epoch()
    method.train_step(x, y)
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), init))


def test_fb_extra_adds_feedback_updates_and_trains_eagerly():
    torch.manual_seed(0)
    model = PlainMLP(12, 16, 2, 10, activation="tanh")
    method = method_class("ddtp-linear")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1), batch_size=8,
                                                               options={"fb_pretrain": 0, "fb_extra": 2}))
    assert not method.compilable()
    x, y = torch.randn(8, 12), torch.randint(0, 10, (8,))
    method.train_step(x, y)
    method.train_step(x, y)
    steps = {int(s["step"]) for s in method.fb_opt.state.values()}
    assert steps == {6}                                          # 2 steps × (1 + 2) feedback updates
    assert next(iter(method.opt.state.values()))["step"] == 2


@pytest.mark.parametrize("arch", ["resmlp", "mlp"])
@pytest.mark.parametrize("name", RULES)
def test_rule_trains_and_is_diagnosed(name, arch, tmp_path, digits):
    config = RunConfig(method=name, dataset="digits", arch=arch, width=32, blocks=2, epochs=3,
                       activation="tanh" if arch == "mlp" else "gelu", options={"fb_pretrain": 0})
    run = train_run(config, tmp_path / "run", data=digits, progress=False)
    assert run.status["status"] == "finished"
    losses = [h["train_loss"] for h in run.history if h["train_loss"] is not None]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    x, y = digits.prepare(digits.x_test[:96]), digits.y_test[:96]
    run.model.eval()
    report = diagnose(run.model, [(x[:48], y[:48]), (x[48:], y[48:])], method=run.method,
                      test_acc=run.test_acc, frozen_acc=0.1, null_k=4)
    assert len(report.gamma) == 3 and all(math.isfinite(g) for g in report.gamma[1:]), report.gamma


@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("pretrain", [0, 1])
def test_the_plain_mlps_shallow_control_has_nothing_to_invert_and_trains(name, pretrain, tmp_path, digits):
    """blocks = 0 on the plain MLP is a linear classifier: no inverse, no feedback optimiser; the
    readout alone steps on ‖z − ẑ‖², i.e. on the output target (a reproduction's shallow control),
    and a feedback pre-training epoch has nothing to train."""
    config = RunConfig(method=name, dataset="digits", arch="mlp", width=32, blocks=0, epochs=3,
                       activation="tanh", options={"fb_pretrain": pretrain})
    run = train_run(config, tmp_path / "run", data=digits, progress=False)
    assert run.status["status"] == "finished" and run.method.fb_opt is None
    losses = [h["train_loss"] for h in run.history if h["train_loss"] is not None]
    assert losses[-1] < losses[0], losses       # the readout learns (slowly, at the published lr)
    if pretrain:                                # the pre-training epoch trained nothing: the model at 1 is at 0
        assert run.history[1]["test_correct"] == run.history[0]["test_correct"]
        assert run.history[2]["test_correct"] != run.history[0]["test_correct"]


@pytest.mark.parametrize("name", RULES)
def test_step_is_reproducible_and_frozen_blocks_stay(name):
    check_step_reproducible_and_frozen_blocks_stay(name, lambda: ResidualMLP(16, 8, 2, 10), {"fb_pretrain": 0})


@pytest.mark.parametrize("name", RULES)
def test_other_architectures_refused_in_one_line(name):
    vit = ViTMini((3, 8, 8), d=8, n_blocks=1, n_classes=10, heads=2, patch=4)
    resnet = build_model("resnet-small", (3, 8, 8), 10, width=4, blocks=1)
    for model in (vit, resnet):
        with pytest.raises(CreditAuditError, match="resmlp or mlp only") as err:
            method_class(name)(model, MethodSettings(epochs=1, trainable_blocks=(0,)))
        assert "\n" not in str(err.value)
    with pytest.raises(CreditAuditError, match="dropout"):
        method_class(name)(PlainMLP(4, 8, 1, 3, dropout=0.1), MethodSettings(epochs=1, trainable_blocks=(0,)))


def test_paper_settings_are_meulemans_mnist_network():
    from creditaudit.papers import paper
    for name in RULES:
        setting = paper(name)
        assert (setting.dataset, setting.width, setting.blocks, setting.activation, setting.init) == \
            ("mnist", 256, 5, "tanh", "xavier-normal")
        assert setting.recipe.optimizer == "adam" and setting.recipe.batch_size == 128
    assert paper("ddtp-linear").epochs == 106 and paper("ddtp-linear").options["fb_pretrain"] == 6
