"""EP's sweep relaxation and CB's closed-form aux pass: the properties that make them the same
methods as before (EP → BP as β → 0, the nudged states are an equilibrium of the energy, CB's
credit/aux gradient = the autograd definition), their learning, and any residual-stream shape."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from creditaudit.data import load_dataset
from creditaudit.methods import MethodSettings, method_class
from creditaudit.methods.local import output_error
from creditaudit.metrics import bp_gradients, ce_gradient, gradient_cosine
from creditaudit.protocol import diagnose
from creditaudit.model import ResidualMLP, ResidualModel

SMALL_BETA = {"beta": 1e-4, "steps": 4}


def build(name, d=16, n_blocks=3, d_in=16, seed=0, dtype=torch.float64, w2_std=0.3, trainable=None,
          **settings):
    torch.manual_seed(seed)
    model = ResidualMLP(d_in, d, n_blocks, 10, w2_std=w2_std).to(dtype)
    trainable = tuple(range(n_blocks)) if trainable is None else trainable
    return model, method_class(name)(model, MethodSettings(epochs=5, seed=seed, trainable_blocks=trainable,
                                                           **settings))


def batch(n=16, d_in=16, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g).to(dtype), torch.randint(0, 10, (n,), generator=g)


def sample_cos(a, b):
    a, b = a.flatten(1), b.flatten(1)
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


def vec_cos(a, b):
    return float(a.flatten() @ b.flatten() / (a.norm() * b.norm()))


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


# -- ep -------------------------------------------------------------------------------------------

def test_ep_credit_tends_to_bp_gradient():
    """Non-identity blocks (w2_std 0.3, float64): the nudged prediction errors −r_{l−1}/β → g_l."""
    model, ep = build("ep", options=SMALL_BETA)
    x, y = batch()
    credit, bp = ep.credit(x, y), bp_gradients(model, x, y).grads
    assert len(credit) == len(bp) == 4
    for a, g in zip(credit, bp):
        assert sample_cos(a, g).min() > 0.99
        assert abs(float(a.norm() / g.norm()) - 1) < 0.01


def test_ep_weight_update_is_bp_gradient_at_small_beta():
    """lr = 0: the step leaves the weights alone and .grad holds the EP estimator −(1/β) ∂E/∂θ."""
    model, ep = build("ep", lr=0.0, options=SMALL_BETA)
    x, y = batch()
    params = list(model.parameters())
    expected = torch.autograd.grad(F.cross_entropy(model(x), y), params)
    before = [p.detach().clone() for p in params]
    ep.train_step(x, y)
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    for l, block in enumerate(model.blocks):                                # per trainable block
        got = torch.cat([p.grad.flatten() for p in block.parameters()])
        want = torch.cat([g.flatten() for p, g in zip(params, expected)
                          if any(p is q for q in block.parameters())])
        assert vec_cos(got, want) > 0.99, l
    for (name, p), g in zip(model.named_parameters(), expected):             # and every tensor
        assert vec_cos(p.grad, g) > 0.99, name


def _stationarity(model, states, y, beta):
    """‖∂F/∂h_{1…L}‖ at `states` by autograd on F = ½Σ‖r‖² + β·CE, independent of ep.py."""
    h = [states[0]] + [s.detach().requires_grad_(True) for s in states[1:]]
    energy = 0.5 * sum((h[l + 1] - h[l] - b(h[l])).pow(2).sum() for l, b in enumerate(model.blocks))
    free_energy = energy + beta * F.cross_entropy(model.readout(h[-1]), y)
    return float(sum(g.pow(2).sum() for g in torch.autograd.grad(free_energy, h[1:])).sqrt())


def _nudged_states(ep, x, y):
    rel = ep.relax(x, y)
    return [rel.leaves[0].detach()] + [leaf.detach() for leaf in rel.leaves[1:]] + [rel.h_last.detach()]


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_ep_relaxation_reaches_the_nudged_equilibrium(beta):
    """More sweeps drive ∂F/∂h (by autograd on the energy itself) to 0, and the credit is −r/β of
    the returned states. (β/N up to 1/16 per sample here, on blocks far from the identity.)"""
    model, ep = build("ep", options={"beta": beta, "steps": 20})
    x, y = batch()
    scale = beta * float(bp_gradients(model, x, y).grads[-1].norm())
    states = _nudged_states(ep, x, y)
    converged = _stationarity(model, states, y, beta)
    assert converged < 1e-8 * scale
    credit = ep.credit(x, y)
    for l, block in enumerate(model.blocks):
        r = states[l + 1] - states[l] - block(states[l])
        torch.testing.assert_close(credit[l + 1], -r / beta, rtol=1e-6, atol=1e-12)
    residuals = [_stationarity(model, _nudged_states(method_class("ep")(model, MethodSettings(
        epochs=1, options={"beta": beta, "steps": k})), x, y), y, beta) for k in (1, 2, 4)]
    assert residuals[0] > residuals[1] > residuals[2] > converged


@pytest.mark.parametrize("beta", [1.0, 30.0, 1e4])
def test_ep_relaxation_never_raises_the_free_energy(beta):
    """The per-sample safeguard: every F_i at h^β is at most its free-phase value, even for a nudge
    far outside the linear regime (where plain sweeps oscillate), and the states stay finite."""
    model, ep = build("ep", options={"beta": beta, "steps": 6})
    x, y = batch()
    free = bp_gradients(model, x, y)
    states = _nudged_states(ep, x, y)
    assert all(torch.isfinite(s).all() for s in states)
    energy = 0.5 * sum((states[l + 1] - states[l] - b(states[l])).pow(2).flatten(1).sum(-1)
                       for l, b in enumerate(model.blocks))
    f_nudged = energy + beta * F.cross_entropy(model.readout(states[-1]), y, reduction="none") / len(y)
    f_free = beta * F.cross_entropy(free.logits, y, reduction="none") / len(y)
    assert (f_nudged <= f_free * (1 + 1e-12)).all()
    assert (f_nudged < f_free).float().mean() > 0.9
    ep.train_step(x, y)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_ep_logs_a_small_residual_after_training(digits):
    """Default settings, float32, after some training: the relaxation has converged (the logged
    relative stationarity residual is small) and the log is per epoch (reset on read)."""
    torch.manual_seed(0)
    model = ResidualMLP(digits.d_in, 32, 4, 10)
    ep = method_class("ep")(model, MethodSettings(epochs=3, seed=0, trainable_blocks=(0, 1, 2, 3)))
    assert ep.epoch_log() == {}
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        for x, y in digits.train_batches(128, g):
            ep.train_step(x, y)
        ep.end_epoch()
        log = ep.epoch_log()
    assert set(log) == {"ep_residual", "ep_steps"}
    assert all(isinstance(v, float) for v in log.values())
    assert log["ep_steps"] == ep.steps
    assert 0 <= log["ep_residual"] < 0.05, log
    assert ep.epoch_log() == {}


def test_ep_residual_is_the_stationarity_residual():
    """The logged number equals ‖∂F/∂h(h^β)‖ / (β‖∂CE/∂h_L(h^free)‖) computed independently."""
    model, ep = build("ep", lr=0.0, options={"beta": 10.0, "steps": 2})
    x, y = batch()
    beta = ep.beta
    expected = _stationarity(model, _nudged_states(ep, x, y), y, beta) / (
        beta * float(bp_gradients(model, x, y).grads[-1].norm()))
    ep.train_step(x, y)
    assert ep.epoch_log()["ep_residual"] == pytest.approx(expected, rel=1e-6)


def test_ep_learns_digits(digits):
    torch.manual_seed(0)
    model = ResidualMLP(digits.d_in, 32, 2, 10)
    ep = method_class("ep")(model, MethodSettings(epochs=4, seed=0, trainable_blocks=(0, 1)))
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(4):
        losses.append(sum(float(ep.train_step(x, y)) for x, y in digits.train_batches(128, g)))
        ep.end_epoch()
    assert losses[-1] < 0.6 * losses[0]
    with torch.no_grad():
        acc = float((model(digits.prepare(digits.x_test)).argmax(-1) == digits.y_test).float().mean())
    assert acc > 0.85


def _confident(name="ep", n=512):
    """`name` on a float32 stack whose head is scaled so that most samples are classified with a CE of
    1e-5 … 1e-2: the samples whose trial steps change F_i by less than F_i's rounding error."""
    torch.manual_seed(0)
    model = ResidualMLP(16, 32, 3, 10, w2_std=0.3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=g)
    with torch.no_grad():
        model.out_head.weight.mul_(12.0)
        y = model(x).argmax(-1)
    return model, method_class(name)(model, MethodSettings(epochs=5, seed=0, trainable_blocks=(0, 1, 2))), x, y


