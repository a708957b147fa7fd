import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from creditaudit import store
from creditaudit.cli import main as cli_main
from creditaudit.config import RunConfig
from creditaudit.data import load_dataset
from creditaudit.errors import CreditAuditError
from creditaudit.runs import load_run, read_status
from creditaudit.train import train_run
from creditaudit.verdict import Thresholds, first_fire_epochs, stop_rule

SMALL = dict(dataset="synthetic", width=32, blocks=2, epochs=4, batch_size=64)


@pytest.fixture(scope="module")
def synthetic(device):
    """The synthetic dataset on the test device: train_run runs where its data are."""
    return load_dataset("synthetic").to(device)


def _metrics_without_time(history):
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in history]


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_bp_learns_digits_quickly(tmp_path, device):
    t0 = time.perf_counter()
    run = train_run(RunConfig(dataset="digits", epochs=4, width=64, blocks=2), tmp_path / "r",
                    progress=False, device=device)
    assert run.status["status"] == "finished"
    assert run.test_acc > 0.9
    assert time.perf_counter() - t0 < 30


def test_same_seed_twice_gives_identical_metrics_and_weights(tmp_path, synthetic):
    config = RunConfig(**SMALL)
    a = train_run(config, tmp_path / "a", data=synthetic, progress=False)
    b = train_run(config, tmp_path / "b", data=synthetic, progress=False)
    assert _metrics_without_time(a.history) == _metrics_without_time(b.history)
    assert _same_weights(a.model, b.model)
    c = train_run(config.replace(seed=7), tmp_path / "c", data=synthetic, progress=False)
    assert _metrics_without_time(c.history) != _metrics_without_time(a.history)


def test_resume_after_kill_equals_uninterrupted(tmp_path, synthetic, monkeypatch, every_epoch):
    config = RunConfig(**SMALL)
    whole = train_run(config, tmp_path / "whole", data=synthetic, progress=False)

    real_save = store.save_checkpoint
    def save_then_die(run_dir, epoch, state, meta, config):
        real_save(run_dir, epoch, state, meta, config)
        if epoch == 2:
            raise KeyboardInterrupt  # the process dies right after epoch 2's checkpoint
    monkeypatch.setattr(store, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_run(config, tmp_path / "killed", data=synthetic, progress=False)
    monkeypatch.setattr(store, "save_checkpoint", real_save)
    assert store.load_checkpoint(tmp_path / "killed")[0]["epoch"] == 2

    resumed = train_run(config, tmp_path / "killed", data=synthetic, progress=False)
    assert resumed.status["status"] == "finished"
    assert _metrics_without_time(resumed.history) == _metrics_without_time(whole.history)
    # the per-example record beside the reported accuracy survives the resume bit for bit
    assert resumed.history[-1]["test_correct"] == whole.history[-1]["test_correct"]
    assert _same_weights(resumed.model, whole.model)
    lines = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["epoch"] for l in lines] == [0, 1, 2, 3, 4]


