"""Issue 24, part B: local-loss, pepita and pc (with iPC). Each update against a hand computation in
float64 (2 blocks of width 4: every gradient written out as outer products of errors and inputs,
LayerNorm and GELU derivatives by their formulas), PC ≈ BP in the weak-nudge limit, pc = ep at the
same equilibrium, frozen blocks, resume and same-seed runs, the CLI and a tiny audit. The properties
every method has (ladder, frozen/shallow controls, state round trip, it learns digits, the step
compiles) come from the registry-driven tests in test_methods.py and test_compile.py."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from creditaudit import store
from creditaudit.cli import main as cli_main
from creditaudit.config import RunConfig
from creditaudit.data import load_dataset
from creditaudit.experiments import read_audit
from creditaudit.methods import MethodSettings, method_class
from creditaudit.metrics import bp_gradients
from creditaudit.model import ResidualMLP
from creditaudit.runs import load_run
from creditaudit.train import train_run
from test_train import _metrics_without_time, _same_weights

N, D_IN, WIDTH, C = 6, 5, 4, 3
TOL = dict(rtol=1e-10, atol=1e-12)


def setup(name, options=None, trainable=(0, 1), seed=0, **settings):
    torch.manual_seed(seed)
    model = ResidualMLP(D_IN, WIDTH, 2, C, w2_std=0.3).double()
    settings = MethodSettings(epochs=3, seed=seed, trainable_blocks=trainable, options=dict(options or {}),
                              **{"clip": 1e9, **settings})        # no clipping: the raw update
    return model, method_class(name)(model, settings)


def data(seed=1, n=N):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D_IN, generator=g, dtype=torch.float64), torch.randint(0, C, (n,), generator=g)


# -- the hand computation --------------------------------------------------------------------------
def ln(h):
    """Parameter-free LayerNorm and its σ: z = (h − mean)/σ, σ = √(var + 1e-5)."""
    mu = h.mean(-1, keepdim=True)
    sigma = ((h - mu).pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    return (h - mu) / sigma, sigma


def ln_back(h, g):
    """(∂z/∂h)ᵀ g = (g − mean(g) − z·mean(g⊙z))/σ."""
    z, sigma = ln(h)
    return (g - g.mean(-1, keepdim=True) - z * (g * z).mean(-1, keepdim=True)) / sigma


def gelu_prime(v):
    return 0.5 * (1 + torch.erf(v / math.sqrt(2))) + v * torch.exp(-v * v / 2) / math.sqrt(2 * math.pi)


def block_parts(block, h):
    """f(h) = W2 gelu(W1 (γ⊙z + b) + b1) + b2, with its intermediate values."""
    z, _ = ln(h)
    u = z * block.ln.weight + block.ln.bias
    v = u @ block.w1.weight.T + block.w1.bias
    s = 0.5 * v * (1 + torch.erf(v / math.sqrt(2)))
    return z, u, v, s, s @ block.w2.weight.T + block.w2.bias


def block_back(block, h, g):
    """Σ_i g_i · ∂f(h_i)/∂θ for every parameter (named like the block's), and (∂f/∂h)ᵀ g."""
    z, u, v, s, _ = block_parts(block, h)
    g_s = g @ block.w2.weight
    g_v = g_s * gelu_prime(v)
    g_u = g_v @ block.w1.weight
    grads = {"w2.weight": g.T @ s, "w2.bias": g.sum(0), "w1.weight": g_v.T @ u, "w1.bias": g_v.sum(0),
             "ln.weight": (g_u * z).sum(0), "ln.bias": g_u.sum(0)}
    return grads, ln_back(h, g_u * block.ln.weight)


def readout_back(model, h, y):
    """The mean CE of readout(h): its parameter gradients (out_ln, out_head) and ∂CE/∂h."""
    z, _ = ln(h)
    u = z * model.out_ln.weight + model.out_ln.bias
    logits = u @ model.out_head.weight.T + model.out_head.bias
    g = (logits.softmax(-1) - F.one_hot(y, C).double()) / len(y)                     # ∂CE/∂logits
    g_u = g @ model.out_head.weight
    grads = {"out_head.weight": g.T @ u, "out_head.bias": g.sum(0),
             "out_ln.weight": (g_u * z).sum(0), "out_ln.bias": g_u.sum(0)}
    return grads, ln_back(h, g_u * model.out_ln.weight)


def forward(model, h0):
    hs = [h0]
    for block in model.blocks:
        hs.append(hs[-1] + block_parts(block, hs[-1])[-1])
    return hs


def expected(model, x, y, a, inputs, h_top, per_sample=True):
    """The gradients of the local update on credit a_0 … a_L: block l from a_{l+1} at the state
    inputs[l] it sees, the embedding from a_0, the head from the CE at h_top. per_sample: a is in
    ∂ℓ_i/∂h units and the local loss is a batch mean (÷N); else a sum (a in mean-CE units)."""
    k = 1 / len(y) if per_sample else 1.0
    want = {"embed.weight": k * a[0].T @ x, "embed.bias": k * a[0].sum(0)}
    for l, block in enumerate(model.blocks):
        grads, _ = block_back(block, inputs[l], k * a[l + 1])
        want.update({f"blocks.{l}.{n}": g for n, g in grads.items()})
    want.update(readout_back(model, h_top, y)[0])
    return want


def assert_grads(model, want):
    got = {n: p.grad for n, p in model.named_parameters()}
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=n)


