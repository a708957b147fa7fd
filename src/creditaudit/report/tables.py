"""The tables: the audit (Markdown and a compact terminal view), the reporting strategies, the
reasons, threshold sensitivity, and one table per other experiment — all read from result JSON."""
from __future__ import annotations

import math
import re
import textwrap
from collections import Counter
from typing import Sequence

from .. import store
from ..errors import CreditAuditError
from ..verdict import verdict_of
from .format import (_f, _first_fire, _g, _gamma_cells, _markdown, _method_name, _pct, _recipe, _sci,
                     _signed)

def _ci(interval: dict | None, scale: float = 100.0, signed: bool = True) -> str:
    """A mean with its 95 % t-interval (and bootstrap interval when present), e.g. "+3.1 [+1.0, +5.2]"."""
    if not isinstance(interval, dict) or _f(interval.get("mean")) is None:
        return "—"
    fmt = (lambda v: f"{scale * v:+.1f}") if signed else (lambda v: f"{scale * v:.1f}")
    text = fmt(_f(interval["mean"]))
    for key, tag in (("t_interval", ""), ("bootstrap_interval", "boot ")):
        iv = interval.get(key)
        if iv and _f(iv[0]) is not None and _f(iv[1]) is not None:
            text += f" {tag}[{fmt(_f(iv[0]))}, {fmt(_f(iv[1]))}]"
    return text


def _gap_cell(depth: dict | None) -> str:
    """(d)'s paired gaps: per seed, then the mean with its one-sided 95 % bounds, in points:
    "+6.4, +4.2 → +5.3 [−2.5, +13.1]"."""
    if not isinstance(depth, dict) or _f(depth.get("mean")) is None:
        return "—"
    gap = lambda g: _f(g.get("gap"))
    per_seed = ", ".join(f"{100 * gap(g):+.1f}" for g in depth.get("gaps") or [] if gap(g) is not None)
    text = f"{per_seed} → {100 * _f(depth['mean']):+.1f}"
    lo, hi = _f(depth.get("lower")), _f(depth.get("upper"))
    if lo is not None and hi is not None:
        text += f" [{100 * lo:+.1f}, {100 * hi:+.1f}]"
    return text


def _yardstick_short(row: dict) -> str:
    """The terminal's cell: acc − yardstick, mean in points, "weak" when the control is."""
    depth = row.get("depth") if isinstance(row.get("depth"), dict) else {}
    gap = _f((depth.get("yardstick") or {}).get("mean")) if isinstance(depth.get("yardstick"), dict) else None
    if gap is None:
        return "—"
    return f"{100 * gap:+.1f}" + (" weak" if depth.get("weak_control") else "")


def _yardstick_cell(row: dict) -> str:
    """acc − yardstick (bp's frozen control under the method's recipe), mean in points with its
    one-sided lower bound, and "weak" when the control falls short of the yardstick (its shortfall's
    lower bound above 0): "+4.2 (≥ +1.3; weak control)"; — without a yardstick."""
    depth = row.get("depth") if isinstance(row.get("depth"), dict) else {}
    yard = depth.get("yardstick") if isinstance(depth.get("yardstick"), dict) else {}
    gap = _f(yard.get("mean"))
    if gap is None:
        return "—"
    lo = _f(yard.get("lower"))
    text = f"{100 * gap:+.1f}" + ("" if lo is None else f" (≥ {100 * lo:+.1f})")
    return text + ("; weak control" if depth.get("weak_control") else "")


def _decision_cell(depth: dict | None) -> str:
    if not isinstance(depth, dict):
        return "—"
    outcome = str(depth.get("outcome") or "—")
    needed = depth.get("seeds_needed")
    return f"{outcome} (~{needed} seeds)" if outcome == "undetermined" and needed else outcome


def _outcome(row: dict) -> str | None:
    """A row's project verdict outcome ("trustworthy", "walk back", "incomplete"); None if unknown."""
    try:
        return verdict_of(row).outcome
    except (ValueError, KeyError, TypeError):
        return None


def verdict_summary(audit: dict) -> str:
    """The report's first line: how many methods walk back, are trustworthy, are incomplete
    (project verdict), e.g. "Of 7 methods, 1 walks back, 5 are trustworthy, 1 is incomplete"."""
    outcomes = [_outcome(r) for r in audit.get("methods") or []]
    n = len(outcomes)
    if not n:
        return "No method was audited."
    count = lambda outcome: sum(o == outcome for o in outcomes)
    be = lambda k: f"{k} {'is' if k == 1 else 'are'}"
    wb = count("walk back")
    text = (f"Of {plural(n, 'method')}, {wb} walk{'s' if wb == 1 else ''} back, "
            f"{be(count('trustworthy'))} trustworthy, {be(count('incomplete'))} incomplete")
    unknown = n - wb - count("trustworthy") - count("incomplete")
    return text + (f", {unknown} without a structured verdict" if unknown else "") + " (project verdict)."


# what the three verdicts mean, said once where a reader first meets them
VERDICT_MEANINGS = (
    ("trustworthy", "these numbers can be taken at face value — every flag was evaluated on "
                    "finished runs and none fired. It does not mean the method works: its accuracy "
                    "says how well it works."),
    ("walk back", "a flag fired: a number the results seem to rest on (the accuracy as the work of "
                  "the deep blocks, Γ as alignment with backprop) does not show what it appears to, "
                  "so a claim built on it is taken back; the reasons name which."),
    ("incomplete", "evidence is missing or undetermined (an unfinished run or control, a flag not "
                   "evaluated, (d) needing more seeds): no verdict yet."),
)


def _verdict_cells(row: dict) -> list[str]:
    return [_method_name(row), _ci(row.get("acc_interval"), signed=False),
            _pct(row.get("frozen_acc"), row.get("frozen_acc_std")),
            _pct(row.get("shallow_acc"), row.get("shallow_acc_std")), _gap_cell(row.get("depth")),
            _yardstick_cell(row), _decision_cell(row.get("depth")),
            _short_verdict(row), _short_verdict(row, "paper")]    # in full under Reasons, below


def _scale_cells(row: dict) -> list[str]:
    return [_method_name(row), _sci(row.get("h_L")), _g(row.get("max_growth")),
            _g(row.get("init_growth")), _g(row.get("stack_growth")), _sci(row.get("g_L")),
            _sci(row.get("gain")), _signed(row.get("rho_bp_model_precision")),
            _signed(row.get("stability_mid")), _first_fire(row.get("first_fire"))]


