"""forward-forward (methods/forward_forward.py): the goodness, the loss and the step's weight gradients
are Hinton's code's arithmetic (ffnew.m) on a 2-layer net written out by hand; negatives never carry
the true label, under either sampler; the hard sampler draws from the readout's softmax over the wrong
labels; the rule trains on the plain MLP and the ResMLP (positive and negative goodness separate), is
diagnosed, and refuses the architectures it is not written for in one line."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from creditaudit.config import RunConfig
from creditaudit.errors import CreditAuditError
from creditaudit.methods import MethodSettings, method_class
from creditaudit.methods.forward_forward import ff_credit, ff_loss, goodness, wrong_labels
from creditaudit.methods.recipe import HalfLinear
from creditaudit.model import build_model
from creditaudit.model.plain import PlainMLP
from creditaudit.model.resmlp import ResidualMLP
from creditaudit.model.resnet import SmallResNet
from creditaudit.model.vit import ViTMini
from creditaudit.protocol import diagnose
from creditaudit.train import train_run

from rule_steps import check_step_reproducible_and_frozen_blocks_stay

RULE = "forward-forward"


def _rms_rows(a: torch.Tensor) -> torch.Tensor:
    """ffnormrows.m: a ./ (tiny + sqrt(mean(a.^2, 2))), with the model's tiny = 1e-8 for Hinton's e^−100
    (which is 0 in float32: model/plain.py)."""
    return a / (1e-8 + a.pow(2).mean(1, keepdim=True).sqrt())


def test_goodness_and_loss_are_hintons_logistic():
    """G = Σh², p = σ(G − D); ℓ⁺ = −½ log p⁺, ℓ⁻ = −½ log(1 − p⁻); ∂ℓ/∂h in closed form = autograd."""
    torch.manual_seed(0)
    h = torch.rand(5, 7, dtype=torch.float64) * 2
    d = 7.0
    g = (h ** 2).sum(1)
    p = 1 / (1 + torch.exp(-(g - d)))                                  # logistic.m
    assert torch.allclose(goodness(h), g)
    assert torch.allclose(ff_loss(h, d, True), -0.5 * torch.log(p))
    assert torch.allclose(ff_loss(h, d, False), -0.5 * torch.log(1 - p))
    for positive in (True, False):
        leaf = h.clone().requires_grad_(True)
        (auto,) = torch.autograd.grad(ff_loss(leaf, d, positive).sum(), leaf)
        assert torch.allclose(ff_credit(h, d, positive), auto)
    assert torch.allclose(ff_credit(h, d, True), -(1 - p)[:, None] * h)        # ffnew.m:148, sign flipped
    assert torch.allclose(ff_credit(h, d, False), p[:, None] * h)              # ffnew.m:207, sign flipped


@pytest.mark.parametrize("peer", [0.0, 0.03])
def test_step_is_hintons_update_on_a_two_layer_net(peer):
    """The .grad the step leaves on each hidden layer is −(posdCbydweights + negdCbydweights)/numcases of
    ffnew.m:143-157, 196-209, computed here line by line from the code: label pixels, ffnormrows,
    ReLU, the logistic of Σs² − N, dC/dtotin, peer normalisation. (The optimiser's smoothing is torch's.)"""
    torch.manual_seed(3)
    c, n = 4, 9
    model = PlainMLP(14, 6, n_blocks=2, n_classes=c, activation="relu", init="fan-in-normal",
                     norm="rms").double()
    with torch.no_grad():                       # non-zero biases, so their gradients are checked too
        for block in model.blocks:
            block.linear.bias.normal_(0, 0.3)
    x, y = torch.randn(n, 14, dtype=torch.float64), torch.randint(0, c, (n,))
    method = method_class(RULE)(model, MethodSettings(epochs=1, trainable_blocks=(0, 1), batch_size=n,
                                                      options={"negatives": "uniform", "peer": peer}))
    method.clear_gradients()
    method.prepare_step()
    method.gradients(x, y)
    u = method._u[:n]
    wrong = (y + 1 + (u * (c - 1)).long()) % c                         # uniform over the wrong labels
    assert not (wrong == y).any()

    weights = [b.linear.weight.detach().T for b in model.blocks]       # Hinton's layout: (in, out)
    biases = [b.linear.bias.detach() for b in model.blocks]
    meanstates = [torch.full((6,), 0.5, dtype=torch.float64) for _ in range(2)]
    dw = [torch.zeros_like(w) for w in weights]
    db = [torch.zeros_like(b) for b in biases]
    for labels, positive in ((y, True), (wrong, False)):
        data = x.clone()
        data[:, :c] = F.one_hot(labels, c).double()                   # data(:,1:10) = targets
        norm = _rms_rows(data)
        for l in range(2):
            states = torch.clamp(norm @ weights[l] + biases[l], min=0)
            prob = torch.sigmoid((states ** 2).sum(1) - 6)
            dcdin = ((1 - prob) if positive else -prob)[:, None] * states
            if positive and peer:
                meanstates[l] = 0.9 * meanstates[l] + 0.1 * states.mean(0)
                dcdin = dcdin + peer * (meanstates[l].mean() - meanstates[l])
            dw[l] += norm.T @ dcdin
            db[l] += dcdin.sum(0)
            norm = _rms_rows(states)
    for l, block in enumerate(model.blocks):
        assert torch.allclose(block.linear.weight.grad, -dw[l].T / n, atol=1e-12), l
        assert torch.allclose(block.linear.bias.grad, -db[l] / n, atol=1e-12), l
    # the readout: CE on out_head(n(h_L)) of the model's own (neutral) forward, the hidden layers detached
    with torch.no_grad():
        h = model(x, return_hidden=True)[1][-1]
    head = [p.detach().clone().requires_grad_(True) for p in model.out_head.parameters()]
    ce = F.cross_entropy(F.linear(_rms_rows(h), *head), y)
    for p, g in zip(model.out_head.parameters(), torch.autograd.grad(ce, head)):
        assert torch.allclose(p.grad, g)


@pytest.mark.parametrize("hard", [True, False])
def test_negatives_never_carry_the_true_label(hard):
    """50 × 2000 draws, logits that put almost all mass on the true label (the hard sampler must still
    refuse it), and the extreme uniforms 0 and the largest float below 1."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        c = 2 + trial % 11
        y = torch.randint(0, c, (2000,), generator=gen)
        logits = torch.randn(2000, c, generator=gen) * 5
        logits[torch.arange(2000), y] += 100.0 * (trial % 2)
        u = torch.rand(2000, generator=gen)
        u[:2] = torch.tensor([0.0, 1.0 - 2 ** -24])
        drawn = wrong_labels(logits, y, u, hard)
        assert ((drawn >= 0) & (drawn < c)).all()
        assert not (drawn == y).any(), (trial, c)
    # and through the step, on the model: the negatives the step presents
    torch.manual_seed(0)
    model = ResidualMLP(12, 16, 1, 10)
    method = method_class(RULE)(model, MethodSettings(
        epochs=1, trainable_blocks=(0,), batch_size=256, options={"negatives": "hard" if hard else "uniform"}))
    x, y = torch.randn(256, 12), torch.randint(0, 10, (256,))
    for _ in range(20):
        method.prepare_step()
        assert not (method.negatives(model(x), y, method._u) == y).any()


