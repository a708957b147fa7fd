"""`creditaudit lint PATH...`: static checks of *your* training and evaluation code for the known
pitfalls of the gradient-alignment protocol.

Each file is read as UTF-8 text and parsed with `ast`; it is never imported or executed, so linting
an untrusted or broken script is safe. A file that cannot be read, decoded or parsed gives one
CA100 finding instead of a traceback.

Every rule is a heuristic over syntax, not over types or values: it cannot see through helper
functions, renamed modules it does not know, or values computed at run time, and it prefers
missing a pitfall to flagging ordinary code. Names are resolved through the file's imports
(`import torch.nn.functional as F`, `from torch import nn`, `from torch.nn.functional import
cosine_similarity`); unimported `F`, `nn` and `np` are read as torch.nn.functional, torch.nn and
numpy. Literal epsilons may also be module or function constants (`EPS = 1e-8`, `eps=1e-8`) when
the name is bound to a single number in the file.

CA100  the file could not be read, decoded as UTF-8, or parsed; nothing else was checked in it.
CA101  a norm's dim passed positionally, or a negative first positional argument: `x.norm(-1)` is
       the p=-1 "norm" of the whole tensor (one scalar), and `.norm(2, -1)` /
       `torch.norm(x, 2, -1)` / `torch.linalg.norm(x, 2, -1)` rely on an argument order that differs
       between these functions. Fix: `x.norm(dim=-1)` or `torch.linalg.vector_norm(x, dim=-1)`.
       A method call `.norm(a, b)` is flagged only when `b` looks like a dim (an int literal, a
       tuple of them, or a name containing "dim"/"axis"), so a LayerNorm held as `self.norm` is not.
CA102  `cosine_similarity` (torch.nn.functional, torch, nn.CosineSimilarity): its denominator is
       clamped at eps=1e-8, so for ‖g‖ ~ 1e-10 the gradient cosine Γ shrinks ~100×. Silent when an
       explicit `eps=` literal below 1e-12 is passed.
CA103  a cosine denominator clamped at a literal eps with 1e-12 ≤ eps < 1 (a floor of 1 or more
       is a clipping threshold, not an epsilon): a division whose divisor floors an expression
       containing a norm (a `.norm`/`vector_norm` call, or a name the same function assigns from
       one) with `.clamp(min=eps)`, `.clamp_min(eps)`, `torch.clamp(den, min=eps)`,
       `max(den, eps)`, `torch.maximum(den, eps)` or `den + eps`. A name assigned such a floored
       norm and later used as a divisor in the same function (`den = (...).clamp(min=1e-8);
       cos = dot / den`) counts too.
CA104  float16 around gradient measurements: `torch.autocast(..., dtype=torch.float16)`,
       `torch.autocast("cuda")` (fp16 by default), `torch.cuda.amp.autocast()` (fp16 by default),
       `.half()`, `.to(torch.float16)`, `.to(dtype=torch.half)`, `torch.set_default_dtype(float16)`,
       in a function (or module top level) that also computes gradients (`torch.autograd.grad`,
       `.backward()`, reading `.grad`). `scaler.scale(loss).backward()` (loss scaling) does not
       count as a measurement. bfloat16 is silent, and so is `torch.autocast(device)` with no
       dtype when the device is not a literal "cuda...".
CA105  `torch.load(..., weights_only=False)`: unpickling runs arbitrary code from the file.
CA106  random feedback matrices: a target whose name contains "feedback", has an "fb" word
       (`fb`, `fb0`, `W_fb`, `fbs`), or is a capital-B name (`B`, `B0`, `Bs`, `B_l`), drawn by
       `torch.randn/rand/randint/normal/..._like`, an in-place `.normal_()`/`.uniform_()`,
       `nn.init.*_`, or `np.random.*`, via assignment, `.append(...)`, `nn.init.normal_(B)` or
       `register_buffer("B", ...)`. (1) A torch draw without a `generator=` keyword (any value but
       None counts as seeded: the generator's own seeding is not traced), a legacy
       `np.random.*` draw, or a draw from `np.random.default_rng()` without a seed is "drawn
       without a seeded generator". (2) Once per name, at its first draw: the name is "never saved
       with the checkpoint" unless it is referenced (as a name, attribute or string key) in the
       arguments of a save call (`torch.save`, `save_file`, `np.save[z]`, `pickle.dump`, ...), in a
       dict or variable later passed to one, in `register_buffer`/`register_parameter`, in a
       `state_dict`/`get_extra_state` method, or is assigned an `nn.Parameter`/`ParameterList`.
CA107  gradient/metric measurements with the model in train mode, only in files that use
       Dropout or BatchNorm (`nn.Dropout*`, `nn.BatchNorm*`, `F.dropout`, `F.batch_norm`). A
       measurement function is one whose name contains cosine, gamma, alignment, diagnos, evaluat
       or an `eval` word, or (unless its name says train/fit/step/update) one that calls
       `torch.autograd.grad`. Flagged when its first mode call is `.train()`, or when it never calls
       `.eval()`/`.train(False)`/`.train(mode)`, refers to a model (a name containing "model"/"net", or `self`
       of an nn.Module subclass), and no caller in the file calls `.eval()` before calling it.

Suppression: a trailing `# creditaudit: ignore[CA102]` (codes comma-separated) silences those codes
on that line only; `# creditaudit: ignore` silences every code on that line.
"""
from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from .errors import CreditAuditError

