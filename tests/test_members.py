"""The member axis (SPEC §8, issue 23 stages 1 and 2): bp, fa, dfa, dfa-penalty, ep, sb and cb on
the ResMLP train K runs as one stack through the one trainer, and each member is the lone run it
stands for.

"The lone run" is main's trainer before the member axis: `tests/data/lone_runs_main.json` holds
the fingerprints of its runs (tests/member_reference.py: weights, AdamW moments and step counts,
learning rates, RNG states, every metrics line), `tests/data/lone_runs_stage2.json` those of
the second stage's methods before they moved (plus their auxiliary nets and generator states).
CPU, float64, one thread: the only difference left is floating-point reassociation of batched vs
plain matmuls, so the bound is 1e-9 relative (measured ≤ 5e-16; EP's ep_residual, a stationarity
residual ~1e-4 of the terms that cancel in it, ≤ 1.3e-13).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from creditaudit import store
from creditaudit.config import RunConfig
from creditaudit.methods import METHODS, MethodSettings
from creditaudit.methods.bp import BP
from creditaudit.methods.members import MemberStack
from creditaudit.model import ARCH_CLASSES
from creditaudit.runs import load_run
from creditaudit.train import can_stack, stack_key, train_run, train_runs
from member_reference import (ALIGNMENT_FIELDS, CONFIGS as STAGE1_CONFIGS, METHOD_NAMES as STAGE1,
                              STAGE2_CONFIGS, f64_synthetic, fingerprint, worst_difference)

STAGE2 = ("sb", "cb", "ep")          # the second stage's methods on the member axis
METHOD_NAMES = STAGE1 + STAGE2
CONFIGS = {**STAGE1_CONFIGS, **STAGE2_CONFIGS}
REFERENCE = {**json.loads((Path(__file__).parent / "data" / "lone_runs_main.json").read_text()),
             **json.loads((Path(__file__).parent / "data" / "lone_runs_stage2.json").read_text())}
RTOL = 1e-9


@pytest.fixture
def f64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield f64_synthetic()
    torch.set_default_dtype(before)


def _fp(run) -> dict:
    return json.loads(json.dumps(store.json_safe(fingerprint(run))))


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_a_lone_run_is_a_stack_of_one_and_equals_mains_lone_run(tmp_path, f64, method):
    """K = 1: train_run (now the one trainer's stack of one, on the member axis) ends where main's
    lone trainer ended, for the main run, another seed, the frozen control, a ladder rung and the
    shallow control."""
    for tag in ("main", "seed123", "frozen", "rung1", "shallow"):
        config = CONFIGS[f"{method}/{tag}"]
        assert can_stack(config)
        run = train_run(config, tmp_path / tag, data=f64, progress=False)
        assert worst_difference(_fp(run), REFERENCE[f"{method}/{tag}"]) < RTOL, tag


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_a_stack_of_k_equals_k_lone_runs_of_main(tmp_path, f64, method):
    """Main run, another seed, frozen control and a ladder rung in one stack (and the two shallow
    controls in another): each member's folder is main's lone run of it."""
    for tags in (("main", "seed123", "frozen", "rung1"), ("shallow", "shallow123")):
        configs = [CONFIGS[f"{method}/{t}"] for t in tags]
        assert len({stack_key(c) for c in configs}) == 1
        trained = train_runs(configs, [tmp_path / t for t in tags], data=f64, progress=False)
        assert [t.stack_size for t in trained] == [len(tags)] * len(tags)
        for tag, t in zip(tags, trained):
            assert worst_difference(_fp(t.run), REFERENCE[f"{method}/{tag}"]) < RTOL, tag


@pytest.mark.parametrize("method", ("fa", "sb", "ep"))
def test_each_members_alignment_series_is_its_lone_runs(tmp_path, f64, method):
    """Γ_l and cos(W, B) over training (train._alignment) of each member of a stack equal its lone
    run's, in float64 to 1e-9 relative, at every epoch (3 epochs: every epoch is probed)."""
    tags = ("main", "seed123", "frozen", "rung1")
    configs = [CONFIGS[f"{method}/{t}"] for t in tags]
    stacked = train_runs(configs, [tmp_path / f"stack-{t}" for t in tags], data=f64, progress=False)
    for tag, config, t in zip(tags, configs, stacked):
        lone = train_run(config, tmp_path / f"lone-{tag}", data=f64, progress=False)
        got = [{k: r.get(k) for k in ALIGNMENT_FIELDS} for r in t.run.history]
        want = [{k: r.get(k) for k in ALIGNMENT_FIELDS} for r in lone.history]
        assert [r["epoch"] for r in t.run.history] == [0, 1, 2, 3]
        if config.control == "frozen":              # a control probes no alignment, stacked or lone
            assert got == want == [dict.fromkeys(ALIGNMENT_FIELDS)] * 4, tag
            continue
        assert all(r["gamma"] is not None and len(r["gamma"]) == config.blocks + 1 for r in got), tag
        assert all((r["weight_alignment"] is not None) == (method == "fa") for r in got), tag
        for g, w in zip(got, want):
            assert g["gamma"] == pytest.approx(w["gamma"], rel=1e-9, abs=1e-12), tag
            if method == "fa":
                assert g["weight_alignment"].keys() == w["weight_alignment"].keys()
                assert list(g["weight_alignment"].values()) == pytest.approx(
                    list(w["weight_alignment"].values()), rel=1e-9, abs=1e-12), tag


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return load_run(run_dir).model.state_dict()


def _history(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in load_run(run_dir).history]


@pytest.mark.parametrize("method", ["fa", "dfa-penalty", *STAGE2])
def test_permuting_members_permutes_results_and_a_duplicated_seed_gives_equal_slices(tmp_path, f64, method):
    tags = ("main", "frozen", "rung1", "main")               # the main run twice
    configs = [CONFIGS[f"{method}/{t}"] for t in tags]
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


def _inject_nan(monkeypatch, member: int, at_step: int) -> None:
    """After the AdamW step number `at_step` of a stack, one weight of `member` becomes NaN."""
    real = MemberStack.apply_gradients
    count = {"steps": 0}

    def apply(self):
        real(self)
        count["steps"] += 1
        if count["steps"] == at_step:
            with torch.no_grad():
                self.net.params["blocks.0.w1.weight"][member, 0, 0] = float("nan")
    monkeypatch.setattr(MemberStack, "apply_gradients", apply)


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_a_nan_in_one_member_leaves_the_others_bit_identical(tmp_path, f64, method, monkeypatch):
    """Member j goes NaN in epoch 2 (step 10 of 8 per epoch): every other member ends bit-identical
    to the same stack without the NaN; member j ends diverged alone, its folder the one a lone run
    with the same NaN writes (status, message, the epoch-1 checkpoint and metrics)."""
    tags = ("main", "seed123", "rung1")
    configs = [CONFIGS[f"{method}/{t}"] for t in tags]
    clean = train_runs(configs, [tmp_path / f"clean{i}" for i in range(3)], data=f64, progress=False)
    _inject_nan(monkeypatch, member=1, at_step=10)
    stacks = []
    real_init = MemberStack.__init__
    monkeypatch.setattr(MemberStack, "__init__", lambda self, methods: (real_init(self, methods),
                                                                         stacks.append(self))[0])
    hit = train_runs(configs, [tmp_path / f"hit{i}" for i in range(3)], data=f64, progress=False)
    assert [t.run.status["status"] for t in hit] == ["finished", "diverged", "finished"]
    # the diverged member was retired: its slices (auxiliary nets too) hold its last checkpoint,
    # masked, nothing NaN
    kept = stacks[0]._lone(load_run(tmp_path / "hit1").method)
    for name, p in stacks[0].stacked().items():
        assert torch.isfinite(p).all() and torch.equal(p[1], kept[name]), name
    for i in (0, 2):
        wa, wb = _weights(tmp_path / f"clean{i}"), _weights(tmp_path / f"hit{i}")
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
        assert _history(tmp_path / f"clean{i}") == _history(tmp_path / f"hit{i}")
    _inject_nan(monkeypatch, member=0, at_step=10)
    lone = train_run(configs[1], tmp_path / "lone", data=f64, progress=False)
    got = hit[1].run
    assert got.status["status"] == lone.status["status"] == "diverged"
    assert got.status["message"] == lone.status["message"]
    assert got.status["epochs_completed"] == lone.status["epochs_completed"] == 1
    assert _history(tmp_path / "hit1") == _history(tmp_path / "clean1")[:2]
    # a stack of 3 against a stack of 1: equal up to the rounding of batched products whose kernel
    # may depend on the batch count (cb's ⟨c(h), ε⟩, a (n × D)·(D × draws) bmm, on this project's
    # CPU; dfa's too on the lent H100's host, a last-digit difference in epoch 1's Γ): which products
    # round alike is the BLAS library's choice, so the bound on the whole fingerprint is the test
    assert worst_difference(_fp(got), _fp(lone)) < RTOL
    assert clean[1].run.status["status"] == "finished"


def test_frozen_slices_stay_bit_identical_to_init_and_are_not_optimised(f64):
    """The per-member mask: a block member k does not train is put back after every step."""
    from creditaudit.runs import build_method, build_model
    configs = [CONFIGS["bp/main"], CONFIGS["bp/frozen"], CONFIGS["bp/rung1"]]
    methods = [build_method(c, build_model(c, f64.input_shape, f64.n_classes)) for c in configs]
    stack = MemberStack(methods)
    init = {k: v.detach().clone() for k, v in stack.net.params.items()}
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        batches = [next(f64.train_batches(64, gen)) for _ in configs]
        stack.train_step(torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches]))
    p = stack.net.params
    assert torch.equal(p["blocks.0.w1.weight"][1:], init["blocks.0.w1.weight"][1:])   # frozen, rung 1
    assert not torch.equal(p["blocks.0.w1.weight"][0], init["blocks.0.w1.weight"][0])
    assert torch.equal(p["blocks.1.w2.weight"][1], init["blocks.1.w2.weight"][1])     # frozen
    assert not torch.equal(p["blocks.1.w2.weight"][2], init["blocks.1.w2.weight"][2])  # rung 1 trains it


