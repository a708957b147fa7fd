"""The yardstick is evidence too, and every accuracy carries the test set it was measured on
(issue 34, items 1, 2 and 7): a yardstick as weak as a control, a yardstick that is the control, a
yardstick built from a patched backprop, and a control measured on rigged test batches — each
through the entrance a user would take, on tiny models (digits, width 16, 2 blocks, 1–2 epochs).
Honest controls and yardsticks keep their verdicts."""
from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

import creditaudit
from creditaudit.cli import main as cli_main
from creditaudit.errors import CreditAuditError
from creditaudit.model import ResidualMLP

FACTORY = '''
import torch
from creditaudit.model import ResidualMLP

def make():
    torch.manual_seed(0)
    return ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
'''


def cli(argv, capsys) -> tuple[int, str, str]:
    code = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(code, err, *needles) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("creditaudit: error:"), (code, err)
    for needle in needles:
        assert re.search(needle, lines[0], re.I), (needle, lines[0])
    return lines[0]


# -- --model: the yardstick a user brings ---------------------------------------------------------
@pytest.fixture(scope="module")
def weights(tmp_path_factory, digits):
    """init, trained (every block), frozen (blocks at init, the rest by bp), yard (the same, another
    lr: an honest yardstick of its own) and eps (init + 1e-6 on the embedding and readout: an
    untrained model that passes for a trained control) as safetensors files."""
    from safetensors.torch import save_file
    from creditaudit.methods import MethodSettings, method_class
    root = tmp_path_factory.mktemp("yardweights")
    (root / "yardnets2.py").write_text(FACTORY)
    torch.manual_seed(0)
    init = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
    states = {"init": init.state_dict()}
    for name, blocks, lr in (("trained", (0, 1), 1e-2), ("frozen", (), 1e-2), ("yard", (), 5e-3)):
        model = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
        model.load_state_dict(init.state_dict())
        bp = method_class("bp")(model, MethodSettings(epochs=2, trainable_blocks=blocks, lr=lr))
        for _ in range(2):
            for x, y in digits.train_batches(128, torch.Generator().manual_seed(0)):
                bp.train_step(x, y)
        states[name] = model.state_dict()
    blocks = {n for n, _ in init.named_parameters() if n.startswith("blocks.")}
    states["eps"] = {n: (t + 1e-6 if t.is_floating_point() and n not in blocks else t.clone())
                     for n, t in init.state_dict().items()}
    for name, state in states.items():
        save_file({k: v.contiguous() for k, v in state.items()}, str(root / f"{name}.safetensors"))
    return root


@pytest.fixture
def model_args(weights, monkeypatch):
    monkeypatch.syspath_prepend(str(weights))
    return ["--model", "yardnets2:make", "--weights", weights / "trained.safetensors", "--dataset", "digits",
            "--eval-batches", 2, "--threads", 1, "--device", "cpu",
            "--init-weights", weights / "init.safetensors"]


def test_a_nudged_control_as_its_own_yardstick_is_refused_and_never_trustworthy(weights, model_args, capsys):
    """The issue's input: control and yardstick both the untrained weights + 1e-6. The yardstick
    does not beat the untrained model, so it is refused in one line calling it the yardstick; and
    the same nudged control alone never switches its own check off (not trustworthy, check ≠ 0)."""
    eps = weights / "eps.safetensors"
    code, _, err = cli(["check", *model_args, "--frozen-control", eps, "--yardstick", eps], capsys)
    line = one_error_line(code, err, "untrained model|control's own weights")
    assert line.startswith("creditaudit: error: the yardstick ")
    code, out, _ = cli(["check", *model_args, "--frozen-control", eps, "--json"], capsys)
    assert code != 0 and not json.loads(out)["verdicts"][0]["verdict"].startswith("trustworthy")


def test_a_yardstick_as_weak_as_the_untrained_model_is_refused(weights, model_args, capsys):
    """An honest control with a yardstick that learnt nothing (init + 1e-6): refused, by name."""
    code, _, err = cli(["check", *model_args, "--frozen-control", weights / "frozen.safetensors",
                        "--yardstick", weights / "eps.safetensors"], capsys)
    one_error_line(code, err, "the yardstick .*eps", "does not beat the untrained model")


