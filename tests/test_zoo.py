"""The zoo's rules (issue 24): sign-symmetry, Kolen–Pollack, DRTP and node perturbation. Each update
against an independent computation in float64 on a 2-block width-4 ResMLP, the properties that make
their audit mean something (frozen blocks stay put, resume is bit-identical, the step compiles
whole — tests/test_compile.py and tests/test_methods.py take them from the registry, a seed's
draws are the CPU generator's whatever the device, node perturbation's noisy pass leaves BatchNorm's
statistics alone), and the rules table of docs/RULES.md against the function that renders it."""
from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from creditaudit import store
from creditaudit.cli import main as cli_main
from creditaudit.config import RunConfig, audit_config_from_dict, load_audit_toml
from creditaudit.errors import CreditAuditError
from creditaudit.methods import METHODS, SHARED_RECIPE, MethodSettings, Recipe, method_class
from creditaudit.methods.fa import routed_modules
from creditaudit.methods.signsym import xavier
from creditaudit.model import ResidualMLP, build_model
from creditaudit.model.resmlp import ACTIVATIONS
from creditaudit.report import recipe_comparison, rules_table
from creditaudit.seeding import derived_generator, derived_seed, draw_on_host, from_one_state

ROOT = Path(__file__).resolve().parents[1]
SIGN, KP, DRTP, NP = "sign-symmetry", "kolen-pollack", "drtp", "node-perturbation"
ZOO = (SIGN, KP, DRTP, NP)


def build(name, trainable=(0, 1), options=None, lr=0.0, seed=0, n_blocks=2, **settings):
    """A float64 ResMLP (3 → 4, 2 blocks, non-trivial W2) and the method `name`."""
    torch.manual_seed(seed)
    model = ResidualMLP(3, 4, n_blocks, 5, w2_std=0.5).double()
    settings = MethodSettings(epochs=2, seed=seed, lr=lr, trainable_blocks=trainable,
                              options=dict(options or {}), **settings)
    return model, method_class(name)(model, settings)


def batch(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g)


def routed_grads(model, x, y, feedback):
    """∂CE/∂θ with every block Linear's input error carried by B instead of W, written out
    independently of fa.py: x·Wᵀ + b where the x-path is (x − x̄)·Bᵀ (value 0, gradient δ·B) and
    the W-path sees x̄ = x.detach() (gradient δᵀx)."""
    def linear(h, module, b):
        return F.linear(h.detach(), module.weight, module.bias) + (h - h.detach()) @ b.T
    h = model.embed_input(x)
    for block, fb in zip(model.blocks, feedback):
        act = ACTIVATIONS[block.activation]
        h = h + linear(act(linear(block.ln(h), block.w1, fb["w1"])), block.w2, fb["w2"])
    loss = F.cross_entropy(model.readout(h), y)
    return dict(zip([k for k, _ in model.named_parameters()],
                    torch.autograd.grad(loss, list(model.parameters()))))


def assert_grads(model, expected):
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-10, atol=1e-12, msg=name)


# -- sign-symmetry ---------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["usf", "brsf", "frsf"])
def test_sign_symmetry_update_is_fa_through_magnitude_times_sign(variant):
    model, method = build(SIGN, options={"variant": variant})
    x, y = batch()
    s, a = xavier(model.blocks[0].w1.weight)                      # 4 × 4: s = 1/2, a = √(6/8)
    assert (s, a) == (0.5, math.sqrt(6 / 8))
    before = [{k: m.clone() for k, m in mags.items()} for mags in method.magnitude]
    method.train_step(x, y)                                      # lr = 0: W stays, B is the step's
    for block, mags, old in zip(model.blocks, method.magnitude, before):
        for name in ("w1", "w2"):
            m = mags[name]
            if variant == "usf":
                assert torch.equal(m, torch.full_like(m, 0.5))
            else:
                assert float(m.min()) >= 0 and float(m.max()) <= a
            assert torch.equal(m, old[name]) == (variant != "brsf")     # brSF redraws per step
    feedback = [{name: torch.sign(getattr(block, name).weight.detach()) * mags[name]
                 for name in ("w1", "w2")} for block, mags in zip(model.blocks, method.magnitude)]
    assert_grads(model, routed_grads(model, x, y, feedback))
    assert method.random_feedback == (variant == "frsf")


