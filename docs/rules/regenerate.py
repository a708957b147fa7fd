"""Regenerate docs/RULES.md's table: one `creditaudit audit --preset zoo` (extra arguments go to
it), then its sealed audit.json is copied to docs/rules/audit.json and its rules.md replaces the
text between the page's markers. Run from the repository root:

    python docs/rules/regenerate.py                  # the real table: every rule, 3 seeds, MNIST-1D
    python docs/rules/regenerate.py --seeds 42 --epochs 1    # a quick look

tests/test_zoo.py checks that the page's table is `rules_table` of docs/rules/audit.json.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from creditaudit.cli import main

ROOT = Path(__file__).resolve().parents[2]
OUT = "audits/zoo"
BEGIN, END = "<!-- rules:begin -->\n", "<!-- rules:end -->"


def splice(page: str, table: str) -> str:
    """`page` with the text between its markers replaced by `table`."""
    head, rest = page.split(BEGIN, 1)
    return head + BEGIN + table + END + rest.split(END, 1)[1]


if __name__ == "__main__":
    os.chdir(ROOT)                                           # the audit records out as audits/zoo
    status = main(["audit", "--preset", "zoo", "--out", OUT, "--quiet", *sys.argv[1:]])
    if status == 2 or not (ROOT / OUT / "audit.json").exists():
        sys.exit(status)                                     # a bad argument: nothing to copy
    shutil.copyfile(ROOT / OUT / "audit.json", ROOT / "docs" / "rules" / "audit.json")
    page = ROOT / "docs" / "RULES.md"
    page.write_text(splice(page.read_text(), (ROOT / OUT / "rules.md").read_text()))
    print(f"docs/RULES.md and docs/rules/audit.json regenerated from {OUT}")