def _ulps(model, k: int):
    """Every weight moved by k ulps (towards +inf for even k, −inf for odd: both directions)."""
    with torch.no_grad():
        for p in model.parameters():
            for _ in range(k):
                p.copy_(torch.nextafter(p, torch.full_like(p, (-1) ** k * math.inf)))


@pytest.mark.parametrize("name", ["ep", "pc"])
def test_credit_reproduces_under_rounding(name):
    """Γ from ep's (and pc's) credit is a continuous function of the weights: moving every float32
    weight by 1 … 6 ulps moves Γ by < 1e-4 (the float32 acceptance test flipped whole samples, 1/N
    each), every sample with a reference gets credit (none kept a = 0 by a rounding-decided
    rejection), and one or two torch threads give the same Γ."""
    model, ep, x, y = _confident(name)
    gamma = lambda: gradient_cosine(ep.credit(x, y), bp_gradients(model, x, y).grads)  # noqa: E731
    credit, g = ep.credit(x, y), bp_gradients(model, x, y).grads
    assert all(a.dtype == torch.float32 for a in credit)
    for a, gl in zip(credit, g):
        assert not ((a.flatten(1).norm(dim=-1) == 0) & (gl.flatten(1).norm(dim=-1) > 0)).any()
    base = gamma()
    assert name != "ep" or min(base) > 0.999
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    for k in range(1, 7):
        _ulps(model, k)
        assert max(abs(a - b) for a, b in zip(gamma(), base)) < 1e-4, k
        model.load_state_dict(saved)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = gamma()
    finally:
        torch.set_num_threads(threads)
    assert max(abs(a - b) for a, b in zip(two, base)) < 1e-6