def test_sign_symmetry_feedback_follows_the_current_signs():
    """With lr > 0 the weights change; the next step's B is M ∘ sign(W) of the new weights."""
    model, method = build(SIGN, options={"variant": "frsf"}, lr=0.5)
    for s in range(3):
        method.train_step(*batch(seed=s))
    x, y = batch(seed=9)
    own = method.credit(x, y)                                    # B rebuilt from the weights now
    for block, fb, mags in zip(model.blocks, method.feedback, method.magnitude):
        for name in ("w1", "w2"):
            torch.testing.assert_close(fb[name], torch.sign(getattr(block, name).weight) * mags[name],
                                       rtol=0, atol=0)
    fresh = method.fresh_feedback_credit(x, y, torch.Generator().manual_seed(3))
    torch.testing.assert_close(fresh[-1], own[-1])               # a_L = g_L under any feedback
    assert not torch.allclose(fresh[0], own[0])                  # new magnitudes below it


def test_sign_symmetry_brsf_compiles_whole():
    """tests/test_compile.py compiles the default (uSF) step; brSF's per-step draw happens in
    `prepare_step`, so its step compiles to one graph too (fullgraph, no recompile) and gives the
    eager update (frSF's step is uSF's with other magnitudes)."""
    variant = "brsf"
    torch._dynamo.reset()
    (model, eager), (twin, compiled) = (build(SIGN, options={"variant": variant}, lr=0.05)
                                        for _ in range(2))
    step = compiled.step_function(backend="eager")
    for i in range(3):
        x, y = batch(seed=i)
        want = eager.train_step(x, y)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = step(x, y)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for (k, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=k)


def test_variant_is_a_checked_string_option_from_toml_and_cli(tmp_path, capsys):
    with pytest.raises(CreditAuditError, match="variant.*usf, brsf, frsf"):
        method_class(SIGN).resolve_options({"variant": "xsf"})
    with pytest.raises(CreditAuditError, match="variant"):
        method_class(SIGN).resolve_options({"variant": 1})
    toml = tmp_path / "a.toml"
    toml.write_text(f'dataset = "digits"\nmethods = ["{SIGN}"]\nepochs = 1\n'
                    f'[options.{SIGN}]\nvariant = "brsf"\n')
    config = audit_config_from_dict(load_audit_toml(toml))
    runs = config.run_configs()
    assert {r.options["variant"] for r in runs if r.method == SIGN} == {"brsf"}   # (bp: the yardstick)
    assert RunConfig(method=SIGN, options={"variant": "brsf"}).run_key != RunConfig(method=SIGN).run_key
    assert cli_main(["train", "--method", SIGN, "--option", "variant=nosuch", "--dataset", "digits",
                     "--out", str(tmp_path / "r")]) == 2
    assert "usf, brsf, frsf" in capsys.readouterr().err


