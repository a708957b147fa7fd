"""The verdict: thresholds, flags, verdict strings, reasons, first-fire epochs, the early-stop rule,
method-level aggregation over seeds and threshold sensitivity. The only place a verdict is decided.

    (a)  EXPLODED    max_l ‖h_{l+1}‖/‖h_l‖ > 50                 scale stability
    (b)  AT FLOOR    ‖g_L‖ < 1e-7                                reference validity (paper)
    (b′) ATTENUATED  readout gain ‖g_L‖/‖∂CE/∂logits‖ < 1e-2     reference validity (this project)
    (c)  DRIFT       cross-batch stability s_{L/2} > 0.30        descriptive: never changes a verdict
    (d)  UNDERCUT    test acc < frozen-blocks acc + 0.02         depth utility

    project verdict = "trustworthy" if none of (a), (b′), (d) fires, else "walk back: <fired>"
    paper verdict   = the same with (b) in place of (b′), shown beside it for comparability

A residual stream (or readout) that goes non-finite counts as (a) fired ("non-finite residual
stream"), and its (b)/(b′) as fired too: a NaN reference gradient is no reference.
Every function here reads plain numbers (or their JSON-safe forms: None = NaN, "inf"), so the same
rules apply to a fresh diagnosis, a monitor history and an audit.json read back.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

from . import metrics as M
from .store import json_number as _num, json_safe


@dataclass(frozen=True)
class Thresholds:
    """Flag thresholds (SPEC §6). Accuracies are fractions: depth_margin 0.02 = 2 points."""

    growth: float = 50.0
    floor: float = 1e-7
    gain: float = 1e-2
    drift: float = 0.30
    depth_margin: float = 0.02


FLAG_NAMES = {"a": "(a) EXPLODED", "b": "(b) AT FLOOR", "b_prime": "(b′) ATTENUATED",
              "c": "(c) DRIFT", "d": "(d) UNDERCUT"}
PROJECT_FLAGS = ("a", "b_prime", "d")
PAPER_FLAGS = ("a", "b", "d")


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------

def _fmt(value: float | None, spec: str = ".3g") -> str:
    """format(value, spec); None → "—" and NaN → "nan", both padded to the spec's width."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        width = "".join(c for c in spec.split(".")[0] if c.isdigit())
        return format("—" if value is None else "nan", f">{width}" if width else "")
    return format(value, spec)


# ---------------------------------------------------------------------------------------------
# The flags, from the statistics 
# ---------------------------------------------------------------------------------------------

# The fires_* functions accept floats or their JSON-safe forms (None = NaN, "inf"), so they work
# on an in-memory monitor history and on one read back from metrics JSON alike.

def fires_a(max_growth: float | str | None, t: Thresholds) -> bool:
    """(a) fires above the threshold, and for a non-finite statistic (non-finite stream)."""
    max_growth = _num(max_growth)
    return not math.isfinite(max_growth) or max_growth > t.growth


def fires_b(g_last: float | str | None, t: Thresholds) -> bool:
    """(b) fires below the floor, and for a NaN/inf reference gradient."""
    g_last = _num(g_last)
    return not math.isfinite(g_last) or g_last < t.floor


def fires_b_prime(gain: float | str | None, t: Thresholds) -> bool:
    """(b′) fires below the gain threshold, and for a NaN/inf gain."""
    gain = _num(gain)
    return not math.isfinite(gain) or gain < t.gain


def fires_c(stability_mid: float | str | None, t: Thresholds) -> bool | None:
    """(c) fires above the drift threshold; None when s could not be measured."""
    stability_mid = _num(stability_mid)
    return None if math.isnan(stability_mid) else stability_mid > t.drift


def fires_d(gap: float | str | None, t: Thresholds) -> bool | None:
    """(d) fires when accuracy − frozen-control accuracy falls short of the margin (with a 1e-9
    tolerance, so a gap of exactly the margin clears it despite float rounding); None when the
    gap could not be measured."""
    gap = _num(gap)
    return None if math.isnan(gap) else gap < t.depth_margin - 1e-9