def sim_loss_by_loops(z, y):
    """Nøkland & Eidnes' L_sim = mean_{i,j} (S(z)_{ij} − S(Y)_{ij})², pair by pair: S the cosine of
    each sample centred over its own features (their ε = 1e-8 on the norms); for the one-hot targets
    Y that is 1 within a class and (0 − 2/C + 1/C)/(1 − 1/C) = −1/(C − 1) across classes."""
    def cos(a, b):
        a, b = a - a.mean(), b - b.mean()
        return (a * b).sum() / (((a * a).sum().sqrt() + 1e-8) * ((b * b).sum().sqrt() + 1e-8))
    onehot = F.one_hot(y, C).double()
    total = 0.0
    for i in range(len(y)):
        for j in range(len(y)):
            target = cos(onehot[i], onehot[j])
            assert abs(float(target) - (1.0 if y[i] == y[j] else -1.0 / (C - 1))) < 1e-7
            total = total + (cos(z[i], z[j]) - target) ** 2
    return total / len(y) ** 2


# -- local-loss ------------------------------------------------------------------------------------
@pytest.mark.parametrize("sim", [0.0, 0.3, 0.99])
def test_local_loss_update_is_the_aux_classifiers_gradient(sim):
    model, method = setup("local-loss", {"sim": sim})
    x, y = data()
    hs = forward(model, x @ model.embed.weight.T + model.embed.bias)
    with torch.no_grad():
        hs = [h.detach() for h in hs]
    a, aux_want = [], {}
    for l, head in enumerate(method.aux):                  # aux head l at h_l, l = 0 … L−1
        z, _ = ln(hs[l])
        e = (z @ head.weight.T + head.bias).softmax(-1) - F.one_hot(y, C).double()
        aux_want[f"{l}.weight"] = (1 - sim) * e.T @ z / N                      # ∂CE/∂A = eᵀz/N
        aux_want[f"{l}.bias"] = (1 - sim) * e.sum(0) / N
        credit = (1 - sim) * ln_back(hs[l], e @ head.weight)                     # N·∂ℓ_aux/∂h
        if sim:
            leaf = hs[l].clone().requires_grad_(True)
            (g,) = torch.autograd.grad(sim_loss_by_loops(ln(leaf)[0], y), leaf)
            credit = credit + sim * N * g
        a.append(credit)
    a.append(N * readout_back(model, hs[-1], y)[1])                             # a_L: the readout
    method.clear_gradients()
    method.gradients(x, y)
    assert_grads(model, expected(model, x, y, a, hs[:-1], hs[-1]))
    for n, p in method.aux.named_parameters():
        torch.testing.assert_close(p.grad, aux_want[n], **TOL, msg=n)
    for got, want in zip(method.credit(x, y), a):
        torch.testing.assert_close(got, want, **TOL)


