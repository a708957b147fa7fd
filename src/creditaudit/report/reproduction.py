"""The paper's numbers beside ours, for an audit that reproduces a rule in its paper's setting
(`creditaudit reproduce`; the paper's facts are sealed in audit.json's "reproduction").

    ours        test error (%) = 100 · (1 − test accuracy) at the final epoch, mean ± sd over seeds
    difference  ours − the paper's, in points
    outcome     "within its spread" when |difference| ≤ the paper's sd (0.5 points where it gives
                none), "miss" beyond it; a run cut short of the paper's epochs is "reduced budget",
                whose miss says nothing about the paper; a paper number that could not be read at
                its source is "paper's number unverified", and one the paper does not give (or
                that could not be found) leaves ours alone with "no paper number".
"""
from __future__ import annotations

import math
from typing import Any




def _ours(row: dict | None) -> tuple[float | None, float | None, int]:
    """(mean error %, sd %, seeds finished) of an audit row."""
    if row is None:
        return None, None, 0
    accs = [s.get("acc") for s in (row.get("per_seed") or {}).values()
            if s.get("status") == "finished" and isinstance(s.get("acc"), (int, float))
            and math.isfinite(s["acc"])]
    if not accs:
        return None, None, 0
    errs = [100.0 * (1.0 - a) for a in accs]
    mean = sum(errs) / len(errs)
    sd = math.sqrt(sum((e - mean) ** 2 for e in errs) / (len(errs) - 1)) if len(errs) > 1 else None
    return mean, sd, len(errs)


def comparison(audit: dict) -> list[dict[str, Any]]:
    """One row per method the paper reports (the rule, then bp): the paper's error, ours, the
    difference and its reading. Empty for an audit that reproduces nothing."""
    rep = audit.get("reproduction")
    if not rep:
        return []
    rows = {r["method"]: r for r in audit.get("methods", [])}
    out = []
    methods = [rep["rule"]] + (["bp"] if rep["rule"] != "bp" else [])
    for method, paper in zip(methods, (rep.get("reported"), rep.get("bp"))):
        mean, sd, n = _ours(rows.get(method))
        paper = paper or {}
        error = paper.get("error")
        diff = None if mean is None or error is None else mean - error
        if mean is None:
            outcome = "no finished run"
        elif error is None:
            outcome = "no paper number"
        elif rep.get("reduced_budget"):
            outcome = "reduced budget"
        elif not paper.get("verified", True):
            outcome = "paper's number unverified"
        else:
            outcome = "within its spread" if abs(diff) <= paper["spread"] + 1e-9 else "miss"
        out.append({"method": method, "paper": error, "paper_sd": paper.get("sd"),
                    "paper_seeds": paper.get("seeds"), "source": paper.get("source") or "—",
                    "selection": paper.get("selection") or "", "spread": paper.get("spread"),
                    "verified": paper.get("verified", error is not None),
                    "ours": mean, "ours_sd": sd, "seeds": n, "difference": diff, "outcome": outcome})
    return out


def _pct(mean: float | None, sd: float | None) -> str:
    if mean is None:
        return "—"
    return f"{mean:.2f}" + ("" if sd is None else f" ± {sd:.2f}")


def _signed(x: float | None) -> str:
    return "—" if x is None else f"{x:+.2f}"


def budget_line(rep: dict) -> str:
    """What ran against what the paper ran."""
    seeds = f"{rep['seeds']} seed{'s' if rep['seeds'] != 1 else ''}"
    if rep.get("reduced_budget"):
        return (f"reduced budget: {rep['epochs']} of the paper's {rep['paper_epochs']} epochs, {seeds} "
                "— a difference here says nothing about the paper")
    return f"the paper's budget: {rep['epochs']} epochs, {seeds}"


def reproduction_markdown(audit: dict) -> list[str]:
    """audit.md's "Reproduction" section (empty list when the audit reproduces nothing)."""
    rep = audit.get("reproduction")
    if not rep:
        return []
    lines = ["## Reproduction", "",
             f"{rep['rule']} as in {rep['citation']}: {rep['dataset']}, {rep['network']}; "
             f"{rep['recipe']}" + (f" ({rep['recipe_citation']})" if rep.get("recipe_citation") else "")
             + f". Reference code: {rep['code']}.", "", budget_line(rep) + ".", "",
             "| method | paper's test error % | source | ours % (final epoch) | seeds | difference | outcome |",
             "|---|---|---|---|---|---|---|"]
    for r in comparison(audit):
        paper = _pct(r["paper"], r["paper_sd"]) + (f" ({r['paper_seeds']} runs)" if r["paper_seeds"] else "")
        source = r["source"] + (f"; {r['selection']}" if r["selection"] else "")
        lines.append(f"| {r['method']} | {paper} | {source} | {_pct(r['ours'], r['ours_sd'])} | {r['seeds']} "
                     f"| {_signed(r['difference'])} | {r['outcome']} |")
    lines += ["", f"Outcome: within its spread when |difference| ≤ the paper's sd (0.5 points where it "
                  "gives none); ours is the final epoch's test error."]
    if rep.get("deviations"):
        lines += ["", "Where this run differs from the paper:", ""]
        lines += [f"- {d}" for d in rep["deviations"]]
    return lines + [""]


