"""CA106: random feedback matrices drawn without a seeded generator, or never saved with the
checkpoint.

A mixin of `checker.Checker`: its methods read the checker's state (`facts`, scopes, `_report`).
The rule in full is in the package's docstring (`creditaudit.lint`)."""
from __future__ import annotations

import ast
import re

from .syntax import (_NP_FACTORIES, _arg, _is_feedback_key, _keyword, _last_name,
                     _makes_parameter, _np_factory_seeded, _position, _target_key)

_TORCH_DRAWS = {"torch.randn", "torch.rand", "torch.randint", "torch.randn_like",
                "torch.rand_like", "torch.randint_like", "torch.normal", "torch.bernoulli"}
_INPLACE_DRAWS = {"normal_", "uniform_", "bernoulli_", "random_", "exponential_", "cauchy_",
                  "log_normal_", "geometric_"}
_INIT_DRAWS = {"normal_", "uniform_", "xavier_normal_", "xavier_uniform_", "kaiming_normal_",
               "kaiming_uniform_", "orthogonal_", "trunc_normal_", "sparse_"}
_NP_NOT_DRAWS = {"seed", "get_state", "set_state", "default_rng", "RandomState", "Generator",
                 "SeedSequence", "PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64", "BitGenerator"}
_NP_DRAW_METHODS = {"standard_normal", "normal", "uniform", "random", "integers", "randn", "rand",
                    "choice", "laplace", "binomial", "multivariate_normal"}


class FeedbackCheck:
    """CA106: the methods `Checker` calls at each node."""

    # -- CA106

    def _draw_seeded(self, call: ast.Call) -> bool | None:
        """None when `call` draws no random numbers, else whether it uses a seeded generator."""
        name = self._name(call.func) or ""
        generator = _keyword(call, "generator")
        has_generator = generator is not None \
            and not (isinstance(generator, ast.Constant) and generator.value is None)
        if name in _TORCH_DRAWS:
            return has_generator
        if name.startswith("torch.nn.init."):
            return has_generator if name.rsplit(".", 1)[1] in _INIT_DRAWS else None
        if name.startswith("numpy.random."):  # the legacy global RandomState
            return None if name.rsplit(".", 1)[1] in _NP_NOT_DRAWS else False
        if not isinstance(call.func, ast.Attribute) or self._is_module(call.func.value):
            return None
        receiver, method = call.func.value, call.func.attr
        if method in _INPLACE_DRAWS:
            return has_generator
        if isinstance(receiver, ast.Call) and self._name(receiver.func) in _NP_FACTORIES:
            return _np_factory_seeded(receiver)
        if isinstance(receiver, ast.Name) and receiver.id in self.facts.rng_names:
            return self.facts.rng_names[receiver.id]
        if isinstance(receiver, ast.Name) and method in _NP_DRAW_METHODS \
                and re.search(r"rng|gen", receiver.id, re.IGNORECASE):
            return True  # a generator passed in: assume the caller seeded it
        return None

    def _note_draws(self, key: str, value: ast.AST, saved: bool) -> None:
        saved = saved or _makes_parameter(value)
        for node in ast.walk(value):
            if isinstance(node, ast.Call):
                seeded = self._draw_seeded(node)
                if seeded is not None:
                    self._draws.append((key, node, seeded, saved))

    def _note_draw_statement(self, call: ast.Call) -> None:
        """Draws made by a statement call: `Bs.append(...)`, `B.normal_()`, `nn.init.normal_(B)`,
        `self.register_buffer("B", ...)`."""
        called = _last_name(call.func)
        if called == "register_buffer":
            name = _arg(call, 0, "name")
            key = name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) \
                else None
            values = [v for v in (_arg(call, 1, "tensor"),) if v is not None]
            keys = [key] + [_target_key(v) for v in values]
            key = next((k for k in keys if _is_feedback_key(k)), None)
            if key is not None:
                for value in values:
                    self._note_draws(key, value, saved=True)
            return
        if not isinstance(call.func, ast.Attribute):
            return
        receiver_key = _target_key(call.func.value)
        if called in ("append", "extend", "insert") and _is_feedback_key(receiver_key):
            for value in call.args:
                self._note_draws(receiver_key, value, saved=False)
        elif self._draw_seeded(call) is not None:
            target = call.func.value if not self._is_module(call.func.value) \
                else (call.args[0] if call.args else None)
            key = _target_key(target) if target is not None else None
            if _is_feedback_key(key):
                self._draws.append((key, call, bool(self._draw_seeded(call)), False))

    def _report_feedback(self) -> None:
        unsaved_reported = set()
        for key, call, seeded, saved in sorted(self._draws, key=lambda d: _position(d[1])):
            if not seeded:
                self._report(call, "CA106",
                             f"feedback matrix `{key}` drawn without a seeded generator: it "
                             "depends on every earlier draw from the global RNG, so a re-run or a "
                             "resume gets a different B and the result is not reproducible",
                             "draw it from its own generator: g = "
                             "torch.Generator().manual_seed(seed); torch.randn(shape, generator=g) "
                             "(numpy: np.random.default_rng(seed))")
            if not saved and key not in self.facts.saved_keys and key not in unsaved_reported:
                unsaved_reported.add(key)
                self._report(call, "CA106",
                             f"feedback matrix `{key}` is never saved with the checkpoint (not a "
                             "buffer or parameter, never passed to torch.save/save_file/np.save): "
                             "a reloaded model gets different feedback than the one it was "
                             "trained with",
                             f'register it: self.register_buffer("{key}", {key}), or put it in '
                             "the dict you torch.save")
