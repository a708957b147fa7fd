"""Regenerate docs/REPRODUCTIONS.md: each rule in its paper's setting (`creditaudit reproduce RULE`,
papers.py), the sealed audit.json of each copied to docs/reproductions/RULE.json, and the page's
table (`report.reproduction.reproductions_page`) written between its markers. The findings below
the table are written by hand. Run from the repository root:

    python docs/reproductions/regenerate.py --data-dir DATA                     # every rule, the papers' budgets
    python docs/reproductions/regenerate.py --data-dir DATA --rules pepita dfa --seeds 42
    python docs/reproductions/regenerate.py --data-dir DATA --epochs pepita=20   # a stated reduced budget
    python docs/reproductions/regenerate.py --page-only                          # the page from the copies

Runs are reused (audits/reproduce/RULE/runs), so an interrupted regeneration resumes. On a GPU,
docs/reproductions/parallel.py runs several rules at once inside a deadline (benchmarks/gpu_session.sh).
tests/test_reproduce.py checks that the page's table is the rendering of the committed copies.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from creditaudit.cli import main
from creditaudit.experiments import read_audit
from creditaudit.papers import PAPERS
from creditaudit.report.reproduction import reproductions_page

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- reproductions:begin -->\n", "<!-- reproductions:end -->"


def splice(page: str, table: str) -> str:
    head, rest = page.split(BEGIN, 1)
    return head + BEGIN + table + END + rest.split(END, 1)[1]


def copies(root: Path = ROOT) -> dict[str, dict]:
    """The committed audits, in papers.py's order, integrity-checked."""
    folder = root / "docs" / "reproductions"
    return {rule: read_audit(folder / f"{rule}.json") for rule in PAPERS
            if (folder / f"{rule}.json").exists()}


def write_page(root: Path = ROOT) -> None:
    page = root / "docs" / "REPRODUCTIONS.md"
    page.write_text(splice(page.read_text(), reproductions_page(copies(root))))


def regenerate(argv: list[str], root: Path = ROOT) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rules", nargs="+", default=list(PAPERS), choices=list(PAPERS))
    p.add_argument("--seeds", nargs="+", default=["42"])
    p.add_argument("--epochs", nargs="+", default=[], metavar="RULE=N",
                   help="a reduced budget for a rule (the page says so)")
    p.add_argument("--data-dir", default="data")
    p.add_argument("--page-only", action="store_true")
    args = p.parse_args(argv)
    os.chdir(root)
    epochs = dict(item.split("=", 1) for item in args.epochs)
    status = 0
    if not args.page_only:
        for rule in args.rules:
            out = f"audits/reproduce/{rule}"
            command = ["reproduce", rule, "--seeds", *args.seeds, "--out", out, "--data-dir", args.data_dir,
                       "--quiet", *(["--epochs", epochs[rule]] if rule in epochs else [])]
            code = main(command)
            if code == 2 or not (root / out / "audit.json").exists():
                print(f"{rule}: no audit written (exit {code}); its row is left as it was", file=sys.stderr)
                status = status or code
                continue
            shutil.copyfile(root / out / "audit.json", root / "docs" / "reproductions" / f"{rule}.json")
    write_page(root)
    print("docs/REPRODUCTIONS.md regenerated from docs/reproductions/*.json")
    return status


if __name__ == "__main__":
    sys.exit(regenerate(sys.argv[1:]))