def test_ep_diagnosis_reproduces_across_threads():
    """The whole diagnosis of an EP model, one vs two torch threads: Γ and every flag statistic
    equal to 1e-6 (relative for the norms), the flags and verdicts identical."""
    model, ep, x, y = _confident("ep", 256)
    batches = [(x[i:i + 64], y[i:i + 64]) for i in range(0, 256, 64)]
    threads = torch.get_num_threads()
    reports = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            reports.append(diagnose(model, batches, method=ep, null=False))
    finally:
        torch.set_num_threads(threads)
    one, two = reports
    assert one.flags == two.flags and one.verdict == two.verdict
    for key in ("gamma", "stability"):
        assert max(abs(a - b) for a, b in zip(getattr(one, key), getattr(two, key))) < 1e-6
    for key in ("residual_norms", "bp_grad_norms"):
        assert getattr(one, key) == pytest.approx(getattr(two, key), rel=1e-6)
    for key in ("readout_gain", "max_growth", "stack_growth"):
        assert getattr(one, key) == pytest.approx(getattr(two, key), rel=1e-6)


# -- cb -------------------------------------------------------------------------------------------

def _trained_cb(n_blocks, steps=3):
    model, cb = build("cb", d=24, n_blocks=n_blocks)
    x, y = batch(n=32)
    for _ in range(steps):                          # the EMA target V̄ moves away from V_φ
        cb.train_step(x, y)
    logits, hidden = model(x, return_hidden=True)
    return model, cb, x, y, [h.detach() for h in hidden], output_error(logits.detach(), y)


