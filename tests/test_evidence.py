"""The evidence gate (issue 22, items 1–3): one record, one function, every entrance through it;
and each case of what the gate refuses or marks "not evaluated", through the entrance a user
would take."""
from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import creditaudit
from creditaudit import store
from creditaudit.cli import main as cli_main
from creditaudit.errors import CreditAuditError, CreditAuditWarning
from creditaudit.model import ResidualMLP, ResidualStream
from creditaudit.protocol import diagnose
from creditaudit.depth import depth_decision
from creditaudit.verdict import SeedEvidence, Thresholds, fires_d, method_verdict

TINY = ["--dataset", "digits", "--width", "16", "--blocks", "2", "--quiet", "--threads", "1",
        "--device", "cpu"]

RULES = '''
import sys
from creditaudit.methods.bp import BP

class HeadlessBP(BP):
    """BP that never updates the embedding or the head: with frozen blocks nothing trains."""
    def gradients(self, x, y):
        loss = super().gradients(x, y)
        for p in [*self.model.embed_parameters(), *self.model.head_parameters()]:
            p.grad = None
        return loss

class ExitingBP(BP):
    """BP whose step ends the process, as a rule with a stray sys.exit(0) would."""
    def gradients(self, x, y):
        sys.exit(0)
'''

FACTORIES = '''
import sys
import torch
from creditaudit.model import ResidualMLP

def make():
    torch.manual_seed(0)
    return ResidualMLP(64, d=16, n_blocks=2, n_classes=10)

def exits():
    sys.exit(0)
'''


def cli(argv, capsys) -> tuple[int, str, str]:
    try:
        code = cli_main([str(a) for a in argv])
    except SystemExit as exc:           # what a user's sys.exit did to the command on main
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def quiet(argv) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return cli_main([str(a) for a in argv])


def one_error_line(code, err, *needles) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("creditaudit: error:"), (code, err)
    for needle in needles:
        assert re.search(needle, lines[0], re.I), (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    root = tmp_path_factory.mktemp("pkg")
    (root / "gaterules.py").write_text(RULES)
    (root / "gatenets.py").write_text(FACTORIES)
    return root


@pytest.fixture(autouse=True)
def _on_path(pkg, monkeypatch):
    monkeypatch.syspath_prepend(str(pkg))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pkg):
    """Trainer run folders: a bp run and its frozen control; a rule's run whose frozen control
    never trained (HeadlessBP); another seed's bp run."""
    import sys
    sys.path.insert(0, str(pkg))
    root = tmp_path_factory.mktemp("runs")
    for name, extra in (("run", ["--method", "bp", "--seed", 0]),
                        ("ctrl", ["--method", "bp", "--seed", 0, "--frozen"]),
                        ("other", ["--method", "bp", "--seed", 1]),
                        ("headless", ["--method", "gaterules:HeadlessBP", "--seed", 0]),
                        ("headless_ctrl", ["--method", "gaterules:HeadlessBP", "--seed", 0, "--frozen"])):
        assert quiet(["train", *TINY, "--epochs", 2, *extra, "--out", root / name]) == 0
    sys.path.remove(str(pkg))
    return root


@pytest.fixture(scope="module")
def weights(tmp_path_factory, digits):
    """A model trained elsewhere: init, trained and frozen-control weights (safetensors)."""
    from safetensors.torch import save_file
    from creditaudit.methods import MethodSettings, method_class
    root = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    init = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
    states = {"init": init.state_dict()}
    for name, blocks in (("trained", (0, 1)), ("frozen", ())):
        model = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
        model.load_state_dict(init.state_dict())
        bp = method_class("bp")(model, MethodSettings(epochs=2, trainable_blocks=blocks, lr=3e-3))
        gen = torch.Generator().manual_seed(0)
        for _ in range(2):
            for x, y in digits.train_batches(128, gen):
                bp.train_step(x, y)
        states[name] = model.state_dict()
    nan = {k: v.clone() for k, v in states["frozen"].items()}
    nan["out_head.bias"][0] = float("nan")              # a control whose outputs are NaN
    states["nan"] = nan
    for name, state in states.items():
        save_file({k: v.contiguous() for k, v in state.items()}, str(root / f"{name}.safetensors"))
    return root


