"""CA104: float16 around gradient measurements.

A mixin of `checker.Checker`: its methods read the checker's state (`facts`, scopes, `_report`).
The rule in full is in the package's docstring (`creditaudit.lint`)."""
from __future__ import annotations

import ast

from .syntax import _arg, _keyword, _last_name, _walk_scope

_AUTOCAST = {"torch.autocast", "torch.amp.autocast", "torch.amp.autocast_mode.autocast"}
_CUDA_AUTOCAST = {"torch.cuda.amp.autocast", "torch.cuda.amp.autocast_mode.autocast"}
_FP16 = {"torch.float16", "torch.half"}
_GRAD_FUNCS = {"torch.autograd.grad", "torch.autograd.backward", "torch.func.grad",
               "torch.func.vjp", "torch.autograd.functional.vjp"}


class PrecisionCheck:
    """CA104: the methods `Checker` calls at each node."""

    # -- CA104

    def _is_fp16(self, node: ast.AST | None) -> bool:
        name = self._name(node) if node is not None else None
        return name in _FP16 or bool(name and name.endswith("HalfTensor")) \
            or (isinstance(node, ast.Constant) and node.value in ("torch.HalfTensor", "float16"))

    def _fp16_site(self, node: ast.Call) -> str | None:
        """What makes this call run in float16, or None."""
        name = self._name(node.func)
        if name in _AUTOCAST or name in _CUDA_AUTOCAST:
            enabled = _keyword(node, "enabled")
            if isinstance(enabled, ast.Constant) and enabled.value is False:
                return None
            if name in _CUDA_AUTOCAST:  # autocast(enabled=True, dtype=torch.float16, ...)
                dtype = _arg(node, 1, "dtype")
                return f"{name}()" if dtype is None or self._is_fp16(dtype) else None
            dtype = _arg(node, 1, "dtype")
            if dtype is not None:
                return "autocast(dtype=float16)" if self._is_fp16(dtype) else None
            device = _arg(node, 0, "device_type")
            if isinstance(device, ast.Constant) and isinstance(device.value, str) \
                    and device.value.startswith("cuda"):
                return 'autocast("cuda") (float16 by default)'
            return None
        if name == "torch.set_default_dtype" and node.args and self._is_fp16(node.args[0]):
            return "torch.set_default_dtype(float16)"
        if isinstance(node.func, ast.Attribute) and not self._is_module(node.func.value):
            if node.func.attr == "half" and not node.args and not node.keywords:
                return ".half()"
            values = [*node.args, *(k.value for k in node.keywords)]
            if node.func.attr in ("to", "type") and any(map(self._is_fp16, values)):
                return f".{node.func.attr}(float16)"
        return None

    def _computes_gradients(self, scope: ast.AST) -> bool:
        if id(scope) not in self._grad_cache:
            self._grad_cache[id(scope)] = any(self._is_gradient_op(n) for n in _walk_scope(scope))
        return self._grad_cache[id(scope)]

    def _is_gradient_op(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Call):
            if self._name(node.func) in _GRAD_FUNCS:
                return True
            if isinstance(node.func, ast.Attribute) and node.func.attr == "backward":
                receiver = node.func.value  # loss scaling keeps fp16 gradients representable
                return not (isinstance(receiver, ast.Call) and _last_name(receiver.func) == "scale")
            return False
        return isinstance(node, ast.Attribute) and node.attr == "grad" \
            and isinstance(node.ctx, ast.Load)

    def _check_fp16(self, node: ast.Call) -> None:
        site = self._fp16_site(node)
        if site is None or not self._computes_gradients(self._scopes[-1]):
            return
        self._report(node, "CA104",
                     f"{site} where gradients are computed: BP gradients near 1e-9 underflow "
                     "float16 (smallest subnormal ≈ 6e-8) to exact zeros, so their norms and Γ "
                     "are wrong",
                     "measure gradients in float32/float64 (no fp16 autocast or .half() around "
                     "them); bfloat16 autocast is acceptable")