def test_the_control_itself_as_its_yardstick_is_refused(weights, model_args, capsys):
    """The control's own file as its yardstick (a trained one: it beats the untrained model)."""
    frozen = weights / "frozen.safetensors"
    code, _, err = cli(["check", *model_args, "--frozen-control", frozen, "--yardstick", frozen], capsys)
    one_error_line(code, err, "the yardstick", "control's own weights")


def test_a_yardstick_refusal_calls_it_the_yardstick(weights, model_args, capsys):
    """The initial weights as the yardstick (nothing trained): refused as "the yardstick", not as
    "the frozen control"."""
    code, _, err = cli(["diagnose", *model_args, "--frozen-control", weights / "frozen.safetensors",
                        "--yardstick", weights / "init.safetensors"], capsys)
    line = one_error_line(code, err, "never trained its embedding")
    assert line.startswith("creditaudit: error: the yardstick ") and "the frozen control" not in line


def test_an_honest_yardstick_is_still_accepted(weights, model_args, capsys):
    """A bp-trained control with a bp-trained yardstick of its own: admitted, not weak, and (d)
    measured against the control as before."""
    code, out, err = cli(["diagnose", *model_args, "--json", "--frozen-control", weights / "frozen.safetensors",
                          "--yardstick", weights / "yard.safetensors"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["depth"]["frozen_acc"] is not None and "weak control" not in report["verdict"]


# -- every accuracy carries the test set it was measured on ---------------------------------------
def _epoch(net, mon, digits, lr, epochs=1):
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr)
    for _ in range(epochs):
        for x, y in digits.train_batches(128, torch.Generator().manual_seed(0)):
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad(), loss.backward(), opt.step()
            mon.step(loss.detach(), len(y))
        mon.epoch_end()


@pytest.fixture
def monitored_run(tmp_path, digits):
    """A finished Monitor run on the test batches `test`, and a function training its frozen
    control (`control_of`) on given test batches (or claimed accuracies when None)."""
    torch.manual_seed(0)
    model = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
    test = [digits.eval_batch(0, 360)]
    mon = creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "run", epochs=1, seed=0, test_batches=test)
    _epoch(model, mon, digits, 1e-2)
    mon.finish()

    def control(name, batches, lr=1e-2):
        net = mon.frozen_control()
        ctrl = creditaudit.Monitor(net, digits.eval_batch(0), tmp_path / name, epochs=1, seed=0,
                                   test_batches=batches, control_of=mon)
        if batches is None:               # a claimed accuracy, measured by the user on anything
            opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr)
            for x, y in digits.train_batches(128, torch.Generator().manual_seed(0)):
                loss = F.cross_entropy(net(x), y)
                opt.zero_grad(), loss.backward(), opt.step()
                ctrl.step(loss.detach(), len(y))
            ctrl.epoch_end(test_acc=0.2)
        else:
            _epoch(net, ctrl, digits, lr)
        return ctrl
    return mon, test, control


def test_every_monitor_accuracy_records_the_digest_of_its_test_batches(monitored_run, digits):
    """Each record and the status carry `test_digest` = data.batches_digest of the test batches,
    however they are batched; another label changes it."""
    from creditaudit.data.tensors import batches_digest
    from creditaudit.monitored import load_monitored
    mon, test, _ = monitored_run
    run = load_monitored(mon.out)
    digest = batches_digest(test)
    x, y = test[0]
    assert batches_digest([(x[:100], y[:100]), (x[100:], y[100:])]) == digest      # batching
    assert batches_digest([(x.flip(0), y.flip(0))]) == digest                       # order
    assert batches_digest([(x, y.roll(1))]) != digest                               # labels
    assert [r["test_digest"] for r in run.history] == [digest] * 2
    assert run.info["test_digest"] == digest and run.status["test_digest"] == digest


