"""No host in the training step (SPEC §8): every built-in method's `gradients` compiles whole with
torch.compile(fullgraph=True) — an .item(), float(), bool() or data-dependent branch would be a
graph break, hence an error — and the compiled step gives the eager step's update. The optimizer
step (`apply_gradients`) stays outside the compiled region: AdamW's first call initialises its
state, which Dynamo does not trace; it is one fused kernel per optimizer anyway. backend="eager"
runs the captured graph with the ordinary kernels, so the check needs no C++ compiler."""
from __future__ import annotations

import copy

import pytest
import torch

from creditaudit.data import ArrayDataset
from creditaudit.errors import CreditAuditError
from creditaudit.methods import METHODS, MethodSettings, method_class
from creditaudit.model import ResidualMLP, build_model
from compile_support import compiled_call

BUILT_IN = tuple(METHODS)          # every built-in method (the registry)
# rules whose step torch.compile cannot trace (forward_gradient.JVP_COMPILES: torch.func.jvp)
EAGER_ONLY = ("fg-w", "fg-a", "lg-fg-a")
SIZES = {"resmlp": dict(width=16, blocks=2), "vit-mini": dict(width=8, blocks=2, options={"heads": 2, "patch": 4}),
         "resnet-small": dict(width=4, blocks=2)}


def pair(name: str, arch: str, device: torch.device, dtype=torch.float64):
    """Two identical (model, method) pairs: one to step eagerly, one compiled."""
    shape = (12,) if arch == "resmlp" else (3, 8, 8)
    torch.manual_seed(0)
    model = build_model(arch, shape, 10, w2_std=0.3, **SIZES[arch]).to(device=device, dtype=dtype)
    settings = MethodSettings(epochs=3, seed=0, lr=1e-2, trainable_blocks=(0, 1))
    twin = copy.deepcopy(model)
    return (model, method_class(name)(model, settings)), (twin, method_class(name)(twin, settings))


def batches(arch: str, device, dtype=torch.float64, n=16, k=2):
    g = torch.Generator().manual_seed(1)
    shape = (12,) if arch == "resmlp" else (3, 8, 8)
    return [(torch.randn((n,) + shape, generator=g).to(device, dtype),
             torch.randint(0, 10, (n,), generator=g).to(device)) for _ in range(k)]


@pytest.mark.parametrize("name", EAGER_ONLY)
def test_an_eager_only_rule_trains_through_its_eager_step(name, device):
    """Asked for a compiled step, a rule that declares itself not compilable gets its eager one."""
    (_, method), _ = pair(name, "resmlp", device)
    assert not method.compilable() and method.step_function(backend="eager") == method.train_step


@pytest.mark.parametrize("name, arch", [(m, "resmlp") for m in BUILT_IN if m not in EAGER_ONLY]
                         + [(m, a) for a in ("vit-mini", "resnet-small") for m in ("bp", "dfa")])
def test_the_step_compiles_whole_and_gives_the_eager_update(name, arch, device):
    """Also: one graph serves every step of every epoch (a step that read a Python counter or a
    last-step value would recompile each step)."""
    torch._dynamo.reset()
    (model, eager), (twin, compiled) = pair(name, arch, device)
    step = compiled.step_function(backend="eager")
    assert step != compiled.train_step                      # it really is the compiled path
    for i, (x, y) in enumerate(batches(arch, device, k=4)):
        want = eager.train_step(x, y)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled_call(step, x, y)                 # fullgraph: a graph break raises
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        if i == 1:
            assert eager.epoch_log() == compiled.epoch_log()    # an epoch boundary in between
    for (k, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=k)
    for oa, ob in zip(eager.optimizers, compiled.optimizers):     # the same optimizer state too
        for sa, sb in zip(oa.state.values(), ob.state.values()):  # (AdamW/Adam moments, SGD momentum)
            assert sa and sorted(sa) == sorted(sb)
            for key in sa:
                torch.testing.assert_close(sb[key], sa[key], rtol=1e-12, atol=1e-12, msg=key)
    assert eager.epoch_log() == compiled.epoch_log()


