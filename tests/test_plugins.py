"""The user's own learning rule (--method PKG.MODULE:CLASS) and own model (--model PKG.MODULE:FACTORY),
run the way a user would: packages outside src/, on PYTHONPATH, through the command line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import save_file

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
TINY = ["--dataset", "digits", "--width", "16", "--blocks", "2", "--epochs", "2"]


SRC = Path(__file__).resolve().parents[1] / "src"


def cli(args, cwd, pythonpath, timeout=240):
    # the user's packages first, then this checkout's src (the subprocess runs the code under test,
    # not whichever creditaudit happens to be installed), then whatever else was on the path
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(p) for p in [*pythonpath, SRC]] + inherited),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "creditaudit", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_error_line(proc) -> str:
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_example_method_trains_and_audits_through_the_cli(tmp_path):
    run = cli(["train", "--method", "scfa:SignConcordantFA", *TINY, "--out", "run", "--quiet"],
              tmp_path, [EXAMPLES])
    assert run.returncode == 0, run.stderr
    assert "finished after 2/2 epochs" in run.stdout
    audit = cli(["audit", "--methods", "scfa:SignConcordantFA", "bp", "--dataset", "digits",
                 "--seeds", "42", "--epochs", "2", "--out", "audit", "--jobs", "1", "--quiet",
                 "--config", str(_toml(tmp_path))], tmp_path, [EXAMPLES])
    assert audit.returncode in (0, 3), audit.stderr
    result = json.loads((tmp_path / "audit" / "audit.json").read_text())
    row = next(m for m in result["methods"] if m["method"] == "scfa:SignConcordantFA")
    controls = {r["control"] for r in result["runs"] if r["method"] == "scfa:SignConcordantFA"}
    assert controls == {"none", "frozen", "shallow"}          # every control, like a built-in
    assert row["verdict"].split(":")[0] in ("trustworthy", "walk back", "incomplete")
    assert row["gamma_layers"] is not None and row["null_layers"] is not None  # Γ and its null
    # every table names the rule by its `name`; audit.md gives its import path once
    assert row["rule_name"] == "scfa"
    md = (tmp_path / "audit" / "audit.md").read_text()
    assert md.count("scfa:SignConcordantFA`") == 1 and "`scfa:SignConcordantFA`" in md
    assert "| scfa " in md and "| scfa:SignConcordantFA " not in md
    table = audit.stdout.split("\n\n")
    assert any(part.startswith("method ") and "\nscfa " in part for part in table), audit.stdout


def _toml(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text("[model]\nwidth = 16\nblocks = 2\n")
    return path


def test_user_method_options_are_validated_like_builtins(tmp_path):
    proc = cli(["train", "--method", "scfa:SignConcordantFA", *TINY, "--option", "magnitude=-1"],
               tmp_path, [EXAMPLES])
    assert "magnitude" in one_error_line(proc)
    assert not (tmp_path / "runs").exists()                     # refused before any training


def test_unimportable_method_is_one_line(tmp_path):
    proc = cli(["train", "--method", "nosuchpkg.rules:Nope", *TINY], tmp_path, [])
    assert "nosuchpkg" in one_error_line(proc)


def _audit_bp_subclass(tmp_path: Path, module: str, cls: str, step: str, *args: str):
    """`creditaudit audit` of a user rule `module:cls`, bp with `train_step(self, x, y)` whose body is
    `step` (its lines, indented for the method), from a package on PYTHONPATH; the finished process."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = textwrap.indent(textwrap.dedent(step).strip(), " " * 8)
    (pkg / f"{module}.py").write_text("import warnings\nfrom creditaudit.methods.bp import BP\n\n\n"
                                      f"class {cls}(BP):\n    name = {cls.lower()!r}\n\n"
                                      f"    def train_step(self, x, y):\n{body}\n")
    return cli(["audit", "--methods", f"{module}:{cls}", *args, "--dataset", "digits", "--out", "audit",
                "--quiet", "--config", str(_toml(tmp_path))], tmp_path, [pkg])