def _trained(cell: str, row: dict) -> str:
    """A deep Γ cell with, for ep and pc, the deep Γ of the credit as trained beside it."""
    trained = _f(row.get("gamma_deep_trained"))
    return cell if trained is None else f"{cell} (as trained {_signed(trained)})"


def _credit_cells(row: dict) -> list[str]:
    gamma, null = _gamma_cells(row)
    gamma = _trained(gamma, row)
    rho = _signed(row.get("rho_deep"))
    if rho != "—" and _f(row.get("rho_deep_std")) is not None:
        rho += f" ± {_f(row['rho_deep_std']):.3f}"
    controls = ("—" if _f(row.get("rho_bp")) is None and _f(row.get("rho_random")) is None
                else f"{_signed(row.get('rho_bp'))} / {_signed(row.get('rho_random'))}")
    return [_method_name(row), gamma, null, _signed(row.get("gamma_deep_paper")), rho, controls]


# what a recipe's source means in the Recipes table: a "published" recipe on this audit's network is
# its paper's optimiser, lr, weight decay and batch size adapted to a setting its authors never ran
# (docs/METHODS.md, "Recipes"); the paper-setting one is the paper's own (`creditaudit reproduce`)
RECIPE_SOURCES = {"published": "adapted from its paper to this setting",
                  "published = shared": "the shared recipe (its paper's own)",
                  "shared": "shared", "paper setting": "its paper's, in the paper's setting",
                  "published = paper setting": "its paper's (the same on this network)",
                  "shared = paper setting": "the shared recipe (its paper's own)",
                  "overridden": "overridden"}


def _recipe_cells(row: dict) -> list[str]:
    source = _recipe(row, "source")
    return [_method_name(row), _recipe(row, "description"), RECIPE_SOURCES.get(source, source),
            _recipe(row, "citation")]


# (title, column heads, cells of one method row); markdown and HTML render the same tables
AUDIT_TABLES = (
    ("Verdicts", ("method", "test acc % [95 % CI]", "frozen %", "shallow %",
                  "(d) acc − frozen, points: per seed → mean [one-sided bounds]",
                  "acc − yardstick, points (≥ lower bound)", "(d) decision",
                  "verdict", "paper's rule"), _verdict_cells),
    ("Scale and reference (median over seeds)",
     ("method", "‖h_L‖", "(a) max growth", "(a′) since init", "(a′) ‖h_L‖/‖h_0‖",
      "‖g_L‖", "(b′) gain", "ρ_BP fp32", "(c) s(L/2)", "first fire (per seed)"), _scale_cells),
    ("Credit", ("method", "deep Γ", "Γ null (z)", "paper's deep Γ", "deep ρ", "ρ BP / rand"), _credit_cells),
    ("Recipes", ("method", "optimiser and schedule", "recipe", "where it is published"), _recipe_cells),
)
PER_SEED_COLUMNS = ("method", "seed", "epochs", "acc %", "frozen %", "gap", "yardstick %", "‖h_L‖",
                    "gain", "since init", "deep Γ", "this run alone: verdict")


def _audit_tables(audit: dict) -> list[tuple[str, Sequence[str], list[list[str]]]]:
    rows = audit.get("methods") or []
    return [(title, head, [cells(r) for r in rows]) for title, head, cells in AUDIT_TABLES]


def _per_seed_cells(audit: dict) -> list[list[str]]:
    out = []
    for row in audit.get("methods") or []:
        for seed, s in (row.get("per_seed") or {}).items():
            gap = _f(s.get("gap"))
            out.append([_method_name(row), str(seed), str(s.get("epochs") or "—"), _pct(s.get("acc")),
                        _pct(s.get("frozen_acc")), "—" if gap is None else f"{100 * gap:+.1f}",
                        _pct(s.get("yardstick_acc")), _sci(s.get("h_L")), _sci(s.get("gain")), _g(s.get("init_growth")),
                        "exact" if s.get("gamma_deep_exact") else _trained(_signed(s.get("gamma_deep")), s),
                        str(s.get("verdict") or "—")])
    return out


def _strategy_cells(audit: dict) -> tuple[list[str], list[list[str]]]:
    methods = audit.get("methods") or []
    strategies = list(audit.get("strategies") or audit.get("strategy_totals") or [])
    rows = [[_method_name(r)] + [str((r.get("strategies") or {}).get(s) or "—") for s in strategies]
            for r in methods]
    totals = audit.get("strategy_totals") or {}
    n = len(methods)
    rows.append(["walks back"] + [("—" if totals.get(s) is None else f"{totals[s]} of {n}")
                                  for s in strategies])
    return ["method", *strategies], rows


# thresholds stored as fractions of accuracy but said in points everywhere a reader meets them
_IN_POINTS = ("depth_margin",)


def _threshold(name: str, value) -> str:
    """A threshold's value as the report says it: (d)'s margin 0.02 → "2 points"; others as is."""
    v = _f(value)
    if name in _IN_POINTS and v is not None:
        return f"{100 * v:g} points" if math.isfinite(v) else f"{v:g}"
    return _g(value)


def _interval(entry: dict, name: str = "") -> str:
    interval = list(entry.get("interval") or [])
    lo, hi = (interval + [None, None])[:2]
    shape = entry.get("interval_shape") or "[lo, hi]"
    if name in _IN_POINTS:
        point = lambda v: _g(None if _f(v) is None else round(100 * _f(v), 2))
        return f"{shape[0]}{point(lo)}, {point(hi)}{shape[-1]} points"
    return f"{shape[0]}{_g(lo)}, {_g(hi)}{shape[-1]}"


def _sensitivity_cells(audit: dict) -> tuple[list[str], list[list[str]]]:
    head = ["threshold", "current", "fires when", "all verdicts stay the same for",
            "fired", "spared", "unmeasured"]
    rows = []
    for name, entry in (audit.get("sensitivity") or {}).items():
        if not isinstance(entry, dict):
            continue
        rows.append([name, _threshold(name, entry.get("current")),
                     str(entry.get("fires_when") or "—").replace("threshold", "T"),
                     _interval(entry, name), *(str(entry.get(k, "—")) for k in ("n_fired", "n_spared",
                                                                           "n_unmeasured"))])
    return head, rows


