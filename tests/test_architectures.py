"""ViT-Mini and SmallResNet (SPEC §2) behind the ResidualModel interface, the model factory, and the
methods that must work on any architecture (bp, fa, dfa, dfa-penalty). Tiny sizes throughout."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from creditaudit.data import ArrayDataset
from creditaudit.errors import CreditAuditError
from creditaudit.methods import MethodSettings, method_class
from creditaudit.methods.fa import FeedbackConv2d, FeedbackLinear, routed_modules
from creditaudit.metrics import bp_gradients
from creditaudit.model import ARCH_OPTIONS, ResidualMLP, SmallResNet, ViTMini, build_model

ARCHS = ("vit-mini", "resnet-small")
TINY = {"vit-mini": dict(width=16, blocks=2, options={"heads": 2, "patch": 4}),
        "resnet-small": dict(width=8, blocks=2)}


def cifar_like(n=32, size=8, seed=0) -> ArrayDataset:
    """Random CIFAR-shaped uint8 images (N, 3, size, size) with CIFAR's normalisation."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (2 * n, 3, size, size), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 10, (2 * n,), generator=g)
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)
    return ArrayDataset("cifar-like", x[:n], y[:n], x[n:], y[n:], 10, mean, std, augment=True)


def tiny(arch, input_shape=(3, 8, 8), seed=0, dtype=torch.float32, w2_std=0.01):
    torch.manual_seed(seed)
    return build_model(arch, input_shape, 10, w2_std=w2_std, **TINY[arch]).to(dtype)


def method(name, model, trainable=None, lr=1e-2, **options):
    trainable = tuple(range(model.n_blocks)) if trainable is None else trainable
    return method_class(name)(model, MethodSettings(epochs=10, seed=0, lr=lr, trainable_blocks=trainable,
                                                    options=options))


@pytest.fixture(scope="module")
def data():
    return cifar_like()


# -- the models --------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, size, stream", [("vit-mini", 8, (4, 16)), ("vit-mini", 16, (16, 16)),
                                                ("resnet-small", 8, (8, 8, 8)),
                                                ("resnet-small", 16, (8, 8, 8))])   # stride 2 from 16 px
def test_forward_shapes_and_stream(arch, size, stream):
    model = tiny(arch, (3, size, size))
    x, y = cifar_like(n=6, size=size).eval_batch(0)
    assert x.shape == (6, 3, size, size)                          # prepare keeps images as images
    logits, hidden = model(x, return_hidden=True)
    assert model.stream_shape == stream and logits.shape == (6, 10)
    assert len(hidden) == model.n_blocks + 1 and all(h.shape == (6,) + stream for h in hidden)
    torch.testing.assert_close(model(x.flatten(1)), logits)       # a flattened batch is viewed back
    bp = bp_gradients(model, x, y)
    assert [g.shape for g in bp.grads] == [h.shape for h in hidden]
    h = bp.hidden[0].clone().requires_grad_(True)
    expected = torch.autograd.grad(F.cross_entropy(model.stream().forward_from(0, h), y), h)[0]
    torch.testing.assert_close(bp.grads[0], expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_fresh_stack_is_near_identity_and_parameter_roles(arch):
    model = tiny(arch)
    x, _ = cifar_like(n=8).eval_batch(0)
    with torch.no_grad():
        _, hidden = model(x, return_hidden=True)
    rel = ((hidden[-1] - hidden[0]).flatten(1).norm(dim=-1) / hidden[0].flatten(1).norm(dim=-1))
    assert float(rel.median()) < 0.1
    roles = model.embed_parameters() + [p for b in model.blocks for p in b.parameters()] \
        + model.head_parameters()
    assert sorted(map(id, roles)) == sorted(id(p) for p in model.parameters())   # a partition
    if arch == "resnet-small":
        assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())


def test_vit_block_is_the_whole_transformer_block():
    """f_l(h) = [h + attn(LN1 h)] + mlp(LN2(h + attn(LN1 h))) − h: the usual two-branch block."""
    model = tiny("vit-mini", w2_std=0.5)
    h = torch.randn(3, *model.stream_shape)
    block = model.blocks[0]
    u = h + block.attn(h)
    torch.testing.assert_close(h + block(h), u + block.mlp(u))


def test_digits_are_images_and_resmlp_unchanged(digits):
    assert digits.input_shape == (1, 8, 8) and digits.d_in == 64
    x, y = digits.eval_batch(0, 16)
    assert x.shape == (16, 1, 8, 8)
    for arch, stream in (("vit-mini", (4, 16)), ("resnet-small", (8, 8, 8))):
        model = tiny(arch, digits.input_shape)
        assert model.stream_shape == stream and model(x).shape == (16, 10)
    torch.manual_seed(0)
    mlp = ResidualMLP(64, 16, 2)
    torch.testing.assert_close(mlp(x), mlp(x.reshape(16, 64)), rtol=0, atol=0)


# -- the factory -------------------------------------------------------------------------------