def test_predsim_loss_is_nokland_and_eidnes_formula():
    """predsim (β = 0.99, as published): ℓ = 0.01 · CE(A z + c, y) + 0.99 · mse(S(z), S(onehot(y))),
    S the adjusted cosine similarity matrix, each row centred before normalising (their
    `similarity_matrix`); computed here with numpy-style sums, independently of the method."""
    model, method = setup("local-loss", {"sim": 0.99})
    g = torch.Generator().manual_seed(4)
    h = torch.randn(N, WIDTH, generator=g, dtype=torch.float64) * 3 + 1
    y = torch.tensor([0, 1, 1, 2, 0, 0])
    z = (h - h.mean(-1, keepdim=True)) / (h.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    head = method.aux[0]
    p = (z @ head.weight.T + head.bias).detach()
    ce = -(p.log_softmax(-1)[torch.arange(N), y]).mean()
    yc = F.one_hot(y, C).double() - 1.0 / C
    yn = yc / (yc.norm(dim=1, keepdim=True) + 1e-8)
    zc = z - z.mean(1, keepdim=True)
    zn = zc / (zc.norm(dim=1, keepdim=True) + 1e-8)                             # their ε
    sim = ((zn @ zn.T - yn @ yn.T) ** 2).sum() / N ** 2
    assert abs(float((yn @ yn.T)[0, 1]) + 1 / (C - 1)) < 1e-7                # across classes: −1/(C − 1)
    want = 0.01 * ce + 0.99 * sim
    torch.testing.assert_close(method._aux_loss(0, h, y).detach(), want, **TOL)
    torch.testing.assert_close(sim_loss_by_loops(z, y), sim, **TOL)


# -- pepita ----------------------------------------------------------------------------------------
def pepita_passes(model, method, x, y, scale):
    """Both passes of PEPITA written out: e from the clean forward, the modulated forward from
    h_0 + F·e (F = scale·B), and every block's units u = gelu(W1 LN(h) + b1) in both."""
    with torch.no_grad():
        h0 = x @ model.embed.weight.T + model.embed.bias
        clean = forward(model, h0)
        z, _ = ln(clean[-1])
        logits = (z * model.out_ln.weight + model.out_ln.bias) @ model.out_head.weight.T + model.out_head.bias
        e = logits.softmax(-1) - F.one_hot(y, C).double()
        mod = forward(model, h0 + scale * e @ method.feedback.T)                # h_0 + F·e, F = scale·B
    return clean, mod, e


def test_pepita_trains_every_block_layer_by_the_papers_rule():
    """Dellaferrera & Kreiman's ΔW_l = mean_i (h_l − h_l^mod)_i ⊗ (h_{l−1}^mod)_i, layer by layer:
    W1's layer activity is its units u = gelu(W1 LN(h) + b1), its input LN(h^mod); W2's activity is
    the stream h_{l+1}, its input u^mod. The reference's step: nothing divided by scale, no bias
    update (the reference has no biases), no clip. No backward pass inside the block."""
    scale = 0.2
    model, method = setup("pepita", {"scale": scale})
    x, y = data()
    clean, mod, e = pepita_passes(model, method, x, y, scale)
    a = [c - m for c, m in zip(clean, mod)]
    torch.testing.assert_close(a[0], -scale * e @ method.feedback.T, **TOL)     # a_0 = −F·e
    method.clear_gradients()
    method.gradients(x, y)
    want = {"embed.weight": a[0].T @ x / N}                                     # no embed bias update
    want.update(readout_back(model, clean[-1], y)[0])                           # the head: true CE
    for l, block in enumerate(model.blocks):
        with torch.no_grad():
            z_mod = ln(mod[l])[0] * block.ln.weight + block.ln.bias             # W1's modulated input
            u_mod = F.gelu(z_mod @ block.w1.weight.T + block.w1.bias)            # W1's modulated units
            z = ln(clean[l])[0] * block.ln.weight + block.ln.bias
            u = F.gelu(z @ block.w1.weight.T + block.w1.bias)
        du = u - u_mod
        dh = clean[l + 1] - mod[l + 1]
        want.update({f"blocks.{l}.w1.weight": du.T @ z_mod / N, f"blocks.{l}.w2.weight": dh.T @ u_mod / N})
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want)                                # the LayerNorm and the biases: no update
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=n)
    for got_a, w in zip(method.credit(x, y), a):
        torch.testing.assert_close(got_a, w, **TOL)
    fresh = method.fresh_feedback_credit(x, y, torch.Generator().manual_seed(9))
    assert not torch.allclose(fresh[0], a[0])                                   # the null redraws B