def _unfinished(audit: dict) -> list[tuple[str, str, str]]:
    """(label, status, message) of every run that did not finish normally or failed diagnosis."""
    out = []
    runs = audit.get("runs")
    if runs is None:  # an audit dict without its runs: fall back to the rows' own lists
        for row in audit.get("methods") or []:
            out += [(str(f.get("label")), str(f.get("status")), str(f.get("message") or ""))
                    for f in row.get("failed") or []]
        return out
    for run in runs:
        message = str(run.get("message") or "")
        if run.get("status") != "finished" or "diagnosis failed" in message:
            out.append((str(run.get("label")), str(run.get("status")), message))
    return out


def _notes(audit: dict) -> dict[str, list[str]]:
    """The (b)/(b′) disagreement notes of the main runs, per method, prefixed by the run."""
    out: dict[str, list[str]] = {}
    for run in audit.get("runs") or []:
        report = run.get("report") or {}
        if run.get("control") == "none" and report.get("notes"):
            out.setdefault(str(run.get("method")), []).extend(
                f"{run.get('label')}: {n}" for n in report["notes"])
    return out


# a run label before a per-seed sentence: "dfa/s42: …", "mypkg.rules:Rule/s1: …"
_SEED_LABEL = re.compile(r"^(\S+/s-?\d+): (.+)$", re.S)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
_FLAG_TAG = re.compile(r"^\([a-d]′?\) ")


def _plain(text: str) -> str:
    """A sentence as compared for repetition: one space between words, no flag tag "(d) " before
    it, no full stop after it."""
    return _FLAG_TAG.sub("", " ".join(str(text).split())).rstrip(".")


def _per_seed_once(items: Sequence[str]) -> list[str]:
    """Per-seed sentences said once: "dfa/s42: X", "dfa/s123: X′" (the same sentence, its numbers
    aside) become one "dfa/s42, dfa/s123: X [the values quoted are dfa/s42's]"; other items pass
    unchanged, in their order."""
    groups: dict[str, list[tuple[str, str]]] = {}
    order: list[str] = []
    for item in items:
        m = _SEED_LABEL.match(" ".join(str(item).split()))
        key = _NUMBER.sub("#", m.group(2)) if m else f"\0{item}"
        if key not in groups:
            order.append(key)
        groups.setdefault(key, []).append((m.group(1), m.group(2)) if m else ("", str(item)))
    out = []
    for key in order:
        (label, body), *more = groups[key]
        if not label:
            out.append(body)
        elif not more:
            out.append(f"{label}: {body}")
        else:
            labels = ", ".join(l for l, _ in groups[key])
            same = all(b == body for _, b in more)
            out.append(f"{labels}: {body}" + ("" if same else f" [the values quoted are {label}'s]"))
    return out


def headline(row: dict) -> str:
    """A method's verdict as its reasons' heading: a walk back with its flags, "trustworthy", or
    "incomplete" alone — what is missing follows it, once (`method_story`), not twice."""
    text = str(row.get("verdict") or "—")
    return "incomplete" if _outcome(row) == "incomplete" else text


def method_story(row: dict, notes: Sequence[str] = ()) -> list[tuple[str, str]]:
    """What a method's verdict rests on, each reason said once: (prefix, sentence) for its reasons,
    what is missing, its notes and the paper's rule, in that order. A sentence repeated per seed is
    said once with the seeds it holds for (`_per_seed_once`); a sentence already said inside an
    earlier one (a note repeating a reason's clause) is left out; the paper's rule, where it rests
    on what is said above, says only its outcome and its own flags. `notes`: the main runs' notes
    (`_notes`) beside the row's own."""
    said: list[str] = []
    story: list[tuple[str, str]] = []

    def say(prefix: str, text: str) -> None:
        if any(_plain(text) in s for s in said):
            return
        said.append(_plain(text))
        story.append((prefix, text))

    for prefix, items in (("", row.get("reasons")), ("missing: ", row.get("missing")),
                          ("note: ", [*(row.get("notes") or []), *notes])):
        for item in _per_seed_once(list(items or [])):
            say(prefix, item)
    paper = str(row.get("paper_verdict") or "—")
    try:
        verdict = verdict_of(row, "paper")
    except (ValueError, KeyError, TypeError):
        verdict = None
    if verdict is not None and verdict.outcome == "incomplete":
        left = [m for m in _per_seed_once(verdict.missing) if not any(_plain(m) in s for s in said)]
        story.append(("paper's rule: ", "incomplete" + (": " + "; ".join(left) if left else
                                                        ", for the reasons above")))
    else:
        story.append(("paper's rule: ", paper))
    return story


def _flag_lines(audit: dict) -> list[str]:
    """One legend line per entry of the flag table stored in audit.json."""
    t = audit.get("thresholds") or {}
    lines = []
    for flag in audit.get("flag_table") or []:
        if not isinstance(flag, dict):
            continue
        stats = "; ".join(f"{st.get('name')} {str(st.get('fires_when', '')).split()[-2]} "
                          f"{_threshold(st.get('threshold'), t.get(st.get('threshold')))} (`{st.get('threshold')}`)"
                          for st in flag.get("statistics") or [])
        verdicts = flag.get("verdicts") or []
        uses = (f"used by the {' and '.join(verdicts)} verdict{'s' if len(verdicts) > 1 else ''}"
                if verdicts else "in no verdict")
        lines.append(f"{flag.get('name')}: fires when {stats}; takes back {flag.get('takes_back')}; "
                     f"{uses}; evaluable: {flag.get('evaluable')}.")
    return lines