# -- Kolen–Pollack -----------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", ["published", "shared", "sgd-momentum"])
def test_kolen_pollack_feedback_gets_the_weight_update_and_decays_onto_w(recipe):
    """W and B get one gradient, so W − B moves by the weight decay alone: under the shared AdamW,
    W − B = (W₀ − B₀)(1 − lr·λ)^t; under SGD with momentum μ (0 in the published plain SGD) and L2
    decay λ folded into the gradient, D = W − B follows v ← μ·v + λ·D, D ← D − lr·v."""
    recipes = {"published": None, "shared": SHARED_RECIPE,
               "sgd-momentum": Recipe(optimizer="sgd", lr=0.05, momentum=0.9, schedule="constant")}
    model, method = build(KP, options={"decay": 0.1}, lr=0.05, recipe=recipes[recipe])
    assert method.recipe.optimizer == ("adamw" if recipe == "shared" else "sgd")
    mu = method.recipe.momentum
    assert mu == (0.9 if recipe == "sgd-momentum" else 0.0)
    x, y = batch()
    feedback = [{k: b.clone() for k, b in pair.items()} for pair in method.feedback]
    gap0 = {(l, k): getattr(model.blocks[l], k).weight.detach() - b
            for l, pair in enumerate(feedback) for k, b in pair.items()}
    expected = routed_grads(model, x, y, feedback)
    method.train_step(x, y)
    assert_grads(model, expected)                                  # W's gradient: fa's through B
    for l, pair in enumerate(method.feedback):
        for k, b in pair.items():
            assert b.grad is getattr(model.blocks[l], k).weight.grad     # ∂B = ∂W
    for _ in range(3):
        method.train_step(*batch(seed=7))
    for l, pair in enumerate(method.feedback):
        for k, b in pair.items():
            if recipe == "shared":
                gap = gap0[(l, k)] * (1 - 0.05 * 0.1) ** 4            # W − B = (W₀ − B₀)(1 − lr·λ)^t
            else:
                gap, v = gap0[(l, k)], torch.zeros_like(gap0[(l, k)])
                for _ in range(4):
                    v = mu * v + 0.1 * gap
                    gap = gap - 0.05 * v
            torch.testing.assert_close(getattr(model.blocks[l], k).weight.detach() - b,
                                       gap, rtol=1e-10, atol=1e-13)


def test_kolen_pollack_gap_contracts_by_the_sgd_decay_exactly():
    """Akrout et al.'s KP under plain SGD with weight decay λ: W ← W − η(g + λW), B ← B − η(g + λB)
    with g_B = g, so W − B ← (1 − ηλ)(W − B) whatever the gradients: after steps with learning rates
    η_s, W − B = (W₀ − B₀) Π_s (1 − η_s λ), in float64 to rounding."""
    wd = 0.3
    model, method = build(KP, seed=3)
    pairs = [(getattr(model.blocks[l], k).weight, b) for l, pair in enumerate(method.feedback)
             for k, b in pair.items()]
    gap0 = [(w.detach() - b).clone() for w, b in pairs]
    sgd = torch.optim.SGD(list(model.parameters()) + [b for _, b in pairs], lr=0.0, weight_decay=wd)
    method.optimizers = [sgd]                                   # the test's optimizer, not the method's
    factor = 1.0
    for step, lr in enumerate((0.2, 0.05, 0.1, 0.3)):
        sgd.param_groups[0]["lr"] = lr
        method.train_step(*batch(seed=step))
        factor *= 1 - lr * wd
    for (w, b), g0 in zip(pairs, gap0):
        torch.testing.assert_close(w.detach() - b, g0 * factor, rtol=1e-12, atol=1e-14)


def test_kolen_pollack_aligns_b_with_w_in_its_default_regime():
    """With λ_KP = 10 (the regime under the shared AdamW; the published SGD's default 0.02 is the
    same budget at its lr) the gap contracts by Π(1 − lr·λ_KP) under AdamW too, and
    cos(W, B) — near 0 for the independent draws at the start — rises towards 1 within a short run
    (50 steps at lr 0.01: the gap shrinks to 0.9⁵⁰ ≈ 0.005); under the run's weight decay alone
    (λ_KP = λ_wd = 0.01) the gap keeps 99.5 % of its size and the cosine stays well below."""
    def cosines(model, method):
        return [float(F.cosine_similarity(getattr(model.blocks[l], k).weight.detach().flatten(),
                                          b.flatten(), dim=0))
                for l, pair in enumerate(method.feedback) for k, b in pair.items()]
    runs = {}
    for decay in (None, 0.01):
        torch.manual_seed(0)
        model = ResidualMLP(3, 16, 1, 5, w2_std=0.5).double()          # cosines of 16 × 16 matrices
        method = method_class(KP)(model, MethodSettings(
            epochs=1, lr=1e-2, trainable_blocks=(0,), recipe=SHARED_RECIPE,
            options={"decay": 10.0 if decay is None else decay}))
        start = cosines(model, method)
        gap0 = [getattr(model.blocks[l], k).weight.detach() - b for l, pair in enumerate(method.feedback)
                for k, b in pair.items()]
        for s in range(50):
            method.train_step(*batch(seed=s))
        shrink = (1 - 1e-2 * (10.0 if decay is None else decay)) ** 50      # constant lr within the epoch
        gaps = [getattr(model.blocks[l], k).weight.detach() - b for l, pair in enumerate(method.feedback)
                for k, b in pair.items()]
        for g0, g in zip(gap0, gaps):
            torch.testing.assert_close(g, g0 * shrink, rtol=1e-9, atol=1e-15)
        runs[decay] = (start, cosines(model, method))
    start, end = runs[None]
    assert max(abs(c) for c in start) < 0.5
    assert all(e > 0.95 for e in end), end
    assert all(e > s + 0.1 for s, e in zip(start, end))
    assert all(w < e - 0.5 for w, e in zip(runs[0.01][1], end)), (runs[0.01], end)


