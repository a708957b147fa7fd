"""Issue 28: inputs that still got through — a measured accuracy overruled by a claimed one, data
that cannot carry a verdict, and single faults (two spellings of λ, another rule's knob, a second
process in a locked folder, the wrong advice, tracebacks). Each test fails on the code before it."""
import threading

import numpy as np

import pytest
import torch

from creditaudit import CreditAuditError
from creditaudit.cli import main as cli_main

TINY = ["--dataset", "digits", "--width", "16", "--blocks", "2", "--quiet", "--threads", "1",
        "--device", "cpu", "--epochs", "1"]


def refused(argv, capsys, match: str) -> str:
    import re
    code = cli_main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("creditaudit: error:"), (code, err)
    assert re.search(match, lines[0]), lines[0]
    return lines[0]


# -- single faults ----------------------------------------------------------------------------------
def test_lam_given_twice_with_different_values_is_refused(tmp_path, capsys):
    from creditaudit.methods.dfa import DFAPenalty
    refused(["train", *TINY, "--method", DFAPenalty.name, "--lam", "0.1", "--option", "lam=0.2",
             "--out", tmp_path / "r"], capsys, r"--lam 0.1 and --option lam=0.2 give λ twice")


def test_sb_refuses_the_knobs_only_cb_reads():
    from creditaudit.config import RunConfig
    from creditaudit.methods.bridges import CreditBridge, StateBridge
    for knob in ("draws", "noise", "tau", "ema"):
        with pytest.raises(CreditAuditError, match=rf"method 'sb' has no option\(s\) {knob}"):
            RunConfig(method=StateBridge.name, options={knob: CreditBridge.option_defaults[knob]})
    assert RunConfig(method=CreditBridge.name, options={"draws": 8}).options["draws"] == 8


def test_check_on_a_control_advises_what_judges_it(tmp_path, capsys):
    for flag, match in (("--shallow", r"is a shallow control .* no verdict of its own"),
                        ("--frozen", r"is a frozen-blocks control: .*diagnose RUN_DIR --frozen-control")):
        out = tmp_path / flag.strip("-")
        assert cli_main(["train", *TINY, flag, "--out", str(out)]) == 0
        capsys.readouterr()
        line = refused(["check", out], capsys, match)
        assert "--frozen-control CONTROL_DIR" not in line


def test_two_processes_started_at_once_on_one_folder_one_is_refused(tmp_path, monkeypatch):
    """The race of issue 28: B looked at the folder before A made it (so B counted it as its own
    debris), then lost the lock to A. B must be refused, must not remove A's lock or folder, and a
    third command while A works must be refused too. Two threads stand for the two processes: flock
    locks of two open() calls exclude each other within one process as across processes."""
    from creditaudit.commands import running
    from creditaudit.experiments import lock
    out = tmp_path / "a" / "audit"
    real = lock.audit_lock
    b_looked, a_holds, b_done = threading.Event(), threading.Event(), threading.Event()
    results = {}

    def ordered(*args, **kwargs):          # B has computed what it made; let A take the lock first
        if threading.current_thread().name == "B":
            b_looked.set()
            a_holds.wait(10)
        return real(*args, **kwargs)
    monkeypatch.setattr(lock, "audit_lock", ordered)

    def a():
        b_looked.wait(10)
        with running.locked_out(out):        # A has written nothing yet: the folder holds the lock only
            a_holds.set()
            b_done.wait(10)
            results["a_lock_there"] = (out / lock.LOCK_FILE).exists()
            try:                           # a third command while A works
                with real(out):
                    results["third"] = "not refused"
            except CreditAuditError:
                results["third"] = "refused"
            (out / "work").write_text("A's files")

    def b():
        try:
            with running.locked_out(out):
                results["b"] = "not refused"
        except CreditAuditError as err:
            results["b"] = f"refused: {err}"
        b_done.set()
    ta, tb = threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")
    tb.start(), ta.start()
    ta.join(20), tb.join(20)
    assert results["b"].startswith("refused: another creditaudit process"), results
    assert results["a_lock_there"] and results["third"] == "refused", results
    assert (out / "work").read_text() == "A's files"


# -- the Monitor: measured beats claimed, numbers in any form, one line each ------------------------
from creditaudit import Monitor, ResidualMLP  # noqa: E402

X, Y = torch.randn(32, 10, generator=torch.Generator().manual_seed(1)), torch.arange(32) % 3


def _model():
    torch.manual_seed(0)
    return ResidualMLP(10, 16, 2, 3)


def _stepped(tmp_path, **kw):
    mon = Monitor(_model(), (X, Y), tmp_path / "run", epochs=2, **kw)
    mon.step(torch.tensor(1.0), 32)
    return mon