@pytest.mark.parametrize("options", [{"beta": 30.0, "steps": 1}, {"beta": 1.0, "steps": 4, "tol": 0.3}])
def test_ep_acceptance_and_tol_are_masked_updates_not_host_branches(options):
    """EP's acceptance test and its tol stop without bool(): at β = 30 one sweep's trial raises
    F_i for some samples (rejected: their credit stays 0) and not for others; with tol the sweeps
    stop changing the credit before `steps`. The compiled step (fullgraph) equals the eager one."""
    torch.manual_seed(0)
    model = build_model("resmlp", (12,), 10, width=16, blocks=2, w2_std=0.3).double()
    settings = MethodSettings(epochs=3, seed=0, lr=1e-2, trainable_blocks=(0, 1), options=options)
    twin = copy.deepcopy(model)
    eager, compiled = method_class("ep")(model, settings), method_class("ep")(twin, settings)
    (x, y), = batches("resmlp", "cpu", k=1)
    rel = eager.relax(x, y)
    if "tol" in options:
        assert 1 <= float(rel.sweeps) < options["steps"]
    else:
        rejected = torch.stack(rel.credit).flatten(2).abs().sum(-1).sum(0) == 0
        assert 0 < int(rejected.sum()) < len(y)
    step = compiled.step_function(backend="eager")
    eager.train_step(x, y)
    compiled_call(step, x, y)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    assert eager.epoch_log() == compiled.epoch_log()


def test_a_step_on_the_device_never_synchronises(device):
    """On CUDA the epoch's steps run under torch.cuda.set_sync_debug_mode("error"): any
    host↔device copy or synchronisation inside a step raises. (On a CPU there is nothing to sync.)"""
    if device.type != "cuda":
        pytest.skip("needs CUDA: synchronisation is a device notion")
    g = torch.Generator().manual_seed(0)
    data = ArrayDataset("img", torch.randint(0, 256, (64, 3, 8, 8), generator=g, dtype=torch.uint8),
                        torch.randint(0, 10, (64,), generator=g),
                        torch.randint(0, 256, (16, 3, 8, 8), generator=g, dtype=torch.uint8),
                        torch.randint(0, 10, (16,), generator=g), 10,
                        torch.full((3, 1, 1), 0.5), torch.full((3, 1, 1), 0.25), augment=True).to(device)
    for name in BUILT_IN:
        torch.manual_seed(0)
        model = build_model("resmlp", (3, 8, 8), 10, width=16, blocks=2).to(device)
        method = method_class(name)(model, MethodSettings(epochs=1, trainable_blocks=(0, 1)))
        batches_ = data.train_batches(16, torch.Generator().manual_seed(0))   # the epoch's one copy
        x, y = next(batches_)
        method.train_step(x, y)                                 # optimizer state initialised
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for x, y in batches_:
                method.train_step(x, y)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name, options", [(m, {}) for m, cls in METHODS.items() if cls.on_member_axis(ResidualMLP)]
                         + [("ep", {"beta": 100.0, "steps": 4, "tol": 0.03})])
def test_the_member_step_compiles_whole_without_recompiling(name, options, device):
    """A stack of 3 members (two seeds and a frozen control) on the member axis: its `gradients`
    compiles with fullgraph=True, a second and later batches reuse the graph, and the compiled
    stack's update is the eager stack's (for ep also with rejected trials and the tol flags,
    per member: masked updates, no host branch)."""
    from creditaudit.methods.members import MemberStack
    torch._dynamo.reset()

    def stack():
        methods = []
        for seed, blocks in ((0, (0, 1)), (1, (0, 1)), (0, ())):
            torch.manual_seed(seed)
            model = build_model("resmlp", (12,), 10, width=16, blocks=2, w2_std=0.3).to(device, torch.float64)
            settings = MethodSettings(epochs=3, seed=seed, lr=1e-2, trainable_blocks=blocks, options=options)
            methods.append(method_class(name)(model, settings))
        return MemberStack(methods)
    eager, compiled = stack(), stack()
    step = compiled.step_function(backend="eager")
    assert step != compiled.train_step
    for i, (x, y) in enumerate(batches("resmlp", device, k=3)):
        xs = torch.stack([x, x.flip(0), x])
        ys = torch.stack([y, y.flip(0), y])
        want = eager.train_step(xs, ys)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled_call(step, xs, ys)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for k, p in eager.net.params.items():
        torch.testing.assert_close(compiled.net.params[k], p, rtol=1e-12, atol=1e-12, msg=k)
    for p, q in zip(eager.params, compiled.params):
        torch.testing.assert_close(compiled.opt.state[q]["exp_avg"], eager.opt.state[p]["exp_avg"],
                                   rtol=1e-12, atol=1e-12)
    eager.sync()
    compiled.sync()                   # what the step left for each member's lone Method (ep's log)
    for a, b in zip(eager.methods, compiled.methods):
        assert b.epoch_log() == pytest.approx(a.epoch_log(), rel=1e-12)


