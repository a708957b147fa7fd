"""One process at a time per output folder: a second audit (or ladder, sweep, train) on the same
folder is refused at once instead of training the same runs twice and racing on their files.

The lock is `flock` on <out>/.creditaudit.lock. Two rules keep it sound when a command removes
the folders it made (a refused command leaves no debris): only the holder removes anything, and
it unlinks the lock file *before* it lets the lock go; a process that won the lock checks that
the file it locked is still the one at the path (it may have opened it just before the holder
unlinked it), and otherwise opens the new one and tries again.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator, Sequence

from ..errors import CreditAuditError

LOCK_FILE = ".creditaudit.lock"


class FolderBusy(CreditAuditError):
    """Another creditaudit process holds the output folder's lock."""


def _open_lock(out: Path) -> int:
    for _ in range(50):        # each retry: a holder removed the folder or its lock file meanwhile
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            continue
        except OSError as err:
            from ..runs import refuse_a_file_as_folder     # the error path only: runs imports torch
            refuse_a_file_as_folder(out)
            raise CreditAuditError(f"cannot write to {out} ({err.strerror or err}); choose a "
                                   "writable --out") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise FolderBusy(f"another creditaudit process (pid {holder}) is working on {out}; "
                             "wait for it to finish, or use another --out") from None
        try:
            now = os.stat(out / LOCK_FILE)
            mine = os.fstat(fd)
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)           # we locked a file its holder had just unlinked: not the lock
    raise CreditAuditError(f"cannot lock {out}: its lock file keeps disappearing (another process "
                           "is removing it); use another --out")


@contextlib.contextmanager
def audit_lock(out: Path, made: Sequence[Path] = ()) -> Iterator[None]:
    """Hold an exclusive lock on <out>/.creditaudit.lock (the kernel drops it when the process
    dies); FolderBusy when another process holds it. `made`: the folders this command created,
    innermost first — on exit they are removed again, under the lock, if they hold nothing but it."""
    out = Path(out)
    fd = _open_lock(out)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        try:
            if made and out.is_dir() and {p.name for p in out.iterdir()} <= {LOCK_FILE}:
                (out / LOCK_FILE).unlink(missing_ok=True)      # before the lock is let go
                for folder in made:
                    with contextlib.suppress(OSError):
                        folder.rmdir()
        finally:
            os.close(fd)
