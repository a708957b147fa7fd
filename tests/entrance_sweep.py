"""A hostile-but-realistic sweep over every entrance of creditaudit (issue 22): not a pytest file.

    python tests/entrance_sweep.py --out DIR [--only SUBSTRING] [--list]

Each case declares what a correct creditaudit does with its input:

    refusal            one line and exit 2 (CLI), or CreditAuditError / ValueError / TypeError raised
                       by creditaudit itself with a message (Python); no traceback on stderr
    result             it works: exit 0 (or the exit the case names), or the call returns
    never-trustworthy  it may run, but it must not print "trustworthy", `check` must not exit 0 on
                       what it wrote, and a returned Report must not say "trustworthy"
    handled            either a result or a refusal, never a traceback (e.g. lint of odd files)

and the sweep classifies what happened: clean refusal, correct result, traceback (an exception
escaped, or a refusal came from deep inside torch/pathlib rather than from creditaudit), silently
wrong (bad input accepted, or a "trustworthy" without evidence), or wrongly refused (a good input
refused). It prints the counts per class and every failure, and exits 1 when any case failed.
Tiny data throughout (digits, 1 epoch, width 16, 2 blocks) so the sweep takes minutes on one core.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
# its kill probes wait for a run's epoch-2 checkpoint: one after every epoch (train.CHECKPOINT_ENV)
os.environ.setdefault("CREDITAUDIT_CHECKPOINT_SECONDS", "0")
import torch  # noqa: E402

torch.set_num_threads(1)
warnings.simplefilter("ignore")

import creditaudit  # noqa: E402
from creditaudit import CreditAuditError  # noqa: E402
from creditaudit.cli import main as cli_main  # noqa: E402

PKG = Path(creditaudit.__file__).resolve().parent
TINY_MODEL = ["--width", "16", "--blocks", "2"]
TINY = ["--dataset", "digits", *TINY_MODEL, "--quiet", "--threads", "1", "--device", "cpu", "--epochs", "1"]
EXPECTS = ("refusal", "result", "never-trustworthy", "handled")
# a verdict, not the report's own words about verdicts ("0 are trustworthy", the definition line
# "trustworthy: these numbers …" / "- **trustworthy**: …", "trustworthy means …"), and not the
# paper's column ("paper's rule: trustworthy"): SPEC §6 keeps the paper's own rule there, for
# comparison with the paper (its (d) is the mean gap to the method's own control, no interval)
TRUSTWORTHY = re.compile(r"(?<!not )(?<!never )(?<!0 are )(?<!paper's rule: )\btrustworthy\b(?! means)(?!\*{0,2}:)")


@dataclass
class Case:
    name: str
    expect: str
    run: Callable[[], "Outcome"]
    owner: str = ""          # whose territory a known failure is (e.g. "gate")


@dataclass
class Outcome:
    kind: str                # "exit" (CLI) or "return" / "raise" (Python)
    code: int | None = None
    out: str = ""
    err: str = ""
    exc: BaseException | None = None
    value: object = None
    clean_exc: bool = False  # a refusal raised by creditaudit itself
    check_code: int | None = None
    wrong: str = ""          # what a case's own check found silently wrong in an outcome that looks right


# -- running an entrance -------------------------------------------------------------------------
def cli(*argv, check: Path | None = None) -> Callable[[], Outcome]:
    """The command line in this process (stdout/stderr captured); `check`: run `creditaudit check`
    on that folder afterwards, for never-trustworthy cases."""
    def run() -> Outcome:
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli_main([str(a) for a in argv])
        except SystemExit as exc:    # argparse's --help/--version, or user code calling sys.exit:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            return Outcome("exit", code, out.getvalue(), err.getvalue())   # the process exits so
        except BaseException as exc:  # noqa: BLE001 — anything escaping main() is a traceback
            return Outcome("raise", None, out.getvalue(), err.getvalue() + traceback.format_exc(), exc)
        result = Outcome("exit", code, out.getvalue(), err.getvalue())
        if check is not None and Path(check).exists():
            cout, cerr = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(cout), contextlib.redirect_stderr(cerr):
                try:
                    result.check_code = cli_main(["check", str(check)])
                except BaseException:  # noqa: BLE001
                    result.check_code = -1
        return result
    return run


def subproc(*argv, env: dict | None = None, check: Path | None = None) -> Callable[[], Outcome]:
    def run() -> Outcome:
        e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        proc = subprocess.run([sys.executable, "-m", "creditaudit", *map(str, argv)], env=e,
                              capture_output=True, timeout=600)
        enc = (env or {}).get("PYTHONIOENCODING", "utf-8")
        o = Outcome("exit", proc.returncode, proc.stdout.decode(enc, "replace"),
                    proc.stderr.decode(enc, "replace"))
        if check is not None and Path(check).exists():
            o.check_code = subprocess.run([sys.executable, "-m", "creditaudit", "check", str(check)],
                                          env=e, capture_output=True, timeout=600).returncode
        return o
    return run


def py(fn: Callable[[], object]) -> Callable[[], Outcome]:
    def run() -> Outcome:
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                value = fn()
        except (CreditAuditError, ValueError, TypeError) as exc:
            frames = traceback.extract_tb(exc.__traceback__)
            ours = bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(PKG)
            return Outcome("raise", exc=exc, clean_exc=isinstance(exc, CreditAuditError) or ours,
                           err=traceback.format_exc())
        except BaseException as exc:  # noqa: BLE001
            return Outcome("raise", exc=exc, err=traceback.format_exc())
        return Outcome("return", value=value)
    return run


def says_trustworthy(o: Outcome) -> bool:
    """A verdict of "trustworthy" anywhere in what the entrance produced."""
    if o.kind == "exit":
        return bool(TRUSTWORTHY.search(o.out)) or o.check_code == 0
    value = o.value
    reports = value if isinstance(value, (list, tuple)) else [value]
    for r in reports:
        for v in (getattr(r, "project", None), getattr(r, "paper", None)):
            if v is not None and getattr(v, "outcome", None) == "trustworthy":
                return True
        if isinstance(r, dict) and any(m.get("verdict", {}).get("outcome") == "trustworthy"
                                       for m in r.get("methods") or [] if isinstance(m, dict)):
            return True
    return o.check_code == 0


def classify(case: Case, o: Outcome) -> tuple[str, bool, str]:
    """(class, as expected, detail)."""
    if o.wrong:
        return "silently wrong", False, o.wrong
    if o.kind == "exit":
        lines = [l for l in o.err.strip().splitlines() if l.strip()]
        tb = "Traceback (most recent call last)" in o.err
        if tb:
            return "traceback", False, o.err.strip().splitlines()[-1][:300]
        if o.code == 2:
            one = len(lines) == 1 and lines[0].startswith("creditaudit: error:")
            if not one:
                return "traceback", False, f"exit 2 but not one line: {o.err.strip()[:300]!r}"
            cls = "clean refusal"
            ok = case.expect in ("refusal", "never-trustworthy", "handled")
            return (cls if ok else "wrongly refused"), ok, lines[0][:300]
        if case.expect == "refusal":
            return "silently wrong", False, f"exit {o.code}, expected a refusal; stdout: {o.out.strip()[-200:]!r}"
        if case.expect == "never-trustworthy" and says_trustworthy(o):
            return "silently wrong", False, (f"trustworthy without evidence (exit {o.code}, check "
                                            f"exit {o.check_code}); {o.out.strip()[-200:]!r}")
        expected_codes = getattr(case, "codes", None) or {0}
        if case.expect == "result" and o.code not in expected_codes:
            return "wrongly refused", False, f"exit {o.code}: {o.err.strip()[-300:]!r}"
        return "correct result", True, f"exit {o.code}"
    if o.kind == "raise":
        if isinstance(o.exc, (CreditAuditError, ValueError, TypeError)) and o.clean_exc:
            msg = " ".join(str(o.exc).split())
            if not msg:
                return "traceback", False, f"{type(o.exc).__name__} without a message"
            ok = case.expect in ("refusal", "never-trustworthy", "handled")
            return ("clean refusal" if ok else "wrongly refused"), ok, f"{type(o.exc).__name__}: {msg[:250]}"
        return "traceback", False, f"{type(o.exc).__name__}: {' '.join(str(o.exc).split())[:250]}"
    if case.expect == "refusal":
        return "silently wrong", False, f"returned {type(o.value).__name__}, expected a refusal"
    if case.expect == "never-trustworthy" and says_trustworthy(o):
        return "silently wrong", False, "a trustworthy verdict without evidence"
    return "correct result", True, "returned"


# -- fixtures: one tiny run, its control, a tiny audit -------------------------------------------
class World:
    def __init__(self, out: Path):
        self.out = out
        self.n = 0

    def fresh(self, name: str) -> Path:
        self.n += 1
        return self.out / "cases" / f"{self.n:04d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:60]}"

    def setup(self) -> None:
        o = self.out
        quiet = lambda *a: _must(cli(*a)(), a)
        quiet("train", *TINY, "--out", o / "run")
        quiet("train", *TINY, "--out", o / "frozen", "--frozen")
        quiet("train", *TINY, "--out", o / "run7", "--seed", "7")
        quiet("train", *TINY, "--out", o / "frozen7", "--frozen", "--seed", "7")
        quiet("train", *TINY, "--out", o / "shallow", "--shallow")
        quiet("diagnose", o / "run", "--frozen-control", o / "frozen", "--threads", "1")
        quiet("diagnose", o / "run7", "--frozen-control", o / "frozen7", "--threads", "1")
        (o / "audit.toml").write_text(textwrap.dedent("""
            dataset = "digits"
            methods = ["bp"]
            seeds = [1, 2]
            epochs = 1
            jobs = 1
            [model]
            width = 16
            blocks = 2
            """))
        quiet("audit", "--config", o / "audit.toml", "--out", o / "audit", "--quiet", "--device", "cpu")
        # a user package: factories and rules that fail in the ways real code fails
        pkg = o / "userpkg"
        pkg.mkdir(exist_ok=True)
        (pkg / "sweep_user.py").write_text(USER_CODE)
        sys.path.insert(0, str(pkg))
        from safetensors.torch import save_file
        import sweep_user
        torch.manual_seed(0)
        good = sweep_user.good()
        save_file({k: v.contiguous() for k, v in good.state_dict().items()}, str(o / "good.safetensors"))
        (o / "notjson.safetensors").write_text("{not safetensors")
        data = (o / "good.safetensors").read_bytes()
        (o / "truncated.safetensors").write_bytes(data[: len(data) // 2])


def _must(o: Outcome, argv) -> None:
    if o.kind != "exit" or o.code not in (0, 1, 3):
        raise SystemExit(f"sweep setup failed: creditaudit {' '.join(map(str, argv))}: {o.err[-2000:]}")


USER_CODE = '''
import sys
import torch
from creditaudit.model import ResidualMLP
from creditaudit.methods import METHODS, REFERENCE_METHOD

BP = METHODS[REFERENCE_METHOD]

def good():
    torch.manual_seed(0)
    return ResidualMLP(64, 16, 2, 10)
def raises():
    raise ValueError("factory is broken")
def returns_none():
    return None
def returns_int():
    return 5
def no_stream():
    return torch.nn.Linear(64, 10)
def needs_args(width):
    return ResidualMLP(64, width, 2, 10)
def exits():
    sys.exit(3)
def interrupts():
    raise KeyboardInterrupt
def half():
    return good().half()
def wrong_inputs():
    return ResidualMLP(40, 16, 2, 10)
def wrong_classes():
    return ResidualMLP(64, 16, 2, 3)
def shape_changer():
    m = good()
    m.blocks[0] = torch.nn.Linear(16, 8)
    return m
not_callable = 5

class Nameless(BP):
    name = ""
class WordRange(BP):
    name = "wordrange"
    option_defaults = {"k": 3}
    option_ranges = {"k": ("1", "10")}
class InitRaises(BP):
    name = "initraises"
    def __init__(self, model, settings):
        raise RuntimeError("rule cannot start")
class NanCredit(BP):
    name = "nancredit"
    def credit(self, x, y):
        return [torch.full_like(h, float("nan")) for h in super().credit(x, y)]
class ShortCredit(BP):
    name = "shortcredit"
    def credit(self, x, y):
        return super().credit(x, y)[:-1]
class ExitCredit(BP):
    name = "exitcredit"
    def credit(self, x, y):
        sys.exit(0)
class NotAMethod:
    name = "nope"

class _AlwaysTraining(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.bn, self.lin = torch.nn.BatchNorm1d(d), torch.nn.Linear(d, d)
    def forward(self, h):
        return self.lin(self.bn(h))
    def train(self, mode=True):          # a train() that ignores its argument
        return super().train(True)
def bn_training():
    m = good()
    m.blocks[0] = _AlwaysTraining(16)
    return m
def on_meta():
    with torch.device("meta"):
        return ResidualMLP(64, 16, 2, 10)
class TimidControl(BP):
    """Its frozen control steps at 1e-3 x the learning rate: embedding and readout move by ~1e-6."""
    name = "timidcontrol"
    def __init__(self, model, settings):
        super().__init__(model, settings)
        if not settings.trainable_blocks:
            for group in self.opt.param_groups:
                group["lr"] *= 1e-3
class OneStepControl(BP):
    """Its frozen control takes one optimizer step, then no more."""
    name = "onestepcontrol"
    def gradients(self, x, y):
        loss = super().gradients(x, y)
        if not self.settings.trainable_blocks:
            if getattr(self, "_stepped", False):
                for p in self.model.parameters():
                    p.grad = None
            self._stepped = True
        return loss
class ExactNone(BP):
    name = "exactnone"
    def exact_positions(self, n_blocks):
        return None
class ExactStr(BP):
    name = "exactstr"
    def exact_positions(self, n_blocks):
        return {0, "L"}
class ExactRaises(BP):
    name = "exactraises"
    def exact_positions(self, n_blocks):
        raise IndexError("no blocks yet")
class ExactNumpy(BP):
    name = "exactnumpy"
    def exact_positions(self, n_blocks):
        import numpy as np
        return {np.int64(n_blocks)}
_DFA = METHODS["dfa"]
class ExactEverywhereDFA(_DFA):
    """dfa claiming every position exact: its Γ is far from 1 below the readout."""
    name = "exacteverywheredfa"
    def exact_positions(self, n_blocks):
        return frozenset(range(n_blocks + 1))
class StrRecipe(BP):
    name = "strrecipe"
    recipe = "sgd"
class DictRecipe(BP):
    name = "dictrecipe"
    recipe = {"optimizer": "sgd"}
class PropertyRecipe(BP):
    name = "propertyrecipe"
    @property
    def recipe(self):
        return None
_FA = METHODS["fa"]
class ShortB(_FA):
    name = "shortb"
    def feedback_pairs(self):
        return [(k, w, b[..., :-1]) for k, w, b in super().feedback_pairs()]
class TransposedB(_FA):
    name = "transposedb"
    def feedback_pairs(self):
        return [(k, w, b.T) for k, w, b in super().feedback_pairs()]
class SwappedPair(_FA):
    name = "swappedpair"
    def feedback_pairs(self):
        return [(k, b, w) for k, w, b in super().feedback_pairs()]
class ReadoutOnlyControl(BP):
    """Its frozen control trains its readout only: the embedding stays at initialisation."""
    name = "readoutonlycontrol"
    def gradients(self, x, y):
        loss = super().gradients(x, y)
        if not self.settings.trainable_blocks:
            for p in self.model.embed_parameters():
                p.grad = None
        return loss
'''


# -- the cases -----------------------------------------------------------------------------------
def cases(w: World) -> list[Case]:
    o = w.out
    C: list[Case] = []
    add = lambda name, expect, run, owner="": C.append(Case(name, expect, run, owner))

    # train: every numeric option with values a tired user types
    bad_count = ["", "abc", "nan", "inf", "-1", "1e400", "99999999999999999999", "1.5", "0x10", "None", "💥"]
    for opt in ("--epochs", "--width", "--blocks", "--batch-size", "--stop-when-flagged",
                "--trainable-blocks", "--threads"):
        for v in bad_count:
            add(f"train {opt} {v!r}", "refusal", cli("train", *TINY, opt, v, "--out", w.fresh("t")))
    for opt in ("--lr", "--weight-decay", "--w2-std", "--clip", "--lam"):
        for v in ["", "abc", "nan", "inf", "-inf", "-1", "1e400", "--"]:
            add(f"train {opt} {v!r}", "refusal", cli("train", *TINY, opt, v, "--out", w.fresh("t")))
    for v in ["-1", str(2 ** 63), "abc", "1.5", ""]:
        add(f"train --seed {v!r}", "refusal", cli("train", *TINY, "--seed", v, "--out", w.fresh("t")))
    for args in (["--method", "nope"], ["--method", ""], ["--method", "sweep_user:NotAMethod"],
                 ["--method", "sweep_user:Nameless"], ["--method", "sweep_user:WordRange"],
                 ["--method", "no_such_pkg:Cls"], ["--method", ":"], ["--method", "sweep_user:"],
                 ["--dataset", "nope"], ["--arch", "nope"], ["--activation", "nope"],
                 ["--precision", "fp8"], ["--device", "tpu"], ["--device", "cuda:99"], ["--device", ""],
                 ["--option", "beta"], ["--option", "nope=1"], ["--option", "lam=nan"],
                 ["--option", "lam=-1"], ["--option", "lam=\"x\""], ["--arch-option", "heads=4"],
                 ["--arch", "vit-mini", "--arch-option", "patch=3"],
                 ["--arch", "vit-mini", "--arch-option", "heads=5"],
                 ["--arch", "vit-mini", "--arch-option", "patch=0"],
                 ["--arch", "resnet-small", "--arch-option", "stem_stride=7"],
                 ["--arch", "vit-mini", "--dataset", "mnist1d"],
                 ["--frozen", "--shallow"], ["--trainable-blocks", "3"], ["--blocks", "0"],
                 ["--epoch", "1"], ["--data-dir", "/dev/null/x", "--dataset", "mnist"],
                 ["--tensorboard", "/etc/passwd"], ["--tensorboard", "/etc/passwd/sub"],
                 ["--tensorboard", ""], ["--out", "/etc/passwd"], ["--out", "/etc/passwd/run"],
                 ["--out", "/proc/creditaudit-run"]):
        out = [] if "--out" in args else ["--out", w.fresh("t")]
        add(f"train {' '.join(map(str, args))}", "refusal", cli("train", *TINY, *args, *out))
    for name, spec in (("cb draws 1e9", "draws=1000000000"), ("cb hidden 0", "hidden=0"),
                       ("cb t_dim huge", "t_dim=99999999"), ("cb ema 2", "ema=2")):
        from creditaudit.methods.bridges import CreditBridge
        add(f"train {name}", "refusal", cli("train", *TINY, "--method", CreditBridge.name, "--option",
                                            spec, "--out", w.fresh("t")))
    # train: inputs that must work
    for args in (["--seed", "0"], ["--lr", "0"], ["--seed", "٣"], ["--out", w.fresh("ünïcode 空白")],
                 ["--shallow"], ["--trainable-blocks", "1"], ["--stop-when-flagged", "1"],
                 ["--arch", "vit-mini", "--arch-option", "patch=4"], ["--tensorboard", w.fresh("tb") / "a" / "b"]):
        out = [] if "--out" in args else ["--out", w.fresh("t")]
        add(f"train ok {' '.join(map(str, args))}", "result", cli("train", *TINY, *args, *out))
    # a refused train, then the corrected one, in one folder: no debris blocks the second
    fixed = w.fresh("fixed")
    add("train refused (patch=3) into a folder", "refusal",
        cli("train", *TINY, "--arch", "vit-mini", "--arch-option", "patch=3", "--out", fixed))
    add("train corrected (patch=4) into the same folder", "result",
        cli("train", *TINY, "--arch", "vit-mini", "--arch-option", "patch=4", "--out", fixed))
    add("train into a finished run's folder with other settings", "refusal",
        cli("train", *TINY, "--lr", "0.5", "--out", o / "run"))
    add("train resumes a finished run (found finished)", "result", cli("train", *TINY, "--out", o / "run"))
    # user rules that fail in training: recorded, never trustworthy
    for cls in ("InitRaises", "NanCredit", "ShortCredit"):
        d = w.fresh(cls)
        add(f"train user rule {cls}", "never-trustworthy",
            cli("train", *TINY, "--method", f"sweep_user:{cls}", "--out", d), owner="")
        add(f"diagnose user rule {cls}", "never-trustworthy",
            cli("diagnose", d, "--threads", "1"), owner="")
    d = w.fresh("ExitCredit")
    add("train user rule that calls sys.exit in credit()", "never-trustworthy",
        cli("train", *TINY, "--method", "sweep_user:ExitCredit", "--out", d), owner="gate")
    add("diagnose user rule that calls sys.exit in credit()", "never-trustworthy",
        cli("diagnose", d, "--threads", "1", "--frozen-control", o / "frozen"), owner="gate")

    # diagnose / calibrate: paths and damaged run folders
    damaged = damaged_runs(w)
    for cmd in ("diagnose", "calibrate"):
        add(f"{cmd} (no run)", "refusal", cli(cmd))
        for path in ("nope", "/etc/passwd", "", "/", o / "audit", o / "userpkg"):
            add(f"{cmd} {path}", "refusal", cli(cmd, path, "--threads", "1"))
        for name, path in damaged.items():
            add(f"{cmd} damaged run: {name}", "refusal", cli(cmd, path, "--threads", "1"))
        for v in ("0", "-1", "abc", "nan", "100001"):
            add(f"{cmd} --eval-batches {v}", "refusal", cli(cmd, o / "run", "--eval-batches", v))
        add(f"{cmd} --device tpu", "refusal", cli(cmd, o / "run", "--device", "tpu"))
        add(f"{cmd} --data-dir /etc/passwd", "handled", cli(cmd, o / "run", "--data-dir", "/etc/passwd", "--threads", "1"))
    for v in ("0", "-3", "x", "100001"):
        add(f"calibrate --null-draws {v}", "refusal", cli("calibrate", o / "run", "--null-draws", v))
    add("calibrate a run", "result", cli("calibrate", o / "run", "--threads", "1", "--null-draws", "2"))
    add("diagnose --rho", "result", cli("diagnose", o / "run", "--rho", "--threads", "1"))
    add("diagnose --json", "result", cli("diagnose", o / "run", "--json", "--threads", "1"))
    for ctl, expect in ((o / "run", "refusal"), (o / "run7", "refusal"), (o / "frozen7", "refusal"),
                        (o / "shallow", "refusal"), ("/etc/passwd", "refusal"), ("nope", "refusal"),
                        (o / "run" / "config.json", "refusal")):
        add(f"diagnose --frozen-control {Path(ctl).name}", expect,
            cli("diagnose", copy_run(w, o / "run"), "--frozen-control", ctl, "--threads", "1"))
    # controls that are no evidence for (d): one that never trained (lr 0: its embedding and
    # readout never moved from init) and one whose training diverged to NaN
    for name, lr in (("never trained (lr 0)", "0"), ("diverged (lr 1e6)", "1e6")):
        ctl = w.fresh("ctl")
        add(f"train a frozen control that {name}", "handled",
            cli("train", *TINY, "--frozen", "--lr", lr, "--out", ctl))
        add(f"diagnose with a frozen control that {name}", "never-trustworthy",
            cli("diagnose", copy_run(w, o / "run"), "--frozen-control", ctl, "--threads", "1"), owner="gate")
    add("diagnose a run without its control", "never-trustworthy",
        cli("diagnose", copy_run(w, o / "run"), "--threads", "1"), owner="")
    copied = copy_run(w, o / "run")
    add("diagnose a copied run folder, its control given", "result",
        cli("diagnose", copied, "--frozen-control", o / "frozen", "--threads", "1"))
    # --model factories
    common = ["--dataset", "digits", "--weights", o / "good.safetensors", "--threads", "1"]
    for fac in ("raises", "returns_none", "returns_int", "no_stream", "needs_args", "half",
                "wrong_inputs", "wrong_classes", "shape_changer", "not_callable", "missing",
                "nope_pkg:x", "sweep_user"):
        spec = fac if ":" in fac or fac == "sweep_user" else f"sweep_user:{fac}"
        add(f"diagnose --model {spec}", "refusal", cli("diagnose", "--model", spec, *common))
    add("diagnose --model sweep_user:exits", "refusal",
        cli("diagnose", "--model", "sweep_user:exits", *common), owner="gate")
    # a KeyboardInterrupt raised by the user's code cannot be told from a Ctrl-C: it stops the
    # command as Ctrl-C does (exit 130); what matters is that nothing reads as judged or passed
    for command in ("diagnose", "check"):
        add(f"{command} --model sweep_user:interrupts", "never-trustworthy",
            cli(command, "--model", "sweep_user:interrupts", *common), owner="gate")
    for weights in ("notjson.safetensors", "truncated.safetensors", "nope.safetensors"):
        add(f"diagnose --model good --weights {weights}", "refusal",
            cli("diagnose", "--model", "sweep_user:good", "--dataset", "digits", "--weights", o / weights))
    add("diagnose --model without --weights", "refusal", cli("diagnose", "--model", "sweep_user:good"))
    add("diagnose --model and a run folder", "refusal", cli("diagnose", o / "run", "--model", "sweep_user:good", *common))
    add("diagnose --model good (no control)", "never-trustworthy", cli("diagnose", "--model", "sweep_user:good", *common))
    add("diagnose --model with itself as control", "refusal",
        cli("diagnose", "--model", "sweep_user:good", *common, "--frozen-control", o / "good.safetensors"))
    add("check --model good (no control)", "never-trustworthy", cli("check", "--model", "sweep_user:good", *common))

    # check / report / thresholds on damaged audits and runs
    audits = damaged_audits(w)
    for cmd in ("check", "report", "thresholds"):
        for path in ("nope", "/etc/passwd", "", o / "userpkg"):
            add(f"{cmd} {path}", "refusal", cli(cmd, path))
        for name, path in audits.items():
            add(f"{cmd} damaged audit: {name}", "refusal", cli(cmd, path))
    add("check (no path)", "refusal", cli("check"))
    add("check an audit", "result", cli("check", copy_run(w, o / "audit")))
    C[-1].codes = {0, 1, 3}
    add("report an audit", "result", cli("report", copy_run(w, o / "audit")))
    add("thresholds an audit", "result", cli("thresholds", copy_run(w, o / "audit")))
    add("check a diagnosed run", "result", cli("check", o / "run"))
    C[-1].codes = {0, 1, 3}
    add("check an undiagnosed run", "refusal", cli("check", copy_run(w, o / "frozen", drop=("diagnosis.json",))))
    stolen = copy_run(w, o / "run7")
    shutil.copy(o / "run" / "diagnosis.json", stolen / "diagnosis.json")
    add("check a run holding another run's diagnosis.json", "never-trustworthy",
        cli("check", stolen), owner="gate")
    for name, path in damaged.items():     # diagnosis.json is not yet bound to the files it judged
        add(f"check damaged run: {name}", "never-trustworthy", cli("check", path), owner="gate")

    # audit / ladder / penalty-sweep: TOML configs and options
    for name, text in bad_tomls().items():
        p = o / "toml" / f"{name}.toml"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        for cmd in ("audit", "ladder"):      # a config that names its out= is run without --out
            out = [] if re.search(rb"^out\s*=", p.read_bytes(), re.M) else ["--out", w.fresh(cmd)]
            add(f"{cmd} --config {name}", "refusal", cli(cmd, "--config", p, *out, "--quiet"))
    add("audit --config (a folder)", "refusal", cli("audit", "--config", o / "toml"))
    add("audit --config nope.toml", "refusal", cli("audit", "--config", o / "nope.toml"))
    base = ["--config", o / "audit.toml", "--quiet", "--device", "cpu"]
    for args in (["--seeds"], ["--seeds", "1", "1"], ["--seeds", "-1"], ["--seeds", "x"],
                 ["--methods", "nope"], ["--methods", "bp", "bp"], ["--methods", ""],
                 ["--epochs", "0"], ["--jobs", "-1"], ["--eval-batches", "0"], ["--executor", "dask"],
                 ["--address", "auto"], ["--max-retries", "-1"], ["--preset", "nope"],
                 ["--dataset", "nope"], ["--arch", "nope"], ["--stack", "--no-stack"],
                 ["--out", "/etc/passwd"], ["--out", "/etc/passwd/a"], ["--device", "tpu"],
                 ["--tensorboard", "/etc/passwd"], ["--tensorboard", "/etc/passwd/x"]):
        add(f"audit {' '.join(map(str, args))}", "refusal", cli("audit", *base, *args, *(
            [] if "--out" in args else ["--out", w.fresh("audit")])))
    add("audit reuses its finished runs", "result", cli("audit", *base, "--out", o / "audit"))
    C[-1].codes = {0, 3}
    add("audit into a folder holding another audit", "refusal",
        cli("audit", *base, "--seeds", "9", "--out", o / "audit"))
    for args in (["--lambdas", "nan"], ["--lambdas", "-1"], ["--lambdas", "0", "0"], ["--lambdas"],
                 ["--method", "nope"], ["--lambdas", "1e400"]):
        add(f"penalty-sweep {' '.join(map(str, args))}", "refusal",
            cli("penalty-sweep", *base, *args, "--out", w.fresh("pen")))
    add("penalty-sweep --method bp (no sweep)", "refusal",
        cli("penalty-sweep", *base, "--method", "bp", "--out", w.fresh("pen")))

    # identity-check
    for args in (["--seeds", "-1"], ["--seeds"], ["--seeds", "x"], ["--blocks", "0"], ["--width", "0"],
                 ["--dataset", "nope"], ["--arch", "vit-mini", "--dataset", "mnist1d"],
                 ["--out", "/etc/passwd"], ["--w2-std", "nan"], ["--w2-std", "-1"], ["--activation", "x"]):
        add(f"identity-check {' '.join(map(str, args))}", "refusal",
            cli("identity-check", "--dataset", "digits", *TINY_MODEL, "--threads", "1", *args,
                *([] if "--out" in args else ["--out", w.fresh("id")])))
    add("identity-check ok", "result", cli("identity-check", "--dataset", "digits", *TINY_MODEL,
                                           "--seeds", "1", "2", "--threads", "1", "--out", w.fresh("id")))
    ident = w.fresh("id-other")
    add("identity-check first config", "result", cli("identity-check", "--dataset", "digits", *TINY_MODEL,
                                                     "--seeds", "1", "--threads", "1", "--out", ident))
    add("identity-check other seeds into the same folder", "refusal",
        cli("identity-check", "--dataset", "digits", *TINY_MODEL, "--seeds", "2", "--threads", "1",
            "--out", ident), owner="gate")

    # lint on odd files
    lint_dir = o / "lint"
    lint_dir.mkdir(exist_ok=True)
    odd = {"empty.py": b"", "syntax.py": b"def f(:\n", "binary.py": bytes(range(256)),
           "latin1.py": "x = 'caf\xe9'\n".encode("latin-1"), "nul.py": b"x = 1\x00\n",
           "deep.py": ("x = " + "(" * 3000 + "1" + ")" * 3000 + "\n").encode(),
           "long.py": ("x = '" + "a" * 2_000_000 + "'\n").encode(), "bom.py": b"\xef\xbb\xbfx = 1\n",
           "ok.py": b"import torch\nloss = torch.nn.functional.cross_entropy\n"}
    for name, data in odd.items():
        (lint_dir / name).write_bytes(data)
        add(f"lint {name}", "handled", cli("lint", lint_dir / name))
    add("lint a folder of odd files", "handled", cli("lint", lint_dir))
    add("lint nope.py", "refusal", cli("lint", o / "nope.py"))
    add("lint /dev/null", "handled", cli("lint", "/dev/null"))
    add("lint (no path)", "refusal", cli("lint"))

    # the top level
    for args in ([], ["nope"], ["--version"], ["train", "--help"], ["--epochs"], ["audit", "--help"]):
        expect = "result" if args in (["--version"], ["train", "--help"], ["audit", "--help"]) else "refusal"
        add(f"creditaudit {' '.join(map(str, args))}", expect, cli(*args))
    # SystemExit(0) from argparse --help/--version is how argparse ends: result when the code is 0
    add("cp1252 console: train prints (a′)", "result",
        subproc("train", *TINY, "--out", w.fresh("cp"), env={"PYTHONIOENCODING": "cp1252"}))
    add("cp1252 console: diagnose prints its table", "result",
        subproc("diagnose", o / "run", "--threads", "1", env={"PYTHONIOENCODING": "cp1252"}))
    add("ascii console: check", "result", subproc("check", o / "run", env={"PYTHONIOENCODING": "ascii"}))
    C[-1].codes = {0, 1, 3}

    C += python_cases(w)
    C += review_cases(w)
    C += issue28_cases(w)
    C += yardstick_cases(w)
    C += issue34_cases(w)
    C += start_and_code_cases(w)
    C += issue35_cases(w)
    C += issue37_cases(w)
    return C


def issue35_cases(w: World) -> list[Case]:
    """Issue 35: the plain MLP's options, `reproduce` with bad rules, counts, folders and data, a
    reproduction on a tiny MNIST-format folder, and per-method [recipes] in an audit TOML."""
    import gzip
    import struct
    import numpy as np
    o, C = w.out, []
    add = lambda name, expect, run, owner="": C.append(Case("i35 " + name, expect, run, owner))
    mlp = ["--arch", "mlp"]
    for opt in ("loss=mse", "loss=", "dropout=1", "dropout=-0.1", "dropout=nan", "init=xavier", "bias=2",
                "bias=-1", "bias=1.5", "heads=2"):
        add(f"train mlp --arch-option {opt}", "refusal",
            cli("train", *TINY, *mlp, "--arch-option", opt, "--out", w.fresh("t")))
    for method, extra in (("sb", []), ("cb", []), ("pepita", ["--arch-option", "dropout=0.1"]),
                          ("ep", ["--arch-option", "dropout=0.5"])):
        add(f"train mlp {method} {' '.join(extra)}", "refusal",
            cli("train", *TINY, *mlp, "--method", method, *extra, "--out", w.fresh("t")))
    for method in ("bp", "fa", "dfa", "drtp", "kolen-pollack", "pepita", "local-loss", "pc"):
        add(f"train mlp {method} bce tanh", "never-trustworthy",
            cli("train", *TINY, *mlp, "--method", method, "--activation", "tanh", "--arch-option", "loss=bce",
                "--out", w.fresh("t")))
    for args in (["nope"], [""], ["bp"], ["sb"], ["fa", "--epochs", "0"], ["fa", "--epochs", "-1"],
                 ["fa", "--epochs", "nan"], ["fa", "--seeds", "-1"], ["fa", "--seeds", "1", "1"],
                 ["fa", "--seeds", "abc"], ["fa", "--data-dir", "/dev/null/x"],
                 ["fa", "--out", "/etc/passwd"], ["fa", "--out", "/proc/creditaudit-repro"],
                 ["fa", "--device", "tpu"], ["fa", "--jobs", "-1"], ["fa", "--recipe", "shared"],
                 ["--list", "--epochs", "x"]):
        add(f"reproduce {' '.join(args)!r}", "refusal", cli("reproduce", *args))
    add("reproduce --list", "result", cli("reproduce", "--list"))
    # a tiny MNIST-format folder: 30 training and 12 test images, every class
    folder = o / "i35-data" / "mnist"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 30), ("t10k", 12)):
        y = (np.arange(n) % 10).astype(np.uint8)
        x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        for name, arr in ((f"{prefix}-images-idx3-ubyte.gz", x), (f"{prefix}-labels-idx1-ubyte.gz", y)):
            raw = bytes([0, 0, 8, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()
            (folder / name).write_bytes(gzip.compress(raw))
    out = w.fresh("repro")
    add("reproduce drtp on a tiny folder, 1 epoch", "never-trustworthy",
        cli("reproduce", "drtp", "--epochs", "1", "--seeds", "42", "--data-dir", o / "i35-data", "--out", out,
            "--quiet", "--device", "cpu", "--jobs", "1"), )
    for table in ('[recipes.bp]\noptimizer = "lbfgs"', '[recipes.bp]\nmomentum = 0.9',
                  '[recipes.bp]\nlr = -1', '[recipes.bp]\nnope = 1', '[recipes]\nbp = 3',
                  '[recipes.nope]\nlr = 0.1'):
        toml = w.fresh("toml").with_suffix(".toml")
        toml.parent.mkdir(parents=True, exist_ok=True)
        toml.write_text('dataset = "digits"\nmethods = ["bp"]\nseeds = [1]\nepochs = 1\n' + table + "\n")
        add(f"audit [recipes] {table!r}", "refusal", cli("audit", "--config", toml, "--out", w.fresh("a"),
                                                          "--quiet", "--device", "cpu"))
    return C


def issue37_cases(w: World) -> list[Case]:
    """Issue 37: forward gradient, Forward-Forward and target propagation — the architectures they
    refuse, bad options, a run on each architecture they claim, and `reproduce` on a tiny MNIST folder
    (made by `issue35_cases`)."""
    C = []
    add = lambda name, expect, run, owner="": C.append(Case("i37 " + name, expect, run, owner))
    rules = ("fg-w", "fg-a", "lg-fg-a", "forward-forward", "dtp", "ddtp-linear")
    for rule in rules:
        for arch in ("vit-mini", "resnet-small"):
            add(f"train {rule} --arch {arch}", "refusal",
                cli("train", *TINY, "--method", rule, "--arch", arch, "--out", w.fresh("t")))
        add(f"train {rule} mlp dropout", "refusal",
            cli("train", *TINY, "--method", rule, "--arch", "mlp", "--arch-option", "dropout=0.2",
                "--out", w.fresh("t")))
        for arch in ("resmlp", "mlp"):
            for control in ([], ["--frozen"], ["--shallow"]):
                add(f"train {rule} --arch {arch} {' '.join(control)}", "never-trustworthy",
                    cli("train", *TINY, "--method", rule, "--arch", arch, *control, "--out", w.fresh("t")))
    for rule, opt in (("forward-forward", "negatives=random"), ("forward-forward", "negatives="),
                      ("forward-forward", "peer=-1"), ("forward-forward", "peer=nan"),
                      ("forward-forward", "readout_lr=0"), ("dtp", "lr_fb=-1"), ("dtp", "lr_fb=nan"),
                      ("dtp", "fb_pretrain=-1"), ("dtp", "fb_pretrain=1.5"), ("ddtp-linear", "fb_extra=-2"),
                      ("dtp", "sigma=-0.1"), ("fg-w", "nope=1")):
        add(f"train {rule} --option {opt}", "refusal",
            cli("train", *TINY, "--method", rule, "--option", opt, "--out", w.fresh("t")))
    add("train dtp --option fb_pretrain=5 (more than the epochs)", "never-trustworthy",
        cli("train", *TINY, "--method", "dtp", "--option", "fb_pretrain=5", "--out", w.fresh("t")))
    add("train forward-forward --option negatives=uniform", "never-trustworthy",
        cli("train", *TINY, "--method", "forward-forward", "--option", "negatives=uniform", "--out", w.fresh("t")))
    for rule in ("forward-forward", "dtp", "ddtp-linear", "fg-w"):
        add(f"reproduce {rule} on a tiny folder, 1 epoch", "never-trustworthy",
            cli("reproduce", rule, "--epochs", "1", "--seeds", "42", "--data-dir", w.out / "i35-data",
                "--out", w.fresh("repro"), "--quiet", "--device", "cpu", "--jobs", "1"))
    return C


def yardstick_cases(w: World) -> list[Case]:
    """Issue 28: a control is evidence only when it measures up to a yardstick the tool trains
    (bp's frozen control); the embedding and the readout each their own group; one rule one name;
    folders mean one thing; one seed with nothing to pool does not decide (d)."""
    from creditaudit import Monitor, ResidualMLP, audit_own_runs
    from creditaudit.data.generated import load_digits
    o, C = w.out, []
    add = lambda name, expect, run, owner="": C.append(Case("ys " + name, expect, run, owner))
    two = o / "toml" / "ys-two-seeds.toml"
    two.parent.mkdir(exist_ok=True)
    two.write_text('dataset = "digits"\nseeds = [1, 2]\nepochs = 2\njobs = 1\ncontrols = ["frozen"]\n'
                   '[model]\nwidth = 16\nblocks = 2\n')
    # controls that barely train, in an audit without bp (the audit trains the yardstick itself).
    # Issue 33: a weak control never walks a rule back and never lets it clear on its own word —
    # (d) clears only when the gap to the yardstick clears too, and the shortfall is reported
    def judged_by_the_yardstick(run: Callable[[], Outcome], out: Path) -> Callable[[], Outcome]:
        def go() -> Outcome:
            o = run()
            if o.kind != "exit" or o.code not in (0, 3):
                return o
            row = json.loads((out / "audit.json").read_text())["methods"][0]
            depth = row["depth"]
            said = " ".join(row["notes"] + row["missing"] + row["reasons"])
            if depth["outcome"] == "clears" and ((depth.get("yardstick") or {}).get("lower") is None
                                                 or depth["yardstick"]["lower"] < depth["margin"] - 1e-6):
                o.wrong = "(d) cleared a weak control without clearing the yardstick"
            elif depth.get("weak_control") and "falls short of the yardstick" not in said:
                o.wrong = "a weak control's shortfall is not reported"
            return o
        return go
    for rule in ("TimidControl", "OneStepControl", "ReadoutOnlyControl"):
        d = w.fresh(f"ys-{rule}")
        add(f"audit a rule whose control is {rule}", "handled", judged_by_the_yardstick(
            cli("audit", "--config", two, "--methods", f"sweep_user:{rule}", "--quiet", "--device", "cpu",
                "--out", d, check=d), d))

    def lone(rule, epochs="2"):
        def run():
            r, c = w.fresh(f"ys-{rule}-run"), w.fresh(f"ys-{rule}-ctl")
            for d, extra in ((r, []), (c, ["--frozen"])):
                _must(cli("train", *TINY[:-1], epochs, "--method", f"sweep_user:{rule}", *extra,
                          "--out", d)(), (rule,))
            return cli("diagnose", r, "--frozen-control", c, "--threads", "1")()
        return run
    for rule in ("TimidControl", "OneStepControl", "ReadoutOnlyControl"):
        add(f"diagnose a run against its {rule} control (no yardstick at hand)", "never-trustworthy",
            lone(rule))

    digits = load_digits()
    test = [digits.eval_batch(0, 360)]

    def monitored(lr_control: float, embedding: bool = True, epochs: int = 2):
        def run():
            torch.manual_seed(0)
            main = Monitor(ResidualMLP(64, d=16, n_blocks=2, n_classes=10), digits.eval_batch(0),
                           w.fresh("ys-mon"), epochs=epochs, seed=0, test_batches=test)
            ctl_model = None
            for who in ("run", "ctl"):
                net = main.model if who == "run" else ctl_model
                m = main if who == "run" else Monitor(ctl_model, digits.eval_batch(0), w.fresh("ys-ctl"),
                                                      epochs=epochs, seed=0, test_batches=test,
                                                      control_of=main)
                params = ([p for p in net.parameters() if p.requires_grad] if who == "run" or embedding
                          else list(net.head_parameters()))
                opt = torch.optim.AdamW(params, 1e-2 if who == "run" else lr_control)
                for _ in range(epochs):
                    for x, y in digits.train_batches(128, torch.Generator().manual_seed(0)):
                        loss = torch.nn.functional.cross_entropy(net(x), y)
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                        m.step(loss.detach(), len(y))
                    m.epoch_end()
                m.finish()
                if who == "run":
                    ctl_model = main.frozen_control()
            return main.report
        return py(run)
    add("Monitor: a control trained at lr 1e-9", "never-trustworthy", monitored(1e-9))
    add("Monitor: a control that trains its readout only", "never-trustworthy", monitored(1e-2, embedding=False))
    # one rule spelled three ways is one method
    add("audit bp spelled three ways", "refusal",
        cli("audit", "--config", two, "--methods", "bp", "creditaudit.methods.bp:BP", "creditaudit.methods:BP",
            "--quiet", "--out", w.fresh("ys-3names")))
    # folders mean one thing
    run = copy_run(w, o / "run")
    add("audit --out a run folder", "refusal",
        cli("audit", "--config", two, "--methods", "bp", "--quiet", "--out", run))
    own = own_runs(w, *digits.eval_batch(0, 32), lambda: ResidualMLP(64, d=16, n_blocks=2, n_classes=10))
    add("audit_own_runs out= another run's folder", "refusal",
        py(lambda: audit_own_runs([own[0]], out=own[1], n_test=360)))
    add("audit_own_runs out= its own run's folder", "refusal",
        py(lambda: audit_own_runs(own, out=own[0], n_test=360)))
    # (d) with no estimate of seed spread: one seed, one method
    d = w.fresh("ys-one-seed")
    add("audit one seed of bp, nothing to pool", "never-trustworthy",
        cli("audit", "--config", two, "--methods", "bp", "--seeds", "3", "--quiet", "--device", "cpu",
            "--out", d, check=d))
    return C


PATCHING_RULE = '''
from creditaudit.methods.bp import BP
from creditaudit.metrics import bp_gradients

_grads = BP.gradients

def _nudge(self, x, y):                 # every step 1e-3 of backprop's: a nudge, not a yardstick
    loss = _grads(self, x, y)
    for p in self.model.parameters():
        if p.grad is not None:
            p.grad.mul_(1e-3)
    return loss

BP.gradients = _nudge
BP.credit = lambda self, x, y: [g.roll(1, 0) for g in bp_gradients(self.model, x, y).grads]

class PatchingRule(BP):
    """Trains like backprop; importing it patches the project's BP (the audit's yardstick)."""
    name = "patching-rule"
'''


def issue34_cases(w: World) -> list[Case]:
    """Issue 34, items 1, 2 and 7: the yardstick is evidence too (as weak as a control, the control
    itself, built from a patched backprop), and every accuracy carries its test set (a control's
    Monitor given rigged test batches)."""
    from safetensors.torch import save_file
    from creditaudit import Monitor, ResidualMLP
    from creditaudit.data.generated import load_digits
    from creditaudit.methods import MethodSettings, method_class
    import sweep_user
    o, C = w.out, []
    add = lambda name, expect, run, owner="": C.append(Case("i34 " + name, expect, run, owner))
    digits = load_digits()
    # --model: init, trained, an honest frozen control and yardstick, and init + 1e-6 (eps)
    torch.manual_seed(0)
    init = sweep_user.good()
    states = {"init": init.state_dict()}
    for name, blocks, lr in (("trained", (0, 1), 1e-2), ("frozen", (), 1e-2), ("yard", (), 5e-3)):
        torch.manual_seed(0)
        model = sweep_user.good()
        model.load_state_dict(init.state_dict())
        step = method_class("bp")(model, MethodSettings(epochs=1, trainable_blocks=blocks, lr=lr))
        for x, y in digits.train_batches(128, torch.Generator().manual_seed(0)):
            step.train_step(x, y)
        states[name] = model.state_dict()
    in_blocks = {n for n, _ in init.named_parameters() if n.startswith("blocks.")}
    states["eps"] = {n: t + 1e-6 if t.is_floating_point() and n not in in_blocks else t.clone()
                     for n, t in init.state_dict().items()}
    f = {}
    for name, state in states.items():
        f[name] = o / f"i34-{name}.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, str(f[name]))
    model = ["--model", "sweep_user:good", "--weights", f["trained"], "--dataset", "digits", "--threads", "1",
             "--device", "cpu", "--init-weights", f["init"]]
    add("check --model: control and yardstick both init + 1e-6", "refusal",
        cli("check", *model, "--frozen-control", f["eps"], "--yardstick", f["eps"]))
    add("check --model: a control init + 1e-6, no yardstick", "never-trustworthy",
        cli("check", *model, "--frozen-control", f["eps"]))
    add("check --model: a yardstick as weak as the untrained model", "refusal",
        cli("check", *model, "--frozen-control", f["frozen"], "--yardstick", f["eps"]))
    add("check --model: the control as its own yardstick", "refusal",
        cli("check", *model, "--frozen-control", f["frozen"], "--yardstick", f["frozen"]))
    add("diagnose --model: an honest yardstick", "result",
        cli("diagnose", *model, "--frozen-control", f["frozen"], "--yardstick", f["yard"]))

    # a Monitor control measured on other test batches than its run's
    test = [digits.eval_batch(0, 360)]

    def monitored(control_test):
        def run():
            torch.manual_seed(0)
            main = Monitor(ResidualMLP(64, d=16, n_blocks=2, n_classes=10), digits.eval_batch(0),
                           w.fresh("i34-mon"), epochs=1, seed=0, test_batches=test)
            ctl = None
            for who in ("run", "ctl"):
                m = main if who == "run" else Monitor(ctl, digits.eval_batch(0), w.fresh("i34-ctl"), epochs=1,
                                                      seed=0, test_batches=control_test, control_of=main)
                net = m.model
                opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], 1e-2)
                for x, y in digits.train_batches(128, torch.Generator().manual_seed(0)):
                    loss = torch.nn.functional.cross_entropy(net(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    m.step(loss.detach(), len(y))
                m.epoch_end()
                m.finish()
                ctl = main.frozen_control()
            return main.report
        return py(run)
    x, y = test[0]
    shifted = y.clone()
    shifted[: int(0.6 * len(y))] = (shifted[: int(0.6 * len(y))] + 1) % 10
    add("Monitor: a control given its run's test set with 60 % of labels shifted", "refusal",
        monitored([(x, shifted)]))
    add("Monitor: a control given a subset of its run's test set", "refusal", monitored([(x[:200], y[:200])]))
    add("Monitor: a control given the same test set, batched otherwise", "result",
        monitored([(x[:100], y[:100]), (x[100:], y[100:])]))

    # a rule module that patches the project's BP on import: the audit's yardstick is no yardstick
    pkg = o / "i34pkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "sweep_patch.py").write_text(PATCHING_RULE)
    toml = o / "toml" / "i34-two-seeds.toml"
    toml.parent.mkdir(exist_ok=True)
    toml.write_text('dataset = "digits"\nseeds = [1, 2]\nepochs = 1\njobs = 1\ncontrols = ["frozen"]\n'
                    '[model]\nwidth = 16\nblocks = 2\n')
    d = w.fresh("i34-patched-bp")
    env = {"PYTHONPATH": os.pathsep.join([str(pkg), str(PKG.parent), os.environ.get("PYTHONPATH", "")])}
    add("audit a rule whose module patches the project's BP on import", "never-trustworthy",
        subproc("audit", "--config", toml, "--methods", "sweep_patch:PatchingRule", "--quiet", "--device", "cpu",
                "--out", d, env=env, check=d))
    return C


def copy_run(w: World, src: Path, drop: tuple[str, ...] = ()) -> Path:
    dst = w.fresh(f"copy-{src.name}")
    shutil.copytree(src, dst)
    for name in drop:
        (dst / name).unlink(missing_ok=True)
    return dst


def damaged_runs(w: World) -> dict[str, Path]:
    """Copies of the finished run, each damaged the way files get damaged."""
    o, out = w.out, {}

    def make(name, edit):
        d = copy_run(w, o / "run")
        edit(d)
        out[name] = d

    def truncate(f):
        return lambda d: (d / f).write_bytes((d / f).read_bytes()[: max(1, (d / f).stat().st_size // 2)])

    def edit_json(f, fn):
        def go(d):
            obj = json.loads((d / f).read_text())
            fn(obj)
            (d / f).write_text(json.dumps(obj))
        return go

    tensors = lambda d: next(d.glob("*.safetensors"))
    for f in ("config.json", "checkpoint.json", "status.json", "metrics.jsonl"):
        make(f"{f} truncated", truncate(f))
        make(f"{f} empty", lambda d, f=f: (d / f).write_text(""))
        make(f"{f} a folder", lambda d, f=f: ((d / f).unlink(), (d / f).mkdir()))
        make(f"{f} binary", lambda d, f=f: (d / f).write_bytes(bytes(range(256))))
        make(f"{f} deeply nested", lambda d, f=f: (d / f).write_text("[" * 100000 + "]" * 100000))
    make("config.json removed", lambda d: (d / "config.json").unlink())
    make("checkpoint.json removed", lambda d: (d / "checkpoint.json").unlink())
    make("config epochs edited", edit_json("config.json", lambda c: c.update(epochs=99)))
    make("config a list", lambda d: (d / "config.json").write_text("[]"))
    make("config NaN lr", lambda d: (d / "config.json").write_text(
        (d / "config.json").read_text().replace('"lr": 0.001', '"lr": NaN')))
    make("checkpoint epoch edited", edit_json("checkpoint.json", lambda c: c.update(epoch=5)))
    make("status edited to finished early", edit_json("status.json", lambda c: c.update(epochs_completed=0)))
    make("metrics accuracy edited", lambda d: (d / "metrics.jsonl").write_text(
        re.sub(r'"test_acc": [0-9.]+', '"test_acc": 0.99', (d / "metrics.jsonl").read_text())))
    make("tensors truncated", lambda d: tensors(d).write_bytes(tensors(d).read_bytes()[:100]))
    make("tensors removed", lambda d: tensors(d).unlink())
    make("tensors a folder", lambda d: (lambda t: (t.unlink(), t.mkdir()))(tensors(d)))
    make("tensors of another run", lambda d: shutil.copy(next((o / "run7").glob("*.safetensors")), tensors(d)))
    return out


def damaged_audits(w: World) -> dict[str, Path]:
    o, out = w.out, {}

    def make(name, edit):
        d = copy_run(w, o / "audit")
        edit(d)
        out[name] = d

    f = "audit.json"
    make("audit.json truncated", lambda d: (d / f).write_bytes((d / f).read_bytes()[:200]))
    make("audit.json empty", lambda d: (d / f).write_text(""))
    make("audit.json {}", lambda d: (d / f).write_text("{}"))
    make("audit.json []", lambda d: (d / f).write_text("[]"))
    make("audit.json null", lambda d: (d / f).write_text("null"))
    make("audit.json a folder", lambda d: ((d / f).unlink(), (d / f).mkdir()))
    make("audit.json binary", lambda d: (d / f).write_bytes(bytes(range(256)) * 4))
    make("audit.json deeply nested", lambda d: (d / f).write_text("{\"a\":" * 50000 + "1" + "}" * 50000))
    make("audit.json accuracy edited", lambda d: (d / f).write_text(
        re.sub(r'"test_acc": [0-9.]+', '"test_acc": 0.99', (d / f).read_text(), count=1)))
    make("audit.json verdict edited", lambda d: (d / f).write_text(
        (d / f).read_text().replace('"walk back"', '"trustworthy"').replace('"incomplete"', '"trustworthy"')))
    make("audit.json NaN", lambda d: (d / f).write_text((d / f).read_text().replace('"test_acc": ', '"test_acc": NaN, "x": ', 1)))
    make("audit.json removed", lambda d: (d / f).unlink())
    make("audit.json utf-16", lambda d: (d / f).write_bytes((d / f).read_text().encode("utf-16")))
    return out


def bad_tomls() -> dict[str, str | bytes]:
    m = '[model]\nwidth = 16\nblocks = 2\n'
    head = 'dataset = "digits"\nmethods = ["bp"]\nseeds = [1]\n'
    return {
        "empty": "", "binary": bytes(range(256)), "latin1": "dataset = 'caf\xe9'\n".encode("latin-1"),
        "deep-array": "a = " + "[" * 5000 + "]" * 5000, "deep-table": "a = " + "{b = " * 3000 + "1" + "}" * 3000,
        "deep-keys": "[" + ".".join(["a"] * 3000) + "]",
        "not-toml": "this is not toml", "unknown-key": head + "epochs = 1\nfoo = 1\n",
        "methods-string": 'methods = "bp"\nepochs = 1\n', "methods-empty": "methods = []\nepochs = 1\n",
        "methods-nested": "methods = [[\"bp\"]]\nepochs = 1\n", "seeds-empty": 'seeds = []\nepochs = 1\n',
        "seeds-neg": "seeds = [-1]\nepochs = 1\n", "seeds-float": "seeds = [1.5]\nepochs = 1\n",
        "seeds-dupe": "seeds = [1, 1]\nepochs = 1\n", "seeds-huge": f"seeds = [{2 ** 63}]\nepochs = 1\n",
        "epochs-0": head + "epochs = 0\n", "epochs-str": head + 'epochs = "3"\n',
        "epochs-float": head + "epochs = 1.0\n", "epochs-inf": head + "epochs = inf\n",
        "epochs-huge": head + "epochs = 1000000000\n", "epochs-bool": head + "epochs = true\n",
        "no-epochs": head, "dataset-nope": 'dataset = "nope"\nepochs = 1\n',
        "dataset-empty": 'dataset = ""\nepochs = 1\n', "out-empty": head + 'epochs = 1\nout = ""\n',
        "device-tpu": head + 'epochs = 1\ndevice = "tpu"\n', "jobs-neg": head + "epochs = 1\njobs = -1\n",
        "eval-0": head + "epochs = 1\neval_batches = 0\n", "executor-dask": head + 'epochs = 1\nexecutor = "dask"\n',
        "address-int": head + 'epochs = 1\nexecutor = "ray"\naddress = 5\n',
        "address-local": head + 'epochs = 1\naddress = "auto"\n',
        "retries-neg": head + "epochs = 1\nmax_retries = -1\n", "stack-str": head + 'epochs = 1\nstack = "yes"\n',
        "controls-x": head + 'epochs = 1\ncontrols = ["x"]\n', "preset-nope": 'preset = "nope"\n',
        "model-width-0": head + "epochs = 1\n[model]\nwidth = 0\n",
        "model-blocks-0": head + "epochs = 1\n[model]\nblocks = 0\n",
        "model-blocks-str": head + 'epochs = 1\n[model]\nblocks = "2"\n',
        "model-arch-nope": head + 'epochs = 1\n[model]\narch = "nope"\n',
        "model-unknown": head + "epochs = 1\n[model]\ndepth = 3\n",
        "model-options-heads": head + "epochs = 1\n[model]\nwidth = 16\n[model.options]\nheads = 3\n",
        "model-a-list": head + "epochs = 1\nmodel = [1]\n",
        "training-lr-str": head + "epochs = 1\n" + m + '[training]\nlr = "x"\n',
        "training-lr-nan": head + "epochs = 1\n" + m + "[training]\nlr = nan\n",
        "training-lam-neg": head + "epochs = 1\n" + m + "[training]\nlam = -1.0\n",
        "training-unknown": head + "epochs = 1\n" + m + "[training]\nmomentum = 0.9\n",
        "thresholds-neg": head + "epochs = 1\n" + m + "[thresholds]\ngrowth = -1\n",
        "thresholds-nan": head + "epochs = 1\n" + m + "[thresholds]\ngrowth = nan\n",
        "thresholds-unknown": head + "epochs = 1\n" + m + "[thresholds]\nfoo = 1\n",
        "thresholds-str": head + "epochs = 1\n" + m + '[thresholds]\ngrowth = "50"\n',
        "options-unknown-method": head + "epochs = 1\n" + m + "[options.nope]\nx = 1\n",
        "options-unknown-key": head + "epochs = 1\n" + m + "[options.bp]\nx = 1\n",
        "options-not-table": head + "epochs = 1\n" + m + "[options]\nbp = 1\n",
        "options-lam-str": head + "epochs = 1\n" + m + '[options.dfa]\nlam = "a"\n',
        "options-draws-huge": head + "epochs = 1\n" + m + "[options.cb]\ndraws = 1000000000\n",
    }


# -- the Python entrances ------------------------------------------------------------------------
def python_cases(w: World) -> list[Case]:
    from creditaudit import Adapter, Monitor, ResidualMLP, ResidualStream, load_monitored
    from creditaudit.protocol import diagnose
    from creditaudit.verdict import Thresholds
    o, C = w.out, []
    add = lambda name, expect, fn, owner="": C.append(Case(name, expect, py(fn), owner))
    gen = torch.Generator().manual_seed(0)
    X, Y = torch.randn(32, 10, generator=gen), torch.arange(32) % 3

    def net(*a, **k):
        torch.manual_seed(0)
        return ResidualMLP(*(a or (10, 16, 2, 3)), **k)

    def mon(model=None, batch=None, **kw):
        kw.setdefault("epochs", 1)
        return Monitor(net() if model is None else model, (X, Y) if batch is None else batch,
                       kw.pop("out", w.fresh("mon")), **kw)

    def loop(epochs=1, steps=(1.0,), ends=None, **kw):
        m = mon(epochs=epochs, test_batches=[(X, Y)], **kw)
        for _ in range(epochs if ends is None else ends):
            for s in steps:
                m.step(s if isinstance(s, torch.Tensor) or s is None or isinstance(s, str) else torch.tensor(s), 32)
            m.epoch_end()
        return m.finish()

    # Monitor: construction
    for name, fn in {
        "float labels": lambda: mon(batch=(X, Y.float())), "2-D labels": lambda: mon(batch=(X, Y[:, None])),
        "bool labels": lambda: mon(batch=(X, Y > 0)), "empty batch": lambda: mon(batch=(X[:0], Y[:0])),
        "length mismatch": lambda: mon(batch=(X, Y[:5])), "triple batch": lambda: mon(batch=(X, Y, Y)),
        "numpy batch": lambda: mon(batch=(X.numpy(), Y.numpy())), "None batch": lambda: Monitor(net(), None, w.fresh("m"), epochs=1),
        "scalar x": lambda: mon(batch=(torch.tensor(1.0), Y)),
        "wrong features": lambda: mon(batch=(torch.randn(32, 7), Y)),
        "labels beyond classes": lambda: mon(batch=(X, Y + 5)),
        "meta model": lambda: mon(model=net().to("meta")), "half model": lambda: mon(model=net().half()),
        "bf16 model": lambda: mon(model=net().bfloat16()), "not a module": lambda: mon(model=lambda x: x),
        "no stream": lambda: mon(model=torch.nn.Linear(10, 3)),
        "epochs 0": lambda: mon(epochs=0), "epochs str": lambda: mon(epochs="3"),
        "epochs bool": lambda: mon(epochs=True), "epochs float": lambda: mon(epochs=2.0),
        "stop_when_flagged 0": lambda: mon(stop_when_flagged=0),
        "dict thresholds": lambda: mon(thresholds={"growth": 2}), "None thresholds": lambda: mon(thresholds=None),
        "out None": lambda: mon(out=None), "out int": lambda: mon(out=5), "out empty": lambda: mon(out=""),
        "out a file": lambda: mon(out="/etc/passwd"), "out under a file": lambda: mon(out="/etc/passwd/run"),
        "out holds a run": lambda: mon(out=o / "run"),
        "tensorboard a file": lambda: mon(tensorboard="/etc/passwd"),
        "tensorboard under a file": lambda: mon(tensorboard="/etc/passwd/tb"),
        "tensorboard int": lambda: mon(tensorboard=5),
        "test_batches int": lambda: mon(test_batches=5),
        "diagnose_batches int": lambda: mon(diagnose_batches=5),
        "diagnose_batches of junk": lambda: mon(diagnose_batches=[1, 2]),
        "adapter a dict": lambda: mon(adapter={"blocks": "blocks"}),
        "adapter wrong path": lambda: mon(adapter=Adapter(blocks="layers")),
        "control_of junk": lambda: mon(control_of=5),
        "control_of a non-run": lambda: mon(control_of=o / "userpkg"),
        "control_of another init": lambda: mon(control_of=mon()),
        "frozen_control int": lambda: mon(frozen_control=5),
    }.items():
        add(f"Monitor {name}", "refusal", fn)
    # Monitor: the loop
    for name, fn, owner in (
            ("vector loss", lambda: loop(steps=(torch.ones(3),)), ""),
            ("None loss", lambda: loop(steps=(None,)), ""), ("str loss", lambda: loop(steps=("x",)), ""),
            ("n = 0", lambda: (lambda m: (m.step(torch.tensor(1.0), 0), m.epoch_end()))(mon(test_batches=[(X, Y)])), "gate"),
            ("n = -5", lambda: (lambda m: (m.step(torch.tensor(1.0), -5), m.epoch_end()))(mon(test_batches=[(X, Y)])), "gate"),
            ("n = nan", lambda: (lambda m: (m.step(torch.tensor(1.0), float("nan")), m.epoch_end()))(mon(test_batches=[(X, Y)])), "gate"),
            ("epoch_end before step", lambda: mon(test_batches=[(X, Y)]).epoch_end(), ""),
            ("epoch_end test_acc 1.5", lambda: (lambda m: (m.step(1.0), m.epoch_end(test_acc=1.5)))(mon()), ""),
            ("epoch_end test_acc nan", lambda: (lambda m: (m.step(1.0), m.epoch_end(test_acc=float("nan"))))(mon()), ""),
            ("epoch_end test_acc str", lambda: (lambda m: (m.step(1.0), m.epoch_end(test_acc="0.5")))(mon()), ""),
            ("epoch_end no accuracy", lambda: (lambda m: (m.step(1.0), m.epoch_end()))(mon()), ""),
            ("epoch_end skips epochs", lambda: (lambda m: (m.step(1.0), m.epoch_end(5, test_acc=0.5)))(mon(epochs=3)), ""),
            ("epoch_end past epochs", lambda: (lambda m: [(m.step(1.0), m.epoch_end(test_acc=0.5)) for _ in range(2)])(mon()), ""),
            ("epoch_end log shadows a field", lambda: (lambda m: (m.step(1.0), m.epoch_end(test_acc=0.5, gain=1.0)))(mon()), "gate"),
            ("epoch_end log is a str", lambda: (lambda m: (m.step(1.0), m.epoch_end(test_acc=0.5, note="x")))(mon()), ""),
            ("step after finish", lambda: (lambda m: (m.step(1.0), m.epoch_end(test_acc=0.5), m.finish(), m.step(1.0)))(mon()), ""),
            ("finish with a junk control", lambda: (lambda m: (m.step(1.0), m.epoch_end(test_acc=0.5), m.finish(frozen_control=o / "userpkg")))(mon()), ""),
            ("test_batches the model cannot take", lambda: mon(test_batches=[(torch.randn(4, 7), Y[:4])]), "")):
        add(f"Monitor {name}", "refusal", fn, owner)
    add("Monitor a whole loop", "never-trustworthy", lambda: loop())      # no control: never trustworthy
    add("Monitor a loop ended early", "never-trustworthy", lambda: loop(epochs=3, ends=1))
    add("Monitor float64 eval batch", "never-trustworthy", lambda: loop(batch=(X.double(), Y)))
    add("Monitor a NaN loss (diverged)", "never-trustworthy", lambda: loop(steps=(float("nan"),)))
    add("Monitor a float64 model", "never-trustworthy", lambda: loop(model=net().double()))
    add("Monitor a frozen control trained by no one", "never-trustworthy", untrained_control(w, X, Y, net), owner="gate")
    # load_monitored and audit_own_runs
    for name, arg in (("None", None), ("int", 5), ("empty", ""), ("a file", "/etc/passwd"),
                      ("a CLI run", o / "run"), ("nope", o / "nope")):
        add(f"load_monitored {name}", "refusal", lambda arg=arg: load_monitored(arg))
    runs = own_runs(w, X, Y, net)
    for name, fn in {
        "no runs": lambda: creditaudit.audit_own_runs([], out=w.fresh("own"), n_test=32),
        "runs a str": lambda: creditaudit.audit_own_runs(str(runs[0]), out=w.fresh("own"), n_test=32),
        "n_test 0": lambda: creditaudit.audit_own_runs(runs, out=w.fresh("own"), n_test=0),
        "n_test str": lambda: creditaudit.audit_own_runs(runs, out=w.fresh("own"), n_test="32"),
        "out a file": lambda: creditaudit.audit_own_runs(runs, out="/etc/passwd", n_test=32),
        "out None": lambda: creditaudit.audit_own_runs(runs, out=None, n_test=32),
        "a CLI run": lambda: creditaudit.audit_own_runs([o / "run"], out=w.fresh("own"), n_test=32),
        "a missing run": lambda: creditaudit.audit_own_runs([o / "nope"], out=w.fresh("own"), n_test=32),
        "the same run twice": lambda: creditaudit.audit_own_runs([runs[0], runs[0]], out=w.fresh("own"), n_test=32),
        "thresholds a dict": lambda: creditaudit.audit_own_runs(runs, out=w.fresh("own"), n_test=32, thresholds={}),
    }.items():
        add(f"audit_own_runs {name}", "refusal", fn,
            "gate" if "twice" in name else "owntools" if "thresholds" in name else "")
    add("audit_own_runs without controls", "never-trustworthy",
        lambda: creditaudit.audit_own_runs(runs, out=w.fresh("own"), n_test=32))
    # diagnose()
    b = [(X, Y), (X.flip(0), Y.flip(0))]
    stream = lambda steps, readout=lambda h: h[:, :3]: ResidualStream(lambda x: x, steps, readout)
    for name, fn in {
        "no batches": lambda: diagnose(net(), []), "batches None": lambda: diagnose(net(), None),
        "batch not a pair": lambda: diagnose(net(), [X]), "float labels": lambda: diagnose(net(), [(X, Y.float())]),
        "wrong features": lambda: diagnose(net(), [(torch.randn(32, 7), Y)]),
        "features vary per batch": lambda: diagnose(net(), [(X, Y), (torch.randn(32, 7), Y)]),
        "labels beyond classes": lambda: diagnose(net(), [(X, Y + 5)]),
        "negative labels": lambda: diagnose(net(), [(X, Y - 1)]),
        "meta batches": lambda: diagnose(net(), [(X.to("meta"), Y.to("meta"))]),
        "meta model": lambda: diagnose(net().to("meta"), b), "half model": lambda: diagnose(net().half(), b),
        "bf16 model": lambda: diagnose(net().bfloat16(), b),
        "a Linear": lambda: diagnose(torch.nn.Linear(10, 3), b), "a string": lambda: diagnose("model", b),
        "null with a 2-arg credit": lambda: diagnose(net(), b, method=lambda x, y: [torch.zeros(32, 16)] * 3, null=True),
        "null with a non-random method": lambda: diagnose(net(), b, method=_bp(net), null=True),
        "rho [99]": lambda: diagnose(net(), b, rho=[99]), "rho [-1]": lambda: diagnose(net(), b, rho=[-1]),
        "rho 'all'": lambda: diagnose(net(), b, rho="all"), "rho [1.5]": lambda: diagnose(net(), b, rho=[1.5]),
        "rho 5": lambda: diagnose(net(), b, rho=5),
        "null_k 0": lambda: diagnose(net(), b, null_k=0), "rho_m 0": lambda: diagnose(net(), b, rho=True, rho_m=0),
        "method int": lambda: diagnose(net(), b, method=5),
        "credit wrong length": lambda: diagnose(net(), b, method=lambda x, y: [torch.zeros(32, 16)] * 2),
        "credit wrong shape": lambda: diagnose(net(), b, method=lambda x, y: [torch.zeros(32, 8)] * 3),
        "credit not a list": lambda: diagnose(net(), b, method=lambda x, y: torch.zeros(32, 16)),
        "credit raises": lambda: diagnose(net(), b, method=lambda x, y: 1 / 0),
        "steps not callable": lambda: diagnose(stream([5, 6]), b),
        "step changes shape": lambda: diagnose(stream([lambda h: h[:, :5]]), b),
        "readout 1-D": lambda: diagnose(stream([lambda h: h], lambda h: h[:, 0]), b),
        "readout raises": lambda: diagnose(stream([lambda h: h], lambda h: 1 / 0), b),
        "frozen_acc 50": lambda: diagnose(net(), b, frozen_acc=50), "frozen_acc nan": lambda: diagnose(net(), b, frozen_acc=float("nan")),
        "test_acc str": lambda: diagnose(net(), b, test_acc="0.5"), "thresholds dict": lambda: diagnose(net(), b, thresholds={}),
        "history junk": lambda: diagnose(net(), b, monitor_history=[1, 2]),
        "history missing fields": lambda: diagnose(net(), b, monitor_history=[{"epoch": 0}]),
        "training junk": lambda: diagnose(net(), b, training=5),
    }.items():
        add(f"diagnose() {name}", "refusal", fn,
            "gate" if name in ("history missing fields",) else "")
    add("diagnose() float64 inputs", "never-trustworthy", lambda: diagnose(net(), [(x.double(), y) for x, y in b]))
    add("diagnose() float64 model", "never-trustworthy", lambda: diagnose(net().double(), b))
    add("diagnose() half inputs to a float32 model (cast up exactly)", "never-trustworthy",
        lambda: diagnose(net(), [(x.half(), y) for x, y in b]))
    add("diagnose() a NaN model", "never-trustworthy", lambda: diagnose(_nan(net()), b))
    add("diagnose() a NaN credit", "never-trustworthy",
        lambda: diagnose(net(), b, method=lambda x, y: [torch.full((len(x), 16), float("nan"))] * 3, frozen_acc=0.0, test_acc=1.0))
    add("diagnose() rho [0, 2]", "never-trustworthy", lambda: diagnose(net(), b, rho=[0, 2]))
    add("diagnose() README stream", "never-trustworthy", lambda: diagnose(stream([lambda h: h + 0.1 * h]), b))
    # constructors
    for name, fn in {
        "ResidualMLP('64')": lambda: ResidualMLP("64", 16), "ResidualMLP(64, -1)": lambda: ResidualMLP(64, -1),
        "ResidualMLP(64, 0)": lambda: ResidualMLP(64, 0), "ResidualMLP n_blocks 2.5": lambda: ResidualMLP(64, 16, 2.5),
        "ResidualMLP n_classes 0": lambda: ResidualMLP(64, 16, 2, 0), "ResidualMLP activation x": lambda: ResidualMLP(64, 16, activation="x"),
        "ResidualMLP w2_std nan": lambda: ResidualMLP(64, 16, w2_std=float("nan")),
        "ResidualMLP w2_std str": lambda: ResidualMLP(64, 16, w2_std="0.1"),
        "ViTMini((3, 32))": lambda: _arch("ViTMini")((3, 32), 16), "ViTMini heads 3": lambda: _arch("ViTMini")((3, 32, 32), 16, heads=3),
        "ViTMini patch 0": lambda: _arch("ViTMini")((3, 32, 32), 16, patch=0),
        "ViTMini patch 5": lambda: _arch("ViTMini")((3, 32, 32), 16, patch=5),
        "SmallResNet width 0": lambda: _arch("SmallResNet")((3, 32, 32), 0),
        "SmallResNet stem 3": lambda: _arch("SmallResNet")((3, 32, 32), 8, stem_stride=3),
        "SmallResNet shape str": lambda: _arch("SmallResNet")("3x32x32", 8),
        "Adapter(blocks=None)": lambda: Adapter(blocks=None), "Adapter(blocks=5)": lambda: Adapter(blocks=5),
        "Adapter(blocks='')": lambda: Adapter(blocks=""), "Adapter(blocks=[])": lambda: Adapter(blocks=[]),
        "Adapter skip str": lambda: Adapter(blocks="b", skip="no"), "Adapter embed int": lambda: Adapter(blocks="b", embed=3),
        "Adapter stream int": lambda: Adapter(blocks="b", stream=3),
        "build_model nope": lambda: _build("nope"),
    }.items():
        add(name, "refusal", fn)
    C += lightning_cases(w, X, Y, net)
    return C


def _arch(name):
    from creditaudit import model
    return getattr(model, name)


def _build(arch):
    from creditaudit.model import build_model
    return build_model(arch, (10,), 3, width=16, blocks=2)


def _bp(net):
    from creditaudit.methods import METHODS, REFERENCE_METHOD, MethodSettings
    return METHODS[REFERENCE_METHOD](net(), MethodSettings(epochs=1))


def _nan(model):
    with torch.no_grad():
        model.blocks[0].w2.weight.fill_(float("nan"))
    return model


def untrained_control(w: World, X, Y, net):
    """A frozen control monitored for its epochs without any optimizer step: its embedding and
    readout never moved from init, so it is no evidence for (d)."""
    from creditaudit import Monitor

    def run():
        main = Monitor(net(), (X, Y), w.fresh("main"), epochs=1, test_batches=[(X, Y)])
        model = main.model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = torch.nn.functional.cross_entropy(model(X), Y)
        loss.backward()
        opt.step()
        main.step(loss, len(Y))
        main.epoch_end()
        main.finish()
        ctl = Monitor(main.frozen_control(), (X, Y), w.fresh("ctl"), epochs=1, test_batches=[(X, Y)],
                      control_of=main)
        ctl.step(torch.tensor(1.0), len(Y))       # no optimizer step: nothing trained
        ctl.epoch_end()
        ctl.finish()
        return main.report
    return run


def own_runs(w: World, X, Y, net) -> list[Path]:
    from creditaudit import Monitor
    out = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        m = Monitor(net(), (X, Y), w.fresh(f"own{seed}"), epochs=1, test_batches=[(X, Y)], seed=seed)
        m.step(torch.tensor(1.0), 32)
        m.epoch_end()
        m.finish()
        out.append(m.out)
    return out


def lightning_cases(w: World, X, Y, net) -> list[Case]:
    try:
        import lightning as L
        from creditaudit.lightning import CreditAuditCallback
    except Exception:  # noqa: BLE001 — the extra is not installed: no cases
        return []
    C = []

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()

        def forward(self, x):
            return self.net(x)

        def stream(self):
            return self.net.stream()

        @property
        def blocks(self):
            return self.net.blocks

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(trainer_kw, out=None, **cb_kw):
        def run():
            cb = CreditAuditCallback((X, Y), w.fresh("pl") if out is None else out,
                                     test_batches=[(X, Y)], **cb_kw)
            loader = torch.utils.data.DataLoader(list(zip(X, Y)), batch_size=8)
            trainer = L.Trainer(callbacks=[cb], logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, **trainer_kw)
            trainer.fit(Module(), loader)
            return cb.report
        return py(run)

    C.append(Case("lightning a 1-epoch fit (no control)", "never-trustworthy", fit({"max_epochs": 1})))
    C.append(Case("lightning fast_dev_run", "never-trustworthy", fit({"max_epochs": 1, "fast_dev_run": True}), "gate"))
    C.append(Case("lightning limit_train_batches 0.5", "never-trustworthy",
                  fit({"max_epochs": 1, "limit_train_batches": 0.5}), "gate"))
    C.append(Case("lightning max_epochs -1", "refusal", fit({"max_epochs": -1})))
    C.append(Case("lightning dict thresholds", "refusal", fit({"max_epochs": 1}, thresholds={})))
    C.append(Case("lightning tensorboard a file", "refusal", fit({"max_epochs": 1}, tensorboard="/etc/passwd")))
    C.append(Case("lightning out an int", "refusal", fit({"max_epochs": 1}, out=5), "owntools"))
    C.append(Case("lightning out a file", "refusal", fit({"max_epochs": 1}, out="/etc/passwd")))
    return C


# -- review round: the new rules, the member axis, the gate after the fact ----------------------
def review_cases(w: World) -> list[Case]:
    """Hostile inputs around today's additions: the zoo's options (variant, sigma, scale,
    incremental, sim, mix), their controls, stacks of odd sets, and folders changed after an audit."""
    from creditaudit.methods.dfa import DFAPenalty
    from creditaudit.methods.drtp import DRTP
    from creditaudit.methods.kolen_pollack import KolenPollack
    from creditaudit.methods.local_losses import LocalLosses
    from creditaudit.methods.node_perturbation import NodePerturbation
    from creditaudit.methods.pepita import PEPITA
    from creditaudit.methods.predictive_coding import PredictiveCoding
    from creditaudit.methods.signsym import SignSymmetry
    from creditaudit.methods import REFERENCE_METHOD
    o, C = w.out, []
    add = lambda name, expect, run, owner="": C.append(Case("rv " + name, expect, run, owner))
    ss, kp, npt, pep, pc, ll, dr = (SignSymmetry.name, KolenPollack.name, NodePerturbation.name,
                                    PEPITA.name, PredictiveCoding.name, LocalLosses.name, DRTP.name)
    # options a user mistypes: one line and exit 2
    for method, spec in ((ss, "variant=xyz"), (ss, "variant=1"), (ss, "variant=USF"), (ss, "variant="),
                         (ss, "variant=true"), (ss, "variant=null"), (ss, "variant=[\"usf\"]"), (ss, "scale=1"),
                         (npt, "sigma=0"), (npt, "sigma=-1"), (npt, "sigma=2"), (npt, "sigma=x"), (npt, "sigma=1e9"),
                         (npt, "sigma=1e-7"), (pep, "scale=0"), (pep, "scale=11"), (pep, "scale=-0.1"),
                         (pep, "scale=\"0.1\""), (pc, "incremental=2"), (pc, "incremental=0.5"),
                         (pc, "incremental=true"), (pc, "incremental=-1"), (pc, "steps=0"), (pc, "alpha=0"),
                         (pc, "alpha=2"), (pc, "beta=0"), (ll, "sim=-0.1"), (ll, "sim=1.5"), (ll, "sim=nan"),
                         (dr, "mix=2"), (dr, "mix=-1"), (dr, "lam=1"), (kp, "variant=usf"), (kp, "lam=0")):
        add(f"train {method} --option {spec}", "refusal",
            cli("train", *TINY, "--method", method, "--option", spec, "--out", w.fresh("rv")))
    add("train sign-symmetry a good variant, then a bad one (the last wins)", "refusal",
        cli("train", *TINY, "--method", ss, "--option", "variant=frsf", "--option", "variant=nope",
            "--out", w.fresh("rv")))
    # the rules on every architecture and control: these must work
    vit = ["--arch", "vit-mini", "--arch-option", "patch=4"]
    for method, args in ((ss, ["--option", "variant=frsf"]), (ss, ["--option", "variant=brsf"]),
                         (pc, ["--option", "incremental=1"]), (npt, vit), (pep, ["--arch", "resnet-small", "--option", "rule=backprop"]),
                         (pc, ["--option", "incremental=1", "--arch", "resnet-small"]),
                         (pc, ["--option", "incremental=1", *vit]), (ll, ["--option", "sim=0.99", *vit]),
                         (kp, ["--frozen"]), (dr, ["--shallow"]), (npt, ["--trainable-blocks", "1"]),
                         (kp, ["--weight-decay", "0"]), (npt, ["--batch-size", "1"]),
                         (pep, ["--frozen", "--arch", "resnet-small"]), (ss, ["--option", "variant=frsf", "--frozen"])):
        add(f"train ok {method} {' '.join(args)}", "result",
            cli("train", *TINY, "--method", method, *args, "--out", w.fresh("rv")))
    # PEPITA's own per-layer rule is written for the ResidualMLP's block: elsewhere one line, not a guess
    for args in (["--arch", "resnet-small"], vit):
        add(f"train refused {pep} {' '.join(args)} (its rule needs the ResidualMLP block)", "refusal",
            cli("train", *TINY, "--method", pep, *args, "--out", w.fresh("rv")))
    # a zoo run and controls of other rules or options: never this run's (d) yardstick
    def trained(method, *args):
        d = w.fresh(f"rv-{method}")
        _must(cli("train", *TINY, "--method", method, *args, "--out", d)(), (method, *args))
        return d
    ss_frsf, ss_usf_frozen = trained(ss, "--option", "variant=frsf"), trained(ss, "--frozen")
    kp_run, bp_frozen = trained(kp), o / "frozen"
    ipc_run, pc_frozen = trained(pc, "--option", "incremental=1"), trained(pc, "--frozen")
    dr_run, kp_frozen = trained(dr), trained(kp, "--frozen")
    pen_run, pen_frozen = (trained(DFAPenalty.name, "--option", "lam=0.1"),
                           trained(DFAPenalty.name, "--option", "lam=0.5", "--frozen"))
    for run, ctl, label in ((ss_frsf, ss_usf_frozen, "frsf run, usf control"),
                            (kp_run, bp_frozen, "kolen-pollack run, bp control"),
                            (ipc_run, pc_frozen, "iPC run, plain pc control"),
                            (dr_run, kp_frozen, "drtp run, kolen-pollack control")):
        add(f"diagnose {label}", "refusal",
            cli("diagnose", copy_run(w, run), "--frozen-control", ctl, "--threads", "1"))
    add("diagnose dfa-penalty λ 0.1 with a λ 0.5 frozen control (λ acts on trained blocks only)", "result",
        cli("diagnose", copy_run(w, pen_run), "--frozen-control", pen_frozen, "--threads", "1"))
    C[-1].codes = {0, 1, 3}
    add("diagnose a node-perturbation run without its control", "never-trustworthy",
        cli("diagnose", trained(npt), "--threads", "1"))
    add("diagnose an iPC run --rho", "never-trustworthy", cli("diagnose", copy_run(w, ipc_run), "--rho", "--threads", "1"))
    for run in (trained(ss), trained(pc), ss_frsf, kp_run):
        add(f"calibrate a {json.loads((run / 'config.json').read_text())['method']} run", "handled",
            cli("calibrate", copy_run(w, run), "--threads", "1", "--null-draws", "2"))
    add("penalty-sweep --method sign-symmetry (no sweep)", "refusal",
        cli("penalty-sweep", "--config", o / "audit.toml", "--method", ss, "--quiet", "--out", w.fresh("pen")))
    # TOML options of the zoo
    head = ('dataset = "digits"\nseeds = [1]\nepochs = 1\njobs = 1\n[model]\nwidth = 16\nblocks = 2\n')
    tomls = {
        "variant int": (ss, f'[options.{ss}]\nvariant = 1\n'),
        "variant nope": (ss, f'[options.{ss}]\nvariant = "nope"\n'),
        "variant list": (ss, f'[options.{ss}]\nvariant = ["usf"]\n'),
        "variant table": (ss, f'[options.{ss}.variant]\na = 1\n'),
        "sigma str": (npt, f'[options.{npt}]\nsigma = "0.01"\n'),
        "sigma inf": (npt, f'[options.{npt}]\nsigma = inf\n'),
        "incremental bool": (pc, f'[options.{pc}]\nincremental = true\n'),
        "incremental float": (pc, f'[options.{pc}]\nincremental = 1.0\n'),
        "scale 1e400": (pep, f'[options.{pep}]\nscale = 1e400\n'),
        "scale nan": (pep, f'[options.{pep}]\nscale = nan\n'),
        "sim str": (ll, f'[options.{ll}]\nsim = "predsim"\n'),
        "stack int": (ss, 'stack = 1\n'),
        "methods twice": (ss, None),
    }
    for name, (method, extra) in tomls.items():
        p = o / "toml" / f"rv-{name.replace(' ', '-')}.toml"
        p.parent.mkdir(exist_ok=True)
        methods = json.dumps([method, method] if extra is None else [method])
        top, _, rest = head.partition("[model]")
        stack = extra if extra and extra.startswith("stack") else ""
        table = "" if extra is None or stack else extra
        p.write_text(f"methods = {methods}\n{top}{stack}[model]{rest}{table}")
        add(f"audit --config {name}", "refusal", cli("audit", "--config", p, "--out", w.fresh("rv-audit"), "--quiet"))
    # the member axis: stacks of odd sets, a user rule among them, all members diverging
    base = ["--config", o / "audit.toml", "--quiet", "--device", "cpu"]
    add("audit --stack bp and pc (one on the axis, one not)", "result",
        cli("audit", *base, "--stack", "--methods", REFERENCE_METHOD, pc, "--out", w.fresh("rv-audit")))
    C[-1].codes = {0, 1, 3}
    d = w.fresh("rv-audit")
    add("audit --stack a user rule (off the axis) that breaks its credit", "never-trustworthy",
        cli("audit", *base, "--stack", "--methods", "sweep_user:NanCredit", "--out", d, check=d))
    add("audit --stack one seed", "result", cli("audit", *base, "--stack", "--seeds", "5", "--out", w.fresh("rv-audit")))
    C[-1].codes = {0, 1, 3}
    div = o / "toml" / "rv-diverge.toml"
    div.write_text('dataset = "digits"\nmethods = ["%s"]\nseeds = [1, 2]\nepochs = 2\njobs = 1\n'
                   '[model]\nwidth = 16\nblocks = 2\n[training]\nlr = 1e6\nclip = 1e9\n' % REFERENCE_METHOD)
    d = w.fresh("rv-div")
    add("audit --stack whose members diverge", "never-trustworthy",
        cli("audit", "--config", div, "--stack", "--quiet", "--device", "cpu", "--out", d, check=d))
    d = w.fresh("rv-killed")
    add("audit --stack killed mid-way, then resumed", "result", killed_then_resumed(d))
    C[-1].codes = {0, 1, 3}
    add("check the resumed stacked audit", "result", cli("check", d))
    C[-1].codes = {0, 1, 3}
    p = o / "toml" / "rv-options-not-audited.toml"
    p.write_text(f'methods = ["{ss}"]\n{head}[options.{pc}]\nincremental = 1\n')
    add("audit --config with options of a rule it does not audit (a shared config)", "result",
        cli("audit", "--config", p, "--out", w.fresh("rv-audit"), "--quiet"))
    C[-1].codes = {0, 1, 3}
    # the gate after the fact: an audit's run folders changed once it was written, then the audit
    # run again into that folder (it reuses what it finds): a changed control or run is never
    # taken as evidence; one removed is trained again (then a verdict is earned)
    expect = {"nothing changed": "result", "frozen control folder was removed": "result",
              "run holds another seed's diagnosis": "result"}
    for name, edit in audit_edits(w).items():
        add(f"audit again into an audit whose {name}", expect.get(name, "never-trustworthy"), edit("audit"))
        if name in expect:
            C[-1].codes = {0, 1, 3}
    # a diagnosis made on an unfinished run, put back after the run was resumed to its end
    add("check a resumed run holding its unfinished diagnosis", "never-trustworthy", stale_diagnosis(w))
    return C


def issue28_cases(w: World) -> list[Case]:
    """Issue 28: a claimed accuracy over a measured one, data that cannot carry a verdict (mnist1d
    caches intact in form), and the single faults and tracebacks it lists."""
    import numpy as np
    from creditaudit import Monitor, ResidualMLP
    from creditaudit.data import load_dataset
    from creditaudit.methods.bridges import CreditBridge, StateBridge
    from creditaudit.methods.dfa import DFAPenalty
    from creditaudit.methods.ep import EP
    from creditaudit.methods.predictive_coding import PredictiveCoding
    o, C = w.out, []
    add = lambda name, expect, run, owner="": C.append(Case(name, expect, run, owner))
    small = ["--width", "16", "--blocks", "2", "--quiet", "--threads", "1", "--device", "cpu", "--epochs", "1"]

    # data: mnist1d caches of the right shapes, finite, labels 0-9 — that cannot carry a verdict
    real = o / "mnist1d-real"
    load_dataset("mnist1d", real)
    with np.load(real / "mnist1d.npz") as z:
        arrays = dict(z)
    rng = np.random.default_rng(0)
    faults = {
        "one class": {"y": np.zeros_like(arrays["y"]), "y_test": np.zeros_like(arrays["y_test"])},
        "one class in the test split": {"y_test": np.full_like(arrays["y_test"], 3)},
        "constant inputs": {"x": np.ones_like(arrays["x"]), "x_test": np.ones_like(arrays["x_test"])},
        "random labels": {"y": rng.integers(0, 10, len(arrays["y"])), "y_test": rng.integers(0, 10, len(arrays["y_test"]))},
        "shuffled training labels": {"y": rng.permutation(arrays["y"])},
        "inputs of 1e38": {"x": np.full_like(arrays["x"], 1e38), "x_test": np.full_like(arrays["x_test"], 1e38)},
        "inputs scaled by 1e17": {"x": arrays["x"] * 1e17, "x_test": arrays["x_test"] * 1e17},
    }
    for name, change in faults.items():
        d = o / "mnist1d-bad" / re.sub(r"\W", "_", name)
        d.mkdir(parents=True, exist_ok=True)
        np.savez(d / "mnist1d.npz", **{**arrays, **change})
        run = w.fresh("bad-data")
        # labels that carry no signal train (the probe only warns) and are caught after training
        expect = "never-trustworthy" if "labels" in name else "refusal"
        add(f"train on a mnist1d cache with {name}", expect,
            cli("train", "--dataset", "mnist1d", "--data-dir", d, *small, "--out", run, check=run))
        toml = o / "toml" / f"i28-{re.sub(r'[^a-z0-9]', '-', name)}.toml"
        toml.parent.mkdir(exist_ok=True)
        toml.write_text(f'dataset = "mnist1d"\ndata_dir = "{d}"\nmethods = ["bp"]\nseeds = [1]\n'
                        "epochs = 1\njobs = 1\n[model]\nwidth = 16\nblocks = 2\n")
        out = w.fresh("bad-data-audit")
        add(f"audit on a mnist1d cache with {name}", expect,
            cli("audit", "--config", toml, "--quiet", "--device", "cpu", "--out", out, check=out))
    for name, args in (("the real mnist1d cache", ["--dataset", "mnist1d", "--data-dir", real]),
                       ("synthetic", ["--dataset", "synthetic"]), ("digits", ["--dataset", "digits"])):
        add(f"train on {name} (never refused)", "result", cli("train", *args, *small, "--out", w.fresh("ok-data")))

    # the command line: one knob twice, another rule's knob, counts without a finite bound
    add("train --lam 0.1 --option lam=0.2", "refusal",
        cli("train", *TINY, "--method", DFAPenalty.name, "--lam", "0.1", "--option", "lam=0.2", "--out", w.fresh("t")))
    add("train --lam 0.1 --option lam=0.1 (the same λ twice)", "result",
        cli("train", *TINY, "--method", DFAPenalty.name, "--lam", "0.1", "--option", "lam=0.1", "--out", w.fresh("t")))
    for knob in ("draws=8", "noise=0.2", "tau=2", "ema=0.5"):
        add(f"train {StateBridge.name} --option {knob} (a {CreditBridge.name} knob)", "refusal",
            cli("train", *TINY, "--method", StateBridge.name, "--option", knob, "--out", w.fresh("t")))
    for method in (PredictiveCoding.name, EP.name):
        add(f"train {method} --option steps=1000000000", "refusal",
            cli("train", *TINY, "--method", method, "--option", "steps=1000000000", "--out", w.fresh("t")))
    add(f"train {CreditBridge.name} --option draws=100000", "refusal",
        cli("train", *TINY, "--method", CreditBridge.name, "--option", "draws=100000", "--out", w.fresh("t")))
    add("check a shallow control (the advice fits it)", "refusal", advice(cli("check", o / "shallow"), "shallow control"))
    add("check a frozen control (the advice fits it)", "refusal", advice(cli("check", o / "frozen"), "frozen-blocks control"))
    add("a second audit into the same --out, started 1 s after the first", "refusal", two_audits(w))

    # --model factories that raised tracebacks
    from safetensors.torch import save_file
    import sweep_user
    bn = sweep_user.bn_training()
    save_file({k: v.contiguous() for k, v in bn.state_dict().items()}, str(o / "bn.safetensors"))
    for factory, weights in (("bn_training", o / "bn.safetensors"), ("on_meta", o / "good.safetensors")):
        add(f"diagnose --model sweep_user:{factory}", "refusal",
            cli("diagnose", "--model", f"sweep_user:{factory}", "--weights", weights, "--dataset", "digits", "--threads", "1"))

    # the Monitor: what it measures wins; numbers in any form; one line for the rest
    X, Y = torch.randn(32, 10, generator=torch.Generator().manual_seed(0)), torch.arange(32) % 3

    def stepped(**kw):
        torch.manual_seed(0)
        m = Monitor(ResidualMLP(10, 16, 2, 3), (X, Y), w.fresh("mon28"), epochs=1, **kw)
        m.step(torch.tensor(1.0), 32)
        return m

    def claimed(value, **kw):
        def run():
            m = stepped(**kw)
            m.epoch_end(test_acc=value)
            return m.finish()
        return run
    add("Monitor epoch_end(test_acc=0.99) with test_batches that give less", "refusal",
        py(claimed(0.99, test_batches=[(X, Y)])))
    for name, value in (("np.float32(0.5)", np.float32(0.5)), ("torch.tensor(0.5)", torch.tensor(0.5)),
                        ("np.array(0.5)", np.array(0.5))):
        add(f"Monitor epoch_end(test_acc={name})", "result", py(claimed(value)))   # accepted (no control: never trustworthy)
    add("Monitor epoch_end(test_acc=tensor([0.5, 0.6]))", "refusal", py(claimed(torch.tensor([0.5, 0.6]))))
    add("Monitor epoch_end(note='hello')", "refusal", py(lambda: stepped().epoch_end(test_acc=0.5, note="hello")))
    add("Monitor an all-NaN eval batch", "refusal",
        py(lambda: Monitor(ResidualMLP(10, 16, 2, 3), (torch.full_like(X, float("nan")), Y), w.fresh("mon28"), epochs=1)))
    return C


def issue34_cases(w: World) -> list[Case]:
    """Issue 34, items 5–7, by class: declarations of the wrong type (exact positions, recipe,
    feedback pairs), a false exact declaration, numpy-int positions, an option given twice, a
    catalog cache of the right keys and wrong types, data a network learns but a linear probe
    cannot read, and data whose labels carry no signal (never refused at load, never trustworthy)."""
    import numpy as np
    from creditaudit import catalog
    from creditaudit.data import load_dataset
    o, C = w.out, []
    add = lambda name, expect, run, owner="": C.append(Case(name, expect, run, owner))
    vit = ["--arch", "vit-mini", "--arch-option", "heads=2"]

    # declarations of the wrong type: one line at train (recipe, feedback pairs) or diagnose (exact)
    for rule in ("ExactNone", "ExactStr", "ExactRaises", "ExactEverywhereDFA"):
        run = w.fresh(f"i34-{rule}")
        add(f"diagnose a run of sweep_user:{rule} (exact_positions)", "refusal",
            chain(cli("train", *TINY, "--method", f"sweep_user:{rule}", "--out", run),
                  cli("diagnose", run, "--threads", "1", "--device", "cpu")))
    run = w.fresh("i34-ExactNumpy")
    add("diagnose a run of sweep_user:ExactNumpy ({np.int64(L)})", "result",
        chain(cli("train", *TINY, "--method", "sweep_user:ExactNumpy", "--out", run),
              cli("diagnose", run, "--threads", "1", "--device", "cpu")))
    out = w.fresh("i34-exact-audit")
    add("audit sweep_user:ExactEverywhereDFA (a false exact claim)", "never-trustworthy",
        cli("audit", "--config", o / "audit.toml", "--methods", "sweep_user:ExactEverywhereDFA", "--seeds", "1",
            "--out", out, "--quiet", "--device", "cpu", check=out))
    for rule in ("StrRecipe", "DictRecipe", "PropertyRecipe", "ShortB", "SwappedPair"):
        add(f"train sweep_user:{rule}", "refusal", cli("train", *TINY, "--method", f"sweep_user:{rule}",
                                                       "--out", w.fresh("i34-t")))
    add("train sweep_user:TransposedB on vit-mini (non-square W)", "refusal",
        cli("train", *TINY, *vit, "--method", "sweep_user:TransposedB", "--out", w.fresh("i34-t")))

    # the command line: one key twice
    for argv in (["--method", "ep", "--option", "beta=0.2", "--option", "beta=0.3"],
                 ["--method", "ep", "--option", "beta=0.2", "--option", "beta=0.2"],
                 [*vit, "--arch-option", "heads=4"]):
        add(f"train {' '.join(argv)}", "refusal", cli("train", *TINY, *argv, "--out", w.fresh("i34-t")))

    # a catalog cache whose keys are all there but whose values are of another type
    def malformed_cache(key, bad):
        def run():
            live = json.loads(json.dumps(catalog.live().values))
            saved = catalog._cache_files
            path = o / "catalog-cache" / f"catalog.{catalog.source_digest()}.json"
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps({"digest": catalog.source_digest(), **live, key: bad}))
            catalog._cache_files = lambda digest: [path]
            try:
                return cli("train", "--help")()
            finally:
                catalog._cache_files = saved
        return run
    for key, bad in (("datasets", "mnist1d"), ("run", {"epochs": 100}), ("max_count", "1e5"), ("knobs", None)):
        add(f"train --help with a catalog cache whose {key} is {bad!r}", "result", malformed_cache(key, bad))

    # data: learnable, but not by a linear probe (never refused); labels with no signal (never trustworthy)
    real = o / "mnist1d-real"
    load_dataset("mnist1d", real)
    with np.load(real / "mnist1d.npz") as z:
        arrays = dict(z)
    rng = np.random.default_rng(3)

    def symmetric_levels(n):      # class c lifts every input by c or 19 − c (centred): no linear read-out
        y = rng.integers(0, 10, n)
        level = np.where(rng.random(n) < 0.5, y, 19 - y) - 9.5
        return (rng.random((n, 40)) - 0.5 + level[:, None]).astype(arrays["x"].dtype), y.astype(arrays["y"].dtype)
    (x, y), (xt, yt) = symmetric_levels(len(arrays["y"])), symmetric_levels(len(arrays["y_test"]))
    for name, change, expect in (
            ("labels a network learns but a linear probe cannot read", {"x": x, "y": y, "x_test": xt, "y_test": yt}, "result"),
            ("random labels (i34)", {"y": rng.integers(0, 10, len(arrays["y"])),
                                     "y_test": rng.integers(0, 10, len(arrays["y_test"]))}, "never-trustworthy")):
        d = o / "mnist1d-i34" / re.sub(r"\W", "_", name)
        d.mkdir(parents=True, exist_ok=True)
        np.savez(d / "mnist1d.npz", **{**arrays, **change})
        add(f"train on a mnist1d cache with {name}", "result" if expect == "result" else "never-trustworthy",
            cli("train", "--dataset", "mnist1d", "--data-dir", d, *TINY[2:], "--out", w.fresh("i34-data")))
        toml = o / "toml" / f"i34-{re.sub(r'[^a-z0-9]', '-', name)}.toml"
        toml.parent.mkdir(exist_ok=True)
        toml.write_text(f'dataset = "mnist1d"\ndata_dir = "{d}"\nmethods = ["bp"]\nseeds = [1]\n'
                        "epochs = 1\njobs = 1\n[model]\nwidth = 16\nblocks = 2\n")
        out = w.fresh("i34-data-audit")
        case = Case(f"audit on a mnist1d cache with {name}", expect,
                    cli("audit", "--config", toml, "--quiet", "--device", "cpu", "--out", out, check=out))
        case.codes = {0, 1, 3}            # it runs; its verdict is whatever the evidence says
        C.append(case)
    return C


def chain(*steps: Callable[[], Outcome]) -> Callable[[], Outcome]:
    """Run each step; the first that does not exit 0 is the outcome, else the last one's."""
    def run() -> Outcome:
        for step in steps:
            o = step()
            if o.kind != "exit" or o.code != 0:
                return o
        return o
    return run