SENTINEL = 1e6          # a .grad planted on a frozen parameter before a step


@pytest.mark.parametrize("arch", ["mlp", "resmlp"])
@pytest.mark.parametrize("name", BUILT_IN)
def test_no_gradient_left_on_a_frozen_block_is_added_to(name, arch, device):
    """A frozen block still requires grad, so a backward pass writes its .grad, which no optimizer
    clears. Every step starts from .grad None on every parameter (`Method.clear_gradients`): a
    .grad left from before is never added to. Left alone, it piled up over the run, and under CUDA
    graphs it was the last replay's output for the next replay to read, which torch refuses: the
    frozen control of bp failed so on an H100 (2026-11-26)."""
    torch.manual_seed(0)
    model = build_model(arch, (12,), 10, width=16, blocks=2, activation="tanh").to(device)
    try:
        method = method_class(name)(model, MethodSettings(epochs=3, seed=0, trainable_blocks=()))
    except CreditAuditError:
        return                            # the rule refuses this architecture (tests/test_plain_mlp.py)
    planted = [p for p in model.blocks.parameters()]
    for p in planted:
        p.grad = torch.full_like(p, SENTINEL)
    (x, y), = batches("resmlp", device, torch.float32, k=1)
    method.train_step(x, y)
    for p in planted:
        assert p.grad is None or p.grad.abs().max() < SENTINEL / 2
    method.clear_gradients()
    assert all(p.grad is None for p in model.parameters())


def test_a_stack_clears_the_gradient_of_a_block_no_member_trains(device):
    """The member stack leaves a block no member trains out of its optimizer; a backward pass still
    writes that block's .grad, and the next step starts from None there too."""
    from creditaudit.methods.members import MemberStack
    methods = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = build_model("resmlp", (12,), 10, width=16, blocks=2).to(device)
        methods.append(method_class("bp")(model, MethodSettings(epochs=3, seed=seed, trainable_blocks=(1,))))
    stack = MemberStack(methods)
    untrained = [p for name, p in stack.net.params.items() if name.startswith("blocks.0.")]
    assert untrained and not any(p is q for p in untrained for q in stack.params)
    for p in untrained:
        p.grad = torch.full_like(p, SENTINEL)
    (x, y), = batches("resmlp", device, torch.float32, k=1)
    stack.train_step(torch.stack([x, x.flip(0)]), torch.stack([y, y.flip(0)]))
    assert all(p.grad is None or p.grad.abs().max() < SENTINEL / 2 for p in untrained)


def test_the_frozen_control_trains_compiled_into_cuda_graphs(device):
    """The frozen control of bp on the plain MLP, compiled as the trainer compiles on a GPU
    (mode reduce-overhead): on an H100 its step raised "accessing tensor output of CUDAGraphs
    that has been overwritten" until every step cleared the frozen layers' .grad."""
    if device.type != "cuda":
        pytest.skip("needs CUDA: CUDA graphs")
    from creditaudit.train import step_runner
    torch.manual_seed(0)
    model = build_model("mlp", (12,), 10, width=16, blocks=1, activation="sigmoid",
                        options={"loss": "bce"}).to(device)
    method = method_class("bp")(model, MethodSettings(epochs=3, seed=0, trainable_blocks=()))
    step = step_runner(method, "reduce-overhead")
    for x, y in batches("resmlp", device, torch.float32, k=6):
        step(x, y)
    assert torch.isfinite(model.out_head.weight).all()
