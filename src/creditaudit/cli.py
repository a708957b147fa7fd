"""The command line: the table of subcommands and their options; each one's work is in commands/.
Options and their defaults come from the config dataclasses (config.py) and the registries
(methods, datasets, architectures), so --help cannot drift from the code. User errors print one
line and exit 2, without a traceback; `check` exits 0 / 1 / 3 by verdict."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import threading

from . import __version__
from .commands import audit, diagnose, experiments, lint, reproduce, train, views
from .commands.exits import EXIT_INTERRUPTED, EXIT_USER_ERROR

EXIT_BROKEN_PIPE = 141      # 128 + SIGPIPE, as a command killed by it exits in a shell
from .errors import CreditAuditError


# -- option types -------------------------------------------------------------------------------
def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _count(low: int, high: int):
    """An argparse type: an integer in low … high (an out-of-range count is refused, never run;
    the catalog's `max_count` bounds every count whose size is a plan, not a typo)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer in {low} … {high}, got {text}")
        return value
    parse.__name__ = "count"       # argparse names the type in its message
    return parse


def _option(text: str) -> tuple[str, object]:
    """KEY=VALUE for a method option; the value is read as JSON when it parses (numbers, bools)."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return key, value
    if isinstance(parsed, float) and not math.isfinite(parsed):
        raise argparse.ArgumentTypeError(f"option {key} must be finite, got {value!r}")
    return key, parsed


def _choices(names) -> str:
    return ", ".join(names)


# -- the subcommands: each one's options in one function, its work in commands/ ------------------
# Options and defaults come from the catalog (catalog.py: the registries and config dataclasses),
# so --help cannot drift from the code and needs no torch. A new option of a subcommand goes into
# that subcommand's `_options_<name>` (or into the shared group it belongs to: `_run_options` for
# what defines a run, `_audit_options` for audits, ladders and sweeps, `_where_options` for where
# things run, `_user_model_options` for --model).
def _run_options(p: argparse.ArgumentParser, cat) -> None:
    """What defines one run (train): its RunConfig fields."""
    d = cat.run_default
    h = lambda name, extra="": f"{cat.run_help(name)}{extra} (default: {d(name)})"
    p.add_argument("--method", default=d("method"), metavar="NAME",
                   help=h("method", f"; one of {_choices(cat.methods)}"))
    p.add_argument("--dataset", default=d("dataset"), choices=cat.datasets, metavar="NAME",
                   help=h("dataset", f"; one of {_choices(cat.datasets)}"))
    p.add_argument("--arch", default=d("arch"), choices=cat.archs, metavar="NAME",
                   help=h("arch", f"; one of {_choices(cat.archs)}"))
    p.add_argument("--seed", type=int, default=d("seed"), help=h("seed"))
    p.add_argument("--epochs", type=_count(1, cat.max_count), default=d("epochs"), help=h("epochs"))
    p.add_argument("--batch-size", type=_count(1, 10 ** 7), default=d("batch_size"), help=h("batch_size"))
    p.add_argument("--lr", type=_finite_float, default=d("lr"), help=h("lr"))
    p.add_argument("--weight-decay", type=_finite_float, default=d("weight_decay"), help=h("weight_decay"))
    p.add_argument("--recipe", choices=cat.recipes, default=d("recipe"), help=h("recipe"))
    p.add_argument("--width", type=_count(1, cat.max_count), default=d("width"), help=h("width"))
    p.add_argument("--blocks", type=_count(0, cat.max_count), default=d("blocks"), help=h("blocks"))
    p.add_argument("--activation", default=d("activation"), choices=cat.activations, metavar="NAME",
                   help=h("activation", f"; one of {_choices(cat.activations)}"))
    p.add_argument("--w2-std", type=_finite_float, default=d("w2_std"), help=h("w2_std"))
    p.add_argument("--clip", type=_finite_float, default=d("clip"), help=h("clip"))
    p.add_argument("--lam", type=_finite_float, default=None,
                   help="residual penalty λ, for the methods that declare it (default: the method's own)")
    depth = p.add_mutually_exclusive_group()
    depth.add_argument("--frozen", action="store_true", help="blocks frozen at init (the frozen-blocks control)")
    depth.add_argument("--shallow", action="store_true", help="no blocks at all (the shallow control)")
    depth.add_argument("--trainable-blocks", type=_count(0, cat.max_count), metavar="K",
                       help="only the last K blocks train (K=0 is the frozen control) (default: all)")
    p.add_argument("--stop-when-flagged", type=_count(1, cat.max_count), metavar="N",
                   help="end the run once (a) or (b′) has held N epochs (default: train to the end)")
    p.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                   help="method option, e.g. --option beta=10 (docs/METHODS.md) (default: none)")
    p.add_argument("--arch-option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                   help="architecture option, e.g. --arch-option heads=4 (default: none)")
    p.add_argument("--precision", choices=cat.precisions, default=d("precision"), help=h("precision"))
    p.add_argument("--no-compile", action="store_true",
                   help="train the step eagerly (default: compiled into CUDA graphs on a GPU, eager on a CPU)")


_LABEL_PROBE_HELP = ("do not warn when a linear probe cannot predict the labels (labels that depend "
                     "on the inputs nonlinearly); labels with no signal still leave the verdict "
                     "incomplete after training (default: warn)")


def _where_options(p: argparse.ArgumentParser, cat, threads: bool = True, labels: bool = True) -> None:
    """Where a single-run command reads data and runs: --data-dir, --device, --threads; and,
    for a command that reads the labels, --no-label-probe."""
    for name in ("data_dir", "device"):
        p.add_argument(f"--{name.replace('_', '-')}", default=cat.audit_default(name),
                       help=f"{cat.audit_help(name)} (default: {cat.audit_default(name)})")
    if labels:
        p.add_argument("--no-label-probe", action="store_true", help=_LABEL_PROBE_HELP)
    if threads:
        p.add_argument("--threads", type=_count(1, 4096), metavar="N",
                       help="CPU threads (default: the idle cores, 1 to 4)")


def _user_model_options(p: argparse.ArgumentParser, cat) -> None:
    """--model and what goes with it: a model trained elsewhere (diagnose, check)."""
    p.add_argument("--model", metavar="PKG.MODULE:FACTORY",
                   help="audit your own model: FACTORY() returns an nn.Module exposing its residual "
                        "stream (docs/ADD_A_METHOD.md) (default: none)")
    p.add_argument("--weights", metavar="FILE",
                   help="with --model: its trained weights (.safetensors) (default: none)")
    p.add_argument("--init-weights", metavar="FILE",
                   help="with --model: its weights at initialisation, for (a′) (default: none)")
    p.add_argument("--yardstick", metavar="FILE",
                   help="with --model and --frozen-control: weights of the same model with its blocks "
                        "at init and embedding and readout trained by backprop; a control more than 2 "
                        "points short of it is weak (default: none: the control must beat the "
                        "untrained model by the margin)")
    p.add_argument("--dataset", choices=cat.datasets, metavar="NAME",
                   help=f"with --model: the data to measure on; one of {_choices(cat.datasets)} "
                        "(default: none)")


def _audit_options(p: argparse.ArgumentParser, cat, methods: bool = True) -> None:
    """An audit's settings (audit, ladder, penalty-sweep): preset or TOML file, then overrides."""
    p.epilog = cat.knobs + "\n" + p.epilog          # what --option sets
    h = lambda name: f"{cat.audit_help(name)} (default: from the preset or config file)"
    p.add_argument("--preset", choices=cat.presets,
                   help="quick: MNIST-1D, no download, 15 epochs; paper: CIFAR-10, 100 epochs "
                        "(both: the paper's seven methods); zoo: every built-in rule, as quick "
                        "(default: quick, unless --config is given)")
    p.add_argument("--config", metavar="FILE",
                   help="audit TOML file, e.g. examples/quick.toml (default: none, the preset alone)")
    p.add_argument("--dataset", choices=cat.datasets, metavar="NAME",
                   help=f"{h('dataset')}; one of {_choices(cat.datasets)}")
    p.add_argument("--arch", choices=cat.archs, metavar="NAME",
                   help=f"architecture, one of {_choices(cat.archs)} (default: {cat.run_default('arch')})")
    if methods:
        p.add_argument("--methods", nargs="+", metavar="NAME",
                       help=f"methods to audit: some of {_choices(cat.methods)}, or PKG.MODULE:CLASS "
                            "(default: from the preset)")
    p.add_argument("--seeds", nargs="+", type=int, metavar="SEED", help=h("seeds"))
    p.add_argument("--epochs", type=_count(1, cat.max_count), help=h("epochs"))
    # what defines every run, as the [model] and [training] tables of a config file set it
    r = lambda name: f"{cat.run_help(name)} of every run (default: from the config file, else {cat.run_default(name)})"
    p.add_argument("--width", type=_count(1, cat.max_count), help=r("width"))
    p.add_argument("--blocks", type=_count(0, cat.max_count),
                   help=f"number of residual blocks L of every run, ≥ 1: the audit trains the shallow "
                        f"control itself (default: from the config file, else {cat.run_default('blocks')})")
    p.add_argument("--lr", type=_finite_float,
                   help="learning rate of every run, overriding each method's recipe (default: from the "
                        "config file, else each recipe's)")
    p.add_argument("--option", type=_option, action="append", default=[], metavar="[METHOD.]KEY=VALUE",
                   help="method option, as [options.METHOD] in a config file: KEY=VALUE for every audited "
                        "method that declares KEY, METHOD.KEY=VALUE for one; e.g. --option decay=10 "
                        "(the options: --help's end) (default: none)")
    p.add_argument("--arch-option", dest="arch_option", type=_option, action="append", default=[],
                   metavar="KEY=VALUE",
                   help="architecture option of every run, as [model.options] in a config file, e.g. "
                        "--arch-option loss=bce with --arch mlp (the options: --help's end) (default: none)")
    p.add_argument("--out", metavar="DIR", help="output folder (default: audits/<preset>, or as named below)")
    p.add_argument("--device", help=f"{cat.audit_help('device')} (default: {cat.audit_default('device')})")
    p.add_argument("--no-compile", action="store_true",
                   help="train every step eagerly (default: compiled into CUDA graphs on a GPU, eager on a CPU)")
    p.add_argument("--data-dir", dest="data_dir", metavar="DIR",
                   help=f"{cat.audit_help('data_dir')} (default: {cat.audit_default('data_dir')})")
    p.add_argument("--no-label-probe", action="store_true", help=_LABEL_PROBE_HELP)
    p.add_argument("--jobs", type=_count(0, 4096), help=f"{cat.audit_help('jobs')} (default: 0)")
    p.add_argument("--eval-batches", dest="eval_batches", type=_count(1, cat.max_count),
                   help=f"{cat.audit_help('eval_batches')} (default: {cat.audit_default('eval_batches')})")
    p.add_argument("--executor", choices=cat.executors,
                   help=f"{cat.audit_help('executor')}: {_choices(cat.executors)} (default: local)")
    p.add_argument("--address", help=f"{cat.audit_help('address')} (default: start a local Ray)")
    p.add_argument("--max-retries", dest="max_retries", type=_count(0, 1000),
                   help=f"{cat.audit_help('max_retries')} (default: {cat.audit_default('max_retries')})")
    stacking = p.add_mutually_exclusive_group()
    stacking.add_argument("--stack", dest="stack", action="store_const", const=True,
                          help=f"train runs of one model shape as one batched stack "
                               f"({cat.stackable}) "
                               "(default: on CUDA only, where it pays)")
    stacking.add_argument("--no-stack", dest="stack", action="store_const", const=False,
                          help="train every run on its own, to compare (default: on CUDA only)")
    p.add_argument("--recipe", choices=cat.recipes,
                   help=f"{cat.audit_help('recipe')} (default: {cat.audit_default('recipe')})")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _eval_batches_option(p: argparse.ArgumentParser, cat, prefix: str = "") -> None:
    p.add_argument("--eval-batches", type=_count(1, cat.max_count), default=cat.audit_default("eval_batches"),
                   help=f"{prefix}{cat.audit_help('eval_batches')} "
                        f"(default: {cat.audit_default('eval_batches')})")


def _options_train(p: argparse.ArgumentParser, cat) -> None:
    p.epilog = cat.knobs + "\n" + p.epilog
    _run_options(p, cat)
    _where_options(p, cat)
    p.add_argument("--out", metavar="DIR", help="run folder (default: runs/METHOD-DATASET-sSEED-KEY)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also log every monitor scalar and flag to TensorBoard in DIR (the "
                        "[tensorboard] extra) (default: none)")


def _options_diagnose(p: argparse.ArgumentParser, cat) -> None:
    p.add_argument("run_dir", nargs="?", help="a run folder written by `creditaudit train`")
    _user_model_options(p, cat)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _eval_batches_option(p, cat)
    _where_options(p, cat)
    p.add_argument("--frozen-control", metavar="RUN_DIR|FILE",
                   help="the frozen-blocks control of the same method, seed and settings "
                        "(a run folder; with --model, its .safetensors weights), for (d) "
                        "(default: none, so the verdict is at best incomplete)")
    p.add_argument("--rho", action="store_true", help="also measure ρ at layers 1…L")


def _options_calibrate(p: argparse.ArgumentParser, cat) -> None:
    p.add_argument("run_dir", nargs="?", help="a run folder written by `creditaudit train`")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _eval_batches_option(p, cat)
    _where_options(p, cat)
    p.add_argument("--null-draws", type=_count(1, cat.max_count), default=cat.null_k,
                   help=f"fresh feedback draws of Γ's null, 1 … {cat.max_count} (default: {cat.null_k})")


def _options_check(p: argparse.ArgumentParser, cat) -> None:
    p.add_argument("path", nargs="?", help="an audit folder (with audit.json) or a diagnosed run folder")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    _user_model_options(p, cat)
    p.add_argument("--frozen-control", metavar="FILE",
                   help="with --model: the frozen control's weights (default: none)")
    _eval_batches_option(p, cat, prefix="with --model: ")
    _where_options(p, cat)
    p.set_defaults(run_dir=None)


def _options_audit(p: argparse.ArgumentParser, cat) -> None:
    _audit_options(p, cat)
    p.epilog = cat.rules + "\n" + p.epilog
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also log every run's monitor scalars and flags to TensorBoard, one "
                        "subfolder of DIR per run (the [tensorboard] extra) (default: none)")
    p.add_argument("--tracker", action="append", metavar="KIND[:WHERE]",
                   help="also log every run to a tracker, one tracker run per run folder, with its "
                        "status and verdicts at the end; repeatable: tensorboard:DIR, wandb[:DIR] "
                        "(WANDB_MODE=offline writes only there), mlflow[:TRACKING_URI] (e.g. "
                        "sqlite:///mlflow.db); the [tensorboard], [wandb], [mlflow] extras "
                        "(default: none)")
    p.add_argument("--tracker-project", metavar="NAME",
                   help="the W&B project / MLflow experiment of --tracker (default: the name of "
                        "the --out folder)")