def _user(weights: Path, *extra) -> list:
    return ["--model", "gatenets:make", "--weights", weights / "trained.safetensors", "--dataset",
            "digits", "--eval-batches", 2, "--threads", 1, "--device", "cpu", *extra]


def _bp_epoch(model, data, mon, gen, opt, n=None):
    for x, y in data.train_batches(128, gen):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mon.step(loss.detach(), len(y) if n is None else n)


def _monitored(tmp_path, digits, name="run", epochs=1, control=True, break_control=None):
    """A monitored bp run (and its frozen control, trained like it); returns (mon, ctrl)."""
    torch.manual_seed(0)
    model = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
    test = [digits.eval_batch(0, 360)]
    mon = creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / name, epochs=epochs, seed=0,
                              test_batches=test)
    opt = torch.optim.AdamW(model.parameters(), 1e-2)
    for _ in range(epochs):
        _bp_epoch(model, digits, mon, torch.Generator().manual_seed(0), opt)
        mon.epoch_end()
    mon.finish()
    if not control:
        return mon, None
    control = mon.frozen_control()
    ctrl = creditaudit.Monitor(control, digits.eval_batch(0), tmp_path / f"{name}_ctrl", epochs=epochs,
                               seed=0, test_batches=test, control_of=mon)
    opt = torch.optim.AdamW([p for p in control.parameters() if p.requires_grad], 1e-2)
    for _ in range(epochs):
        _bp_epoch(control, digits, ctrl, torch.Generator().manual_seed(0), opt)
        if break_control is not None:
            break_control(control)
        ctrl.epoch_end()
    ctrl.finish()
    return mon, ctrl


# -- 1. one gate: every entrance hands its evidence to evidence.gate ----------------------------------
@pytest.fixture
def spy(monkeypatch):
    from creditaudit import evidence
    calls: list = []
    real = evidence.gate

    def gate(ev):
        assert isinstance(ev, evidence.Evidence)
        calls.append(ev)
        return real(ev)
    monkeypatch.setattr(evidence, "gate", gate)
    return calls


def test_every_entrance_calls_the_one_gate(spy, runs, weights, tmp_path, capsys, digits):
    def through(what, fn, *, control=True):
        spy.clear()
        fn()
        assert spy, f"{what} never called evidence.gate"
        if control:
            assert any(ev.control is not None for ev in spy), f"{what} gave the gate no control"
    # the command line: a run folder with its control, a model trained elsewhere, check
    through("diagnose RUN --frozen-control",
            lambda: quiet(["diagnose", runs / "run", "--frozen-control", runs / "ctrl",
                           "--eval-batches", 2, "--threads", 1, "--device", "cpu"]))
    through("diagnose --model --frozen-control",
            lambda: quiet(["diagnose", *_user(weights, "--frozen-control", weights / "frozen.safetensors",
                                              "--init-weights", weights / "init.safetensors")]))
    through("check RUN", lambda: quiet(["check", runs / "run"]), control=False)
    assert spy[-1].check_binding
    # the audit (a PKG:CLASS rule goes the same way: the trainer trains it)
    (tmp_path / "a.toml").write_text('controls = ["frozen"]\n[model]\nwidth = 16\nblocks = 2\n')
    through("audit", lambda: quiet(["audit", "--config", tmp_path / "a.toml", "--dataset", "digits",
                                    "--methods", "bp", "--seeds", 0, "--epochs", 1, "--out",
                                    tmp_path / "aud", "--jobs", 1, "--device", "cpu", "--quiet"]))
    # the Monitor (its control's finish re-diagnoses the run with (d)), and audit_own_runs
    through("Monitor", lambda: _monitored(tmp_path, digits))
    through("audit_own_runs", lambda: creditaudit.audit_own_runs(
        [tmp_path / "run"], [tmp_path / "run_ctrl"], out=tmp_path / "own", n_test=360))
    through("diagnose MONITORED_RUN", lambda: quiet(["diagnose", tmp_path / "run"]), control=False)


