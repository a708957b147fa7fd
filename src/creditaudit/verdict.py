"""The verdict: thresholds, flags, verdict strings, reasons, first-fire epochs, the early-stop rule,
method-level aggregation over seeds and threshold sensitivity. The only place a verdict is decided
(docs/PROTOCOL.md states the rules in words).

    (a)  EXPLODED    max_l ‖h_{l+1}‖/‖h_l‖ > 50                     scale stability (paper)
    (a′) GROWN       max_l ‖h_l‖/‖h_l at init‖ > 100, or ‖h_L‖/‖h_0‖ > 50   growth since init (project)
    (b)  AT FLOOR    ‖g_L‖ < 1e-7                                    reference validity (paper)
    (b′) ATTENUATED  readout gain ‖g_L‖/‖∂CE/∂logits‖ < 1e-2         reference validity (project)
    (c)  DRIFT       cross-batch stability s_{L/2} > 0.30            descriptive: never changes a verdict
    (d)  UNDERCUT    test acc < frozen-blocks acc + 0.02             depth utility

    project verdict: flags (a), (a′), (b′), (d);  paper verdict: flags (a), (b), (d)
    "walk back: <fired flags>"   when any of its flags fired (a fired flag is evidence enough)
    "trustworthy"                when every one of its flags was evaluated, on a finished run, and
                                 none fired
    "incomplete: <what is missing>"  otherwise (a flag not evaluated, the run unfinished, (d)
                                 undetermined across seeds)

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
    """Flag thresholds (docs/PROTOCOL.md). Accuracies are fractions: depth_margin 0.02 = 2 points."""

    growth: float = 50.0
    init_growth: float = 100.0
    stack_growth: float = 50.0
    floor: float = 1e-7
    gain: float = 1e-2
    drift: float = 0.30
    depth_margin: float = 0.02


FLAG_NAMES = {"a": "(a) EXPLODED", "a_prime": "(a′) GROWN", "b": "(b) AT FLOOR",
              "b_prime": "(b′) ATTENUATED", "c": "(c) DRIFT", "d": "(d) UNDERCUT"}
PROJECT_FLAGS = ("a", "a_prime", "b_prime", "d")
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


def fires_a_prime(init_growth: float | str | None, stack_growth: float | str | None,
                  t: Thresholds) -> bool | None:
    """(a′) fires when any ‖h_l‖ grew past `init_growth` × its value at initialisation, or when the
    stack amplifies ‖h_0‖ past `stack_growth`; a non-finite statistic fires. None (not evaluated)
    when there is no recorded initialisation and the whole-stack ratio alone does not fire."""
    init_growth, stack_growth = _num(init_growth), _num(stack_growth)
    stack = not math.isfinite(stack_growth) and not math.isnan(stack_growth) or stack_growth > t.stack_growth
    if math.isnan(init_growth):
        return True if stack else None
    return not math.isfinite(init_growth) or init_growth > t.init_growth or stack


def fires_d(gap: float | str | None, t: Thresholds) -> bool | None:
    """(d) fires when accuracy − frozen-control accuracy falls short of the margin (with a 1e-9
    tolerance, so a gap of exactly the margin clears it despite float rounding); None when the
    gap could not be measured."""
    gap = _num(gap)
    return None if math.isnan(gap) else gap < t.depth_margin - 1e-9


def growth_since_init(h_norms: Sequence[float], init: Sequence[float] | None) -> float:
    """(a′) statistic: max_l ‖h_l‖ / ‖h_l at initialisation‖ (NaN without a recorded init)."""
    if not init or len(init) != len(h_norms):
        return float("nan")
    ratios = [_num(h) / _num(h0) if _num(h0) > 0 else float("inf") for h, h0 in zip(h_norms, init)]
    return float("nan") if any(math.isnan(r) for r in ratios) else max(ratios)


def stack_growth(h_norms: Sequence[float]) -> float:
    """(a′) whole-stack amplification ‖h_L‖ / ‖h_0‖ (medians); 1.0 with no blocks."""
    h0, hl = _num(h_norms[0]), _num(h_norms[-1])
    return hl / h0 if h0 > 0 else float("inf") if hl > 0 else float("nan")


def first_fire_epochs(history: Sequence[dict], thresholds: Thresholds = Thresholds()
                      ) -> dict[str, int | None]:
    """The first epoch at which (a), (b) and (b′) fired in a training-time monitor history.

    history: one dict per epoch with keys epoch, h_norms, g_norms, max_growth, gain (test_acc is
    ignored here). Values may be JSON-safe (None / "inf"). max_growth is recomputed from h_norms
    when absent. Returns {"a": epoch | None, "b": …, "b_prime": …}; None = never fired.
    """
    first: dict[str, int | None] = {"a": None, "a_prime": None, "b": None, "b_prime": None}
    init = [_num(v) for v in history[0]["h_norms"]] if history and int(history[0]["epoch"]) == 0 else None
    for row in history:
        h = [_num(v) for v in row["h_norms"]]
        growth = row["max_growth"] if "max_growth" in row else M.max_block_growth(h)
        fired = {"a": fires_a(growth, thresholds),
                 "a_prime": bool(fires_a_prime(growth_since_init(h, init), stack_growth(h), thresholds)),
                 "b": fires_b(row["g_norms"][-1], thresholds),
                 "b_prime": fires_b_prime(row["gain"], thresholds)}
        for key, on in fired.items():
            if on and first[key] is None:
                first[key] = int(row["epoch"])
    return first


def flag_streak(history: Sequence[dict], thresholds: Thresholds) -> int:
    """How many consecutive epochs, ending now, (a), (a′) or (b′) has held in a monitor history.

    (b) alone does not count: it also fires on a healthy model that fits its eval batch (the
    confound (b′) removes), and stopping such a run early would only truncate a good result.
    """
    streak = 0
    for r in reversed(history):
        h = [_num(v) for v in r["h_norms"]]
        grown = fires_a_prime(growth_since_init(h, [_num(v) for v in history[0]["h_norms"]]),
                              stack_growth(h), thresholds)
        if not (fires_a(r["max_growth"], thresholds) or grown or fires_b_prime(r["gain"], thresholds)):
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


def verdict_string(flags: dict[str, bool | None], keys: Sequence[str], nonfinite: bool = False,
                   missing: Sequence[str] = ()) -> str:
    """"walk back: …" if a flag of `keys` fired; else "incomplete: …" naming every flag that was not
    evaluated (None) and every other missing piece of evidence (`missing`); else "trustworthy"."""
    fired = []
    for k in keys:
        if flags.get(k):
            name = FLAG_NAMES[k]
            fired.append(f"{name} (non-finite residual stream)" if nonfinite and k == "a" else name)
    if fired:
        return "walk back: " + ", ".join(fired)
    gaps = [f"{FLAG_NAMES[k].split()[0]} not evaluated" for k in keys if flags.get(k) is None
            and not any(m.startswith(FLAG_NAMES[k].split()[0]) for m in missing)]
    gaps += list(missing)
    return "incomplete: " + "; ".join(gaps) if gaps else "trustworthy"


def training_gaps(training: dict | None) -> list[str]:
    """What a run's training status leaves missing: a run that did not finish is no final result.
    A run stopped by --stop-when-flagged or diverged is evidence of a flag, not a gap."""
    if training is None:
        return []
    status = training.get("status")
    done, planned = training.get("epochs_completed"), training.get("epochs_planned")
    if status in ("finished", "stopped", "diverged"):
        return []
    return [f"the run is unfinished ({done}/{planned} epochs, status {status or 'unknown'})"]


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
    if f.get("a_prime") and not r.nonfinite and not r.diverged:
        since = ("" if math.isnan(_num(r.init_growth)) else
                 f"‖h_l‖ grew up to {_num(r.init_growth):.3g}× its value at initialisation "
                 f"(threshold {t.init_growth:g}) and ")
        out.append(f"(a′) GROWN: {since}the stack amplifies ‖h_0‖ = {r.residual_norms[0]:.3g} "
                   f"{_num(r.stack_growth):.3g}× to ‖h_L‖ = {r.residual_norms[-1]:.3g} (threshold "
                   f"{t.stack_growth:g}), so the headline accuracy is read through a terminal "
                   "normalisation of a stream whose scale the method does not control.")
    rho_fp32 = getattr(r, "rho_bp_model_precision", None)
    if r.nonfinite:
        out += [f"{FLAG_NAMES[k]}: the BP reference gradient is non-finite, so Γ has no reference "
                "to be compared with." for k in ("b", "b_prime") if f[k]]
    elif f["b"]:
        check = ("" if rho_fp32 is None else
                 f" In the model's own precision the reference still predicts the loss change with "
                 f"ρ_BP = {rho_fp32:.3f}" + (" (so it is numerically intact; see (b′) for what that "
                 "means)." if rho_fp32 > 0.9 else ", so it is numerically unreliable."))
        out.append(f"(b) AT FLOOR: ‖g_L‖ = {r.bp_grad_norms[-1]:.3g} < {t.floor:g}: the reported "
                   "Γ compares the credit with a gradient at the paper's floor, where float32 "
                   f"rounding can dominate it.{check}")
    if f["b_prime"] and not r.nonfinite:
        out.append(f"(b′) ATTENUATED: the readout passes only {r.readout_gain:.3g} of the output "
                   f"error back into the residual stream (< {t.gain:g}): moving h_L changes the "
                   f"loss about {1 / max(r.readout_gain, 1e-300):.3g}× less than through a healthy "
                   "readout, so the blocks' credit — aligned or not — barely moves the loss, and a "
                   "reported Γ or ρ at the blocks does not show that the blocks learn from it.")
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
    """The sentence docs/PROTOCOL.md asks for when (b) and (b′) disagree."""
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
    "init_growth": (lambda d: d.get("init_growth"), ">"),
    "stack_growth": (lambda d: d.get("stack_growth"), ">"),
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


def interval(values: Sequence[float], confidence: float = 0.95,
             bounds: tuple[float, float] = (-math.inf, math.inf)) -> dict:
    """Mean of per-seed values with a t-interval (n ≥ 2) and, at n ≥ 5, a BCa bootstrap interval
    (scipy.stats.bootstrap, 9,999 resamples, fixed seed); intervals are clipped to `bounds` (an
    accuracy cannot pass 100 %). None where it cannot be computed."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    out = {"n": len(vals), "mean": statistics.fmean(vals) if vals else None, "t_interval": None,
           "bootstrap_interval": None}
    if len(vals) >= 2:
        from scipy import stats
        sem = statistics.stdev(vals) / math.sqrt(len(vals))
        half = float(stats.t.ppf(0.5 + confidence / 2, len(vals) - 1)) * sem
        out["t_interval"] = [max(bounds[0], out["mean"] - half), min(bounds[1], out["mean"] + half)]
    if len(vals) >= 5 and len(set(vals)) > 1:
        import numpy as np
        from scipy import stats
        res = stats.bootstrap((np.array(vals),), np.mean, confidence_level=confidence,
                              n_resamples=9999, random_state=np.random.default_rng(0))
        out["bootstrap_interval"] = [max(bounds[0], float(res.confidence_interval.low)),
                                     min(bounds[1], float(res.confidence_interval.high))]
    return out


