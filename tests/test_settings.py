"""Settings travel whole: every option of every subcommand reaches what it controls.

The table below has one row per option of `cli.build_parser()` (found by walking the parser, so a
new option without a row fails `test_every_option_has_a_row`). A row gives the arguments that set
the option to a non-default value, and a probe that reads, from the calls the command made, the
thing the option controls: the RunConfig handed to the trainer, the AuditConfig's runs and
`Execution` handed to `run_all`, the eval batches and device of a diagnosis, the arguments of the
user-model loader, ... The command's terminal call is replaced by a recorder that stops it, so
nothing trains. Each row is checked both ways: the probe reads the expected value with the option,
and a different one without it (so the row can fail).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import importlib

import creditaudit.check
import creditaudit.data
import creditaudit.experiments
import creditaudit.experiments.common
import creditaudit.experiments.identity
import creditaudit.lint
import creditaudit.train
import creditaudit.usermodel
from creditaudit.cli import build_parser
from creditaudit.cli import main as cli_main
from creditaudit.data import load_dataset
from creditaudit.methods import Recipe
from creditaudit.methods.dfa import DFAPenalty

WORK = Path("settings-work")          # relative: every test runs in its own tmp folder (chdir)


class Stop(BaseException):
    """Raised by the recorded terminal call: the command got as far as it needed to (a
    BaseException, so that no `except Exception` that records a failed run swallows it)."""


@dataclass
class Row:
    extra: list[str]                     # the option at a non-default value
    probe: Callable[["Calls"], Any]      # what it controls, read from the recorded calls
    expected: Any
    base: list[str] | None = None        # the subcommand's arguments without the option (None: BASE)
    replace: bool = False                # `extra` replaces `base` (a positional, or a different mode)


class Calls(dict):
    """name → (args, kwargs) of the recorded calls of one command; plus loads and threads."""

    def args(self, name: str) -> tuple:
        return self[name][0]

    def kw(self, name: str) -> dict:
        return self[name][1]


# -- what each subcommand's terminal call is, and its arguments without the option -----------------
RUN = str(WORK / "run")
FROZEN = str(WORK / "frozen")
AUDIT_OUT = str(WORK / "out")
BASE = {
    "train": ["--quiet"],
    "diagnose": [RUN],
    "calibrate": [RUN],
    "check": [AUDIT_OUT],
    "audit": ["--out", AUDIT_OUT],
    "ladder": ["--out", AUDIT_OUT],
    "penalty-sweep": ["--out", AUDIT_OUT],
    "identity-check": ["--out", AUDIT_OUT],
    "thresholds": [AUDIT_OUT],
    "report": [AUDIT_OUT],
    "reproduce": ["fa", "--out", AUDIT_OUT],
    "lint": ["a.py"],
}
USER = ["--model", "pkg.nets:make", "--weights", "w.safetensors", "--dataset", "digits"]

train_config = lambda c: c.args("train_run")[0]
run_configs = lambda name: (lambda c: c.args(name)[0])
execution = lambda name: (lambda c: c.kw(name)["execution"])
diag_run = lambda c: c.args("diagnose_run")[0]
n_batches = lambda name: (lambda c: len(c.args(name)[1]))
ident_config = lambda c: c["build_model"][0][0]


def _audit_rows(entry: str, methods: bool = True) -> dict[str, Row]:
    """The options shared by audit, ladder and penalty-sweep, probed at `run_all` of `entry`."""
    cfgs, ex = run_configs(entry), execution(entry)
    rows = {
        "--preset": Row(["--preset", "paper"], lambda c: cfgs(c)[0].dataset, "cifar10"),
        "--config": Row(["--config", "a.toml"], lambda c: cfgs(c)[0].width, 24),
        "--dataset": Row(["--dataset", "digits"], lambda c: {x.dataset for x in cfgs(c)}, {"digits"}),
        "--arch": Row(["--arch", "resnet-small"], lambda c: {x.arch for x in cfgs(c)}, {"resnet-small"}),
        "--seeds": Row(["--seeds", "5", "6"], lambda c: {x.seed for x in cfgs(c)}, {5, 6}),
        "--epochs": Row(["--epochs", "3"], lambda c: {x.epochs for x in cfgs(c)}, {3}),
        "--out": Row(["--out", "elsewhere"], lambda c: Path(c.args(entry)[1]), Path("elsewhere")),
        "--device": Row(["--device", "meta"], lambda c: ex(c).device, "meta"),
        "--data-dir": Row(["--data-dir", "d2"], lambda c: ex(c).data_dir, "d2"),
        "--jobs": Row(["--jobs", "3"], lambda c: ex(c).jobs, 3),
        "--eval-batches": Row(["--eval-batches", "3"], lambda c: c.kw(entry)["n_eval"], 3),
        "--executor": Row(["--executor", "ray"], lambda c: ex(c).executor, "ray"),
        "--address": Row(["--address", "h:1", "--executor", "ray"], lambda c: ex(c).address, "h:1"),
        "--max-retries": Row(["--max-retries", "7"], lambda c: ex(c).max_retries, 7),
        "--stack": Row(["--stack"], lambda c: ex(c).stack, True),
        "--no-stack": Row(["--no-stack"], lambda c: ex(c).stack, False),
        "--quiet": Row(["--quiet"], lambda c: c.kw(entry)["progress"], False),
        "--no-compile": Row(["--no-compile"], lambda c: ex(c).compile_step, False),
        "--no-label-probe": Row(["--no-label-probe"], lambda c: ex(c).label_probe, False),
        "--width": Row(["--width", "8"], lambda c: {x.width for x in cfgs(c)}, {8}),
        "--blocks": Row(["--blocks", "2"], lambda c: {x.blocks for x in cfgs(c) if x.control != "shallow"}, {2}),
        "--lr": Row(["--lr", "0.5"], lambda c: {x.lr for x in cfgs(c)}, {0.5}),
        "--arch-option": Row(["--arch", "mlp", "--arch-option", "loss=bce"],
                             lambda c: {x.arch_options.get("loss") for x in cfgs(c)}, {"bce"}),
    }
    if methods:
        rows["--option"] = Row(["--option", "beta=0.5"],
                               lambda c: {x.options["beta"] for x in cfgs(c) if x.method == "ep"}, {0.5},
                               base=["--out", AUDIT_OUT, "--methods", "bp", "ep"])
    else:   # penalty-sweep's own method (dfa-penalty): an option besides the swept λ
        rows["--option"] = Row(["--option", "normalise=0"],
                               lambda c: {x.options["normalise"] for x in cfgs(c) if x.control == "none"}, {0})
    if methods:
        rows["--methods"] = Row(["--methods", "bp", "fa"], lambda c: {x.method for x in cfgs(c)}, {"bp", "fa"})
        # a rule whose published recipe is not the shared one (pepita's is SGD)
        rows["--recipe"] = Row(["--recipe", "shared"], lambda c: {x.recipe["optimizer"] for x in cfgs(c)},
                               {"adamw"}, base=["--out", AUDIT_OUT, "--methods", "pepita"])
    else:   # penalty-sweep: the built-in rules with λ are the paper's (AdamW either way); a user's
        rows["--recipe"] = Row(["--recipe", "shared"], lambda c: {x.recipe["optimizer"] for x in cfgs(c)},
                               {"adamw"}, base=["--out", AUDIT_OUT, "--method", "test_settings:SweptSGD",
                                                "--lambdas", "0.1"])
    return rows


class SweptSGD(DFAPenalty):
    """A user's rule with λ and an SGD recipe of its own (penalty-sweep's --recipe row)."""
    name = "swept-sgd"
    recipe = Recipe(optimizer="sgd", lr=0.01, momentum=0.9, weight_decay=0.0, schedule="constant")


ROWS: dict[tuple[str, str], Row] = {}
ROWS.update({("", "--version"): Row(["--version"], None, None)})      # output switch: see below
ROWS.update({("train", k): v for k, v in {
    "--method": Row(["--method", "fa"], lambda c: train_config(c).method, "fa"),
    "--dataset": Row(["--dataset", "digits"], lambda c: (train_config(c).dataset, c["loads"][-1][0]),
                     ("digits", "digits")),
    "--arch": Row(["--arch", "vit-mini", "--dataset", "digits", "--width", "8", "--arch-option", "heads=2"],
                  lambda c: train_config(c).arch, "vit-mini",
                  base=["--quiet", "--dataset", "digits", "--width", "8"]),
    "--seed": Row(["--seed", "7"], lambda c: train_config(c).seed, 7),
    "--epochs": Row(["--epochs", "3"], lambda c: train_config(c).epochs, 3),
    "--batch-size": Row(["--batch-size", "32"], lambda c: train_config(c).batch_size, 32),
    "--lr": Row(["--lr", "0.5"], lambda c: train_config(c).lr, 0.5),
    "--weight-decay": Row(["--weight-decay", "0.5"], lambda c: train_config(c).weight_decay, 0.5),
    "--recipe": Row(["--recipe", "shared"], lambda c: train_config(c).recipe["optimizer"], "adamw",
                    base=["--quiet", "--method", "pepita"]),
    "--width": Row(["--width", "8"], lambda c: train_config(c).width, 8),
    "--blocks": Row(["--blocks", "2"], lambda c: train_config(c).blocks, 2),
    "--activation": Row(["--activation", "relu"], lambda c: train_config(c).activation, "relu"),
    "--w2-std": Row(["--w2-std", "0.5"], lambda c: train_config(c).w2_std, 0.5),
    "--clip": Row(["--clip", "0.25"], lambda c: train_config(c).clip, 0.25,
                  base=["--quiet", "--method", "dfa"]),        # bp clips nothing: refused there
    "--lam": Row(["--lam", "0.5"], lambda c: train_config(c).options["lam"], 0.5,
                 base=["--quiet", "--method", "dfa-penalty"]),
    "--frozen": Row(["--frozen"], lambda c: train_config(c).control, "frozen"),
    "--shallow": Row(["--shallow"], lambda c: train_config(c).control, "shallow"),
    "--trainable-blocks": Row(["--trainable-blocks", "1"], lambda c: train_config(c).trainable_block_ids, (3,)),
    "--stop-when-flagged": Row(["--stop-when-flagged", "2"],
                               lambda c: (train_config(c).stop_when_flagged,
                                          c.kw("train_run")["stop_rule"] is not None), (2, True)),
    "--option": Row(["--option", "beta=0.5"], lambda c: train_config(c).options["beta"], 0.5,
                    base=["--quiet", "--method", "ep"]),
    "--arch-option": Row(["--arch-option", "heads=2"], lambda c: train_config(c).arch_options.get("heads"), 2,
                         base=["--quiet", "--dataset", "digits", "--arch", "vit-mini", "--width", "8"]),
    "--data-dir": Row(["--data-dir", "d2"], lambda c: c["loads"][-1][1], "d2"),
    "--no-label-probe": Row(["--no-label-probe"], lambda c: c["loads"][-1][2], False),
    "--device": Row(["--device", "meta"], lambda c: str(c.kw("train_run")["device"]), "meta"),
    "--threads": Row(["--threads", "5"], lambda c: c["threads"][-1], 5),
    "--out": Row(["--out", "r2"], lambda c: Path(c.args("train_run")[1]), Path("r2")),
    "--quiet": Row(["--quiet"], lambda c: c.kw("train_run")["progress"], False, base=[]),
    "--tensorboard": Row(["--tensorboard", "tb"],
                         lambda c: getattr(c.kw("train_run").get("on_epoch"), "log_dir", None), Path("tb")),
    "--precision": Row(["--precision", "bf16"], lambda c: train_config(c).precision, "bf16"),
    "--no-compile": Row(["--no-compile"], lambda c: c.kw("train_run")["compile_step"], False),
}.items()})
for sub in ("diagnose", "calibrate"):
    ROWS.update({(sub, k): v for k, v in {
        "run_dir": Row([FROZEN], lambda c: diag_run(c).run_dir, Path(FROZEN), replace=True),
        "--eval-batches": Row(["--eval-batches", "3"], n_batches("diagnose_run"), 3),
        "--data-dir": Row(["--data-dir", "d2"], lambda c: c["loads"][-1][1], "d2"),
        "--no-label-probe": Row(["--no-label-probe"], lambda c: c["loads"][-1][2], False),
        "--device": Row(["--device", "meta"], lambda c: next(diag_run(c).model.parameters()).device.type, "meta"),
        "--threads": Row(["--threads", "5"], lambda c: c["threads"][-1], 5),
        "--json": Row(["--json"], None, None),                   # output switch: see below
    }.items()})
ROWS.update({("diagnose", k): v for k, v in {
    "--frozen-control": Row(["--frozen-control", FROZEN],
                            lambda c: c.kw("diagnose_run")["control"] and c.kw("diagnose_run")["control"].run_dir,
                            Path(FROZEN)),
    "--rho": Row(["--rho"], lambda c: c.kw("diagnose_run")["rho"], True),
    "--model": Row(USER, lambda c: "user_model_evidence" in c and c.args("user_model_evidence")[0],
                   "pkg.nets:make", replace=True),
    "--weights": Row(["--weights", "v.safetensors"], lambda c: c.args("user_model_evidence")[1],
                     "v.safetensors", base=USER),
    "--init-weights": Row(["--init-weights", "i.safetensors"], lambda c: c.kw("user_model_evidence")["init"],
                          "i.safetensors", base=USER),
    "--yardstick": Row(["--yardstick", "y.safetensors"], lambda c: c.kw("user_model_evidence")["yardstick"],
                       "y.safetensors", base=USER),
    "--dataset": Row(["--dataset", "synthetic"], lambda c: c["loads"][-1][0], "synthetic", base=USER),
}.items()})
ROWS[("calibrate", "--null-draws")] = Row(["--null-draws", "3"], lambda c: c.kw("diagnose_run")["null_k"], 3)
ROWS.update({("check", k): v for k, v in {
    "path": Row([RUN], lambda c: Path(c.args("check_path")[0]), Path(RUN), replace=True),
    "--json": Row(["--json"], None, None),                       # output switch: see below
    "--model": Row(USER, lambda c: "user_model_evidence" in c and c.args("user_model_evidence")[0],
                   "pkg.nets:make"),
    "--weights": Row(["--weights", "v.safetensors"], lambda c: c.args("user_model_evidence")[1],
                     "v.safetensors", base=USER),
    "--init-weights": Row(["--init-weights", "i.safetensors"], lambda c: c.kw("user_model_evidence")["init"],
                          "i.safetensors", base=USER),
    "--yardstick": Row(["--yardstick", "y.safetensors"], lambda c: c.kw("user_model_evidence")["yardstick"],
                       "y.safetensors", base=USER),
    "--dataset": Row(["--dataset", "synthetic"], lambda c: c["loads"][-1][0], "synthetic", base=USER),
    "--frozen-control": Row(["--frozen-control", "f.safetensors"],
                            lambda c: c.kw("user_model_evidence")["frozen"], "f.safetensors", base=USER),
    "--eval-batches": Row(["--eval-batches", "3"], lambda c: len(c.args("user_model_evidence")[3]), 3, base=USER),
    "--data-dir": Row(["--data-dir", "d2"], lambda c: c["loads"][-1][1], "d2", base=USER),
    "--no-label-probe": Row(["--no-label-probe"], lambda c: c["loads"][-1][2], False, base=USER),
    "--device": Row(["--device", "meta"], lambda c: str(c.kw("user_model_evidence")["device"]), "meta", base=USER),
    "--threads": Row(["--threads", "5"], lambda c: c["threads"][-1], 5, base=USER),
}.items()})
ROWS.update({("audit", k): v for k, v in _audit_rows("audit_run_all").items()})
ROWS.update({("ladder", k): v for k, v in _audit_rows("ladder_run_all").items()})
ROWS.update({("penalty-sweep", k): v for k, v in _audit_rows("penalty_run_all", methods=False).items()})
ROWS.update({("penalty-sweep", k): v for k, v in {
    "--method": Row(["--method", "sb"], lambda c: {x.method for x in c.args("penalty_run_all")[0]}, {"sb"},
                    base=["--out", AUDIT_OUT, "--lambdas", "0.1"]),
    "--lambdas": Row(["--lambdas", "0.3"], lambda c: {x.options["lam"] for x in c.args("penalty_run_all")[0]
                                                      if x.control == "none"}, {0.3}),   # controls: λ = 0
}.items()})
ROWS.update({("identity-check", k): v for k, v in {
    "--dataset": Row(["--dataset", "digits"], lambda c: (ident_config(c).dataset, c["loads"][-1][0]),
                     ("digits", "digits")),
    "--arch": Row(["--arch", "resnet-small", "--dataset", "digits"], lambda c: ident_config(c).arch,
                  "resnet-small", base=["--out", AUDIT_OUT, "--dataset", "digits"]),
    "--seeds": Row(["--seeds", "5", "6"], lambda c: list(c.args("identity_check")[1]), [5, 6]),
    "--width": Row(["--width", "8"], lambda c: ident_config(c).width, 8),
    "--blocks": Row(["--blocks", "2"], lambda c: ident_config(c).blocks, 2),
    "--activation": Row(["--activation", "relu"], lambda c: ident_config(c).activation, "relu"),
    "--w2-std": Row(["--w2-std", "0.5"], lambda c: ident_config(c).w2_std, 0.5),
    "--out": Row(["--out", "elsewhere"], lambda c: Path(c.args("identity_experiment")[2]), Path("elsewhere")),
    "--data-dir": Row(["--data-dir", "d2"], lambda c: c["loads"][-1][1], "d2"),
    "--device": Row(["--device", "meta"], lambda c: c.args("identity_check")[2].device.type, "meta"),
    "--threads": Row(["--threads", "5"], lambda c: c["threads"][-1], 5),
}.items()})
_repro, _repro_ex = run_configs("audit_run_all"), execution("audit_run_all")
ROWS.update({("reproduce", k): v for k, v in {
    "rule": Row(["dfa", "--out", AUDIT_OUT], lambda c: {x.method for x in _repro(c)}, {"dfa", "bp"}, replace=True),
    "--seeds": Row(["--seeds", "5", "6"], lambda c: {x.seed for x in _repro(c)}, {5, 6}),
    "--epochs": Row(["--epochs", "3"], lambda c: {x.epochs for x in _repro(c)}, {3}),
    "--out": Row(["--out", "elsewhere"], lambda c: Path(c.args("audit_run_all")[1]), Path("elsewhere")),
    "--device": Row(["--device", "meta"], lambda c: _repro_ex(c).device, "meta"),
    "--data-dir": Row(["--data-dir", "d2"], lambda c: _repro_ex(c).data_dir, "d2"),
    "--jobs": Row(["--jobs", "3"], lambda c: _repro_ex(c).jobs, 3),
    "--quiet": Row(["--quiet"], lambda c: c.kw("audit_run_all")["progress"], False),
    "--no-compile": Row(["--no-compile"], lambda c: _repro_ex(c).compile_step, False),
    "--no-label-probe": Row(["--no-label-probe"], lambda c: _repro_ex(c).label_probe, False),
    "--list": Row(["--list"], None, None),                      # output switch: tests/test_reproduce.py
}.items()})
for sub in ("thresholds", "report"):
    ROWS[(sub, "audit_dir")] = Row(["other"], lambda c: Path(c.args("read_audit")[0]), Path("other"),
                                   replace=True)
ROWS[("lint", "paths")] = Row(["b.py", "c/"], lambda c: c.args("run_lint")[0], ["b.py", "c/"], replace=True)

ROWS[("audit", "--tensorboard")] = Row(["--tensorboard", "tb"], None, None)   # see below
ROWS[("audit", "--tracker")] = Row(["--tracker", "tensorboard:tb"], None, None)
ROWS[("audit", "--tracker-project")] = Row(["--tracker-project", "p"], None, None)

# Output switches change what is printed or logged, not what is computed; each is checked by its
# output (the audit's TensorBoard log after its runs: tests/test_tensorboard.py reads it back; its
# --tracker runs and their project: tests/test_trackers.py reads them back).
OUTPUT_SWITCHES = {("", "--version"), ("diagnose", "--json"), ("calibrate", "--json"), ("check", "--json"),
                   ("audit", "--tensorboard"), ("audit", "--tracker"), ("audit", "--tracker-project"),
                   ("reproduce", "--list")}


def _options() -> set[tuple[str, str]]:
    """(subcommand, option) for every option and positional of the parser ("" = the top level)."""
    parser = build_parser()
    found = set()

    def walk(p: argparse.ArgumentParser, name: str) -> None:
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(sub, sub_name)
                continue
            found.add((name, action.option_strings[-1] if action.option_strings else action.dest))
    walk(parser, "")
    return found


def test_every_option_has_a_row():
    options = _options()
    assert options - set(ROWS) == set(), "add a row to ROWS for each new option"
    assert set(ROWS) - options == set(), "ROWS names options the parser no longer has"


# -- running a command up to its terminal call ----------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny trained run and its frozen control (real folders: `diagnose` loads them)."""
    from creditaudit.config import RunConfig
    from creditaudit.train import train_run
    root = tmp_path_factory.mktemp("settings")
    data = load_dataset("digits")
    config = RunConfig(dataset="digits", width=8, blocks=1, epochs=1)
    train_run(config, root / WORK / "run", data=data, progress=False)
    train_run(config.replace(trainable_blocks=0), root / WORK / "frozen", data=data, progress=False)
    return root


