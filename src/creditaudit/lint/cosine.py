"""CA102 and CA103: a cosine whose denominator is clamped (`cosine_similarity`'s eps = 1e-8, or a
literal floor ≥ 1e-12), which shrinks Γ when ‖g‖ is near the floor.

A mixin of `checker.Checker`: its methods read the checker's state (`facts`, scopes, `_report`).
The rule in full is in the package's docstring (`creditaudit.lint`)."""
from __future__ import annotations

import ast

from .syntax import _arg, _has_norm, _keyword, _number

# The smallest epsilon that counts as a harmful clamp: Γ's norms can be ~1e-10, and a floor at
# 1e-12 already distorts their product (~1e-20); a floor at 1e-30 does not.
EPS_THRESHOLD = 1e-12
# A floor of 1 or more on a norm is a clipping threshold (`max(1.0, norm)`), not an epsilon.
CLIP_THRESHOLD = 1.0
_COSINE_FUNCS = {"torch.nn.functional.cosine_similarity", "torch.cosine_similarity",
                 "torch.nn.CosineSimilarity", "torch.nn.modules.CosineSimilarity",
                 "torch.nn.modules.distance.CosineSimilarity"}
_CLAMP_METHODS = {"clamp", "clamp_", "clamp_min", "clamp_min_", "clip", "clip_"}
_CLAMP_FUNCS = {"torch.clamp", "torch.clip", "torch.clamp_min"}
_MAX_FUNCS = {"max", "torch.maximum", "torch.fmax", "numpy.maximum", "numpy.fmax", "math.fmax"}


class CosineCheck:
    """CA102, CA103: the methods `Checker` calls at each node."""

    # -- CA102

    def _check_cosine_similarity(self, node: ast.Call) -> None:
        if self._name(node.func) not in _COSINE_FUNCS:
            return
        eps = _number(_keyword(node, "eps"), self.facts.constants)
        if eps is not None and eps < EPS_THRESHOLD:
            return  # an explicit tiny eps keeps small gradients' cosines intact
        self._report(node, "CA102",
                     "cosine_similarity clamps its denominator at eps=1e-8, so where ‖g‖ ~ 1e-10 "
                     "(vanishing BP gradients) the gradient cosine Γ shrinks ~100× and reads as "
                     "misalignment",
                     "compute (a*g).sum(-1) / (a.norm(dim=-1) * g.norm(dim=-1)) without a clamp, "
                     "and mark Γ undefined (NaN) where a norm is 0")

    # -- CA103

    def _eps(self, node: ast.AST | None) -> float | None:
        """A literal (or constant) epsilon, also when wrapped as torch.tensor(1e-8)."""
        if isinstance(node, ast.Call) and node.args \
                and self._name(node.func) in ("torch.tensor", "torch.as_tensor"):
            node = node.args[0]
        return _number(node, self.facts.constants)

    def _clamp(self, node: ast.AST) -> tuple[list[ast.AST], float] | None:
        """(floored operands, eps) when `node` floors an expression at a numeric eps, else None."""
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            for eps_side, other in ((node.right, node.left), (node.left, node.right)):
                eps = self._eps(eps_side)
                if eps is not None:
                    return [other], eps
            return None
        if not isinstance(node, ast.Call):
            return None
        name = self._name(node.func)
        if name in _CLAMP_FUNCS and node.args:
            eps = self._eps(_arg(node, 1, "min"))
            return ([node.args[0]], eps) if eps is not None else None
        if name in _MAX_FUNCS:
            eps_values = [e for e in map(self._eps, node.args) if e is not None]
            others = [a for a in node.args if self._eps(a) is None]
            return (others, max(eps_values)) if eps_values and others else None
        if isinstance(node.func, ast.Attribute) and node.func.attr in _CLAMP_METHODS \
                and not self._is_module(node.func.value):
            eps = self._eps(_arg(node, 0, "min"))
            return ([node.func.value], eps) if eps is not None else None
        return None

    def _harmful_clamp(self, node: ast.AST) -> bool:
        parts = self._clamp(node)
        return parts is not None and EPS_THRESHOLD <= parts[1] < CLIP_THRESHOLD \
            and any(_has_norm(o, self._scope_names("norm")) for o in parts[0])

    def _check_divisor(self, divisor: ast.AST) -> None:
        # One finding per divisor: the outermost harmful clamp in it (ast.walk is breadth-first).
        for node in ast.walk(divisor):
            if self._harmful_clamp(node):
                if id(node) not in self._reported_clamps:
                    self._reported_clamps.add(id(node))
                    self._report_clamp(node)
                return

    def _check_inplace_clamp(self, call: ast.Call) -> None:
        # `den.clamp_(min=1e-8)` on a norm-derived divisor, as a statement of its own.
        if isinstance(call.func, ast.Attribute) and call.func.attr.endswith("_") \
                and isinstance(call.func.value, ast.Name) \
                and call.func.value.id in self._scope_names("divisor"):
            self._check_divisor(call)

    def _report_clamp(self, node: ast.AST) -> None:
        operands, eps = self._clamp(node)
        self._report(node, "CA103",
                     f"a norm in a denominator floored at eps={eps:g}: gradient norms can be "
                     "~1e-10, so the floor replaces their product and shrinks the cosine Γ "
                     "toward 0",
                     "divide by the unclamped product a.norm(dim=-1) * g.norm(dim=-1) and mark Γ "
                     "undefined (NaN) where it is 0 (or floor at a tiny value such as 1e-30)")
