"""What every check reads of a parsed file, as small pure functions over the `ast`: names resolved
through the file's imports, numeric constants, norm-derived names, saved keys, seeded generators,
and the file-wide `Facts` collected once before the visit."""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Iterator

# Read these unimported names as the modules researchers conventionally bind them to.
_DEFAULT_ALIASES = {"torch": "torch", "F": "torch.nn.functional", "nn": "torch.nn", "np": "numpy",
                    "numpy": "numpy", "math": "math"}
# Scopes that own their body: a function's gradient/mode facts are not those of what it defines.
_OWN_SCOPE = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_NORM_NAMES = {"norm", "vector_norm"}
_NP_FACTORIES = {"numpy.random.default_rng", "numpy.random.RandomState", "numpy.random.Generator"}
_SAVE_CALLS = {"save", "save_file", "save_model", "save_pretrained", "savez", "savez_compressed",
               "dump"}
_PARAMETER_CALLS = {"Parameter", "ParameterList", "ParameterDict"}
_FEEDBACK_WORD = re.compile(r"feedback", re.IGNORECASE)
_FB_WORD = re.compile(r"fbs?\d*")
_B_NAME = re.compile(r"B(?:s|\d+)?(?:_\w*)?")
_STOCHASTIC_LAYER = re.compile(r"torch\.nn\.(?:modules\.[\w.]*)?\w*(?:Dropout|BatchNorm)\w*"
                               r"|torch\.nn\.functional\.(?:\w*dropout\w*|batch_norm)")


def _import_aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted name it is bound to by the file's imports (anywhere in the file)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
                else:  # `import torch.nn.functional` binds only `torch`
                    root = a.name.split(".")[0]
                    aliases[root] = root
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if a.name != "*":
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """`F.cosine_similarity` -> "torch.nn.functional.cosine_similarity"; None unless a name chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _last_name(node: ast.AST) -> str | None:
    """The called name: `torch.save` -> "save", `save_file` -> "save_file"."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def _target_key(node: ast.AST) -> str | None:
    """The name an assignment target is known by: `self.B[l]` -> "B", `Bs` -> "Bs"."""
    if isinstance(node, (ast.Subscript, ast.Starred)):
        return _target_key(node.value)
    if isinstance(node, ast.Attribute):  # `self.B.data.normal_()` initialises `B`
        return _target_key(node.value) if node.attr == "data" else node.attr
    return node.id if isinstance(node, ast.Name) else None


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _arg(call: ast.Call, index: int, name: str) -> ast.AST | None:
    """An argument given by keyword `name` or at positional `index`."""
    by_name = _keyword(call, name)
    if by_name is not None:
        return by_name
    return call.args[index] if len(call.args) > index else None


def _number(node: ast.AST | None, constants: dict[str, float] | None = None) -> float | None:
    """A numeric literal (with sign), or a name bound to one in `constants`; else None."""
    sign = 1.0
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        sign = -1.0 if isinstance(node.op, ast.USub) else 1.0
        node = node.operand
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return sign * float(node.value)
    if constants and isinstance(node, ast.Name) and node.id in constants:
        return sign * constants[node.id]
    return None


def _assigned_pairs(node: ast.AST) -> list[tuple[ast.AST, ast.AST]]:
    """(target, value) pairs of an assignment; `a, b = x, y` pairs element-wise."""
    if isinstance(node, ast.Assign):
        targets, value = node.targets, node.value
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        targets, value = [node.target], node.value
    else:
        return []
    pairs = []
    for target in targets:
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
                and len(target.elts) == len(value.elts):
            pairs.extend(zip(target.elts, value.elts))
        elif isinstance(target, (ast.Tuple, ast.List)):
            pairs.extend((elt, value) for elt in target.elts)
        else:
            pairs.append((target, value))
    return pairs


def _walk_scope(scope: ast.AST) -> Iterator[ast.AST]:
    """Nodes of a function (or module) body, not descending into functions/classes it defines."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, _OWN_SCOPE):
            todo.extend(ast.iter_child_nodes(node))


def _position(node: ast.AST) -> tuple[int, int]:
    return node.lineno, node.col_offset


def _numeric_constants(tree: ast.AST) -> dict[str, float]:
    """Names bound to exactly one numeric literal in the file (`EPS = 1e-8`, `def f(eps=1e-8)`)."""
    seen: dict[str, set] = {}

    def note(name: str, value: ast.AST) -> None:
        seen.setdefault(name, set()).add(_number(value))  # None marks "bound to something else"

    for node in ast.walk(tree):
        for target, value in _assigned_pairs(node):
            if isinstance(target, ast.Name):
                note(target.id, value)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            positional = a.posonlyargs + a.args
            for arg, default in zip(positional[len(positional) - len(a.defaults):], a.defaults):
                note(arg.arg, default)
            for arg, default in zip(a.kwonlyargs, a.kw_defaults):
                if default is not None:
                    note(arg.arg, default)
    return {k: next(iter(v)) for k, v in seen.items() if len(v) == 1 and None not in v}


def _is_norm_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _last_name(node.func) in _NORM_NAMES


def _norm_names(scope: ast.AST) -> set[str]:
    """Names a function (or the module) assigns from a norm, directly or through other such
    names (`den = na * ng`). Per scope, so an `a = x.norm()` elsewhere does not taint `a`."""
    pairs = [(t.id, v) for node in _walk_scope(scope) for t, v in _assigned_pairs(node)
             if isinstance(t, ast.Name)]
    names: set[str] = set()
    changed = True
    while changed:  # a fixpoint over the file's assignments; each pass adds a name or stops
        changed = False
        for name, value in pairs:
            if name not in names and _has_norm(value, names):
                names.add(name)
                changed = True
    return names


def _has_norm(node: ast.AST, norm_names: set[str]) -> bool:
    return any(_is_norm_call(n) or (isinstance(n, ast.Name) and n.id in norm_names)
               for n in ast.walk(node))


def _divisor_names(scope: ast.AST) -> set[str]:
    """Names that appear in the right operand of a division in a function (or the module)."""
    names = set()
    for node in _walk_scope(scope):
        right = None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            right = node.right
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):
            right = node.value
        if right is not None:
            names.update(n.id for n in ast.walk(right) if isinstance(n, ast.Name))
    return names


def _refs(node: ast.AST) -> set[str]:
    """Every name, attribute and string constant mentioned inside `node`."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
    return out