def test_a_control_measured_on_rigged_test_batches_is_refused(monitored_run, tmp_path):
    """The issue's input: the control's Monitor gets the same test set with 60 % of its labels
    shifted. Its accuracy is not comparable with the run's: refused in one line when it finishes
    (it hands itself to its run) and by audit_own_runs — never a (d) against it."""
    mon, test, control = monitored_run
    x, y = test[0]
    rigged = y.clone()
    k = int(0.6 * len(y))
    rigged[:k] = (rigged[:k] + 1) % 10
    with pytest.raises(CreditAuditError, match="measured on other test batches than its run"):
        control("ctrl", [(x, rigged)]).finish()
    assert (mon.report.to_dict().get("depth") or {}).get("frozen_acc") is None     # the run keeps no (d)
    with pytest.raises(CreditAuditError, match="the frozen control .*ctrl was measured on other test batches"):
        creditaudit.audit_own_runs([mon.out], [tmp_path / "ctrl"], out=tmp_path / "own", n_test=360, quiet=True)


def test_a_control_with_a_claimed_accuracy_leaves_d_unevaluated(monitored_run, tmp_path):
    """A control whose accuracy is the user's claim (no test_batches: no digest) is unverified:
    (d) is not evaluated, so the run is never "trustworthy" on its word."""
    mon, _, control = monitored_run
    control("claimed", None).finish()
    report = mon.report.to_dict()
    assert (report.get("depth") or {}).get("frozen_acc") is None
    assert report["verdicts"]["project"]["outcome"] != "trustworthy"
    assert "no digest of the test batches" in json.dumps(report, ensure_ascii=False)


def test_an_honest_monitor_control_is_still_admitted(monitored_run, tmp_path):
    """The same test batches for run and control: (d) is measured against the control, as before."""
    mon, test, control = monitored_run
    ctrl = control("ctrl", test)
    ctrl.finish()
    depth = mon.report.to_dict()["depth"]
    assert depth["frozen_acc"] == pytest.approx(ctrl.history[-1]["test_acc"])
    own = creditaudit.audit_own_runs([mon.out], [ctrl.out], out=tmp_path / "own", n_test=360, quiet=True)
    assert own["methods"][0]["per_seed"]["0"]["frozen_acc"] == pytest.approx(depth["frozen_acc"])


# -- the audit's own yardstick: the project's backprop, verified by what it computes ---------------
PATCHER = '''
from creditaudit.methods.bp import BP
from creditaudit.metrics import bp_gradients

_grads = BP.gradients

def _nudge(self, x, y):                 # every step 1e-3 of backprop's: the yardstick barely trains
    loss = _grads(self, x, y)
    for p in self.model.parameters():
        if p.grad is not None:
            p.grad.mul_(1e-3)
    return loss

BP.gradients = _nudge
BP.credit = lambda self, x, y: [g.roll(1, 0) for g in bp_gradients(self.model, x, y).grads]

class Patcher(BP):
    """Trains like backprop; importing it patches the project's BP."""
'''


def test_an_audit_yardstick_from_a_patched_backprop_is_refused(tmp_path, monkeypatch):
    """A user rule module that patches creditaudit's BP on import (its step nudged, its credit
    rolled): the audit's bp yardstick is refused (its rule is not the project's), so no seed's (d)
    is evaluated against it, and no run is "trustworthy"."""
    from creditaudit.config import RunConfig
    from creditaudit.experiments.common import Execution, run_all
    from creditaudit.methods.bp import BP
    monkeypatch.setattr(BP, "gradients", BP.gradients)      # restored after the test
    monkeypatch.setattr(BP, "credit", BP.credit)
    (tmp_path / "bppatcher.py").write_text(PATCHER)
    monkeypatch.syspath_prepend(str(tmp_path))
    main = RunConfig(method="bppatcher:Patcher", dataset="digits", width=16, blocks=2, epochs=1, seed=0)
    frozen, yard = main.replace(trainable_blocks=0), main.replace(method="bp", trainable_blocks=0)
    outcomes = run_all([main, frozen, yard], tmp_path / "out", execution=Execution(jobs=1, device="cpu"),
                       frozen_of=lambda c: frozen.bind_data(c.data_digest) if c.control == "none" else None,
                       yardstick_of=lambda c: yard, progress=False)
    by = {o.config.method + o.config.control: o for o in outcomes}
    assert by["bpfrozen"].status == "refused" and "not the project's bp" in by["bpfrozen"].message
    run = by["bppatcher:Patchernone"]
    if run.report is None:
        # the patched rule also inherits bp's exact positions while its credit is rolled: its own
        # diagnosis is refused for that false declaration (issue 34 item 6), so no verdict at all
        assert "exact_positions declares" in run.message
        return
    report = run.report
    assert report["depth"]["frozen_acc"] is None if report.get("depth") else True
    assert any("the yardstick" in m for m in report["missing_evidence"]), report["missing_evidence"]
    assert report["verdicts"]["project"]["outcome"] != "trustworthy"