def first_fire_epochs(history: Sequence[dict], thresholds: Thresholds = Thresholds()
                      ) -> dict[str, int | None]:
    """The first epoch at which (a), (b) and (b′) fired in a training-time monitor history.

    history: one dict per epoch with keys epoch, h_norms, g_norms, max_growth, gain (test_acc is
    ignored here). Values may be JSON-safe (None / "inf"). max_growth is recomputed from h_norms
    when absent. Returns {"a": epoch | None, "b": …, "b_prime": …}; None = never fired.
    """
    first: dict[str, int | None] = {"a": None, "b": None, "b_prime": None}
    for row in history:
        growth = (row["max_growth"] if "max_growth" in row
                  else M.max_block_growth([_num(v) for v in row["h_norms"]]))
        fired = {"a": fires_a(growth, thresholds), "b": fires_b(row["g_norms"][-1], thresholds),
                 "b_prime": fires_b_prime(row["gain"], thresholds)}
        for key, on in fired.items():
            if on and first[key] is None:
                first[key] = int(row["epoch"])
    return first


def flag_streak(history: Sequence[dict], thresholds: Thresholds) -> int:
    """How many consecutive epochs, ending now, (a) or (b′) has held in a monitor history.

    (b) alone does not count: it also fires on a healthy model that fits its eval batch (the
    confound (b′) removes), and stopping such a run early would only truncate a good result.
    """
    streak = 0
    for r in reversed(history):
        if not (fires_a(r["max_growth"], thresholds) or fires_b_prime(r["gain"], thresholds)):
            break
        streak += 1
    return streak


def stop_rule(epochs: int | None, thresholds: Thresholds) -> Callable[[Sequence[dict]], str | None] | None:
    """The early-stop rule handed to the trainer for `--stop-when-flagged N`: given the monitor
    history so far, a message when a flag has held N epochs, else None. None when N is None."""
    if epochs is None:
        return None

    def rule(history: Sequence[dict]) -> str | None:
        held = flag_streak(history, thresholds)
        if held >= epochs:
            return (f"stopped at epoch {history[-1]['epoch']}: a monitor flag held {held} epochs "
                    f"(--stop-when-flagged {epochs})")
        return None
    return rule


def verdict_string(flags: dict[str, bool | None], keys: Sequence[str], nonfinite: bool = False) -> str:
    fired = []
    for k in keys:
        if flags.get(k):
            name = FLAG_NAMES[k]
            fired.append(f"{name} (non-finite residual stream)" if nonfinite and k == "a" else name)
    return "walk back: " + ", ".join(fired) if fired else "trustworthy"


def reasons(r) -> list[str]:
    t, f, out = r.thresholds, r.flags, []
    if f["a"]:
        if r.diverged:
            out.append(f"(a) EXPLODED: training diverged ({r.diverged}); the figures here come "
                       "from its last finite checkpoint, and no number of this run can be "
                       "reported as the method's result.")
        elif r.nonfinite:
            out.append("(a) EXPLODED: the residual stream (or its readout) is non-finite (inf/NaN) "
                       "on the eval batches, so every number measured on it — accuracy, Γ, ρ — "
                       "is invalid.")
        else:
            out.append(f"(a) EXPLODED: one block multiplies ‖h‖ by {r.max_growth:.3g} "
                       f"(> {t.growth:g}; ‖h_L‖ = {r.residual_norms[-1]:.3g}), so the headline "
                       "accuracy is read through a terminal LayerNorm hiding an unstable stream "
                       "and does not show that the blocks learned a usable representation.")
    if r.nonfinite:
        out += [f"{FLAG_NAMES[k]}: the BP reference gradient is non-finite, so Γ has no reference "
                "to be compared with." for k in ("b", "b_prime") if f[k]]
    elif f["b"]:
        out.append(f"(b) AT FLOOR: ‖g_L‖ = {r.bp_grad_norms[-1]:.3g} < {t.floor:g}, so the "
                   "reported Γ is a cosine against a floor-level reference and means nothing.")
    if f["b_prime"] and not r.nonfinite:
        out.append(f"(b′) ATTENUATED: the readout passes only {r.readout_gain:.3g} of the output "
                   f"error back into the residual stream (< {t.gain:g}), so the reported Γ is a "
                   "cosine against a reference that no longer carries the loss's signal.")
    if f["c"]:
        out.append(f"(c) DRIFT: s at layer {r.mid_layer} is {r.stability_mid:.3f} (> {t.drift:g}): "
                   "one sample-invariant direction dominates the true gradient, so a high Γ there "
                   "can come from matching that drift rather than per-sample credit "
                   "(descriptive; it does not change the verdict).")
    if f["d"] and r.depth is not None:
        out.append(f"(d) UNDERCUT: accuracy {r.depth.acc:.4f} does not clear the frozen-blocks "
                   f"control {r.depth.frozen_acc:.4f} by {100 * t.depth_margin:g} points, so the "
                   "headline accuracy does not show that the trained blocks add anything.")
    return out