def _options_reproduce(p: argparse.ArgumentParser, cat) -> None:
    p.add_argument("rule", nargs="?", metavar="RULE",
                   help="the rule to reproduce in its paper's setting (--list shows them)")
    p.add_argument("--list", action="store_true", help="list the paper settings and their numbers")
    p.add_argument("--seeds", nargs="+", type=int, metavar="SEED",
                   help=f"(default: {' '.join(map(str, cat.audit_default('seeds')))})")
    p.add_argument("--epochs", type=_count(1, cat.max_count),
                   help="fewer than the paper's epochs is a reduced budget, and the report says so "
                        "(default: the paper's)")
    p.add_argument("--out", metavar="DIR", help="audit folder (default: audits/reproduce/RULE)")
    p.add_argument("--data-dir", dest="data_dir", metavar="DIR",
                   help=f"{cat.audit_help('data_dir')} (default: {cat.audit_default('data_dir')})")
    p.add_argument("--device", help=f"{cat.audit_help('device')} (default: {cat.audit_default('device')})")
    p.add_argument("--jobs", type=_count(0, 4096), help=f"{cat.audit_help('jobs')} (default: 0)")
    p.add_argument("--no-compile", action="store_true",
                   help="train every step eagerly (default: compiled into CUDA graphs on a GPU, eager on a CPU)")
    p.add_argument("--no-label-probe", action="store_true", help=_LABEL_PROBE_HELP)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(tensorboard=None, tracker=None, tracker_project=None)