# The smallest epsilon that counts as a harmful clamp: Γ's norms can be ~1e-10, and a floor at
# 1e-12 already distorts their product (~1e-20); a floor at 1e-30 does not.
EPS_THRESHOLD = 1e-12
# A floor of 1 or more on a norm is a clipping threshold (`max(1.0, norm)`), not an epsilon.
CLIP_THRESHOLD = 1.0

# Read these unimported names as the modules researchers conventionally bind them to.
_DEFAULT_ALIASES = {"torch": "torch", "F": "torch.nn.functional", "nn": "torch.nn", "np": "numpy",
                    "numpy": "numpy", "math": "math"}
_SKIP_DIRS = {".venv", "__pycache__", "site-packages"}
# Scopes that own their body: a function's gradient/mode facts are not those of what it defines.
_OWN_SCOPE = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)

_NORM_NAMES = {"norm", "vector_norm"}
_TORCH_NORM_FUNCS = {"torch.norm", "torch.functional.norm", "torch.linalg.norm",
                     "torch.linalg.vector_norm"}
_COSINE_FUNCS = {"torch.nn.functional.cosine_similarity", "torch.cosine_similarity",
                 "torch.nn.CosineSimilarity", "torch.nn.modules.CosineSimilarity",
                 "torch.nn.modules.distance.CosineSimilarity"}
_CLAMP_METHODS = {"clamp", "clamp_", "clamp_min", "clamp_min_", "clip", "clip_"}
_CLAMP_FUNCS = {"torch.clamp", "torch.clip", "torch.clamp_min"}
_MAX_FUNCS = {"max", "torch.maximum", "torch.fmax", "numpy.maximum", "numpy.fmax", "math.fmax"}
_AUTOCAST = {"torch.autocast", "torch.amp.autocast", "torch.amp.autocast_mode.autocast"}
_CUDA_AUTOCAST = {"torch.cuda.amp.autocast", "torch.cuda.amp.autocast_mode.autocast"}
_FP16 = {"torch.float16", "torch.half"}
_GRAD_FUNCS = {"torch.autograd.grad", "torch.autograd.backward", "torch.func.grad",
               "torch.func.vjp", "torch.autograd.functional.vjp"}
_TORCH_DRAWS = {"torch.randn", "torch.rand", "torch.randint", "torch.randn_like",
                "torch.rand_like", "torch.randint_like", "torch.normal", "torch.bernoulli"}
_INPLACE_DRAWS = {"normal_", "uniform_", "bernoulli_", "random_", "exponential_", "cauchy_",
                  "log_normal_", "geometric_"}
_INIT_DRAWS = {"normal_", "uniform_", "xavier_normal_", "xavier_uniform_", "kaiming_normal_",
               "kaiming_uniform_", "orthogonal_", "trunc_normal_", "sparse_"}