def test_the_lightning_callback_goes_through_the_gate(spy, tmp_path, digits):
    L = pytest.importorskip("lightning")
    from creditaudit.lightning import CreditAuditCallback
    module, cb, loader = _lightning(tmp_path, digits, "run")
    _fit(L, module, cb, loader, max_epochs=1)
    assert spy
    spy.clear()
    ccb = CreditAuditCallback(digits.eval_batch(0), tmp_path / "ctrl", adapter=_ADAPTER, seed=0,
                              test_batches=[digits.eval_batch(0, 360)], control_of=cb)
    _fit(L, cb.frozen_control(), ccb, loader, max_epochs=1)
    assert any(ev.control is not None for ev in spy)
    assert cb.report.flags["d"] is not None                  # the run gained (d) through the gate


def test_the_gate_rules_on_records():
    """The one function, on records alone: what it refuses, what it leaves "not evaluated"."""
    from creditaudit.evidence import ControlEvidence, Evidence, gate
    good = ControlEvidence("C", acc=0.6, blocks_at_init=True, embedding_moved=True, readout_moved=True, finite=True)
    assert gate(Evidence("r", None, good)).frozen_acc == 0.6
    for bad, needle in ((dict(mismatch="arch is 'vit' there but 'resmlp' here"), "not this run's control"),
                        (dict(finite=False), "non-finite"), (dict(blocks_at_init=False), "not frozen"),
                        (dict(embedding_moved=False), "never trained its embedding"),
                        (dict(readout_moved=False), "never trained its readout")):
        with pytest.raises(CreditAuditError, match=needle):
            gate(Evidence("r", None, ControlEvidence(**{**good.__dict__, **bad})))
    for lacking, needle in ((dict(finished=False), "not finished"), (dict(acc=None), "no test accuracy"),
                            (dict(unverified="no init"), "unverified: no init"),
                            (dict(finite=None), "could not be checked"),
                            (dict(embedding_moved=None), "could not be checked")):
        admitted = gate(Evidence("r", None, ControlEvidence(**{**good.__dict__, **lacking})))
        assert admitted.frozen_acc is None and needle in admitted.depth_why
    assert gate(Evidence("r")).frozen_acc is None               # no control: (d) not evaluated
    bound = {"run": "k", "checkpoint": "c", "status": "s"}
    gate(Evidence("r", diagnosis_binding=bound, run_binding=dict(bound), check_binding=True))
    for key in bound:
        with pytest.raises(CreditAuditError, match="belongs to another"):
            gate(Evidence("r", diagnosis_binding=bound, run_binding={**bound, key: "x"}, check_binding=True))
    with pytest.raises(CreditAuditError, match="names no run"):
        gate(Evidence("r", diagnosis_binding=None, run_binding=bound, check_binding=True))


# -- 2. what the gate refuses or marks "not evaluated" ------------------------------------------------
def test_a_frozen_control_that_never_trained_is_refused_by_diagnose(runs, capsys):
    """A rule that leaves embedding and readout alone when the blocks are frozen gives a control
    still at init: (d) against it would clear by construction. Main accepted it."""
    argv = ["diagnose", runs / "headless", "--frozen-control", runs / "headless_ctrl", "--eval-batches", 2,
            "--threads", 1, "--device", "cpu"]
    one_error_line(*cli(argv, capsys)[::2], "never trained", "embedding and readout")


