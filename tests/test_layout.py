"""The layout rules of docs/ARCHITECTURE.md, checked on the source. The layer order is read from
the document's table itself, so the document and the code cannot disagree silently."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import pytest

from creditaudit.methods import METHODS, REFERENCE_METHOD

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "creditaudit"
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        yield path, path.relative_to(SRC).parts


def _top(parts) -> str:
    return parts[0][:-3] if parts[0].endswith(".py") else parts[0]


def _doc_layers() -> dict[str, int]:
    """module → rank from the layer table of ARCHITECTURE.md (the top row has the highest rank)."""
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ")][1:]  # no header
    layers: list[list[str]] = []
    for row in rows:
        layer, module = (cell.strip() for cell in row.strip("|").split("|")[:2])
        if layer:
            layers.append([])
        layers[-1] += [name.rstrip("/").removesuffix(".py") for name in re.findall(r"`([^`]+)`", module)]
    return {m: len(layers) - i for i, names in enumerate(layers) for m in names}


def _internal_imports():
    """(file, importing top-level module, imported top-level module) for every relative import
    that leaves its own package, wherever it sits in the file (inside functions too)."""
    for path, parts in _modules():
        here = _top(parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            if node.level <= len(parts) - 1:
                continue                    # a sibling inside the same package
            target = (node.module or "").split(".")[0] or None
            for t in [target] if target else [a.name for a in node.names]:
                if t != here and t != "__version__":   # __version__: the package root's constant
                    yield path.relative_to(SRC), here, t


def test_every_module_is_in_the_layer_table():
    ranks = _doc_layers()
    modules = {_top(parts) for _, parts in _modules()} - {"__init__"}
    assert modules - set(ranks) == set(), "add these modules to the table in docs/ARCHITECTURE.md"
    assert set(ranks) - modules == set(), "the table in docs/ARCHITECTURE.md names modules that do not exist"


def test_imports_point_down_the_documented_layers():
    ranks = _doc_layers()
    upward = [f"{path} imports {t}" for path, here, t in _internal_imports()
              if here != "__init__" and t in ranks and ranks[t] > ranks[here]]  # the root re-exports
    assert upward == [], upward


def test_the_layer_check_can_fail():
    """The table really orders something: the command line sits above the experiments, which sit
    above the configuration, which sits above the foundations."""
    ranks = _doc_layers()
    assert ranks["cli"] > ranks["experiments"] > ranks["config"] > ranks["verdict"] > ranks["metrics"] \
        > ranks["model"] == ranks["errors"]


def _imports_of(module: str) -> set[str]:
    return {t for _, here, t in _internal_imports() if here == module}


def test_lint_imports_only_the_error_type():
    assert _imports_of("lint") <= {"errors"}


def test_report_measures_trains_and_runs_nothing():
    forbidden = {"metrics", "protocol", "methods", "model", "data", "train", "runs", "stacked", "runner",
                 "experiments", "usermodel"}
    assert _imports_of("report") & forbidden == set()


def test_train_judges_nothing():
    assert _imports_of("train") & {"verdict", "protocol"} == set()


# -- names ------------------------------------------------------------------------------------------
def _code_strings(path: Path):
    """(line, text) of every string constant in code: not docstrings, not `--help` example lines."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                and not node.value.startswith("  creditaudit "):
            yield node.lineno, node.value


def test_no_method_name_outside_methods():
    """A method's name is known only to its class and the registry: presets, --help, validation and
    the stackable set take their lists from `METHODS`. Caught anywhere in a string (help texts,
    titles, f-strings), as a whole word."""
    # "bp" also names the BP-gradient control of ρ (a measurement's key, not the method)
    names = sorted(set(METHODS) - {REFERENCE_METHOD}, key=len, reverse=True)
    word = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")(?![\w-])")
    hits = [f"{path.relative_to(SRC)}:{line} {text!r}" for path, parts in _modules() if parts[0] != "methods"
            for line, text in _code_strings(path) if word.search(text)]
    assert hits == [], hits


