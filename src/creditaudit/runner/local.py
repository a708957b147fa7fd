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
    def __init__(self, workers: int = 1):
        self.workers = max(1, workers)

    def map(self, fn: Callable[[Any], dict], jobs: Sequence[Any],
            on_done: Callable[[int, dict], None]) -> list[dict]:
        with sigterm_interrupts():
            return self._map(fn, jobs, on_done)

    def _map(self, fn: Callable[[Any], dict], jobs: Sequence[Any],
             on_done: Callable[[int, dict], None]) -> list[dict]:
        results: list[Any] = [None] * len(jobs)
        if self.workers <= 1 or len(jobs) <= 1:
            for i, job in enumerate(jobs):
                results[i] = fn(job)
                on_done(i, results[i])
            return results
        pool = ProcessPoolExecutor(max_workers=min(self.workers, len(jobs)),
                                   mp_context=get_context("spawn"), initializer=_die_with_parent,
                                   initargs=(os.getpid(),))
        try:
            futures = {pool.submit(fn, job): i for i, job in enumerate(jobs)}
            for fut in as_completed(futures):
                i = futures[fut]
                try:
                    results[i] = fut.result()
                except Exception as err:  # noqa: BLE001 — a worker died (out of memory, killed)
                    results[i] = worker_died(err)
                on_done(i, results[i])
        except BaseException:                       # Ctrl-C / SIGTERM: stop every worker now
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.kill()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        return results