def test_which_methods_are_on_the_member_axis():
    """bp, fa, dfa, dfa-penalty, ep, sb and cb on the ResMLP, vit-mini and resnet-small
    (tests/test_members_archs.py); the rest train as a stack of one
    through their lone step; so does a subclass that changes the lone step of a member-axis method."""
    resmlp = ARCH_CLASSES["resmlp"]
    on = {name for name, cls in METHODS.items() if cls.on_member_axis(resmlp)}
    assert on == set(METHOD_NAMES)
    for arch in ("vit-mini", "resnet-small"):
        assert {name for name, cls in METHODS.items() if cls.on_member_axis(ARCH_CLASSES[arch])} == set(METHOD_NAMES)

    class MyBP(BP):
        name = "my-bp"

        def gradients(self, x, y):
            return super().gradients(x, y)

    class MyBPOnTheAxis(MyBP):
        def member_gradients(self, stack, x, y):
            return super().member_gradients(stack, x, y)

    assert not MyBP.on_member_axis(resmlp) and MyBPOnTheAxis.on_member_axis(resmlp)

    class MyFA(METHODS["fa"]):   # a rule that rebuilds fa's feedback each step (as sign-symmetry does)
        name = "my-fa"

        def prepare_step(self):
            super().prepare_step()

    assert METHODS["fa"].on_member_axis(resmlp) and not MyFA.on_member_axis(resmlp)