def test_an_audit_with_an_untrained_control_is_never_trustworthy(pkg, tmp_path):
    """The audit cannot refuse one method's control without losing the others: the seed's (d) is
    not evaluated, the control is marked refused, and the method verdict names why; a shallow
    control that never trained is refused too (its accuracy is not reported)."""
    (tmp_path / "a.toml").write_text('controls = ["frozen", "shallow"]\n[model]\nwidth = 16\nblocks = 2\n')
    quiet(["audit", "--config", tmp_path / "a.toml", "--dataset", "digits", "--methods",
           "gaterules:HeadlessBP", "--seeds", 0, "--epochs", 2, "--out", tmp_path / "aud", "--jobs", 1,
           "--device", "cpu", "--quiet"])
    audit = store.read_sealed_json(tmp_path / "aud" / "audit.json", "audit")
    row = audit["methods"][0]
    assert row["n_paired_with_frozen"] == 0 and row["flags"]["d"] is None
    for rule in ("project", "paper"):
        assert row["verdicts"][rule]["outcome"] != "trustworthy"
    assert "never trained" in " ".join(row["missing"])
    for kind in ("frozen", "shallow"):                   # neither yardstick trained: both refused
        ctrl = next(r for r in audit["runs"] if r["control"] == kind)
        assert ctrl["status"] == "refused" and "never trained" in ctrl["message"], ctrl["message"]
    assert row["shallow_acc"] is None


def test_a_control_with_non_finite_outputs_is_refused(weights, capsys):
    argv = ["diagnose", *_user(weights, "--frozen-control", weights / "nan.safetensors", "--init-weights",
                               weights / "init.safetensors")]
    one_error_line(*cli(argv, capsys)[::2], "non-finite weights or outputs")


def test_a_monitored_control_with_non_finite_outputs_is_refused(tmp_path, digits):
    def poison(control):
        with torch.no_grad():
            control.out_head.bias[0] = float("nan")  # h_l and the user's loss stay finite
    with pytest.raises(CreditAuditError, match="non-finite weights or outputs"):
        _monitored(tmp_path, digits, break_control=poison)


def test_a_control_of_another_architecture_or_run_is_refused(runs, tmp_path, capsys, digits):
    argv = ["diagnose", runs / "run", "--frozen-control", runs / "other", "--eval-batches", 2,
            "--threads", 1, "--device", "cpu"]
    one_error_line(*cli(argv, capsys)[::2], "not this run's control")
    argv[3] = runs / "headless_ctrl"                         # another method's control
    one_error_line(*cli(argv, capsys)[::2], "not this run's control", "method")
    mon, _ = _monitored(tmp_path, digits, "a")
    _, ctrl_b = _monitored(tmp_path, digits, "b")            # same init, another run
    with pytest.raises(CreditAuditError, match="not this run's control.*built for another run"):
        mon.finish(frozen_control=ctrl_b.out)


def _gamma_reports(digits, poison_seed):
    """Two seeds' diagnoses of a tiny bp-trained model; the credit of one seed is NaN at h_1."""
    reports = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)

        def credit(x, y, model=model, seed=seed):
            from creditaudit.metrics import bp_gradients
            grads = [g.clone() for g in bp_gradients(model, x, y).grads]
            if seed == poison_seed:
                grads[1][0, 0] = float("nan")
            return grads
        from creditaudit.metrics import monitor_snapshot
        snap = monitor_snapshot(model, *digits.eval_batch(0)).to_dict()
        reports.append(diagnose(model, [digits.eval_batch(i, 64) for i in range(2)], method=credit,
                                frozen_acc=0.1, test_acc=0.9,
                                monitor_history=[{"epoch": 0, **snap}, {"epoch": 1, **snap}],
                                training={"status": "finished", "epochs_completed": 1,
                                          "epochs_planned": 1}).to_dict())
    return reports


def test_a_credit_non_finite_in_one_seed_keeps_the_method_verdict_from_trustworthy(digits):
    clean = _gamma_reports(digits, poison_seed=None)
    seeds = [SeedEvidence(f"s{i}", "finished", r, 0.9, 0.1, 1000) for i, r in enumerate(clean)]
    judged = method_verdict(seeds, Thresholds())
    assert judged["verdicts"]["project"]["outcome"] == "trustworthy", judged["verdicts"]["project"]
    poisoned = _gamma_reports(digits, poison_seed=1)
    assert poisoned[1]["verdict"].startswith("incomplete: Γ not evaluated")   # the seed's own verdict
    seeds = [SeedEvidence(f"s{i}", "finished", r, 0.9, 0.1, 1000) for i, r in enumerate(poisoned)]
    judged = method_verdict(seeds, Thresholds())
    for rule in ("project", "paper"):                      # neither column may say trustworthy
        assert judged["verdicts"][rule]["outcome"] == "incomplete", judged["verdicts"][rule]
        assert any("s1: Γ not evaluated" in m for m in judged["verdicts"][rule]["missing"])