def test_no_dataset_list_outside_the_loader_table():
    from creditaudit.data import DATASET_NAMES, LOADERS
    assert DATASET_NAMES == tuple(LOADERS)
    hits = []
    for path, parts in _modules():
        if parts == ("data", "__init__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                consts = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                if len(consts & set(DATASET_NAMES)) >= 2:
                    hits.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert hits == [], hits


# -- defaults ---------------------------------------------------------------------------------------
def _is_literal(node: ast.AST) -> bool:
    """A hand-typed value: a non-empty constant or container of constants (None/False/[] are "unset")."""
    if isinstance(node, ast.Constant):
        return node.value not in (None, False, True, "")
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return bool(node.elts) and all(isinstance(e, ast.Constant) for e in node.elts)
    return False


def test_the_command_line_types_no_default():
    """Every default the command line (`cli.py` and its handlers in `commands/`) shows comes from
    config.py (or the function that measures): no `add_argument(default=<literal>)`, no
    `args.x or <literal>`."""
    hits = []
    for path in [SRC / "cli.py", *sorted((SRC / "commands").glob("*.py"))]:
        name = str(path.relative_to(SRC))
        tree = ast.parse(path.read_text())
        labels = {id(k.value) for n in ast.walk(tree) if isinstance(n, ast.Call)
                  for k in n.keywords if k.arg == "where"}      # "where" names the settings in messages
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                hits += [f"{name}:{node.lineno}" for k in node.keywords if k.arg == "default" and _is_literal(k.value)]
            if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and _is_literal(node.values[-1]) \
                    and id(node) not in labels:
                hits.append(f"{name}:{node.lineno}")
    assert hits == [], hits


def test_parser_defaults_are_the_config_defaults():
    """The check above can fail only if the values it forbids are what the parser shows: the
    defaults it does show equal the config's."""
    from creditaudit.cli import build_parser
    from creditaudit.config import AuditConfig, RunConfig, default
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    train = {a.dest: a.default for a in subs["train"]._actions}
    for f in dataclasses.fields(RunConfig):
        if f.name in train and f.metadata.get("help"):
            assert train[f.name] == default(RunConfig, f.name), f.name
    diagnose = {a.dest: a.default for a in subs["diagnose"]._actions}
    for name in ("eval_batches", "data_dir", "device"):
        assert diagnose[name] == default(AuditConfig, name)
    ident = {a.dest: a.default for a in subs["identity-check"]._actions}
    assert ident["seeds"] == list(default(AuditConfig, "seeds")) and ident["dataset"] == default(RunConfig, "dataset")


def test_experiment_defaults_are_the_audit_defaults():
    import inspect
    from creditaudit.config import AuditConfig, default
    from creditaudit.experiments import Execution, ladder, penalty_sweep, run_all
    shared = {f.name for f in dataclasses.fields(Execution)} & {f.name for f in dataclasses.fields(AuditConfig)}
    assert {"data_dir", "device", "jobs", "executor", "address", "max_retries", "stack"} <= shared
    for name in shared:
        assert getattr(Execution(), name) == default(AuditConfig, name), name
    for fn in (run_all, ladder, penalty_sweep):
        assert inspect.signature(fn).parameters["n_eval"].default == default(AuditConfig, "eval_batches")


def test_every_knob_has_a_help_line():
    from creditaudit.model import ARCH_OPTION_HELP, ARCH_OPTIONS
    for name, cls in METHODS.items():
        assert set(cls.option_help) == set(cls.option_defaults), name
    assert {a: set(o) for a, o in ARCH_OPTIONS.items()} == {a: set(h) for a, h in ARCH_OPTION_HELP.items()}


# -- adding a method: the registry line is the only list in the package ------------------------------
def test_a_method_added_to_the_registry_alone_is_everywhere(monkeypatch, capsys):
    import creditaudit.methods as methods
    from creditaudit.cli import build_parser
    from creditaudit.config import RunConfig, audit_config_from_dict, presets

    class Extra(METHODS[REFERENCE_METHOD]):
        name = "extra-rule"
    monkeypatch.setitem(methods.METHODS, Extra.name, Extra)
    assert Extra.name in presets()["quick"]["methods"] and Extra.name in presets()["paper"]["methods"]
    assert Extra.name in presets()["zoo"]["methods"]
    assert Extra.name in audit_config_from_dict({"preset": "quick"}).methods
    assert RunConfig(method=Extra.name).method == Extra.name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["audit", "--help"])
    assert Extra.name in capsys.readouterr().out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    assert Extra.name in capsys.readouterr().out


