"""CA107: gradient or metric measurements taken with the model in train mode (Dropout, BatchNorm).

A mixin of `checker.Checker`: its methods read the checker's state (`facts`, scopes, `_report`).
The rule in full is in the package's docstring (`creditaudit.lint`)."""
from __future__ import annotations

import ast
import re

from .syntax import _last_name, _mode_call, _position, _walk_scope

_METRIC_NAME = re.compile(r"cosine|gamma|alignment|diagnos|evaluat|(?:^|_)eval(?:_|$)",
                          re.IGNORECASE)
_TRAINING_NAME = re.compile(r"train|fit|step|update", re.IGNORECASE)
_MODEL_NAME = re.compile(r"model|net", re.IGNORECASE)


class TrainModeCheck:
    """CA107: the methods `Checker` calls at each node."""

    # -- CA107

    def _check_train_mode(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if not self.facts.stochastic_layers or not self._is_measurement(fn):
            return
        modes = sorted(((n, m) for n in _walk_scope(fn) if (m := _mode_call(n))),
                       key=lambda nm: _position(nm[0]))
        why = ("Dropout/BatchNorm make the forward pass stochastic and batch-coupled in train "
               "mode, so the measured gradients are not the model's")
        if modes and modes[0][1] == "train":
            call = modes[0][0]
            self._report(call, "CA107",
                         f"`{self._src(call)}` in measurement function `{fn.name}` while this file "
                         f"uses Dropout/BatchNorm: {why}",
                         f"call {self._src(call.func.value)}.eval() before measuring (and restore "
                         "the previous mode afterwards)")
        elif not modes and self._refers_to_model(fn) and not self._caller_sets_eval(fn.name):
            self._report(fn, "CA107",
                         f"measurement function `{fn.name}` never puts the model in eval mode "
                         f"and this file uses Dropout/BatchNorm: {why}",
                         "call model.eval() at its start (and restore model.train(was_training) "
                         "afterwards)")

    def _is_measurement(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        if _METRIC_NAME.search(fn.name):
            return True
        if _TRAINING_NAME.search(fn.name):
            return False  # a training step may call autograd.grad in train mode on purpose
        return any(isinstance(n, ast.Call) and self._name(n.func) == "torch.autograd.grad"
                   for n in _walk_scope(fn))

    def _refers_to_model(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        for node in _walk_scope(fn):
            name = node.id if isinstance(node, ast.Name) else (
                node.arg if isinstance(node, ast.arg) else
                node.attr if isinstance(node, ast.Attribute) else None)
            if name and _MODEL_NAME.search(name):
                return True
        # A method of an nn.Module subclass measures `self`.
        return bool(self._classes) and any((_last_name(b) or "").endswith("Module")
                                           for b in self._classes[-1].bases)

    def _caller_sets_eval(self, name: str) -> bool:
        """Some function in the file calls `.eval()` before it calls `name(...)`."""
        for scope in self.facts.functions:
            nodes = list(_walk_scope(scope))
            calls = [_position(n) for n in nodes
                     if isinstance(n, ast.Call) and _last_name(n.func) == name]
            evals = [_position(n) for n in nodes if _mode_call(n) == "eval"]
            if calls and evals and min(evals) < max(calls):
                return True
        return False
