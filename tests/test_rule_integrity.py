"""Issue 34, items 3 and 4: a run starts from the weights its seed gives (a rule that moves them
outside its steps is refused), and a user rule's runs and diagnoses are keyed by all the code it
runs (an edited rule or helper trains and diagnoses again, and says why). Tiny runs: digits, width
16, 2 blocks, 1 epoch, in this process."""
from __future__ import annotations

import hashlib
import importlib
import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from creditaudit import CreditAuditError
from creditaudit.cli import main
from creditaudit.config import RunConfig
from creditaudit.data import load_dataset
from creditaudit.methods import METHODS
from creditaudit.methods.rule_code import code_of
from creditaudit.runs import build_model, load_run, weights_digest
from creditaudit.train import train_run, train_runs

TINY = dict(dataset="digits", width=16, blocks=2, epochs=1)
CLI_TINY = ["--dataset", "digits", "--width", "16", "--blocks", "2", "--epochs", "1", "--quiet",
            "--device", "cpu", "--threads", "1"]

RULES = '''
import torch
from creditaudit.methods.bp import BP
from .helpers import scale


class Honest(BP):
    name = "honest"

    def credit(self, x, y):
        return [scale(c) for c in super().credit(x, y)]

    def later(self):
        from . import lazy            # imported inside a function: code the rule runs too
        return lazy.VALUE


class PretrainInInit(BP):
    """Pretrains every weight by backprop inside __init__ (issue 34 item 3)."""
    name = "pretrain"

    def __init__(self, model, settings):
        super().__init__(model, settings)
        x = torch.randn(64, 64)
        y = torch.randint(0, 10, (64,))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()


class MovesInCredit(BP):
    """Moves the weights when its credit is read (the monitor reads it at epoch 0)."""
    name = "movesincredit"

    def credit(self, x, y):
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.01)
        return super().credit(x, y)


class MovesAtLoad(BP):
    """Honest while it trains; moves the weights when it is built over a trained model."""
    name = "movesatload"
    MOVE = False

    def __init__(self, model, settings):
        super().__init__(model, settings)
        if type(self).MOVE:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
'''


def _package(root: Path, name: str) -> Path:
    """A user package `name` under `root`: rules.py imports helpers.py, which imports deep.py;
    lazy.py is imported inside a function; unrelated.py is imported by nothing."""
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "rules.py").write_text(RULES)
    (pkg / "helpers.py").write_text("import math\nfrom .deep import FACTOR\n\n"
                                    "def scale(t):\n    return t * FACTOR\n")
    (pkg / "deep.py").write_text("FACTOR = 1.0\n")
    (pkg / "lazy.py").write_text("VALUE = 1\n")
    (pkg / "unrelated.py").write_text("X = 1\n")
    return pkg


@pytest.fixture
def userpkg(tmp_path, monkeypatch, request):
    name = "rules34_" + hashlib.sha256(request.node.name.encode()).hexdigest()[:8]
    pkg = _package(tmp_path / "src", name)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    importlib.invalidate_caches()
    yield name, pkg
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", None, "cpu")