def test_sigkill_mid_run_then_resume_matches(tmp_path, every_epoch):
    # Every phase runs as its own process with one intra-op thread: float reductions depend on
    # the thread count, and the claim is "same machine, same settings → same bits".
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["train", "--dataset", "synthetic", "--width", "64", "--blocks", "2", "--epochs", "12",
            "--quiet", "--device", "cpu"]
    cmd = lambda out: [sys.executable, "-m", "creditaudit"] + args + ["--out", str(tmp_path / out)]
    subprocess.run(cmd("whole"), env=env, check=True, capture_output=True)
    proc = subprocess.Popen(cmd("k"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = tmp_path / "k" / "checkpoint.json"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if ckpt.exists() and json.loads(ckpt.read_text())["epoch"] >= 3:
            break
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = json.loads(ckpt.read_text())["epoch"]
    subprocess.run(cmd("k"), env=env, check=True, capture_output=True)
    a, b = load_run(tmp_path / "whole"), load_run(tmp_path / "k")
    assert killed_at < 12 or proc.returncode == 0  # it was killed mid-run (or had just finished)
    assert _metrics_without_time(a.history) == _metrics_without_time(b.history)
    assert _same_weights(a.model, b.model)


def test_a_folder_with_another_run_is_refused(tmp_path, synthetic):
    train_run(RunConfig(**SMALL), tmp_path / "r", data=synthetic, progress=False)
    with pytest.raises(CreditAuditError, match="different run"):
        train_run(RunConfig(**SMALL).replace(seed=1), tmp_path / "r", data=synthetic, progress=False)


def test_finished_run_is_reused_not_retrained(tmp_path, synthetic, monkeypatch):
    config = RunConfig(**SMALL)
    train_run(config, tmp_path / "r", data=synthetic, progress=False)
    monkeypatch.setattr("creditaudit.train.build_model",
                        lambda *a, **k: pytest.fail("a finished run was trained again"))
    assert train_run(config, tmp_path / "r", data=synthetic, progress=False).status["status"] == "finished"


def test_divergence_ends_cleanly_keeping_the_last_finite_checkpoint(tmp_path, synthetic):
    run = train_run(RunConfig(**SMALL).replace(lr=1e9, epochs=6), tmp_path / "r", data=synthetic,
                    progress=False)
    if run.status["status"] != "diverged":
        pytest.skip("lr=1e9 did not diverge on this platform")
    assert "non-finite" in run.status["message"]
    meta, state = store.load_checkpoint(tmp_path / "r")
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    assert meta["epoch"] == run.history[-1]["epoch"] == run.status["epochs_completed"]
    assert run.status["epochs_planned"] == 6
    assert read_status(tmp_path / "r") == run.status    # status.json is sealed and matches its checkpoint
    json.loads((tmp_path / "r" / "status.json").read_text())


@pytest.mark.parametrize("argv, needle", [
    (["train", "--method", "nope"], "unknown method"),
    (["train", "--dataset", "cifar10", "--data-dir", "/nonexistent"], "cifar-10-batches-py"),
    (["train", "--trainable-blocks", "9"], "trainable_blocks"),
    (["train", "--epochs", "0"], "epochs"),
    (["train", "--device", "cuda:0"] if not torch.cuda.is_available() else ["train", "--device", "tpu"],
     "device"),
])
def test_cli_user_errors_are_one_clear_line(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert sum(line.startswith("creditaudit: error:") for line in err.splitlines()) == 1


@pytest.mark.parametrize("argv, needle", [
    (["train", "--dataset", "nope"], "invalid choice: 'nope'"),
    (["train", "--arch", "nope"], "invalid choice: 'nope'"),
    (["train", "--lr", "nan"], "finite"),
])
def test_cli_option_values_are_checked_by_the_parser(argv, needle, capsys, tmp_path, monkeypatch):
    """Choices from the registries (datasets, architectures) and malformed values are refused while
    parsing: exit 2, one error line (naming every valid choice), no usage dump, no traceback."""
    monkeypatch.chdir(tmp_path)
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and "usage:" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("creditaudit: error:")
    if "--dataset" in argv:
        from creditaudit.data import DATASET_NAMES
        assert all(f"'{name}'" in err for name in DATASET_NAMES)
    assert not (tmp_path / "runs").exists()


def test_blocks_zero_is_refused_and_lam_sets_the_lam_option(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["train", "--blocks", "0", "--dataset", "digits"]) == 2
    err = capsys.readouterr().err
    assert "--blocks must be ≥ 1" in err and "--shallow" in err
    assert cli_main(["train", "--method", "bp", "--lam", "0.01", "--dataset", "digits"]) == 2
    assert "lam" in capsys.readouterr().err                   # bp declares no λ
    out = tmp_path / "pen"
    assert cli_main(["train", "--method", "dfa-penalty", "--lam", "0.05", "--dataset", "digits",
                     "--width", "16", "--blocks", "1", "--epochs", "1", "--quiet", "--device", "cpu",
                     "--threads", "1", "--out", str(out)]) == 0
    config = load_run(out).config
    assert config.options == {"lam": 0.05, "normalise": 1} and config.lam == 0.05   # resolved: dfa's knob too


SUBCOMMANDS = ("train", "diagnose", "calibrate", "check", "audit", "ladder", "penalty-sweep",
               "identity-check", "thresholds", "report", "lint")


def test_cli_help_and_version(capsys):
    """--help lists every subcommand; each subcommand's --help gives the default of every option
    that takes a value and ends with an examples section."""
    import argparse
    from creditaudit.cli import build_parser
    with pytest.raises(SystemExit) as e:
        cli_main(["--version"])
    assert e.value.code == 0 and "creditaudit" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli_main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    listed = text.split("positional arguments:")[1].split("options:")[0]
    names = [line.split()[0] for line in listed.splitlines() if line.startswith("    ") and line.split()]
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(SUBCOMMANDS) <= set(sub.choices)
    assert set(sub.choices) <= set(names), set(sub.choices) - set(names)    # each one is listed
    assert text.rstrip().split("\n\n")[-1].startswith("examples:")
    missing = []
    for name, parser in sub.choices.items():
        with pytest.raises(SystemExit) as e:
            cli_main([name, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith(f"usage: creditaudit {name}")
        sections = text.rstrip().split("\n\n")
        assert sections[-1].startswith("examples:\n  creditaudit "), name     # ends with examples
        assert all(line.startswith(f"  creditaudit {name}")
                   for line in sections[-1].splitlines()[1:]), name
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0:   # positionals, switches, --help
                continue
            if "(default" not in (action.help or ""):
                missing.append((name, action.option_strings[-1]))
            else:
                assert action.option_strings[-1] in text, (name, action.option_strings)
        if any(a.option_strings and a.nargs != 0 for a in parser._actions):
            assert "(default" in text, name
    assert not missing, f"options whose --help gives no default: {sorted(missing)}"


def test_stop_when_flagged_ends_a_doomed_run_and_records_first_fire(tmp_path, synthetic):
    always = Thresholds(gain=1e9)  # (b′) fires at every epoch, from the init snapshot on
    config = RunConfig(**SMALL).replace(epochs=10, stop_when_flagged=3)
    run = train_run(config, tmp_path / "r", data=synthetic, progress=False,
                    stop_rule=stop_rule(config.stop_when_flagged, always))
    assert run.status["status"] == "stopped"
    assert "--stop-when-flagged 3" in run.status["message"]
    assert run.status["epochs_completed"] == 2      # epochs 0, 1, 2 flagged → stop
    assert run.status["epochs_planned"] == 10
    assert "first_fire" not in run.status           # the verdict's business, read from the history
    first = first_fire_epochs(run.history, always)
    assert first["b_prime"] == 0
    assert first["a"] is None
    assert [r["epoch"] for r in run.history] == [0, 1, 2]
    assert stop_rule(None, always) is None

    never = train_run(RunConfig(**SMALL).replace(stop_when_flagged=1), tmp_path / "n",
                      data=synthetic, progress=False, stop_rule=stop_rule(1, Thresholds()))
    assert never.status["status"] == "finished" and never.history[-1]["epoch"] == SMALL["epochs"]
    assert never.status["epochs_completed"] == never.status["epochs_planned"] == SMALL["epochs"]


def test_a_diverged_run_fires_a_in_its_diagnosis(tmp_path, synthetic):
    from creditaudit.experiments import eval_batches
    from creditaudit.protocol import diagnose
    run = train_run(RunConfig(**SMALL).replace(lr=1e9, epochs=6), tmp_path / "r", data=synthetic,
                    progress=False)
    if run.status["status"] != "diverged":
        pytest.skip("lr=1e9 did not diverge on this platform")
    report = diagnose(run.model, eval_batches(synthetic, 8), diverged=run.status["message"])
    assert report.flags["a"] and report.verdict.startswith("walk back: (a)")
    assert "training diverged" in report.reasons[0]


@pytest.mark.parametrize("kwargs, needle", [
    (dict(method="ep", options={"steps": 0}), "steps"),
    (dict(method="ep", options={"beta": -1.0}), "beta"),
    (dict(method="cb", options={"ema": 1.5}), "ema"),
    (dict(method="sb", options={"draws": 0}), "draws"),
    (dict(method="bp", options={"lam": 0.01}), "lam"),
    (dict(method="dfa", options={"lam": 0.01}), "lam"),
    (dict(method="dfa-penalty", options={"lam": -1.0}), "lam"),
    (dict(stop_when_flagged="3"), "stop_when_flagged"),
])
def test_bad_method_options_and_misplaced_lambda_are_user_errors(kwargs, needle):
    with pytest.raises(CreditAuditError, match=needle):
        RunConfig(**kwargs)


def test_lam_is_a_read_only_view_of_the_lam_option():
    assert RunConfig(method="dfa-penalty").lam == 1e-2               # the method's own default
    assert RunConfig(method="dfa-penalty", options={"lam": 0.1}).lam == 0.1
    assert RunConfig(method="sb").lam == 0.0 and RunConfig(method="bp").lam == 0.0
    with pytest.raises(TypeError):
        RunConfig(method="dfa-penalty", lam=0.1)                     # no longer a field
    with pytest.raises(AttributeError):
        RunConfig(method="dfa-penalty").lam = 0.1
    a, b = RunConfig(method="cb", options={"lam": 1e-2}), RunConfig(method="cb")
    assert a.run_key != b.run_key and "λ=0.01" in a.label


# -- no host in the step, precision, the same run trained once ---------------------------------------
def test_an_epochs_order_and_augmentation_are_drawn_before_its_first_batch(device):
    """Every random number of an epoch is drawn up front (one copy to the device per epoch):
    after the first batch the generator is already where the whole epoch leaves it."""
    from creditaudit.data import ArrayDataset
    g = torch.Generator().manual_seed(0)
    data = ArrayDataset("img", torch.randint(0, 256, (70, 3, 8, 8), generator=g, dtype=torch.uint8),
                        torch.randint(0, 10, (70,), generator=g),
                        torch.randint(0, 256, (10, 3, 8, 8), generator=g, dtype=torch.uint8),
                        torch.randint(0, 10, (10,), generator=g), 10, torch.full((3, 1, 1), 0.5),
                        torch.full((3, 1, 1), 0.25), augment=True).to(device)
    first, whole = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    next(data.train_batches(32, first))
    epoch = list(data.train_batches(32, whole))
    assert torch.equal(first.get_state(), whole.get_state())
    assert [len(y) for _, y in epoch] == [32, 32, 6]
    # the same batches as drawing the order, then every sample's crop and flip, on the CPU
    from creditaudit.data.tensors import crop_flip, draw_crop_flip
    g = torch.Generator().manual_seed(1)
    order = torch.randperm(70, generator=g)
    offsets, flips = draw_crop_flip(70, 4, g)
    want = crop_flip(data.x_train.cpu()[order], 4, offsets, flips).float().div(255)
    want = (want - data.mean.cpu()) / data.std.cpu()
    torch.testing.assert_close(torch.cat([x for x, _ in epoch]).cpu(), want)
    assert torch.equal(torch.cat([y for _, y in epoch]).cpu(), data.y_train.cpu()[order])


def test_bf16_steps_are_recorded_and_the_monitor_stays_fp32(tmp_path, synthetic, monkeypatch):
    """precision = bf16: the steps run under bfloat16 autocast; (a), (b), (b′) are still measured
    in float32 outside it, and the run's config says bf16."""
    from creditaudit import metrics
    from creditaudit.methods.bp import BP
    seen = {"step": set(), "monitor": set()}
    dev = synthetic.device.type
    real_grads, real_bp = BP.gradients, metrics.bp_gradients

    def grads(self, x, y):
        seen["step"].add(torch.is_autocast_enabled(dev))
        return real_grads(self, x, y)

    def bp(model, x, y):
        out = real_bp(model, x, y)
        seen["monitor"].add((torch.is_autocast_enabled(dev), *(g.dtype for g in out.grads)))
        return out
    monkeypatch.setattr(BP, "gradients", grads)
    monkeypatch.setattr(metrics, "bp_gradients", bp)
    config = RunConfig(**SMALL).replace(epochs=2, precision="bf16")
    run = train_run(config, tmp_path / "r", data=synthetic, progress=False)
    assert run.status["status"] == "finished"
    assert seen["step"] == {True}
    assert seen["monitor"] == {(False, torch.float32, torch.float32, torch.float32)}
    assert json.loads((tmp_path / "r" / "config.json").read_text())["precision"] == "bf16"
    assert all(isinstance(v, float) for v in run.history[-1]["g_norms"])
    with pytest.raises(CreditAuditError, match="precision"):
        RunConfig(precision="fp16")


def test_a_penalty_sweep_trains_one_frozen_control_equal_to_a_separate_one(tmp_path, device):
    """λ acts only on trainable blocks, so dfa-penalty's frozen control is the same run for every
    λ: the sweep trains it once, and it is bit-identical to one trained under another λ."""
    from creditaudit.experiments import penalty_sweep
    from creditaudit.experiments.common import Execution
    base = RunConfig(method="dfa-penalty", dataset="digits", width=16, blocks=2, epochs=2)
    result = penalty_sweep([base], tmp_path / "sweep", lambdas=(1e-3, 1e-1),
                           execution=Execution(device=str(device), jobs=1), progress=False)
    frozen = [r for r in result["runs"] if r["control"] == "frozen"]
    assert len(frozen) == 1 and len(result["runs"]) == 3
    assert [row["frozen_acc"] for row in result["rows"]] == [frozen[0]["test_acc"]] * 2
    separate = train_run(base.replace(options={"lam": 1e-3}, trainable_blocks=0), tmp_path / "alone",
                         data=load_dataset("digits").to(device), progress=False)
    shared = load_run(frozen[0]["run_dir"], device)
    assert _same_weights(shared.model, separate.model)
    assert _metrics_without_time(shared.history) == _metrics_without_time(separate.history)


def test_a_step_that_fails_to_compile_trains_eagerly_with_a_warning(synthetic, monkeypatch):
    """The compiled step is an optimisation: if compiling fails (its first call raises before
    anything is updated), the step's gradients are computed eagerly — the optimizer steps once —
    and the run goes on eagerly, saying so once."""
    from creditaudit.runs import build_method, build_model
    from creditaudit.train import step_runner
    config = RunConfig(**SMALL)
    model = build_model(config, synthetic.input_shape, synthetic.n_classes).to(synthetic.device)
    twin = build_model(config, synthetic.input_shape, synthetic.n_classes).to(synthetic.device)
    method, reference = build_method(config, model), build_method(config, twin)
    calls = []

    def broken(fn, **options):
        def compiled(x, y):
            calls.append(options["mode"])
            raise RuntimeError("Unsupported: a graph break\nmore detail")
        return compiled
    monkeypatch.setattr(torch, "compile", broken)
    step = step_runner(method, "default")
    x, y = synthetic.eval_batch(0)
    with pytest.warns(UserWarning, match=r"compiling the bp step failed .*a graph break\); training eagerly"):
        loss = step(x, y)
    torch.testing.assert_close(loss, reference.train_step(x, y))
    step(x, y)                                                  # eager from now on: no second try
    reference.train_step(x, y)
    assert calls == ["default"]
    assert _same_weights(model, twin)                           # one optimizer step per batch
    assert step_runner(method, None) == method.train_step


def test_the_canonical_control_drops_only_options_that_act_on_trainable_blocks():
    from creditaudit.runs import canonical_control
    for method in ("dfa-penalty", "sb", "cb"):
        spelled = RunConfig(method=method, options={"lam": 0.0}).options     # resolved, with λ = 0
        main = RunConfig(method=method, options={"lam": 1e-3})
        frozen = canonical_control(main.replace(trainable_blocks=0))
        assert frozen.options == spelled and frozen.trainable_blocks == 0 and frozen.lam == 0
        assert canonical_control(main.replace(blocks=0)).options == spelled     # shallow: no blocks
        assert canonical_control(RunConfig(method=method, trainable_blocks=0)) == frozen   # default λ
        assert frozen == canonical_control(main.replace(options={"lam": 0.1}, trainable_blocks=0))
        assert canonical_control(main) == main                                   # blocks train: λ acts
        assert canonical_control(main.replace(trainable_blocks=1)) == main.replace(trainable_blocks=1)
    ep = RunConfig(method="ep", options={"beta": 0.5}, trainable_blocks=0)
    assert canonical_control(ep) == ep                                           # β acts on the embedding too


@pytest.mark.parametrize("method", ["bp", "fa", "ep"])
def test_controls_train_without_alignment_probes_and_as_before(tmp_path, synthetic, method, monkeypatch):
    """A frozen or shallow control records no alignment (nothing reads a control's Γ; its credit
    runs only to train its embedding), its main run does at epoch 0, every k-th and the last; and
    skipping the probes changes nothing a control trains: the same weights and accuracy as with a
    probe at every epoch forced through (probing runs under a forked RNG)."""
    from creditaudit import train as train_module
    config = RunConfig(method=method, **SMALL)
    main = train_run(config, tmp_path / "main", data=synthetic, progress=False)
    assert all("gamma" in r for r in main.history)                     # 4 epochs: every one probed
    for control in (config.replace(trainable_blocks=0), config.replace(blocks=0)):
        run = train_run(control, tmp_path / control.control, data=synthetic, progress=False)
        assert run.finished and not any("gamma" in r or "weight_alignment" in r for r in run.history)
        real = train_module._probes_alignment
        monkeypatch.setattr(train_module, "_probes_alignment", lambda c, e, every: True)
        probed = train_run(control, tmp_path / f"{control.control}-probed", data=synthetic, progress=False)
        monkeypatch.setattr(train_module, "_probes_alignment", real)
        assert _same_weights(run.model, probed.model)
        assert [r["test_acc"] for r in run.history] == [r["test_acc"] for r in probed.history]


def test_bp_forms_no_gradient_for_a_frozen_block_and_trains_as_backward_did(tmp_path, synthetic):
    """bp takes the gradients of its optimised parameters alone: a frozen block gets none (it was
    a third of that block's backward), and the trained parameters' gradients are loss.backward()'s."""
    from creditaudit.methods import MethodSettings, method_class
    from creditaudit.model import build_model
    torch.manual_seed(0)
    x, y = synthetic.x_train[:64], synthetic.y_train[:64]
    for trainable in ((), (0,), (0, 1)):
        model = build_model("resmlp", synthetic.input_shape, synthetic.n_classes, width=32, blocks=2).to(x.device)
        method = method_class("bp")(model, MethodSettings(epochs=1, seed=0, lr=1e-3, trainable_blocks=trainable))
        method.clear_gradients()
        method.gradients(x, y)
        got = {n: p.grad for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        model.loss(model(x), y).backward()
        for n, p in model.named_parameters():
            frozen = n.startswith("blocks.") and int(n.split(".")[1]) not in trainable
            if frozen:
                assert got[n] is None, n
            else:
                assert torch.equal(got[n], p.grad), n


@pytest.mark.parametrize("method", ["bp", "fa"])
def test_a_stack_forms_no_gradient_for_a_block_no_member_trains(synthetic, method):
    """A lone run trains as a stack of one: a block that no member trains gets no gradient (its
    weights require none), while a block one member trains still gets one for every member (the
    stack masks the frozen member's slice)."""
    from creditaudit.methods import MethodSettings, method_class
    from creditaudit.methods.members import MemberStack
    from creditaudit.model import build_model
    x, y = synthetic.x_train[:64], synthetic.y_train[:64]

    def stack(*trainable):
        methods = []
        for k, blocks in enumerate(trainable):
            torch.manual_seed(k)
            model = build_model("resmlp", synthetic.input_shape, synthetic.n_classes, width=32, blocks=2).to(x.device)
            methods.append(method_class(method)(model, MethodSettings(epochs=1, seed=k, lr=1e-3,
                                                                      trainable_blocks=blocks)))
        return MemberStack(methods)
    for trainable, trained in ((((),), ()), (((), (1,)), (1,)), (((0, 1),), (0, 1))):
        s = stack(*trainable)
        s.train_step(torch.stack([x] * len(trainable)), torch.stack([y] * len(trainable)))
        for name, p in s.net.params.items():
            if name.startswith("blocks."):
                l = int(name.split(".")[1])
                assert p.requires_grad == (l in trained) and (p.grad is not None) == (l in trained), name
            else:
                assert p.grad is not None, name


# -- checkpoints every CHECKPOINT_SECONDS ------------------------------------------------------------
def _counting_saves(monkeypatch):
    saved = []
    real_save = store.save_checkpoint

    def counting(run_dir, epoch, state, meta, config):
        saved.append(epoch)
        real_save(run_dir, epoch, state, meta, config)
    monkeypatch.setattr(store, "save_checkpoint", counting)
    return saved


def test_a_run_shorter_than_the_interval_writes_one_checkpoint_at_its_end(tmp_path, synthetic, monkeypatch):
    from creditaudit.train import CHECKPOINT_ENV
    monkeypatch.delenv(CHECKPOINT_ENV, raising=False)
    saved = _counting_saves(monkeypatch)
    run = train_run(RunConfig(**SMALL), tmp_path / "r", data=synthetic, progress=False)
    assert saved == [4]                 # epochs 0–3 stayed in memory: 4 epochs take far under 10 s
    assert run.status["status"] == "finished" and store.load_checkpoint(tmp_path / "r")[0]["epoch"] == 4
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [0, 1, 2, 3, 4]


def test_the_interval_comes_from_the_environment(tmp_path, synthetic, monkeypatch, every_epoch):
    saved = _counting_saves(monkeypatch)
    train_run(RunConfig(**SMALL), tmp_path / "r", data=synthetic, progress=False)
    assert saved == [0, 1, 2, 3, 4]     # 0: after every epoch


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "inf"])
def test_a_bad_interval_is_refused_before_training(tmp_path, synthetic, monkeypatch, value):
    from creditaudit.train import CHECKPOINT_ENV
    monkeypatch.setenv(CHECKPOINT_ENV, value)
    with pytest.raises(CreditAuditError, match=f"{CHECKPOINT_ENV}=.* is not a number of seconds"):
        train_run(RunConfig(**SMALL), tmp_path / "r", data=synthetic, progress=False)
    assert not (tmp_path / "r").exists()


def test_an_interrupted_run_writes_its_last_epoch_and_resumes_to_the_same_bits(tmp_path, synthetic,
                                                                              monkeypatch):
    """Ctrl-C in the middle of epoch 3, no checkpoint written yet (the interval is not reached):
    the state after epoch 2, kept in memory, is written on the way out, and the resumed run ends
    with the uninterrupted run's weights and metrics."""
    from creditaudit.methods.members import MemberStack
    from creditaudit.train import CHECKPOINT_ENV
    monkeypatch.delenv(CHECKPOINT_ENV, raising=False)
    config = RunConfig(**SMALL)
    whole = train_run(config, tmp_path / "whole", data=synthetic, progress=False)
    per_epoch = -(-len(synthetic.y_train) // config.batch_size)
    real_step, steps = MemberStack.train_step, []

    def step_then_stop(self, x, y):
        steps.append(1)
        if len(steps) == 2 * per_epoch + 2:         # epoch 3's second batch
            raise KeyboardInterrupt
        return real_step(self, x, y)
    monkeypatch.setattr(MemberStack, "train_step", step_then_stop)
    saved = _counting_saves(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        train_run(config, tmp_path / "killed", data=synthetic, progress=False)
    assert saved == [2]
    assert store.load_checkpoint(tmp_path / "killed")[0]["epoch"] == 2
    assert not (tmp_path / "killed" / "status.json").exists()
    lines = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [0, 1, 2]
    monkeypatch.setattr(MemberStack, "train_step", real_step)
    resumed = train_run(config, tmp_path / "killed", data=synthetic, progress=False)
    assert _metrics_without_time(resumed.history) == _metrics_without_time(whole.history)
    assert _same_weights(resumed.model, whole.model)


def test_a_failed_first_write_does_not_say_nothing_was_trained(tmp_path, synthetic, monkeypatch):
    from creditaudit.train import CHECKPOINT_ENV
    monkeypatch.delenv(CHECKPOINT_ENV, raising=False)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(store, "save_checkpoint", full)
    with pytest.raises(CreditAuditError) as err:
        train_run(RunConfig(**SMALL), tmp_path / "r", data=synthetic, progress=False)
    assert "No space left on device" in str(err.value)
    assert "no checkpoint is kept yet" in str(err.value) and "nothing was trained" not in str(err.value)