# -- issue 34, items 3 and 4: runs start where the seed says; reuse keyed by all the code that ran ---
RULES34 = """
import os
import torch
from creditaudit.methods.bp import BP
from .helpers import scale


def _nudge(model, by):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


class Honest(BP):
    name = "honest34"
    def credit(self, x, y):
        return [scale(c) for c in super().credit(x, y)]


class PretrainInInit(BP):
    \"\"\"Pretrains every weight by backprop inside __init__: epoch 0 is already trained.\"\"\"
    name = "pretrain34"
    def __init__(self, model, settings):
        super().__init__(model, settings)
        x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()


class PretrainControlOnly(BP):
    \"\"\"Moves its frozen control's weights (blocks included) in __init__, not its run's.\"\"\"
    name = "pretraincontrol34"
    def __init__(self, model, settings):
        super().__init__(model, settings)
        if not settings.trainable_blocks:
            _nudge(model, 0.05)


class MovesInCredit(BP):
    \"\"\"Moves the weights whenever its credit is read (the monitor reads it at epoch 0).\"\"\"
    name = "movesincredit34"
    def credit(self, x, y):
        _nudge(self.model, 0.01)
        return super().credit(x, y)


class MovesAtLoad(BP):
    \"\"\"Honest while it trains; moves the loaded weights when it is built again to be diagnosed.\"\"\"
    name = "movesatload34"
    def __init__(self, model, settings):
        super().__init__(model, settings)
        if os.environ.get("SWEEP34_MOVE_AT_LOAD"):
            _nudge(model, 0.05)


class MovesInLoadState(BP):
    \"\"\"Moves the weights whenever its checkpointed state is loaded back.\"\"\"
    name = "movesinloadstate34"
    def load_extra_state(self, state):
        _nudge(self.model, 0.05)
"""

