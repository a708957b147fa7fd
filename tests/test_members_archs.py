"""vit-mini and resnet-small on the member axis (issue 30 stage 3): bp, fa, dfa, dfa-penalty, ep,
sb and cb train K runs of one shape as one stack (`model.members.MemberViTMini`,
`MemberSmallResNet`), and each member is the lone run it stands for.

"The lone run" is the lone step (`Method.train_step` on the lone model), trained here through the
one trainer with the method taken off the member axis (`member_archs` without the architecture,
the path every run of these architectures took before this stage). CPU, float64, one thread: the
only difference left is floating-point reassociation of batched vs plain products, so the bound is
1e-9 relative (measured: vit-mini ≤ 5.5e-13, ep's the largest; resnet-small ≤ 2.2e-16) on the
full fingerprint (tests/member_reference.py): weights and BatchNorm buffers, AdamW moments and
step counts, learning rates, RNG states, the method's generator and feedback draws and auxiliary
nets, every metrics line.
"""
from __future__ import annotations

import json

import pytest
import torch

from creditaudit import store
from creditaudit.config import RunConfig
from creditaudit.data.generated import load_digits
from creditaudit.methods import METHODS, MethodSettings, method_class
from creditaudit.methods.members import MemberStack
from creditaudit.model import ARCH_CLASSES, ResidualMLP, build_model
from creditaudit.model.members import MemberSmallResNet, stack_models
from creditaudit.runs import build_method, load_run
from creditaudit.train import can_stack, stack_key, train_run, train_runs
from compile_support import compiled_call
from member_reference import F64Dataset, fingerprint, worst_difference

ARCHS = ("vit-mini", "resnet-small")
METHOD_NAMES = ("bp", "fa", "dfa", "dfa-penalty", "ep", "sb", "cb")
OPTIONS = {"sb": {"hidden": 16, "t_dim": 4, "lam": 1e-2}, "cb": {"hidden": 16, "t_dim": 4, "lam": 1e-2}}
SIZES = {"vit-mini": dict(width=16, blocks=2, arch_options={"heads": 2, "patch": 4}),
         "resnet-small": dict(width=8, blocks=2)}
RTOL = 1e-9


def config(arch: str, method: str, **changes) -> RunConfig:
    base = RunConfig(method=method, dataset="digits", arch=arch, epochs=2, batch_size=64,
                     options=OPTIONS.get(method, {}), **SIZES[arch])
    return base.replace(**changes) if changes else base


@pytest.fixture(scope="module")
def f64():
    """192 train / 64 test digits (8×8, one channel) in float64: 3 batches an epoch."""
    d = load_digits()
    return F64Dataset(d.name, d.x_train[:192].double(), d.y_train[:192], d.x_test[:64].double(),
                      d.y_test[:64], d.n_classes, d.mean, d.std)


@pytest.fixture
def double():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.fixture
def lone_step(monkeypatch):
    """Takes every method off the member axis for the new architectures: a run trains through its
    lone `train_step` (the reference this stage must reproduce)."""
    def off():
        for cls in METHODS.values():
            if "member_archs" in vars(cls):
                monkeypatch.setattr(cls, "member_archs", tuple(a for a in cls.member_archs
                                                               if a is ResidualMLP))
    return off


def _fp(run) -> dict:
    return json.loads(json.dumps(store.json_safe(fingerprint(run))))


MEMBERS = {"main": {}, "seed123": {"seed": 123}, "frozen": {"trainable_blocks": 0},
           "rung1": {"trainable_blocks": 1}}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_a_stack_of_k_equals_k_lone_runs(tmp_path, f64, double, lone_step, arch, method, monkeypatch):
    """Main run, another seed, the frozen control and a ladder rung in one stack: each member's
    folder is the lone run's (full fingerprint), its frozen blocks bit-identical to the lone run's
    (= init); (bp) a stack of one too."""
    configs = {tag: config(arch, method, **c) for tag, c in MEMBERS.items()}
    assert all(map(can_stack, configs.values())) and len({stack_key(c) for c in configs.values()}) == 1
    trained = train_runs(list(configs.values()), [tmp_path / t for t in configs], data=f64, progress=False)
    assert [t.stack_size for t in trained] == [4] * 4
    one = train_run(configs["main"], tmp_path / "one", data=f64, progress=False) if method == "bp" else None
    lone_step()
    assert not can_stack(configs["main"])
    for (tag, c), t in zip(configs.items(), trained):
        lone = train_run(c, tmp_path / f"lone_{tag}", data=f64, progress=False)
        assert worst_difference(_fp(t.run), _fp(lone)) < RTOL, tag
        got, want = t.run.model.state_dict(), lone.model.state_dict()
        for name in want:
            if name.startswith("blocks.") and int(name.split(".")[1]) not in c.trainable_block_ids \
                    and "running" not in name and "num_batches" not in name:
                assert torch.equal(got[name], want[name]), (tag, name)
        if tag == "main" and one is not None:
            assert worst_difference(_fp(one), _fp(lone)) < RTOL


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return load_run(run_dir).model.state_dict()