def test_kolen_pollack_leaves_a_frozen_block_and_its_feedback_alone():
    model, method = build(KP, trainable=(1,), lr=0.05)
    w = [p.detach().clone() for p in model.blocks[0].parameters()]
    b = {k: v.clone() for k, v in method.feedback[0].items()}
    for s in range(2):
        method.train_step(*batch(seed=s))
    assert all(torch.equal(p, q) for p, q in zip(model.blocks[0].parameters(), w))
    assert all(torch.equal(method.feedback[0][k], v) for k, v in b.items())
    assert not all(torch.equal(method.feedback[1][k], v) for k, v in b.items())


# -- DRTP ----------------------------------------------------------------------------------------------

def test_drtp_credit_is_the_projected_target_and_the_update_its_local_loss():
    model, method = build(DRTP, clip=1e9)                          # no clip: the plain local losses
    x, y = batch()
    target = -F.one_hot(y, 5).double()
    rms = lambda a: a / (a.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6)
    want = [rms(target @ method.feedback[0].T)] + [rms(target @ b.T) for b in method.feedback]
    credit = method.credit(x, y)
    for a, w in zip(credit, want):
        torch.testing.assert_close(a, w, rtol=1e-12, atol=1e-12)
    with torch.no_grad():                                          # no forward result enters it
        model.out_head.weight.mul_(-3.0)
    for a, w in zip(method.credit(x, y), want):
        torch.testing.assert_close(a, w, rtol=0, atol=0)
    _, hidden = model(x, return_hidden=True)
    loss = F.cross_entropy(model.readout(hidden[-1].detach()), y) \
        + (model.embed_input(x) * want[0]).sum(-1).mean() \
        + sum((blk(h.detach()) * a).sum(-1).mean() for blk, h, a in zip(model.blocks, hidden, want[1:]))
    expected = dict(zip([k for k, _ in model.named_parameters()],
                        torch.autograd.grad(loss, list(model.parameters()))))
    method.train_step(x, y)
    assert_grads(model, expected)


# -- node perturbation ----------------------------------------------------------------------------------

def test_node_perturbation_update_from_the_loss_change_under_its_noise():
    sigma = 1e-2
    model, method = build(NP, options={"sigma": sigma}, clip=1e9, batch_size=8)
    x, y = batch(n=6)
    method.train_step(x, y)                                        # lr = 0; keeps the step's noise
    xi = method._noise[:, :6]
    assert method._noise.shape == (3, 8, 4)                       # (L + 1, batch_size, d)
    assert abs(float(method._noise.std()) / sigma - 1) < 0.35
    with torch.no_grad():
        h = [model.embed_input(x)]
        noisy = h[0] + xi[0]
        for l, blk in enumerate(model.blocks):
            h.append(h[-1] + blk(h[-1]))
            noisy = noisy + blk(noisy) + xi[l + 1]
        dl = (F.cross_entropy(model.readout(noisy), y, reduction="none")
              - F.cross_entropy(model.readout(h[-1]), y, reduction="none"))
        credit = [dl[:, None] * xi[l] / sigma ** 2 for l in range(3)]
    loss = F.cross_entropy(model.readout(h[-1]), y) + (model.embed_input(x) * credit[0]).sum(-1).mean() \
        + sum((blk(hl) * a).sum(-1).mean() for blk, hl, a in zip(model.blocks, h, credit[1:]))
    expected = dict(zip([k for k, _ in model.named_parameters()],
                        torch.autograd.grad(loss, list(model.parameters()))))
    assert_grads(model, expected)