@pytest.fixture
def run_cli(folders, monkeypatch):
    monkeypatch.chdir(folders)
    (folders / "a.toml").write_text('preset = "quick"\n[model]\nwidth = 24\n')
    calls = Calls(loads=[], threads=[])
    small = {name: load_dataset(name) for name in ("digits", "synthetic")}

    def recorder(name: str, then: Callable | None = None):
        def record(*args, **kwargs):
            calls[name] = (args, kwargs)
            if then is None:
                raise Stop
            return then(*args, **kwargs)
        return record

    def fake_load(name, data_dir=None, device="cpu", download=True, label_probe=True):
        calls["loads"].append((name, str(data_dir), label_probe))
        return small["digits" if name == "digits" else "synthetic"].to(device)

    # "meta" stands for a device other than the default: the real resolver refuses it (only cpu and
    # cuda train), so it is let through here, where nothing runs on it
    import creditaudit.runs
    real_resolve = creditaudit.runs.resolve_device
    real_as_device = creditaudit.runs.as_device
    monkeypatch.setattr(creditaudit.runs, "resolve_device",
                        lambda d="auto": torch.device("meta") if str(d) == "meta" else real_resolve(d))
    monkeypatch.setattr(creditaudit.runs, "as_device", lambda d, default=None: torch.device("meta")
                        if str(d) == "meta" else real_as_device(d, default))
    import creditaudit.commands.diagnose
    monkeypatch.setattr(creditaudit.commands.diagnose, "_check_credit", lambda *a, **k: None)   # runs credit(): not on meta
    real_set_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls["threads"].append(n), real_set_threads(1)))
    monkeypatch.setattr(creditaudit.data, "load_dataset", fake_load)
    monkeypatch.setattr(creditaudit.experiments.identity, "load_dataset", fake_load)
    monkeypatch.setattr(creditaudit.train, "train_run", recorder("train_run"))
    monkeypatch.setattr(creditaudit.experiments.common, "diagnose_run", recorder("diagnose_run"))
    monkeypatch.setattr(creditaudit.usermodel, "user_model_evidence", recorder("user_model_evidence"))
    monkeypatch.setattr(creditaudit.check, "check_path", recorder("check_path"))
    for module in ("audit", "ladder", "penalty"):   # the modules (the package exports functions of
        monkeypatch.setattr(importlib.import_module(f"creditaudit.experiments.{module}"),  # 2 names)
                            "run_all", recorder(f"{module}_run_all"))
    monkeypatch.setattr(creditaudit.experiments, "identity_check_experiment",
                        recorder("identity_experiment", creditaudit.experiments.identity_check_experiment))
    monkeypatch.setattr(creditaudit.experiments.identity, "build_model",
                        recorder("build_model", creditaudit.experiments.identity.build_model))
    monkeypatch.setattr(creditaudit.experiments.identity, "identity_check", recorder("identity_check"))
    monkeypatch.setattr(creditaudit.experiments, "read_audit", recorder("read_audit"))
    monkeypatch.setattr(creditaudit.lint, "run_lint", recorder("run_lint"))

    def run(argv: list[str]) -> Calls:
        calls.clear()
        calls.update(loads=[], threads=[])
        try:
            code = cli_main(argv)
        except Stop:
            if "identity_check" in calls:          # its model builder is only called when measured
                calls.args("identity_check")[0](1)
            return calls
        raise AssertionError(f"creditaudit {' '.join(argv)} returned {code} before its terminal call")
    return run


