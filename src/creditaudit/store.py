"""The run store: one folder per run, every file written atomically.

    RUN/config.json                 the resolved RunConfig
    RUN/metrics.jsonl               one JSON line per checkpointed epoch (epoch 0 = at init)
    RUN/checkpoint.json             metadata: format tag, epoch, status, the non-tensor state
    RUN/checkpoint-eNNNN.safetensors  every tensor (weights, optimizer moments, feedback matrices,
                                    RNG states) of that epoch's checkpoint

A checkpoint is written tensors first, then the JSON that names them (with their sha256), so a
kill at any moment leaves the previous complete checkpoint readable. Loading reads JSON and
safetensors only: nothing is ever unpickled.

Integrity: every record a verdict depends on is sealed with a sha256 over its canonical JSON —
checkpoint.json (the run's config, history, method state skeleton, RNG states, and the sha256 of
its tensors file, so feedback matrices and weights are covered too), status.json (which also names
the checkpoint's seal), diagnosis.json and audit.json. Loading recomputes each seal and refuses a
record that does not match, naming the file. This catches accidents and casual edits (a changed
accuracy, epoch or status, a truncated file, a config.json that no longer matches its checkpoint).
It is not a signature: someone who edits a record and recomputes its sha256 on purpose is not
stopped — sign the audit folder (e.g. with gpg) where that matters.
"""
from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .errors import CreditAuditError

FORMAT = "creditaudit-checkpoint"
FORMAT_VERSION = 2
SEAL = "sha256"