def test_node_perturbation_credit_is_unbiased_for_the_per_sample_gradient():
    """E[ΔL·ξ/σ²] = ∂ℓ_i/∂h_l: averaged over 20 000 noise draws on one sample, the credit points
    along the BP gradient of that sample's loss (cos > 0.99, norm within 3 %)."""
    model, method = build(NP, options={"sigma": 1e-4})
    x, y = batch(n=1)
    k = 20_000
    xs, ys = x.expand(k, -1), y.expand(k)
    with torch.no_grad():
        logits, hidden = model(xs, return_hidden=True)
    noise = torch.randn((3, k, 4), generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 1e-4
    credit = method._perturbed_credit(hidden, logits, ys, noise)
    h0 = model.embed_input(x).detach().requires_grad_(True)
    hs = [h0]
    for blk in model.blocks:
        hs.append(hs[-1] + blk(hs[-1]))
    grads = torch.autograd.grad(F.cross_entropy(model.readout(hs[-1]), y), hs)
    for a, g in zip(credit, grads):
        mean = a.mean(0)
        assert float(mean @ g[0] / (mean.norm() * g[0].norm())) > 0.99
        assert abs(float(mean.norm() / g[0].norm()) - 1) < 0.03


def test_node_perturbation_credit_does_not_advance_the_training_noise():
    model, method = build(NP)
    x, y = batch()
    state = method.gen.get_state()
    first = method.credit(x, y)
    assert torch.equal(method.gen.get_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(first, method.credit(x, y)))
    with pytest.raises(CreditAuditError, match="batch"):
        method.train_step(*batch(n=200))                            # more than batch_size rows


def test_node_perturbation_noisy_pass_leaves_batchnorm_statistics_alone():
    """On resnet-small (BatchNorm in training mode) a step leaves the running statistics and batch
    counters its clean forward alone leaves: the noisy forward (normalised by its own batch's
    statistics) changes no buffer. Eagerly and compiled whole."""
    torch.manual_seed(0)
    model = build_model("resnet-small", (1, 8, 8), 5, width=4, blocks=2, w2_std=0.3).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (6,), generator=g)
    clean, twin = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        clean(x)                                                     # the clean forward alone
    settings = MethodSettings(epochs=1, seed=0, lr=0.0, trainable_blocks=(0, 1), batch_size=6)
    method_class(NP)(model, settings).train_step(x, y)
    torch._dynamo.reset()
    method_class(NP)(twin, settings).step_function(backend="eager")(x, y)
    for stepped in (model, twin):
        for (k, want), got in zip(clean.named_buffers(), stepped.buffers()):
            assert torch.equal(got, want), k
    assert int(dict(model.named_buffers())["stem_bn.num_batches_tracked"]) == 1


# -- a seed's draws are the same on any device --------------------------------------------------------

