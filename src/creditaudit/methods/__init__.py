"""Credit-assignment methods, by name. Adding one: a new file with a `Method` subclass, and its class
in `_BUILT_IN` below; every list of methods elsewhere (presets, --help, validation) comes from here."""
from __future__ import annotations

import importlib
import math
from typing import Any

from ..errors import CreditAuditError
from .base import Method, MethodSettings
from .bp import BP
from .bridges import CreditBridge, StateBridge
from .dfa import DFA, DFAPenalty
from .drtp import DRTP
from .ep import EP
from .fa import FA
from .forward_forward import ForwardForward
from .forward_gradient import ForwardGradientA, ForwardGradientW, LocalGreedyForwardGradientA
from .kolen_pollack import KolenPollack
from .local import LocalMethod, output_error, rms_normalise
from .local_losses import LocalLosses
from .node_perturbation import NodePerturbation
from .pepita import PEPITA
from .predictive_coding import PredictiveCoding
from .recipe import CHOICES as RECIPE_CHOICES
from .recipe import SHARED as SHARED_RECIPE
from .recipe import Recipe
from .signsym import SignSymmetry
from .target_propagation import DTP, DDTPLinear

# the paper's seven first (`Method.paper`), then the zoo (issue 24)
_BUILT_IN: tuple[type[Method], ...] = (BP, FA, DFA, DFAPenalty, EP, StateBridge, CreditBridge,
                                       SignSymmetry, KolenPollack, DRTP, NodePerturbation,
                                       LocalLosses, PEPITA, PredictiveCoding, ForwardGradientW,
                                       ForwardGradientA, LocalGreedyForwardGradientA, ForwardForward,
                                       DTP, DDTPLinear)
METHODS: dict[str, type[Method]] = {cls.name: cls for cls in _BUILT_IN}
REFERENCE_METHOD = BP.name        # the method every other is compared with (Γ = 1 by construction)


def method_class(name: str) -> type[Method]:
    """The class of a built-in method, or of a user's method given as PKG.MODULE:CLASS (imported
    from the user's own package, which must be importable, e.g. on PYTHONPATH)."""
    if name in METHODS:
        return METHODS[name]
    if isinstance(name, str) and ":" in name:
        return _user_method(name)
    raise CreditAuditError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}, "
                           "or give your own as PKG.MODULE:CLASS")


def resolve_method_name(name: str) -> str:
    """`name` checked and in its one spelling: a built-in's name for any spelling of a built-in
    class (`bp`, `creditaudit.methods.bp:BP` and `creditaudit.methods:BP` are all "bp"), else
    MODULE:CLASS of the module that defines the class (a class re-exported by a package has one
    name), so one rule is one method in an audit's pooling, its run keys and its report."""
    cls = method_class(name)
    for builtin, known in METHODS.items():
        if known is cls:
            return builtin
    defined = f"{cls.__module__}:{cls.__qualname__}"
    try:
        return defined if method_class(defined) is cls else name
    except CreditAuditError:          # defined where it cannot be imported by name (e.g. __main__)
        return name


def _user_method(spec: str) -> type[Method]:
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise CreditAuditError(f"method {spec!r} names no {'module' if not module_name else 'class'}; give "
                               "PKG.MODULE:CLASS, e.g. --method myrules.local:MyRule")
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as err:       # the module is found, but is not valid Python: PYTHONPATH is not it
        raise CreditAuditError(f"{module_name!r} for method {spec!r} is not valid Python ({err.msg}, "
                               f"{err.filename}:{err.lineno}); fix the file") from None
    except Exception as err:  # noqa: BLE001 — any import failure of user code is the user's to fix
        raise CreditAuditError(f"cannot import {module_name!r} for method {spec!r} "
                               f"({type(err).__name__}: {err}); put its package on PYTHONPATH") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise CreditAuditError(f"module {module_name!r} ({getattr(module, '__file__', '?')}) has no {class_name!r} "
                               f"for method {spec!r}; check the class name after the colon")
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise CreditAuditError(f"{spec!r} is not a creditaudit Method subclass; subclass "
                               "creditaudit.methods.Method (docs/ADD_A_METHOD.md)")
    if not cls.name or not isinstance(cls.name, str):
        raise CreditAuditError(f"{spec!r}: set a class attribute name = \"...\" (a string) on the method")
    _check_declarations(cls, spec)
    return cls