def _legend(audit: dict) -> list[str]:
    t = audit.get("thresholds") or {}
    margin = 100 * (_f(t.get("depth_margin")) if _f(t.get("depth_margin")) is not None else 0.02)
    return [
        "test acc / frozen / shallow: final test accuracy (%) of the method, its frozen-blocks control "
        "and its shallow control; mean [95 % t-interval] or mean ± std over seeds (one seed: its value).",
        "(d) acc − frozen: the seed-paired gaps, their mean and its one-sided bounds (95 %; the lower "
        "one at the audit-wide level when Holm tightened it). (d) decision: clears when both the gap to "
        f"the frozen control and the gap to the yardstick have their lower bound at or above +{margin:g} "
        "points, undercut when the upper bound of the gap to the control is below it, else undetermined "
        "(~n: the seed count likely to decide it if the true gap lay 1 point from the margin). The "
        "noise: the seed spread of the gap (the larger of this method's own and that pooled over the "
        "methods sharing its recipe) plus the spread over the shared test set, from each run's "
        "per-example record (or a stated bound for runs without one). paper's rule: the paper's "
        f"verdict, (a), (b) and (d) UNDERCUT when the mean gap is below +{margin:g} points, with no interval.",
        _yardstick_legend(audit),
        *_flag_lines(audit),
        "‖h_L‖, ‖g_L‖, gain, growth: median over samples of the diagnosed quantity, then the median over "
        "seeds; a reason quotes one named seed's value. ρ_BP fp32: the BP gradient's own perturbation "
        "correlation in the model's precision (1 = numerically intact).",
        "deep Γ: mean of Γ_l over the residual positions l = 1 … L less those where the rule's credit "
        "equals the BP gradient by construction (e.g. l = L where the readout backpropagates exactly, as "
        "in feedback alignment: Γ_L = 1 there says nothing about the rule; \"n/a (exact by "
        "construction)\" when every deep position is, as for bp), then over seeds; "
        "its null and z over the same positions. paper's deep Γ: the paper's mean over l = 1 … L, exact "
        "positions included, for comparing with the paper's figures. "
        "\"as trained\" (the relaxation rules): the deep Γ of the credit exactly as the training step "
        "computes it (the model's float32, strict acceptance of each relaxation step); the deep Γ beside "
        "it is of the float64 relaxation with a rounding margin, which reproduces across machines "
        "(PROTOCOL §3.13). "
        "deep ρ: mean over l = 1 … L, then over seeds (± std over seeds); "
        "Γ null: the same Γ under fresh random feedback draws (mean ± std), z = (Γ − null)/std; "
        "* = Γ uninterpretable because (b) or (b′) fired: the BP reference it is a cosine against "
        "carries no usable loss signal, so no z is given (\"z n/a\") — however far Γ sits from its "
        "null, it is no evidence of alignment; — = no null (the rule has no random feedback to "
        "redraw). ρ BP / rand: the controls a = BP gradient and a = random vector.",
        *[f"Γ null, {_method_name(r)}: {r['null_note']}." for r in audit.get("methods") or []
          if r.get("null_note")],
        "first fire: the epoch at which the training-time monitor first saw each flag, one entry per "
        "seed (— = never). A flag other than (d) fires for a method when it fires on any of its seeds.",
        "Per seed, this run alone: the verdict one seed gets with its own control, (d) UNDERCUT when "
        "its own gap is below the margin, with no interval; the method's verdict above decides (d) "
        "over all its seeds at 5 % error, so the two can differ.",
    ]


def _yardstick_legend(audit: dict) -> str:
    """The yardstick and (d)'s error rate, in one legend line."""
    yard = audit.get("yardstick") or {}
    rate = audit.get("depth_error_rate") or {}
    per = 100 * (_f(rate.get("per_claim")) or 0.05)
    text = (f"acc − yardstick: the method's accuracy minus its yardstick — {yard.get('method', 'bp')}'s "
            "frozen control under the method's own recipe: the same frozen blocks, embedding and readout "
            "trained by exact gradients — with its one-sided lower bound; a clear needs it above the "
            "margin too. weak control: the control falls short of the yardstick (the shortfall's lower "
            "bound is above 0); that is reported, and never walks a rule back.")
    if rate.get("methods_tested"):
        text += (f" A false \"clears\" anywhere among this audit's {rate['methods_tested']} methods tested "
                 f"is held to {per:g} % (Holm); each undercut is a one-sided {per:g} % claim "
                 "(rates measured by benchmarks/decision_calibration.py, docs/PROTOCOL.md).")
    return text


def _same_rows(audit: dict) -> list[str]:
    """A note for each pair of methods whose rows print identically: the table's precision hides
    their difference, so the note gives the full-precision differences from audit.json."""
    rows = audit.get("methods") or []
    judged = {"(d) decision", "verdict", "paper's rule", "first fire (per seed)", "method"}
    printed = {i: [c for _, head, cells in AUDIT_TABLES for h, c in zip(head, cells(r)) if h not in judged]
               for i, r in enumerate(rows)}
    notes = []
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            if printed[i] != printed[j] or all(c == "—" for c in printed[i]):
                continue
            diffs = []
            for key, label, scale in (("acc", "accuracy", 100), ("gamma_deep", "deep Γ", 1),
                                      ("rho_deep", "deep ρ", 1), ("gain", "gain", 1), ("h_L", "‖h_L‖", 1)):
                a, b = _f(rows[i].get(key)), _f(rows[j].get(key))
                if a is not None and b is not None and math.isfinite(a) and math.isfinite(b):
                    diffs.append(f"{label} {scale * abs(a - b):.2g}{' points' if scale == 100 else ''}")
            notes.append(
                f"{_method_name(rows[i])} and {_method_name(rows[j])} print the same numbers at this "
                "precision. Their runs are separate; their credit and updates agree to within the "
                "printed digits — as for a method whose credit converges to the BP gradient (EP with "
                "a nudge of β/N ≪ 1 on the mean CE matches BP to O(β/N)). Full-precision differences "
                f"(audit.json): {', '.join(diffs) or 'none recorded'}.")
    return notes


def _meta(audit: dict) -> str:
    bits = []
    if audit.get("creditaudit_version"):
        bits.append(f"creditaudit {audit['creditaudit_version']}")
    if audit.get("created"):
        bits.append(f"created {audit['created']}")
    wall = _f(audit.get("wall_time"))
    if audit.get("source") == "user-loop":          # audit_own_runs: judged here, trained elsewhere
        bits.append("runs trained in your own loop")
    elif wall is not None:
        bits.append(f"wall time {wall:.0f} s ({work_done(audit)})")
    return "; ".join(bits)


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """"1 seed", "2 seeds", "0 seeds"."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


def work_done(audit: dict) -> str:
    """What this invocation computed and what it reused: "3 runs trained now, 2 of 5 diagnoses
    reused" (an audit.json written before diagnoses were reused says runs only)."""
    trained = audit.get("runs_trained_now")
    text = f"{'?' if trained is None else trained} {'run' if trained == 1 else 'runs'} trained now"
    if audit.get("diagnoses") is not None:
        text += f", {audit.get('diagnoses_reused', 0)} of {plural(audit['diagnoses'], 'diagnosis', 'diagnoses')} reused"
    return text