def _history(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in load_run(run_dir).history]


@pytest.mark.parametrize("arch, method", [("vit-mini", "fa"), ("resnet-small", "dfa-penalty"), ("vit-mini", "sb")])
def test_permuting_members_permutes_results_and_a_duplicated_seed_gives_equal_slices(
        tmp_path, f64, double, arch, method):
    configs = [config(arch, method, **MEMBERS[t]) for t in ("main", "frozen", "rung1", "main")]
    train_runs(configs, [tmp_path / f"a{i}" for i in range(4)], data=f64, progress=False)
    order = [2, 3, 0, 1]
    train_runs([configs[i] for i in order], [tmp_path / f"b{i}" for i in order], data=f64, progress=False)
    for i in range(4):
        wa, wb = _weights(tmp_path / f"a{i}"), _weights(tmp_path / f"b{i}")
        assert all(torch.equal(wa[k], wb[k]) for k in wa), i
        assert _history(tmp_path / f"a{i}") == _history(tmp_path / f"b{i}")
    w0, w3 = _weights(tmp_path / "a0"), _weights(tmp_path / "a3")
    assert all(torch.equal(w0[k], w3[k]) for k in w0)
    assert _history(tmp_path / "a0") == _history(tmp_path / "a3")


@pytest.mark.parametrize("arch, method, weight", [("vit-mini", "dfa", "blocks.0.qkv.weight"),
                                                  ("resnet-small", "bp", "blocks.0.conv1.weight"),
                                                  ("resnet-small", "cb", "blocks.0.conv1.weight")])
def test_a_nan_in_one_member_leaves_the_others_bit_identical(tmp_path, f64, double, arch, method, weight,
                                                             monkeypatch):
    """Member 1 goes NaN in epoch 2 (after step 5 of 3 per epoch; for the ResNet its BatchNorm
    statistics go NaN with it): the other members end bit-identical to the same stack without
    the NaN, member 1 diverged alone with its epoch-1 folder, its slices (parameters and buffers)
    reset to that checkpoint."""
    configs = [config(arch, method, **MEMBERS[t]) for t in ("main", "seed123", "rung1")]
    clean = train_runs(configs, [tmp_path / f"clean{i}" for i in range(3)], data=f64, progress=False)
    real, count, stacks = MemberStack.apply_gradients, {"steps": 0}, []

    def apply(self):
        real(self)
        count["steps"] += 1
        if count["steps"] == 5:
            with torch.no_grad():
                self.net.params[weight][1].view(-1)[0] = float("nan")
    monkeypatch.setattr(MemberStack, "apply_gradients", apply)
    real_init = MemberStack.__init__
    monkeypatch.setattr(MemberStack, "__init__", lambda self, methods: (real_init(self, methods),
                                                                         stacks.append(self))[0])
    hit = train_runs(configs, [tmp_path / f"hit{i}" for i in range(3)], data=f64, progress=False)
    assert [t.run.status["status"] for t in hit] == ["finished", "diverged", "finished"]
    assert hit[1].run.status["epochs_completed"] == 1
    kept = load_run(tmp_path / "hit1").model
    for name, p in {**dict(kept.named_parameters()), **dict(kept.named_buffers())}.items():
        stacked = {**stacks[0].net.params, **stacks[0].net.buffers}[name]
        if "running" not in name and "num_batches" not in name:   # buffers move on: training mode
            assert torch.equal(stacked[1], p), name
        assert torch.isfinite(stacked[1].double()).all(), name
    for i in (0, 2):
        wa, wb = _weights(tmp_path / f"clean{i}"), _weights(tmp_path / f"hit{i}")
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
        assert _history(tmp_path / f"clean{i}") == _history(tmp_path / f"hit{i}")
    assert _history(tmp_path / "hit1") == _history(tmp_path / "clean1")[:2]
    assert clean[1].run.status["status"] == "finished"


