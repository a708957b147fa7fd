"""The verdict: the flag table, the verdict object, (d) across seeds, first-fire epochs, the early-stop
rule, method-level aggregation over seeds and threshold sensitivity. The only place a verdict is
decided (docs/PROTOCOL.md states the rules in words).

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
    "incomplete: <what is missing>"  otherwise (a flag not evaluated, the run unfinished or stopped
                                 early, (d) undetermined across seeds)

Each flag is one entry of `FLAGS` (statistic, threshold, direction, when it can be evaluated, its
sentence, what it takes back, which verdicts use it); the verdict, the monitor's first-fire epochs,
the early-stop rule, threshold sensitivity and the report all read that table. A verdict is a
`Verdict` object (JSON via to_dict/from_dict); its text is for people, never parsed back.

Across seeds (d) is decided in depth.py (two paired contrasts, a variance over seeds and the
shared test set, Holm across an audit); the paper's own rule (mean gap < margin) is kept apart
for the paper verdict. Threshold sensitivity is in sensitivity.py. A residual stream (or readout) that goes non-finite counts as (a)
fired ("non-finite residual stream"), and its (b)/(b′) as fired too: a NaN reference gradient is no
reference. Every function here reads plain numbers (or their JSON-safe forms: None = NaN, "inf"),
so the same rules apply to a fresh diagnosis, a monitor history and an audit.json read back.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from . import metrics as M
from .depth import ACC_TOLERANCE, DepthDecision, PairedGap, depth_decision
from .errors import CreditAuditError
from .store import json_number as _num, unpack_correct

TRUSTWORTHY, WALK_BACK, INCOMPLETE = "trustworthy", "walk back", "incomplete"
# A frozen control is weak, at one seed, when its accuracy falls short of the yardstick of the
# same seed (the same frozen blocks, embedding and readout trained by exact gradients: bp's frozen
# control) by more than this. Only a lone run (`diagnose`, `check`) reads it; across seeds the
# shortfall is its own statistic with its own interval (depth.py). The line is one-sided 5 % for
# the *difference* yardstick − control at one seed: t_{0.95, 24} · 0.81 points = 1.38 points, 0.81
# the sd of that difference within a rule over its seeds, pooled over the 12 rules of the zoo audit
# whose control is not the yardstick itself (docs/rules/audit.json, each rule's yardstick under its
# own recipe; docs/PROTOCOL.md "The yardstick").
YARDSTICK_TOLERANCE = 0.0138


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

    def __post_init__(self):
        # a NaN threshold makes every comparison false, so nothing could ever fire
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise CreditAuditError(f"threshold {f.name} must be a number, got {value!r}")


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
# The flag table
# ---------------------------------------------------------------------------------------------

def _monitor_growth(row: dict, init: dict | None) -> Any:
    return row["max_growth"] if "max_growth" in row else M.max_block_growth([_num(v) for v in row["h_norms"]])


def _monitor_init_growth(row: dict, init: dict | None) -> float:
    now = [_num(v) for v in row["h_norms"]]
    return growth_since_init(now, None if init is None else [_num(v) for v in init["h_norms"]])


@dataclass(frozen=True)
class Statistic:
    """One thresholded statistic of a flag.

    fires when `value <direction> threshold` (with `tolerance` in the flag's favour of not firing,
    so float rounding cannot flip a gap of exactly the margin). A NaN value (or ±inf for a "<"
    statistic) is a non-finite stream: it fires when `nonfinite_fires`, else the statistic is not
    evaluated (None)."""

    name: str                                   # what it is, in the paper's words
    key: str                                    # its key in a diagnosis dict
    threshold: str                              # the Thresholds field
    direction: str                              # ">" or "<"
    of_report: Callable[[dict], Any]
    of_monitor: Callable[[dict, dict | None], Any] | None = None   # (monitor row, epoch-0 row)
    nonfinite_fires: bool = False
    tolerance: float = 0.0
    log_scale: bool = True                      # how a plot of it across runs reads best

    def fires(self, value: Any, t: Thresholds) -> bool | None:
        x, limit = _num(value), getattr(t, self.threshold)
        if math.isnan(x) or (self.direction == "<" and math.isinf(x)):
            return True if self.nonfinite_fires else None
        return x > limit if self.direction == ">" else x < limit - self.tolerance


@dataclass(frozen=True)
class Flag:
    """One diagnostic: its statistics, when it can be evaluated, what its firing takes back, which
    verdicts use it, whether the training-time monitor watches it and whether it may stop a run."""

    key: str
    label: str                                  # "(a)"
    word: str                                   # "EXPLODED"
    statistics: tuple[Statistic, ...]
    evaluable: str                              # when it can be evaluated
    takes_back: str                             # the reported number it takes back
    sentence: str                               # the plain sentence, without numbers
    verdicts: tuple[str, ...]                   # "paper", "project"
    monitored: bool = False                     # first-fire epoch from the monitor
    stops: bool = False                         # counts toward --stop-when-flagged

    @property
    def name(self) -> str:
        return f"{self.label} {self.word}"

    def fires(self, values: dict[str, Any], t: Thresholds) -> bool | None:
        """Fired when any statistic fires; else not evaluated (None) when any could not be; else False."""
        each = [s.fires(values.get(s.key), t) for s in self.statistics]
        return True if any(each) else None if any(e is None for e in each) else False

    def fires_on_report(self, report: dict, t: Thresholds) -> bool | None:
        return self.fires({s.key: s.of_report(report) for s in self.statistics}, t)

    def fires_on_monitor(self, row: dict, init: dict | None, t: Thresholds) -> bool | None:
        return self.fires({s.key: s.of_monitor(row, init) for s in self.statistics}, t)

    def to_dict(self) -> dict:
        return {"key": self.key, "name": self.name, "evaluable": self.evaluable,
                "takes_back": self.takes_back, "sentence": self.sentence, "verdicts": list(self.verdicts),
                "monitored": self.monitored, "stops": self.stops,
                "statistics": [{"name": s.name, "key": s.key, "threshold": s.threshold,
                                "fires_when": f"statistic {s.direction} threshold"} for s in self.statistics]}


FLAGS: dict[str, Flag] = {f.key: f for f in (
    Flag("a", "(a)", "EXPLODED",
         (Statistic("largest single-block growth max_l ‖h_{l+1}‖/‖h_l‖", "max_growth", "growth", ">",
                    lambda d: d.get("max_growth"), _monitor_growth, nonfinite_fires=True),),
         "always (a non-finite stream fires it)",
         "the headline accuracy",
         "the headline accuracy is read through a terminal LayerNorm hiding an unstable stream and "
         "does not show that the blocks learned a usable representation",
         ("paper", "project"), monitored=True, stops=True),
    Flag("a_prime", "(a′)", "GROWN",
         (Statistic("growth since initialisation max_l ‖h_l‖/‖h_l at init‖", "init_growth",
                    "init_growth", ">", lambda d: d.get("init_growth"), _monitor_init_growth),
          Statistic("whole-stack amplification ‖h_L‖/‖h_0‖", "stack_growth", "stack_growth", ">",
                    lambda d: d.get("stack_growth"),
                    lambda r, i: stack_growth([_num(v) for v in r["h_norms"]]))),
         "needs the run's initialisation (monitor epoch 0); without it only a firing whole-stack "
         "ratio decides",
         "the headline accuracy",
         "the headline accuracy is read through a terminal normalisation of a stream whose scale the "
         "method does not control",
         ("project",), monitored=True, stops=True),
    Flag("b", "(b)", "AT FLOOR",
         (Statistic("BP gradient at the last position ‖g_L‖", "g_L", "floor", "<",
                    lambda d: (d.get("bp_grad_norms") or [None])[-1],
                    lambda r, i: (r.get("g_norms") or [None])[-1], nonfinite_fires=True),),
         "always (a non-finite gradient fires it)",
         "Γ",
         "the reported Γ compares the credit with a gradient at the paper's floor, where float32 "
         "rounding can dominate it",
         ("paper",), monitored=True),
    Flag("b_prime", "(b′)", "ATTENUATED",
         (Statistic("readout gain ‖g_L‖/‖∂CE/∂logits‖", "readout_gain", "gain", "<",
                    lambda d: d.get("readout_gain"), lambda r, i: r.get("gain"),
                    nonfinite_fires=True),),
         "needs a finite stream with some non-zero logit error (a non-finite stream fires it)",
         "Γ and ρ at the blocks",
         "the blocks' credit, aligned or not, barely moves the loss, so a reported Γ or ρ at the "
         "blocks does not show that the blocks learn from it",
         ("project",), monitored=True, stops=True),
    Flag("c", "(c)", "DRIFT",
         (Statistic("cross-batch stability s_{L/2}", "stability_mid", "drift", ">",
                    lambda d: d.get("stability_mid"), log_scale=False),),
         "needs K ≥ 2 eval batches with non-zero gradients",
         "nothing (descriptive)",
         "one sample-invariant direction dominates the true gradient, so a high Γ there can come "
         "from matching that drift rather than per-sample credit",
         ()),
    Flag("d", "(d)", "UNDERCUT",
         (Statistic("accuracy − frozen-blocks control accuracy", "gap", "depth_margin", "<",
                    lambda d: (d.get("depth") or {}).get("gap"), tolerance=ACC_TOLERANCE,
                    log_scale=False),),
         "needs the accuracy of a finished, matching frozen-blocks control; across seeds a one-sided "
         "5 % decision that may be undetermined (the paper's rule: the mean gap)",
         "the headline accuracy",
         "the headline accuracy does not show that the trained blocks add anything",
         ("paper", "project")),
)}
PROJECT_FLAGS = tuple(k for k, f in FLAGS.items() if "project" in f.verdicts)
PAPER_FLAGS = tuple(k for k, f in FLAGS.items() if "paper" in f.verdicts)
VERDICT_FLAGS = {"project": PROJECT_FLAGS, "paper": PAPER_FLAGS}
FLAG_NAMES = {k: f.name for k, f in FLAGS.items()}


def flag_table() -> list[dict]:
    """The flag table as JSON (an audit stores it, so its report is a view of audit.json alone)."""
    return [f.to_dict() for f in FLAGS.values()]


# The fires_* functions accept floats or their JSON-safe forms (None = NaN, "inf"); each is the
# flag table's rule for one statistic.

def fires_a(max_growth: float | str | None, t: Thresholds) -> bool:
    """(a) fires above the threshold, and for a non-finite statistic (non-finite stream)."""
    return bool(FLAGS["a"].fires({"max_growth": max_growth}, t))


def fires_b(g_last: float | str | None, t: Thresholds) -> bool:
    """(b) fires below the floor, and for a NaN/inf reference gradient."""
    return bool(FLAGS["b"].fires({"g_L": g_last}, t))


def fires_b_prime(gain: float | str | None, t: Thresholds) -> bool:
    """(b′) fires below the gain threshold, and for a NaN/inf gain."""
    return bool(FLAGS["b_prime"].fires({"readout_gain": gain}, t))


def fires_c(stability_mid: float | str | None, t: Thresholds) -> bool | None:
    """(c) fires above the drift threshold; None when s could not be measured."""
    return FLAGS["c"].fires({"stability_mid": stability_mid}, t)


def fires_a_prime(init_growth: float | str | None, stack_growth: float | str | None,
                  t: Thresholds) -> bool | None:
    """(a′) fires when any ‖h_l‖ grew past `init_growth` × its value at initialisation, or when the
    stack amplifies ‖h_0‖ past `stack_growth`. None (not evaluated) when a statistic could not be
    measured (no recorded initialisation) and the other does not fire."""
    return FLAGS["a_prime"].fires({"init_growth": init_growth, "stack_growth": stack_growth}, t)


def fires_d(gap: float | str | None, t: Thresholds) -> bool | None:
    """(d) for one run: fires when accuracy − frozen-control accuracy falls short of the margin
    (a gap within ACC_TOLERANCE of the margin clears it: float32 accuracies); None when the gap could
    not be measured."""
    return FLAGS["d"].fires({"gap": gap}, t)


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


# ---------------------------------------------------------------------------------------------
# The training-time monitor: first fire and the early-stop rule
# ---------------------------------------------------------------------------------------------

def _init_row(history: Sequence[dict]) -> dict | None:
    return history[0] if history and int(history[0]["epoch"]) == 0 else None


def first_fire_epochs(history: Sequence[dict], thresholds: Thresholds = Thresholds()
                      ) -> dict[str, int | None]:
    """The first epoch at which each monitored flag ((a), (a′), (b), (b′)) fired in a monitor history.

    history: one dict per epoch with keys epoch, h_norms, g_norms, max_growth, gain (test_acc is
    ignored here). Values may be JSON-safe (None / "inf"). max_growth is recomputed from h_norms
    when absent. Returns {"a": epoch | None, …}; None = never fired.
    """
    monitored = [f for f in FLAGS.values() if f.monitored]
    first: dict[str, int | None] = {f.key: None for f in monitored}
    init = _init_row(history)
    for row in history:
        for f in monitored:
            if first[f.key] is None and f.fires_on_monitor(row, init, thresholds):
                first[f.key] = int(row["epoch"])
    return first


def flag_streak(history: Sequence[dict], thresholds: Thresholds) -> int:
    """How many consecutive epochs, ending now, a flag that may stop a run ((a), (a′), (b′)) has held.

    (b) alone does not count: it also fires on a healthy model that fits its eval batch (the
    confound (b′) removes), and stopping such a run early would only truncate a good result.
    """
    stoppers = [f for f in FLAGS.values() if f.stops]
    init, streak = _init_row(history), 0
    for row in reversed(history):
        if not any(f.fires_on_monitor(row, init, thresholds) for f in stoppers):
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


# ---------------------------------------------------------------------------------------------
# The verdict object
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    """One verdict. rule: "project" or "paper"; outcome: "trustworthy", "walk back" or "incomplete";
    fired: the flag keys that fired (a walk back); missing: what kept it from "trustworthy"
    (an incomplete one, or the caveats of a walk back); `text` is the line people read."""

    rule: str
    outcome: str
    fired: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    nonfinite: bool = False

    @property
    def trustworthy(self) -> bool:
        return self.outcome == TRUSTWORTHY

    @property
    def walks_back(self) -> bool:
        return self.outcome == WALK_BACK

    @property
    def text(self) -> str:
        if self.outcome == WALK_BACK:
            return "walk back: " + ", ".join(
                f"{FLAG_NAMES[k]} (non-finite residual stream)" if self.nonfinite and k == "a"
                else FLAG_NAMES[k] for k in self.fired)
        if self.outcome == INCOMPLETE:
            return "incomplete: " + "; ".join(self.missing)
        return TRUSTWORTHY

    def __str__(self) -> str:
        return self.text

    def to_dict(self) -> dict:
        return {"rule": self.rule, "outcome": self.outcome, "fired": list(self.fired),
                "missing": list(self.missing), "nonfinite": self.nonfinite, "text": self.text}

    @classmethod
    def from_dict(cls, d: dict) -> "Verdict":
        return cls(str(d["rule"]), str(d["outcome"]), tuple(d.get("fired") or ()),
                   tuple(d.get("missing") or ()), bool(d.get("nonfinite")))


def decide(flags: dict[str, bool | None], rule: str, nonfinite: bool = False,
           missing: Sequence[str] = (), explained: Iterable[str] = ()) -> Verdict:
    """The verdict of `rule` from its flags: walk back when one of them fired; else incomplete when
    one was not evaluated (None) or other evidence is `missing`; else trustworthy. `explained`:
    flags whose None a `missing` entry already explains (e.g. "(d) undetermined: …")."""
    keys = VERDICT_FLAGS[rule]
    fired = tuple(k for k in keys if flags.get(k))
    explained = set(explained)
    gaps = [f"{FLAGS[k].label} not evaluated" for k in keys
            if flags.get(k) is None and k not in explained] + list(missing)
    if fired:
        return Verdict(rule, WALK_BACK, fired, tuple(gaps), nonfinite)
    return Verdict(rule, INCOMPLETE if gaps else TRUSTWORTHY, (), tuple(gaps), nonfinite)


def verdict_of(d: dict, rule: str = "project") -> Verdict:
    """The structured verdict stored in a diagnosis or audit-row dict (`d["verdicts"][rule]`)."""
    stored = (d.get("verdicts") or {}).get(rule)
    if not isinstance(stored, dict):
        raise ValueError(f"no structured {rule} verdict in this result (written by an older creditaudit?)")
    return Verdict.from_dict(stored)


def training_gaps(training: dict | None) -> list[str]:
    """What a run's training status leaves missing. A run that did not finish — killed, or stopped
    early by --stop-when-flagged — is no final result; a diverged run is evidence of (a), not a gap."""
    if training is None:
        return []
    if not isinstance(training, dict):
        raise CreditAuditError(f"training must be a dict with status, epochs_completed and "
                               f"epochs_planned, got {training!r}")
    status = training.get("status")
    done, planned = training.get("epochs_completed"), training.get("epochs_planned")
    if status == "diverged" or (status == "finished" and done == planned):
        return []
    if status == "stopped":
        return [f"the run was stopped early by --stop-when-flagged at epoch {done} of {planned}, so "
                "it is no final result (only a flag firing on its last checkpoint can decide it)"]
    return [f"the run is unfinished ({done}/{planned} epochs, status {status or 'unknown'})"]


# ---------------------------------------------------------------------------------------------
# Sentences: one per fired flag, with the numbers it rests on
# ---------------------------------------------------------------------------------------------

def reasons_by_flag(r) -> dict[str, str]:
    """{flag key: its sentence} for every fired flag of a diagnosis `r` (a protocol.Report)."""
    t, f, out = r.thresholds, r.flags, {}
    if f["a"]:
        if r.diverged:
            out["a"] = (f"(a) EXPLODED: training diverged ({r.diverged}); the figures here come "
                        "from its last finite checkpoint, and no number of this run can be "
                        "reported as the method's result.")
        elif r.nonfinite:
            out["a"] = ("(a) EXPLODED: the residual stream (or its readout) is non-finite (inf/NaN) "
                        "on the eval batches, so every number measured on it — accuracy, Γ, ρ — "
                        "is invalid.")
        else:
            out["a"] = (f"(a) EXPLODED: one block multiplies ‖h‖ by {r.max_growth:.3g} "
                        f"(> {t.growth:g}; ‖h_L‖ = {r.residual_norms[-1]:.3g}), so "
                        f"{FLAGS['a'].sentence}.")
    if f.get("a_prime") and not r.nonfinite and not r.diverged:
        since = ("" if math.isnan(_num(r.init_growth)) else
                 f"‖h_l‖ grew up to {_num(r.init_growth):.3g}× its value at initialisation "
                 f"(threshold {t.init_growth:g}) and ")
        out["a_prime"] = (f"(a′) GROWN: {since}the stack amplifies ‖h_0‖ = {r.residual_norms[0]:.3g} "
                          f"{_num(r.stack_growth):.3g}× to ‖h_L‖ = {r.residual_norms[-1]:.3g} (threshold "
                          f"{t.stack_growth:g}), so {FLAGS['a_prime'].sentence}.")
    rho_fp32 = getattr(r, "rho_bp_model_precision", None)
    if r.nonfinite:
        for k in ("b", "b_prime"):
            if f[k]:
                out[k] = (f"{FLAG_NAMES[k]}: the BP reference gradient is non-finite, so Γ has no "
                          "reference to be compared with.")
    elif f["b"]:
        check = ("" if rho_fp32 is None else
                 f" In the model's own precision the reference still predicts the loss change with "
                 f"ρ_BP = {rho_fp32:.3f}" + (" (so it is numerically intact; see (b′) for what that "
                 "means)." if rho_fp32 > 0.9 else ", so it is numerically unreliable."))
        out["b"] = (f"(b) AT FLOOR: ‖g_L‖ = {r.bp_grad_norms[-1]:.3g} < {t.floor:g}: "
                    f"{FLAGS['b'].sentence}.{check}")
    if f["b_prime"] and not r.nonfinite:
        out["b_prime"] = (f"(b′) ATTENUATED: the readout passes only {r.readout_gain:.3g} of the output "
                          f"error back into the residual stream (< {t.gain:g}): moving h_L changes the "
                          f"loss about {1 / max(r.readout_gain, 1e-300):.3g}× less than through a "
                          f"healthy readout; {FLAGS['b_prime'].sentence}.")
    if f["c"]:
        out["c"] = (f"(c) DRIFT: s at layer {r.mid_layer} is {r.stability_mid:.3f} (> {t.drift:g}): "
                    f"{FLAGS['c'].sentence} (descriptive; it does not change the verdict).")
    if f["d"] and r.depth is not None:
        out["d"] = (f"(d) UNDERCUT: accuracy {r.depth.acc:.4f} does not clear the frozen-blocks "
                    f"control {r.depth.frozen_acc:.4f} by {100 * t.depth_margin:g} points, so "
                    f"{FLAGS['d'].sentence}.")
    return out


def reasons(r) -> list[str]:
    return list(reasons_by_flag(r).values())


def disagreement(r) -> list[str]:
    """The sentence docs/PROTOCOL.md asks for when (b) and (b′) disagree."""
    if r.nonfinite or r.flags["b"] is None or r.flags["b_prime"] is None or r.flags["b"] == r.flags["b_prime"]:
        return []
    t = r.thresholds
    if r.flags["b"]:
        # the median sample's error is tiny, so at least half the eval samples are fitted; the mean
        # loss may still be large, carried by the rest (a confidently wrong few): say which
        rest = ", carried by the other samples" if r.eval_loss >= 0.1 else ""
        return [f"(b) fired but the readout gain is healthy ({r.readout_gain:.3g} ≥ {t.gain:g}): "
                f"‖g_L‖ = {r.bp_grad_norms[-1]:.3g} is small because the error at the logits is "
                f"small (median ‖∂CE/∂logits‖ = {r.logit_grad_norm:.3g}: at least half the eval "
                f"samples are fitted; eval loss {r.eval_loss:.3g}{rest}), not because the readout "
                "attenuates it. The project verdict follows (b′)."]
    return [f"(b′) fired but (b) did not: ‖g_L‖ = {r.bp_grad_norms[-1]:.3g} stays above "
            f"{t.floor:g} only because the error at the logits is large (eval loss "
            f"{r.eval_loss:.3g}), while the readout attenuates it to {r.readout_gain:.3g} of its "
            "size — the absolute floor confounds the two. The project verdict follows (b′)."]


# ---------------------------------------------------------------------------------------------
# One method over its seeds
# ---------------------------------------------------------------------------------------------

@dataclass
class SeedEvidence:
    """What one seed of a method contributes to the method's verdict.

    status: how the main run's training ended ("finished", "stopped", "diverged", "failed", …);
    report: its diagnosis dict (None if none); acc / frozen_acc: its headline accuracy and that of
    the frozen-blocks control of the same seed (None when missing or unfinished); n_test: the
    number of test samples both accuracies were measured on (None: unknown); yardstick_acc: the
    same seed's yardstick (its frozen blocks, embedding and readout trained by exact gradients;
    None: none trained or given).
    """

    label: str
    status: str
    report: dict | None
    acc: float | None
    frozen_acc: float | None
    n_test: int | None = None
    yardstick_acc: float | None = None
    # each arm's per-example correctness on the test set (`depth.pack_correct` records; None: none)
    correct: dict | None = None
    frozen_correct: dict | None = None
    yardstick_correct: dict | None = None
    yardstick_expected: bool = False          # one was trained or given for this seed's recipe

    @property
    def paired(self) -> PairedGap | None:
        """The seed's (d) evidence; a per-example record is checked against the accuracy it sits
        beside (`depth.unpack_correct`: an edited or foreign record is refused)."""
        if self.acc is None or self.frozen_acc is None \
                or not math.isfinite(float(self.acc)) or not math.isfinite(float(self.frozen_acc)):
            return None       # a non-finite accuracy is no evidence: the seed counts as unpaired
        y = None if self.yardstick_acc is None or not math.isfinite(float(self.yardstick_acc)) \
            else float(self.yardstick_acc)
        return PairedGap(self.label, float(self.acc), float(self.frozen_acc), self.n_test, y,
                         unpack_correct(self.correct, self.acc, self.label),
                         unpack_correct(self.frozen_correct, self.frozen_acc, f"{self.label}'s control"),
                         None if y is None else unpack_correct(self.yardstick_correct, y,
                                                               f"{self.label}'s yardstick"))


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


def _cite(diagnosed: Sequence[SeedEvidence], k: str) -> tuple[SeedEvidence, str]:
    first = next(s for s in diagnosed if s.report["flags"].get(k))
    sentence = (first.report.get("reasons_by_flag") or {}).get(k) or FLAG_NAMES[k]
    return first, sentence


def method_verdict(seeds: Sequence[SeedEvidence], t: Thresholds,
                   depth: DepthDecision | None = None) -> dict:
    """Flags, both verdicts and reasons of one method across its seeds (the audit table's last columns).

    (a), (a′), (b), (b′), (c) fire for the method when they fire on any diagnosed seed; a flag is
    evaluated (False) only when every seed was diagnosed and none left it unevaluated. (d): the
    project verdict uses `depth` (the audit's decision: pooled over the methods sharing a recipe,
    Holm over the audit, `depth.decide_audit`; None = these seeds alone, `depth.depth_decision`);
    the paper verdict the paper's rule, mean paired gap < margin. Anything missing — a run that
    failed, did not finish or was not diagnosed, a seed without a finished frozen control, a seed's
    `missing_evidence` (e.g. Γ not evaluated: a non-finite credit) — keeps both verdicts from
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
    pairs = [s.paired for s in seeds if s.paired is not None]
    if depth is None:
        depth = depth_decision(pairs, t.depth_margin)
    flags["d"] = depth.fires
    paper_flags = {**flags, "d": depth.paper_undercut}
    missing = []
    lost = [s for s in seeds if not s.report]
    if lost:
        missing.append(f"{len(lost)}/{len(seeds)} runs failed or were not diagnosed "
                       f"({', '.join(f'{s.label}: {s.status}' for s in lost)})")
    for s in diagnosed:
        # a seed's training gap, or what its evidence lacked (its control refused or unverified, a
        # non-finite credit: Γ not evaluated), holds the method back as it held the seed back
        missing += [f"{s.label}: {gap}" for gap in training_gaps(s.report.get("training"))
                    + list(s.report.get("missing_evidence") or ())]
    if len(pairs) < len(seeds) and pairs:
        missing.append(f"(d) paired with a finished frozen control for only {len(pairs)}/{len(seeds)} seeds")
    expected = [s for s in seeds if s.paired is not None and s.yardstick_expected]
    with_yard = [s for s in expected if s.paired.yardstick_acc is not None]
    if len(with_yard) < len(expected):      # trained or given, but missing: failed, refused, diverged
        missing.append(f"(d) has a finished yardstick for only {len(with_yard)}/{len(expected)} seeds")
    undetermined = depth.outcome == "undetermined"
    explained = ("d",) if undetermined else ()
    out, notes = [], []
    for k in keys:
        if flags[k]:
            first, sentence = _cite(diagnosed, k)
            out.append(f"{sentence} [fired on {counts[k]}/{len(diagnosed)} seeds; the values quoted "
                       f"are {first.label}'s, the tables show the median over seeds]")
    if flags["d"]:
        out.append(f"(d) UNDERCUT: {depth.explain()}: the gap to the rule's own control lies below the "
                   f"+{100 * t.depth_margin:g}-point margin at 5 % error, so {FLAGS['d'].sentence}.")
    if depth.caveat():
        notes.append(depth.caveat())
    if depth.control_note():
        notes.append(f"(d) {depth.control_note()}.")
    project = decide(flags, "project", missing=missing + ([depth.short()] if undetermined else []),
                     explained=explained)
    # the paper's rule decides its (d) on the mean gap to the control; the same rule read against
    # the yardstick must hold too, or a weak control's clear is no evidence and the paper's column
    # is not "trustworthy" either
    short_of_yardstick = (depth.yardstick is not None and paper_flags["d"] is False
                          and depth.yardstick.mean < t.depth_margin - ACC_TOLERANCE)
    weak = ([f"(d) by the paper's rule the run clears its own control, but its mean gap to the "
             f"yardstick (bp's frozen control under the same recipe) is "
             f"{100 * depth.yardstick.mean:+.1f} points, below the margin"] if short_of_yardstick else [])
    paper = decide(paper_flags, "paper", missing=missing + weak)
    return {"flags": flags, "paper_flags": paper_flags, "flag_counts": counts,
            # the mean gap to the control (what the paper reads), its bounds, and the second
            # statistic (the gap to the yardstick) in depth["yardstick"]
            "depth": depth.to_dict(),
            "depth_gap": statistics.fmean(g.gap for g in depth.gaps) if depth.gaps else None,
            "depth_gap_interval": {"n": depth.n, "mean": depth.mean,
                                   "one_sided_bounds": None if depth.lower is None else [depth.lower, depth.upper]},
            "n_paired_with_frozen": len(pairs),
            "verdicts": {"project": project.to_dict(), "paper": paper.to_dict()},
            "verdict": project.text, "paper_verdict": paper.text,
            "missing": missing + ([depth.explain()] if undetermined else []), "reasons": out,
            "notes": notes}
