"""A bad-input sweep's findings, by class: a config table that is not a table beside a flag that
merges into it, folders that mean another thing (a run into an experiment's folder, one experiment
into another's), options that only --model reads given where they would be ignored, a control
diagnosed against itself, a (d)-judged diagnosis replaced by one without a control, a value option
given twice, thresholds that make a flag meaningless, `lint` paths holding no Python, a view given
audit.json itself, a closed pipe. Each test fails on the code before it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from creditaudit.cli import main as cli_main
from test_bad_inputs import refused      # exit 2, one line "creditaudit: error: …" matching

TINY = ["--dataset", "digits", "--width", "16", "--blocks", "1", "--quiet", "--epochs", "1"]
AUDIT = [*TINY, "--methods", "bp", "--seeds", "42", "--jobs", "1"]


@pytest.fixture(scope="module")
def audited(tmp_path_factory) -> Path:
    """A tiny audit (bp, one seed, digits, 1 epoch): its folder, runs and controls diagnosed."""
    out = tmp_path_factory.mktemp("audit") / "a"
    assert cli_main(["audit", *AUDIT, "--out", str(out)]) in (0, 1, 3)
    return out


def run_of(audit: Path, kind: str) -> Path:
    return next(audit.glob(f"runs/bp-{kind}-s42-*"))


# -- a config table that is not one, beside a flag that merges into it --------------------------
@pytest.mark.parametrize("table, flag", [("model = 3", ["--width", "16"]), ("model = 3", ["--blocks", "1"]),
                                         ("model = 3", ["--arch", "resmlp"]),
                                         ("model = 3", ["--arch-option", "loss=bce"]),
                                         ("[[model]]\nwidth = 3", ["--width", "16"]),
                                         ("training = 3", ["--lr", "0.01"])])
@pytest.mark.parametrize("command", ["audit", "ladder"])
def test_a_config_section_that_is_not_a_table_is_refused_beside_its_flag(tmp_path, capsys, table, flag, command):
    toml = tmp_path / "c.toml"
    toml.write_text(f'dataset = "digits"\nmethods = ["bp"]\nseeds = [42]\nepochs = 1\n{table}\n')
    section = "training" if "training" in table else "model"
    refused([command, "--config", toml, *flag, "--out", tmp_path / "o"], capsys,
            rf"\[{section}\] in .* must be a table")
    assert not (tmp_path / "o").exists()


# -- folders mean one thing -----------------------------------------------------------------------
def test_a_run_is_refused_in_an_experiments_folder_or_among_other_files(audited, tmp_path, capsys):
    before = (audited / "audit.json").read_bytes()
    refused(["train", *TINY, "--out", audited], capsys, r"is an audit's folder \(it holds audit.json\)")
    assert not (audited / "config.json").exists() and (audited / "audit.json").read_bytes() == before
    busy = tmp_path / "busy"
    (busy / "runs").mkdir(parents=True)          # an experiment under way has runs/ before its record
    refused(["train", *TINY, "--out", busy], capsys, r"it holds runs/\)")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    refused(["train", *TINY, "--out", notes], capsys, r"already holds other files \(notes.txt\) and no run")
    assert sorted(p.name for p in notes.iterdir()) == ["notes.txt"]
    # an empty folder is a new run's, and a run's own folder resumes (here: finds it finished)
    empty = tmp_path / "empty"
    empty.mkdir()
    for _ in range(2):
        assert cli_main(["train", *TINY, "--out", str(empty)]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("command, extra", [("ladder", ["--methods", "bp", "--seeds", "42", "--jobs", "1"]),
                                            ("penalty-sweep", ["--seeds", "42", "--jobs", "1"]),
                                            ("identity-check", ["--seeds", "42"])])
def test_an_experiment_is_refused_in_another_experiments_folder(audited, capsys, command, extra):
    judged = (run_of(audited, "none") / "diagnosis.json").read_bytes()
    common = TINY[:6] if command == "identity-check" else TINY      # it trains nothing: no --epochs
    refused([command, *common, *extra, "--out", audited], capsys, r"is an audit's folder \(it holds audit.json\)")
    assert (run_of(audited, "none") / "diagnosis.json").read_bytes() == judged


def test_an_audit_is_refused_in_a_ladders_folder(tmp_path, capsys):
    folder = tmp_path / "l"
    folder.mkdir()
    (folder / "ladder.json").write_text("{}")
    refused(["audit", *AUDIT, "--out", folder], capsys, r"is a ladder's folder \(it holds ladder.json\)")


# -- options only --model reads, where they would be ignored ---------------------------------------
@pytest.mark.parametrize("option", [["--weights", "w.safetensors"], ["--init-weights", "w.safetensors"],
                                    ["--yardstick", "w.safetensors"], ["--dataset", "mnist"]])
def test_diagnose_refuses_model_only_options_with_a_run_folder(audited, capsys, option):
    refused(["diagnose", run_of(audited, "none"), *option], capsys,
            rf"{option[0]} applies with --model only")


@pytest.mark.parametrize("option", [["--frozen-control", "/nowhere"], ["--weights", "w.safetensors"],
                                    ["--dataset", "mnist"], ["--eval-batches", "3"]])
def test_check_refuses_options_it_would_ignore_on_a_folder(audited, capsys, option):
    refused(["check", run_of(audited, "none"), *option], capsys,
            rf"{option[0]} applies with --model only \(a model trained elsewhere\); check reads the "
            r"diagnosis saved")


def test_a_control_is_not_diagnosed_against_a_control(audited, capsys):
    frozen = run_of(audited, "frozen")
    refused(["diagnose", frozen, "--frozen-control", frozen], capsys, r"is itself a control \(bp/frozen/s42\)")
    refused(["diagnose", run_of(audited, "shallow")], capsys, r"is a shallow control .* no depth to diagnose")


def test_a_diagnosis_that_judged_d_is_kept_over_one_without_a_control(audited, tmp_path, capsys):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(run_of(audited, "none"), run)
    saved = json.loads((run / "diagnosis.json").read_text())
    assert isinstance(saved["depth"], dict)           # the audit judged (d) against the control
    assert cli_main(["check", str(run)]) in (0, 1, 3)
    verdict = capsys.readouterr().out
    assert cli_main(["diagnose", str(run)]) == 0
    err = capsys.readouterr().err
    assert "kept" in err and "give --frozen-control CONTROL to replace it" in err
    assert json.loads((run / "diagnosis.json").read_text()) == saved
    assert cli_main(["check", str(run)]) in (0, 1, 3)
    assert capsys.readouterr().out == verdict
    # with the control, the diagnosis is replaced as before
    assert cli_main(["diagnose", str(run), "--frozen-control", str(run_of(audited, "frozen"))]) == 0
    assert isinstance(json.loads((run / "diagnosis.json").read_text())["depth"], dict)


# -- a list option given twice ----------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["audit", "--seeds", "42", "--seeds", "43"],
                                  ["audit", "--methods", "bp", "--methods", "fa"],
                                  ["ladder", "--seeds", "1", "--seeds", "2"],
                                  ["penalty-sweep", "--lambdas", "0.5", "--lambdas", "0.1"],
                                  ["reproduce", "fa", "--seeds", "1", "--seeds", "2"]])
def test_a_list_option_given_twice_is_refused(capsys, argv):
    refused(argv, capsys, rf"argument {argv[-2]}: given twice; give it once, with every value "
                          rf"\(e.g. {argv[-2]} {argv[-3]} {argv[-1]}\)")


def test_a_single_value_given_twice_keeps_the_last(tmp_path, capsys):
    """The command line's convention (an alias's option overridden by a later one)."""
    out = tmp_path / "r"
    assert cli_main(["train", *TINY, "--seed", "1", "--seed", "7", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["seed"] == 7


def test_repeatable_options_still_repeat(tmp_path, capsys):
    out = tmp_path / "r"
    assert cli_main(["train", *TINY, "--method", "ep", "--option", "beta=0.5", "--option", "steps=3",
                     "--out", str(out)]) == 0
    options = json.loads((out / "config.json").read_text())["options"]
    assert (options["beta"], options["steps"]) == (0.5, 3)


# -- thresholds a flag cannot mean anything under -----------------------------------------------------
@pytest.mark.parametrize("key, value", [("growth", 0), ("growth", 0.5), ("init_growth", 0.9), ("stack_growth", 0),
                                        ("floor", 0), ("floor", 1), ("gain", 0), ("drift", 1), ("drift", 5),
                                        ("depth_margin", 1), ("depth_margin", 5)])
def test_a_threshold_outside_its_meaningful_range_is_refused(tmp_path, capsys, key, value):
    toml = tmp_path / "c.toml"
    toml.write_text(f'dataset = "digits"\nmethods = ["bp"]\nseeds = [42]\nepochs = 1\n[thresholds]\n{key} = {value}\n')
    refused(["audit", "--config", toml, "--out", tmp_path / "o"], capsys, rf"threshold {key} in .* must lie in")


def test_thresholds_inside_their_ranges_are_accepted():
    from creditaudit.config import THRESHOLD_KEYS, THRESHOLD_RANGES, audit_config_from_dict
    assert set(THRESHOLD_RANGES) == set(THRESHOLD_KEYS)
    edge = {"growth": 1, "init_growth": 1, "stack_growth": 1e6, "floor": 1e-30, "gain": 1e9, "drift": 0,
            "depth_margin": 0}
    config = audit_config_from_dict({"dataset": "digits", "methods": ["bp"], "epochs": 1, "thresholds": edge},
                                    where="t")
    assert config.thresholds == edge


# -- audit's --arch-option, as [model.options] says it ----------------------------------------------
def test_audit_arch_option_names_the_runs_the_config_table_names(tmp_path):
    from creditaudit.cli import build_parser
    from creditaudit.commands.audit import _audit_raw
    from creditaudit.config import audit_config_from_dict
    args = build_parser().parse_args(["audit", *AUDIT, "--arch", "mlp", "--arch-option", "loss=bce"])
    flags = audit_config_from_dict(_audit_raw(args), where="flags")
    toml = tmp_path / "c.toml"
    toml.write_text('dataset = "digits"\nmethods = ["bp"]\nseeds = [42]\nepochs = 1\njobs = 1\n'
                    '[model]\narch = "mlp"\nwidth = 16\nblocks = 1\n[model.options]\nloss = "bce"\n')
    table = audit_config_from_dict(_audit_raw(build_parser().parse_args(["audit", "--config", str(toml)])),
                                   where=str(toml))
    keys = lambda c: sorted(r.run_key for r in c.run_configs())
    assert keys(flags) == keys(table)
    assert {r.arch_options["loss"] for r in flags.run_configs()} == {"bce"}
    with pytest.raises(Exception, match=r"--arch-option loss is given twice"):
        _audit_raw(build_parser().parse_args(["audit", "--arch-option", "loss=bce", "--arch-option", "loss=ce"]))


# -- lint paths that hold no Python, and a file's declared encoding ---------------------------------
def test_lint_refuses_paths_without_python_and_reads_a_declared_encoding(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(["lint", empty], capsys, r"holds no \.py file")
    refused(["lint", ""], capsys, r"an empty path was given")
    latin = tmp_path / "latin.py"
    latin.write_bytes(b'# -*- coding: latin-1 -*-\nname = "caf\xe9"\n')
    assert cli_main(["lint", str(latin)]) == 0
    assert "no findings in 1 file" in capsys.readouterr().out
    for body, message in ((b'name = "caf\xe9"\n', "not valid UTF-8 (byte 11"),
                          (b"# coding: nope\nx = 1\n", "names no encoding Python knows")):
        latin.write_bytes(body)
        assert cli_main(["lint", str(latin)]) == 1
        assert message in capsys.readouterr().out


# -- views given audit.json, or another file ---------------------------------------------------------
def test_a_view_given_audit_json_reads_its_folder(audited, tmp_path, capsys):
    assert cli_main(["thresholds", str(audited / "audit.json")]) == 0
    assert (audited / "thresholds.json").exists()
    capsys.readouterr()
    other = tmp_path / "notes.txt"
    other.write_text("x")
    for view in ("thresholds", "report"):
        refused([view, other], capsys, r"is a file; give the audit's folder")


# -- a closed pipe -----------------------------------------------------------------------------------
def test_a_reader_that_closes_the_pipe_is_not_a_user_error(audited):
    """`creditaudit report AUDIT | head -1`: the shell's convention (141), nothing on stderr."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "creditaudit", "report", str(audited)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()            # the reader is gone before the first line (`head -0`; the whole
    err = proc.stderr.read().decode()       # report of a tiny audit would fit in the pipe's buffer)
    assert proc.wait(timeout=120) == 141 and "error" not in err, err