def test_the_yardstick_check_measures_the_credit_of_the_rule(tmp_path, digits):
    """Verified by what it computes: bp's credit has Γ = 1 at every position on a probe batch; a
    credit rolled across the batch (a patch the code check would not see, e.g. of a helper) has
    Γ < 1 and the gate refuses it."""
    from dataclasses import replace
    from creditaudit import evidence
    from creditaudit.config import RunConfig
    from creditaudit.runs import load_run, yardstick_evidence
    from creditaudit.train import train_run
    config = RunConfig(method="bp", dataset="digits", width=16, blocks=2, epochs=1, seed=0, trainable_blocks=0)
    train_run(config.bind_data(digits.digest), tmp_path / "yard", data=digits, progress=False)
    run = load_run(tmp_path / "yard", "cpu")
    x, y = digits.eval_batch(0)
    ev = yardstick_evidence(run, x, y, init_acc=0.1)
    assert ev.mismatch is None and ev.credit_cos == pytest.approx(1.0, abs=1e-9)
    assert evidence.gate_yardstick(ev, 0.02) == pytest.approx(run.test_acc)
    true_credit = run.method.credit
    run.method.credit = lambda x, y: [g.roll(1, 0) for g in true_credit(x, y)]
    rolled = yardstick_evidence(run, x, y, init_acc=0.1)
    assert rolled.credit_cos < 0.99
    with pytest.raises(CreditAuditError, match="the yardstick .* not trained by exact gradients"):
        evidence.gate_yardstick(rolled, 0.02)
    with pytest.raises(CreditAuditError, match="the yardstick .* does not beat the untrained model"):
        evidence.gate_yardstick(replace(ev, init_acc=run.test_acc), 0.02)


def test_the_test_digest_survives_stacking_and_resume(tmp_path, digits, monkeypatch, every_epoch):
    """Run folders: every record and the status carry the digest of the test set the accuracy was
    measured on (data.test_digest), for stacked members, a member resumed from its checkpoint, and
    a lone run alike; another test set has another digest."""
    from creditaudit import store
    from creditaudit.config import RunConfig
    from creditaudit.data.tensors import batches_digest
    from creditaudit.runs import load_run, read_status
    from creditaudit.train import train_run, train_runs
    base = RunConfig(method="bp", dataset="digits", width=16, blocks=2, epochs=2, batch_size=128)
    configs = [c.bind_data(digits.digest) for c in (base, base.replace(seed=1))]
    dirs = [tmp_path / "m0", tmp_path / "m1"]
    real_save = store.save_checkpoint

    def dying_save(run_dir, epoch, *args, **kwargs):
        real_save(run_dir, epoch, *args, **kwargs)
        if epoch == 1 and run_dir.name == "m1":
            raise KeyboardInterrupt
    monkeypatch.setattr(store, "save_checkpoint", dying_save)
    with pytest.raises(KeyboardInterrupt):
        train_runs(configs, dirs, data=digits, progress=False)
    monkeypatch.setattr(store, "save_checkpoint", real_save)
    trained = train_runs(configs, dirs, data=digits, progress=False)
    assert trained[0].stack_size == 2                          # resumed together, from epoch 1
    train_run(configs[0], tmp_path / "lone", data=digits, progress=False)
    digest = digits.test_digest
    assert digest == batches_digest(digits.eval_batches("test", 128))
    for d in (*dirs, tmp_path / "lone"):
        assert [r["test_digest"] for r in load_run(d).history] == [digest] * 3, d
        assert read_status(d)["test_digest"] == digest
    x, y = digits.x_test, digits.y_test
    assert batches_digest(digits.eval_batches("test")) != batches_digest([(digits.prepare(x), y.roll(1))])
