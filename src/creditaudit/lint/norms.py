"""CA101: a norm's dim passed positionally (`x.norm(-1)` is the p = −1 "norm" of the whole tensor).

A mixin of `checker.Checker`: its methods read the checker's state (`facts`, scopes, `_report`).
The rule in full is in the package's docstring (`creditaudit.lint`)."""
from __future__ import annotations

import ast

from .syntax import _number

_TORCH_NORM_FUNCS = {"torch.norm", "torch.functional.norm", "torch.linalg.norm",
                     "torch.linalg.vector_norm"}


class NormCheck:
    """CA101: the methods `Checker` calls at each node."""

    # -- CA101

    def _check_norm(self, node: ast.Call) -> None:
        name = self._name(node.func)
        if name in _TORCH_NORM_FUNCS:
            function_form = True  # torch.norm(input, p, dim): p/ord is the 2nd positional
        elif isinstance(node.func, ast.Attribute) and node.func.attr == "norm" \
                and not self._is_module(node.func.value):
            function_form = False  # x.norm(p, dim)
        else:
            return
        if any(isinstance(a, ast.Starred) for a in node.args):
            return
        args = node.args[1:] if function_form else node.args
        p = _number(args[0]) if args else None
        if p is not None and p < 0:
            self._report(node, "CA101",
                         f"norm with {self._src(args[0])} as its positional p/ord: this is the "
                         f"p={self._src(args[0])} 'norm' of the whole tensor (one scalar), not a "
                         "per-sample L2 norm along dim -1",
                         "pass dim by keyword: x.norm(dim=-1) (or "
                         "torch.linalg.vector_norm(x, dim=-1))")
        elif len(args) >= 2 and (function_form or self._looks_like_dim(args[1])):
            self._report(node, "CA101",
                         "norm dim passed positionally: Tensor.norm, torch.norm and "
                         "torch.linalg.norm order their arguments differently, so a positional dim "
                         "is easily read as p/ord",
                         "pass it by keyword: x.norm(p=2, dim=-1) (or "
                         "torch.linalg.vector_norm(x, ord=2, dim=-1))")

    @staticmethod
    def _looks_like_dim(node: ast.AST) -> bool:
        if isinstance(node, (ast.Tuple, ast.List)):
            return bool(node.elts) and all(NormCheck._looks_like_dim(e) for e in node.elts)
        if isinstance(node, ast.Name):
            return "dim" in node.id.lower() or "axis" in node.id.lower()
        value = _number(node)
        return value is not None and value == int(value)
