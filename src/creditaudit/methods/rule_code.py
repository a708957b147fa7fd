"""The code a user's rule (PKG.MODULE:CLASS) runs: its module and every module of its own package
that it imports, transitively, as {path: sha256}. A built-in rule's code is keyed by
`config.TRAINING_CODE_VERSION`; a user's rule is keyed by this (its run key and its diagnosis key),
so an edit of the rule or of a helper it imports retrains and re-diagnoses instead of reusing runs
of the old code.

"Its own package" is what lies under the sys.path entry the rule was imported from: the rule's
top-level package, and, when that entry is the user's own folder (not site-packages nor the
standard library), the other top-level modules beside it. Never creditaudit's own files (the
training-code version covers them), nor third-party or standard-library code. Imports are read
from the source (ast), not from what happens to be imported in this process, so one rule has one
digest in every process; paths are relative to the sys.path entry, so a moved package is the same
code.
"""
from __future__ import annotations

import ast
import hashlib
import json
import sysconfig
from pathlib import Path

_CREDITAUDIT = Path(__file__).resolve().parents[1]
# spec → (stamp of its files, (sys.path entry, code)): recomputed when any of its files changes
_CACHE: dict[str, tuple[tuple, tuple[Path, dict[str, str]]]] = {}


def _third_party(path: Path) -> bool:
    """Whether `path` lies in site-packages / dist-packages or the standard library."""
    if any(part in ("site-packages", "dist-packages") for part in path.parts):
        return True
    roots = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return any(r and (path == Path(r) or Path(r) in path.parents) for r in roots)


def _file_of(root: Path, name: str) -> Path | None:
    """The source file of module `name` under `root` (a module or a package's __init__), if any."""
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path.resolve()
    return None


def _imported_names(path: Path, module: str) -> set[str]:
    """Every module name `path` (the source of `module`) imports, anywhere in the file (inside
    functions too): `import a.b` → a, a.b; `from a import b` → a, a.b (b may be a submodule);
    relative imports resolved against `module`'s package."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):
        return set()                    # it imported, so it parsed; a race with an edit: the bytes count
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                parts = parts[:len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [base] + [f"{base}.{a.name}" if base else a.name for a in node.names if a.name != "*"]
        else:
            continue
        for target in targets:
            bits = [b for b in target.split(".") if b]
            names.update(".".join(bits[:i]) for i in range(1, len(bits) + 1))   # each package's __init__ runs
    return names


def rule_files(module_name: str, module_file: str | None, root: Path | None,
               classes: tuple[type, ...] = ()) -> dict[str, str]:
    """{path relative to `root`: sha256} of the rule's module `module_name` (at `module_file`,
    imported from the sys.path entry `root`) and of every module of its own package it imports,
    transitively, plus the modules that define `classes` (the rule's class and its bases: a base
    imported by importlib is code the rule runs too). {} for a rule without a file."""
    if module_file is None or root is None:
        return {}
    root = root.resolve()
    top = module_name.split(".")[0]
    own_folder = not _third_party(root)

    def ours(name: str) -> Path | None:
        # the rule's own package is the user's code even where it is installed (site-packages);
        # another top-level module counts only beside it in the user's own folder
        same_package = name.split(".")[0] == top
        if not same_package and not own_folder:
            return None
        path = _file_of(root, name)
        if path is None or _CREDITAUDIT in path.parents or (not same_package and _third_party(path)):
            return None
        return path

    todo = [name for name in {module_name, *(c.__module__ for c in classes)} if ours(name)]
    todo += [".".join(module_name.split(".")[:i]) for i in range(1, module_name.count(".") + 1)]
    seen: dict[str, Path] = {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = ours(name)
        if path is None:
            continue
        seen[name] = path
        todo.extend(n for n in _imported_names(path, name) if n not in seen)
    return {str(p.relative_to(root).as_posix()): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(set(seen.values()))}


def code_of(spec: str) -> dict[str, str]:
    """`rule_files` of the imported rule PKG.MODULE:CLASS; cached while none of its files changes
    (a run key is asked for often, and an edit always changes a file's mtime or size)."""
    from . import method_class, method_origin
    cached = _CACHE.get(spec)
    if cached is not None and cached[0] == _stamp(cached[1][0], cached[1][1]):
        return cached[1][1]
    cls = method_class(spec)
    origin = method_origin(spec)
    root = None if origin.get("sys_path_entry") is None else Path(origin["sys_path_entry"])
    code = rule_files(origin["module"], origin.get("file"), root, cls.__mro__)
    if root is not None and code:
        _CACHE[spec] = (_stamp(root, code), (root, code))
    return code


def _stamp(root: Path, code: dict[str, str]) -> tuple:
    """(path, mtime_ns, size) of each file of `code`: what says it may have changed."""
    out = []
    for rel in sorted(code):
        try:
            st = (root / rel).stat()
            out.append((rel, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((rel, -1, -1))
    return tuple(out)


def code_digest(code: dict[str, str]) -> str:
    """One sha256 of a rule's files ({path: sha256}, as `code_of` gives them)."""
    return hashlib.sha256(json.dumps(code, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def changed_files(recorded: dict[str, str], now: dict[str, str]) -> list[str]:
    """The files that differ between two `code_of` records (edited, added or gone), sorted."""
    return sorted(p for p in set(recorded) | set(now) if recorded.get(p) != now.get(p))