def test_pepita_step_is_not_clipped():
    """The reference clips nothing: rule "pepita" leaves settings.clip aside (a clip of 1e-9 gives
    the same gradients as none)."""
    x, y = data()
    grads = []
    for clip in (1e9, 1e-9):
        model, method = setup("pepita", clip=clip)
        method.clear_gradients()
        method.gradients(x, y)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n
    assert max(float(g.norm()) for n, g in grads[0].items() if n.startswith("blocks")) > 1e-6


def test_pepita_backprop_rule_is_the_local_loss_through_the_block():
    """rule = "backprop" (not PEPITA): W1 and the LayerNorm by backprop of a_{l+1} through W2."""
    scale = 0.2
    model, method = setup("pepita", {"scale": scale, "rule": "backprop"})
    x, y = data()
    clean, mod, _ = pepita_passes(model, method, x, y, scale)
    a = [c - m for c, m in zip(clean, mod)]
    method.clear_gradients()
    method.gradients(x, y)
    assert_grads(model, expected(model, x, y, a, mod[:-1], clean[-1]))         # presynaptic: modulated


def test_pepita_feedback_has_the_published_scale():
    """F = 0.05 · U(±√(6/D)) as in the reference code: B's entries lie within ±√(6/D) and fill it."""
    torch.manual_seed(0)
    model = ResidualMLP(D_IN, 256, 2, 10)
    method = method_class("pepita")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1)))
    bound = math.sqrt(6 / 256)
    assert method.scale == 0.05
    assert method.feedback.abs().max() <= bound and method.feedback.abs().max() > 0.99 * bound
    assert abs(method.feedback.std().item() - bound / math.sqrt(3)) < 0.05 * bound


def test_pepita_rule_refuses_blocks_it_is_not_written_for():
    from creditaudit.errors import CreditAuditError
    from creditaudit.model import build_model
    model = build_model("vit-mini", input_shape=(3, 8, 8), n_classes=C, width=16, blocks=1)
    with pytest.raises(CreditAuditError, match='rule = "backprop"'):
        method_class("pepita")(model, MethodSettings(epochs=1, trainable_blocks=(0,)))
    method_class("pepita")(model, MethodSettings(epochs=1, trainable_blocks=(0,), options={"rule": "backprop"}))


# -- pc / iPC --------------------------------------------------------------------------------------
def pc_by_hand(model, x, y, beta, alpha, steps):
    """The PC inference by its equations: h_l ← h_l − α ∂F/∂h_l, then ε, a and the update's gradients."""
    h0 = x @ model.embed.weight.T + model.embed.bias
    hs = forward(model, h0)
    for _ in range(steps):
        eps = [hs[l + 1] - hs[l] - block_parts(b, hs[l])[-1] for l, b in enumerate(model.blocks)]
        grad = [eps[0] - eps[1] - block_back(model.blocks[1], hs[1], eps[1])[1],           # ∂F/∂h_1
                eps[1] + beta * readout_back(model, hs[2], y)[1]]                          # ∂F/∂h_2
        hs = [hs[0], hs[1] - alpha * grad[0], hs[2] - alpha * grad[1]]
    eps = [hs[l + 1] - hs[l] - block_parts(b, hs[l])[-1] for l, b in enumerate(model.blocks)]
    a = [-e / beta for e in eps]
    a = [a[0] + block_back(model.blocks[0], hs[0], a[0])[1]] + a                          # (I + J_0)ᵀ a_1
    return a, expected(model, x, y, a, hs[:-1], hs[-1], per_sample=False)


def test_pc_update_and_credit_by_hand():
    beta, alpha, steps = 0.5, 0.3, 3
    model, method = setup("pc", {"beta": beta, "alpha": alpha, "steps": steps})
    x, y = data()
    with torch.no_grad():
        a, want = pc_by_hand(model, x, y, beta, alpha, steps)
    method.clear_gradients()
    method.gradients(x, y)
    assert_grads(model, want)
    for got, w in zip(method.credit(x, y), a):
        torch.testing.assert_close(got, w, **TOL)
    method.apply_gradients()
    assert 0 < method.epoch_log()["pc_residual"] < 1                            # partly relaxed