def _makes_parameter(value: ast.AST) -> bool:
    """The value wraps nn.Parameter/ParameterList/ParameterDict: it lands in the state_dict."""
    return any(isinstance(n, ast.Call) and _last_name(n.func) in _PARAMETER_CALLS
               for n in ast.walk(value))


def _saved_keys(tree: ast.AST) -> set[str]:
    """Names that reach a checkpoint: see CA106 in the module docstring."""
    keys: set[str] = set()
    containers: set[str] = set()  # variables passed to a save call: what goes into them is saved
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            called = _last_name(node.func)
            args = [*node.args, *(k.value for k in node.keywords)]
            if called in _SAVE_CALLS:
                for arg in args:
                    keys |= _refs(arg)
                    if isinstance(arg, ast.Name):
                        containers.add(arg.id)
            elif called in ("register_buffer", "register_parameter"):
                for arg in args:
                    keys |= _refs(arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.name in ("state_dict", "get_extra_state", "_save_to_state_dict"):
            keys |= _refs(node)
        for target, value in _assigned_pairs(node):
            if _makes_parameter(value):
                keys.add(_target_key(target) or "")
    for node in ast.walk(tree):
        for target, value in _assigned_pairs(node):
            if _root_name(target) in containers:
                keys |= _refs(value) | _refs(target)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("update", "setdefault", "__setitem__") \
                and _root_name(node.func.value) in containers:
            keys |= _refs(node)
    return keys


def _np_factory_seeded(call: ast.Call) -> bool:
    seed = _arg(call, 0, "seed")
    return seed is not None and not (isinstance(seed, ast.Constant) and seed.value is None)


def _rng_names(tree: ast.AST, aliases: dict[str, str]) -> dict[str, bool]:
    """numpy Generator variables -> whether they were created with a seed."""
    out = {}
    for node in ast.walk(tree):
        for target, value in _assigned_pairs(node):
            if isinstance(target, ast.Name) and isinstance(value, ast.Call) \
                    and _dotted(value.func, aliases) in _NP_FACTORIES:
                out[target.id] = _np_factory_seeded(value)
    return out


def _uses_stochastic_layers(tree: ast.AST, aliases: dict[str, str]) -> bool:
    """Dropout or BatchNorm anywhere in the file (train vs eval mode then changes the forward)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = _dotted(node, aliases)
            if name and _STOCHASTIC_LAYER.fullmatch(name):
                return True
    return False


def _is_feedback_key(key: str | None) -> bool:
    if not key:
        return False
    return bool(_FEEDBACK_WORD.search(key) or _B_NAME.fullmatch(key)
                or any(_FB_WORD.fullmatch(word) for word in key.lower().split("_")))


def _mode_call(node: ast.AST) -> str | None:
    """"eval" for `.eval()`/`.train(False)`, "train" for `.train()`/`.train(True)`, "unknown" for
    `.train(mode)`; None for anything else (the builtin `eval(...)` is not a method call)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    if node.func.attr == "eval" and not node.args and not node.keywords:
        return "eval"
    if node.func.attr != "train" or len(node.args) + len(node.keywords) > 1:
        return None
    mode = _arg(node, 0, "mode")
    if mode is None:
        return "train"
    if isinstance(mode, ast.Constant) and isinstance(mode.value, bool):
        return "train" if mode.value else "eval"
    return "unknown"


@dataclass
class Facts:
    """What the rules need to know about the whole file before visiting it."""
    aliases: dict[str, str]
    constants: dict[str, float]
    saved_keys: set[str]
    rng_names: dict[str, bool]
    stochastic_layers: bool
    functions: list[ast.AST] = field(default_factory=list)


def collect_facts(tree: ast.Module) -> Facts:
    aliases = {**_DEFAULT_ALIASES, **_import_aliases(tree)}
    functions = [tree] + [n for n in ast.walk(tree)
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return Facts(aliases=aliases, constants=_numeric_constants(tree), saved_keys=_saved_keys(tree),
                  rng_names=_rng_names(tree, aliases),
                  stochastic_layers=_uses_stochastic_layers(tree, aliases), functions=functions)