def test_penalty_sweep_names_the_methods_that_have_a_penalty(capsys):
    refused(["penalty-sweep", "--method", "bp", "--lambdas", "0", "0.1"], capsys,
            r"method 'bp' has no penalty option \(lam\) to sweep; choose one of dfa-penalty")


def test_a_user_rule_spec_that_misses_is_named_for_what_misses(tmp_path, capsys, monkeypatch):
    (tmp_path / "myrules_ok.py").write_text("x = 1\n")
    (tmp_path / "myrules_syntax.py").write_text("def broken(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec, match in (("myrules_ok:Nope", r"module 'myrules_ok' \(.*myrules_ok.py\) has no 'Nope'"),
                        ("myrules_syntax:X", r"'myrules_syntax' .* is not valid Python .*myrules_syntax.py:1\); fix"),
                        (":X", r"method ':X' names no module; give PKG.MODULE:CLASS"),
                        ("myrules_ok:", r"method 'myrules_ok:' names no class")):
        refused(["train", *TINY, "--method", spec, "--out", tmp_path / "o"], capsys, match)


# -- a model setting the architecture does not read ------------------------------------------------
@pytest.mark.parametrize("arch, flag, value, dataset", [("mlp", "--w2-std", "0.1", "digits"),
                                                         ("resnet-small", "--activation", "tanh", "digits")])