def test_draw_on_host_is_the_cpu_stream_whatever_the_device():
    """`draw_on_host` draws from the CPU generator, then moves the numbers: for a tensor on another
    device ('meta' stands in for a GPU) the generator advances exactly as for one on the CPU, where
    the numbers are the generator's own; a bfloat16 model gets the float32 draw, cast."""
    gens = [derived_generator(3, "test") for _ in range(3)]
    want = torch.randn((2, 5), generator=gens[0])
    assert torch.equal(draw_on_host(torch.randn, (2, 5), gens[1], torch.zeros(1)), want)
    moved = draw_on_host(torch.randn, (2, 5), gens[2], torch.zeros(1, device="meta"))
    assert moved.device.type == "meta" and moved.shape == (2, 5)
    assert torch.equal(gens[2].get_state(), gens[0].get_state())
    low = draw_on_host(torch.rand, (4,), derived_generator(3, "test"), torch.zeros(1, dtype=torch.bfloat16))
    assert low.dtype == torch.bfloat16
    assert torch.equal(low, torch.rand(4, generator=derived_generator(3, "test")).bfloat16())


@pytest.mark.parametrize("name, options", [(SIGN, {"variant": "brsf"}), (NP, {}), ("cb", {})])
def test_a_steps_draws_are_the_next_numbers_of_the_seeds_cpu_generator(name, options):
    """What a step draws — brSF's magnitudes |R|, node perturbation's ξ, cb's ε — is the next
    numbers of the method's CPU generator derived from (seed, "method:<name>"), drawn in the
    model's dtype (`draw_on_host` then moves them to the model's device); the step draws nothing
    else, and the generator's state is the method's (saved with it)."""
    model, method = build(name, options=options, seed=5, batch_size=8)
    assert method.gen.device.type == "cpu" and method.gen.initial_seed() == derived_seed(5, f"method:{name}")
    ref = torch.Generator()
    ref.set_state(method.gen.get_state())
    method.train_step(*batch())
    if name == SIGN:                     # one draw for every module, in block and module order
        modules = [(mags, key, module) for block, mags in zip(model.blocks, method.magnitude)
                   for key, module in routed_modules(block)]
        flat = torch.rand(sum(m.weight.numel() for _, _, m in modules), generator=ref, dtype=torch.float64)
        for (mags, key, module), want in zip(modules, flat.split([m.weight.numel() for _, _, m in modules])):
            assert torch.equal(mags[key], want.view_as(module.weight) * xavier(module.weight)[1]), key
    else:
        sigma = method.sigma if name == NP else 1.0
        shape = (3, 8, 4) if name == NP else (int(method.opts["draws"]), 2, 4)
        assert torch.equal(method._noise, torch.randn(shape, generator=ref, dtype=torch.float64) * sigma)
    assert torch.equal(method.gen.get_state(), ref.get_state())
    assert torch.equal(method.state_dict()["gen"], ref.get_state())


# -- every zoo rule: frozen blocks, resume, CLI ----------------------------------------------------------

VARIANTS = [(SIGN, {"variant": "brsf"}), (SIGN, {"variant": "frsf"}), (KP, {}), (DRTP, {}), (NP, {})]


@pytest.mark.parametrize("name, options", VARIANTS)
def test_frozen_blocks_stay_bit_identical(name, options):
    model, method = build(name, trainable=(), options=options, lr=0.05)
    before = [p.detach().clone() for b in model.blocks for p in b.parameters()]
    embed = model.embed.weight.detach().clone()
    for s in range(3):
        method.train_step(*batch(seed=s))
    assert all(torch.equal(p, q) for p, q in zip([p for b in model.blocks for p in b.parameters()], before))
    assert not torch.equal(model.embed.weight, embed)


def _metrics_without_time(history):
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in history]


