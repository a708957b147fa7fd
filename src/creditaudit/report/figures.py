"""The figures, drawn from result JSON with matplotlib's object API (no pyplot state)."""
from __future__ import annotations

import hashlib
import io
import math
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Sequence

import matplotlib
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import NullFormatter

from .. import store
from . import format as format_module
from .format import _f, _g, _method_name, _plottable, _signed

FIGURES = {
    "norms.png": "Per-layer median ‖h_l‖ and BP gradient ‖g_l‖ of the main runs (mean over seeds), "
                 "log scale; the dashed line is the (b) floor.",
    "monitor.png": "Training-time monitor, one line per seed, each method with its own colour, line "
                   "style and (open) marker: max per-block growth (a), ‖g_L‖ (b), readout gain (b′) "
                   "and test accuracy; grey dashed lines are the thresholds, large filled markers the "
                   "epoch at which a flag first fired. Each method's curves sit slightly apart along "
                   "x so that equal ones (EP at a small nudge and BP) stay visible.",
    "gamma.png": "Γ_l (mean over seeds) per residual position; hatched band (the method's colour and "
                 "hatching, dotted edges): its random-feedback null, mean ± 2 std. Dashed line: "
                 "uninterpretable, (b) or (b′) fired. Hollow grey rings: positions where the rule's "
                 "credit equals the BP gradient by construction (Γ_l = 1, left out of the deep Γ). "
                 "Each method's points sit slightly apart along x so that equal curves stay visible.",
    "rho.png": "Perturbation correlation ρ_l per method (mean over seeds) beside its controls: "
               "a = BP gradient (≈ 1) and a = random vector (≈ 0).",
    "alignment.png": "Alignment over training, recorded by the training-time monitor on its fixed "
                     "eval batch (mean over seeds). First, per method: Γ_l against epoch, one line "
                     "per residual position l (positions exact by construction are not drawn: their "
                     "Γ_l is 1 throughout, so bp has no panel). Below, for rules with feedback weights: "
                     "cos(W, B) of each block's forward weight W and the feedback weight B its error "
                     "travels back through, flattened (1 = B is W, as in backprop).",
}
_DPI = 110

def _method_names(audit: dict) -> list[str]:
    names = [str(r.get("method")) for r in audit.get("methods") or []]
    return names + sorted({str(r.get("method")) for r in audit.get("runs") or []} - set(names))


def _colors(audit: dict) -> dict[str, str]:
    # 16 distinct colours: the zoo preset draws 14 methods in one panel
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
               "#7f7f7f", "#bcbd22", "#17becf", "#000000", "#006d2c", "#7a0177", "#b15928",
               "#08306b", "#b8860b"]
    return {m: palette[i % len(palette)] for i, m in enumerate(_method_names(audit))}


