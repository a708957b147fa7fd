"""report.html: one self-contained page (inline CSS, figures as data URIs) from the audit JSON."""
from __future__ import annotations

import base64
import html
from typing import Sequence

from ..verdict import verdict_of
from .figures import FIGURES
from .format import _method_name
from .tables import (PER_SEED_COLUMNS, VERDICT_MEANINGS, _audit_tables, _legend, _meta, _notes,
                     headline, method_story,
                     _per_seed_cells, _same_rows, _sensitivity_cells, _strategy_cells, _unfinished,
                     verdict_summary)

_CSS = """
body { font-family: -apple-system, "Segoe UI", "DejaVu Sans", Helvetica, Arial, sans-serif;
       margin: 20px 24px; color: #222; font-size: 14px; line-height: 1.45; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 18px; margin-top: 28px;
     border-bottom: 1px solid #ccc; padding-bottom: 3px; } h3 { font-size: 15px; margin: 14px 0 4px; }
.header { font-size: 15px; } .meta { color: #666; font-size: 12px; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; }
th, td { border: 1px solid #bbb; padding: 4px 6px; text-align: right; white-space: nowrap;
         font-variant-numeric: tabular-nums; }
th { background: #eef1f5; text-align: center; white-space: normal; }
td:first-child, th:first-child { text-align: left; font-weight: 600; }
td.ok { background: #d7f0d9; color: #125c1b; text-align: left; }
td.bad { background: #f8d4d4; color: #8a1010; text-align: left; }
td.warn { background: #fbf0cf; color: #6b4a00; text-align: left; }
td.wrap { white-space: normal; min-width: 110px; max-width: 220px; text-align: left; }
td.left { text-align: left; }
td.na { color: #999; background: #f4f4f4; }
.summary { font-size: 17px; font-weight: 600; margin: 10px 0 4px; }
dl.meanings { font-size: 13px; margin: 4px 0 10px; max-width: 1000px; }
dl.meanings dt { font-weight: 600; float: left; clear: left; width: 95px; }
dl.meanings dd { margin: 0 0 4px 100px; }
table.audit { font-size: 12px; }
tr.total td { font-weight: 600; background: #f6f6f6; }
ul.legend { color: #555; font-size: 12px; padding-left: 18px; }
ul.failed li { color: #8a1010; }
figure { margin: 18px 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { color: #555; font-size: 12px; max-width: 1000px; }
"""


# a verdict's outcome, or a reporting strategy's conclusion ("accept" / "walk back"), → cell colour
_OUTCOME_CLASS = {"trustworthy": "ok", "accept": "ok", "walk back": "bad", "incomplete": "warn"}


def _verdict_class(row: dict, rule: str) -> str:
    """"ok" / "bad" / "warn" / "" from a row's structured verdict (never from its text)."""
    try:
        return _OUTCOME_CLASS.get(verdict_of(row, rule).outcome, "")
    except (ValueError, KeyError, TypeError):
        return ""