@pytest.mark.parametrize("key", sorted(set(ROWS) - OUTPUT_SWITCHES), ids=" ".join)
def test_option_reaches_what_it_controls(key, run_cli):
    sub, _ = key
    row = ROWS[key]
    base = BASE[sub] if row.base is None else row.base
    without = row.probe(run_cli([sub, *base]))
    got = row.probe(run_cli([sub, *row.extra] if row.replace else [sub, *base, *row.extra]))
    assert got == row.expected, f"{sub} {' '.join(row.extra)}: got {got!r}"
    assert without != row.expected, f"the row of {sub} {row.extra[0]} does not change anything"


def test_output_switches(folders, monkeypatch, capsys):
    """--version prints the version; --json prints what the plain output shows, as JSON."""
    from creditaudit import __version__
    monkeypatch.chdir(folders)
    with pytest.raises(SystemExit):
        cli_main(["--version"])
    assert capsys.readouterr().out.strip() == f"creditaudit {__version__}"
    for sub in ("calibrate", "diagnose"):
        extra = ["--null-draws", "2"] if sub == "calibrate" else []
        assert cli_main([sub, RUN, "--device", "cpu", *extra]) == 0
        plain = capsys.readouterr().out
        assert cli_main([sub, RUN, "--device", "cpu", "--json", *extra]) == 0
        report = json.loads(capsys.readouterr().out)
        assert isinstance(report, dict) and report["label"] in plain and "{" not in plain
    from creditaudit.check import check_path
    from creditaudit.runs import write_diagnosis
    write_diagnosis(Path(RUN), report)       # the last diagnose --json, bound to its run
    code = cli_main(["check", RUN])
    lines = capsys.readouterr().out
    assert cli_main(["check", RUN, "--json"]) == code
    assert json.loads(capsys.readouterr().out) == check_path(Path(RUN))[2] and lines


