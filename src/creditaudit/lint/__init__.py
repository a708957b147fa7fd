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
import tokenize
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import CreditAuditError
from .checker import Checker
from .findings import Finding, _suppressions

_SKIP_DIRS = {".venv", "__pycache__", "site-packages"}

__all__ = ["Finding", "lint_paths", "lint_source", "run_lint"]


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
        checker = Checker(path, source, tree)
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
    try:           # as Python reads it: UTF-8 (a leading byte-order mark tolerated) unless a PEP 263
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)   # coding line says otherwise
    except SyntaxError as err:     # an unknown codec named, or bytes that are not UTF-8 (below)
        if "unknown encoding" in str(err.msg):
            return _unparsable(shown, 1, 1, f"its coding line names no encoding Python knows ({err.msg})")
        encoding = "utf-8-sig"
    try:
        source = data.decode(encoding)
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        name = "UTF-8" if encoding.startswith("utf-8") else encoding
        return _unparsable(shown, line, 1, f"not valid {name} (byte {err.start} of the file)")
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
    if any(str(p) == "" for p in paths):
        raise CreditAuditError("lint: an empty path was given; pass Python files or folders, "
                               "e.g. `creditaudit lint train.py src/`")
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
        found = list(_python_files(root))
        if not found:      # a mistyped path must not pass a CI gate as "no findings in 0 files"
            raise CreditAuditError(f"lint: {str(root)!r} holds no .py file (hidden folders and "
                                   f"{', '.join(sorted(_SKIP_DIRS))} are skipped); pass the folder of "
                                   "your Python code")
        files.update(dict.fromkeys(found))
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