# Methods whose curves coincide (EP at a small nudge tracks BP) must still be told apart without
# colour: each method also gets its own line style, marker and hatching.
_LINESTYLES = ["-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 1))]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
_HATCHES = ["//", "\\\\", "xx", "..", "||", "--", "++", "oo"]


def _styles(audit: dict) -> dict[str, dict]:
    """Per method: line style, marker, hatch and a small x offset (so identical curves sit side by
    side instead of on top of each other), in the order of `_colors`."""
    names = _method_names(audit)
    return {m: {"ls": _LINESTYLES[i % len(_LINESTYLES)], "marker": _MARKERS[i % len(_MARKERS)],
                "hatch": _HATCHES[i % len(_HATCHES)], "dx": 0.06 * (i - (len(names) - 1) / 2)}
            for i, m in enumerate(names)}


def _main_runs(audit: dict) -> dict[str, list[dict]]:
    """Main (control == "none") runs per method, in run order."""
    out: dict[str, list[dict]] = {}
    for run in audit.get("runs") or []:
        if run.get("control", "none") == "none":
            out.setdefault(str(run.get("method")), []).append(run)
    return out


def _png(fig: Figure, key: str | None = None) -> bytes:
    """The figure as PNG bytes; `key` (`figure_key`) is written into it as a text chunk, so that a
    later report can tell whether it would draw the same figure (`render_figures`)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight",
                metadata={"Software": None, **({_KEY_CHUNK: key} if key else {})})
    return buf.getvalue()


# -- drawing a figure only when what it shows changed ------------------------------------------------
_KEY_CHUNK = "creditaudit-figure"     # the PNG tEXt keyword holding the figure's key
# What audit.json records about the command that wrote it rather than about its runs: when it
# started, how long it took, what it trained or measured anew and how it scheduled the runs. No
# figure draws these (tests/test_report.py checks it), so a re-run that only reused runs and
# diagnoses draws nothing again.
EXECUTION_FIELDS = ("created", store.SEAL, "wall_time", "runs_trained_now", "diagnoses_reused")
RUN_EXECUTION_FIELDS = ("trained_now", "diagnosis_reused", "stack")
# the code that draws: a changed figure module (or matplotlib) draws every figure again
_CODE = hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (sys.modules[__name__], format_module))
                       + matplotlib.__version__.encode()).hexdigest()


def figure_key(audit: dict, name: str) -> str:
    """sha256 of what figure `name` is drawn from: the audit (json_safe form) less its
    EXECUTION_FIELDS, the figure's name and the drawing code."""
    drawn = {k: v for k, v in audit.items() if k not in EXECUTION_FIELDS}
    drawn["runs"] = [{k: v for k, v in r.items() if k not in RUN_EXECUTION_FIELDS} if isinstance(r, dict) else r
                     for r in audit.get("runs") or []]
    return store.digest({"audit": drawn, "figure": name, "code": _CODE})


def drawn_key(png: bytes) -> str | None:
    """The key a PNG written by `_png` carries (None: none, or not a PNG)."""
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    pos = 8
    while pos + 8 <= len(png):       # chunks: length (4 bytes, big-endian), type (4), data, CRC (4)
        length, kind = int.from_bytes(png[pos:pos + 4], "big"), png[pos + 4:pos + 8]
        if kind == b"tEXt":
            keyword, _, text = png[pos + 8:pos + 8 + length].partition(b"\0")
            if keyword == _KEY_CHUNK.encode():
                return text.decode("latin-1")
        if kind == b"IEND":
            break
        pos += 12 + length
    return None


def _kept_figure(audit: dict, name: str, previous: Path | None) -> tuple[bytes | None, str]:
    """(the PNG of that name in `previous` when it carries this figure's key, else None; the key)."""
    key = figure_key(audit, name)
    if previous is not None:
        try:
            old = (Path(previous) / name).read_bytes()
        except OSError:                 # none yet (or unreadable): draw it
            old = b""
        if drawn_key(old) == key:
            return old, key
    return None, key


def draw_job(job: tuple[dict, str, str]) -> dict[str, Any]:
    """An executor's job (runner/__init__.py: it returns a record, never raises): figure `name` of
    `audit` drawn, as {"png": bytes}, or {"error": why}."""
    audit, name, key = job
    try:
        return {"png": _png(FIGURE_MAKERS[name](audit), key)}
    except Exception as err:  # noqa: BLE001 — drawn again by the caller, where it raises
        return {"error": f"{type(err).__name__}: {err}"}


def render_figures(audit: dict, names: Sequence[str], previous: Path | None = None,
                   executor=None) -> dict[str, bytes]:
    """Each figure of `names` as PNG bytes: the file of that name in `previous` when it carries the
    figure's key (drawn from the same content by the same code), else drawn now. With an executor (an audit's pool of local workers,
    idle by now), the figures to draw are drawn in its workers, one per worker at a time: two
    cores draw two figures at once, where the driver alone draws them one after another (the
    quick audit's five take about 7 s on one core). A figure a worker fails to draw is drawn here."""
    pngs: dict[str, bytes] = {}
    todo: list[tuple[str, str]] = []
    for name in names:
        kept, key = _kept_figure(audit, name, previous)
        if kept is not None:
            pngs[name] = kept
        else:
            todo.append((name, key))
    if executor is not None and len(todo) > 1:
        records = executor.map(draw_job, [(audit, name, key) for name, key in todo], lambda i, r: None)
        pngs.update({name: rec["png"] for (name, _), rec in zip(todo, records)
                     if isinstance(rec.get("png"), bytes)})
    for name, key in todo:
        if name not in pngs:
            pngs[name] = _png(FIGURE_MAKERS[name](audit), key)
    return {name: pngs[name] for name in names}


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


class _Thresholds:
    """The thresholds recorded in a result dict, as attributes (t.growth, t.floor, …); a threshold
    the dict does not record is None, and its line is not drawn."""

    def __init__(self, recorded: dict | None):
        self.__dict__.update({k: _f(v) for k, v in (recorded or {}).items()})

    def __getattr__(self, name: str):
        return None


def _shown(audit: dict) -> dict[str, str]:
    """A user's rule (PKG.MODULE:CLASS) → its `name`, as the legends show it (the tables too)."""
    return {str(r["method"]): str(r["rule_name"]) for r in audit.get("methods") or [] if r.get("rule_name")}


def _thresholds(audit: dict) -> _Thresholds:
    return _Thresholds(audit.get("thresholds"))


# a legend beside the data keeps to one column up to this many entries; more (the zoo's 20 rules, each
# with its null) go into columns, and the figure grows tall enough for them
LEGEND_ROWS = 16


def _legend_layout(fig: Figure, n_entries: int, height: float) -> int:
    """The number of columns for a legend of `n_entries` beside the data, after making `fig` at least
    tall enough for its rows (a long legend would otherwise dwarf the plot it explains)."""
    ncol = max(1, math.ceil(n_entries / LEGEND_ROWS))
    rows = math.ceil(n_entries / ncol)
    fig.set_size_inches(fig.get_size_inches()[0] + 2.2 * (ncol - 1), max(height, 0.26 * rows + 1.0))
    return ncol


def norms_figure(audit: dict) -> Figure:
    """Per-layer median ‖h_l‖ and ‖g_l‖ per method (mean over the seeds' diagnoses), log y."""
    fig = Figure(figsize=(11, 4.2))
    ax_h, ax_g = fig.subplots(1, 2)
    colors, drawn, shown = _colors(audit), False, _shown(audit)
    for method, runs in _main_runs(audit).items():
        reports = [r["report"] for r in runs if r.get("report")]
        for ax, key in ((ax_h, "residual_norms"), (ax_g, "bp_grad_norms")):
            curve = _mean_curve([rep.get(key) or [] for rep in reports], log=True)
            if _has_values(curve):
                ax.plot(range(len(curve)), curve, "o-", color=colors[method], label=shown.get(method, method),
                        lw=2)
                drawn = True
    floor = _thresholds(audit).floor
    if floor is not None:
        ax_g.axhline(floor, color="0.3", ls="--", lw=1.2, label=f"(b) floor {_g(floor)}")
    for ax, title in ((ax_h, "residual stream ‖$h_l$‖"), (ax_g, "BP gradient ‖$g_l$‖ = ‖∂CE/∂$h_l$‖")):
        ax.set_yscale("log")
        ax.set_xlabel("residual position l")
        ax.set_ylabel("median per-sample L2 norm")
        ax.set_title(title)
        ax.grid(True, which="major", alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if drawn:   # one legend for both panels, outside the data
        handles, labels = ax_h.get_legend_handles_labels()
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9,
                   title="method", ncol=_legend_layout(fig, len(labels), 4.2))
    floor_lines = [line for line in ax_g.get_lines() if line.get_label().startswith("(b)")]
    if floor_lines:
        ax_g.legend(handles=floor_lines, fontsize=8, loc="lower left")
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
        (lambda r: r.get("max_growth"), True, (t.growth, f"(a) growth {_g(t.growth)}"), "a",
         "max per-block growth ‖$h_{l+1}$‖/‖$h_l$‖"),
        (lambda r: (r.get("g_norms") or [None])[-1], True, (t.floor, f"(b) floor {_g(t.floor)}"), "b",
         "‖$g_L$‖ (BP gradient at the last position)"),
        (lambda r: r.get("gain"), True, (t.gain, f"(b′) gain {_g(t.gain)}"), "b_prime", "readout gain ‖$g_L$‖/‖∂CE/∂logits‖"),
        (lambda r: None if _f(r.get("test_acc")) is None else 100 * _f(r.get("test_acc")), False,
         None, None, "test accuracy (%)"),
    ]
    colors, styles, seen, shown = _colors(audit), _styles(audit), set(), _shown(audit)
    for method, runs in _main_runs(audit).items():
        style = styles.get(method, {"ls": "-", "marker": "o", "dx": 0.0})
        for run in runs:
            history = [r for r in run.get("monitor") or [] if isinstance(r, dict)]
            if not history:
                continue
            first = (run.get("report") or {}).get("first_fire")
            first = first if isinstance(first, dict) else {}
            epochs = [_plottable(r.get("epoch")) for r in history]
            shifted = [e + style["dx"] for e in epochs]
            for ax, (value, log, _, flag, _) in zip(axes, panels):
                ys = [_plottable(value(r), log) for r in history]
                if not _has_values(ys):
                    continue
                label = shown.get(method, method) if ax is axes[3] and method not in seen else None
                if label:
                    seen.add(method)
                ax.plot(shifted, ys, ls=style["ls"], marker=style["marker"], ms=4, mfc="none",
                        markevery=max(1, len(ys) // 12), color=colors[method], lw=1.3, alpha=0.85,
                        label=label)
                epoch = first.get(flag) if flag else None
                if epoch is not None and epoch in epochs:
                    y = ys[epochs.index(epoch)]
                    if not math.isnan(y):
                        ax.plot([epoch + style["dx"]], [y], "o", ms=8, color=colors[method], mec="black",
                                mew=1)
    for ax, (_, log, line, _, title) in zip(axes, panels):
        if line is not None and line[0] is not None:
            drawn = ax.axhline(line[0], color="0.3", ls="--", lw=1.2, label=line[1])
            ax.legend(handles=[drawn], fontsize=8, loc="lower left", framealpha=0.9)
        if log:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if seen:
        handles, labels = axes[3].get_legend_handles_labels()
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9,
                   title="method (● = first fire)", title_fontsize=8,
                   ncol=_legend_layout(fig, len(labels), 7.5))
    else:
        axes[3].text(0.5, 0.5, "no monitor history", ha="center", va="center",
                     transform=axes[3].transAxes)
    fig.tight_layout()
    return fig


