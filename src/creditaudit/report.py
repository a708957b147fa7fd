"""The audit report, made from the audit dict (the content of audit.json) and nothing else.

    audit_table(audit)            the Markdown tables (also what the command line prints)
    write_report(audit, out_dir)  audit.md, report.html (one self-contained file) and the figures:
        norms.png     per-layer median ‖h_l‖ and ‖g_l‖ of the main runs, mean over seeds   (a), (b)
        monitor.png   the training-time monitor: max growth, ‖g_L‖, readout gain, test accuracy
        gamma.png     Γ_l per method with its random-feedback null band (mean ± 2 std)
        rho.png       ρ_l per method beside its controls (a = BP gradient, a = random vector)

Results are data first: every number and every curve here is read from the audit dict, so a report
can be rebuilt from a saved audit.json without any model. The dict may come straight from
`experiments.audit` (floats, NaN, inf) or from JSON (NaN → null, inf → "inf"); both render the same.
A missing piece (a method without Γ, a failed run, a value that could not be measured) leaves its
cell as "—" and its curve out; it never stops the report.
"""
from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path
from typing import Any, Callable, Sequence

from matplotlib.figure import Figure

from . import store
from .experiments import STRATEGIES
from .protocol import Thresholds, first_fire_epochs

FIGURES = {
    "norms.png": "Per-layer median ‖h_l‖ and BP gradient ‖g_l‖ of the main runs (mean over seeds), "
                 "log scale; the dashed line is the (b) floor.",
    "monitor.png": "Training-time monitor, one thin line per seed: max per-block growth (a), ‖g_L‖ (b), "
                   "readout gain (b′) and test accuracy; dashed lines are the thresholds, filled "
                   "markers the epoch at which a flag first fired.",
    "gamma.png": "Γ_l (mean over seeds) per residual position; shaded: the random-feedback null, "
                 "mean ± 2 std. Dashed: uninterpretable, (b) or (b′) fired.",
    "rho.png": "Perturbation correlation ρ_l per method (mean over seeds) beside its controls: "
               "a = BP gradient (≈ 1) and a = random vector (≈ 0).",
}
_FINISHED = "finished"
_DPI = 110


# -- numbers ----------------------------------------------------------------------------------
def _f(value: Any) -> float | None:
    """A number from either form of the audit dict; None for missing or NaN ("not measured")."""
    if value is None or isinstance(value, bool):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def _plottable(value: Any, log: bool = False) -> float:
    """NaN for what a curve must skip (missing, non-finite, ≤ 0 on a log axis)."""
    x = _f(value)
    if x is None or not math.isfinite(x) or (log and x <= 0):
        return math.nan
    return x


def _sci(value: Any) -> str:
    """Norms and gains: 4.0e+08."""
    x = _f(value)
    return "—" if x is None else ("inf" if x == math.inf else "-inf" if x == -math.inf else f"{x:.1e}")


def _g(value: Any) -> str:
    """Ratios (max growth): 3 significant digits, scientific outside [0.001, 1e4)."""
    x = _f(value)
    if x is None:
        return "—"
    if not math.isfinite(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.3g}" if x == 0 or 1e-3 <= abs(x) < 1e4 else f"{x:.1e}"


def _signed(value: Any, digits: int = 3) -> str:
    """Cosines and correlations: +0.057."""
    x = _f(value)
    if x is None:
        return "—"
    if not math.isfinite(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:+.{digits}f}"


def _pct(mean: Any, std: Any = None) -> str:
    """Accuracy fraction → "87.8 ± 0.8" (percent)."""
    m, s = _f(mean), _f(std)
    if m is None:
        return "—"
    return f"{100 * m:.1f}" + ("" if s is None else f" ± {100 * s:.1f}")


def _method_name(row: dict) -> str:
    lam = _f(row.get("lam"))
    name = str(row.get("method") or "?")
    return f"{name} (λ={lam:g})" if lam else name


def _first_fire(first: dict | None) -> str:
    """Per-seed first-fire epochs of (a), (b), (b′): "a: 8/9/11; b: —/—/—; b′: 3/4/4"."""
    if not isinstance(first, dict):
        return "—"
    parts = []
    for key, short in (("a", "a"), ("b", "b"), ("b_prime", "b′")):
        epochs = first.get(key)
        if not epochs:
            parts.append(f"{short}: —")
            continue
        parts.append(f"{short}: " + "/".join("—" if e is None else str(e) for e in epochs))
    return "; ".join(parts)