def disagreement(r) -> list[str]:
    """The sentence SPEC §6 asks for when (b) and (b′) disagree."""
    if r.nonfinite or r.flags["b"] == r.flags["b_prime"]:
        return []
    t = r.thresholds
    if r.flags["b"]:
        return [f"(b) fired but the readout gain is healthy ({r.readout_gain:.3g} ≥ {t.gain:g}): "
                f"‖g_L‖ = {r.bp_grad_norms[-1]:.3g} is small because the error at the logits is "
                f"small (median ‖∂CE/∂logits‖ = {r.logit_grad_norm:.3g}, eval loss "
                f"{r.eval_loss:.3g}: the model fits its eval batches), not because the readout "
                "attenuates it. The project verdict follows (b′)."]
    return [f"(b′) fired but (b) did not: ‖g_L‖ = {r.bp_grad_norms[-1]:.3g} stays above "
            f"{t.floor:g} only because the error at the logits is large (eval loss "
            f"{r.eval_loss:.3g}), while the readout attenuates it to {r.readout_gain:.3g} of its "
            "size — the absolute floor confounds the two. The project verdict follows (b′)."]


# ---------------------------------------------------------------------------------------------
# Threshold sensitivity
# ---------------------------------------------------------------------------------------------

# threshold name → (statistic read from a report dict, direction in which the flag fires)
_SENSITIVITY = {
    "growth": (lambda d: d["max_growth"], ">"),
    "floor": (lambda d: d["bp_grad_norms"][-1], "<"),
    "gain": (lambda d: d["readout_gain"], "<"),
    "drift": (lambda d: d["stability_mid"], ">"),
    "depth_margin": (lambda d: (d.get("depth") or {}).get("gap"), "<"),
}


def threshold_sensitivity(reports: Sequence[dict], thresholds: Thresholds | None = None
                          ) -> tuple[dict, str]:
    """For each threshold, the interval over which every run's flag stays as it is now.

    A flag that fires when stat > T (growth, drift) keeps every run's verdict for any T' in
    [max stat of the runs it spares, min stat of the runs it fires on); one that fires when
    stat < T (floor, gain, depth_margin on acc − frozen) for any T' in (max fired, min spared].
    An open end is ±inf ("inf"/"-inf" in JSON). Runs whose statistic is NaN (non-finite stream,
    or nothing measured) fire or stay unmeasured whatever the threshold; they are counted apart
    and do not narrow the interval. `thresholds` defaults to those stored in the first report.
    Returns (JSON-ready dict, fixed-width table).
    """
    dicts = [r.to_dict() if hasattr(r, "to_dict") else r for r in reports]
    if thresholds is None:
        thresholds = Thresholds(**dicts[0]["thresholds"]) if dicts else Thresholds()
    out: dict[str, dict] = {}
    for name, (stat_of, direction) in _SENSITIVITY.items():
        current = getattr(thresholds, name)
        stats = [_num(stat_of(d)) for d in dicts]
        labels = [d.get("label", "") or f"run {i}" for i, d in enumerate(dicts)]
        measured = [(s, lab) for s, lab in zip(stats, labels) if not math.isnan(s)]
        if direction == ">":
            fired = [s for s, _ in measured if s > current]
            spared = [s for s, _ in measured if s <= current]
            lo, hi = max(spared, default=-math.inf), min(fired, default=math.inf)
            shape = "[lo, hi)"
        else:
            fired = [s for s, _ in measured if s < current]
            spared = [s for s, _ in measured if s >= current]
            lo, hi = max(fired, default=-math.inf), min(spared, default=math.inf)
            shape = "(lo, hi]"
        out[name] = {"current": current, "fires_when": f"stat {direction} threshold",
                     "interval": [lo, hi], "interval_shape": shape,
                     "n_fired": len(fired), "n_spared": len(spared),
                     "n_unmeasured": len(stats) - len(measured),
                     "per_run": {lab: s for s, lab in zip(stats, labels)}}
    result = json_safe(out)
    head = f"{'threshold':<13} {'current':>9}  {'fires if':>8}  {'same verdicts for':<28} fired/spared/n.m."
    lines = [head, "-" * len(head)]
    for name, row in out.items():
        lo, hi = row["interval"]
        left, right = row["interval_shape"][0], row["interval_shape"][-1]
        interval = f"{left}{_fmt(lo, '.3g')}, {_fmt(hi, '.3g')}{right}"
        lines.append(f"{name:<13} {row['current']:>9.3g}  {row['fires_when'].split()[1] + ' T':>8}"
                     f"  {interval:<28} {row['n_fired']}/{row['n_spared']}/{row['n_unmeasured']}")
    return result, "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# One method over its seeds