TOP34 = """
from creditaudit.methods.bp import BP
import sweep34_sibling


class TopLevel(BP):
    name = "toplevel34"
    def credit(self, x, y):
        return [c * sweep34_sibling.FACTOR for c in super().credit(x, y)]
"""


def start_and_code_cases(w: World) -> list[Case]:
    """Issue 34: a rule that moves the weights outside its steps (in __init__, when its credit is
    read, when it is built again at load) is refused in one line; a rule whose code changed (its
    module, a helper of its package, a top-level sibling module it imports) trains and diagnoses
    again and says why, and its old folder named explicitly is refused; an unchanged rule is reused."""
    o, C = w.out, []
    add = lambda name, expect, run, owner="": C.append(Case(f"issue34: {name}", expect, run, owner))
    root = o / "rules34"
    pkg = root / "sweep34pkg"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "rules.py").write_text(RULES34)
    (pkg / "helpers.py").write_text("FACTOR = 1.0\n\ndef scale(t):\n    return t * FACTOR\n")
    (root / "sweep34_top.py").write_text(TOP34)
    (root / "sweep34_sibling.py").write_text("FACTOR = 1.0\n")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    rule = lambda cls: f"sweep34pkg.rules:{cls}"
    edits = iter(range(1, 10 ** 6))

    def edit(path: Path) -> None:          # what a user does: the file's bytes change
        path.write_text(path.read_text() + f"# edit {next(edits)}\n")

    for cls in ("PretrainInInit", "MovesInCredit", "MovesInLoadState"):
        add(f"train a rule that moves the weights outside its steps ({cls})", "refusal",
            cli("train", *TINY, "--method", rule(cls), "--out", w.fresh(cls)))
    add("train --frozen a rule that moves its control's weights in __init__", "refusal",
        cli("train", *TINY, "--frozen", "--method", rule("PretrainControlOnly"), "--out", w.fresh("ctl34")))
    pre = w.fresh("audit-pretrain34")
    add("audit a rule that pretrains every weight in __init__", "never-trustworthy",
        cli("audit", "--config", o / "audit.toml", "--methods", rule("PretrainInInit"), "--quiet",
            "--device", "cpu", "--out", pre, check=pre))

    def at_load() -> Outcome:
        d = w.fresh("load34")
        _must(cli("train", *TINY, "--method", rule("MovesAtLoad"), "--out", d)(), ("train", d))
        os.environ["SWEEP34_MOVE_AT_LOAD"] = "1"
        try:
            return cli("diagnose", d, "--threads", "1")()     # no control: a refusal here is the load's
        finally:
            del os.environ["SWEEP34_MOVE_AT_LOAD"]
    add("diagnose a run whose rule moves the loaded weights when it is built again", "refusal", at_load)

    def audited(spec: str, touch: Path | None, d: Path) -> Outcome:
        """Audit `spec` into `d`, edit `touch` (None: nothing), audit again: with an edit every run of
        the rule trains and is diagnosed again and stderr says why; without, everything is reused."""
        argv = ("audit", "--config", o / "audit.toml", "--methods", spec, "--seeds", "1", "--quiet",
                "--device", "cpu", "--out", d)
        _must(cli(*argv)(), argv)
        if touch is not None:
            edit(touch)
        second = cli(*argv)()
        if second.kind != "exit" or second.code not in (0, 3):
            return second
        second.code = 0
        result = json.loads((d / "audit.json").read_text())
        mine = [r for r in result["runs"] if r["method"] == spec]
        stale = [r["label"] for r in mine if (not r["trained_now"] or r["diagnosis_reused"]) == (touch is not None)]
        if touch is not None and (stale or "the rule's code changed since the run was trained" not in second.err):
            second.wrong = f"after editing {touch.name}: reused {stale}; stderr {second.err.strip()[-200:]!r}"
        if touch is None and stale:
            second.wrong = f"unchanged code, yet trained or diagnosed again: {stale}"
        return second
    add("audit an honest user rule twice, unchanged (every run and diagnosis reused)", "result",
        lambda: audited(rule("Honest"), None, w.fresh("honest34")))
    add("audit again after the rule's imported helper was edited", "result",
        lambda: audited(rule("Honest"), pkg / "helpers.py", w.fresh("helper34")))
    add("audit again after the rule's own module was edited", "result",
        lambda: audited(rule("Honest"), pkg / "rules.py", w.fresh("module34")))
    add("audit again after a top-level sibling module the rule imports was edited", "result",
        lambda: audited("sweep34_top:TopLevel", root / "sweep34_sibling.py", w.fresh("sibling34")))

    def old_folder(command: str, needle: str) -> Callable[[], Outcome]:
        def run() -> Outcome:
            d = w.fresh(f"old34-{command}")
            _must(cli("train", *TINY, "--method", rule("Honest"), "--out", d)(), ("train", d))
            edit(pkg / "helpers.py")
            argv = (("train", *TINY, "--method", rule("Honest"), "--out", d) if command == "train"
                    else ("diagnose", d, "--threads", "1"))
            return advice(cli(*argv), needle)()
        return run
    add("train --out a run's folder after its rule's helper was edited", "refusal",
        old_folder("train", "trained by other code"))
    add("diagnose a run after its rule's helper was edited", "refusal",
        old_folder("diagnose", "its weights are not this code's"))
    return C