# -- audit's run options are the config file's -------------------------------------------------------
def _run_keys(calls: Calls) -> list[str]:
    return sorted(c.run_key for c in calls.args("audit_run_all")[0])


def test_audit_options_give_the_run_keys_of_the_same_settings_in_toml(run_cli):
    """--option, --lr, --width and --blocks of `audit` are the [options.METHOD], [training] and
    [model] tables of a config file: the same runs, key for key. KEY=VALUE reaches every audited
    method that declares KEY (and no other), METHOD.KEY=VALUE that method alone, and a pair
    overrides the same key of the file's table, leaving its other keys."""
    Path("same.toml").write_text(
        'dataset = "digits"\nmethods = ["bp", "ep", "dfa-penalty", "sb"]\nseeds = [1, 2]\nepochs = 2\n'
        '[model]\nwidth = 8\nblocks = 2\n[training]\nlr = 0.01\n'
        '[options.ep]\nbeta = 0.5\nsteps = 3\n[options.dfa-penalty]\nlam = 0.2\n[options.sb]\nlam = 0.2\n')
    Path("base.toml").write_text(
        'dataset = "digits"\nmethods = ["bp", "ep", "dfa-penalty", "sb"]\nseeds = [1, 2]\nepochs = 2\n'
        '[options.ep]\nbeta = 2.0\nsteps = 3\n')
    from_file = _run_keys(run_cli(["audit", "--out", AUDIT_OUT, "--config", "same.toml"]))
    given = _run_keys(run_cli(["audit", "--out", AUDIT_OUT, "--config", "base.toml", "--width", "8",
                               "--blocks", "2", "--lr", "0.01", "--option", "ep.beta=0.5",
                               "--option", "lam=0.2"]))
    assert given == from_file
    plain = _run_keys(run_cli(["audit", "--out", AUDIT_OUT, "--config", "base.toml"]))
    assert set(plain).isdisjoint(from_file)       # the options changed every run's key
    # lam reached both methods that declare it, beta ep alone (bp declares neither)
    configs = run_cli(["audit", "--out", AUDIT_OUT, "--config", "base.toml", "--option", "lam=0.2",
                       "--option", "ep.beta=0.5"]).args("audit_run_all")[0]
    mains = {x.method: x.options for x in configs if x.control == "none" and x.seed == 1}
    assert mains["bp"] == {} and mains["dfa-penalty"]["lam"] == mains["sb"]["lam"] == 0.2
    assert mains["ep"]["beta"] == 0.5 and mains["ep"]["steps"] == 3