def test_a_model_setting_the_architecture_does_not_read_is_refused(tmp_path, capsys, arch, flag, value, dataset):
    """Kept, it changed the run key (a retrain) and the record while the network stayed the same."""
    refused(["train", "--method", "bp", "--dataset", dataset, "--arch", arch, "--width", "8", "--blocks", "1",
             "--epochs", "1", "--quiet", flag, value, "--out", tmp_path / "r"], capsys,
            rf"{arch} does not read {flag[2:].replace('-', '_')} .*remove {flag}")
    assert not (tmp_path / "r").exists()
    toml = tmp_path / "c.toml"
    toml.write_text(f'dataset = "digits"\nmethods = ["bp"]\nseeds = [42]\nepochs = 1\n'
                    f'[model]\narch = "{arch}"\nwidth = 8\nblocks = 1\n{flag[2:].replace("-", "_")} = '
                    f'{value if flag == "--w2-std" else repr(value)}\n')
    refused(["audit", "--config", toml, "--out", tmp_path / "a"], capsys, rf"{arch} does not read")
    from creditaudit.config import RunConfig
    RunConfig(method="bp", arch=arch, w2_std=0.01, activation="gelu")   # the defaults pass


def test_a_train_diverged_in_the_terminal_reads_as_a_fired_a(tmp_path, capsys):
    """The verdict reads a diverged run as (a) EXPLODED; the terminal said "(a) never"."""
    assert cli_main(["train", *TINY, "--lr", "1e9", "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "diverged after 0/1 epochs" in out and "(a) epoch 1 (diverged)" in out, out


# -- the data folder ---------------------------------------------------------------------------------
def test_a_folder_where_an_idx_file_belongs_is_named_not_downloaded(tmp_path, capsys, monkeypatch):
    from creditaudit.data import idx
    root = tmp_path / "data"
    (root / "mnist" / "train-images-idx3-ubyte.gz").mkdir(parents=True)
    monkeypatch.setattr(idx, "fetch", lambda *a: pytest.fail("no download is tried"))
    refused(["train", *TINY[2:], "--dataset", "mnist", "--data-dir", root, "--out", tmp_path / "r"], capsys,
            r"train-images-idx3-ubyte.gz is a folder, not MNIST's IDX file; move it away")


def test_an_unwritable_data_folder_is_named_not_its_temporary_file(tmp_path, capsys, monkeypatch):
    import tempfile
    from creditaudit.data import idx

    def no_write(*a, **k):
        raise PermissionError(13, "Permission denied", str(tmp_path / "data/mnist/.train-images.xyz.download"))
    monkeypatch.setattr(tempfile, "mkstemp", no_write)
    (tmp_path / "data" / "mnist").mkdir(parents=True)
    line = refused(["train", *TINY[2:], "--dataset", "mnist", "--data-dir", tmp_path / "data",
                    "--out", tmp_path / "r"], capsys, r"mnist cannot be written \(Permission denied\); point --data-dir")
    assert ".download" not in line


# -- a device that names an index the machine does not have ------------------------------------------
def test_a_device_index_the_machine_lacks_is_refused(tmp_path, capsys, monkeypatch):
    refused(["train", *TINY, "--device", "cpu:1", "--out", tmp_path / "r"], capsys,
            r"device 'cpu:1': the CPU has no index; use cpu")
    assert not (tmp_path / "r").exists()
    import torch
    from creditaudit.errors import CreditAuditError
    from creditaudit.runs import as_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(CreditAuditError, match=r"'cuda:3' asked for, but this machine has 1 CUDA GPU\(s\): cuda:0 … cuda:0"):
        as_device("cuda:3")
    assert as_device("cuda:0") == torch.device("cuda:0") and as_device("cpu") == torch.device("cpu")


# -- --out naming a file ------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [["train", *TINY], ["audit", *AUDIT], ["identity-check", "--dataset", "digits", "--width", "16", "--blocks", "1", "--seeds", "42"]])
def test_out_naming_a_file_is_refused_and_the_file_is_kept(tmp_path, capsys, command):
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    refused([*command, "--out", out], capsys, r"notes.txt is a file, not a folder; give --out a new folder")
    assert out.read_text() == "mine"


# -- --clip given to a rule that clips nothing -----------------------------------------------------------
def _stepped(name: str, clip: float, options: dict):
    import torch
    from creditaudit.methods import MethodSettings, method_class
    from creditaudit.model import ResidualMLP
    torch.manual_seed(0)
    model = ResidualMLP(16, d=16, n_blocks=2, n_classes=10)
    method = method_class(name)(model, MethodSettings(epochs=1, seed=5, batch_size=32, clip=clip,
                                                      trainable_blocks=(0, 1), options=options))
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        method.train_step(4 * torch.randn(32, 16, generator=g), torch.randint(0, 10, (32,), generator=g))
    return [p.detach().clone() for p in model.blocks.parameters()]


def _built_in():
    from creditaudit.methods import METHODS
    return [(name, {}) for name in sorted(METHODS)] + [("pepita", {"rule": "backprop"})]


@pytest.mark.parametrize("name, options", _built_in())
def test_what_a_rule_declares_of_the_clip_is_what_its_step_does(name, options):
    """The declaration the run key and `train --clip` rely on (`Method.clips`), checked on each
    built-in rule's step: a rule that declares it clips nothing trains bit-identical blocks under a
    clip of 1e-8 and 1e8; one that clips trains other blocks."""
    import torch
    from creditaudit.methods import method_class
    tight, loose = _stepped(name, 1e-8, options), _stepped(name, 1e8, options)
    same = all(torch.equal(a, b) for a, b in zip(tight, loose))
    cls = method_class(name)
    assert same == (not cls.clips(cls.resolve_options(options))), (name, options)


def test_clip_on_a_rule_that_clips_nothing_is_refused_and_leaves_its_key(tmp_path, capsys):
    from creditaudit.config import RunConfig
    refused(["train", *TINY, "--method", "bp", "--clip", "0.5", "--out", tmp_path / "r"], capsys,
            r"bp clips nothing, so --clip would change nothing; drop it \(the rules that clip per block, under some option at least: .*dfa")
    assert not (tmp_path / "r").exists()
    assert RunConfig(method="bp", clip=0.5).run_key == RunConfig(method="bp").run_key   # an audit's shared clip
    assert RunConfig(method="dfa", clip=0.5).run_key != RunConfig(method="dfa").run_key
    assert RunConfig(method="pepita", clip=0.5).run_key == RunConfig(method="pepita").run_key
    assert RunConfig(method="pepita", clip=0.5, options={"rule": "backprop"}).clip == 0.5


# -- a network that does not fit in memory ------------------------------------------------------------
def test_a_run_that_cannot_allocate_says_to_make_it_smaller(tmp_path, capsys, monkeypatch):
    """`--width 100000` asks 40 GB for one block: the advice is the size, not "fix the method"."""
    from creditaudit import train as trainer

    def too_big(*a, **k):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 40000000000 bytes")
    monkeypatch.setattr(trainer, "train_run", too_big)
    assert cli_main(["train", *TINY, "--out", str(tmp_path / "r")]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit in memory at these settings: lower --width, --blocks or --batch-size" in err[0]
    assert "fix the method" not in err[0] and (tmp_path / "r" / "error.txt").exists()


# -- a config file's value that a flag overrides is still checked ------------------------------------
@pytest.mark.parametrize("line, flag, says", [
    ("epochs = -5", ["--epochs", "1"], r"epochs in .*c\.toml .*got -5.*--epochs overrides it"),
    ("seeds = [42, 42]", ["--seeds", "42"], r"seeds.*--seeds overrides it"),
    ('methods = ["nope"]', ["--methods", "bp"], r"nope.*--methods overrides it"),
    ('dataset = "mnist-2d"', ["--dataset", "digits"], r"mnist-2d.*--dataset overrides it"),
    ("[model]\nwidth = 0", ["--width", "16"], r"width.*--width overrides it"),
    ("[training]\nlr = -1.0", ["--lr", "0.01"], r"lr.*--lr overrides it"),
])
@pytest.mark.parametrize("command", ["audit", "ladder"])
def test_a_config_value_a_flag_overrides_is_still_checked(tmp_path, capsys, line, flag, says, command):
    toml = tmp_path / "c.toml"
    body = {"epochs": "epochs = 1", "seeds": "seeds = [42]", "methods": 'methods = ["bp"]',
            "dataset": 'dataset = "digits"'}
    key = line.split()[0]
    toml.write_text("\n".join(v for k, v in body.items() if k != key) + "\n" + line + "\n")
    refused([command, "--config", toml, *flag, "--out", tmp_path / "o"], capsys, says)
    assert not (tmp_path / "o").exists()


def test_a_valid_file_overridden_by_a_flag_still_runs_the_flag(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('dataset = "digits"\nmethods = ["bp"]\nseeds = [42]\nepochs = 5\n[model]\nwidth = 16\n'
                    "blocks = 1\n")
    out = tmp_path / "o"
    assert cli_main(["audit", "--config", str(toml), "--epochs", "1", "--jobs", "1", "--quiet",
                     "--out", str(out)]) in (0, 3)
    assert {r["config"]["epochs"] for r in json.loads((out / "audit.json").read_text())["runs"]} == {1}