def schedule_line(audit: dict) -> str:
    """How the audit's runs were scheduled, in one line, from each run's "stack" record, e.g.
    "stacked: 14 stacks of 3–6 runs; 4 runs alone (user rule not on the member axis)", then how the
    largest stack was sized (`experiments.sizing`) where the records say; "" when
    the runs carry none (trained in the user's own loop, or an audit.json from before)."""
    records = [r["stack"] for r in audit.get("runs") or [] if isinstance(r.get("stack"), dict)]
    if not records:
        return ""
    sizes = {(s.get("id"), s.get("size")): s.get("size") for s in records if (s.get("size") or 1) > 1}
    alone = Counter(str(s.get("alone") or "alone") for s in records if (s.get("size") or 1) <= 1)
    plural = lambda n, word: f"{n} {word}{'' if n == 1 else 's'}"
    if sizes:
        low, high = min(sizes.values()), max(sizes.values())
        parts = [f"stacked: {plural(len(sizes), 'stack')} of {low if low == high else f'{low}–{high}'} runs"]
    else:
        parts = ["stacked: none"]
    if alone:
        why = "; ".join(reason if len(alone) == 1 else f"{n}: {reason}" for reason, n in alone.most_common())
        parts.append(f"{plural(sum(alone.values()), 'run')} alone ({why})")
    sizing = sorted({str(s["sizing"].get("why")) for s in records if isinstance(s.get("sizing"), dict)})
    parts += [f"stack size: {why}" for why in sizing]
    return "; ".join(parts)


def audit_table(audit: dict) -> str:
    """The audit as Markdown: the header, the main table (one row per method), runs that did not
    finish, the reporting-strategy comparison, each verdict's reasons and the threshold-sensitivity
    table. Padded to fixed width, so it is also what the command line prints."""
    out = ["# Credit-assignment audit", "", str(audit.get("header") or "")]
    if _meta(audit):
        out += ["", _meta(audit)]
    if schedule_line(audit):
        out += ["", schedule_line(audit)]
    out += ["", f"**{verdict_summary(audit)}**", ""]
    out += [f"- **{name}**: {meaning}" for name, meaning in VERDICT_MEANINGS]
    out += [f"- **{row['rule_name']}** is your rule `{row['method']}`; the tables name it by its `name`."
            for row in audit.get("methods") or [] if row.get("rule_name")]
    from .reproduction import reproduction_markdown
    out += ["", *reproduction_markdown(audit)] if audit.get("reproduction") else []
    out += ["", "## Audit"]
    for title, head, cells in _audit_tables(audit):
        out += ["", f"### {title}", "", _markdown(head, cells) if cells else "(no methods)"]
    out += ["", "### Per seed", "", _markdown(PER_SEED_COLUMNS, _per_seed_cells(audit)), ""]
    out += [f"- {line}" for line in _legend(audit)]
    out += [f"- note: {line}" for line in _same_rows(audit)]
    unfinished = _unfinished(audit)
    if unfinished:
        out += ["", "Runs that did not finish normally:", ""]
        out += [f"- {label} ({status}): {message}" for label, status, message in unfinished]
    head, rows = _strategy_cells(audit)
    out += ["", "## Reporting strategies", "",
            "What each way of reporting concludes about a method: accuracy only accepts every result; "
            "accuracy + Γ accepts when the mean Γ is positive; the full protocol is the project verdict.",
            "", _markdown(head, rows)]
    out += ["", "## Reasons", ""]
    notes = _notes(audit)
    for row in audit.get("methods") or []:
        out.append(f"- **{_method_name(row)}** — {headline(row)}")
        story = method_story(row, notes.get(str(row.get("method")), []))
        out += [] if row.get("reasons") else ["  - no flag fired."]
        out += [f"  - {prefix}{text}" for prefix, text in story]
    head, rows = _sensitivity_cells(audit)
    out += ["", "## Threshold sensitivity", ""]
    if rows:
        out += ["For each threshold, the interval over which every verdict stays as it is now: for a "
                "per-run statistic, where every run's flag stays; for depth_margin, where every "
                "method's (d) decision stays, re-decided at each margin.", "", _markdown(head, rows)]
    else:
        out.append("(not available: no run was diagnosed)")
    return "\n".join(out) + "\n"




def calibration_table(report: dict) -> str:
    """`creditaudit calibrate`: per layer ‖g_l‖, Γ_l beside its null (z), ρ_l beside its controls."""
    report = store.json_safe(report)
    null = report.get("null") or {}
    rho = {r["layer"]: r for r in report.get("rho") or []}
    nudge = {n["layer"]: n for n in report.get("nudge") or []}
    gamma = report.get("gamma") or [None] * len(report["bp_grad_norms"])
    z = report.get("gamma_z") or [None] * len(gamma)
    exact = set(report.get("gamma_exact") or ())
    rows = []
    for l, g in enumerate(report["bp_grad_norms"]):
        r = rho.get(l, {})
        nm = (null.get("mean") or [None] * len(gamma))[l]
        ns = (null.get("std") or [None] * len(gamma))[l]
        interpretable = bool(report.get("gamma_interpretable"))
        if l in exact:       # the credit is ∂CE/∂h_l by construction: Γ_l = 1 is no finding
            rows.append([str(l), _sci(g), f"exact ({_signed(gamma[l])})", "—", "—",
                         _signed(r.get("method")), _signed(r.get("bp")), _signed(r.get("random")),
                         _signed(nudge.get(l, {}).get("relative"))])
            continue
        rows.append([str(l), _sci(g), _signed(gamma[l]) + ("" if interpretable else "*"),
                     "—" if nm is None else f"{_signed(nm)} ± {_g(ns)}",
                     _g(z[l]) if interpretable or z[l] is None else "n/a*",
                     _signed(r.get("method")), _signed(r.get("bp")), _signed(r.get("random")),
                     _signed(nudge.get(l, {}).get("relative"))])
    head = ["layer", "‖g_l‖", "Γ_l", "null μ ± σ", "z", "ρ method", "ρ BP (≈1)", "ρ random (≈0)",
            "nudge ΔCE vs BP"]
    lines = [f"calibration — {report.get('label', '')}: verdict {report['verdict']}", "",
             _markdown(head, rows)]
    if not report.get("gamma_interpretable"):
        lines.append("\n* Γ uninterpretable: (b) or (b′) fired, the BP reference is at the floor or "
                     "attenuated; its z against the null is not shown, as no z makes such a Γ evidence.")
    if not null:
        lines.append("\n(no null: this method has no random feedback to redraw)")
    if report.get("gamma") is not None:
        lines.append(f"\ndeep Γ {'n/a (exact by construction)' if report.get('gamma_deep_exact') else _signed(report.get('gamma_deep'))}"
                     + (f" (l = {', '.join(map(str, sorted(exact)))} exact by construction, left out)"
                        if exact else "")
                     + f"; the paper's deep Γ, mean over l = 1 … L: {_signed(report.get('gamma_deep_paper'))}")
    lines.append("\nnudge: ΔCE after h_l ← h_l − 0.01·â_l (â rescaled per sample to ‖g_l‖), "
                 "relative to the same nudge along the BP gradient (1 = as good as BP).")
    return "\n".join(lines)


