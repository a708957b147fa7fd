"""The layout rules of docs/ARCHITECTURE.md, checked on the source: no method name outside
methods/, and imports point one way (never up the layer list)."""
from __future__ import annotations

import ast
from pathlib import Path

from creditaudit.methods import METHODS, REFERENCE_METHOD

SRC = Path(__file__).resolve().parents[1] / "src" / "creditaudit"

# lower number = lower layer; a module may import only modules of a lower or equal-rank sibling
RANK = {"__init__": 10, "errors": 0, "seeding": 0, "store": 0, "data": 1, "model": 1, "metrics": 2, "methods": 3,
        "verdict": 3, "protocol": 4, "config": 4, "runs": 5, "train": 6, "stacked": 6, "usermodel": 6, "runner": 6,
        "adapter": 2, "trackers": 4, "monitor": 6, "lightning": 7,
        "experiments": 7, "report": 7, "check": 8, "lint": 8, "cli": 9, "__main__": 10}


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        yield path, path.relative_to(SRC).parts


def _top(parts) -> str:
    return parts[0][:-3] if parts[0].endswith(".py") else parts[0]


def test_no_method_name_outside_methods():
    """A method's name is known only to its class and the registry: presets, --help and validation
    take their lists from `METHODS`."""
    # "bp" also names the BP-gradient control of ρ (a measurement's key, not the method)
    names = set(METHODS) - {REFERENCE_METHOD}
    hits = []
    for path, parts in _modules():
        if parts[0] == "methods":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr)
                      and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names \
                    and id(node) not in docstrings:
                hits.append(f"{path.relative_to(SRC)}:{node.lineno} {node.value!r}")
    assert hits == [], hits


def test_imports_point_down():
    upward = []
    for path, parts in _modules():
        here = _top(parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            depth = len(parts) - 1          # folders between the file and the package root
            if node.level <= depth:
                continue                    # a sibling inside the same package
            target = (node.module or "").split(".")[0] or None
            targets = [target] if target else [a.name for a in node.names]
            for t in targets:
                if t in RANK and t != here and RANK[t] > RANK[here]:
                    upward.append(f"{path.relative_to(SRC)} imports {t}")
    assert upward == [], upward


def test_every_module_has_a_rank():
    missing = {_top(parts) for _, parts in _modules()} - set(RANK) - {"__init__"}
    assert missing == set(), f"add {missing} to RANK and docs/ARCHITECTURE.md"