@pytest.mark.parametrize("name, options", VARIANTS)
def test_resume_after_kill_equals_uninterrupted(name, options, tmp_path, monkeypatch, every_epoch):
    from creditaudit.train import train_run
    config = RunConfig(method=name, options=options, dataset="synthetic", width=8, blocks=2,
                       epochs=2, batch_size=256)            # 2000 samples: 7 batches + one of 208
    whole = train_run(config, tmp_path / "whole", progress=False)
    real_save = store.save_checkpoint

    def save_then_die(run_dir, epoch, state, meta, config):
        real_save(run_dir, epoch, state, meta, config)
        if epoch == 1:
            raise KeyboardInterrupt
    monkeypatch.setattr(store, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_run(config, tmp_path / "killed", progress=False)
    monkeypatch.setattr(store, "save_checkpoint", real_save)
    resumed = train_run(config, tmp_path / "killed", progress=False)
    assert resumed.status["status"] == "finished"
    assert _metrics_without_time(resumed.history) == _metrics_without_time(whole.history)
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.dumps(whole.method.extra_state(), default=lambda t: t.tolist()) == \
        json.dumps(resumed.method.extra_state(), default=lambda t: t.tolist())


def test_every_zoo_rule_trains_through_the_audit_command(tmp_path, capsys):
    """`creditaudit audit` on digits trains every zoo rule (and its controls) to the end, measures
    its deep Γ (and the null where the rule has random feedback) and writes rules.md."""
    toml = tmp_path / "zoo.toml"
    toml.write_text(f'preset = "zoo"\ndataset = "digits"\nmethods = {json.dumps(list(ZOO))}\n'
                    'seeds = [1]\nepochs = 1\neval_batches = 1\njobs = 1\n[model]\nwidth = 8\nblocks = 2\n')
    assert cli_main(["audit", "--config", str(toml), "--out", str(tmp_path / "a"), "--quiet"]) in (0, 1, 3)
    result = store.read_sealed_json(tmp_path / "a" / "audit.json", "audit.json")
    rows = {r["method"]: r for r in result["methods"]}
    assert set(rows) == set(ZOO)
    assert all(r["statuses"] == {"1": "finished"} and r["gamma_deep"] is not None for r in rows.values())
    assert (rows[SIGN]["null_deep_mean"] is None) and rows[KP]["null_deep_mean"] is not None   # uSF: no null
    assert rows[NP]["null_deep_mean"] is None and rows[DRTP]["null_deep_mean"] is not None
    assert (tmp_path / "a" / "rules.md").read_text() == rules_table(result)
    # the report says what Γ's null means where the generic reading does not (issue 24: a learned B)
    audit_md = (tmp_path / "a" / "audit.md").read_text()
    assert "learning the feedback bought" in rows[KP]["null_note"]
    for name in (KP, SIGN, NP):
        assert rows[name]["null_note"] and f"Γ null, {name}: {rows[name]['null_note']}" in audit_md
    assert not rows[DRTP]["null_note"]        # random feedback, redrawn: the generic reading holds


# -- presets, --help, the rules table ---------------------------------------------------------------------

def test_quick_and_paper_train_the_paper_seven_and_zoo_every_rule():
    from creditaudit.config import presets
    paper = [n for n, cls in METHODS.items() if cls.paper]
    assert len(paper) == 7 and not set(ZOO) & set(paper)
    assert presets()["quick"]["methods"] == presets()["paper"]["methods"] == paper
    zoo = audit_config_from_dict({"preset": "zoo"})
    quick = audit_config_from_dict({"preset": "quick"})
    assert zoo.methods == tuple(METHODS)
    assert (zoo.dataset, zoo.seeds, zoo.epochs, zoo.model, zoo.training) == \
        (quick.dataset, quick.seeds, quick.epochs, quick.model, quick.training)
    shipped = audit_config_from_dict(load_audit_toml(ROOT / "examples" / "zoo.toml"))
    assert (shipped.dataset, shipped.methods, shipped.seeds, shipped.epochs) == \
        (zoo.dataset, zoo.methods, zoo.seeds, zoo.epochs)


def test_audit_help_lists_every_rule_on_one_line(capsys):
    from creditaudit.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["audit", "--help"])
    out = capsys.readouterr().out
    for name in METHODS:
        # the rules list ("  * NAME: …" or "  NAME: …"), not the options list at --help's end
        # ("  NAME: KEY=VALUE …")
        lines = [l for l in out.splitlines() if re.match(rf"\s+\*?\s*{re.escape(name)}: \S", l)
                 and not re.match(rf"\s+{re.escape(name)}: [\w-]+=", l)]
        assert len(lines) == 1, name