def ladder_table(result: dict) -> str:
    """`creditaudit ladder`: accuracy per method and number of trainable blocks k."""
    result = store.json_safe(result)
    rows = [[r["method"], str(r["k"]), _pct(r["acc"], r["acc_std"]), _sci(r.get("h_L")),
             ", ".join(sorted(set(r["statuses"])))] for r in result["rows"]]
    return _markdown(["method", "k trainable", "test acc %", "‖h_L‖", "status"], rows)


def penalty_table(result: dict) -> str:
    """`creditaudit penalty-sweep`: per λ accuracy, norms, gain, deep Γ vs null, deep ρ, verdict."""
    result = store.json_safe(result)
    rows = []
    for r in result["rows"]:
        gamma, null = _gamma_cells(r)
        rows.append([f"{_f(r['lam']):g}", _pct(r["acc"], r["acc_std"]), _pct(r["frozen_acc"]),
                     _gap_cell(r.get("depth")), _sci(r["h_L"]), _sci(r["g_L"]), _sci(r["gain"]), gamma,
                     null, _signed(r["rho_deep"]), r["verdict"], str(r.get("paper_verdict") or "—")])
    return _markdown(["λ", "test acc %", "frozen %", "(d) gap, points: per seed → mean [one-sided 95 %]",
                      "‖h_L‖", "‖g_L‖", "gain", "deep Γ", "Γ null (z)", "deep ρ", "verdict",
                      "paper's rule"], rows)


def identity_table(result: dict) -> str:
    """`creditaudit identity-check`: per block ‖f_l‖/‖h_l‖ and the whole stack, mean ± std over seeds."""
    result = store.json_safe(result)
    rows = [[f"block {l}", f"{_g(m)} ± {_g(s)}"]
            for l, (m, s) in enumerate(zip(result["block_ratio_mean"], result["block_ratio_std"]))]
    rows.append(["‖h_L − h_0‖/‖h_0‖", f"{_g(result['stack_change_mean'])} ± {_g(result['stack_change_std'])}"])
    rows.append(["cos(h_L, h_0)", f"{_g(result['stack_cos_mean'])} ± {_g(result['stack_cos_std'])}"])
    return (f"frozen-init identity check — seeds {', '.join(map(str, result['seeds']))}, "
            f"{result['n_samples']} samples (medians over samples, mean ± std over seeds)\n\n"
            + _markdown(["quantity", "value"], rows))



def _short_verdict(row: dict, rule: str = "project") -> str:
    """A verdict with flag names only, "walk back: (a), (b′)", or its outcome alone, for a table
    cell (the reasons, in full, follow the table)."""
    try:
        verdict = verdict_of(row, rule)
    except (ValueError, KeyError, TypeError):
        return str(row.get("verdict" if rule == "project" else "paper_verdict") or "—")
    if verdict.walks_back:
        return "walk back: " + ", ".join(f"({k.replace('_prime', '′')})" for k in verdict.fired)
    return verdict.outcome


RULES_COLUMNS = ("rule", "recipe", "acc % (mean ± sd)", "frozen %", "(d) gap, points", "(d) decision",
                 "‖h_L‖", "(b′) gain", "deep Γ", "Γ null (z)", "verdict")


def rules_table(audit: dict) -> str:
    """The rules table (docs/RULES.md; every audit writes it as rules.md): per method of an
    audit, accuracy (mean ± sd over seeds), the frozen control, (d)'s paired gap and its decision,
    ‖h_L‖ and the readout gain (medians over seeds), deep Γ beside its null where the rule has
    random feedback, and the project verdict by flag name; then one line per rule: its verdict in
    full, with the paper's rule beside it."""
    audit = store.json_safe(audit)
    rows = audit.get("methods") or []
    cells = []
    for row in rows:
        gap = _f(row.get("depth_gap"))
        gamma, null = _gamma_cells(row)
        cells.append([_method_name(row), _recipe(row, "label"), _pct(row.get("acc"), row.get("acc_std")),
                      _pct(row.get("frozen_acc"), row.get("frozen_acc_std")),
                      "—" if gap is None else f"{100 * gap:+.1f}", _decision_cell(row.get("depth")),
                      _sci(row.get("h_L")), _sci(row.get("gain")), gamma, null, _short_verdict(row)])
    config = audit.get("config") or {}
    extras = [f"preset {config['preset']}"] if config.get("preset") else []
    extras += [f"{k} {v}" for k, v in sorted((config.get("model") or {}).items())]
    setting = (f"{config.get('dataset', '?')}, seeds {', '.join(map(str, config.get('seeds') or []))}, "
               f"{config.get('epochs', '?')} epoch(s)" + (f" ({', '.join(extras)})" if extras else ""))
    out = [f"Audit: {setting}; {_meta(audit)}.", "",
           _markdown(RULES_COLUMNS, cells) if cells else "(no methods)", ""]
    out += [f"- **{_method_name(row)}**: {row.get('verdict') or '—'} (paper's rule: "
            f"{row.get('paper_verdict') or '—'})" + _recipe_line(row) for row in rows]
    return "\n".join(out) + "\n"


def _recipe_line(row: dict) -> str:
    """"; recipe (published): … — citation" for a rules.md line; nothing for an older audit."""
    if not isinstance(row.get("recipe"), dict):
        return ""
    return (f"; recipe ({_recipe(row, 'source')}): {_recipe(row, 'description')} — "
            f"{_recipe(row, 'citation')}")


RECIPE_COMPARISON_COLUMNS = ("rule", "published recipe", "acc %", "verdict", "shared recipe", "acc %",
                             "verdict", "changes with the recipe")