def test_a_raising_user_method_fails_its_run_and_the_audit_completes(tmp_path):
    proc = _audit_bp_subclass(tmp_path, "badrule", "Exploding", 'raise RuntimeError("my rule has a bug")',
                              "bp", "--seeds", "42", "--epochs", "2", "--jobs", "1")
    assert proc.returncode == 3, proc.stderr                    # a run failed: not a clean audit
    result = json.loads((tmp_path / "audit" / "audit.json").read_text())
    bad = [r for r in result["runs"] if r["method"] == "badrule:Exploding"]
    assert bad and all(r["status"] == "failed" for r in bad if r["control"] != "shallow")
    traceback = tmp_path / bad[0]["run_dir"] / "error.txt"
    assert "my rule has a bug" in traceback.read_text()
    rows = {m["method"]: m for m in result["methods"]}
    assert rows["badrule:Exploding"]["verdict"].startswith("incomplete")
    assert all(r["status"] == "finished" for r in result["runs"] if r["method"] == "bp")


def test_a_warning_raised_in_every_worker_is_told_once(tmp_path):
    """A rule that warns at every step, trained by two worker processes: the warning reaches the
    terminal once for the audit, with its category and where it was raised, not once per worker or
    run; another message is another line."""
    proc = _audit_bp_subclass(tmp_path, "chatty", "Chatty", '''
        warnings.warn("the chatty rule steps")
        if not self.settings.trainable_blocks:
            warnings.warn("the chatty rule trains no block")
        return super().train_step(x, y)
    ''', "--seeds", "1", "2", "--epochs", "1", "--jobs", "2")
    assert proc.returncode in (0, 3), proc.stderr
    runs = [r for r in json.loads((tmp_path / "audit" / "audit.json").read_text())["runs"]
            if r["method"] == "chatty:Chatty"]
    assert len(runs) == 6 and all(r["status"] == "finished" for r in runs)   # main, frozen, shallow × 2
    lines = proc.stderr.splitlines()
    steps = [l for l in lines if "UserWarning: the chatty rule steps" in l]
    assert len(steps) == 1 and "chatty.py:" in steps[0], proc.stderr
    assert len([l for l in lines if "UserWarning: the chatty rule trains no block" in l]) == 1, proc.stderr
    assert not list((tmp_path / "audit").glob(".warned-*"))      # the workers' shared record is gone


def _user_model_package(tmp_path: Path) -> Path:
    pkg = tmp_path / "models"
    pkg.mkdir()
    (pkg / "mynets.py").write_text(textwrap.dedent('''
        import torch
        from creditaudit.model import ResidualMLP

        def make():
            torch.manual_seed(0)
            return ResidualMLP(64, d=16, n_blocks=2, n_classes=10)

        def wrong():
            return "not a model"
    '''))
    return pkg


def test_user_model_from_the_command_line(tmp_path):
    from creditaudit.data import load_dataset
    from creditaudit.methods import MethodSettings, method_class
    from creditaudit.model import ResidualMLP
    pkg = _user_model_package(tmp_path)
    torch.manual_seed(0)
    init = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
    save_file(init.state_dict(), str(tmp_path / "init.safetensors"))
    data = load_dataset("digits")
    trained = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
    trained.load_state_dict(init.state_dict())
    frozen = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
    frozen.load_state_dict(init.state_dict())
    for model, blocks in ((trained, (0, 1)), (frozen, ())):
        bp = method_class("bp")(model, MethodSettings(epochs=20, trainable_blocks=blocks, lr=3e-3))
        gen = torch.Generator().manual_seed(0)
        for _ in range(20):
            for x, y in data.train_batches(128, gen):
                bp.train_step(x, y)
            bp.end_epoch()
    save_file(trained.state_dict(), str(tmp_path / "trained.safetensors"))
    save_file(frozen.state_dict(), str(tmp_path / "frozen.safetensors"))
    args = ["--model", "mynets:make", "--weights", "trained.safetensors", "--dataset", "digits",
            "--eval-batches", "2"]
    proc = cli(["diagnose", *args, "--frozen-control", "frozen.safetensors",
                "--init-weights", "init.safetensors", "--json"], tmp_path, [pkg])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["flags"]["d"] is not None and report["flags"]["a_prime"] is not None
    assert report["depth"]["acc"] > report["depth"]["frozen_acc"]
    check = cli(["check", *args, "--frozen-control", "frozen.safetensors",
                 "--init-weights", "init.safetensors"], tmp_path, [pkg])
    assert check.returncode == {"trustworthy": 0, "walk back": 1}.get(
        report["verdict"].split(":")[0], 3), check.stdout
    # without the control and the init weights, it cannot be trustworthy
    partial = json.loads(cli(["diagnose", *args, "--json"], tmp_path, [pkg]).stdout)
    assert not partial["verdict"].startswith("trustworthy")
    assert "d" in partial["not_evaluated"]