@pytest.mark.parametrize("argv, says", [
    (["--option", "decay=10"], "no audited method (bp, ep) has an option 'decay'; kolen-pollack declares it"),
    (["--option", "fa.beta=1"], "names fa, which this audit does not train"),
    (["--option", "ep.beta=-1"], "option beta of method 'ep' must lie in"),
    (["--blocks", "0"], "--blocks must be ≥ 1"),
    (["--lr", "inf"], "argument --lr: expected a finite number"),
    (["--unknown", "1"], "unrecognized arguments: --unknown 1 (see: creditaudit audit --help)"),
])
def test_audit_options_are_refused_in_one_line(run_cli, capsys, argv, says):
    """A bad run option of `audit` is one line and exit 2, as train's; an argument `audit` does not
    take points at `creditaudit audit --help`, not at the top level's."""
    assert cli_main(["audit", "--out", AUDIT_OUT, "--methods", "bp", "ep", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


# -- beyond the command line: a setting reaches the step it controls ---------------------------------
def test_clip_travels_from_toml_to_the_step_and_back_from_the_run_folder(tmp_path):
    """[training] clip → every RunConfig of the audit → the method's settings → each trainable
    block's gradient norm after a step; the run folder rebuilds the method with the same clip, and
    runs that differ only in clip never share a stack."""
    from creditaudit.config import audit_config_from_dict
    from creditaudit.runs import build_method, build_model, load_run
    from creditaudit.train import group_stacks
    from creditaudit.train import train_run
    audit = audit_config_from_dict({"dataset": "digits", "methods": ["dfa"], "seeds": [1],
                                    "training": {"clip": 1e-3}, "model": {"width": 16, "blocks": 2}})
    configs = audit.run_configs()
    # dfa's runs clip; the yardstick's (bp's frozen control) clips nothing and keeps the default,
    # so its key is the one of any audit's yardstick
    assert {c.clip for c in configs if c.method == "dfa"} == {1e-3}
    assert {c.clip for c in configs if c.method == "bp"} == {1.0}
    data = load_dataset("digits")
    config = next(c for c in configs if c.method == "dfa")
    model = build_model(config, data.input_shape, data.n_classes)
    method = build_method(config, model)
    assert method.settings.clip == 1e-3
    x, y = data.eval_batch(0)
    method.train_step(x, y)
    for block in model.blocks:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in block.parameters()]))
        assert 0 < norm <= 1e-3 * (1 + 1e-4)
    run = train_run(config.replace(epochs=1), tmp_path / "r", data=data, progress=False)
    assert load_run(tmp_path / "r").method.settings.clip == 1e-3 == run.config.clip
    assert len(group_stacks([config, config.replace(clip=2.0)])) == 2
    assert len(group_stacks([config, config.replace(seed=2)])) == 1


def test_defaults_of_the_python_api_are_the_run_config_defaults():
    """MethodSettings (the methods' direct Python API) repeats RunConfig's defaults for the knobs
    both have; this keeps the two from drifting apart."""
    import dataclasses
    from creditaudit.config import RunConfig, default
    from creditaudit.methods import MethodSettings
    same_meaning = ("seed", "lr", "weight_decay", "clip")    # trainable_blocks: ids there, a count here
    for name in same_meaning:
        assert MethodSettings.__dataclass_fields__[name].default == default(RunConfig, name), name