def test_cb_bridge_target_is_the_softmin_of_the_ema_value():
    model, cb, x, y, hidden, e = _trained_cb(3)
    state = cb.gen.get_state()
    got = cb._bridge_target(hidden, e)
    cb.gen.set_state(state)
    eps = cb._draw_noise(3, hidden[0])                                       # (K, L, D)
    k, tau = eps.shape[0], float(cb.opts["tau"])
    want = []
    for l in range(3):
        h = hidden[l + 1]
        sigma = cb.opts["noise"] * h.pow(2).mean(-1, keepdim=True).sqrt()
        depth = torch.full((len(y),), l + 1)
        v = torch.stack([cb.value(cb.target, h + sigma * eps[j, l], depth, e) for j in range(k)])
        want.append(-tau * (torch.logsumexp(-v / tau, 0) - math.log(k)))
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n_blocks", [3, 1, 0])
def test_cb_closed_form_matches_the_autograd_definition(n_blocks):
    """Credit = ∇_h V_φ and the aux gradient = that of bridge + terminal loss by create_graph."""
    model, cb, x, y, hidden, e = _trained_cb(n_blocks)
    n = len(y)
    state = cb.gen.get_state()
    credit, grads, loss = cb._value_pass(hidden, e, y, True)
    cb.gen.set_state(state)
    h, depth, s = cb._inputs(hidden, e, list(range(n_blocks + 1)))
    h = h.requires_grad_(True)
    v = cb.value(cb.aux, h, depth, s)
    grad_v = torch.autograd.grad(v.sum(), h, create_graph=True)[0]
    _, grad_last = ce_gradient(model.readout, hidden[-1], y, reduction="none")
    ref = (grad_v[n_blocks * n:] - grad_last).pow(2).sum() / grad_last.pow(2).sum()
    if n_blocks:
        ref = ref + (v[:n_blocks * n] - cb._bridge_target(hidden, e)).pow(2).mean()
    names = [name for name, _ in cb.aux.named_parameters()]
    want = torch.autograd.grad(ref, list(cb.aux.parameters()), allow_unused=True)
    for a, b in zip(credit, grad_v.detach().chunk(n_blocks + 1)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
    assert float(loss) == pytest.approx(float(ref.detach()), rel=1e-12)
    for name, w in zip(names, want):
        w = torch.zeros_like(grads[name]) if w is None else w
        torch.testing.assert_close(grads[name], w, rtol=1e-9, atol=1e-13, msg=name)
    torch.testing.assert_close(cb.credit(x, y)[0], credit[0])


def test_cb_train_step_uses_the_closed_form_gradient():
    """One train_step = AdamW on exactly the closed-form gradient, then the EMA of V̄."""
    model, cb, x, y, hidden, e = _trained_cb(2, steps=1)
    before = {k: v.clone() for k, v in cb.aux.state_dict().items()}
    target_before = {k: v.clone() for k, v in cb.target.state_dict().items()}
    model_before = {k: v.clone() for k, v in model.state_dict().items()}
    state = cb.gen.get_state()
    cb.train_step(x, y)
    grads = {name: p.grad.clone() for name, p in cb.aux.named_parameters()}
    after, target_after = cb.aux.state_dict(), cb.target.state_dict()
    ema = cb.opts["ema"]
    for name, p in target_after.items():                                   # V̄ ← ema·V̄ + (1−ema)·V
        torch.testing.assert_close(p, ema * target_before[name] + (1 - ema) * after[name])
    cb.gen.set_state(state)
    cb.aux.load_state_dict(before)
    cb.target.load_state_dict(target_before)
    model.load_state_dict(model_before)                                     # the head moved too
    _, want, loss = cb._value_pass(hidden, e, y, True)
    assert cb.last_aux_loss == pytest.approx(float(loss))
    for name in grads:
        torch.testing.assert_close(grads[name], want[name])


def test_cb_learns_terminal_gradient(digits):
    torch.manual_seed(0)
    model = ResidualMLP(digits.d_in, 32, 2, 10)
    cb = method_class("cb")(model, MethodSettings(epochs=10, seed=0, trainable_blocks=(0, 1)))
    x, y = digits.eval_batch(0)
    before = sample_cos(cb.credit(x, y)[-1], bp_gradients(model, x, y).grads[-1]).mean()
    g = torch.Generator().manual_seed(0)
    for _ in range(7):
        for xb, yb in digits.train_batches(128, g):
            cb.train_step(xb, yb)
    after = sample_cos(cb.credit(x, y)[-1], bp_gradients(model, x, y).grads[-1]).mean()
    assert after > 0.9 and after > before


# -- any residual-stream shape ----------------------------------------------------------------------

class TokenBranch(nn.Module):
    """A residual branch on a (N, 3, 4) token stream that mixes tokens and features."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(4)
        self.mix = nn.Linear(3, 3)
        self.fc = nn.Linear(4, 4)
        nn.init.normal_(self.fc.weight, std=0.3)

    def forward(self, h):
        return self.fc(torch.tanh(self.mix(self.ln(h).transpose(1, 2)).transpose(1, 2)))


class TokenNet(ResidualModel):
    def __init__(self, d_in=8, n_classes=5, n_blocks=2):
        super().__init__()
        self.n_classes, self.stream_shape = n_classes, (3, 4)
        self.embed = nn.Linear(d_in, 12)
        self.blocks = nn.ModuleList(TokenBranch() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, n_classes)

    def embed_input(self, x):
        return self.embed(x.flatten(1)).view(-1, 3, 4)

    def readout(self, h_last):
        return self.head(self.norm(h_last).mean(1))

    def embed_parameters(self):
        return list(self.embed.parameters())

    def head_parameters(self):
        return list(self.norm.parameters()) + list(self.head.parameters())


def token_data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x @ torch.randn(8, 5, generator=g)).argmax(-1)                     # learnable labels
    return x, y


@pytest.mark.parametrize("name", ["ep", "sb", "cb"])
def test_token_stream(name):
    torch.manual_seed(0)
    model = TokenNet()
    method = method_class(name)(model, MethodSettings(epochs=1, seed=0, lr=1e-2, trainable_blocks=(0, 1)))
    x, y = token_data()
    credit = method.credit(x, y)
    assert len(credit) == 3
    assert all(a.shape == (64, 3, 4) and torch.isfinite(a).all() for a in credit)
    with torch.no_grad():
        start = float(F.cross_entropy(model(x), y))
    blocks_before = [p.detach().clone() for p in model.blocks.parameters()]
    for _ in range(30):
        assert torch.isfinite(method.train_step(x, y))
    with torch.no_grad():
        end = float(F.cross_entropy(model(x), y))
    assert end < 0.8 * start, (start, end)
    assert any(not torch.equal(p, q) for p, q in zip(model.blocks.parameters(), blocks_before))
    if name == "ep":                   # relaxed (1 = the free state); this toy's LN over 4 features
        assert 0 <= method.epoch_log()["ep_residual"] < 1    # is far stiffer than the ResMLP's


def test_token_stream_ep_tends_to_bp():
    torch.manual_seed(0)
    model = TokenNet().double()
    ep = method_class("ep")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1), options=SMALL_BETA))
    x, y = token_data()
    x = x.double()
    for a, g in zip(ep.credit(x, y), bp_gradients(model, x, y).grads):
        assert a.shape == g.shape == (64, 3, 4)
        assert sample_cos(a, g).min() > 0.99


def test_token_stream_cb_closed_form():
    torch.manual_seed(0)
    model = TokenNet().double()
    cb = method_class("cb")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1)))
    x, y = token_data()
    x = x.double()
    logits, hidden = model(x, return_hidden=True)
    e = output_error(logits.detach(), y)
    hidden = [h.detach() for h in hidden]
    credit, _, _ = cb._value_pass(hidden, e, y, True)
    for l, a in enumerate(credit):
        h = hidden[l].requires_grad_(True)
        v = cb.value(cb.aux, h.flatten(1), torch.full((64,), l), e)
        want = torch.autograd.grad(v.sum(), h)[0]
        assert a.shape == (64, 3, 4)
        torch.testing.assert_close(a, want)