# -- fast where nothing is computed: --help and argument errors import no torch ------------------
_NO_TORCH = r"""
import contextlib, io, sys
import creditaudit.cli as cli
from creditaudit.catalog import PACKAGE
outcomes = []
for argv in [["--help"], *[[c[0], "--help"] for c in cli.COMMANDS], ["audit", "--epochs", "x"],
             ["train", "--dataset", "no-such-data"], ["nonsense"]]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as err:
            code = err.code
    outcomes.append(code)
print(outcomes, sorted(m for m in ("torch", "numpy", "matplotlib") if m in sys.modules))
"""


def test_help_and_argument_errors_import_no_torch(tmp_path):
    """Every --help and an argument error answer from the cached catalog: torch (seconds of CPU)
    is never imported. The first command of a source tree computes the catalog; the second reads it."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": str(SRC.parent), "XDG_CACHE_HOME": str(tmp_path)}
    run = lambda: subprocess.run([sys.executable, "-c", _NO_TORCH], env=env, capture_output=True,
                                 text=True, check=True).stdout.strip()
    run()                                   # computes (or finds) the catalog
    from creditaudit.cli import COMMANDS
    assert run() == f"{[0] * (1 + len(COMMANDS)) + [2, 2, 2]} []"


def test_the_cached_catalog_is_the_live_one(tmp_path, monkeypatch):
    """What --help reads from the cache equals what the registries say now; a cache file that is
    not JSON of this source tree is recomputed, not trusted."""
    import json
    from creditaudit import catalog
    live = json.loads(json.dumps(catalog.live().values))
    monkeypatch.setattr(catalog, "_cache_files", lambda digest: [tmp_path / f"catalog.{digest}.json"])
    assert catalog.load().values == live                 # computed, then written
    (cached,) = tmp_path.glob("catalog.*.json")
    assert catalog.load().values == live                 # read back
    for broken in ("{not json", json.dumps({"digest": "other", **live}), json.dumps({"digest": catalog.source_digest()})):
        cached.write_text(broken)
        assert catalog.load().values == live


@pytest.mark.parametrize("key, bad", [("datasets", "mnist1d"), ("run", {"epochs": 100}), ("max_count", "100000"),
                                      ("methods", [1, 2]), ("experiment_out", ["ladder"]), ("knobs", None),
                                      ("null_k", True), ("audit", {"seeds": [[42], 7]})])
def test_a_cached_catalog_with_every_key_but_values_of_another_type_is_rebuilt(key, bad, tmp_path, monkeypatch):
    """Issue 34 item 6: a cache file of this source tree whose keys are all present but whose value
    types are wrong used to reach argparse (a traceback); it is recomputed and replaced, and the
    command line works from it."""
    import json
    from creditaudit import catalog
    from creditaudit.cli import main as cli_main
    live = json.loads(json.dumps(catalog.live().values))
    monkeypatch.setattr(catalog, "_cache_files", lambda digest: [tmp_path / f"catalog.{digest}.json"])
    cached = tmp_path / f"catalog.{catalog.source_digest()}.json"
    cached.write_text(json.dumps({"digest": catalog.source_digest(), **live, key: bad}))
    assert not catalog.well_formed(json.loads(cached.read_text()), catalog.source_digest())
    assert catalog.load().values == live
    assert json.loads(cached.read_text())[key] == live[key]          # replaced by the good one
    cached.write_text(json.dumps({"digest": catalog.source_digest(), **live, key: bad}))
    with pytest.raises(SystemExit) as done:
        cli_main(["train", "--help"])
    assert done.value.code == 0


def test_help_summaries_are_whole_sentences():
    """`audit --help` gives each rule a whole line of its docstring, never one cut mid-sentence."""
    from creditaudit.catalog import summary_line
    for name, cls in METHODS.items():
        line = summary_line(name, cls)
        assert line and line.count("(") == line.count(")") and line.count('"') % 2 == 0, (name, line)


def test_no_module_imports_one_that_imports_it_back():
    """No import loop between our modules: the graph of every relative import (inside functions
    and `if TYPE_CHECKING:` too) between top-level modules has no cycle (monitor.py and
    monitor_diagnosis.py were one)."""
    graph: dict[str, set[str]] = {}
    for _, here, t in _internal_imports():
        if here != "__init__":                  # the package root re-exports, and is imported by none
            graph.setdefault(here, set()).add(t)
    loops, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                loops.append(" → ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"
    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert loops == [], loops
