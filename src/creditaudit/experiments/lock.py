"""One process at a time per output folder: a second audit (or ladder, sweep) on the same folder
is refused at once instead of training the same runs twice and racing on their files."""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

from ..errors import CreditAuditError


@contextlib.contextmanager
def audit_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on <out>/.creditaudit.lock; the kernel drops it when the process dies."""
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(out) / ".creditaudit.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise CreditAuditError(f"cannot write to {out} ({err.strerror or err}); choose a writable --out") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise CreditAuditError(f"another creditaudit process (pid {holder}) is working on {out}; "
                                   "wait for it to finish, or use another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)