def reproduction_terminal(audit: dict) -> list[str]:
    """The terminal's lines: one per method, then the budget."""
    rep = audit.get("reproduction")
    if not rep:
        return []
    lines = [f"reproduction of {rep['rule']} ({rep['citation']}):"]
    for r in comparison(audit):
        lines.append(f"  {r['method']:<14} paper {_pct(r['paper'], r['paper_sd'])} %  ours "
                     f"{_pct(r['ours'], r['ours_sd'])} % over {r['seeds']} seed{'s' if r['seeds'] != 1 else ''}"
                     f"  difference {_signed(r['difference'])}  {r['outcome']}")
    lines.append("  " + budget_line(rep))
    return lines





def _verdict(audit: dict, method: str) -> str:
    from ..verdict import verdict_of
    row = next((r for r in audit.get("methods", []) if r["method"] == method), None)
    if row is None:
        return "—"
    v = verdict_of(row)
    return v.outcome + (f" ({', '.join(v.fired)})" if getattr(v, "fired", None) else "")


def _frozen(audit: dict, method: str) -> str:
    row = next((r for r in audit.get("methods", []) if r["method"] == method), None)
    acc = None if row is None else row.get("frozen_acc")
    return "—" if not isinstance(acc, (int, float)) else f"{100 * (1 - acc):.2f}"


def train_seconds(audit: dict) -> float | None:
    """The training seconds of the audit's runs, summed (a stack counted once)."""
    seen, total = set(), 0.0
    for run in audit.get("runs", []):
        secs = run.get("train_seconds")
        stack = (run.get("stack") or {}).get("id")
        if not isinstance(secs, (int, float)):
            return None
        key = ("stack", stack) if stack is not None and (run.get("stack") or {}).get("size", 1) > 1 \
            else ("run", run["key"])
        if key not in seen:
            seen.add(key)
            total += secs
    return total


def reproductions_page(audits: dict[str, dict]) -> str:
    """docs/REPRODUCTIONS.md's generated part: one summary row per rule reproduced (its audit.json,
    by rule), then each rule's setting, sources and deviations."""
    head = ["rule", "setting", "paper: rule / bp (test error %)", "ours: rule / bp", "difference (rule)",
            "outcome", "rule's frozen control (random features), error %", "verdict (rule)", "budget"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    details = []
    for rule, audit in audits.items():
        rep = audit["reproduction"]
        rows = {r["method"]: r for r in comparison(audit)}
        mine, bp = rows.get(rule), rows.get("bp")
        mark = lambda r: "" if r is None or r["paper"] is None or r["verified"] else " (unverified)"
        paper = (f"{_pct(mine['paper'], mine['paper_sd'])}{mark(mine)} / "
                 + ("—" if bp is None else _pct(bp["paper"], bp["paper_sd"]) + mark(bp)))
        ours = (f"{_pct(mine['ours'], mine['ours_sd'])} / "
                + ("—" if bp is None else _pct(bp["ours"], bp["ours_sd"])))
        secs = train_seconds(audit)
        budget = (f"{rep['epochs']}/{rep['paper_epochs']} epochs, {rep['seeds']} seed"
                  f"{'s' if rep['seeds'] != 1 else ''}" + ("" if secs is None else f", {secs / 60:.0f} min"))
        lines.append(f"| {rule} | {rep['dataset']}, {rep['network']} | {paper} | {ours} | "
                     f"{_signed(mine['difference'])} | {mine['outcome']} | {_frozen(audit, rule)} | "
                     f"{_verdict(audit, rule)} | {budget} |")
        details += [f"### {rule}", "",
                    f"- **Paper:** {rep['citation']}; its number: {mine['source']}"
                    + (f" ({mine['selection']})" if mine["selection"] else "") + "."
                    + ("" if bp is None else f" bp: {bp['source']}."),
                    f"- **Setting:** {rep['dataset']}, {rep['network']}; {rep['recipe']}"
                    + (f" ({rep['recipe_citation']})" if rep.get("recipe_citation") else "") + ".",
                    f"- **Reference code:** {rep['code']}.",
                    f"- **Ran:** {budget_line(rep)}; machine: {rep.get('machine') or 'not recorded'}.",
                    f"- **Verdicts in this setting:** {rule} {_verdict(audit, rule)}; bp {_verdict(audit, 'bp')}."]
        details += [f"- **Differs from the paper:** {d}" for d in rep.get("deviations", [])]
        details.append("")
    return "\n".join(lines + [""] + details)