def recipe_comparison(published: dict, shared: dict) -> str:
    """Each rule under its published recipe and under the shared one, side by side (docs/RULES.md,
    `docs/rules/regenerate.py`): the recipe, accuracy and project verdict under each, and whether
    the verdict changes with the recipe — the outcome, or only the flags behind it. A rule in one
    audit only is listed with "—" for the other. Both are audit.json contents (`--recipe
    published` and `--recipe shared`; the paper's seven train the same runs under both)."""
    published, shared = store.json_safe(published), store.json_safe(shared)
    for audit, which in ((published, "published"), (shared, "shared")):
        recorded = (audit.get("config") or {}).get("recipe", "published")
        if recorded != which:
            raise CreditAuditError(f"the {which}-recipe audit given was run with --recipe {recorded}; "
                                   f"give the audit run with --recipe {which}")
    by_name = lambda audit: {r.get("method"): r for r in audit.get("methods") or []}
    mine, theirs = by_name(published), by_name(shared)
    cells, changed = [], []
    for name in [*mine, *(m for m in theirs if m not in mine)]:
        a, b = mine.get(name), theirs.get(name)
        row = []
        for r in (a, b):
            row += (["—", "—", "—"] if r is None else
                    [_recipe(r, "label"), _pct(r.get("acc"), r.get("acc_std")), _short_verdict(r)])
        if a is None or b is None:
            change = "—"
        elif _outcome(a) != _outcome(b):
            change = f"yes: {_outcome(a) or '—'} → {_outcome(b) or '—'}"
            changed.append(str(name))
        elif _short_verdict(a) != _short_verdict(b):
            change = "flags only"
        elif _recipe(a, "label") == _recipe(b, "label"):
            change = "no (one recipe)"
        else:
            change = "no"
        cells.append([_method_name(a or b), *row, change])
    summary = (f"The verdict changes with the recipe for {', '.join(changed)}." if changed
               else "No rule's verdict changes with the recipe.")
    return "\n".join([f"Published: {_meta(published)}. Shared: {_meta(shared)}.", "",
                      _markdown(RECIPE_COMPARISON_COLUMNS, cells) if cells else "(no methods)", "",
                      summary]) + "\n"


# the columns (d) is read from: a narrow terminal keeps them while the verdict column has room
_VERDICT_COLUMNS = ("frozen %", "vs yardstick")
# the verdict column's room before a column is dropped: 20 for any other column, 12 (it wraps a
# verdict onto more lines; "incomplete" fits) for the columns (d) is read from
_VERDICT_ROOM = (20, 12)