def _gamma_cells(row: dict) -> tuple[str, str]:
    """(deep Γ, its null with z). "*" marks Γ uninterpretable ((b) or (b′) fired)."""
    gamma = _f(row.get("gamma_deep"))
    if gamma is None:
        return "—", "—"
    mark = "*" if row.get("gamma_interpretable") is False else ""
    mean, std = _f(row.get("null_deep_mean")), _f(row.get("null_deep_std"))
    if mean is None:
        return _signed(gamma) + mark, "—"
    null = f"{_signed(mean)} ± {'—' if std is None else f'{std:.3f}'}"
    if std is not None and std > 0:
        null += f" (z {(gamma - mean) / std:+.1f})"
    return _signed(gamma) + mark, null


# -- the tables, as cells (Markdown and HTML render the same cells) --------------------------
AUDIT_COLUMNS = ("method", "test acc %", "frozen %", "shallow %", "‖h_L‖", "‖g_L‖", "gain",
                 "max growth", "s(L/2)", "deep Γ", "Γ null (z)", "deep ρ", "ρ BP / rand",
                 "first fire (per seed)", "verdict", "paper verdict")


def _audit_cells(audit: dict) -> list[list[str]]:
    rows = []
    for row in audit.get("methods") or []:
        gamma, null = _gamma_cells(row)
        rho = _signed(row.get("rho_deep"))
        if rho != "—" and _f(row.get("rho_deep_std")) is not None:
            rho += f" ± {_f(row['rho_deep_std']):.3f}"
        controls = ("—" if _f(row.get("rho_bp")) is None and _f(row.get("rho_random")) is None
                    else f"{_signed(row.get('rho_bp'))} / {_signed(row.get('rho_random'))}")
        rows.append([_method_name(row), _pct(row.get("acc"), row.get("acc_std")),
                     _pct(row.get("frozen_acc"), row.get("frozen_acc_std")),
                     _pct(row.get("shallow_acc"), row.get("shallow_acc_std")),
                     _sci(row.get("h_L")), _sci(row.get("g_L")), _sci(row.get("gain")),
                     _g(row.get("max_growth")), _signed(row.get("stability_mid")), gamma, null,
                     rho, controls, _first_fire(row.get("first_fire")),
                     str(row.get("verdict") or "—"), str(row.get("paper_verdict") or "—")])
    return rows


def _strategy_cells(audit: dict) -> tuple[list[str], list[list[str]]]:
    methods = audit.get("methods") or []
    rows = [[_method_name(r)] + [str((r.get("strategies") or {}).get(s) or "—") for s in STRATEGIES]
            for r in methods]
    totals = audit.get("strategy_totals") or {}
    n = len(methods)
    rows.append(["walks back"] + [("—" if totals.get(s) is None else f"{totals[s]} of {n}")
                                  for s in STRATEGIES])
    return ["method", *STRATEGIES], rows


def _interval(entry: dict) -> str:
    interval = list(entry.get("interval") or [])
    lo, hi = (interval + [None, None])[:2]
    shape = entry.get("interval_shape") or "[lo, hi]"
    return f"{shape[0]}{_g(lo)}, {_g(hi)}{shape[-1]}"