def test_ipc_updates_the_weights_at_every_inference_step():
    beta, alpha, steps = 0.5, 0.3, 3
    model, method = setup("pc", {"beta": beta, "alpha": alpha, "steps": steps, "incremental": 1})
    assert not method.compilable()
    twin = copy.deepcopy(model)
    # plain SGD on both sides: at the feed-forward states every ε is 0 up to rounding, and AdamW
    # would blow that rounding (which differs between two implementations) up to lr-sized steps
    method.optimizers = [torch.optim.SGD(model.parameters(), lr=0.2)]
    opt = torch.optim.SGD(twin.parameters(), lr=0.2)
    x, y = data()
    with torch.no_grad():
        hs = forward(twin, x @ twin.embed.weight.T + twin.embed.bias)
        for _ in range(steps):        # one evaluation → a weight step (at the old θ) and a state step
            h0 = x @ twin.embed.weight.T + twin.embed.bias
            hs = [h0] + hs[1:]
            eps = [hs[l + 1] - hs[l] - block_parts(b, hs[l])[-1] for l, b in enumerate(twin.blocks)]
            grad = [eps[0] - eps[1] - block_back(twin.blocks[1], hs[1], eps[1])[1],
                    eps[1] + beta * readout_back(twin, hs[2], y)[1]]
            a = [-e / beta for e in eps]
            a = [a[0] + block_back(twin.blocks[0], hs[0], a[0])[1]] + a
            want = expected(twin, x, y, a, hs[:-1], hs[-1], per_sample=False)
            for n, p in twin.named_parameters():
                p.grad = want[n].clone()
            opt.step()
            hs = [hs[0], hs[1] - alpha * grad[0], hs[2] - alpha * grad[1]]
    method.train_step(x, y)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=n)


def test_ipc_credit_is_that_of_the_inference_ipc_trains_with():
    """iPC takes fixed steps of length α (train_step); its audited credit must come from those
    steps, not from plain pc's trial steps, which here reject steps iPC takes (α = 1) and would
    report a credit iPC never uses."""
    beta, alpha, steps = 0.5, 1.0, 5
    model, ipc = setup("pc", {"beta": beta, "alpha": alpha, "steps": steps, "incremental": 1})
    _, plain = setup("pc", {"beta": beta, "alpha": alpha, "steps": steps})
    x, y = data()
    with torch.no_grad():
        a, _ = pc_by_hand(model, x, y, beta, alpha, steps)
    for got, w in zip(ipc.credit(x, y), a):
        torch.testing.assert_close(got, w, **TOL)
    assert max(float((p - w).abs().max()) for p, w in zip(plain.credit(x, y), a)) > 1.0


def test_pc_credit_tends_to_the_bp_gradient_at_weak_nudge():
    """Whittington & Bogacz: at equilibrium and small β, the prediction errors are BP's gradients."""
    torch.manual_seed(3)
    model = ResidualMLP(D_IN, 8, 3, C, w2_std=0.3).double()
    method = method_class("pc")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1, 2),
                                                      options={"beta": 1e-4, "steps": 300, "alpha": 0.5}))
    x, y = data(n=16)
    g = bp_gradients(model, x, y).grads
    for l, (a, b) in enumerate(zip(method.credit(x, y), g)):
        cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
        assert float(cos.min()) > 0.99, (l, cos)
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05 * float(b.abs().max()))


def test_a_pc_inference_step_that_raises_a_samples_energy_is_rejected():
    """With blocks whose Jacobians make α = 0.5 unstable (plain steps: residual ~1e6 after 300
    steps on this model), the masked steps never raise any F_i and the credit stays aligned."""
    torch.manual_seed(3)
    model = ResidualMLP(D_IN, 8, 3, C, w2_std=0.5).double()
    method = method_class("pc")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1, 2),
                                                      options={"beta": 1e-4, "steps": 100, "alpha": 0.5}))
    x, y = data(n=16)
    h0 = model.embed_input(x).detach()
    states, _, _ = method.infer(h0, y)
    free = method.evaluate(h0, method._free(h0)[0], y, [])[1]
    relaxed = method.evaluate(h0, states, y, [])[1]
    assert bool((relaxed <= free).all()) and bool((relaxed < free).any())
    g = bp_gradients(model, x, y).grads
    for a, b in zip(method.credit(x, y), g):
        assert float(((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))).min()) > 0.8


