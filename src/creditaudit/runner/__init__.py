"""How runs are executed: an executor maps a job function over jobs and reports each result as it
arrives. `local` (the default) is a pool of spawned worker processes on this machine; `ray` runs
each job as a Ray task, on this machine or a cluster (runner/ray.py, the `creditaudit[ray]` extra).

A job function never raises: it returns a record (a failed run is data). An executor only adds
what a worker's death means: the record {"status": "failed", "message": "worker died: …"}.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable, Iterator, Protocol, Sequence

from ..errors import CreditAuditError


class Executor(Protocol):
    def map(self, fn: Callable[[Any], dict], jobs: Sequence[Any],
            on_done: Callable[[int, dict], None]) -> list[dict]:
        """Results of fn over jobs, in job order; on_done(i, result) as each finishes."""


def make_executor(name: str = "local", *, workers: int = 1, address: str | None = None,
                  max_retries: int = 3, gpus_per_job: float = 0.0) -> Executor:
    if name == "local":
        from .local import LocalExecutor
        return LocalExecutor(workers)
    if name == "ray":
        from .ray import RayExecutor
        return RayExecutor(address=address, max_retries=max_retries, gpus_per_job=gpus_per_job)
    raise CreditAuditError(f"unknown executor {name!r}; choose local or ray")


def worker_died(err: BaseException) -> dict:
    message = f"worker died: {err!r}"
    return {"status": "failed", "message": message, "error": message, "trained": True}


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While runs execute, SIGTERM raises KeyboardInterrupt in the main thread, so an executor stops
    its workers and the command exits like on Ctrl-C (finished runs saved, exit 130) instead of dying
    mid-write. Replaces only the default handler or Ray's own (which aborts the driver with a stack
    dump), never a handler the program installed itself."""
    previous = signal.getsignal(signal.SIGTERM)
    ours = previous in (signal.SIG_DFL, None) or getattr(previous, "__module__", "").startswith("ray.")
    if threading.current_thread() is not threading.main_thread() or not ours:
        yield
        return
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
