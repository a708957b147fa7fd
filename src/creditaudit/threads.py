"""How many CPU threads torch computes with: the cores the machine's load leaves idle.

A small model at torch's default thread count (every core) on a busy machine can run 20× slower
than at one thread — OpenMP threads spin waiting for cores other processes hold (a 6-epoch digits
run measured 2255 s of wall time for 157 s of CPU on a busy 2-core machine); at 1–2 threads it
never crawls. The command line sets the count (`--threads`, default `idle_threads`); the Monitor,
inside a user's own process, lowers torch's count to it and says so (`guard_threads`).
"""
from __future__ import annotations

import os

import torch

from .errors import CreditAuditError


def idle_threads() -> int:
    """The cores the machine's load leaves idle: cores − round(1-minute load average), at least 1,
    at most 4 (more threads do not speed up the small models audited here)."""
    cores = os.cpu_count() or 1
    try:
        busy = round(os.getloadavg()[0])
    except OSError:                         # no load average (Windows): assume an idle machine
        busy = 0
    return max(1, min(4, cores - busy))


def guard_threads(threads: int | str | None = "auto") -> str | None:
    """Set torch's intra-op thread count for a run: an int, that many; "auto", `idle_threads`
    when torch would use more (never raised: a count the user lowered is theirs); None, left as
    it is. Returns the advice line to show when "auto" changed it, else None."""
    if threads is None:
        return None
    if threads == "auto":
        now, idle = torch.get_num_threads(), idle_threads()
        if now <= idle:
            return None
        torch.set_num_threads(idle)
        return (f"torch was set to {now} CPU threads with {idle} core(s) idle: set to {idle}, as "
                "`creditaudit` commands do (a busy machine at every core can run a small model 20× "
                "slower); pass threads=N to choose, threads=None to keep torch's setting")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise CreditAuditError(f"threads must be a number of CPU threads (≥ 1), \"auto\" or None, got "
                               f"{threads!r}")
    torch.set_num_threads(threads)
    return None