def test_a_copied_or_stale_diagnosis_is_refused_by_check(runs, tmp_path, capsys):
    base = ["--eval-batches", 2, "--threads", 1, "--device", "cpu"]
    run, other = tmp_path / "run", tmp_path / "other"
    shutil.copytree(runs / "run", run)
    shutil.copytree(runs / "other", other)
    (run / "diagnosis.json").unlink(missing_ok=True)     # one judged against a control would be kept
    assert quiet(["diagnose", run, *base]) == 0
    assert cli(["check", run], capsys)[0] == 3            # its own diagnosis: incomplete (no control)
    shutil.copy(run / "diagnosis.json", other / "diagnosis.json")
    one_error_line(*cli(["check", other], capsys)[::2], "belongs to another run")
    # a diagnosis made before the run finished: the run then resumed and finished
    from creditaudit.config import RunConfig
    from creditaudit.data import load_dataset
    from creditaudit.train import train_run
    config = RunConfig.from_dict(json.loads((runs / "run" / "config.json").read_text()))
    data = load_dataset("digits")
    late = tmp_path / "late"

    def stop(history):
        if history[-1]["epoch"] == 1:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        train_run(config, late, data=data, progress=False, on_epoch=stop)
    assert quiet(["diagnose", late, *base]) == 0           # of the unfinished run
    train_run(config, late, data=data, progress=False)    # resumed and finished
    one_error_line(*cli(["check", late], capsys)[::2], "belongs to another checkpoint")


@pytest.mark.parametrize("damage", ["metrics truncated", "metrics accuracy edited", "tensors truncated",
                                    "tensors of another run"])
def test_check_refuses_a_diagnosed_run_whose_records_were_damaged_after(damage, runs, tmp_path, capsys):
    """check RUN reads the run as a load would: a diagnosis is never read back from a run whose
    metrics log, checkpoint tensors or config were edited, truncated or swapped after it."""
    run = tmp_path / "run"
    shutil.copytree(runs / "run", run)
    assert quiet(["diagnose", run, "--frozen-control", runs / "ctrl", "--eval-batches", 2,
                  "--threads", 1, "--device", "cpu"]) == 0
    assert cli(["check", run], capsys)[0] in (0, 1, 3)       # intact: a verdict
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    tensors = next(run.glob("checkpoint-e*.safetensors"))
    if damage == "metrics truncated":          # a finished run's log is whole
        metrics.write_text("".join(lines[:-1]))
    elif damage == "metrics accuracy edited":
        last = json.loads(lines[-1])
        last["test_acc"] = 0.99
        metrics.write_text("".join(lines[:-1]) + json.dumps(last) + "\n")
    elif damage == "tensors truncated":
        tensors.write_bytes(tensors.read_bytes()[:-100])
    else:
        shutil.copy(next((runs / "other").glob("checkpoint-e*.safetensors")), tensors)
    code, _, err = cli(["check", run], capsys)
    assert code == 2 and "trustworthy" not in err
    one_error_line(code, err, str(run))


def test_own_loop_entrances_refuse_non_paths_and_dict_thresholds(tmp_path):
    from creditaudit import audit_own_runs
    with pytest.raises(CreditAuditError, match="thresholds must be a creditaudit.verdict.Thresholds"):
        audit_own_runs([tmp_path], out=tmp_path / "a", n_test=100, thresholds={})
    lightning = pytest.importorskip("creditaudit.lightning")
    with pytest.raises(CreditAuditError, match="out must be a folder path"):
        lightning.CreditAuditCallback((torch.zeros(2, 64), torch.zeros(2, dtype=torch.long)), out=5)