_NP_FACTORIES = {"numpy.random.default_rng", "numpy.random.RandomState", "numpy.random.Generator"}
_NP_NOT_DRAWS = {"seed", "get_state", "set_state", "default_rng", "RandomState", "Generator",
                 "SeedSequence", "PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64", "BitGenerator"}
_NP_DRAW_METHODS = {"standard_normal", "normal", "uniform", "random", "integers", "randn", "rand",
                    "choice", "laplace", "binomial", "multivariate_normal"}
_SAVE_CALLS = {"save", "save_file", "save_model", "save_pretrained", "savez", "savez_compressed",
               "dump"}
_PARAMETER_CALLS = {"Parameter", "ParameterList", "ParameterDict"}

_FEEDBACK_WORD = re.compile(r"feedback", re.IGNORECASE)
_FB_WORD = re.compile(r"fbs?\d*")
_B_NAME = re.compile(r"B(?:s|\d+)?(?:_\w*)?")
_STOCHASTIC_LAYER = re.compile(r"torch\.nn\.(?:modules\.[\w.]*)?\w*(?:Dropout|BatchNorm)\w*"
                               r"|torch\.nn\.functional\.(?:\w*dropout\w*|batch_norm)")
_METRIC_NAME = re.compile(r"cosine|gamma|alignment|diagnos|evaluat|(?:^|_)eval(?:_|$)",
                          re.IGNORECASE)
_TRAINING_NAME = re.compile(r"train|fit|step|update", re.IGNORECASE)
_MODEL_NAME = re.compile(r"model|net", re.IGNORECASE)
_IGNORE = re.compile(r"#\s*creditaudit:\s*ignore(?:\[([^\]]*)\])?", re.IGNORECASE)