def advice(run: Callable[[], Outcome], needle: str) -> Callable[[], Outcome]:
    """A refusal whose advice must name what the folder is: other advice reads as silently wrong."""
    def go() -> Outcome:
        o = run()
        if o.kind == "exit" and o.code == 2 and needle not in o.err:
            return Outcome("exit", 0, out=f"wrong advice: {o.err.strip()}")
        return o
    return go


def two_audits(w: World) -> Callable[[], Outcome]:
    """Two `creditaudit audit` processes into one --out, the second started 1 s after the first:
    one is refused in one line (whichever did not get the lock) and the other finishes."""
    def run() -> Outcome:
        out = w.fresh("race")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, "-m", "creditaudit", "audit", "--config", str(w.out / "audit.toml"),
                "--quiet", "--device", "cpu", "--seeds", "11", "--out", str(out)]
        first = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(1.0)
        second = subprocess.run(argv, env=env, capture_output=True, timeout=600)
        f_out, f_err = first.communicate(timeout=600)
        done = [Outcome("exit", first.returncode, f_out.decode(), f_err.decode()),
                Outcome("exit", second.returncode, second.stdout.decode(), second.stderr.decode())]
        refused = [o for o in done if o.code == 2]
        finished = [o for o in done if o.code in (0, 1, 3)]
        if len(refused) == 1 and len(finished) == 1:     # whichever locked first finishes
            return refused[0]
        if len(finished) == 2:                            # both ran: the race
            return done[1]
        return Outcome("raise", exc=RuntimeError(f"exits {[o.code for o in done]}: "
                                                 f"{(done[0].err + done[1].err)[-300:]}"))
    return run