def _options_ladder(p: argparse.ArgumentParser, cat) -> None:
    _audit_options(p, cat)


def _options_penalty(p: argparse.ArgumentParser, cat) -> None:
    _audit_options(p, cat, methods=False)
    p.add_argument("--method", help="the method to sweep (default: the first that declares a sweep)")
    p.add_argument("--lambdas", nargs="+", type=_finite_float, metavar="λ",
                   help="λ values (default: the method's own sweep, 0 1e-4 1e-3 1e-2 1e-1)")


def _options_identity(p: argparse.ArgumentParser, cat) -> None:
    r = cat.run_default
    p.add_argument("--dataset", default=r("dataset"), choices=cat.datasets, metavar="NAME",
                   help=f"inputs to measure on; one of {_choices(cat.datasets)} (default: {r('dataset')})")
    p.add_argument("--arch", default=r("arch"), choices=cat.archs, metavar="NAME",
                   help=f"one of {_choices(cat.archs)} (default: {r('arch')})")
    seeds = list(cat.audit_default("seeds"))
    p.add_argument("--seeds", nargs="+", type=int, default=seeds,
                   help=f"(default: {' '.join(map(str, seeds))})")
    p.add_argument("--width", type=_count(1, cat.max_count), default=r("width"), help=f"(default: {r('width')})")
    p.add_argument("--blocks", type=_count(0, cat.max_count), default=r("blocks"), help=f"(default: {r('blocks')})")
    p.add_argument("--activation", default=r("activation"), choices=cat.activations, metavar="NAME",
                   help=f"one of {_choices(cat.activations)} (default: {r('activation')})")
    p.add_argument("--w2-std", type=_finite_float, default=r("w2_std"), help=f"(default: {r('w2_std')})")
    out = cat.experiment_out["identity-check"]
    p.add_argument("--out", default=out, help=f"(default: {out})")
    _where_options(p, cat, labels=False)       # it measures the blocks at init: no label is read


