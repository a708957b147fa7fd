"""Every entrance refuses bad input in one line (issue 22, items 4 and 5): a command-line user gets
`creditaudit: error: …` and exit 2, a Python user a CreditAuditError naming the argument and the fix,
never a deep torch error or a traceback; a refused command leaves nothing behind that blocks the
corrected one. `tests/entrance_sweep.py` throws a few hundred more such inputs at the same doors."""
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import creditaudit
from creditaudit import Adapter, CreditAuditError, Monitor, ResidualMLP, ResidualStream, load_monitored
from creditaudit.cli import main as cli_main
from creditaudit.protocol import diagnose

TINY = ["--dataset", "digits", "--width", "16", "--blocks", "2", "--quiet", "--threads", "1",
        "--device", "cpu", "--epochs", "1"]
USAGE = Path(__file__).resolve().parents[1] / "docs" / "USAGE.md"


def cli(argv, capsys) -> tuple[int, str, str]:
    code = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def refused(argv, capsys, match: str) -> str:
    """The command exits 2 with one `creditaudit: error:` line matching `match`."""
    code, _, err = cli(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("creditaudit: error:"), (code, err)
    assert re.search(match, lines[0]), lines[0]
    return lines[0]


def model(d_in=10, width=16, blocks=2, classes=3):
    torch.manual_seed(0)
    return ResidualMLP(d_in, width, blocks, classes)


X, Y = torch.randn(32, 10, generator=torch.Generator().manual_seed(1)), torch.arange(32) % 3


# -- the command line ------------------------------------------------------------------------------
def test_deeply_nested_toml_is_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    refused(["audit", "--config", deep], capsys, "nests tables or arrays too deeply")


def test_calibrate_without_a_run_folder_is_one_line(capsys):
    refused(["calibrate"], capsys, r"give a run folder: creditaudit calibrate RUN_DIR")


def test_user_rule_with_malformed_option_ranges_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "entrance_rules.py").write_text(textwrap.dedent("""
        from creditaudit.methods import REFERENCE_METHOD, METHODS
        class Words(METHODS[REFERENCE_METHOD]):
            name = "words"
            option_defaults = {"k": 3}
            option_ranges = {"k": ("1", "10")}
        class Stranger(METHODS[REFERENCE_METHOD]):
            name = "stranger"
            option_defaults = {"k": 3}
            option_ranges = {"q": (0, 1)}
        class Flat(METHODS[REFERENCE_METHOD]):
            name = "flat"
            option_defaults = {"k": 3}
            option_ranges = {"k": 5}
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    for cls, match in (("Words", r"option_ranges\['k'\] must be an inclusive \(low, high\) pair of numbers"),
                       ("Stranger", "option_ranges names 'q', which is not in option_defaults"),
                       ("Flat", r"option_ranges\['k'\] must be")):
        refused(["train", *TINY, "--method", f"entrance_rules:{cls}", "--option", "k=4",
                 "--out", tmp_path / cls], capsys, match)
        assert not (tmp_path / cls).exists()


def test_a_cp1252_console_gets_the_report_in_ascii(tmp_path):
    """A Windows console (cp1252) cannot print ′ or ‖: they are spelled (a') and || instead of a
    UnicodeEncodeError after the run trained."""
    env = {**os.environ, "PYTHONIOENCODING": "cp1252", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "creditaudit", "train", *TINY, "--out", tmp_path / "run"],
                          env=env, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode("cp1252")
    out = proc.stdout.decode("cp1252")
    assert "(a') never" in out and "median ||h_L||" in out
    assert b"Traceback" not in proc.stderr


def test_unwritable_tensorboard_is_refused_before_training(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("not a folder")
    refused(["train", *TINY, "--out", tmp_path / "run", "--tensorboard", a_file], capsys,
            "is a file, not a folder")
    assert not (tmp_path / "run").exists()                 # nothing trained, no folder made
    refused(["audit", "--preset", "quick", "--dataset", "digits", "--methods", "bp", "--seeds", "1",
             "--epochs", "1", "--out", tmp_path / "audit", "--tensorboard", a_file / "sub"], capsys,
            "is a file, not a folder")
    assert not (tmp_path / "audit").exists()


def test_refused_train_leaves_no_debris_and_the_corrected_command_runs(tmp_path, capsys):
    """A model its data cannot feed is refused after the folder's config.json was written; that
    stub would make the corrected command's folder "a different run"."""
    out = tmp_path / "runs" / "vit"
    argv = ["train", *TINY, "--arch", "vit-mini", "--out", out]
    refused([*argv, "--arch-option", "patch=3"], capsys, "not divisible by patch=3")
    assert not (tmp_path / "runs").exists()
    code, stdout, err = cli([*argv, "--arch-option", "patch=4"], capsys)
    assert code == 0, err
    assert "finished after 1/1 epochs" in stdout


def test_read_errors_are_not_reported_as_a_full_disk(tmp_path, capsys):
    for folder, record, command in (("audit", "audit.json", "check"), ("audit", "audit.json", "report"),
                                    ("run", "config.json", "diagnose"), ("own", "run.json", "check")):
        (tmp_path / folder / record).mkdir(parents=True, exist_ok=True)   # a folder, not a file
        line = refused([command, tmp_path / folder], capsys, "cannot read")
        assert "free space" not in line and "cannot write" not in line
    (tmp_path / "cfg.toml").mkdir()
    line = refused(["audit", "--config", tmp_path / "cfg.toml"], capsys, "is a folder")
    assert "free space" not in line


def test_address_without_the_ray_executor_is_refused(tmp_path, capsys):
    refused(["audit", "--preset", "quick", "--address", "auto", "--out", tmp_path / "a"], capsys,
            "add --executor ray")
    assert not (tmp_path / "a").exists()


def test_every_count_option_has_a_finite_bound():
    """A count knob (an int option) of every built-in method has a finite upper bound: pc/ep steps
    of 1e9 once ran for hours, cb draws of 1e9 exhausted memory (issue 28)."""
    from creditaudit.methods import METHODS
    from creditaudit.methods.bridges import CreditBridge
    from creditaudit.methods.predictive_coding import PredictiveCoding
    from creditaudit.config import RunConfig
    with pytest.raises(CreditAuditError, match=r"option draws .* must lie in \[1, 1024\]"):
        RunConfig(method=CreditBridge.name, options={"draws": 10 ** 9})
    with pytest.raises(CreditAuditError, match=r"option steps .* must lie in \[1, 1000\]"):
        RunConfig(method=PredictiveCoding.name, options={"steps": 10 ** 9})
    for name, cls in METHODS.items():
        for key, value in cls.option_defaults.items():
            if isinstance(value, int) and not isinstance(value, bool):
                assert key in cls.option_ranges and math.isfinite(cls.option_ranges[key][1]), (name, key)


# -- the Monitor -----------------------------------------------------------------------------------
@pytest.mark.parametrize("case, match", [
    (lambda out: Monitor(model(), (X, Y.float()), out, epochs=1), "integer class indices"),
    (lambda out: Monitor(model(), (X, Y), out, epochs=1, thresholds={"growth": 2.0}), "must be a creditaudit.verdict.Thresholds"),
    (lambda out: Monitor(model().to("meta"), (X, Y), out, epochs=1), "meta device"),
    (lambda out: Monitor(model().half(), (X, Y), out, epochs=1), "torch.float16"),
    (lambda out: Monitor(model().bfloat16(), (X, Y), out, epochs=1), "torch.bfloat16"),
    (lambda out: Monitor(model(), (X, Y), None, epochs=1), "out must be a folder path"),
    (lambda out: Monitor(model(), (X, Y), out, epochs=1, test_batches=5), "test_batches must be an iterable"),
    (lambda out: Monitor(model(), (X, Y), out, epochs=1, tensorboard=out.parent / "file"), "is a file, not a folder"),
])
def test_monitor_refuses_bad_arguments_in_one_line(tmp_path, case, match):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CreditAuditError, match=match):
        case(tmp_path / "run")
    assert not (tmp_path / "run" / "run.json").exists()


@pytest.mark.parametrize("loss, match", [(torch.ones(5), r"shape \(5,\)"), (None, "got NoneType"),
                                         ("0.3", "got str")])
def test_monitor_step_refuses_a_loss_that_is_not_one_number(tmp_path, loss, match):
    mon = Monitor(model(), (X, Y), tmp_path / "run", epochs=1, test_batches=[(X, Y)])
    with pytest.raises(CreditAuditError, match=match):
        mon.step(loss, 32)
    mon.step(torch.tensor(1.0), 32)                     # the run goes on
    assert mon.epoch_end()["train_loss"] == 1.0


def test_monitor_refused_at_its_first_record_leaves_no_run_behind(tmp_path):
    """A bad test batch fails the epoch-0 record; run.json must not be left to block the retry."""
    out = tmp_path / "run"
    with pytest.raises(CreditAuditError):
        Monitor(model(), (X, Y), out, epochs=1, test_batches=[(torch.randn(4, 7), Y[:4])])
    assert not (out / "run.json").exists()
    mon = Monitor(model(), (X, Y), out, epochs=1, test_batches=[(X, Y)])
    mon.step(torch.tensor(1.0), 32)
    mon.epoch_end()
    assert mon.finish() is not None and mon.status["status"] == "finished"


# -- diagnose() ----------------------------------------------------------------------------------
def _stream(steps):
    return ResidualStream(embed=lambda x: x, steps=steps, readout=lambda h: h[:, :3])


@pytest.mark.parametrize("call, match", [
    (lambda: diagnose(model(), [(torch.randn(32, 7), Y)]), r"eval batch 0 \(x of shape \(32, 7\)"),
    (lambda: diagnose(model(), [(X.to("meta"), Y.to("meta"))]), "meta device"),
    (lambda: diagnose(model().to("meta"), [(X, Y)]), "meta device"),
    (lambda: diagnose(model().half(), [(X, Y)]), "float32 or float64"),
    (lambda: diagnose(model(), [(X, Y)], method=lambda x, y: [torch.zeros(32, 16)] * 3, null=True),
     r"takes \(x, y, gen\)"),
    (lambda: diagnose(model(), [(X, Y)], rho=[99]), r"rho=\[99\] names a layer beyond the model's 2 blocks"),
    (lambda: diagnose(model(), [(X, Y)], rho=[-1]), "rho must be True, False or a list of layer indices"),
    (lambda: diagnose(model(), [(X, Y)], rho="1"), "rho must be"),
    (lambda: diagnose(model(), [(X, Y)], null_k=0), "null_k must be a positive integer"),
    (lambda: diagnose(_stream([5]), [(X, Y)]), "must be callables"),
    (lambda: diagnose(_stream([lambda h: h[:, :5]]), [(X, Y)]), "block 0 changes the residual stream's shape"),
])
def test_diagnose_refuses_bad_inputs_in_one_line(call, match):
    with pytest.raises(CreditAuditError, match=match):
        call()


def test_diagnose_takes_float64_inputs_and_models_in_their_own_precision():
    """float64 inputs to a float32 model are measured as that model computes (float32); a float64
    model is measured in float64: the same figures as the float32 pair, to float32 rounding."""
    batches = [(X, Y), (X.flip(0), Y.flip(0))]
    ref = diagnose(model(), batches)
    as64 = diagnose(model(), [(x.double(), y) for x, y in batches])
    assert as64.residual_norms == ref.residual_norms and as64.project == ref.project
    wide = diagnose(model().double(), batches)
    assert wide.residual_norms == pytest.approx(ref.residual_norms, rel=1e-5)
    assert wide.project.outcome == ref.project.outcome


# -- constructors and loaders ----------------------------------------------------------------------
@pytest.mark.parametrize("call, match", [
    (lambda: ResidualMLP("64", 16), "d_in must be an integer"),
    (lambda: ResidualMLP(64, -1), "d must be an integer ≥ 1"),
    (lambda: ResidualMLP(64, 16, n_blocks=2.5), "n_blocks must be an integer ≥ 0"),
    (lambda: ResidualMLP(64, 16, w2_std=float("nan")), "w2_std must be a finite number"),
    (lambda: load_monitored(None), "run_dir must be a folder path"),
    (lambda: Adapter(blocks=None), r"Adapter\(blocks=...\) must name the residual blocks"),
    (lambda: Adapter(blocks="layers", skip="no"), "skip=...\\) must be True or False"),
    (lambda: Adapter(blocks="layers", embed=5), r"Adapter\(embed=...\) must be"),
])
def test_constructors_refuse_bad_arguments_in_one_line(call, match):
    with pytest.raises(CreditAuditError, match=match):
        call()


def test_image_architectures_refuse_bad_arguments_in_one_line():
    from creditaudit.model import SmallResNet, ViTMini
    with pytest.raises(CreditAuditError, match="input_shape must be"):
        ViTMini((3, 32), 16)
    with pytest.raises(CreditAuditError, match="heads must be an integer"):
        ViTMini((3, 32, 32), 16, heads="4")
    with pytest.raises(CreditAuditError, match="width must be an integer"):
        SmallResNet((3, 32, 32), width=0)


# -- the package's Python API, as docs/USAGE.md shows it ----------------------------------------
def test_readme_python_example_runs_with_diagnose_from_the_package():
    assert creditaudit.diagnose is diagnose and "diagnose" in creditaudit.__all__
    text = USAGE.read_text()
    block = text.split("From Python, the protocol reaches a model only through", 1)[1]
    code = block.split("```python", 1)[1].split("```", 1)[0]
    assert "from creditaudit import ResidualStream, diagnose" in code

    class Mine(torch.nn.Module):        # the names the example assumes
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Linear(10, 16)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
            self.final_norm = torch.nn.LayerNorm(16)
            self.head = torch.nn.Linear(16, 3)

    torch.manual_seed(0)
    net = Mine()
    scope = {"my_model": net, "my_eval_batches": [(X, Y), (X.flip(0), Y.flip(0))],
             "my_credit_signals": lambda x, y: [torch.zeros(len(x), 16) for _ in range(3)]}
    exec(compile(code, str(USAGE), "exec"), scope)
    assert scope["report"].gamma is not None and len(scope["report"].residual_norms) == 3


def test_an_empty_tensorboard_folder_is_refused_not_ignored(tmp_path, capsys):
    refused(["train", *TINY, "--out", tmp_path / "run", "--tensorboard", ""], capsys,
            "the TensorBoard log folder must be a folder path")
    assert not (tmp_path / "run").exists()


def test_a_sealed_record_with_nan_is_refused_as_edited(tmp_path):
    from creditaudit.store import read_sealed_json, write_sealed_json
    path = tmp_path / "audit.json"
    write_sealed_json(path, {"test_acc": 0.5})
    path.write_text(path.read_text().replace("0.5", "NaN"))
    with pytest.raises(CreditAuditError, match="modified after it was written"):
        read_sealed_json(path, "audit")


def test_a_negative_penalty_is_refused_even_where_no_method_takes_it():
    from creditaudit.config import audit_config_from_dict
    with pytest.raises(CreditAuditError, match=r"lam in \[training\] of .* must be a finite number ≥ 0"):
        audit_config_from_dict({"methods": ["bp"], "epochs": 1, "training": {"lam": -1.0}})


def test_monitor_control_of_and_diagnose_credit_failures_are_one_line(tmp_path):
    with pytest.raises(CreditAuditError, match="control_of must be a folder path"):
        Monitor(model(), (X, Y), tmp_path / "run", epochs=1, control_of=5)
    with pytest.raises(CreditAuditError, match="the method's credit raised ZeroDivisionError on eval batch 0"):
        diagnose(model(), [(X, Y)], method=lambda x, y: 1 / 0)


@pytest.mark.parametrize("command", ["audit", "ladder"])
def test_a_refused_audit_leaves_no_locked_folder(tmp_path, capsys, command):
    """Data that cannot be loaded is refused after the output folder was locked: the folder (and
    the parents this command made) are removed again. (A --data-dir that is a file: MNIST is
    missing and cannot be downloaded there, refused before any network use.)"""
    (tmp_path / "none").write_text("")
    refused([command, "--dataset", "mnist", "--data-dir", tmp_path / "none", "--methods", "bp",
             "--seeds", "1", "--epochs", "1", "--quiet", "--out", tmp_path / "a" / "b"], capsys,
            "MNIST's train-images-idx3-ubyte is missing and cannot be downloaded into")
    assert not (tmp_path / "a").exists()