def killed_then_resumed(d: Path) -> Callable[[], Outcome]:
    """`audit --stack` in a subprocess, killed (SIGKILL) once a run has a checkpoint, then the same
    command again in this process: it must resume and finish."""
    toml = d.parent.parent / "toml" / "rv-kill.toml"
    toml.write_text('dataset = "digits"\nmethods = ["%s"]\nseeds = [1, 2, 3]\nepochs = 30\njobs = 1\n'
                    '[model]\nwidth = 16\nblocks = 2\n' % creditaudit.methods.REFERENCE_METHOD)
    args = ["audit", "--config", toml, "--stack", "--quiet", "--device", "cpu", "--out", d]

    def run() -> Outcome:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "creditaudit", *map(str, args)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.time()
        while time.time() - t0 < 120 and proc.poll() is None:
            if any(d.glob("runs/*/checkpoint-e0002.safetensors")):
                break
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        return cli(*args, check=d)()
    return run


def audit_edits(w: World) -> dict[str, Callable[[str], Callable[[], Outcome]]]:
    """Copies of a finished audit with one of its run folders changed afterwards."""
    o = w.out
    src = o / "trust"
    if not src.exists():
        # synthetic data, 6 epochs, width 32: bp's (d) clears on 3 seeds, so the audit as written
        # is trustworthy and `check` exits 0 on it: an edit must take that away
        (o / "trust.toml").write_text('dataset = "synthetic"\nmethods = ["%s"]\nseeds = [1, 2, 3]\nepochs = 6\n'
                                      'jobs = 1\n[model]\nwidth = 32\nblocks = 2\n'
                                      % creditaudit.methods.REFERENCE_METHOD)
        _must(cli("audit", "--config", o / "trust.toml", "--out", src, "--quiet", "--device", "cpu")(), ("audit",))

    def runs_of(d: Path, control: str) -> list[Path]:
        return sorted(p for p in (d / "runs").iterdir() if f"-{control}-" in p.name)

    def swap_controls(d):       # seed 1's frozen folder now holds seed 2's control
        a, b = runs_of(d, "frozen")[:2]
        shutil.rmtree(a)
        shutil.copytree(b, a)

    def control_is_run(d):      # the frozen control's weights replaced by the run's
        ctl, run = runs_of(d, "frozen")[0], runs_of(d, "none")[0]
        for t in ctl.glob("*.safetensors"):
            t.unlink()
        for t in run.glob("*.safetensors"):
            shutil.copy(t, ctl / t.name)

    def control_removed(d):
        shutil.rmtree(runs_of(d, "frozen")[0])

    def diagnosis_swapped(d):
        a, b = runs_of(d, "none")[:2]
        shutil.copy(b / "diagnosis.json", a / "diagnosis.json")

    def metrics_truncated(d):
        m = runs_of(d, "none")[0] / "metrics.jsonl"
        m.write_text(m.read_text().splitlines()[0] + "\n")

    edits = {"nothing changed": lambda d: None,
             "frozen control was swapped for another seed's": swap_controls,
             "frozen control holds the run's weights": control_is_run,
             "frozen control folder was removed": control_removed,
             "run holds another seed's diagnosis": diagnosis_swapped,
             "run's metrics log was cut": metrics_truncated}

    def make(edit):
        def per_command(cmd):
            def run():
                d = w.fresh("rv-edited")
                shutil.copytree(src, d)
                edit(d)
                if cmd == "audit":
                    return cli("audit", "--config", o / "trust.toml", "--out", d, "--quiet",
                               "--device", "cpu", check=d)()
                return cli(cmd, d)()
            return run
        return per_command
    return {name: make(edit) for name, edit in edits.items()}


