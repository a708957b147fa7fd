"""`creditaudit lint`: the static check of a researcher's own code."""
from __future__ import annotations

import sys


def cmd_lint(args) -> int:
    from ..lint import run_lint
    return run_lint(args.paths, sys.stdout)