def test_docs_rules_table_is_the_rendering_of_the_committed_audit():
    """docs/RULES.md's table between its markers is exactly `rules_table` of docs/rules/audit.json
    (sealed like every audit.json: an edited result is refused), and that audit is the command the
    page shows (`creditaudit audit --preset zoo …`): every built-in rule."""
    audit = store.read_sealed_json(ROOT / "docs" / "rules" / "audit.json", "docs/rules/audit.json")
    page = (ROOT / "docs" / "RULES.md").read_text()
    table = page.split("<!-- rules:begin -->\n", 1)[1].split("<!-- rules:end -->", 1)[0]
    assert table == rules_table(audit)
    assert [r["method"] for r in audit["methods"]] == list(METHODS)
    assert audit["config"]["preset"] == "zoo"
    assert "creditaudit audit --preset zoo" in page
    # the published and shared recipes side by side: the rendering of both committed audits, once
    # docs/rules/regenerate.py has written the shared one
    comparison = page.split("<!-- recipes:begin -->\n", 1)[1].split("<!-- recipes:end -->", 1)[0]
    shared_path = ROOT / "docs" / "rules" / "audit_shared.json"
    if shared_path.exists():
        shared = store.read_sealed_json(shared_path, "docs/rules/audit_shared.json")
        assert comparison == recipe_comparison(audit, shared)
    else:
        assert comparison.startswith("Not generated yet")


@pytest.mark.parametrize("name", sorted(n for n, cls in METHODS.items() if cls.random_feedback))
def test_one_null_draw_for_all_batches_is_the_per_batch_draw_bit_for_bit(name):
    """Γ's null asks each rule for its credit on every eval batch under one draw
    (`Method.fresh_feedback_credits`). A rule that draws once and reuses the draw (fa, dfa and
    their kin) must give exactly what drawing again per batch from the same generator state gives,
    and leave the generator where that would; and a second draw must differ."""
    options = {"variant": "frsf"} if name == "sign-symmetry" else None
    model, method = build(name, options=options)
    batches = [batch(6, seed) for seed in (1, 2, 3)]
    gen, again = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    once = method.fresh_feedback_credits(batches, gen)
    start, per_batch = again.get_state(), []
    for x, y in batches:
        again.set_state(start)
        per_batch.append(method.fresh_feedback_credit(x, y, again))
    assert len(once) == len(batches)
    for a, b in zip(once, per_batch):
        assert len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))
    assert torch.equal(gen.get_state(), again.get_state())
    other = method.fresh_feedback_credits(batches, gen)
    assert any(not torch.equal(p, q) for p, q in zip(other[0], once[0]))


@pytest.mark.parametrize("name", sorted(n for n, cls in METHODS.items() if cls.random_feedback))
def test_all_null_draws_at_once_are_the_draws_one_by_one_bit_for_bit(name):
    """Γ's null asks for all its draws at once (`Method.fresh_feedback_draws`): a rule that runs
    each batch's forward once for every draw (dfa, dfa-penalty, drtp) must give exactly the
    credits of each draw asked for alone, batch by batch (`fresh_feedback_credit` with the
    generator at the same state), and leave each generator where that would."""
    options = {"variant": "frsf"} if name == "sign-symmetry" else None
    model, method = build(name, options=options)
    batches = [batch(6, seed) for seed in (1, 2, 3)]
    gens = [torch.Generator().manual_seed(s) for s in (11, 12, 13)]
    alone = [torch.Generator().manual_seed(s) for s in (11, 12, 13)]
    together = list(method.fresh_feedback_draws(batches, iter(gens)))
    assert len(together) == len(gens)
    for draw, gen, again in zip(together, gens, alone):
        expected = from_one_state(method.fresh_feedback_credit, batches, again)
        assert len(draw) == len(batches)
        for a, b in zip(draw, expected):
            assert len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))
        assert torch.equal(gen.get_state(), again.get_state())
    assert any(not torch.equal(p, q) for p, q in zip(together[0][0], together[1][0]))
