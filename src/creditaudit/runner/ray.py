"""The Ray executor: each job is a Ray task, on this machine or on a Ray cluster (docs/RAY.md).

A task asks for one CPU (and `gpus_per_job` GPUs) and is retried by Ray, up to `max_retries`
times, when its worker process dies (killed, out of memory, node lost). A retried training job
resumes from its run folder's last checkpoint, because `train_job` always does. Workers write run
folders exactly as local workers do, so the output folder must be on a filesystem that every node
of the cluster mounts at the same path; nothing is shipped back but the job's small record.

Connecting: `address=None` starts a local Ray instance with every core of this machine (or reuses
one that is already running in this process) and shuts it down when the executor is done with it
(`close()`, or when the executor is garbage-collected, at the latest at exit); `address="auto"` or
"HOST:PORT" joins an existing cluster, which is left running.
"""
from __future__ import annotations

import logging
import os
import re
import socket
import time
import weakref
from typing import Any, Callable, Sequence

from ..errors import CreditAuditError
from . import sigterm_interrupts, worker_died

INSTALL = 'pip install "creditaudit[ray]"'
WAIT_S = 0.5          # how often the driver wakes up while waiting (keeps Ctrl-C prompt)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise CreditAuditError(
            f"the ray executor needs Ray, which is not installed: {INSTALL}") from None
    return ray


def run_in_worker(fn: Callable[[Any], dict], job: Any, cwd: str) -> dict:
    """The Ray task: `fn(job)` in the driver's working directory where this node has it, so that
    relative paths (the output and data folders) mean what they mean on the driver."""
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    return fn(job)


def _check_reachable(address: str, timeout: float = 10.0) -> None:
    """Fail fast on a HOST:PORT nobody listens on (Ray itself would retry for minutes)."""
    host, _, port = address.rpartition("://")[2].rpartition(":")
    if not host or not port.isdigit():
        return                                      # "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as err:
        raise ConnectionError(f"{host}:{port} does not answer: {err.strerror or err}") from None


def _shutdown(ray, state: dict) -> None:
    """Shut down the local Ray instance this executor started (and only that)."""
    if state.get("started"):
        state["started"] = False
        if ray.is_initialized():
            ray.shutdown()


def task_raised(err: BaseException) -> dict:
    """The record of a task whose function raised (job functions never should)."""
    cause = getattr(err, "cause", None)
    what = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else type(err).__name__
    message = f"raised in a Ray worker: {what}"
    text = re.sub(r"\x1b\[[0-9;]*m", "", getattr(err, "traceback_str", None) or str(err))
    return {"status": "failed", "message": message, "error": message, "traceback": text,
            "trained": True}


class RayExecutor:
    def __init__(self, address: str | None = None, max_retries: int = 3, gpus_per_job: float = 0.0):
        self.ray = _import_ray()
        if not isinstance(max_retries, int) or max_retries < 0:
            raise CreditAuditError(f"max_retries must be an integer ≥ 0, got {max_retries!r}")
        self.address = address or None
        self.max_retries = max_retries
        self.gpus_per_job = float(gpus_per_job or 0.0)
        self._state: dict[str, bool] = {"started": False}
        self._finalizer = weakref.finalize(self, _shutdown, self.ray, self._state)

    # -- connection -------------------------------------------------------------------------------
    def connect(self) -> None:
        """Join the cluster at `address` (or $RAY_ADDRESS), or start a local Ray instance; reuse
        one already up in this process."""
        ray = self.ray
        if ray.is_initialized():
            return
        quiet = dict(log_to_driver=False, logging_level=logging.WARNING)
        address = self.address or os.environ.get("RAY_ADDRESS") or None
        try:
            if address is None:
                ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, **quiet)
                self._state["started"] = True
            else:
                _check_reachable(address)
                ray.init(address=address, **quiet)
        except ConnectionError as err:
            token = ("; if the cluster uses token authentication, also set RAY_AUTH_MODE=token"
                     if address != "auto" and not os.environ.get("RAY_AUTH_MODE") else "")
            raise CreditAuditError(f"cannot reach the Ray cluster at {address!r} ({err}); start it "
                                   "with `ray start --head` (docs/RAY.md), or leave out --address to "
                                   f"run Ray on this machine alone{token}") from None

    def close(self) -> None:
        """Shut down the local Ray instance this executor started; a cluster is left running."""
        _shutdown(self.ray, self._state)

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the Executor protocol --------------------------------------------------------------------
    def map(self, fn: Callable[[Any], dict], jobs: Sequence[Any],
            on_done: Callable[[int, dict], None]) -> list[dict]:
        """fn over jobs as Ray tasks; results in job order, on_done(i, result) as each finishes."""
        results: list[Any] = [None] * len(jobs)
        if not jobs:
            return results
        self.connect()
        gpus = self.ray.cluster_resources().get("GPU", 0)
        if self.gpus_per_job > gpus:
            self.close()
            raise CreditAuditError(f"each run asks for {self.gpus_per_job:g} GPU but the Ray cluster has "
                                   f"{gpus:g}; start its nodes with GPUs (ray start --num-gpus N) or "
                                   "train on CPU (--device cpu)")
        with sigterm_interrupts():
            return self._map(fn, jobs, on_done, results)

    def _map(self, fn, jobs, on_done, results: list) -> list[dict]:
        ray = self.ray
        pending: list = []
        try:
            task = ray.remote(num_cpus=1, num_gpus=self.gpus_per_job, max_retries=self.max_retries,
                              retry_exceptions=False)(run_in_worker)
            cwd = os.getcwd()
            name = getattr(fn, "__name__", "job")
            index = {}
            for i, job in enumerate(jobs):
                ref = task.options(name=f"{name}[{i}]").remote(fn, job, cwd)
                index[ref] = i
                pending.append(ref)
            while pending:
                done, pending = ray.wait(pending, num_returns=len(pending), timeout=WAIT_S,
                                         fetch_local=True)
                for ref in sorted(done, key=index.__getitem__):
                    i = index[ref]
                    results[i] = self._result(ref)
                    on_done(i, results[i])
        except BaseException:          # Ctrl-C, SIGTERM, a failing on_done: stop every task still out
            self._cancel(pending)
            self.close()
            raise
        return results

    def _result(self, ref) -> dict:
        ray = self.ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as err:      # the job function raised (never by design)
            return task_raised(err)
        except ray.exceptions.RayError as err:          # worker died after max_retries, node lost, OOM
            return worker_died(err)

    def _cancel(self, refs) -> None:
        ray = self.ray
        for ref in refs:
            try:
                ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001 — already finished, or Ray itself is going down
                pass
        if refs:
            time.sleep(0.1)    # let the raylet deliver the kills before a shutdown tears it down
