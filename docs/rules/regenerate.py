"""Regenerate docs/RULES.md's tables: the zoo audit under each rule's published recipe and under
the shared one (`creditaudit audit --preset zoo --recipe published|shared`; extra arguments go to
both), then the sealed audit.json files are copied to docs/rules/audit.json and
docs/rules/audit_shared.json, the published audit's rules.md replaces the text between the page's
rules markers and the side-by-side comparison (`report.recipe_comparison`) the text between its
recipes markers. Run from the repository root:

    python docs/rules/regenerate.py                  # the real tables: every rule, 3 seeds, MNIST-1D
    python docs/rules/regenerate.py --seeds 42 --epochs 1    # a quick look

The shared audit's folder (audits/zoo-shared) reads and writes its runs in the published audit's
runs folder (a link): the paper's seven train the same runs under both recipes, so they train once.
tests/test_zoo.py checks that the page's tables are the renderings of the committed audits.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from creditaudit.cli import main
from creditaudit.experiments import read_audit
from creditaudit.report import recipe_comparison

ROOT = Path(__file__).resolve().parents[2]
OUT = "audits/zoo"
BEGIN, END = "<!-- rules:begin -->\n", "<!-- rules:end -->"
RECIPES_BEGIN, RECIPES_END = "<!-- recipes:begin -->\n", "<!-- recipes:end -->"


def splice(page: str, table: str, begin: str = BEGIN, end: str = END) -> str:
    """`page` with the text between its markers `begin` and `end` replaced by `table`."""
    head, rest = page.split(begin, 1)
    return head + begin + table + end + rest.split(end, 1)[1]


def regenerate(args: list[str], root: Path = ROOT, out: str = OUT) -> int:
    """Both audits into `out` and `out`-shared under `root`, then `root`/docs/RULES.md and
    `root`/docs/rules/ from them. Returns the audits' exit status (the first one's, unrendered,
    when it could not write its audit.json)."""
    os.chdir(root)                                           # the audits record out as given
    shared, statuses = f"{out}-shared", []
    for folder, recipe in ((out, "published"), (shared, "shared")):
        if recipe == "shared" and not (root / shared / "runs").exists():
            (root / shared).mkdir(parents=True, exist_ok=True)
            (root / out / "runs").mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(root / out / "runs", root / shared), root / shared / "runs")
        status = main(["audit", "--preset", "zoo", "--out", folder, "--recipe", recipe, "--quiet", *args])
        if status == 2 or not (root / folder / "audit.json").exists():
            return status                                    # a bad argument: nothing to copy
        statuses.append(status)
    docs = root / "docs" / "rules"
    shutil.copyfile(root / out / "audit.json", docs / "audit.json")
    shutil.copyfile(root / shared / "audit.json", docs / "audit_shared.json")
    page = root / "docs" / "RULES.md"
    text = splice(page.read_text(), (root / out / "rules.md").read_text())
    comparison = recipe_comparison(read_audit(root / out), read_audit(root / shared))
    page.write_text(splice(text, comparison, RECIPES_BEGIN, RECIPES_END))
    print(f"docs/RULES.md, docs/rules/audit.json and docs/rules/audit_shared.json regenerated from "
          f"{out} and {shared}")
    return max(statuses)                                     # 3: some run failed or a verdict is incomplete


if __name__ == "__main__":
    sys.exit(regenerate(sys.argv[1:]))