def _terminal_legend(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """The terminal table's legend: every column it kept and every symbol its cells use."""
    cells = " ".join(str(c) for r in rows for c in r)
    legend = [("recipe", "recipe: optimiser, momentum, lr, schedule (audit.md: in full, with its source)"),
              ("acc %", f"acc{', frozen' if 'frozen %' in head else ''}: mean ± std over seeds (one seed: its "
                        "value)"),
              ("(d) gap", "(d) gap: mean paired gap to the rule's own frozen control, points"),
              ("vs yardstick", "vs yardstick: acc − bp's frozen control under the same recipe, points (weak: "
                               "the control falls short of it; (d) clears only above the margin on both gaps)"),
              ("deep Γ", "deep Γ: mean cos(credit, BP gradient) over the deep positions, mean over seeds")]
    medians = [c for c in ("‖h_L‖", "gain", "growth") if c in head]
    if medians:
        legend.append((medians[0], f"{', '.join(medians)}: median over seeds (a reason quotes one named "
                                   "seed's value)"))
    text = [t for column, t in legend if column in head]
    text.append("verdict: the project verdict by flag name; each method's reasons follow, once")
    symbols = (("exact", "exact: the rule's credit is the BP gradient at every deep position, so Γ says "
                         "nothing (n/a)"),
               ("*", "*: Γ uninterpretable, as (b) or (b′) fired (the BP reference carries no usable "
                     "loss signal)"),
               ("—", "—: not measured or not applicable"),
               ("λ=", "λ: the rule's penalty weight (its option lam)"))
    text += [t for symbol, t in symbols if symbol in cells]
    return "; ".join(text) + "."


def compact_table(audit: dict, width: int = 120, out: str | None = None) -> str:
    """The audit for a terminal: one row per method, at most `width` columns (a verdict too long for
    its column wraps onto the next lines, never cut), then each method's whole verdict as audit.md
    gives it — reasons, the paper's rule, what is missing, every note — wrapped to `width`, and one
    line on what to do next (`next_step`, with the audit folder `out`)."""
    head = ["method", "recipe", "acc %", "frozen %", "(d) gap", "vs yardstick", "‖h_L‖", "gain", "growth",
            "deep Γ", "verdict"]
    rows = []
    for row in audit.get("methods") or []:
        gamma = "exact" if row.get("gamma_deep_exact") else _gamma_cells(row)[0]   # n/a: exact by construction
        depth = row.get("depth") if isinstance(row.get("depth"), dict) else {}
        gap = _f(depth.get("mean"))
        rows.append([_method_name(row), _recipe(row, "label"), _pct(row.get("acc"), row.get("acc_std")),
                     _pct(row.get("frozen_acc"), row.get("frozen_acc_std")),
                     "—" if gap is None else f"{100 * gap:+.1f}", _yardstick_short(row), _sci(row.get("h_L")),
                     _sci(row.get("gain")), _g(row.get("max_growth")), gamma, _short_verdict(row)])
    if not rows:
        return "(no methods)"
    # a narrow terminal drops the least needed columns first; the columns a verdict rests on
    # ((d)'s "frozen %" and "vs yardstick") go last, and the verdict column stays
    for drop in ("growth", "gain", "‖h_L‖", "deep Γ", "recipe", "(d) gap", "frozen %", "vs yardstick"):
        widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
        room = _VERDICT_ROOM[drop in _VERDICT_COLUMNS]
        if sum(widths[:-1]) + 2 * (len(head) - 1) + room <= width:
            break
        j = head.index(drop)
        head, rows = head[:j] + head[j + 1:], [r[:j] + r[j + 1:] for r in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    room = width - sum(widths[:-1]) - 2 * (len(head) - 1)
    widths[-1] = max(_VERDICT_ROOM[1], min(widths[-1], room))
    indent = " " * (sum(widths[:-1]) + 2 * (len(head) - 1))

    def line(cells) -> list[str]:
        first, *rest = textwrap.wrap(str(cells[-1]), widths[-1], break_on_hyphens=False) or [""]
        lead = "  ".join(str(c).ljust(w) for c, w in zip(cells[:-1], widths))
        return [f"{lead}  {first}".rstrip(), *(indent + more for more in rest)]
    wrap = lambda text, lead="", more="    ": textwrap.wrap(text, width, initial_indent=lead,
                                                          subsequent_indent=more, break_on_hyphens=False)
    out_lines = [*wrap(verdict_summary(audit)),
                 *(l for name, meaning in VERDICT_MEANINGS for l in wrap(f"{name}: {meaning}")), "",
                 *line(head), "  ".join("-" * w for w in widths), *(l for r in rows for l in line(r)), ""]
    # the legend names only the columns this width kept
    out_lines += wrap(_terminal_legend(head, rows))
    notes = _notes(audit)
    for row in audit.get("methods") or []:
        out_lines += ["", *wrap(f"{_method_name(row)}: {headline(row)}")]
        for prefix, text in method_story(row, notes.get(str(row.get("method")), [])):
            out_lines += wrap(f"{prefix}{text}", "  - ", "      ")
    out_lines += ["", *wrap(next_step(audit, out), "", "  ")]
    return "\n".join(out_lines)


# a failure that a second try may not meet (the disk, the machine, an interrupt); any other
# failure repeats on a rerun until its cause is changed
TRANSIENT_FAILURES = ("cannot write", "interrupted", "worker", "killed", "out of memory")

# above this many seeds, more seeds are no practical way to decide (d): next says so instead
SEEDS_WORTH_ADDING = 20
_SEEDS_NEEDED = re.compile(r"about (\d+) seeds would (?:likely )?decide")


def rerun_can_finish(run: dict) -> bool:
    """Whether running the same command again can finish `run`: an unfinished run (interrupted,
    killed) resumes; a failed one only when its message names a transient cause
    (`TRANSIENT_FAILURES`) — any other failure repeats."""
    status = run.get("status")
    if status in ("finished", "stopped", "diverged"):
        return False
    if status == "failed":
        return any(t in str(run.get("message") or "").lower() for t in TRANSIENT_FAILURES)
    return True


def seeds_needed(row: dict) -> int | None:
    """The seed count an undetermined (d) names (depth.seeds_needed: at a stated effect, a true gap
    1 point from the margin), or, for an audit.json written before it was stored, the count its
    'missing' text names; None when there is none."""
    depth = row.get("depth") if isinstance(row.get("depth"), dict) else {}
    if depth.get("outcome") == "undetermined" and "deciding_effect" in depth:
        n = depth.get("seeds_needed")
        return int(n) if isinstance(n, int) and not isinstance(n, bool) else None
    counts = [int(m.group(1)) for item in row.get("missing") or []
              for m in [_SEEDS_NEEDED.search(" ".join(str(item).split()))] if m]
    return max(counts) if counts else None


def next_step(audit: dict, out: str | None = None) -> str:
    """One line: what to do next for this audit's outcome (walk back: read the report and how robust
    the flags are; incomplete for want of seeds: the seeds the estimate names, or, past
    `SEEDS_WORTH_ADDING`, that more seeds are no practical way to decide; a run unfinished: run it
    again, only where a rerun can finish it; trustworthy: gate CI on it)."""
    where = out or "AUDIT_DIR"
    methods = audit.get("methods") or []
    outcomes = [_outcome(r) for r in methods]
    runs = audit.get("runs") or []
    parts = []
    if "walk back" in outcomes:
        parts.append(f"open {where}/report.html for the figures behind each flag; `creditaudit "
                     f"thresholds {where}` shows how far each threshold may move before a verdict changes")
    if "incomplete" in outcomes:
        retry = [r for r in runs if rerun_can_finish(r)]
        repeats = [r for r in runs if r.get("status") == "failed" and not rerun_can_finish(r)]
        if retry:
            parts.append(f"run the same command again to finish the {plural(len(retry), 'unfinished run')} "
                         "(finished runs and diagnoses are reused)")
        if repeats:
            parts.append(f"{plural(len(repeats), 'run')} failed the way a rerun repeats (first: "
                         f"{repeats[0].get('label')}; {where}/audit.md lists them): change what it names, "
                         "then run again")
        needed = {_method_name(r): n for r in methods if _outcome(r) == "incomplete"
                  for n in [seeds_needed(r)] if n is not None}
        worth = {m: n for m, n in needed.items() if n <= SEEDS_WORTH_ADDING}
        if worth:
            seeds = [int(s) for s in (audit.get("config") or {}).get("seeds") or []]
            total = max(max(worth.values()), len(seeds) + 1)
            more = seeds + [max(seeds or [0]) + 1 + i for i in range(total - len(seeds))]
            whom = ", ".join(worth)
            parts.append(f"add seeds to decide (d) for {whom}: ~{total} seeds in all would likely decide it "
                         "if the true gap lies 1 point from the margin — train them in your loop and pass "
                         "them to audit_own_runs"
                         if audit.get("source") == "user-loop" else
                         f"add seeds to decide (d) for {whom}: --seeds {' '.join(map(str, more))} "
                         f"({total} seeds: likely to decide it if the true gap lies 1 point from the margin; "
                         "runs of the seeds you have are reused)")
        for method, n in needed.items():
            if n > SEEDS_WORTH_ADDING:
                parts.append(f"{method}'s (d) would likely need ~{n} seeds even 1 point from the margin: more "
                             "seeds are no practical way to decide it; report it as undetermined")
        if len(parts) == ("walk back" in outcomes):
            parts.append(f"read 'missing' under each incomplete method above (and in {where}/audit.md)")
    if not parts:
        parts.append(f"`creditaudit check {where}` gives these verdicts as an exit status for CI; "
                     f"{where}/report.html has the figures")
    return "next: " + "; ".join(parts) + "."


def sensitivity_table(sensitivity: dict) -> str:
    """`creditaudit thresholds`: per threshold, the interval over which every run's flag stays."""
    head, rows = _sensitivity_cells({"sensitivity": sensitivity})
    return (_markdown(head, rows) + "\n\nfired / spared: runs whose flag fires / does not fire at the "
            "current threshold; unmeasured: runs without that statistic (a non-finite stream), which "
            "no threshold changes. depth_margin counts methods: (d) undercut / clears / undetermined "
            "or not evaluated, each re-decided across its seeds at every margin.")