@dataclass(frozen=True)
class Finding:
    """One pitfall at `path:line:col` (1-based line and column)."""
    path: str
    line: int
    col: int
    code: str
    message: str
    fix: str

    def format(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: {self.code} {self.message} — fix: {self.fix}"


# ---------------------------------------------------------------- small pure helpers over the ast

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


def _suppressions(source: str) -> dict[int, frozenset[str] | None]:
    """line -> codes silenced there (None: all), from `# creditaudit: ignore[...]` comments."""
    comments: list[tuple[int, str]] = []
    try:  # tokenize so that the marker inside a string literal does not count
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments.append((tok.start[0], tok.string))
    except (tokenize.TokenError, SyntaxError):
        comments = [(i, line) for i, line in enumerate(source.splitlines(), 1) if "#" in line]
    out: dict[int, frozenset[str] | None] = {}
    for line, text in comments:
        match = _IGNORE.search(text)
        if match:
            codes = match.group(1)
            out[line] = None if codes is None else frozenset(
                c.strip().upper() for c in codes.split(",") if c.strip())
    return out


@dataclass
class _Facts:
    """What the rules need to know about the whole file before visiting it."""
    aliases: dict[str, str]
    constants: dict[str, float]
    saved_keys: set[str]
    rng_names: dict[str, bool]
    stochastic_layers: bool
    functions: list[ast.AST] = field(default_factory=list)


def _collect_facts(tree: ast.Module) -> _Facts:
    aliases = {**_DEFAULT_ALIASES, **_import_aliases(tree)}
    functions = [tree] + [n for n in ast.walk(tree)
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return _Facts(aliases=aliases, constants=_numeric_constants(tree), saved_keys=_saved_keys(tree),
                  rng_names=_rng_names(tree, aliases),
                  stochastic_layers=_uses_stochastic_layers(tree, aliases), functions=functions)


# ---------------------------------------------------------------- the visitor

class _Checker(ast.NodeVisitor):
    """One pass over a parsed file; each `_check_*` method is one rule at one kind of node."""

    def __init__(self, path: str, source: str, tree: ast.Module):
        self.path = path
        self.lines = source.splitlines()
        self.facts = _collect_facts(tree)
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
            return bool(node.elts) and all(_Checker._looks_like_dim(e) for e in node.elts)
        if isinstance(node, ast.Name):
            return "dim" in node.id.lower() or "axis" in node.id.lower()
        value = _number(node)
        return value is not None and value == int(value)

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

    # -- CA105

    def _check_torch_load(self, node: ast.Call) -> None:
        if self._name(node.func) != "torch.load":
            return
        flag = _keyword(node, "weights_only")
        if isinstance(flag, ast.Constant) and flag.value is False:
            self._report(node, "CA105",
                         "torch.load(..., weights_only=False) unpickles the file, which runs "
                         "arbitrary code from whoever wrote the checkpoint",
                         "use torch.load(path, weights_only=True), or store tensors with "
                         "safetensors (safetensors.torch.save_file / load_file)")

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


# ---------------------------------------------------------------- public API

def _unparsable(path: str, line: int, col: int, message: str) -> list[Finding]:
    return [Finding(path, max(line, 1), max(col, 1), "CA100", message,
                    "make it valid UTF-8 Python 3 source (the linter parses it, never runs it), "
                    "or leave it out of the paths")]


def lint_source(source: str, path: str = "<string>") -> list[Finding]:
    """Findings for one file's source text, sorted by line; `path` is only used in the findings."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as err:
        return _unparsable(path, err.lineno or 1, err.offset or 1, f"cannot parse: {err.msg}")
    except (ValueError, RecursionError, MemoryError) as err:  # null bytes, absurd nesting
        return _unparsable(path, 1, 1, f"cannot parse: {err}")
    try:
        checker = _Checker(path, source, tree)
        checker.visit(tree)
        findings = checker.finish()
    except RecursionError:
        return _unparsable(path, 1, 1, "too deeply nested to check")
    ignored = _suppressions(source)
    kept = [f for f in findings if f.line not in ignored
            or (ignored[f.line] is not None and f.code not in ignored[f.line])]
    return sorted(set(kept), key=lambda f: (f.line, f.col, f.code, f.message))


def _lint_file(path: Path) -> list[Finding]:
    shown = str(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        return _unparsable(shown, 1, 1, f"cannot read the file: {err.strerror or err}")
    try:
        source = data.decode("utf-8-sig")  # utf-8, tolerating a leading byte-order mark
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        return _unparsable(shown, line, 1, f"not valid UTF-8 (byte {err.start} of the file)")
    return lint_source(source, shown)


def _python_files(root: Path) -> Iterator[Path]:
    if root.is_file():
        yield root
        return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("."):
                yield Path(dirpath) / name


def _files(paths: Iterable) -> list[Path]:
    """Every file to check, after making sure each given path exists (fail before any output)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    roots = [Path(p) for p in paths]
    if not roots:
        raise CreditAuditError("lint: no paths given; pass Python files or folders, "
                               "e.g. `creditaudit lint train.py src/`")
    for root in roots:
        if not root.exists():
            raise CreditAuditError(f"lint: no such file or folder: {str(root)!r}; pass an existing "
                                   "Python file or a folder of .py files")
        if not (root.is_file() or root.is_dir()):
            raise CreditAuditError(f"lint: {str(root)!r} is neither a file nor a folder; pass a "
                                   "Python file or a folder of .py files")
    files: dict[Path, None] = {}  # ordered and without duplicates
    for root in roots:
        files.update(dict.fromkeys(_python_files(root)))
    return list(files)


def _lint_files(files: list[Path]) -> list[Finding]:
    findings = [f for path in files for f in _lint_file(path)]
    return sorted(findings, key=lambda f: (f.path, f.line, f.col, f.code, f.message))


def lint_paths(paths) -> list[Finding]:
    """Findings for files and folders (searched recursively for *.py), sorted by path and line.
    Raises CreditAuditError for a path that does not exist."""
    return _lint_files(_files(paths))


def run_lint(paths: list[str], out) -> int:
    """Print one line per finding and a summary to `out`; 1 when there are findings, else 0."""
    files = _files(paths)
    findings = _lint_files(files)
    for finding in findings:
        print(finding.format(), file=out)
    checked = f"{len(files)} file{'' if len(files) == 1 else 's'}"
    if findings:
        print(f"{len(findings)} finding{'' if len(findings) == 1 else 's'} in {checked}", file=out)
        return 1
    print(f"no findings in {checked}", file=out)
    return 0
