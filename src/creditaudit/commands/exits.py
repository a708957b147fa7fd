"""Exit statuses, and what a command says of runs that failed: retry only what a retry can fix."""
from __future__ import annotations

import sys

EXIT_USER_ERROR, EXIT_WALK_BACK, EXIT_INCOMPLETE, EXIT_INTERRUPTED = 2, 1, 3, 130


# a failure that may pass on a second try (the disk, the machine); any other failure repeats
_TRANSIENT = ("cannot write", "interrupted", "worker", "killed", "out of memory")


def failed_runs_advice(failed: list[dict], where: str) -> str:
    """One clause for failed runs: retry only what a retry can fix; otherwise say what to change."""
    transient = [r for r in failed if any(t in str(r.get("message", "")).lower() for t in _TRANSIENT)]
    if len(transient) == len(failed):
        return (f"{len(failed)} run(s) failed (listed in {where}); run the same command again to "
                "retry them — finished runs are reused")
    first = next(r for r in failed if r not in transient)
    message = " ".join(str(first.get("message", "")).split())
    message = message if len(message) <= 240 else message[:237] + "..."
    return (f"{len(failed)} run(s) failed (listed in {where}); they fail the same way on a rerun "
            f"until the cause is changed — first: {first.get('label')}: {message}")


def experiment_exit(result: dict, where: str) -> int:
    """0 when every run of a ladder or sweep ended; else one line and exit 3 (as the audit)."""
    failed = [r for r in result.get("runs") or [] if r["status"] not in ("finished", "stopped", "diverged")]
    if not failed:
        return 0
    every = " (every run)" if len(failed) == len(result["runs"]) else ""
    print(f"creditaudit: {failed_runs_advice(failed, where)}{every} — exit status 3: the result is "
          "not complete", file=sys.stderr)
    return EXIT_INCOMPLETE