def test_build_model_resmlp_is_bit_identical():
    torch.manual_seed(3)
    a = build_model("resmlp", (1, 8, 8), 10, width=16, blocks=2, activation="tanh", w2_std=0.05)
    torch.manual_seed(3)
    b = ResidualMLP(64, d=16, n_blocks=2, n_classes=10, activation="tanh", w2_std=0.05)
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    x = torch.randn(5, 1, 8, 8)
    assert torch.equal(a(x), b(x))


def test_build_model_errors():
    with pytest.raises(CreditAuditError, match=r"vit-mini needs image data \(C, H, W\); dataset input is \(40,\)"):
        build_model("vit-mini", (40,), 10, width=16, blocks=1)
    with pytest.raises(CreditAuditError, match="resnet-small needs image data"):
        build_model("resnet-small", (40,), 10, width=8, blocks=1)
    with pytest.raises(CreditAuditError, match="no option.*depth.*its options: patch, heads, mlp_ratio"):
        build_model("vit-mini", (3, 8, 8), 10, width=16, blocks=1, options={"depth": 3})
    with pytest.raises(CreditAuditError, match="resmlp has no option"):
        build_model("resmlp", (40,), 10, width=16, blocks=1, options={"patch": 4})
    with pytest.raises(CreditAuditError, match="unknown architecture"):
        build_model("vgg", (3, 8, 8), 10, width=16, blocks=1)
    with pytest.raises(CreditAuditError, match="not divisible by heads"):
        build_model("vit-mini", (3, 8, 8), 10, width=15, blocks=1, options={"heads": 2})
    with pytest.raises(CreditAuditError, match="not divisible by patch"):
        build_model("vit-mini", (3, 10, 10), 10, width=16, blocks=1)
    with pytest.raises(CreditAuditError, match="must be an integer"):
        build_model("resnet-small", (3, 8, 8), 10, width=8, blocks=1, options={"stem_stride": 1.5})
    assert set(ARCH_OPTIONS) == {"resmlp", "vit-mini", "resnet-small", "mlp"}


# -- methods on every architecture -------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["bp", "fa", "dfa", "dfa-penalty"])
def test_methods_reduce_the_loss(arch, name, data):
    model = tiny(arch, w2_std=0.1)
    m = method(name, model)
    x, y = data.eval_batch(0, 32, split="train")
    losses = [float(m.train_step(x, y)) for _ in range(12)]
    # mean of the last 3 steps clearly below the first 3 (random labels on a fixed batch of 32;
    # dfa on the width-8 ResNet is the slowest, ≈ 0.1 lower after 12 steps)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses
    credit = m.credit(x, y)
    assert len(credit) == model.n_blocks + 1
    assert all(a.shape == (32,) + model.stream_shape and torch.isfinite(a).all() for a in credit)


@pytest.mark.parametrize("arch", ARCHS)
def test_fa_with_weight_transport_is_bp(arch):
    """B := W for every block Linear/Conv2d turns FA back into BP: every parameter gradient and
    every credit a_l equals BP's (float64; BatchNorm in training mode)."""
    model = tiny(arch, dtype=torch.float64, w2_std=0.5)
    fa = method("fa", model, lr=0.0)
    for fb, block in zip(fa.feedback, model.blocks):
        names = [n for n, _ in routed_modules(block)]
        assert sorted(fb) == sorted(names) and names
        for name, module in routed_modules(block):
            fb[name] = module.weight.detach().clone()
    x, y = cifar_like(n=16).eval_batch(0)
    x = x.double()
    params = list(model.parameters())
    expected = torch.autograd.grad(F.cross_entropy(model(x), y), params)
    fa.train_step(x, y)
    for p, g in zip(params, expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-9, atol=1e-12)
    for a, g in zip(fa.credit(x, y), bp_gradients(model, x, y).grads):
        torch.testing.assert_close(a, g, rtol=1e-9, atol=1e-12)
    assert not any("forward" in m.__dict__ for m in model.modules())   # routing undone


@pytest.mark.parametrize("arch", ARCHS)
def test_fa_random_feedback_exact_readout_and_state(arch):
    model = tiny(arch, w2_std=0.5)
    fa = method("fa", model)
    x, y = cifar_like(n=16).eval_batch(0)
    credit, bp = fa.credit(x, y), bp_gradients(model, x, y).grads
    torch.testing.assert_close(credit[-1], bp[-1])                    # a_L = g_L: exact readout
    cos = F.cosine_similarity(credit[0].flatten(1), bp[0].flatten(1)).mean()
    assert cos < 0.99                                                 # B ≠ W below it
    other = method("fa", tiny(arch, w2_std=0.5, seed=1))
    other.load_extra_state(fa.extra_state())
    assert all(torch.equal(a, b) for fa_l, o_l in zip(fa.feedback, other.feedback)
               for a, b in zip(fa_l.values(), o_l.values()))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["fa", "dfa"])