def _sensitivity_cells(audit: dict) -> tuple[list[str], list[list[str]]]:
    head = ["threshold", "current", "fires when", "all verdicts stay the same for",
            "fired", "spared", "unmeasured"]
    rows = []
    for name, entry in (audit.get("sensitivity") or {}).items():
        if not isinstance(entry, dict):
            continue
        rows.append([name, _g(entry.get("current")),
                     str(entry.get("fires_when") or "—").replace("threshold", "T"),
                     _interval(entry), *(str(entry.get(k, "—")) for k in ("n_fired", "n_spared",
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
        if run.get("status") != _FINISHED or "diagnosis failed" in message:
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


def _legend(audit: dict) -> list[str]:
    t = audit.get("thresholds") or {}
    th = lambda k, default: _g(t.get(k, default))
    return [
        "test acc / frozen / shallow: final test accuracy (%), mean ± std over seeds, of the method, "
        "its frozen-blocks control and its shallow control; (d) UNDERCUT fires unless the method "
        f"clears the frozen control by {100 * (0.02 if _f(t.get('depth_margin')) is None else _f(t.get('depth_margin'))):g} points.",
        "‖h_L‖, ‖g_L‖: median over samples of the per-sample L2 norm of the last residual position and "
        f"of the BP gradient there (median over seeds); (b) AT FLOOR fires when ‖g_L‖ < {th('floor', 1e-7)}.",
        f"gain: readout gain ‖g_L‖/‖∂CE/∂logits‖, (b′) ATTENUATED below {th('gain', 1e-2)}; "
        f"max growth: max_l ‖h_(l+1)‖/‖h_l‖, (a) EXPLODED above {th('growth', 50)}; "
        f"s(L/2): cross-batch stability, (c) DRIFT above {th('drift', 0.3)} (descriptive).",
        "deep Γ, deep ρ: mean over residual positions l = 1 … L, then over seeds (ρ: ± std over seeds); "
        "Γ null: the same Γ under fresh random feedback draws (mean ± std), z = (Γ − null)/std; "
        "* = Γ uninterpretable because (b) or (b′) fired. ρ BP / rand: the controls a = BP gradient "
        "and a = random vector.",
        "first fire: the epoch at which the training-time monitor first saw (a), (b), (b′), one entry "
        "per seed (— = never). verdict: the project's ((a), (b′), (d)); paper verdict: ((a), (b), (d)).",
    ]


# -- Markdown ---------------------------------------------------------------------------------
def _markdown(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table padded to fixed width, so it reads as plain text too."""
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in rows)])


def _meta(audit: dict) -> str:
    bits = []
    if audit.get("creditaudit_version"):
        bits.append(f"creditaudit {audit['creditaudit_version']}")
    if audit.get("created"):
        bits.append(f"created {audit['created']}")
    wall = _f(audit.get("wall_time"))
    if wall is not None:
        bits.append(f"wall time {wall:.0f} s ({audit.get('runs_trained_now', '?')} runs trained now)")
    return "; ".join(bits)


def audit_table(audit: dict) -> str:
    """The audit as Markdown: the header, the main table (one row per method), runs that did not
    finish, the reporting-strategy comparison, each verdict's reasons and the threshold-sensitivity
    table. Padded to fixed width, so it is also what the command line prints."""
    out = ["# Credit-assignment audit", "", str(audit.get("header") or "")]
    if _meta(audit):
        out += ["", _meta(audit)]
    cells = _audit_cells(audit)
    out += ["", "## Audit", "", _markdown(AUDIT_COLUMNS, cells) if cells else "(no methods)", ""]
    out += [f"- {line}" for line in _legend(audit)]
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
        out.append(f"- **{_method_name(row)}** — {row.get('verdict') or '—'}")
        reasons = list(row.get("reasons") or [])
        out += [f"  - {r}" for r in reasons] or ["  - no flag fired."]
        out += [f"  - note: {n}" for n in notes.get(str(row.get("method")), [])]
    head, rows = _sensitivity_cells(audit)
    out += ["", "## Threshold sensitivity", ""]
    if rows:
        out += ["For each threshold, the interval over which every run's flag — and so every "
                "verdict — stays as it is now.", "", _markdown(head, rows)]
    else:
        out.append("(not available: no run was diagnosed)")
    return "\n".join(out) + "\n"


# -- figures ----------------------------------------------------------------------------------
def _colors(audit: dict) -> dict[str, str]:
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
               "#7f7f7f", "#bcbd22", "#17becf"]
    names = [str(r.get("method")) for r in audit.get("methods") or []]
    names += sorted({str(r.get("method")) for r in audit.get("runs") or []} - set(names))
    return {m: palette[i % len(palette)] for i, m in enumerate(names)}


def _main_runs(audit: dict) -> dict[str, list[dict]]:
    """Main (control == "none") runs per method, in run order."""
    out: dict[str, list[dict]] = {}
    for run in audit.get("runs") or []:
        if run.get("control", "none") == "none":
            out.setdefault(str(run.get("method")), []).append(run)
    return out


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _mean_curve(curves: Sequence[Sequence[Any]], log: bool) -> list[float]:
    """Elementwise mean over seeds of per-layer curves, skipping missing/non-plottable values."""
    n = max((len(c) for c in curves), default=0)
    out = []
    for i in range(n):
        vals = [_plottable(c[i], log) for c in curves if i < len(c)]
        vals = [v for v in vals if not math.isnan(v)]
        out.append(sum(vals) / len(vals) if vals else math.nan)
    return out


def _has_values(values: Sequence[float]) -> bool:
    return any(not math.isnan(v) for v in values)


def _thresholds(audit: dict) -> Thresholds:
    t = Thresholds()
    given = {k: _f(v) for k, v in (audit.get("thresholds") or {}).items()
             if k in Thresholds.__dataclass_fields__ and _f(v) is not None}
    return Thresholds(**{**t.__dict__, **given})


def norms_figure(audit: dict) -> Figure:
    """Per-layer median ‖h_l‖ and ‖g_l‖ per method (mean over the seeds' diagnoses), log y."""
    fig = Figure(figsize=(11, 4.2))
    ax_h, ax_g = fig.subplots(1, 2)
    colors, drawn = _colors(audit), False
    for method, runs in _main_runs(audit).items():
        reports = [r["report"] for r in runs if r.get("report")]
        for ax, key in ((ax_h, "residual_norms"), (ax_g, "bp_grad_norms")):
            curve = _mean_curve([rep.get(key) or [] for rep in reports], log=True)
            if _has_values(curve):
                ax.plot(range(len(curve)), curve, "o-", color=colors[method], label=method, lw=2)
                drawn = True
    floor = _thresholds(audit).floor
    ax_g.axhline(floor, color="0.3", ls="--", lw=1.2, label=f"(b) floor {floor:g}")
    for ax, title in ((ax_h, "residual stream ‖$h_l$‖"), (ax_g, "BP gradient ‖$g_l$‖ = ‖∂CE/∂$h_l$‖")):
        ax.set_yscale("log")
        ax.set_xlabel("residual position l")
        ax.set_ylabel("median per-sample L2 norm")
        ax.set_title(title)
        ax.grid(True, which="major", alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if drawn:
        ax_h.legend(fontsize=9)
    ax_g.legend(fontsize=9)
    if not drawn:
        ax_h.text(0.5, 0.5, "no diagnosed run", ha="center", va="center", transform=ax_h.transAxes)
    fig.tight_layout()
    return fig


def monitor_figure(audit: dict) -> Figure:
    """The training-time monitor of every main run: one color per method, one thin line per seed,
    a filled marker at the epoch where (a), (b) or (b′) first fired."""
    t = _thresholds(audit)
    fig = Figure(figsize=(11, 7.5))
    axes = fig.subplots(2, 2).ravel()
    panels = [  # (value of a monitor row, log?, threshold line, flag whose first fire is marked, title)
        (lambda r: r.get("max_growth"), True, (t.growth, f"(a) growth {t.growth:g}"), "a",
         "max per-block growth ‖$h_{l+1}$‖/‖$h_l$‖"),
        (lambda r: (r.get("g_norms") or [None])[-1], True, (t.floor, f"(b) floor {t.floor:g}"), "b",
         "‖$g_L$‖ (BP gradient at the last position)"),
        (lambda r: r.get("gain"), True, (t.gain, f"(b′) gain {t.gain:g}"), "b_prime", "readout gain ‖$g_L$‖/‖∂CE/∂logits‖"),
        (lambda r: None if _f(r.get("test_acc")) is None else 100 * _f(r.get("test_acc")), False,
         None, None, "test accuracy (%)"),
    ]
    colors, seen = _colors(audit), set()
    for method, runs in _main_runs(audit).items():
        for run in runs:
            history = [r for r in run.get("monitor") or [] if isinstance(r, dict)]
            if not history:
                continue
            first = (run.get("report") or {}).get("first_fire")
            if not isinstance(first, dict):
                try:
                    first = first_fire_epochs(history, t)
                except (KeyError, TypeError, IndexError, ValueError):
                    first = {}
            epochs = [_plottable(r.get("epoch")) for r in history]
            for ax, (value, log, _, flag, _) in zip(axes, panels):
                ys = [_plottable(value(r), log) for r in history]
                if not _has_values(ys):
                    continue
                label = method if ax is axes[3] and method not in seen else None
                if label:
                    seen.add(method)
                ax.plot(epochs, ys, "-", color=colors[method], lw=1.1, alpha=0.85, label=label)
                epoch = first.get(flag) if flag else None
                if epoch is not None and epoch in epochs:
                    y = ys[epochs.index(epoch)]
                    if not math.isnan(y):
                        ax.plot([epoch], [y], "o", ms=8, color=colors[method], mec="black", mew=1)
    for ax, (_, log, line, _, title) in zip(axes, panels):
        if line is not None:
            ax.axhline(line[0], color="0.3", ls="--", lw=1.2, label=line[1])
            ax.legend(fontsize=8, loc="best")
        if log:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if seen:
        axes[3].legend(fontsize=9, title="method (● = first fire)", title_fontsize=8)
    else:
        axes[3].text(0.5, 0.5, "no monitor history", ha="center", va="center",
                     transform=axes[3].transAxes)
    fig.tight_layout()
    return fig


def gamma_figure(audit: dict) -> Figure:
    """Γ_l per method with its null band (mean ± 2 std) where the method has one."""
    fig = Figure(figsize=(8, 4.6))
    ax = fig.subplots()
    colors, drawn = _colors(audit), False
    for row in audit.get("methods") or []:
        gamma = [_plottable(v) for v in row.get("gamma_layers") or []]
        if not _has_values(gamma):
            continue
        color = colors.get(str(row.get("method")), "k")
        null = row.get("null_layers")
        if isinstance(null, (list, tuple)) and len(null) == 2 and null[0] and null[1]:
            mean = [_plottable(v) for v in null[0]]
            std = [_plottable(v) for v in null[1]]
            ax.fill_between(range(len(mean)), [m - 2 * s for m, s in zip(mean, std)],
                            [m + 2 * s for m, s in zip(mean, std)], color=color, alpha=0.18,
                            lw=0, label=f"{_method_name(row)} null ± 2 std")
        bad = row.get("gamma_interpretable") is False
        ax.plot(range(len(gamma)), gamma, "o--" if bad else "o-", color=color, lw=2,
                label=_method_name(row) + (" (uninterpretable)" if bad else ""))
        drawn = True
    ax.axhline(0, color="0.5", lw=0.8)
    if drawn:
        ax.set_xlabel("residual position l")
        ax.set_ylabel(r"$\Gamma_l$ = mean cos($a_l$, $g_l$)")
        ax.set_title(r"Gradient cosine $\Gamma_l$ and its random-feedback null")
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=9)
    else:
        _no_data(ax, "no method has Γ")
    fig.tight_layout()
    return fig


def rho_figure(audit: dict) -> Figure:
    """ρ_l per method, one panel each, as grouped bars beside the BP and random-vector controls."""
    rows = [r for r in audit.get("methods") or []
            if isinstance(r.get("rho_layers"), dict)
            and _has_values([_plottable(v) for vs in r["rho_layers"].values() for v in vs or []])]
    fig = Figure(figsize=(max(5.0, 3.6 * len(rows)), 4.2))
    if not rows:
        _no_data(fig.subplots(), "no method has ρ")
        return fig
    axes = fig.subplots(1, len(rows), sharey=True, squeeze=False)[0]
    colors = _colors(audit)
    series = (("method", None, "method"), ("bp", "0.35", "a = BP gradient"),
              ("random", "0.75", "a = random vector"))
    for ax, row in zip(axes, rows):
        layers = row["rho_layers"]
        n = max(len(v or []) for v in layers.values())
        for j, (key, color, label) in enumerate(series):
            ys = [_plottable(v) for v in (layers.get(key) or [])] + [math.nan] * n
            xs = [l + 1 + (j - 1) * 0.27 for l in range(n)]
            ax.bar(xs, [0 if math.isnan(y) else y for y in ys[:n]], width=0.27,
                   color=color or colors.get(str(row.get("method")), "k"), edgecolor="black", lw=0.5,
                   label=_method_name(row) if key == "method" else label)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(1, n + 1))
        ax.set_xlabel("residual position l")
        ax.set_title(f"{_method_name(row)}: deep ρ {_signed(row.get('rho_deep'))}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="center right")
    axes[0].set_ylabel(r"$\rho_l$ (Pearson, predicted vs true ΔCE)")
    fig.tight_layout()
    return fig


FIGURE_MAKERS: dict[str, Callable[[dict], Figure]] = {
    "norms.png": norms_figure, "monitor.png": monitor_figure,
    "gamma.png": gamma_figure, "rho.png": rho_figure,
}


# -- HTML -------------------------------------------------------------------------------------
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
td.wrap { white-space: normal; min-width: 125px; }
td.left { text-align: left; }
table.audit { font-size: 12px; }
tr.total td { font-weight: 600; background: #f6f6f6; }
ul.legend { color: #555; font-size: 12px; padding-left: 18px; }
ul.failed li { color: #8a1010; }
figure { margin: 18px 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { color: #555; font-size: 12px; max-width: 1000px; }
"""


def _cell_class(text: str) -> str:
    if text.startswith(("trustworthy", "accept")):
        return "ok"
    if text.startswith("walk back"):
        return "bad"
    return ""


def _html_table(head: Sequence[str], rows: Sequence[Sequence[str]], total_last: bool = False,
                wrap: Sequence[int] = (), breaks: dict[int, tuple[str, str]] | None = None,
                left: Sequence[int] = (), css_class: str = "") -> str:
    """An HTML table of escaped cells; `wrap` columns may wrap, and `breaks` {column: (separator,
    its replacement with a <br>)} splits wide cells over lines."""
    breaks = breaks or {}
    out = [f'<table class="{css_class}">' if css_class else "<table>", "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for i, row in enumerate(rows):
        cls = ' class="total"' if total_last and i == len(rows) - 1 else ""
        cells = []
        for j, cell in enumerate(row):
            klass = " ".join(c for c in (_cell_class(cell), "wrap" if j in wrap else "",
                                         "left" if j in left else "") if c)
            cells.append(f'<td class="{klass}">' if klass else "<td>")
            text = html.escape(cell)
            if j in breaks:
                text = text.replace(*breaks[j])
            cells[-1] += text + "</td>"
        out.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
    return "\n".join(out + ["</table>"])


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
    cells = _audit_cells(audit)
    verdict_cols = (AUDIT_COLUMNS.index("verdict"), AUDIT_COLUMNS.index("paper verdict"))
    first_fire = (AUDIT_COLUMNS.index("first fire (per seed)"),)
    breaks = {first_fire[0]: ("; ", "<br>"),
              AUDIT_COLUMNS.index("Γ null (z)"): (" (", "<br>("),
              AUDIT_COLUMNS.index("ρ BP / rand"): (" / ", " /<br>")}
    table = _html_table(AUDIT_COLUMNS, cells, wrap=verdict_cols, breaks=breaks, left=first_fire,
                        css_class="audit")
    parts += ["<h2>Audit</h2>", f'<div class="scroll">{table}</div>' if cells else "<p>(no methods)</p>",
              '<ul class="legend">' + "".join(f"<li>{e(line)}</li>" for line in _legend(audit)) + "</ul>"]
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
              "project verdict.</p>", _html_table(head, rows, total_last=True)]
    parts.append("<h2>Reasons</h2>")
    notes = _notes(audit)
    for row in audit.get("methods") or []:
        verdict = str(row.get("verdict") or "—")
        color = {"ok": "#125c1b", "bad": "#8a1010"}.get(_cell_class(verdict), "#222")
        parts.append(f'<h3>{e(_method_name(row))} — <span style="color:{color}">{e(verdict)}</span></h3>')
        items = [e(r) for r in row.get("reasons") or []] or ["no flag fired."]
        items += [f"<i>note</i>: {e(n)}" for n in notes.get(str(row.get("method")), [])]
        parts.append("<ul>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>")
    head, rows = _sensitivity_cells(audit)
    parts.append("<h2>Threshold sensitivity</h2>")
    if rows:
        parts += ["<p>For each threshold, the interval over which every run's flag — and so every "
                  "verdict — stays as it is now.</p>", _html_table(head, rows)]
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


# -- everything -------------------------------------------------------------------------------
def write_report(audit: dict, out_dir: Path) -> dict[str, Path]:
    """Write audit.md, report.html and the figures into out_dir (each file atomically).

    Returns {file name: path}. Accepts the dict `experiments.audit` returns or audit.json read back.
    """
    out_dir = Path(out_dir)
    audit = store.json_safe(audit)  # one form to read: NaN → None, inf → "inf", int keys → str
    pngs = {}
    for name, make in FIGURE_MAKERS.items():
        pngs[name] = _png(make(audit))
    paths: dict[str, Path] = {}
    for name, data in pngs.items():
        paths[name] = out_dir / name
        store.atomic_write_bytes(paths[name], data)
    figures = "\n".join(f"![{name}]({name})\n\n*{FIGURES[name]}*\n" for name in pngs)
    paths["audit.md"] = out_dir / "audit.md"
    store.atomic_write_text(paths["audit.md"], audit_table(audit) + "\n## Figures\n\n" + figures)
    paths["report.html"] = out_dir / "report.html"
    store.atomic_write_text(paths["report.html"], report_html(audit, pngs))
    return paths


# -- the other experiments: one table and one figure each, from their JSON ----------------------
def _save_png(fig: Figure, path: Path) -> Path:
    store.atomic_write_bytes(Path(path), _png(fig))
    return Path(path)


def calibration_table(report: dict) -> str:
    """`creditaudit calibrate`: per layer ‖g_l‖, Γ_l beside its null (z), ρ_l beside its controls."""
    report = store.json_safe(report)
    null = report.get("null") or {}
    rho = {r["layer"]: r for r in report.get("rho") or []}
    nudge = {n["layer"]: n for n in report.get("nudge") or []}
    gamma = report.get("gamma") or [None] * len(report["bp_grad_norms"])
    z = report.get("gamma_z") or [None] * len(gamma)
    rows = []
    for l, g in enumerate(report["bp_grad_norms"]):
        r = rho.get(l, {})
        nm = (null.get("mean") or [None] * len(gamma))[l]
        ns = (null.get("std") or [None] * len(gamma))[l]
        rows.append([str(l), _sci(g), _signed(gamma[l]) + ("" if report.get("gamma_interpretable") else "*"),
                     "—" if nm is None else f"{_signed(nm)} ± {_g(ns)}", _g(z[l]),
                     _signed(r.get("method")), _signed(r.get("bp")), _signed(r.get("random")),
                     _signed(nudge.get(l, {}).get("relative"))])
    head = ["layer", "‖g_l‖", "Γ_l", "null μ ± σ", "z", "ρ method", "ρ BP (≈1)", "ρ random (≈0)",
            "nudge ΔCE vs BP"]
    lines = [f"calibration — {report.get('label', '')}: verdict {report['verdict']}", "",
             _markdown(head, rows)]
    if not report.get("gamma_interpretable"):
        lines.append("\n* Γ uninterpretable: (b) or (b′) fired, the BP reference is at the floor or attenuated.")
    if not null:
        lines.append("\n(no null: this method has no random feedback to redraw)")
    lines.append("\nnudge: ΔCE after h_l ← h_l − 0.01·â_l (â rescaled per sample to ‖g_l‖), "
                 "relative to the same nudge along the BP gradient (1 = as good as BP).")
    return "\n".join(lines)


def ladder_table(result: dict) -> str:
    """`creditaudit ladder`: accuracy per method and number of trainable blocks k."""
    result = store.json_safe(result)
    rows = [[r["method"], str(r["k"]), _pct(r["acc"], r["acc_std"]), _sci(r.get("h_L")),
             ", ".join(sorted(set(r["statuses"])))] for r in result["rows"]]
    return _markdown(["method", "k trainable", "test acc %", "‖h_L‖", "status"], rows)


def ladder_figure(result: dict, path: Path) -> Path:
    result = store.json_safe(result)
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    for method in dict.fromkeys(r["method"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["method"] == method]
        ks = [r["k"] for r in rows]
        acc = [100 * _plottable(r["acc"]) for r in rows]
        sd = [100 * (_f(r["acc_std"]) or 0.0) for r in rows]
        ax.errorbar(ks, acc, yerr=sd, marker="o", capsize=3, label=method)
    ax.set_xlabel("trainable blocks k (0 = frozen control, L = full run)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Depth ladder")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save_png(fig, path)


def penalty_table(result: dict) -> str:
    """`creditaudit penalty-sweep`: per λ accuracy, norms, gain, deep Γ vs null, deep ρ, verdict."""
    result = store.json_safe(result)
    rows = []
    for r in result["rows"]:
        gamma, null = _gamma_cells(r)
        rows.append([f"{_f(r['lam']):g}", _pct(r["acc"], r["acc_std"]), _pct(r["frozen_acc"]),
                     _sci(r["h_L"]), _sci(r["g_L"]), _sci(r["gain"]), gamma, null,
                     _signed(r["rho_deep"]), r["verdict"]])
    return _markdown(["λ", "test acc %", "frozen %", "‖h_L‖", "‖g_L‖", "gain", "deep Γ", "Γ null (z)",
                      "deep ρ", "verdict"], rows)


def penalty_figure(result: dict, path: Path) -> Path:
    result = store.json_safe(result)
    rows = result["rows"]
    x = list(range(len(rows)))
    labels = [f"{_f(r['lam']):g}" for r in rows]
    fig = Figure(figsize=(11, 3.6))
    axes = fig.subplots(1, 3)
    axes[0].plot(x, [100 * _plottable(r["acc"]) for r in rows], marker="o")
    axes[0].set_ylabel("test accuracy (%)")
    axes[1].plot(x, [_plottable(r["h_L"], log=True) for r in rows], marker="o", label="‖h_L‖")
    axes[1].plot(x, [_plottable(r["g_L"], log=True) for r in rows], marker="s", label="‖g_L‖")
    axes[1].set_yscale("log")
    axes[1].legend()
    axes[2].plot(x, [_plottable(r["gamma_deep"]) for r in rows], marker="o", label="deep Γ")
    mean = [_plottable(r.get("null_deep_mean")) for r in rows]
    std = [_plottable(r.get("null_deep_std")) for r in rows]
    axes[2].fill_between(x, [m - 2 * s for m, s in zip(mean, std)], [m + 2 * s for m, s in zip(mean, std)],
                         alpha=0.25, label="null ± 2σ")
    axes[2].plot(x, [_plottable(r["rho_deep"]) for r in rows], marker="^", label="deep ρ")
    axes[2].axhline(0, color="0.5", lw=0.8)
    axes[2].legend()
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.set_xlabel("λ")
        ax.grid(alpha=0.3)
    fig.suptitle("dfa-penalty sweep")
    return _save_png(fig, path)


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


def identity_figure(result: dict, path: Path) -> Path:
    result = store.json_safe(result)
    fig = Figure(figsize=(5, 3.5))
    ax = fig.add_subplot()
    means = [_plottable(v) for v in result["block_ratio_mean"]]
    stds = [_f(v) or 0.0 for v in result["block_ratio_std"]]
    ax.bar(range(len(means)), means, yerr=stds, capsize=3)
    ax.set_xlabel("block l")
    ax.set_ylabel("median ‖f_l(h_l)‖ / ‖h_l‖ at init")
    ax.set_title(f"stack: ‖h_L−h_0‖/‖h_0‖ = {_g(result['stack_change_mean'])}, "
                 f"cos = {_g(result['stack_cos_mean'])}", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    return _save_png(fig, path)


def sensitivity_figure(reports: Sequence[dict], sensitivity: dict, path: Path) -> Path:
    """Each run's statistic for (a), (b), (b′) on a log axis, with the threshold and the interval
    over which every verdict stays the same shaded."""
    reports = store.json_safe(list(reports))
    sensitivity = store.json_safe(sensitivity)
    stats = (("growth", "max block growth (a)", lambda r: r["max_growth"]),
             ("floor", "‖g_L‖ (b)", lambda r: r["bp_grad_norms"][-1]),
             ("gain", "readout gain (b′)", lambda r: r["readout_gain"]))
    fig = Figure(figsize=(12, 3.6))
    for ax, (name, title, stat) in zip(fig.subplots(1, 3), stats):
        values = [_plottable(stat(r), log=True) for r in reports]
        labels = [r.get("label", "") for r in reports]
        ax.scatter(values, range(len(values)), s=14)
        ax.set_yticks(range(len(values)), labels, fontsize=6)
        ax.set_xscale("log")
        entry = sensitivity.get(name, {})
        lo, hi = (entry.get("interval") or [None, None])
        lo, hi = _f(lo), _f(hi)
        if lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi) and lo > 0:
            ax.axvspan(lo, hi, alpha=0.2, color="tab:green", label="same verdicts")
        if _f(entry.get("current")):
            ax.axvline(_f(entry["current"]), color="tab:red", ls="--", label="threshold")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    return _save_png(fig, path)


__all__ = ["audit_table", "write_report", "report_html", "norms_figure", "monitor_figure",
           "gamma_figure", "rho_figure", "calibration_table", "ladder_table", "ladder_figure",
           "penalty_table", "penalty_figure", "identity_table", "identity_figure",
           "sensitivity_figure"]