# ---------------------------------------------------------------------------------------------

@dataclass
class SeedEvidence:
    """What one seed of a method contributes to the method's verdict.

    status: how the main run's training ended ("finished", "stopped", "diverged", "failed", …);
    report: its diagnosis dict (None if none); acc / frozen_acc: its headline accuracy and that of
    the frozen-blocks control of the same seed (None when missing or unfinished).
    """

    label: str
    status: str
    report: dict | None
    acc: float | None
    frozen_acc: float | None


def method_verdict(seeds: Sequence[SeedEvidence], t: Thresholds) -> dict:
    """Flags, verdicts and reasons of one method across its seeds (the audit table's last columns).

    (a), (b), (b′), (c) fire for the method when they fire on any diagnosed seed; (d) compares
    the seed-paired gaps acc − frozen acc (same seed), and fires when their mean falls short of the
    margin. Each reason names how many seeds it fired on and one example run.
    """
    diagnosed = [s for s in seeds if s.report]
    paired = [s for s in seeds if s.acc is not None and s.frozen_acc is not None]
    counts = {k: sum(bool(s.report["flags"].get(k)) for s in diagnosed) for k in ("a", "b", "b_prime", "c")}
    flags: dict[str, bool | None] = {k: (counts[k] > 0 if diagnosed else None) for k in counts}
    gap = statistics.fmean(s.acc - s.frozen_acc for s in paired) if paired else None
    flags["d"] = fires_d(gap, t)
    out = []
    for k in ("a", "b", "b_prime", "c"):
        if flags[k]:
            first = next(s for s in diagnosed if s.report["flags"].get(k))
            sentence = next((x for x in first.report["reasons"] if x.startswith(FLAG_NAMES[k])),
                            FLAG_NAMES[k])
            out.append(f"{sentence} [{counts[k]}/{len(diagnosed)} seeds; e.g. {first.label}]")
    if flags["d"]:
        out.append(f"(d) UNDERCUT: over {len(paired)} seed(s), accuracy is "
                   f"{100 * gap:+.1f} points from the frozen-blocks control of the same "
                   f"seed, short of +{100 * t.depth_margin:g}, so the headline accuracy "
                   "does not show that the trained blocks add anything.")
    failed = [s for s in seeds if s.status not in ("finished", "diverged", "stopped") or not s.report]

    def verdict(keys) -> str:
        if not diagnosed:
            return f"incomplete: no diagnosed run ({len(failed)}/{len(seeds)} failed)"
        return verdict_string(flags, keys)

    return {"flags": flags, "flag_counts": counts, "depth_gap": gap, "n_paired_with_frozen": len(paired),
            "verdict": verdict(PROJECT_FLAGS), "paper_verdict": verdict(PAPER_FLAGS), "reasons": out}