def test_frozen_blocks_stay_bit_identical(arch, name, data):
    model = tiny(arch, w2_std=0.1)
    before = [p.detach().clone() for p in model.blocks.parameters()]
    n0 = len(list(model.blocks[0].parameters()))
    m = method(name, model, trainable=(1,))
    x, y = data.eval_batch(0, 32, split="train")
    for _ in range(3):
        m.train_step(x, y)
    after = list(model.blocks.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before[:n0], after[:n0]))
    assert all(p.grad is None for p in model.blocks[0].parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before[n0:], after[n0:]))   # block 1 trains


def test_feedback_functions_match_autograd_with_b_equal_w():
    """The custom Functions with B = W are the ordinary ops: leading dims, stride, groups, bias."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    out = torch.randn(2, 3, 5, 6, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((FeedbackLinear.apply(x, w, b, w.detach()) * out).sum(), (x, w, b))
    ref = torch.autograd.grad((F.linear(x, w, b) * out).sum(), (x, w, b))
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r)
    x = torch.randn(2, 4, 7, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 2, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    conv = ((2, 2), (1, 1), (1, 1), 2)
    y = F.conv2d(x, w, b, *conv)
    out = torch.randn(y.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((FeedbackConv2d.apply(x, w, b, w.detach(), *conv) * out).sum(), (x, w, b))
    ref = torch.autograd.grad((y * out).sum(), (x, w, b))
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r)


def test_fa_refuses_unroutable_blocks():
    model = tiny("resnet-small")
    model.blocks[0].extra = nn.Conv1d(2, 2, 1)
    with pytest.raises(CreditAuditError, match="cannot route Conv1d"):
        method("fa", model)


@pytest.mark.parametrize("arch, options", [("vit-mini", {"heads": 2, "patch": 4}), ("resnet-small", {})])
def test_a_bp_trained_instance_fires_no_flag(arch, options, tmp_path, device):
    from creditaudit.config import RunConfig
    from creditaudit.data import load_dataset
    from creditaudit.experiments import eval_batches
    from creditaudit.experiments.common import diagnose_run
    from creditaudit.train import train_run
    config = RunConfig(method="bp", dataset="digits", arch=arch, epochs=10, lr=3e-3, width=16,
                       blocks=2, arch_options=options)
    data = load_dataset("digits").to(device)
    run = train_run(config, tmp_path / "run", data=data, progress=False)      # runs where data are
    control = train_run(config.replace(trainable_blocks=0), tmp_path / "frozen", data=data, progress=False)
    report = diagnose_run(run, eval_batches(data, 8), control=control, run_data=data)
    assert run.test_acc > 0.7
    assert {k: report.flags[k] for k in ("a", "a_prime", "b", "b_prime", "d")} == dict.fromkeys(
        ("a", "a_prime", "b", "b_prime", "d"), False), report.reasons
    assert report.verdict == "trustworthy"


def test_smallresnet_readout_gain_is_blind_to_stream_scale():
    """What (b) and (b′) do without a terminal LayerNorm: the SmallResNet's readout (pool → Linear)
    is linear in h_L, so scaling the stream by 1000 leaves the readout gain ‖g_L‖/‖∂CE/∂logits‖
    unchanged — (b′) cannot see an explosion there, unlike on the pre-LN models, where the gain
    falls ∝ 1/‖h_L‖. (a)/(a′) must catch it instead; (b) follows the loss, which saturates."""
    from creditaudit.model import build_model
    from creditaudit.protocol import diagnose
    torch.manual_seed(0)
    model = build_model("resnet-small", (3, 16, 16), 10, width=8, blocks=2).eval()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 3, 16, 16, generator=g), torch.randint(0, 10, (32,), generator=g))
               for _ in range(2)]
    base = diagnose(model, batches)
    stream = model.stream()
    scaled = type(stream)(embed=lambda x: 1000 * stream.embed(x), steps=stream.steps,
                          readout=stream.readout, branches=None)
    big = diagnose(scaled, batches)
    assert big.readout_gain > 0.5 * base.readout_gain          # not ∝ 1/‖h_L‖: no fall by ~1000×
    assert not big.flags["b_prime"]
    assert big.residual_norms[-1] > 500 * base.residual_norms[-1]


@pytest.mark.parametrize("arch", ["vit-mini", "resnet-small"])
def test_full_diagnosis_with_rho_and_nudging_on_image_streams(arch):
    """ρ, its controls and the nudging test perturb whole (T, d) / (C, H, W) states per sample."""
    from creditaudit.methods import MethodSettings, method_class
    from creditaudit.model import build_model
    from creditaudit.protocol import diagnose
    torch.manual_seed(0)
    options = {"heads": 2} if arch == "vit-mini" else {}
    model = build_model(arch, (3, 8, 8), 10, width=8, blocks=2, options=options)
    dfa = method_class("dfa")(model, MethodSettings(epochs=1, trainable_blocks=(0, 1)))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g))
               for _ in range(2)]
    report = diagnose(model, batches, method=dfa, rho=True, rho_m=4, null_k=2)
    assert [r.layer for r in report.rho] == [1, 2]
    assert all(r.bp > 0.9 for r in report.rho)            # the BP control predicts ΔL
    assert all(abs(r.random) < 0.5 for r in report.rho)
    assert report.nudge is not None and len(report.gamma) == 3
