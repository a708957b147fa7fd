"""Running or importing this file writes SENTINEL and then fails: the lint tests check that the
linter only parses it (SENTINEL must not exist afterwards) and still reports line 15."""
import os

SENTINEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lint_executed_me.txt")

with open(SENTINEL, "w") as fh:
    fh.write("creditaudit lint executed this file\n")

import creditaudit_lint_no_such_module  # noqa: E402,F401  (importing fails too)

raise SystemExit("creditaudit lint must never execute the files it checks")

import torch  # noqa: E402
torch.load("checkpoint.pt", weights_only=False)