def test_a_claimed_accuracy_that_disagrees_with_the_measured_one_is_refused(tmp_path):
    mon = _stepped(tmp_path, test_batches=[(X, Y)])
    with pytest.raises(CreditAuditError, match=r"epoch_end\(test_acc=0.99\), but the Monitor measured 0\.\d{4} on its test_batches"):
        mon.epoch_end(test_acc=0.99)
    measured = mon._measure_test_acc()
    record = mon.epoch_end(test_acc=round(measured, 2))      # rounding is no disagreement
    assert record["test_acc"] == measured                    # and what is recorded is measured


@pytest.mark.parametrize("value", [np.float32(0.5), np.float64(0.5), torch.tensor(0.5), np.array(0.5),
                                   torch.tensor([0.5]), 1])
def test_numpy_and_torch_scalars_are_accuracies(tmp_path, value):
    assert _stepped(tmp_path).epoch_end(test_acc=value)["test_acc"] == float(value)


@pytest.mark.parametrize("kwargs, match", [
    (dict(test_acc=torch.tensor([0.5, 0.6])), r"test_acc must be one number, got a Tensor of shape \(2,\)"),
    (dict(test_acc=0.5, note="hello"), r"epoch_end\(note=...\) must be a number, got str 'hello'"),
    (dict(test_acc=0.5, grad=torch.ones(3)), r"epoch_end\(grad=...\) must be one number"),
    (dict(test_acc=True), "test_acc must be a number, got bool"),
])
def test_epoch_end_refuses_what_is_not_one_number_in_one_line(tmp_path, kwargs, match):
    with pytest.raises(CreditAuditError, match=match):
        _stepped(tmp_path).epoch_end(**kwargs)


def test_a_non_finite_eval_batch_is_refused_not_sealed_as_diverged(tmp_path):
    with pytest.raises(CreditAuditError, match="eval_batch: x holds NaN"):
        Monitor(_model(), (torch.full_like(X, float("nan")), Y), tmp_path / "run", epochs=1)
    assert not (tmp_path / "run" / "status.json").exists()


# -- --model factories that used to raise tracebacks ------------------------------------------------
USER_MODELS = '''
import torch
from creditaudit.model import ResidualMLP

class AlwaysTraining(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.bn, self.lin = torch.nn.BatchNorm1d(d), torch.nn.Linear(d, d)
    def forward(self, h):
        return self.lin(self.bn(h))
    def train(self, mode=True):          # forced into training mode
        return super().train(True)

def bn_training():
    torch.manual_seed(0)
    m = ResidualMLP(64, 16, 2, 10)
    m.blocks[0] = AlwaysTraining(16)
    return m

def on_meta():
    with torch.device("meta"):
        return ResidualMLP(64, 16, 2, 10)

def good():
    torch.manual_seed(0)
    return ResidualMLP(64, 16, 2, 10)
'''


@pytest.mark.parametrize("factory, weights_of, match", [
    ("bn_training", "bn_training", r"bn_training\(\): blocks.0, .* stay in training mode after model.eval\(\)"),
    ("on_meta", "good", r"on_meta\(\) returned a model on the meta device"),
])
def test_user_model_factories_are_refused_in_one_line(factory, weights_of, match, tmp_path, capsys, monkeypatch):
    import importlib
    import sys
    from safetensors.torch import save_file
    (tmp_path / "bad_user_models.py").write_text(USER_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("bad_user_models", None)
    mod = importlib.import_module("bad_user_models")
    weights = tmp_path / f"{weights_of}.safetensors"
    save_file({k: v.contiguous() for k, v in getattr(mod, weights_of)().state_dict().items()}, str(weights))
    refused(["diagnose", "--model", f"bad_user_models:{factory}", "--weights", weights,
             "--dataset", "digits", "--threads", "1"], capsys, match)


def test_train_prints_a_run_whose_numbers_could_not_be_measured(tmp_path, capsys, monkeypatch):
    """Inputs of 1e38 (refused at load now) once crashed `train` formatting a None metric: the
    summary prints what it has, whatever the data — here with the data check switched off."""
    import creditaudit.data
    monkeypatch.setattr(creditaudit.data, "check_learnable", lambda data, where: None)
    y = np.arange(5000) % 10
    np.savez(tmp_path / "mnist1d.npz", x=np.full((4000, 40), 1e38, np.float32), y=y[:4000],
             x_test=np.full((1000, 40), 1e38, np.float32), y_test=y[4000:])
    code = cli_main(["train", "--dataset", "mnist1d", "--data-dir", str(tmp_path), *TINY[2:],
                     "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0 and "diverged" in out and "median ‖h_L‖ —" in out, out