def test_hard_negatives_follow_the_softmax_over_the_wrong_labels():
    """200,000 draws for one sample (y = 3): the counts against P(k) = e^{z_k}/Σ_{c≠3} e^{z_c}, a chi-square
    with 8 degrees of freedom (99.9 % point 26.1; fixed seed). The uniform sampler: 1/9 each."""
    z = torch.tensor([1.5, -0.5, 0.0, 4.0, 2.0, -1.0, 0.7, 1.1, -2.0, 0.3])
    m = 200_000
    y = torch.full((m,), 3)
    u = torch.rand(m, generator=torch.Generator().manual_seed(11))
    for hard in (True, False):
        counts = torch.bincount(wrong_labels(z.expand(m, -1), y, u, hard), minlength=10).double()
        assert counts[3] == 0
        if hard:
            expected = torch.cat([z[:3], z[4:]]).softmax(0).double() * m
        else:
            expected = torch.full((9,), m / 9, dtype=torch.float64)
        observed = torch.cat([counts[:3], counts[4:]])
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < 26.1, (hard, chi2)
    # the sampler the step uses is this one, fed the readout's logits of the neutral pass
    torch.manual_seed(1)
    model = ResidualMLP(12, 16, 1, 10)
    method = method_class(RULE)(model, MethodSettings(epochs=1, trainable_blocks=(0,)))
    x, y = torch.randn(64, 12), torch.randint(0, 10, (64,))
    uu = torch.rand(64)
    assert torch.equal(method.negatives(model(x), y, uu), wrong_labels(model(x), y, uu, True))


