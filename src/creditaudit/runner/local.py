"""The local executor: one process per job slot, spawned (never forked: torch and threads), each
single-threaded on CPU. Workers die with the parent (Linux: PR_SET_PDEATHSIG), so killing an audit
— even with SIGKILL — leaves no orphan training on and racing a rerun. While runs execute, SIGTERM
is turned into KeyboardInterrupt: the workers are stopped and the command exits like on Ctrl-C
(finished runs saved, exit 130) instead of dying mid-write."""
from __future__ import annotations

import ctypes
import os
import signal
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from typing import Any, Callable, Sequence

from . import sigterm_interrupts, worker_died


def _die_with_parent(parent: int) -> None:
    """Worker initializer: ask the kernel to SIGKILL this worker when its parent dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)              # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):              # not Linux: fall back to the check below only
        pass
    if os.getppid() != parent:                     # the parent died before prctl took effect
        os._exit(1)
    # tqdm would create a multiprocessing lock here, registered with the parent's resource tracker;
    # a worker killed with its parent never unregisters it, and the tracker then prints a
    # "leaked semaphore" warning after the command ended. A worker only needs tqdm's thread lock.
    try:
        from tqdm.std import TqdmDefaultWriteLock
        TqdmDefaultWriteLock.mp_lock = None
    except ImportError:                            # another tqdm layout: keep its default
        pass


class LocalExecutor:
    """One pool of `workers` spawned processes, made at the first map that needs it and kept for
    the maps after it (an audit's training, evidence gate and diagnoses start workers once, not
    once per phase); `close()` ends it. A pool a dying worker broke is replaced at the next map."""

    def __init__(self, workers: int = 1):
        self.workers = max(1, workers)
        self._pool: ProcessPoolExecutor | None = None

    def map(self, fn: Callable[[Any], dict], jobs: Sequence[Any],
            on_done: Callable[[int, dict], None]) -> list[dict]:
        with sigterm_interrupts():
            return self._map(fn, jobs, on_done)

    @property
    def running(self) -> bool:
        """Whether its workers are up and whole (a map now starts none)."""
        return self._pool is not None and not getattr(self._pool, "_broken", False)

    def close(self) -> None:
        """End the workers (after the jobs they run); a later map starts new ones."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _kill(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.kill()
            pool.shutdown(wait=False, cancel_futures=True)

    def _map(self, fn: Callable[[Any], dict], jobs: Sequence[Any],
             on_done: Callable[[int, dict], None]) -> list[dict]:
        results: list[Any] = [None] * len(jobs)
        if self.workers <= 1 or (len(jobs) <= 1 and self._pool is None):
            for i, job in enumerate(jobs):
                results[i] = fn(job)
                on_done(i, results[i])
            return results
        if self._pool is None or getattr(self._pool, "_broken", False):
            self._kill()
            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=get_context("spawn"),
                                             initializer=_die_with_parent, initargs=(os.getpid(),))
        try:
            futures = {self._pool.submit(fn, job): i for i, job in enumerate(jobs)}
            for fut in as_completed(futures):
                i = futures[fut]
                try:
                    results[i] = fut.result()
                except Exception as err:  # noqa: BLE001 — a worker died (out of memory, killed)
                    results[i] = worker_died(err)
                on_done(i, results[i])
        except BaseException:                       # Ctrl-C / SIGTERM: stop every worker now
            self._kill()
            raise
        return results

    def __del__(self):                              # an executor dropped without close()
        try:
            self._kill()
        except Exception:  # noqa: BLE001 — at interpreter exit, modules may be gone
            pass