def gamma_figure(audit: dict) -> Figure:
    """Γ_l per method with its null band (mean ± 2 std) where the method has one."""
    fig = Figure(figsize=(8, 4.6))
    ax = fig.subplots()
    colors, styles, drawn, marked_exact = _colors(audit), _styles(audit), False, False
    for row in audit.get("methods") or []:
        gamma = [_plottable(v) for v in row.get("gamma_layers") or []]
        if not _has_values(gamma):
            continue
        color = colors.get(str(row.get("method")), "k")
        style = styles.get(str(row.get("method")), {"marker": "o", "hatch": "//", "dx": 0.0})
        xs = [l + style["dx"] for l in range(len(gamma))]
        null = row.get("null_layers")
        if isinstance(null, (list, tuple)) and len(null) == 2 and null[0] and null[1]:
            # overlapping bands stay apart: a faint fill, the method's hatching and its edges
            mean = [_plottable(v) for v in null[0]]
            std = [_plottable(v) for v in null[1]]
            lo, hi = [m - 2 * s for m, s in zip(mean, std)], [m + 2 * s for m, s in zip(mean, std)]
            ax.fill_between(range(len(mean)), lo, hi, facecolor=color, alpha=0.08, lw=0)
            ax.fill_between(range(len(mean)), lo, hi, facecolor="none", edgecolor=color, alpha=0.7,
                            hatch=style["hatch"], lw=0.8, ls=":", label=f"{_method_name(row)} null ± 2 std")
        bad = row.get("gamma_interpretable") is False
        ax.plot(xs, gamma, ls="--" if bad else "-", marker=style["marker"], color=color,
                lw=2, label=_method_name(row) + (" (uninterpretable)" if bad else ""))
        exact = [l for l in row.get("gamma_exact") or [] if 0 <= l < len(gamma)]
        if exact:      # exact by construction: hollow grey rings, left out of the deep Γ
            ax.plot([xs[l] for l in exact], [gamma[l] for l in exact], ls="none", marker="o", ms=13,
                    mfc="none", mec="0.45", mew=1.5,
                    label=None if marked_exact else "exact by construction (left out of deep Γ)")
            marked_exact = True
        drawn = True
    ax.axhline(0, color="0.5", lw=0.8)
    if drawn:
        ax.set_xlabel("residual position l")
        ax.set_ylabel(r"$\Gamma_l$ = mean cos($a_l$, $g_l$)")
        ax.set_title(r"Gradient cosine $\Gamma_l$ and its random-feedback null")
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        n_entries = len(ax.get_legend_handles_labels()[1])
        ax.legend(fontsize=9, loc="center left", bbox_to_anchor=(1.02, 0.5),
                  ncol=_legend_layout(fig, n_entries, 4.6))
    else:
        _no_data(ax, "no method has Γ")
    fig.tight_layout()
    return fig