def _separation(method, model, x, y) -> tuple[float, float]:
    """(the FF loss summed over the goodness positions, mean G⁺ − G⁻ at the top position), for fixed
    uniform negatives, at the current weights."""
    with torch.no_grad():
        wrong = wrong_labels(model(x), y, torch.linspace(0, 0.999, len(y)), hard=False)
        loss, gap = 0.0, 0.0
        states = {}
        for labels, positive in ((y, True), (wrong, False)):
            h = method.present(model.embed_input(x), labels)
            hs = [h]
            for block in model.blocks:
                h = model.advance(h, block(h))
                hs.append(h)
            states[positive] = hs
            loss += sum(float(ff_loss(hs[l], method.threshold[l], positive).mean()) for l in method.positions)
        top = model.n_blocks
        gap = float((goodness(states[True][top]) - goodness(states[False][top])).mean())
    return loss, gap


@pytest.mark.parametrize("arch", ["mlp", "resmlp"])
def test_trains_and_positive_and_negative_goodness_separate(arch, digits):
    torch.manual_seed(0)
    options = {"norm": "rms", "init": "fan-in-normal"} if arch == "mlp" else {}
    model = build_model(arch, digits.input_shape, 10, width=64, blocks=2, activation="relu", options=options)
    method = method_class(RULE)(model, MethodSettings(epochs=3, trainable_blocks=(0, 1), lr=1e-2))
    x, y = digits.eval_batch(0)
    before = _separation(method, model, x, y)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        for xb, yb in digits.train_batches(128, g):
            method.train_step(xb, yb)
        method.end_epoch()
    after = _separation(method, model, x, y)
    assert after[0] < 0.8 * before[0], (before, after)
    assert after[1] > before[1] and after[1] > 0, (before, after)
    log = method.epoch_log()
    assert set(log) == set() or math.isfinite(log["ff_loss"])


@pytest.mark.parametrize("arch", ["resmlp", "mlp"])
def test_trains_end_to_end_and_is_diagnosed(arch, tmp_path, digits):
    config = RunConfig(method=RULE, dataset="digits", arch=arch, width=32, blocks=2, epochs=2)
    run = train_run(config, tmp_path / "run", data=digits, progress=False)
    assert run.status["status"] == "finished"
    x, y = digits.prepare(digits.x_test[:96]), digits.y_test[:96]
    report = diagnose(run.model, [(x[:48], y[:48]), (x[48:], y[48:])], method=run.method,
                      test_acc=run.test_acc, frozen_acc=0.1, null_k=3)
    assert len(report.gamma) == 3 and all(math.isfinite(g) for g in report.gamma[1:]), report.gamma


def test_frozen_control_trains_the_readout_alone_and_the_step_reproduces():
    check_step_reproducible_and_frozen_blocks_stay(RULE, lambda: PlainMLP(16, 8, n_blocks=2, n_classes=10, norm="rms"))


@pytest.mark.parametrize("model, needle", [
    (lambda: ViTMini((3, 8, 8), d=8, n_blocks=1, n_classes=10, heads=2, patch=4), "resmlp or mlp only"),
    (lambda: SmallResNet((3, 8, 8), width=4, n_blocks=1, n_classes=10), "resmlp or mlp only"),
    (lambda: PlainMLP(16, 8, n_blocks=1, n_classes=10, dropout=0.1), "dropout"),
    (lambda: PlainMLP(6, 8, n_blocks=1, n_classes=10), "only 6"),
    (lambda: ResidualMLP(12, 4, 1, 10), "too narrow for 10 classes"),
])
def test_what_it_is_not_written_for_is_refused_in_one_line(model, needle):
    with pytest.raises(CreditAuditError, match=needle) as err:
        method_class(RULE)(model(), MethodSettings(epochs=1, trainable_blocks=(0,)))
    assert "\n" not in str(err.value)


def test_an_unknown_sampler_is_refused_in_one_line():
    with pytest.raises(CreditAuditError, match="negatives.*hard, uniform"):
        method_class(RULE)(ResidualMLP(12, 16, 1, 10), MethodSettings(
            epochs=1, trainable_blocks=(0,), options={"negatives": "permuted"}))


