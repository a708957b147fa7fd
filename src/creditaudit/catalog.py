"""What the command line shows and checks before it runs anything: the registries' names (methods,
data sets, architectures, activations), every method's and architecture's knobs with their defaults
and help lines, and the config dataclasses' defaults and help — the values `cli.build_parser` puts
into options, choices and --help.

Computing them imports the registries, and with them torch (seconds of CPU). So the catalog is
computed once per source tree and kept as plain JSON beside the package's bytecode
(`__pycache__/catalog.<digest>.json`, else the user's cache folder), keyed by a sha256 of every
source file of the package: any edit (a new method, a changed default) gives another key, and the
next command computes it afresh. `--help` and an argument error then need no torch. The file is
read as JSON only; one that does not parse, lacks a key or holds a value of another type than the
catalog computes (`well_formed`) is recomputed and replaced, never trusted.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parent
_KEYS = ("run", "audit", "max_count", "precisions", "presets", "executors", "experiment_out",
         "datasets", "archs", "activations", "methods", "knobs", "rules", "stackable", "null_k", "recipes")


class Catalog:
    """The catalog's values as attributes; `run(name)` / `audit(name)` give a config field's
    default, `run_help(name)` / `audit_help(name)` its help line."""

    def __init__(self, values: dict[str, Any]):
        self.values = {key: values[key] for key in _KEYS}
        for key in _KEYS:
            setattr(self, key, values[key])

    def run_default(self, name: str):
        return self.values["run"][name][0]

    def run_help(self, name: str) -> str:
        return self.values["run"][name][1]

    def audit_default(self, name: str):
        return self.values["audit"][name][0]

    def audit_help(self, name: str) -> str:
        return self.values["audit"][name][1]


def live() -> Catalog:
    """The catalog computed now from the registries and config (imports torch)."""
    import dataclasses
    import inspect
    from .config import (EXECUTORS, EXPERIMENT_OUT, MAX_COUNT, PRECISIONS, PRESET_NAMES, AuditConfig,
                         RunConfig, default, field_help)
    from .data import DATASET_NAMES
    from .methods import METHODS, RECIPE_CHOICES
    from .model import ACTIVATIONS, ARCHITECTURES
    from .protocol import diagnose
    from .train import stackable

    def fields(cls):
        return {f.name: [default(cls, f.name), field_help(cls, f.name)] for f in dataclasses.fields(cls)}
    return Catalog({
        "run": fields(RunConfig), "audit": fields(AuditConfig), "max_count": MAX_COUNT,
        "precisions": list(PRECISIONS), "presets": list(PRESET_NAMES), "executors": list(EXECUTORS),
        "experiment_out": dict(EXPERIMENT_OUT), "datasets": list(DATASET_NAMES),
        "archs": list(ARCHITECTURES), "activations": list(ACTIVATIONS), "methods": list(METHODS),
        "knobs": _knobs(), "rules": _rules(), "stackable": stackable(),
        "null_k": inspect.signature(diagnose).parameters["null_k"].default,
        "recipes": list(RECIPE_CHOICES)})


def _knobs() -> str:
    """The --option and --arch-option knobs of every built-in method and architecture, with their
    defaults and one-line help (`Method.option_help`, `model.ARCH_OPTION_HELP`)."""
    from .methods import METHODS
    from .model import ARCH_OPTION_HELP, ARCH_OPTIONS
    lines = ["method options (--option KEY=VALUE):"]
    for name, cls in METHODS.items():
        for key, value in cls.option_defaults.items():
            lines.append(f"  {name}: {key}={value!r}  {cls.option_help.get(key, '')}".rstrip())
    lines.append("architecture options (--arch-option KEY=VALUE):")
    for arch, options in ARCH_OPTIONS.items():
        for key, value in options.items():
            lines.append(f"  {arch}: {key}={value!r}  {ARCH_OPTION_HELP[arch].get(key, '')}".rstrip())
    return "\n".join(lines) + "\n"


def summary_line(name: str, cls) -> str:
    """A method's one line for `audit --help`: its `summary`, else the first paragraph of its
    class's or module's docstring joined into one line (never cut mid-sentence), without a
    leading "NAME — "."""
    doc = cls.summary or cls.__dict__.get("__doc__") or sys.modules[cls.__module__].__doc__ or ""
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    return paragraph.split(" — ", 1)[1] if paragraph.startswith(f"{name} — ") else paragraph


def _rules() -> str:
    """Every built-in rule with its one line (`summary_line`), for `audit --help`; the paper's
    seven are marked."""
    from .methods import METHODS
    lines = ["rules (--methods NAME; * = one of the paper's seven, trained by the quick and paper "
             "presets; the zoo preset trains all):"]
    for name, cls in METHODS.items():
        lines += textwrap.wrap(f"{'*' if cls.paper else ' '} {name}: {summary_line(name, cls)}", 100,
                               initial_indent="  ", subsequent_indent="      ")
    return "\n".join(lines) + "\n"


def source_digest(skip: tuple[str, ...] = ()) -> str:
    """sha256 of every .py file of the package (path and bytes), but those under the top-level
    names in `skip`: the catalog's key (all of them), and part of a diagnosis' binding (all but
    the views and the command line, which compute nothing a diagnosis holds)."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in skip:
            continue
        h.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:32]


def _cache_files(digest: str) -> list[Path]:
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return [PACKAGE / "__pycache__" / f"catalog.{digest}.json", home / "creditaudit" / f"catalog.{digest}.json"]


_STRING_LISTS = ("precisions", "presets", "executors", "datasets", "archs", "activations", "methods", "recipes")


def well_formed(values: Any, digest: str) -> bool:
    """Whether a cache file's JSON has the catalog's form: this source tree's digest, every key,
    each value of the type `live` computes — run / audit: field → [default (JSON), help line];
    lists of names; experiment_out: subcommand → folder; knobs / rules / stackable: text; max_count
    and null_k: positive integers. A file of the right keys with other types (hand-edited, written
    by another program) would otherwise reach argparse as choices and defaults."""
    if not isinstance(values, dict) or values.get("digest") != digest or not all(k in values for k in _KEYS):
        return False
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0
    names = lambda v: isinstance(v, list) and bool(v) and all(isinstance(x, str) and x for x in v)
    fields = lambda v: isinstance(v, dict) and bool(v) and all(
        isinstance(k, str) and isinstance(f, list) and len(f) == 2 and isinstance(f[1], str)
        for k, f in v.items())
    return (fields(values["run"]) and fields(values["audit"]) and is_int(values["max_count"])
            and is_int(values["null_k"]) and all(names(values[k]) for k in _STRING_LISTS)
            and isinstance(values["experiment_out"], dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in values["experiment_out"].items())
            and all(isinstance(values[k], str) for k in ("knobs", "rules", "stackable")))


def load() -> Catalog:
    """The catalog of this source tree: read from its cache file when one holds it, else computed
    (`live`) and written to the first cache folder that takes it (none: computed each time)."""
    digest = source_digest()
    files = _cache_files(digest)
    for path in files:
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
            if well_formed(values, digest):
                return Catalog(values)
        except (OSError, ValueError):
            continue
    text = json.dumps({"digest": digest, **live().values})
    catalog = Catalog(json.loads(text))      # as a later command reads it: the first behaves alike
    for path in files:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)            # a reader sees the old file or the whole new one
            for old in path.parent.glob("catalog.*.json"):     # an earlier source tree's
                if old != path:
                    old.unlink(missing_ok=True)
            break
        except OSError:
            continue
    return catalog