def test_a_monitored_diagnosis_copied_to_another_run_is_refused(tmp_path, digits, capsys):
    _monitored(tmp_path, digits, "a", control=False)
    _monitored(tmp_path, digits, "b", control=False)
    shutil.copy(tmp_path / "a" / "diagnosis.json", tmp_path / "b" / "diagnosis.json")
    one_error_line(*cli(["check", tmp_path / "b"], capsys)[::2], "belongs to another run")
    one_error_line(*cli(["diagnose", tmp_path / "b"], capsys)[::2], "belongs to another run")
    with pytest.raises(CreditAuditError, match="belongs to another run"):
        creditaudit.audit_own_runs([tmp_path / "b"], out=tmp_path / "aud", n_test=360)


def test_sys_exit_in_a_rule_or_a_factory_is_an_unfinished_run_and_a_non_zero_exit(runs, weights, tmp_path,
                                                                                    capsys):
    code, _, err = cli(["train", *TINY, "--epochs", 2, "--method", "gaterules:ExitingBP", "--seed", 0,
                        "--out", tmp_path / "x"], capsys)
    one_error_line(code, err, r"sys\.exit\(0\)")
    assert not (tmp_path / "x" / "status.json").exists()  # unfinished
    assert cli(["check", tmp_path / "x"], capsys)[0] != 0
    argv = ["check", "--model", "gatenets:exits", "--weights", weights / "trained.safetensors",
            "--dataset", "digits", "--device", "cpu"]
    one_error_line(*cli(argv, capsys)[::2], r"sys\.exit\(0\)")


def test_sys_exit_inside_a_monitored_loop_leaves_a_run_check_does_not_pass(tmp_path, digits, capsys):
    torch.manual_seed(0)
    model = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
    with pytest.raises(SystemExit):
        with creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "r", epochs=2, seed=0,
                                 test_batches=[digits.eval_batch(0, 360)]) as mon:
            mon.step(1.0, 8)
            mon.epoch_end()
            raise SystemExit(0)
    code, out, _ = cli(["check", tmp_path / "r"], capsys)
    assert code == 3 and "incomplete" in out


def _lightning(tmp_path, digits, name, **kw):
    import lightning as L
    from creditaudit.lightning import CreditAuditCallback

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(digits.x_train, digits.y_train),
                                         batch_size=128, shuffle=True)
    torch.manual_seed(0)
    cb = CreditAuditCallback(digits.eval_batch(0), tmp_path / name, adapter=_ADAPTER, seed=0,
                             test_batches=[digits.eval_batch(0, 360)], **kw)
    return Classifier(), cb, loader


_ADAPTER = creditaudit.Adapter(embed=lambda m, x: m.net.embed_input(x), blocks="net.blocks",
                               readout="net.readout")


def _fit(L, module, cb, loader, **trainer):
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb], **trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)


@pytest.mark.parametrize("limit", [{"fast_dev_run": True}, {"limit_train_batches": 0.5},
                                   {"limit_train_batches": 2}])
def test_a_lightning_fit_over_part_of_each_epoch_is_not_finished(limit, tmp_path, digits, capsys):
    L = pytest.importorskip("lightning")
    module, cb, loader = _lightning(tmp_path, digits, "run")
    _fit(L, module, cb, loader, max_epochs=1, **limit)
    from creditaudit.monitor import load_monitored
    run = load_monitored(tmp_path / "run")
    assert run.status["status"] == "ended-early", run.status
    assert cli(["check", tmp_path / "run"], capsys)[0] == 3


def test_sys_exit_inside_a_lightning_step_leaves_an_interrupted_run(tmp_path, digits, capsys):
    L = pytest.importorskip("lightning")
    module, cb, loader = _lightning(tmp_path, digits, "run")
    module.training_step = lambda batch, batch_idx: (_ for _ in ()).throw(SystemExit(0))
    with pytest.raises(SystemExit):
        _fit(L, module, cb, loader, max_epochs=1)
    assert cli(["check", tmp_path / "run"], capsys)[0] == 3