def test_a_killed_resnet_stack_resumes_each_member_as_its_lone_run(tmp_path, f64, double, lone_step,
                                                                   monkeypatch, every_epoch):
    """Killed after two members saved epoch 1: those two resume as one stack from their
    checkpoints (BatchNorm running statistics and AdamW state included), the third from epoch 0
    alone; each ends as its lone run does (the full fingerprint)."""
    configs = [config("resnet-small", "bp", **MEMBERS[t]) for t in ("main", "seed123", "rung1")]
    dirs = [tmp_path / f"m{i}" for i in range(3)]
    real_save = store.save_checkpoint

    def dying_save(run_dir, epoch, *args, **kwargs):
        real_save(run_dir, epoch, *args, **kwargs)
        if epoch == 1 and run_dir.name == "m1":
            raise KeyboardInterrupt
    monkeypatch.setattr(store, "save_checkpoint", dying_save)
    with pytest.raises(KeyboardInterrupt):
        train_runs(configs, dirs, data=f64, progress=False)
    monkeypatch.setattr(store, "save_checkpoint", real_save)
    trained = train_runs(configs, dirs, data=f64, progress=False)
    assert [t.stack_size for t in trained] == [2, 2, 1]
    lone_step()
    for i, (c, t) in enumerate(zip(configs, trained)):
        lone = train_run(c, tmp_path / f"lone{i}", data=f64, progress=False)
        assert worst_difference(_fp(t.run), _fp(lone)) < RTOL, i


def _lone_pair(arch: str, seed: int, shape=(3, 8, 8)):
    torch.manual_seed(seed)
    return build_model(arch, shape, 10, w2_std=0.3, **{k: v for k, v in SIZES[arch].items()
                                                        if k in ("width", "blocks")},
                       options=SIZES[arch].get("arch_options"))


def test_batch_norm_per_member_is_the_lone_batchnorm_in_train_and_eval_mode(double):
    """Training mode: batch statistics per member, each member's running mean/var and
    num_batches_tracked moved as its lone BatchNorm2d moves them (momentum, eps, unbiased var);
    eval mode: the running statistics; `unstack_into` writes the buffers back."""
    models = [_lone_pair("resnet-small", s) for s in range(3)]
    for m in models:
        for bn in m.modules():
            if isinstance(bn, torch.nn.BatchNorm2d):
                bn.momentum, bn.eps = 0.3, 1e-3
    net = stack_models(models)
    assert isinstance(net, MemberSmallResNet)
    g = torch.Generator().manual_seed(0)
    for training in (True, True, False):
        x = torch.randn(3, 16, 3, 8, 8, generator=g) * 2 + 1
        net.train(training)
        h = net.embed_input(x)
        got = net.readout(h + net.block(0, h) + net.block(1, h + net.block(0, h)) * 0)
        for k, m in enumerate(models):
            m.train(training)
            h0 = m.embed_input(x[k])
            want = m.readout(h0 + m.blocks[0](h0) + m.blocks[1](h0 + m.blocks[0](h0)) * 0)
            torch.testing.assert_close(got[k], want, rtol=1e-12, atol=1e-12)
    lone = _lone_pair("resnet-small", 9)
    net.unstack_into(2, lone)
    for name, b in models[2].named_buffers():
        assert torch.equal(dict(lone.named_buffers())[name], b), name
    assert int(models[2].stem_bn.num_batches_tracked) == 2


def test_stacking_refuses_models_of_other_shapes_or_classes():
    with pytest.raises(ValueError, match="one shape"):
        stack_models([_lone_pair("vit-mini", 0), build_model("vit-mini", (3, 8, 8), 10, width=8, blocks=2,
                                                             options={"heads": 2})])
    with pytest.raises(TypeError, match="SmallResNet"):
        MemberSmallResNet([_lone_pair("vit-mini", 0)])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["bp", "fa", "dfa-penalty", "ep", "cb"])
def test_the_member_step_compiles_whole_without_recompiling(arch, name, double):
    """A stack of 3 (two seeds and a frozen control): `gradients` compiles with fullgraph=True,
    later batches reuse the graph (BatchNorm's in-place buffer updates included), and the compiled
    stack's update, buffers and AdamW moments are the eager stack's."""
    torch._dynamo.reset()

    def stack():
        methods = []
        for seed, blocks in ((0, (0, 1)), (1, (0, 1)), (0, ())):
            settings = MethodSettings(epochs=3, seed=seed, lr=1e-2, trainable_blocks=blocks,
                                      options=OPTIONS.get(name, {}))
            methods.append(method_class(name)(_lone_pair(arch, seed), settings))
        return MemberStack(methods)
    eager, compiled = stack(), stack()
    step = compiled.step_function(backend="eager")
    assert step != compiled.train_step
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        xs, ys = torch.randn(3, 8, 3, 8, 8, generator=g), torch.randint(0, 10, (3, 8), generator=g)
        want = eager.train_step(xs, ys)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled_call(step, xs, ys)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for k, p in {**eager.net.params, **eager.net.buffers}.items():
        torch.testing.assert_close({**compiled.net.params, **compiled.net.buffers}[k], p,
                                   rtol=1e-12, atol=1e-12, msg=k)
    for p, q in zip(eager.params, compiled.params):
        torch.testing.assert_close(compiled.opt.state[q]["exp_avg"], eager.opt.state[p]["exp_avg"],
                                   rtol=1e-12, atol=1e-12)