def stale_diagnosis(w: World) -> Callable[[], Outcome]:
    def run() -> Outcome:
        d = w.fresh("rv-stale")
        argv = ["train", *TINY, "--epochs", "200", "--out", d]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "creditaudit", *map(str, argv)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.time()
        while time.time() - t0 < 120 and proc.poll() is None and not any(d.glob("checkpoint-e0002*")):
            time.sleep(0.02)
        proc.kill()
        proc.wait()
        cli("diagnose", d, "--threads", "1")()           # the unfinished run's diagnosis (no control)
        stale = (d / "diagnosis.json").read_bytes() if (d / "diagnosis.json").exists() else None
        cli(*argv)()                                      # resumed to its end
        if stale is not None:
            (d / "diagnosis.json").write_bytes(stale)     # the user restores "their" diagnosis
        return cli("check", d)()
    return run


# -- main ----------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="scratch folder (created; reused fixtures)")
    p.add_argument("--only", default="", help="run only the cases whose name contains this")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.out / "cases", ignore_errors=True)
    w = World(args.out.resolve())
    t0 = time.perf_counter()
    w.setup()
    all_cases = cases(w)
    if args.list:
        for c in all_cases:
            print(f"{c.expect:18s} {c.name}")
        print(f"{len(all_cases)} cases")
        return 0
    selected = [c for c in all_cases if args.only in c.name]
    counts: dict[str, int] = {}
    failures = []
    for c in selected:
        try:
            outcome = c.run()
            cls, ok, detail = classify(c, outcome)
        except BaseException as exc:  # noqa: BLE001 — the harness itself must finish
            cls, ok, detail = "traceback", False, f"harness: {type(exc).__name__}: {exc}"
        counts[cls] = counts.get(cls, 0) + 1
        if not ok:
            failures.append((c, cls, detail))
    print(f"entrance sweep: {len(selected)} cases in {time.perf_counter() - t0:.0f} s")
    for cls in ("clean refusal", "correct result", "traceback", "silently wrong", "wrongly refused"):
        print(f"  {cls:16s} {counts.get(cls, 0)}")
    if failures:
        print("\nfailures:")
        for c, cls, detail in failures:
            owner = f" [{c.owner}]" if c.owner else ""
            print(f"  {cls}{owner}: {c.name} (expected {c.expect}) — {detail}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