def rho_figure(audit: dict) -> Figure:
    """ρ_l per method, one panel each, as grouped bars beside the BP and random-vector controls."""
    rows = [r for r in audit.get("methods") or []
            if isinstance(r.get("rho_layers"), dict)
            and _has_values([_plottable(v) for vs in r["rho_layers"].values() for v in vs or []])]
    ncols = min(4, max(1, len(rows)))
    nrows = math.ceil(len(rows) / ncols) if rows else 1
    fig = Figure(figsize=(3.4 * ncols + 1.5, 3.2 * nrows + 0.4))
    if not rows:
        _no_data(fig.subplots(), "no method has ρ")
        return fig
    grid = fig.subplots(nrows, ncols, sharey=True, squeeze=False).ravel()
    for ax in grid[len(rows):]:
        ax.set_visible(False)
    axes = grid[:len(rows)]
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
        ax.set_title(f"{_method_name(row)}: deep ρ {_signed(row.get('rho_deep'))}", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    for ax in grid[::ncols]:
        ax.set_ylabel(r"$\rho_l$ (predicted vs true ΔCE)")
    fig.legend([Patch(facecolor="0.6", edgecolor="black"), Patch(facecolor="0.35", edgecolor="black"),
                Patch(facecolor="0.75", edgecolor="black")],
               ["the method's credit (its colour)", "a = BP gradient (≈ 1)", "a = random vector (≈ 0)"],
               loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=9)
    fig.tight_layout()
    return fig


def alignment_figure(audit: dict) -> Figure:
    """Γ_l and cos(W, B) against epoch per method, from each row's "alignment" (a pure view: the
    means over seeds are audit.json's). One panel per method with a position that is not exact
    by construction (bp has none), then one per rule with feedback weights."""
    rows = [r for r in audit.get("methods") or [] if isinstance(r.get("alignment"), dict)
            and r["alignment"].get("epochs")]
    n_pos = max((len(g) for r in rows for g in r["alignment"]["gamma"]), default=0)
    gamma_rows = [r for r in rows if set(range(n_pos)) - set(r.get("gamma_exact") or ())]
    weight_rows = [r for r in rows if r["alignment"].get("weight_alignment")]
    if not gamma_rows and not weight_rows:
        fig = Figure(figsize=(6, 2.5))
        _no_data(fig.subplots(), "no alignment was recorded over training")
        return fig
    ncols = min(4, max(len(gamma_rows), len(weight_rows)))
    up = lambda n: -(-n // ncols)
    nrows = up(len(gamma_rows)) + up(len(weight_rows))
    fig = Figure(figsize=(3.6 * ncols + 0.4, 2.9 * nrows + 0.5))
    grid = fig.subplots(nrows, ncols, squeeze=False)
    for ax in grid.flat:
        ax.set_visible(False)
    cmap = matplotlib.colormaps["viridis"]
    shade = lambda i, n: cmap(i / max(1, n - 1) * 0.9)
    panels = [(r, "gamma", divmod(i, ncols)) for i, r in enumerate(gamma_rows)]
    panels += [(r, "weights", (up(len(gamma_rows)) + i // ncols, i % ncols)) for i, r in enumerate(weight_rows)]
    for row, kind, (gi, gj) in panels:
        ax = grid[gi][gj]
        ax.set_visible(True)
        al = row["alignment"]
        epochs = al["epochs"]
        if kind == "gamma":
            exact = set(row.get("gamma_exact") or ())
            for l in range(n_pos):
                ys = [_plottable(g[l]) if l < len(g) else math.nan for g in al["gamma"]]
                if l not in exact and _has_values(ys):
                    ax.plot(epochs, ys, marker="o", ms=3, color=shade(l, n_pos), label=f"l = {l}")
            skipped = f", l = {', '.join(map(str, sorted(exact)))} exact: not drawn" if exact else ""
            ax.set_title(f"{_method_name(row)}: Γ_l{skipped}", fontsize=9)
            ax.set_ylabel(r"$\Gamma_l$ = mean cos($a_l$, $g_l$)", fontsize=8)
        else:
            pairs = al["weight_alignment"]
            blocks = sorted({n.split(".", 1)[0] for n in pairs}, key=lambda b: (len(b), b))
            modules = sorted({n.split(".", 1)[1] for n in pairs if "." in n})
            for name, ys in pairs.items():
                block, _, module = name.partition(".")
                ax.plot(epochs, [_plottable(v) for v in ys], marker=".", color=shade(blocks.index(block), len(blocks)),
                        ls=("-", "--", ":", "-.")[modules.index(module) % 4] if module in modules else "-",
                        label=f"block {block} {module}".strip())
            ax.set_title(f"{_method_name(row)}: cos(W, B) per feedback weight", fontsize=9)
            ax.set_ylabel("cos(vec W, vec B)", fontsize=8)
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_ylim(-1.05, 1.05)
        ax.set_xlabel("epoch", fontsize=8)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6.5, loc="lower right", ncol=2)
    fig.suptitle("Alignment over training (training-time monitor on its eval batch, mean over seeds)",
                 fontsize=11)
    fig.tight_layout()
    return fig


FIGURE_MAKERS: dict[str, Callable[[dict], Figure]] = {
    "norms.png": norms_figure, "monitor.png": monitor_figure,
    "gamma.png": gamma_figure, "rho.png": rho_figure, "alignment.png": alignment_figure,
}




def _save_png(fig: Figure, path: Path) -> Path:
    store.atomic_write_bytes(Path(path), _png(fig))
    return Path(path)


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
    fig.suptitle(f"{rows[0]['method']} sweep" if rows else "penalty sweep")
    return _save_png(fig, path)


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
    """Each run's statistic for every thresholded flag, with the threshold (red) and the interval
    over which every verdict stays the same (green); one panel per threshold, run labels once."""
    from ..verdict import FLAGS           # the statistics, their getters and scales: the flag table
    reports = store.json_safe(list(reports))
    sensitivity = store.json_safe(sensitivity)
    stats = [(st.threshold, textwrap.shorten(f"{flag.label} {st.name}", 44, placeholder="…"),
              st.of_report, st.log_scale)
             for flag in FLAGS.values() for st in flag.statistics if st.threshold in sensitivity]
    labels = [r.get("label", "") for r in reports]
    ncols = 4
    nrows = math.ceil(len(stats) / ncols)
    fig = Figure(figsize=(15, 0.22 * len(reports) * nrows + 1.6 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(stats):]:
        ax.set_visible(False)
    for i, (ax, (name, title, stat, log)) in enumerate(zip(axes, stats)):
        values = [_plottable(stat(r), log=log) for r in reports]
        ax.scatter(values, range(len(values)), s=14, zorder=3)
        ax.set_yticks(range(len(values)), labels if i % ncols == 0 else [], fontsize=6)
        ax.set_ylim(-0.5, len(values) - 0.5)
        if log:
            ax.set_xscale("log")
        entry = sensitivity.get(name, {})
        lo, hi = (entry.get("interval") or [None, None])
        lo, hi = _f(lo), _f(hi)
        if _f(entry.get("current")) is not None:
            ax.axvline(_f(entry["current"]), color="tab:red", ls="--")
        left, right = ax.get_xlim()
        if lo is not None and hi is not None:          # an open end runs to the edge of the panel
            lo, hi = max(lo, left), min(hi, right)
            if lo < hi:
                ax.axvspan(lo, hi, alpha=0.2, color="tab:green")
        ax.set_xlim(left, right)
        if log:
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{title}\nthreshold {_g(entry.get('current'))}", fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
    fig.legend([Patch(facecolor="tab:green", alpha=0.2), Line2D([], [], color="tab:red", ls="--")],
               ["thresholds giving the same verdicts", "current threshold"],
               loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, fontsize=9)
    fig.tight_layout()
    return _save_png(fig, path)
