"""The one pass over a parsed file: `Checker` visits each node once and calls each check's method
there; each check lives in its own module as a mixin (norms, cosine, precision, loading, feedback,
train_mode)."""
from __future__ import annotations

import ast

from .cosine import CosineCheck
from .feedback import FeedbackCheck
from .findings import Finding
from .loading import LoadingCheck
from .norms import NormCheck
from .precision import PrecisionCheck
from .syntax import (_assigned_pairs, _divisor_names, _dotted, _is_feedback_key, _norm_names, _root_name,
                     _target_key, collect_facts)
from .train_mode import TrainModeCheck


class Checker(NormCheck, CosineCheck, PrecisionCheck, LoadingCheck, FeedbackCheck, TrainModeCheck,
              ast.NodeVisitor):
    """One pass over a parsed file; each `_check_*` method (from its check's mixin) is one rule at
    one kind of node."""

    def __init__(self, path: str, source: str, tree: ast.Module):
        self.path = path
        self.lines = source.splitlines()
        self.facts = collect_facts(tree)
        self.findings: list[Finding] = []
        self._scopes: list[ast.AST] = [tree]  # innermost function last (module at the bottom)
        self._classes: list[ast.ClassDef] = []
        self._grad_cache: dict[int, bool] = {}
        self._name_cache: dict[tuple[str, int], set[str]] = {}
        self._reported_clamps: set[int] = set()
        self._draws: list[tuple[str, ast.Call, bool, bool]] = []  # key, call, seeded, saved

    # -- plumbing

    def _report(self, node: ast.AST, code: str, message: str, fix: str) -> None:
        line, col = self._where(node)
        self.findings.append(Finding(self.path, line, col, code, message, fix))

    def _where(self, node: ast.AST) -> tuple[int, int]:
        """1-based (line, column); a method call points at its method name, so a finding in a long
        chain lands on the right line. ast columns count UTF-8 bytes: convert them to characters."""
        line, byte_col = node.lineno, node.col_offset
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.end_lineno is not None and node.func.end_col_offset is not None:
            line = node.func.end_lineno
            byte_col = node.func.end_col_offset - len(node.func.attr.encode())
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return line, len(text.encode()[:byte_col].decode("utf-8", "ignore")) + 1

    def _name(self, node: ast.AST) -> str | None:
        return _dotted(node, self.facts.aliases)

    def _is_module(self, node: ast.AST) -> bool:
        """`torch.linalg` or `np`: the call is a module function, not a tensor method."""
        return _root_name(node) in self.facts.aliases

    def _scope_names(self, kind: str) -> set[str]:
        """The innermost scope's norm-derived ("norm") or divisor ("divisor") names, cached."""
        scope = self._scopes[-1]
        if (kind, id(scope)) not in self._name_cache:
            make = _norm_names if kind == "norm" else _divisor_names
            self._name_cache[(kind, id(scope))] = make(scope)
        return self._name_cache[(kind, id(scope))]

    def _src(self, node: ast.AST) -> str:
        return ast.unparse(node)

    def finish(self) -> list[Finding]:
        self._report_feedback()
        return self.findings

    # -- traversal

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._check_train_mode(node)
        self._scopes.append(node)
        self.generic_visit(node)
        self._scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._classes.append(node)
        self.generic_visit(node)
        self._classes.pop()

    def visit_Call(self, node: ast.Call) -> None:
        self._check_norm(node)
        self._check_cosine_similarity(node)
        self._check_fp16(node)
        self._check_torch_load(node)
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if isinstance(node.op, ast.Div):
            self._check_divisor(node.right)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.op, ast.Div):
            self._check_divisor(node.value)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign | ast.AnnAssign) -> None:
        for target, value in _assigned_pairs(node):
            if isinstance(target, ast.Name) and target.id in self._scope_names("divisor"):
                self._check_divisor(value)  # `den = (...).clamp(min=1e-8)` then `dot / den`
            key = _target_key(target)
            if _is_feedback_key(key):
                self._note_draws(key, value, saved=False)
        self.generic_visit(node)

    visit_AnnAssign = visit_Assign

    def visit_Expr(self, node: ast.Expr) -> None:
        call = node.value
        if isinstance(call, ast.Call):
            self._check_inplace_clamp(call)
            self._note_draw_statement(call)
        self.generic_visit(node)