@pytest.mark.parametrize("options", [{"beta": 100.0, "steps": 1}, {"beta": 10.0, "steps": 4, "tol": 0.03}])
def test_ep_acceptance_and_tol_flags_are_per_member(f64, options):
    """EP's masks on the member axis: at β = 100 a trial is rejected for some samples and not
    others; with tol the members (inputs scaled ×1, ×10, ×100: stiffer relaxations) stop after
    different numbers of sweeps. Each member of the stack (two seeds and a frozen control, each on
    its own batches) steps exactly as its lone run: weights, AdamW moments and the epoch_log
    (ep_residual, ep_steps)."""
    from creditaudit.runs import build_method, build_model
    base = STAGE2_CONFIGS["ep/main"].replace(options=options)
    configs = [base, base.replace(seed=123), base.replace(trainable_blocks=0)]

    def build():
        return [build_method(c, build_model(c, f64.input_shape, f64.n_classes)) for c in configs]
    lone, stack = build(), MemberStack(build())
    gens = [torch.Generator().manual_seed(k) for k in range(3)]
    for _ in range(3):
        batches = [(x * scale, y) for scale, (x, y) in
                   zip((1.0, 10.0, 100.0), (next(f64.train_batches(128, g)) for g in gens))]
        for m, (x, y) in zip(lone, batches):
            m.train_step(x, y)
        stack.train_step(torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches]))
    stack.sync()
    logs = [m.epoch_log() for m in lone]
    for k, (m, s) in enumerate(zip(lone, stack.methods)):
        for (name, p), q in zip(m.model.named_parameters(), s.model.parameters()):
            torch.testing.assert_close(q, p, rtol=RTOL, atol=1e-15, msg=name)
        for a, b in zip(m.opt.state.values(), s.opt.state.values()):
            torch.testing.assert_close(b["exp_avg"], a["exp_avg"], rtol=RTOL, atol=1e-15)
        got = s.epoch_log()
        assert got.keys() == logs[k].keys() == {"ep_residual", "ep_steps"}
        assert got == pytest.approx(logs[k], rel=RTOL)
    if "tol" in options:       # the members' tol flags went off at different sweeps
        assert len({log["ep_steps"] for log in logs}) > 1, logs
    else:                      # some samples' trials rejected, not all (per member and sample)
        x, y = next(f64.train_batches(128, gens[0]))
        rejected = torch.stack(lone[0].relax(x, y).credit).flatten(2).abs().sum(-1).sum(0) == 0
        assert 0 < int(rejected.sum()) < len(y)