def test_pc_and_ep_agree_at_the_same_equilibrium():
    """On this energy EP's estimator keeps only its nudged term: at one equilibrium the two rules
    give the same credit and the same update."""
    opts = {"beta": 0.5}
    model, pc = setup("pc", {**opts, "steps": 400, "alpha": 0.5})
    twin = copy.deepcopy(model)
    ep = method_class("ep")(twin, MethodSettings(epochs=3, trainable_blocks=(0, 1), options={**opts, "steps": 40}))
    x, y = data()
    for a, b in zip(pc.credit(x, y), ep.credit(x, y)):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)
    pc.gradients(x, y), ep.gradients(x, y)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9, msg=n)


# -- controls, resume, seeds -----------------------------------------------------------------------
@pytest.mark.parametrize("name, options", [("local-loss", {"sim": 0.99}), ("pc", {"incremental": 1, "steps": 2})])
def test_frozen_blocks_stay_bit_identical_under_the_non_default_variants(name, options):
    model, method = setup(name, options, trainable=(1,))
    frozen = [p.clone() for p in model.blocks[0].parameters()]
    trained = [p.clone() for p in model.blocks[1].parameters()]
    for s in range(2):
        method.train_step(*data(seed=s))
    assert all(torch.equal(a, b) for a, b in zip(frozen, model.blocks[0].parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(trained, model.blocks[1].parameters()))


@pytest.fixture(scope="module")
def synthetic():
    return load_dataset("synthetic")


@pytest.mark.parametrize("name, options", [("local-loss", {"sim": 0.99}), ("pepita", {}), ("pc", {"steps": 3}),
                                           ("pc", {"steps": 2, "incremental": 1})])
def test_resume_after_kill_equals_the_uninterrupted_run(name, options, tmp_path, synthetic, monkeypatch, every_epoch):
    """The killed run trains its first epochs afresh from the seed, the rest after resuming: its
    whole metrics history and final weights equal the uninterrupted run's, so one seed gives one run."""
    config = RunConfig(method=name, options=options, dataset="synthetic", width=16, blocks=2, epochs=3,
                       batch_size=128)
    whole = train_run(config, tmp_path / "whole", data=synthetic, progress=False)
    real_save = store.save_checkpoint

    def save_then_die(run_dir, epoch, state, meta, config):
        real_save(run_dir, epoch, state, meta, config)
        if epoch == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(store, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_run(config, tmp_path / "killed", data=synthetic, progress=False)
    monkeypatch.setattr(store, "save_checkpoint", real_save)
    resumed = train_run(config, tmp_path / "killed", data=synthetic, progress=False)
    assert resumed.status["status"] == "finished"
    assert _metrics_without_time(resumed.history) == _metrics_without_time(whole.history)
    assert _same_weights(resumed.model, whole.model)


# -- end to end --------------------------------------------------------------------------------------
def test_each_trains_on_digits_from_the_cli_and_a_tiny_audit_measures_its_credit(tmp_path, capsys):
    names = ["local-loss", "pepita", "pc"]
    for name in names:
        out = tmp_path / name
        assert cli_main(["train", "--method", name, "--dataset", "digits", "--width", "16", "--blocks", "2",
                         "--epochs", "1", "--quiet", "--device", "cpu", "--threads", "1", "--out", str(out)]) == 0
        run = load_run(out)
        assert run.status["status"] == "finished" and run.config.method == name
    toml = tmp_path / "tiny.toml"
    toml.write_text(f'dataset = "digits"\nmethods = {names!r}\nseeds = [1]\nepochs = 1\njobs = 1\neval_batches = 2\n'
                    f'out = "{tmp_path / "audit"}"\n[model]\nwidth = 16\nblocks = 2\n'.replace("'", '"'))
    assert cli_main(["audit", "--config", str(toml), "--quiet", "--device", "cpu"]) in (0, 1, 3)
    result = read_audit(tmp_path / "audit")
    assert {r["status"] for r in result["runs"]} == {"finished"}
    methods = {m["method"]: m for m in result["methods"]}
    assert set(methods) == set(names)
    for name, m in methods.items():             # Γ at every position, and its null for pepita's B only
        assert len(m["gamma_layers"]) == 3 and all(math.isfinite(g) for g in m["gamma_layers"]), name
        assert (m["null_deep_mean"] is not None) == (name == "pepita"), name