def _options_thresholds(p: argparse.ArgumentParser, cat) -> None:
    p.add_argument("audit_dir", help="an audit folder (with audit.json)")


def _options_report(p: argparse.ArgumentParser, cat) -> None:
    p.add_argument("audit_dir", help="an audit folder (with audit.json)")


def _options_lint(p: argparse.ArgumentParser, cat) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH", help="Python files or folders to check")


# name, one line of help, example command lines, its options, what runs it
COMMANDS = (
    ("train", "train one run into a run folder (resumes if interrupted)",
     "  creditaudit train --method dfa --dataset mnist1d --epochs 15\n"
     "  creditaudit train --method dfa --dataset mnist1d --epochs 15 --frozen", _options_train, train.cmd_train),
    ("diagnose", "audit one run: diagnostics (a)–(d), Γ, verdict",
     "  creditaudit diagnose runs/dfa-RUN --frozen-control runs/dfa-FROZEN\n"
     "  creditaudit diagnose --model mypkg.nets:make --weights trained.safetensors "
     "--dataset cifar10 --frozen-control frozen.safetensors", _options_diagnose, diagnose.cmd_diagnose),
    ("calibrate", "ρ per layer beside its BP/random controls, Γ beside its null",
     "  creditaudit calibrate runs/dfa-RUN", _options_calibrate, diagnose.cmd_calibrate),
    ("check", "verdict gate for CI: exit 0 trustworthy, 1 walk back, 3 incomplete, 2 error",
     "  creditaudit check audits/quick\n"
     "  creditaudit check --model mypkg.nets:make --weights trained.safetensors --dataset digits "
     "--frozen-control frozen.safetensors", _options_check, diagnose.cmd_check),
    ("audit", "train + diagnose methods × seeds with controls; write the report",
     "  creditaudit audit --preset quick\n"
     "  creditaudit audit --config examples/quick.toml --methods bp dfa --seeds 42", _options_audit, audit.cmd_audit),
    ("reproduce", "a rule and bp in the rule's own paper's setting, audited, the paper's numbers beside ours",
     "  creditaudit reproduce --list\n"
     "  creditaudit reproduce dfa --seeds 42 --data-dir data", _options_reproduce, reproduce.cmd_reproduce),
    ("ladder", "accuracy vs number of trainable blocks k = 0…L (default out: audits/ladder)",
     "  creditaudit ladder --methods bp dfa --seeds 42 --epochs 15", _options_ladder, experiments.cmd_ladder),
    ("penalty-sweep", "a penalised method over λ, with frozen controls, Γ, its null and ρ "
                      "(default out: audits/penalty_sweep)",
     "  creditaudit penalty-sweep --seeds 42 --epochs 15\n"
     "  creditaudit penalty-sweep --lambdas 0 0.01 --seeds 42 123", _options_penalty, experiments.cmd_penalty),
    ("identity-check", "how close a fresh residual stack is to the identity, over seeds",
     "  creditaudit identity-check --dataset mnist1d --seeds 42 123 456", _options_identity, experiments.cmd_identity),
    ("thresholds", "threshold sensitivity over an audit's runs",
     "  creditaudit thresholds audits/quick", _options_thresholds, views.cmd_thresholds),
    ("report", "rewrite audit.md, report.html and the PNGs from audit.json alone",
     "  creditaudit report audits/quick", _options_report, views.cmd_report),
    ("lint", "check your own training/eval code for the protocol's pitfalls (never runs it)",
     "  creditaudit lint train.py eval/", _options_lint, lint.cmd_lint),
)