@pytest.mark.parametrize("method", STAGE2)
def test_a_killed_stack_resumes_each_member_as_its_lone_run(tmp_path, f64, method, monkeypatch, every_epoch):
    """Killed after two members saved epoch 1: those two resume as one stack from their
    checkpoints (auxiliary nets, their AdamW state and the method's generator included), the
    third from epoch 0 alone; each ends as main's lone run did (the full fingerprint)."""
    tags = ("main", "seed123", "rung1")
    configs = [CONFIGS[f"{method}/{t}"] for t in tags]
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
    for tag, t in zip(tags, trained):
        assert worst_difference(_fp(t.run), REFERENCE[f"{method}/{tag}"]) < RTOL, tag


def test_a_subclass_that_changes_a_helper_of_the_lone_step_trains_lone(tmp_path):
    """A user's rule below a member-axis method that overrides anything its lone step calls (dfa's
    `local_gradients`, fa's `forward`, an `__init__` with another optimizer) is not the rule the
    member step computes: it trains through its own step. Here a dfa whose blocks get zero credit
    (weight decay 0): its blocks must stay at init, which the member step (plain dfa) breaks."""
    resmlp = ARCH_CLASSES["resmlp"]
    DFA = METHODS["dfa"]

    class NoBlockCredit(DFA):
        name = "no-block-credit"

        def local_gradients(self, y, fwd, credit, lam=0.0):
            return super().local_gradients(y, fwd, [torch.zeros_like(c) for c in credit], lam=lam)

    class Renamed(DFA):             # data only, as dfa-penalty: the member step is still its step
        name = "renamed-dfa"

    assert not NoBlockCredit.on_member_axis(resmlp) and Renamed.on_member_axis(resmlp)
    assert METHODS["dfa-penalty"].on_member_axis(resmlp)
    model = resmlp(8, 8, 2, 3)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    method = NoBlockCredit(model, MethodSettings(epochs=1, weight_decay=0.0, trainable_blocks=(0, 1)))
    with pytest.raises(ValueError, match="member axis"):       # the trainer's stack refuses it
        MemberStack([method])
    x, y = torch.randn(2, 16, 8), torch.arange(32).view(2, 16) % 3
    for k in range(2):
        method.train_step(x[k], y[k])
    assert all(torch.equal(p, init[n]) for n, p in model.named_parameters() if n.startswith("blocks"))


@pytest.mark.parametrize("method", ["dfa", "dfa-penalty"])
def test_dfa_without_normalisation_on_the_member_axis_equals_its_lone_steps(f64, method):
    """normalise = 0 (Nøkland 2016's e·Bᵀ, no rms division) is honoured by the member step: a
    stack of two seeds (one frozen in block 0) ends where each member's lone steps end, to float64
    rounding; and it is another rule than the normalised one (the lone steps differ)."""
    from creditaudit.runs import build_method, build_model
    base = RunConfig(method=method, dataset="synthetic", width=16, blocks=2, epochs=3, batch_size=64,
                     options={"normalise": 0})
    configs = [base, base.replace(seed=123, trainable_blocks=1)]

    def methods(cs):
        return [build_method(c, build_model(c, f64.input_shape, f64.n_classes)) for c in cs]
    stack, lone = MemberStack(methods(configs)), methods(configs)
    normalised = methods([c.replace(options={}) for c in configs])
    assert [m.normalise for m in lone] == [False, False] and normalised[0].normalise
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        batches = [next(f64.train_batches(64, gen)) for _ in configs]
        stack.train_step(torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches]))
        for m, n, (x, y) in zip(lone, normalised, batches):
            m.train_step(x, y)
            n.train_step(x, y)
    for k, m in enumerate(lone):
        for name, p in m.model.named_parameters():
            torch.testing.assert_close(stack.net.params[name][k], p.detach(), rtol=RTOL, atol=1e-12, msg=name)
    w = "blocks.1.w1.weight"
    assert not torch.allclose(dict(normalised[0].model.named_parameters())[w],
                              dict(lone[0].model.named_parameters())[w])