# -- item 3: runs start where the seed says -----------------------------------------------------
def test_a_rule_that_pretrains_in_its_init_is_refused_in_one_line(userpkg, tmp_path, capsys):
    name, _ = userpkg
    spec = f"{name}.rules:PretrainInInit"
    out = tmp_path / "run"
    assert main(["train", *CLI_TINY, "--method", spec, "--out", str(out)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "Traceback" not in err[0]
    assert spec in err[0] and "in its __init__" in err[0] and "training steps" in err[0]
    assert not (out / "checkpoint.json").exists()            # nothing of it was kept as a run


def test_a_rule_that_moves_weights_at_epoch_0_is_refused(userpkg, tmp_path, digits):
    name, _ = userpkg
    with pytest.raises(CreditAuditError, match="before its first step"):
        train_run(RunConfig(method=f"{name}.rules:MovesInCredit", **TINY), tmp_path / "run",
                  data=digits, progress=False)


def test_rebuilding_a_method_that_moves_the_loaded_weights_is_refused(userpkg, tmp_path, digits):
    name, _ = userpkg
    spec = f"{name}.rules:MovesAtLoad"
    run = train_run(RunConfig(method=spec, **TINY), tmp_path / "run", data=digits, progress=False)
    assert run.finished                                     # honest while it trained
    cls = importlib.import_module(f"{name}.rules").MovesAtLoad
    cls.MOVE = True
    try:
        with pytest.raises(CreditAuditError, match="when it is built again"):
            load_run(tmp_path / "run")
    finally:
        cls.MOVE = False
    assert load_run(tmp_path / "run").finished               # the same folder reads back once honest


def test_the_initial_weights_digest_is_the_seeds_for_stacked_and_lone_runs(tmp_path, digits):
    c1, c2 = (RunConfig(method="bp", seed=s, **TINY).bind_data(digits.digest) for s in (1, 2))
    stacked = train_runs([c1, c2], [tmp_path / "s1", tmp_path / "s2"], data=digits, progress=False)
    assert [t.stack_size for t in stacked] == [2, 2]
    train_run(c1, tmp_path / "lone", data=digits, progress=False)

    def recorded(d):
        ckpt = json.loads((d / "checkpoint.json").read_text())["init_weights"]
        status = json.loads((d / "status.json").read_text())["init_weights"]
        assert ckpt == status == load_run(d).init_weights
        return ckpt

    seed1 = weights_digest(build_model(c1, digits.input_shape, digits.n_classes))
    assert recorded(tmp_path / "s1") == recorded(tmp_path / "lone") == seed1
    assert recorded(tmp_path / "s2") == weights_digest(build_model(c2, digits.input_shape, digits.n_classes))
    assert recorded(tmp_path / "s2") != seed1
    # and it is the initial weights', not the trained ones'
    assert weights_digest(load_run(tmp_path / "lone").model) != seed1


# -- item 4: reuse keyed by all the code that ran -----------------------------------------------
def test_builtin_run_keys_are_unchanged():
    for method in METHODS:
        config = RunConfig(method=method, **TINY)
        blob = json.dumps(config.to_dict(), sort_keys=True, separators=(",", ":"))
        assert config.rule_code is None
        assert config.run_key == hashlib.sha256(blob.encode()).hexdigest()[:12]
    # the key this run has had since TRAINING_CODE_VERSION 4 (issue 35: PEPITA's reference step);
    # existing folders keep theirs (a new RunConfig field or a TRAINING_CODE_VERSION bump changes it
    # on purpose: update it then; it was 60aee272ceec under version 3)
    assert RunConfig(method="bp", **TINY).bind_data("0" * 64).run_key == "9024152e4bd1"


def test_a_user_rules_code_is_its_package_modules_it_imports(userpkg):
    name, pkg = userpkg
    spec = f"{name}.rules:Honest"
    code = code_of(spec)
    assert set(code) == {f"{name}/{f}" for f in ("__init__.py", "rules.py", "helpers.py", "deep.py", "lazy.py")}
    assert code[f"{name}/deep.py"] == hashlib.sha256((pkg / "deep.py").read_bytes()).hexdigest()
    key = RunConfig(method=spec, **TINY).run_key
    (pkg / "unrelated.py").write_text("X = 2\n")              # imported by nothing: the same run
    assert RunConfig(method=spec, **TINY).run_key == key
    for module in ("deep.py", "lazy.py", "rules.py"):
        before = RunConfig(method=spec, **TINY).run_key
        (pkg / module).write_text((pkg / module).read_text() + "\n# edited\n")
        assert RunConfig(method=spec, **TINY).run_key != before, module


def test_an_edited_helper_trains_and_diagnoses_again_and_says_why(userpkg, tmp_path, capsys):
    name, pkg = userpkg
    spec = f"{name}.rules:Honest"
    out = tmp_path / "audit"
    toml = tmp_path / "tiny.toml"
    toml.write_text("[model]\nwidth = 16\nblocks = 2\n")
    audit = ["audit", "--config", str(toml), "--methods", spec, "--dataset", "digits", "--seeds", "1",
             "--epochs", "1", "--out", str(out), "--jobs", "1", "--quiet", "--device", "cpu"]

    def run_audit():
        assert main(audit) in (0, 3)
        result = json.loads((out / "audit.json").read_text())
        mine = [r for r in result["runs"] if r["method"] == spec]
        assert len(mine) == 3                               # the rule, its frozen and shallow controls
        return result, mine, capsys.readouterr()

    _, first, _ = run_audit()
    assert all(r["trained_now"] for r in first)
    result, again, said = run_audit()                       # unchanged code: every run and diagnosis reused
    assert result["runs_trained_now"] == 0 and result["diagnoses_reused"] == result["diagnoses"]
    assert "again" not in said.err

    (pkg / "deep.py").write_text("FACTOR = 3.0\n")          # the helper's helper, as a user edits it
    result, edited, said = run_audit()
    assert result["runs_trained_now"] == 3
    assert all(r["trained_now"] and not r["diagnosis_reused"] for r in edited)
    assert {r["key"] for r in edited}.isdisjoint({r["key"] for r in first})
    assert said.err.count(f"the rule's code changed since the run was trained ({name}/deep.py)") == 3
    # the old run's folder, named explicitly: refused in one line, never resumed nor read as this code's
    old = Path(next(r["run_dir"] for r in first if r["control"] == "none"))
    for argv, needle in ((["train", *CLI_TINY, "--method", spec, "--seed", "1", "--out", str(old)],
                          "trained by other code"),
                         (["diagnose", str(old), "--threads", "1"], "its weights are not this code's")):
        assert main(argv) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and needle in err[0] and f"{name}/deep.py" in err[0], err


def test_code_is_the_users_own_only(tmp_path):
    """The rule's own package counts even installed in site-packages; a top-level module beside it
    counts in the user's own folder and not in site-packages; creditaudit, torch and the standard
    library, which lie elsewhere, never do (read from the source: nothing here is imported)."""
    from creditaudit.methods.rule_code import rule_files
    for where, sibling_counts in (("work", True), ("lib/site-packages", False)):
        root = tmp_path / where
        (root / "mine").mkdir(parents=True)
        (root / "mine" / "__init__.py").write_text("")
        (root / "mine" / "rule.py").write_text(
            "import os, json, torch\nimport creditaudit.methods\nfrom creditaudit.methods.bp import BP\n"
            "import sibling\nfrom mine import helper\n")
        (root / "mine" / "helper.py").write_text("from . import helper\n")      # a cycle ends
        (root / "sibling.py").write_text("import mine.helper\n")
        code = rule_files("mine.rule", str(root / "mine" / "rule.py"), root)
        expected = {"mine/__init__.py", "mine/rule.py", "mine/helper.py"}
        assert set(code) == expected | ({"sibling.py"} if sibling_counts else set()), where