# -- atomic files -----------------------------------------------------------------------------
def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def as_path(value: Any, what: str) -> Path:
    """A path argument (str or os.PathLike, not empty) as a Path; anything else is one line
    naming the argument, not a TypeError from pathlib."""
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise CreditAuditError(f"{what} must be a folder path (a string or pathlib.Path), got {value!r}")
    return Path(value)


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CreditAuditError(f"{path} not found: is this a {what}?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CreditAuditError(f"{path} is not valid JSON ({err}); the {what} is corrupt") from None
    except RecursionError:       # json recurses once per nesting level: no record nests this deep
        raise CreditAuditError(f"{path} nests too deeply to be a {what}; it is corrupt") from None
    except OSError as err:       # a folder where a file should be, no permission: a read, not a write
        raise CreditAuditError(f"cannot read {path} ({err.strerror or err}); is it a {what}?") from None


# -- sealed records -----------------------------------------------------------------------------
def digest(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj` (sorted keys, no whitespace, strict JSON)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def seal(obj: dict) -> dict:
    """`obj` plus its seal (a sha256 over everything else in it)."""
    body = {k: v for k, v in obj.items() if k != SEAL}
    return {**body, SEAL: digest(body)}


def unseal(obj: Any, path: Path, what: str) -> dict:
    """`obj` without its seal, after checking it; any mismatch is refused with one clear line."""
    if not isinstance(obj, dict) or SEAL not in obj:
        raise CreditAuditError(f"{path} carries no integrity seal; it was not written by this "
                               f"creditaudit or was edited by hand — re-create the {what}")
    body = {k: v for k, v in obj.items() if k != SEAL}
    try:
        sealed = digest(body) == obj[SEAL]
    except (ValueError, TypeError):     # NaN/Infinity: never written by us (json_safe), so edited
        sealed = False
    if not sealed:
        raise CreditAuditError(f"{path} was modified after it was written (integrity check failed); "
                               f"the {what} cannot be trusted — restore it or re-create it")
    return body


def write_sealed_json(path: Path, obj: dict) -> None:
    atomic_write_json(path, seal(obj))


def read_sealed_json(path: Path, what: str) -> dict:
    return unseal(read_json(path, what), Path(path), what)


# -- nested state <-> (tensors, JSON skeleton) --------------------------------------------------
def flatten_state(obj: Any, tensors: dict[str, torch.Tensor], prefix: str = "s") -> Any:
    """Split nested state (dicts, lists, tuples, tensors, numbers, strings) into a JSON skeleton
    and a flat {name: tensor} dict; dict keys that are not strings and tuples are tagged so
    `unflatten_state` restores them exactly (optimizer state dicts use int keys)."""
    if isinstance(obj, torch.Tensor):
        name = f"{prefix}"
        tensors[name] = obj.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": name}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {"__dict__": {k: flatten_state(v, tensors, f"{prefix}.{k}") for k, v in obj.items()}}
        return {"__items__": [[k, flatten_state(v, tensors, f"{prefix}.{i}")]
                              for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, (list, tuple)):
        items = [flatten_state(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} in a checkpoint (at {prefix})")


def unflatten_state(skel: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skel, list):
        return [unflatten_state(v, tensors) for v in skel]
    if isinstance(skel, dict):
        if "__tensor__" in skel:
            return tensors[skel["__tensor__"]]
        if "__dict__" in skel:
            return {k: unflatten_state(v, tensors) for k, v in skel["__dict__"].items()}
        if "__items__" in skel:
            return {k: unflatten_state(v, tensors) for k, v in skel["__items__"]}
        if "__tuple__" in skel:
            return tuple(unflatten_state(v, tensors) for v in skel["__tuple__"])
        raise ValueError(f"unknown skeleton node {list(skel)}")
    return skel


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# -- checkpoints ------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlatState:
    """Nested state already split by `flatten_state`: its JSON skeleton and host copies of its
    tensors. A copy of the state as it was when taken: the trainer keeps one per epoch it does
    not write yet (`train.CHECKPOINT_SECONDS`), so that the state later written is that epoch's."""

    skeleton: Any
    tensors: dict[str, torch.Tensor]

    @classmethod
    def of(cls, state: Any) -> "FlatState":
        tensors: dict[str, torch.Tensor] = {}
        return cls(flatten_state(state, tensors), tensors)


def save_checkpoint(run_dir: Path, epoch: int, state: dict[str, Any] | FlatState, meta: dict[str, Any],
                    config: dict[str, Any]) -> None:
    """Save nested `state` (tensors + plain values, or a `FlatState` taken earlier) for `epoch`;
    `meta` is extra JSON (data shape, label); `config` is the run's config, sealed into the
    checkpoint with everything else."""
    run_dir = Path(run_dir)
    flat = state if isinstance(state, FlatState) else FlatState.of(state)
    skeleton, tensors = flat.skeleton, flat.tensors
    name = f"checkpoint-e{epoch:04d}.safetensors"
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp)
        os.chmod(tmp, 0o644)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, run_dir / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(run_dir)
    previous = _checkpoint_meta(run_dir)
    write_sealed_json(run_dir / "checkpoint.json", {
        "format": FORMAT, "version": FORMAT_VERSION, "epoch": epoch, "tensors": name,
        "tensors_sha256": _sha256(run_dir / name), **meta, "config": config,
        "skeleton": json_safe(skeleton)})
    _fsync_dir(run_dir)  # the new JSON is on disk before the tensors it replaces go
    if previous and previous.get("tensors") not in (None, name):
        (run_dir / previous["tensors"]).unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _checkpoint_meta(run_dir: Path) -> dict | None:
    path = Path(run_dir) / "checkpoint.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, OSError):
        return None     # unreadable: load_checkpoint refuses it with the reason


def checkpoint_digest(run_dir: Path) -> str | None:
    """The seal of the run's current checkpoint.json (binds status.json to that checkpoint)."""
    meta = _checkpoint_meta(run_dir)
    return None if meta is None else meta.get(SEAL)


def has_checkpoint(run_dir: Path) -> bool:
    return (Path(run_dir) / "checkpoint.json").exists()


def load_checkpoint(path: Path) -> tuple[dict[str, Any], Any]:
    """(metadata, state) of the checkpoint in run folder `path` (or its checkpoint.json).

    Raises CreditAuditError for anything that is not an intact creditaudit checkpoint: a foreign
    file, a truncated or altered tensors file, a missing piece.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoint.json"
    elif path.suffix == ".safetensors":
        raise CreditAuditError(
            f"{path}: pass the run folder (or its checkpoint.json), not the tensors file alone")
    if not path.exists():
        raise CreditAuditError(
            f"no checkpoint at {path}: point at a run folder written by `creditaudit train --out DIR`")
    meta = read_json(path, "creditaudit checkpoint")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CreditAuditError(
            f"{path} is not a creditaudit checkpoint (no format tag {FORMAT!r}); "
            "point at a run folder written by `creditaudit train`")
    if meta.get("version") != FORMAT_VERSION:
        raise CreditAuditError(
            f"{path} has checkpoint format version {meta.get('version')}, this creditaudit reads "
            f"version {FORMAT_VERSION}; re-train the run with this version")
    meta = unseal(meta, path, "run's checkpoint")
    config_path = path.parent / "config.json"
    if config_path.exists() and read_json(config_path, "creditaudit run folder") != meta.get("config"):
        raise CreditAuditError(f"{config_path} does not match the config sealed in its checkpoint "
                               "(it was edited); restore it or re-train the run")
    tensors_path = path.parent / str(meta.get("tensors"))
    if not tensors_path.exists():
        raise CreditAuditError(f"checkpoint tensors {tensors_path} are missing; re-train the run")
    try:
        tensors_sha256 = _sha256(tensors_path)
    except OSError as err:
        raise CreditAuditError(f"cannot read checkpoint tensors {tensors_path} ({err.strerror or err}); "
                               "delete the run folder and train it again") from None
    if tensors_sha256 != meta.get("tensors_sha256"):
        raise CreditAuditError(
            f"checkpoint tensors {tensors_path} are truncated or corrupt (sha256 mismatch); "
            "delete the run folder and train it again")
    try:
        tensors = load_file(tensors_path)
    except (SafetensorError, OSError, ValueError) as err:
        raise CreditAuditError(f"cannot read {tensors_path}: {err}; delete the run folder and "
                               "train it again") from None
    try:
        state = unflatten_state(meta["skeleton"], tensors)
    except (KeyError, ValueError, TypeError) as err:
        raise CreditAuditError(f"{path} does not match its tensors ({err}); the checkpoint is corrupt") from None
    return meta, state


# -- metrics log ------------------------------------------------------------------------------
def json_safe(value: Any) -> Any:
    """A strict-JSON copy of nested results (json.dumps(allow_nan=False) accepts it).

    NaN → None ("could not be measured"); ±inf → the strings "inf" / "-inf" (a measured, unbounded
    value, e.g. a diverged norm); tensors → lists; tuples → lists; dict keys → strings.
    """
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return value if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def json_number(value: Any) -> float:
    """The inverse of `json_safe` for one number: None → NaN, "inf"/"-inf" → ±inf."""
    return float("nan") if value is None else float(value)


def check_metrics_log(run_dir: Path, history: list[dict], ended: bool = False) -> None:
    """Refuse a metrics.jsonl that disagrees with the sealed checkpoint's history (the truth).

    The log is a readable copy of that history, rewritten after each checkpoint; a kill between the
    two writes leaves it one epoch short, so a log that is a prefix of the history is accepted —
    unless the run has `ended` (its status.json is written after its last log). Any other
    difference (an edited accuracy, a dropped or added line) is refused in one line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        lines = None
    except OSError as err:
        raise CreditAuditError(f"cannot read {path} ({err.strerror or err}); restore the file, or "
                               "delete it to read the run from its checkpoint alone") from None
    truth = json.loads(json.dumps([json_safe(r) for r in history], allow_nan=False))
    if lines is None or len(lines) > len(truth) or len(truth) - len(lines) > (0 if ended else 1) \
            or lines != truth[:len(lines)]:
        epoch = next((i for i, (a, b) in enumerate(zip(lines or [], truth)) if a != b), None)
        where = f" at epoch {truth[epoch].get('epoch', epoch)}" if epoch is not None else ""
        raise CreditAuditError(f"{path} disagrees with the sealed checkpoint history{where} (it was edited "
                               "or replaced); the checkpoint is the record — restore the file, or delete "
                               "it to read the run from its checkpoint alone")


def write_metrics(run_dir: Path, history: list[dict]) -> None:
    """Rewrite metrics.jsonl from the full history (atomic; at most a few hundred lines)."""
    atomic_write_text(Path(run_dir) / "metrics.jsonl",
                      "".join(json.dumps(json_safe(r), allow_nan=False) + "\n" for r in history))


# -- per-example correctness: one bit per test example, recorded with every accuracy -------------

def pack_correct(correct) -> dict:
    """A bool vector (one entry per test example, in the test set's fixed order) as the record a
    run keeps: {"n": N, "bits": base64 of the bits packed little-endian}. 1000 examples: 168 chars."""
    bits = np.asarray(correct, dtype=bool).reshape(-1)
    return {"n": int(bits.size),
            "bits": base64.b64encode(np.packbits(bits, bitorder="little").tobytes()).decode("ascii")}


def unpack_correct(record, acc: float | None = None, what: str = "the run") -> np.ndarray | None:
    """The bool vector of a `pack_correct` record (None: no record). With `acc`, the record must
    agree with the accuracy it sits beside (to one example), else it is refused: bits that do not
    score the run's accuracy are not its bits."""
    if record is None:
        return None
    try:
        n = int(record["n"])
        raw = base64.b64decode(record["bits"], validate=True)
        bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
    except (KeyError, TypeError, ValueError) as err:
        raise CreditAuditError(f"the per-example record of {what} is malformed ({err}); retrain it "
                               "into a fresh --out") from None
    if n < 1 or not n <= bits.size < n + 8:
        raise CreditAuditError(f"the per-example record of {what} holds {bits.size} bits for {n} "
                               "examples; retrain it into a fresh --out")
    bits = bits[:n].astype(bool)
    if acc is not None and abs(bits.mean() - float(acc)) > 1.0 / n + 1e-6:     # one example, and float32 rounding
        raise CreditAuditError(f"the per-example record of {what} scores {bits.mean():.4f}, not its "
                               f"recorded accuracy {float(acc):.4f}: the record was edited or belongs to "
                               "another run; retrain it into a fresh --out")
    return bits