def build_parser(cat=None) -> argparse.ArgumentParser:
    """The whole command line from `COMMANDS`; `cat` the catalog (default: computed now from the
    registries, so a method added to the registry is in --help at once; `main` reads the cached one)."""
    if cat is None:
        from .catalog import live
        cat = live()
    p = _Parser(
        prog="creditaudit",
        description="Train non-backprop credit-assignment methods and audit whether their accuracy "
                    "and gradient-cosine figures mean anything (docs/PROTOCOL.md).",
        epilog="examples:\n  creditaudit audit --preset quick\n  creditaudit check audits/quick",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"creditaudit {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, helptext, examples, options, func in COMMANDS:
        s = sub.add_parser(name, help=helptext, description=helptext, epilog="examples:\n" + examples,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        s.set_defaults(func=func)
        options(s, cat)
        _record_given(s)
    return p


class _StoreRecorded(argparse._StoreAction):
    """Records which options were given (`_given_options`, read where an option would be ignored), and
    refuses a list option given twice: argparse keeps the last list silently, so `--seeds 42 --seeds
    43` would audit seed 43 alone where the lists look meant to add up. A single value given twice
    keeps the command line's convention, the last one wins (`alias ca='creditaudit audit --jobs 2'`,
    then `ca --jobs 1`); repeatable options (--option) append, and are not this."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_given_options", set())
        if self.dest in given and self.nargs == "+":
            raise argparse.ArgumentError(self, "given twice; give it once, with every value (e.g. "
                                               f"{option_string} {' '.join(map(str, getattr(namespace, self.dest)))} "
                                               f"{' '.join(map(str, values))})")
        given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


def _record_given(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if type(action) is argparse._StoreAction and action.option_strings:
            action.__class__ = _StoreRecorded


class _Parser(argparse.ArgumentParser):
    """Bad options are user errors like any other: one line, exit 2 (no usage block). Options are
    never abbreviated (--epoch is not --epochs): a typo must not silently pick an option."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise CreditAuditError(f"{message} (see: {self.prog} --help)")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but an argument no option takes is refused by the subcommand it was given
        to, so that the message points at that subcommand's --help (`creditaudit audit --help`)."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            subs = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
            command = getattr(parsed, "command", None)
            owner = subs[0].choices.get(command, self) if subs and command else self
            owner.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def _interrupt(signum, frame):
    raise KeyboardInterrupt


# what the report's symbols become on a console that cannot print them (cp1252, ASCII, …)
_ASCII = {"′": "'", "‖": "||", "…": "...", "—": "-", "–": "-", "→": "->", "←": "<-", "≥": ">=",
          "≤": "<=", "≈": "~", "×": "x", "−": "-", "·": "*", "Γ": "Gamma", "λ": "lambda",
          "ρ": "rho", "β": "beta", "σ": "sigma", "τ": "tau", "∂": "d", "√": "sqrt", "∞": "inf",
          "²": "^2", "Δ": "Delta", "ε": "eps", "ψ": "psi", "φ": "phi", "✓": "ok", "✗": "x"}


def _ascii_fallback(err: UnicodeEncodeError):
    text = err.object[err.start:err.end]
    return "".join(_ASCII.get(c, "?") for c in text), err.end


def _printable_console() -> None:
    """stdout/stderr that never raise on a character the console's encoding lacks (a cp1252
    Windows console and the ′ of "(a′)"): such a character is spelled in ASCII instead."""
    import codecs
    codecs.register_error("creditaudit-ascii", _ascii_fallback)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="creditaudit-ascii")


_WRITE_ERRNOS = {"ENOSPC", "EDQUOT", "EROFS", "EFBIG"}   # the disk, not the path, is the problem


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)     # SIGTERM stops like Ctrl-C: workers stopped, exit 130
    _printable_console()
    try:
        from .catalog import load
        args = build_parser(load()).parse_args(argv)     # --help ends here with its own SystemExit(0)
        try:
            return args.func(args)
        except SystemExit as err:
            # only the user's code (a --model factory or its forward, a PKG:CLASS rule's step or
            # credit) exits inside a command: a run it was training is unfinished, nothing was
            # judged, and the exit must not read as success (`check` exiting 0)
            raise CreditAuditError(f"code of yours called sys.exit({err.code!r}) inside `creditaudit "
                                   f"{args.command}` (a model factory or forward, or a method's step "
                                   "or credit); nothing was judged and a run it trained is unfinished "
                                   "(its finished epochs are kept) — remove the exit and run the same "
                                   "command again") from None
    except CreditAuditError as err:
        print(f"creditaudit: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except BrokenPipeError:       # the reader went away (`| head`): not an error of the path or disk
        import os
        with contextlib.suppress(OSError):       # nothing more can reach it, the final flush included
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as err:        # reading or writing a file: which one the errno says
        import errno
        where = f" {err.filename}" if getattr(err, "filename", None) else ""
        if errno.errorcode.get(err.errno) in _WRITE_ERRNOS:    # a full disk or a read-only one
            print(f"creditaudit: error: cannot write{where} ({err.strerror or err}); finished runs "
                  "are saved — free space or fix permissions, then run the same command again",
                  file=sys.stderr)
        else:                     # no permission, a folder where a file should be, a bad path
            print(f"creditaudit: error: cannot read or write{where} ({err.strerror or err}); fix "
                  "the path or its permissions, then run the same command again", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("creditaudit: interrupted; finished work is saved — run the same command again to "
              "resume", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