def test_a_monitor_history_of_another_shape_and_an_empty_stream_are_refused(digits):
    torch.manual_seed(0)
    model = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
    batches = [digits.eval_batch(0, 64)]
    good = {"epoch": 0, "h_norms": [1.0] * 3, "g_norms": [1e-3] * 3, "gain": 0.5}
    diagnose(model, batches, monitor_history=[good])
    for bad, needle in (({k: v for k, v in good.items() if k != "g_norms"}, "lacks g_norms"),
                        ({**good, "h_norms": [1.0] * 5}, "h_norms has 5 positions.*has 3"),
                        ({**good, "epoch": 0.5}, "integer epoch")):
        with pytest.raises(CreditAuditError, match=needle):
            diagnose(model, batches, monitor_history=[bad])
    empty = ResidualStream(embed=model.embed_input, steps=[], readout=model.readout)
    with pytest.raises(CreditAuditError, match="no steps"):
        diagnose(empty, batches)


def test_monitor_logs_never_overwrite_a_measured_field_and_step_counts_are_positive(tmp_path, digits):
    torch.manual_seed(0)
    model = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
    mon = creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "r", epochs=2, seed=0,
                              test_batches=[digits.eval_batch(0, 360)])
    for n in (0, -3, float("nan"), 2.5, True):
        with pytest.raises(CreditAuditError, match="positive integer"):
            mon.step(1.0, n)
    mon.step(1.0, 8)
    for name in ("gain", "h_norms", "train_loss", "wall_time", "eval_batch_acc"):
        with pytest.raises(CreditAuditError, match=f"logs {name}, which the monitor measures"):
            mon.epoch_end(**{name: 0.5})
    record = mon.epoch_end(my_gain=0.5)
    assert record["my_gain"] == 0.5 and record["gain"] != 0.5


def test_a_mnist1d_cache_of_another_shape_is_regenerated_and_the_user_told(tmp_path):
    from creditaudit.data import load_dataset
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "mnist1d.npz", x=rng.normal(size=(10, 40)), y=np.arange(10) % 10,
             x_test=rng.normal(size=(5, 40)), y_test=np.arange(5))
    with pytest.warns(CreditAuditWarning, match="not an intact MNIST-1D cache.*generating"):
        data = load_dataset("mnist1d", tmp_path)
    assert tuple(data.x_train.shape) == (4000, 40) and tuple(data.x_test.shape) == (1000, 40)


def test_an_identity_check_of_another_configuration_is_never_replaced(tmp_path, capsys):
    base = ["identity-check", "--dataset", "digits", "--width", 16, "--blocks", 2, "--device", "cpu",
            "--out", tmp_path]
    assert cli([*base, "--seeds", 1, 2], capsys)[0] == 0
    before = (tmp_path / "identity_check.json").read_bytes()
    one_error_line(*cli([*base, "--seeds", 1, 3], capsys)[::2], "another configuration", "seeds")
    one_error_line(*cli([*base[:4], 32, *base[5:], "--seeds", 1, 2], capsys)[::2], "another configuration")
    assert (tmp_path / "identity_check.json").read_bytes() == before
    one_error_line(*cli([*base, "--seeds", 4, 4], capsys)[::2], "more than once")
    assert cli([*base, "--seeds", 1, 2], capsys)[0] == 0    # the same check again: fine


def test_an_own_runs_report_of_another_n_test_is_never_replaced(tmp_path, digits):
    _monitored(tmp_path, digits, "a", control=False)
    creditaudit.audit_own_runs([tmp_path / "a"], out=tmp_path / "aud", n_test=360)
    with pytest.raises(CreditAuditError, match="already holds the report of another audit"):
        creditaudit.audit_own_runs([tmp_path / "a"], out=tmp_path / "aud", n_test=1000)


def test_own_runs_sensitivity_uses_the_across_seeds_decision(tmp_path, digits):
    _monitored(tmp_path, digits, "a")
    audit = creditaudit.audit_own_runs([tmp_path / "a"], [tmp_path / "a_ctrl"], out=tmp_path / "aud",
                                       n_test=360)
    row = audit["sensitivity"]["depth_margin"]
    assert row["fires_when"] == "upper bound < threshold"      # as `creditaudit thresholds` writes it
    assert list(row["per_run"]) == [audit["methods"][0]["method"]]