def depth_decision(gaps: Sequence[float], t: Thresholds) -> tuple[bool | None, dict, str | None]:
    """(d) across seeds from the paired gaps acc − frozen acc of the same seed: (fires, interval,
    why undetermined). One seed: its gap decides. Several: fires when the 95 % t-interval lies below
    the margin, passes when it lies at or above it, and is undetermined when it straddles it."""
    iv = interval(gaps)
    if iv["n"] == 0:
        return None, iv, None
    if iv["t_interval"] is None:
        return fires_d(iv["mean"], t), iv, None
    lo, hi = iv["t_interval"]
    if hi < t.depth_margin - 1e-9:
        return True, iv, None
    if lo >= t.depth_margin - 1e-9:
        return False, iv, None
    return None, iv, (f"(d) undetermined: the paired gap to the frozen control is {100 * iv['mean']:+.1f} "
                      f"points with 95 % interval [{100 * lo:+.1f}, {100 * hi:+.1f}] over {iv['n']} "
                      f"seeds, which straddles the +{100 * t.depth_margin:g}-point margin; add seeds")


def method_verdict(seeds: Sequence[SeedEvidence], t: Thresholds) -> dict:
    """Flags, verdicts and reasons of one method across its seeds (the audit table's last columns).

    (a), (a′), (b), (b′), (c) fire for the method when they fire on any diagnosed seed; a flag is
    evaluated (False) only when every seed was diagnosed and none left it unevaluated. (d) uses the
    seed-paired gaps (`depth_decision`). Anything missing — a run that failed, did not finish or
    was not diagnosed, a seed without a finished frozen control — keeps the verdict from
    "trustworthy"; a fired flag still walks it back.
    """
    diagnosed = [s for s in seeds if s.report]
    keys = ("a", "a_prime", "b", "b_prime", "c")
    counts = {k: sum(bool(s.report["flags"].get(k)) for s in diagnosed) for k in keys}
    flags: dict[str, bool | None] = {}
    for k in keys:
        unevaluated = any(s.report["flags"].get(k) is None for s in diagnosed)
        flags[k] = True if counts[k] else (None if unevaluated or len(diagnosed) < len(seeds)
                                            or not diagnosed else False)
    paired = [s for s in seeds if s.acc is not None and s.frozen_acc is not None]
    gaps = [s.acc - s.frozen_acc for s in paired]
    flags["d"], gap_interval, undetermined = depth_decision(gaps, t)
    missing = []
    lost = [s for s in seeds if not s.report]
    if lost:
        missing.append(f"{len(lost)}/{len(seeds)} runs failed or were not diagnosed "
                       f"({', '.join(f'{s.label}: {s.status}' for s in lost)})")
    for s in diagnosed:
        missing += [f"{s.label}: {gap}" for gap in training_gaps(s.report.get("training"))]
    if len(paired) < len(seeds) and paired:
        missing.append(f"(d) paired with a finished frozen control for only {len(paired)}/{len(seeds)} seeds")
    if undetermined:
        missing.append(undetermined)
    out = []
    for k in keys:
        if flags[k]:
            first = next(s for s in diagnosed if s.report["flags"].get(k))
            sentence = next((x for x in first.report["reasons"] if x.startswith(FLAG_NAMES[k])),
                            FLAG_NAMES[k])
            out.append(f"{sentence} [{counts[k]}/{len(diagnosed)} seeds; e.g. {first.label}]")
    if flags["d"]:
        ci = gap_interval["t_interval"]
        spread = "" if ci is None else f" (95 % interval [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}])"
        out.append(f"(d) UNDERCUT: over {len(paired)} seed(s), accuracy is "
                   f"{100 * gap_interval['mean']:+.1f} points{spread} from the frozen-blocks control "
                   f"of the same seed, short of +{100 * t.depth_margin:g}, so the headline accuracy "
                   "does not show that the trained blocks add anything.")
    return {"flags": flags, "flag_counts": counts, "depth_gap": gap_interval["mean"],
            "depth_gap_interval": gap_interval, "n_paired_with_frozen": len(paired),
            "verdict": verdict_string(flags, PROJECT_FLAGS, missing=missing),
            "paper_verdict": verdict_string(flags, PAPER_FLAGS, missing=missing),
            "missing": missing, "reasons": out}
