"""Threshold sensitivity: for each threshold of the flag table, the interval over which every
verdict of a set of runs (or an audit's across-seed (d) decisions) stays as it is now."""
from __future__ import annotations

import math
from typing import Sequence

from .depth import ACC_TOLERANCE, ERROR_RATE, DepthDecision, redecide_audit
from .store import json_number as _num, json_safe
from .verdict import FLAGS, Thresholds, _fmt


def _run_interval(stats: list[float], current: float, direction: str) -> tuple[float, float, str, int, int]:
    if direction == ">":
        fired = [s for s in stats if s > current]
        spared = [s for s in stats if s <= current]
        return max(spared, default=-math.inf), min(fired, default=math.inf), "[lo, hi)", len(fired), len(spared)
    fired = [s for s in stats if s < current]
    spared = [s for s in stats if s >= current]
    return max(fired, default=-math.inf), min(spared, default=math.inf), "(lo, hi]", len(fired), len(spared)


def _depth_interval(decisions: dict[str, DepthDecision], t: Thresholds) -> dict:
    """The margin interval over which every method's (d) decision stays, found by re-running the
    audit's decisions (Holm included, `depth.redecide_audit`). An outcome can only change where the
    margin passes a bound of a contrast at some level the step-down can use, so the outcomes are
    checked on a grid of those bounds and between them."""
    def outcomes(margin: float) -> tuple[str, ...]:
        again = redecide_audit(decisions, margin)
        return tuple(again[m].outcome for m in decisions)
    K = max(1, sum(d.control is not None for d in decisions.values()))
    levels = sorted({ERROR_RATE / k for k in range(1, K + 1)})
    ends = sorted({b + ACC_TOLERANCE for d in decisions.values()
                   for c in (d.control, d.yardstick) if c is not None
                   for a in levels for b in (c.bounds(a) or ())})
    now = outcomes(t.depth_margin)
    lo, hi = -math.inf, math.inf
    for b in ends:                    # the outcomes are constant between consecutive ends
        if b < t.depth_margin and outcomes(b) != now:
            lo = b
        if b >= t.depth_margin and hi == math.inf and outcomes(b + 1e-12) != now:
            hi = b
    return {"fires_when": "upper bound < threshold",
            "interval": [lo, hi],      # where the outcomes change: a bound + ACC_TOLERANCE
            "interval_shape": "(lo, hi]",
            "n_fired": now.count("undercut"), "n_spared": now.count("clears"),
            "n_unmeasured": len(now) - now.count("undercut") - now.count("clears"),
            "per_run": dict(zip(decisions, now))}


def threshold_sensitivity(reports: Sequence[dict], thresholds: Thresholds | None = None,
                          depth: dict[str, DepthDecision | dict | None] | None = None) -> tuple[dict, str]:
    """For each threshold, the interval over which every verdict stays as it is now.

    For each statistic of the flag table: a flag that fires when stat > T keeps every run's flag for
    any T' in [max stat of the runs it spares, min stat of the runs it fires on); one that fires
    when stat < T for any T' in (max fired, min spared]. An open end is ±inf ("inf"/"-inf" in
    JSON). Runs whose statistic is NaN fire or stay unmeasured whatever the threshold; they are
    counted apart and do not narrow the interval. `depth_margin`: with `depth` ({method: its
    across-seed decision, as an audit stores it}) the interval over which re-running those
    decisions gives the same outcomes; without it, each run's own gap. `thresholds` defaults to
    those stored in the first report. Returns (JSON-ready dict, fixed-width table).
    """
    dicts = [r.to_dict() if hasattr(r, "to_dict") else r for r in reports]
    if thresholds is None:
        thresholds = Thresholds(**dicts[0]["thresholds"]) if dicts else Thresholds()
    decisions = {name: d if isinstance(d, DepthDecision) else DepthDecision.from_dict(d)
                 for name, d in (depth or {}).items() if d}
    out: dict[str, dict] = {}
    labels = [d.get("label", "") or f"run {i}" for i, d in enumerate(dicts)]
    for flag in FLAGS.values():
        for stat in flag.statistics:
            current = getattr(thresholds, stat.threshold)
            if stat.threshold == "depth_margin" and decisions:
                out[stat.threshold] = {"current": current, **_depth_interval(decisions, thresholds)}
                continue
            stats = [_num(stat.of_report(d)) for d in dicts]
            measured = [s for s in stats if not math.isnan(s)]
            lo, hi, shape, n_fired, n_spared = _run_interval(measured, current, stat.direction)
            out[stat.threshold] = {"current": current, "fires_when": f"stat {stat.direction} threshold",
                                   "interval": [lo, hi], "interval_shape": shape,
                                   "n_fired": n_fired, "n_spared": n_spared,
                                   "n_unmeasured": len(stats) - len(measured),
                                   "per_run": {lab: s for s, lab in zip(stats, labels)}}
    result = json_safe(out)
    head = f"{'threshold':<13} {'current':>9}  {'fires if':>8}  {'same verdicts for':<28} fired/spared/n.m."
    lines = [head, "-" * len(head)]
    for name, row in out.items():
        lo, hi = row["interval"]
        left, right = row["interval_shape"][0], row["interval_shape"][-1]
        interval = f"{left}{_fmt(lo, '.3g')}, {_fmt(hi, '.3g')}{right}"
        lines.append(f"{name:<13} {row['current']:>9.3g}  {row['fires_when'].split()[-2] + ' T':>8}"
                     f"  {interval:<28} {row['n_fired']}/{row['n_spared']}/{row['n_unmeasured']}")
    return result, "\n".join(lines)
