"""The report: a pure view of audit.json (and of the other experiments' JSON). Nothing here
measures or judges; every number, sentence and curve is read from the result dict, so
`creditaudit report AUDIT_DIR` rebuilds audit.md, report.html and the PNGs from audit.json alone.

    tables.py    Markdown tables, the compact terminal table, the other experiments' tables
    figures.py   the PNGs
    html.py      report.html
"""
from __future__ import annotations

from pathlib import Path

from .. import store
from .figures import FIGURES, FIGURE_MAKERS, render_figures
from .html import report_html
from .tables import audit_table, compact_table, recipe_comparison, rules_table

# -- everything -------------------------------------------------------------------------------
def write_report(audit: dict, out_dir: Path, previous: Path | None = None, executor=None) -> dict[str, Path]:
    """Write audit.md, rules.md (the rules table of docs/RULES.md), report.html and the figures into
    out_dir (each file atomically).

    Returns {file name: path}. `audit` is audit.json's content (as `experiments.read_audit` gives it).
    A figure is drawn only when what it shows changed: one in `previous` (default: out_dir) drawn
    from the same content by the same code is taken as it is (`figures.render_figures`). The text
    files are written every time: they show the command's wall time and what it trained anew.
    `executor`: the audit's local workers, to draw the figures in (`figures.render_figures`).
    """
    out_dir = Path(out_dir)
    audit = store.json_safe(audit)  # one form to read: NaN → None, inf → "inf", int keys → str
    pngs = render_figures(audit, list(FIGURE_MAKERS), out_dir if previous is None else previous, executor)
    paths: dict[str, Path] = {}
    for name, data in pngs.items():
        paths[name] = out_dir / name
        store.atomic_write_bytes(paths[name], data)
    figures = "\n".join(f"![{name}]({name})\n\n*{FIGURES[name]}*\n" for name in pngs)
    paths["audit.md"] = out_dir / "audit.md"
    store.atomic_write_text(paths["audit.md"], audit_table(audit) + "\n## Figures\n\n" + figures)
    paths["rules.md"] = out_dir / "rules.md"
    store.atomic_write_text(paths["rules.md"], rules_table(audit))
    paths["report.html"] = out_dir / "report.html"
    store.atomic_write_text(paths["report.html"], report_html(audit, pngs))
    return paths




__all__ = ["FIGURES", "audit_table", "compact_table", "recipe_comparison", "report_html", "rules_table",
           "write_report"]