def test_user_model_errors_are_one_line(tmp_path):
    pkg = _user_model_package(tmp_path)
    save_file({"bogus": torch.zeros(3)}, str(tmp_path / "bad.safetensors"))
    base = ["diagnose", "--dataset", "digits", "--eval-batches", "2"]
    assert "nosuch" in one_error_line(cli([*base, "--model", "nosuch.mod:make", "--weights", "bad.safetensors"],
                                          tmp_path, [pkg]))
    assert "must return" in one_error_line(cli([*base, "--model", "mynets:wrong", "--weights", "bad.safetensors"],
                                               tmp_path, [pkg]))
    assert "do not fit" in one_error_line(cli([*base, "--model", "mynets:make", "--weights", "bad.safetensors"],
                                              tmp_path, [pkg]))


def test_writing_a_rule_example_trains_and_is_diagnosed_through_the_cli(tmp_path):
    """docs/WRITING_A_RULE.md's worked rule (src/creditaudit/methods/drtp.py, built in) named the
    way a user names their own, PKG.MODULE:CLASS: its option is validated, it trains, its credit is
    measured at every position with its null, and `check` reads the result."""
    spec = "creditaudit.methods.drtp:DRTP"
    bad = cli(["train", "--method", spec, *TINY, "--option", "mix=2"], tmp_path, [])
    assert "mix" in one_error_line(bad)
    run = cli(["train", "--method", spec, *TINY, "--option", "mix=0.5", "--out", "run",
               "--quiet", "--threads", "1"], tmp_path, [])
    assert run.returncode == 0 and "finished after 2/2 epochs" in run.stdout, run.stderr
    diag = cli(["diagnose", "run", "--json", "--threads", "1"], tmp_path, [])
    assert diag.returncode == 0, diag.stderr
    report = json.loads(diag.stdout)
    assert len(report["gamma"]) == 3 and report["null"] is not None      # Γ at l = 0…L and its null
    check = cli(["check", "run"], tmp_path, [])                           # diagnose saved diagnosis.json
    assert check.returncode == 3 and "incomplete" in check.stdout, check.stderr   # no frozen control


def test_user_model_with_zero_initialised_branches_is_told_its_control_is_shallow(tmp_path):
    """A model of your own whose residual branches start at exactly 0 (ResNet's zero-γ, many
    transformers): its frozen control is exactly a shallow network. Measured on the control's
    blocks, the diagnosis says so and what (d) then asks."""
    from creditaudit.data import load_dataset
    from creditaudit.methods import MethodSettings, method_class
    from creditaudit.model import ResidualMLP
    pkg = tmp_path / "models"
    pkg.mkdir()
    (pkg / "zeronets.py").write_text(textwrap.dedent('''
        import torch
        from creditaudit.model import ResidualMLP

        def make():
            torch.manual_seed(0)
            return ResidualMLP(64, d=16, n_blocks=2, n_classes=10, w2_std=0.0)
    '''))
    torch.manual_seed(0)
    init = ResidualMLP(64, d=16, n_blocks=2, n_classes=10, w2_std=0.0)
    save_file(init.state_dict(), str(tmp_path / "init.safetensors"))
    data = load_dataset("digits")
    for name, blocks in (("trained", (0, 1)), ("frozen", ())):
        model = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
        model.load_state_dict(init.state_dict())
        bp = method_class("bp")(model, MethodSettings(epochs=3, trainable_blocks=blocks, lr=3e-3))
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            for x, y in data.train_batches(128, gen):
                bp.train_step(x, y)
            bp.end_epoch()
        save_file(model.state_dict(), str(tmp_path / f"{name}.safetensors"))
    proc = cli(["diagnose", "--model", "zeronets:make", "--weights", "trained.safetensors", "--dataset",
                "digits", "--eval-batches", "2", "--frozen-control", "frozen.safetensors",
                "--init-weights", "init.safetensors", "--json"], tmp_path, [pkg])
    assert proc.returncode == 0, proc.stderr
    notes = " ".join(json.loads(proc.stdout)["notes"])
    assert "exactly a shallow network" in notes and "beat no blocks at all" in notes
