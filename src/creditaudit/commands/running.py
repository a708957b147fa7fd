"""How a command runs: its CPU threads, its folder's lock, its training recorded as the audit
records it, its report written whole."""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path

from ..errors import CreditAuditError


def set_threads(args) -> None:
    """Threads for a single-run command: --threads, else the idle cores (threads.idle_threads)."""
    from ..threads import guard_threads, idle_threads
    guard_threads(getattr(args, "threads", None) or idle_threads())


def given_once(pairs: list[tuple[str, object]], flag: str) -> dict[str, object]:
    """KEY=VALUE pairs of a repeatable option as a dict; a key given twice is refused (the last
    value would silently win), even with the same value twice (a typo is as likely as intent)."""
    seen: dict[str, object] = {}
    for key, value in pairs:
        if key in seen:
            raise CreditAuditError(f"{flag} {key} is given twice ({flag} {key}={seen[key]!r} and "
                                   f"{flag} {key}={value!r}); give each key once")
        seen[key] = value
    return seen


def compile_step(args) -> bool | None:
    """--no-compile: never; otherwise None = where it pays (the step compiled on CUDA only)."""
    return False if args.no_compile else None


@contextlib.contextmanager
def locked_out(out: Path, stub: str | None = None):
    """`audit_lock(out)`, and a command refused inside it leaves nothing that blocks the corrected
    command: folders it made that hold only the lock are removed, and `stub` (train's config.json)
    when this command wrote it and no checkpoint followed — a refused model's config.json would
    make the corrected run's folder "a different run"."""
    from ..experiments.lock import audit_lock
    made = [p for p in (out, *out.parents) if not p.exists()]
    had_stub = stub is not None and (out / stub).exists()
    with audit_lock(out, made):      # only the holder removes anything (experiments/lock.py)
        try:
            yield
        except CreditAuditError:
            if stub is not None and not had_stub and not (out / "checkpoint.json").exists():
                (out / stub).unlink(missing_ok=True)
                (out / "method_origin.json").unlink(missing_ok=True)    # written beside it for a user's rule
            raise


def train_or_record(train_run, config, out: Path, **train_kwargs):
    """train_run, with a run that raises (a user's rule, say) recorded like the audit records it:
    its traceback in <out>/error.txt, one line on stderr, and None (exit 3) instead of a traceback."""
    import time
    from ..runs import failure_record
    t0 = time.perf_counter()
    try:
        return train_run(config, out, **train_kwargs)
    except (CreditAuditError, OSError, KeyboardInterrupt):
        raise
    except Exception as err:  # noqa: BLE001 — the run failed; its traceback goes to error.txt
        record = failure_record(out, err, time.perf_counter() - t0)
        memory = isinstance(err, MemoryError) or any(
            s in str(err).lower() for s in ("can't allocate memory", "out of memory"))
        fix = ("the network or a batch does not fit in memory at these settings: lower --width, "
               "--blocks or --batch-size" if memory else
               "fix the method or settings it names, then run the same command again")
        print(f"creditaudit: the run {config.label} failed: {record['message']}; {fix} "
              "(finished epochs are kept)", file=sys.stderr)
        return None


def write_report_together(write_report, result: dict, out: Path, executor=None) -> dict:
    """write_report into a temporary folder beside the report, then move every file in: a write
    that fails (a full disk) leaves the previous report whole rather than half old, half new.
    `executor`: local workers to draw the figures in (`report.write_report`)."""
    import shutil
    import tempfile
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out, prefix=".report-"))
    try:
        staged = write_report(result, staging, previous=out, executor=executor)   # an unchanged figure is kept
        files = {}
        for name, path in staged.items():      # renames within one folder: they need no space
            os.replace(path, out / path.name)
            files[name] = out / path.name
        return files
    finally:
        shutil.rmtree(staging, ignore_errors=True)