def test_the_label_code_is_the_first_features_or_signed_when_the_stream_is_narrow():
    from creditaudit.methods.forward_forward import label_code
    assert torch.equal(label_code(10, 16), torch.eye(10, 16))
    narrow = label_code(10, 8)
    assert torch.equal(narrow[:8], torch.eye(8)) and torch.equal(narrow[8:], -torch.eye(2, 8))
    assert len({tuple(r.tolist()) for r in narrow}) == 10                     # every label distinct


def test_the_half_linear_schedule_is_hintons_epsgain():
    """ffnew.m:130-135 for maxepoch = 6: epochs 1-3 at 1, then (1 + 2(6 − e))/6 = 5/6, 3/6, 1/6."""
    assert [HalfLinear(6)(e) for e in range(6)] == pytest.approx([1, 1, 1, 5 / 6, 3 / 6, 1 / 6])


def test_resume_after_kill_equals_uninterrupted(tmp_path, monkeypatch, every_epoch):
    """The half-linear schedule, the peer running means and the sampler's generator resume exactly."""
    import json

    from creditaudit import store
    config = RunConfig(method=RULE, dataset="synthetic", arch="mlp", width=16, blocks=2, epochs=3,
                       batch_size=256, arch_options={"norm": "rms"})
    whole = train_run(config, tmp_path / "whole", progress=False)
    real_save = store.save_checkpoint

    def save_then_die(run_dir, epoch, state, meta, config):
        real_save(run_dir, epoch, state, meta, config)
        if epoch == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(store, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_run(config, tmp_path / "killed", progress=False)
    monkeypatch.setattr(store, "save_checkpoint", real_save)
    resumed = train_run(config, tmp_path / "killed", progress=False)
    assert resumed.status["status"] == "finished"
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.dumps(whole.method.extra_state(), default=lambda t: t.tolist()) == \
        json.dumps(resumed.method.extra_state(), default=lambda t: t.tolist())
    lrs = [g["lr"] for g in resumed.method.optimizers[0].param_groups]
    assert lrs == pytest.approx([g["lr"] for g in whole.method.optimizers[0].param_groups])


def test_credit_does_not_advance_the_training_draws_and_round_trips():
    torch.manual_seed(0)
    model = PlainMLP(16, 8, n_blocks=2, n_classes=10, norm="rms")
    method = method_class(RULE)(model, MethodSettings(epochs=1, trainable_blocks=(0, 1), batch_size=32))
    x, y = torch.randn(32, 16), torch.randint(0, 10, (32,))
    method.train_step(x, y)
    state = method.gen.get_state()
    first = method.credit(x, y)
    assert all(torch.equal(a, b) for a, b in zip(first, method.credit(x, y)))
    assert torch.equal(state, method.gen.get_state())
    saved = method.state_dict()
    torch.manual_seed(1)
    twin = method_class(RULE)(PlainMLP(16, 8, n_blocks=2, n_classes=10, norm="rms"),
                              MethodSettings(epochs=1, seed=9, trainable_blocks=(0, 1), batch_size=32))
    twin.model.load_state_dict(model.state_dict())
    twin.load_state_dict(saved)
    assert all(torch.equal(m, twin.mean_states[l]) for l, m in method.mean_states.items())
    assert all(torch.equal(a, b) for a, b in zip(first, twin.credit(x, y)))


def test_the_plain_mlp_step_with_peer_normalisation_compiles_whole():
    """The mlp path (peer normalisation's in-place running means and gradient terms) under
    torch.compile(fullgraph=True) gives the eager step's update; the ResMLP path is in test_compile."""
    import copy
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PlainMLP(16, 12, n_blocks=2, n_classes=10, norm="rms").double()
    twin = copy.deepcopy(model)
    settings = MethodSettings(epochs=2, seed=0, trainable_blocks=(0, 1), batch_size=16)
    eager, compiled = method_class(RULE)(model, settings), method_class(RULE)(twin, settings)
    step = compiled.step_function(backend="eager")
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        x, y = torch.randn(16, 16, generator=g, dtype=torch.float64), torch.randint(0, 10, (16,), generator=g)
        want = eager.train_step(x, y)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = step(x, y)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(model.state_dict().values(), twin.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    for l, m in eager.mean_states.items():
        torch.testing.assert_close(compiled.mean_states[l], m, rtol=1e-12, atol=1e-12)
    assert eager.epoch_log() == compiled.epoch_log()