def test_d_covers_float32_accuracies():
    acc, frozen = np.float32(0.52), np.float32(0.50)           # a gap of exactly the margin, in float32
    gap = float(acc) - float(frozen)
    assert gap < 0.02                                          # float32 rounding put it below
    assert fires_d(gap, Thresholds()) is False
    assert depth_decision([gap], Thresholds().depth_margin).paper_undercut is False


# -- 3. an adapter that proves itself -----------------------------------------------------------------
class _OwnSkip(nn.Module):
    """A block that adds its own skip, as pre-LN transformer blocks do."""

    def __init__(self, d):
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))

    def forward(self, h):
        return h + self.f(h)


class _Net(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.stem = nn.Linear(64, d)
        self.layers = nn.ModuleList(_OwnSkip(d) for _ in range(2))
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        h = self.stem(x.flatten(1))
        for block in self.layers:
            h = block(h)
        return self.head(h)


def test_an_adapter_that_does_not_reproduce_the_model_is_one_line(tmp_path, digits):
    torch.manual_seed(0)
    model = _Net()
    embed = lambda m, x: m.stem(x.flatten(1))
    wrong = creditaudit.Adapter(embed=embed, blocks="layers", readout="head")          # skip=True default
    with pytest.raises(CreditAuditError, match=r"differ by up to .*pass Adapter\(skip=False\)"):
        creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "r", epochs=1, adapter=wrong)
    assert not (tmp_path / "r").exists()
    no_head = creditaudit.Adapter(embed=embed, blocks="layers", readout=lambda m, h: h[:, :10], skip=False)
    with pytest.raises(CreditAuditError, match="check the adapter's embed, blocks and readout"):
        creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "r", epochs=1, adapter=no_head)
    right = creditaudit.Adapter(embed=embed, blocks="layers", readout="head", skip=False)
    creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "r", epochs=1, adapter=right)


def test_a_flag_at_epoch_0_names_the_adapter(tmp_path, digits):
    torch.manual_seed(0)
    model = _Net()
    with torch.no_grad():                                      # blocks that blow the stream up at init
        for block in model.layers:
            block.f[3].weight.mul_(400.0)
    adapter = creditaudit.Adapter(embed=lambda m, x: m.stem(x.flatten(1)), blocks="layers", readout="head",
                                  skip=False)
    with pytest.warns(creditaudit.FlagFired, match="epoch 0.*likely cause is the adapter"):
        creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "r", epochs=1, adapter=adapter)


# -- a control whose blocks are the identity at init is a shallow network: the report says so -----
def test_a_control_of_identity_blocks_is_named_a_shallow_network():
    """Measured ‖f_l(h_l)‖ = 0 for every block of the admitted frozen control (zero-initialised
    residual branches): the gate's note says the control equals a shallow network and what (d)
    then asks; blocks that move the stream, an unmeasured ratio, or a control (d) cannot use, no note."""
    from creditaudit.evidence import ControlEvidence, Evidence, gate
    checked = dict(acc=0.5, blocks_at_init=True, embedding_moved=True, readout_moved=True, finite=True)
    note = gate(Evidence("r", None, ControlEvidence("ctl", branch_ratio=0.0, **checked))).note
    assert "exactly a shallow network" in note and "beat no blocks at all" in note
    for ratio in (0.03, None):
        assert gate(Evidence("r", None, ControlEvidence("ctl", branch_ratio=ratio, **checked))).note is None
    unfinished = gate(Evidence("r", None, ControlEvidence("ctl", branch_ratio=0.0, **{**checked, "acc": None})))
    assert unfinished.frozen_acc is None and unfinished.note is None


def test_branch_ratios_are_zero_exactly_for_zero_initialised_branches():
    import torch
    from creditaudit.metrics import branch_ratios
    from creditaudit.model import build_model
    x = torch.randn(8, 64)
    for arch_shape in (("resmlp", (64,)),):
        zero = build_model(arch_shape[0], arch_shape[1], 10, width=16, blocks=3, w2_std=0.0)
        assert branch_ratios(zero, x) == [0.0, 0.0, 0.0]
        assert min(branch_ratios(build_model(arch_shape[0], arch_shape[1], 10, width=16, blocks=3), x)) > 1e-3