def method_origin(spec: str) -> dict[str, Any]:
    """Where a user's method PKG.MODULE:CLASS was imported from: its module's file and the
    sys.path entry that holds it (None for a module without a file), recorded in its run folders
    so a later command can say how to make the rule importable again."""
    import sys
    from pathlib import Path
    module_name = spec.partition(":")[0]
    method_class(spec)                                # imported (and checked) now
    file = getattr(sys.modules[module_name], "__file__", None)
    entry = None
    if file is not None:
        entry = Path(file).resolve()
        if entry.name == "__init__.py":
            entry = entry.parent
        for _ in module_name.split("."):
            entry = entry.parent                      # mypkg/rules.py → the folder holding mypkg
    return {"method": spec, "module": module_name, "file": file,
            "sys_path_entry": None if entry is None else str(entry)}


def not_importable(spec: str, origin: dict | None) -> str:
    """The one line for a run folder whose rule cannot be imported now (`origin`: what its run
    recorded, see `method_origin`)."""
    where = (origin or {}).get("sys_path_entry")
    if not where:
        return (f"rule {spec} is not importable; put the package it came from on PYTHONPATH "
                "or pip install it")
    return f"rule {spec} is not importable; run with PYTHONPATH={where} or pip install it"


def _check_declarations(cls: type[Method], spec: str) -> None:
    """A user's method declares its knobs as the built-in ones do (methods/base.py): each option a
    number, bool or string; each range an inclusive (low, high) pair of numbers of a declared
    option; each help line a string. Anything else is one line naming the attribute, here, rather
    than a TypeError deep in option validation."""
    fix = "(docs/ADD_A_METHOD.md)"
    defaults, ranges, helps = cls.option_defaults, cls.option_ranges, cls.option_help
    if not isinstance(defaults, dict) or not all(
            isinstance(k, str) and isinstance(v, (bool, int, float, str)) for k, v in defaults.items()):
        raise CreditAuditError(f"{spec!r}: option_defaults must be a dict of option name → default "
                               f"number, bool or string, got {defaults!r} {fix}")
    if not isinstance(ranges, dict):
        raise CreditAuditError(f"{spec!r}: option_ranges must be a dict of option name → (low, high), "
                               f"got {ranges!r} {fix}")
    for key, bounds in ranges.items():
        if key not in defaults:
            raise CreditAuditError(f"{spec!r}: option_ranges names {key!r}, which is not in "
                                   f"option_defaults ({', '.join(map(str, defaults)) or 'none'}) {fix}")
        if not (isinstance(bounds, (tuple, list)) and len(bounds) == 2 and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and not math.isnan(b)
                for b in bounds) and bounds[0] <= bounds[1]):
            raise CreditAuditError(f"{spec!r}: option_ranges[{key!r}] must be an inclusive (low, high) "
                                   f"pair of numbers with low ≤ high (math.inf for no bound), got "
                                   f"{bounds!r} {fix}")
        if isinstance(defaults[key], (bool, str)):
            raise CreditAuditError(f"{spec!r}: option_ranges[{key!r}] bounds a "
                                   f"{type(defaults[key]).__name__} option; ranges are for numbers {fix}")
    if not isinstance(helps, dict) or not all(isinstance(v, str) for v in helps.values()):
        raise CreditAuditError(f"{spec!r}: option_help must be a dict of option name → one line of "
                               f"help, got {helps!r} {fix}")
    # a str, dict or property in place of a Recipe would fail deep in the run config
    # (config._resolve_recipe) or the optimiser; the class attribute is read as it is declared
    recipe = cls.recipe            # a property reads as the property object on the class
    if not isinstance(recipe, Recipe):
        raise CreditAuditError(f"{spec!r}: recipe must be a class attribute recipe = Recipe(...) "
                               f"(creditaudit.methods.Recipe), got a {type(recipe).__name__} "
                               f"({recipe!r:.60}); or leave it out for the shared AdamW recipe "
                               "(docs/WRITING_A_RULE.md)")


def methods_with_option(option: str) -> list[str]:
    """The methods that declare `option` (e.g. the penalty λ, "lam")."""
    return [name for name, cls in METHODS.items() if option in cls.option_defaults]


def sweep_defaults() -> dict[str, tuple[str, tuple[Any, ...]]]:
    """method → (option, values) for the methods that declare a sweep (`creditaudit penalty-sweep`)."""
    return {name: next(iter(cls.sweep.items())) for name, cls in METHODS.items() if cls.sweep}


__all__ = ["METHODS", "RECIPE_CHOICES", "REFERENCE_METHOD", "SHARED_RECIPE", "LocalMethod", "Method",
           "MethodSettings", "Recipe", "method_class",
           "methods_with_option", "output_error", "resolve_method_name", "rms_normalise",
           "sweep_defaults"]