def _html_table(head: Sequence[str], rows: Sequence[Sequence[str]], total_last: bool = False,
                wrap: Sequence[int] = (), breaks: dict[int, tuple[str, str]] | None = None,
                left: Sequence[int] = (), css_class: str = "",
                classes: dict[tuple[int, int], str] | None = None) -> str:
    """An HTML table of escaped cells; `wrap` columns may wrap, `breaks` {column: (separator,
    its replacement with a <br>)} splits wide cells over lines, `classes` {(row, column): "ok",
    "bad" or "na" (greyed: not to be read as evidence)} colours a cell."""
    breaks, classes = breaks or {}, classes or {}
    out = [f'<table class="{css_class}">' if css_class else "<table>", "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for i, row in enumerate(rows):
        cls = ' class="total"' if total_last and i == len(rows) - 1 else ""
        cells = []
        for j, cell in enumerate(row):
            klass = " ".join(c for c in (classes.get((i, j), ""),
                                         "wrap" if j in wrap else "",
                                         "left" if j in left else "") if c)
            cells.append(f'<td class="{klass}">' if klass else "<td>")
            text = html.escape(cell)
            if j in breaks:
                text = text.replace(*breaks[j])
            cells[-1] += text + "</td>"
        out.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
    return "\n".join(out + ["</table>"])


def _reproduction_html(audit: dict) -> list[str]:
    """The paper's numbers beside ours (report/reproduction.py), for an audit that reproduces a rule."""
    from .reproduction import budget_line, comparison
    rep = audit.get("reproduction")
    if not rep:
        return []
    e = html.escape
    head = ["method", "paper's test error %", "source", "ours % (final epoch)", "seeds", "difference",
            "outcome"]
    cells = [[r["method"], "—" if r["paper"] is None else f"{r['paper']:.2f}"
              + ("" if r["paper_sd"] is None else f" ± {r['paper_sd']:.2f}"),
              r["source"] + (f"; {r['selection']}" if r["selection"] else ""),
              "—" if r["ours"] is None else f"{r['ours']:.2f}" + ("" if r["ours_sd"] is None else f" ± {r['ours_sd']:.2f}"),
              str(r["seeds"]), "—" if r["difference"] is None else f"{r['difference']:+.2f}", r["outcome"]]
             for r in comparison(audit)]
    parts = ["<h2>Reproduction</h2>",
             f"<p>{e(rep['rule'])} as in {e(rep['citation'])}: {e(rep['dataset'])}, {e(rep['network'])}; "
             f"{e(rep['recipe'])}. Reference code: {e(rep['code'])}.</p>",
             f"<p>{e(budget_line(rep))}.</p>", _html_table(head, cells, wrap=(2,), left=(2,))]
    if rep.get("deviations"):
        parts.append("<p>Where this run differs from the paper:</p><ul>"
                     + "".join(f"<li>{e(d)}</li>" for d in rep["deviations"]) + "</ul>")
    return parts


def report_html(audit: dict, pngs: dict[str, bytes]) -> str:
    """One self-contained HTML page: inline CSS, the tables, the reasons, the figures as data URIs."""
    e = html.escape
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             "<title>creditaudit report</title>", f"<style>{_CSS}</style></head><body>",
             "<h1>Credit-assignment audit</h1>",
             f'<p class="header">{e(str(audit.get("header") or ""))}</p>']
    if _meta(audit):
        parts.append(f'<p class="meta">{e(_meta(audit))}</p>')
    parts.append(f'<p class="summary">{e(verdict_summary(audit))}</p>')
    parts.append('<dl class="meanings">' + "".join(f"<dt>{e(name)}</dt><dd>{e(meaning)}</dd>"
                                                   for name, meaning in VERDICT_MEANINGS) + "</dl>")
    parts += _reproduction_html(audit)
    parts.append("<h2>Audit</h2>")
    methods = audit.get("methods") or []
    for title, head, cells in _audit_tables(audit):
        verdicts = {j: rule for j, col in enumerate(head)
                    for rule in [{"verdict": "project", "paper's rule": "paper"}.get(col)] if rule}
        first = [i for i, col in enumerate(head) if col.startswith("first fire")]
        # long text wraps too, so that a table fits a 1280-px page without a scroll bar
        prose = [i for i, col in enumerate(head)
                 if col.startswith("(d) acc") or col in ("(d) decision", "optimiser and schedule",
                                                         "where it is published")]
        classes = {(i, j): _verdict_class(row, rule) for i, row in enumerate(methods)
                   for j, rule in verdicts.items()}
        # Γ marked uninterpretable ((b) or (b′) fired): its cells greyed, its z not shown
        # and so is a deep Γ whose every position is exact by construction (bp's)
        classes.update({(i, j): "na" for i, row in enumerate(methods)
                        if row.get("gamma_interpretable") is False or row.get("gamma_deep_exact")
                        for j, col in enumerate(head) if col in ("deep Γ", "Γ null (z)")})
        parts += [f"<h3>{e(title)}</h3>", '<div class="scroll">' + _html_table(
            head, cells, wrap=list(verdicts) + first + prose, breaks={i: ("; ", "<br>") for i in first},
            left=first, css_class="audit", classes=classes) + "</div>" if cells else "<p>(no methods)</p>"]
    seeds = [s for row in methods for s in (row.get("per_seed") or {}).values()]
    last = len(PER_SEED_COLUMNS) - 1
    parts += ["<h3>Per seed</h3>", '<div class="scroll">' + _html_table(
        PER_SEED_COLUMNS, _per_seed_cells(audit), wrap=[last],
        classes={(i, last): _verdict_class(s, "project") for i, s in enumerate(seeds)}) + "</div>",
        '<ul class="legend">' + "".join(f"<li>{e(line)}</li>" for line in _legend(audit))
        + "".join(f"<li><b>note</b>: {e(line)}</li>" for line in _same_rows(audit)) + "</ul>"]
    unfinished = _unfinished(audit)
    if unfinished:
        parts += ["<h3>Runs that did not finish normally</h3>", '<ul class="failed">']
        parts += [f"<li><b>{e(label)}</b> ({e(status)}): {e(message)}</li>"
                  for label, status, message in unfinished]
        parts.append("</ul>")
    head, rows = _strategy_cells(audit)
    parts += ["<h2>Reporting strategies</h2>",
              "<p>What each way of reporting concludes about a method: accuracy only accepts every "
              "result; accuracy + Γ accepts when the mean Γ is positive; the full protocol is the "
              "project verdict.</p>", _html_table(head, rows, total_last=True, classes={
                  (i, j): _OUTCOME_CLASS.get(cell, "") for i, row in enumerate(rows[:-1])
                  for j, cell in enumerate(row)})]
    parts.append("<h2>Reasons</h2>")
    notes = _notes(audit)
    for row in audit.get("methods") or []:
        verdict = headline(row)
        color = {"ok": "#125c1b", "bad": "#8a1010", "warn": "#6b4a00"}.get(_verdict_class(row, "project"), "#222")
        parts.append(f'<h3>{e(_method_name(row))} — <span style="color:{color}">{e(verdict)}</span></h3>')
        items = [] if row.get("reasons") else ["no flag fired."]
        items += [(f"<i>{e(prefix.rstrip(': '))}</i>: " if prefix else "") + e(text)    # each reason once
                  for prefix, text in method_story(row, notes.get(str(row.get("method")), []))]
        parts.append("<ul>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>")
    head, rows = _sensitivity_cells(audit)
    parts.append("<h2>Threshold sensitivity</h2>")
    if rows:
        parts += ["<p>For each threshold, the interval over which every verdict stays as it is now: "
                  "for a per-run statistic, where every run's flag stays; for depth_margin, where "
                  "every method's (d) decision stays, re-decided at each margin.</p>",
                  _html_table(head, rows)]
    else:
        parts.append("<p>(not available: no run was diagnosed)</p>")
    parts.append("<h2>Figures</h2>")
    for name, data in pngs.items():
        uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
        caption = FIGURES.get(name, name)
        parts.append(f'<figure><img src="{uri}" alt="{e(name)}: {e(caption)}">'
                     f"<figcaption><b>{e(name)}</b> — {e(caption)}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


