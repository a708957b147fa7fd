"""(d) across seeds: how depth utility is decided for a method, and for an audit of K methods.

Each seed s of a method contributes three accuracies, all scored on the same N test examples:
the run's (r), its own frozen control's (c) and — where one was trained or given — the yardstick's
(y: the same frozen blocks, embedding and readout trained by exact gradients under the same
recipe). Two questions, two paired contrasts, one rule to combine them:

    (d)        D_s = r_s − c_s      the paper's within-rule test: do the trained blocks beat the
                                    rule's own frozen-blocks control?
    yardstick  Y_s = r_s − y_s      do they beat the best the frozen blocks can do?
    shortfall  W_s = y_s − c_s      how weak the rule's control is (reported, never decides)

    clears     lower_D ≥ margin and lower_Y ≥ margin   (an intersection–union test: each at
               level α keeps the level α for the conjunction, with no correction)
    undercut   upper_D < margin                        (only the rule's own control walks it back)
    otherwise  undetermined

Every bound is one-sided at α = 5 %, mean ∓ t_{1−α, ν}·√V, with a variance that matches how the
accuracies were measured — seed-to-seed training noise and the one test set every arm shares:

    V = s²_seed / n  +  s²_ex / N

s²_seed: the contrast's seed variance (the larger of its own and the one pooled over the audit's
methods that share its recipe); s²_ex: the variance over the N test examples of the per-example
difference averaged over seeds, e_i = (1/n) Σ_s (a_si − b_si), from the per-example correctness
every run records (`store.pack_correct`). The sum counts the seed × example interaction twice
(once in each term), so it errs on the wide side (measured: benchmarks/decision_calibration.py).
ν: Welch–Satterthwaite over the two terms. A run with no per-example record is decided with the bound s²_ex ≤ (1/n) Σ_s
min(p_a + p_b, 2 − p_a − p_b) — the chance that two arms disagree on an example — and says so.

Across the K methods of an audit a false "clears" anywhere is held to 5 % by Holm's step-down over
the K methods tested (`decide_audit`): the clear of the method with the j-th smallest p-value
(p = max(p_D, p_Y), the IUT's) stands only when every smaller one stood and p ≤ α/(K − j + 1).
Undercuts stay one-sided 5 % claims each. benchmarks/decision_calibration.py measures both rates
by simulating whole audits through these functions (docs/PROTOCOL.md "Deciding (d)").
"""
from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

import numpy as np

from .errors import CreditAuditError
from .store import json_number as _num

ERROR_RATE = 0.05          # each one-sided claim; with Holm, a false clear anywhere in an audit
POWER = 0.80               # "seeds likely to decide it": the count that decides with this probability
MAX_SEEDS = 1000
# "seeds likely to decide it" is computed at a stated effect, not the observed one: a true gap
# this far (in accuracy) from the margin, on the side the mean lies
DECIDING_EFFECT = 0.01
# (d) compares accuracy gaps with the margin in the flag's favour of not firing by this much: an
# accuracy held in float32 is off by up to 2^-24 ≈ 6e-8 (a fraction ≤ 1), a gap of two by ≤ 1.2e-7,
# so a gap of exactly the margin computed in float32 clears; 1e-6 stays far below one test
# sample (1/n_test ≥ 1e-5 for test sets up to 100,000 samples)
ACC_TOLERANCE = 1e-6


# ---------------------------------------------------------------------------------------------
# One seed's evidence
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PairedGap:
    """One seed's (d) evidence: the run's test accuracy and its frozen control's, both measured on
    the same `n_test` test examples (None: unknown), the yardstick's (None: none trained or
    given) and, where recorded, each arm's per-example correctness on those examples."""

    label: str
    acc: float
    frozen_acc: float
    n_test: int | None = None
    yardstick_acc: float | None = None
    correct: np.ndarray | None = field(default=None, compare=False, repr=False)
    frozen_correct: np.ndarray | None = field(default=None, compare=False, repr=False)
    yardstick_correct: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def gap(self) -> float:
        """acc − the control's accuracy (the gap the paper reads)."""
        return self.acc - self.frozen_acc

    @property
    def yardstick_gap(self) -> float | None:
        """acc − the yardstick's accuracy (None: no yardstick)."""
        return None if self.yardstick_acc is None else self.acc - self.yardstick_acc

    @property
    def shortfall(self) -> float | None:
        """How far the control falls short of the yardstick (yardstick − control; None: none)."""
        return None if self.yardstick_acc is None else self.yardstick_acc - self.frozen_acc

    def arm(self, name: str) -> tuple[float | None, np.ndarray | None]:
        return {"run": (self.acc, self.correct), "control": (self.frozen_acc, self.frozen_correct),
                "yardstick": (self.yardstick_acc, self.yardstick_correct)}[name]

    def to_dict(self) -> dict:
        return {"label": self.label, "acc": self.acc, "frozen_acc": self.frozen_acc,
                "gap": self.gap, "n_test": self.n_test, "yardstick_acc": self.yardstick_acc,
                "yardstick_gap": self.yardstick_gap, "shortfall": self.shortfall,
                "per_example": all(b is not None for b in (self.correct, self.frozen_correct))}

    @classmethod
    def from_dict(cls, d: dict) -> "PairedGap":
        y = d.get("yardstick_acc")
        return cls(str(d["label"]), float(d["acc"]), float(d["frozen_acc"]), d.get("n_test"),
                   None if y is None else float(y))


@dataclass(frozen=True)
class SeedNoise:
    """The seed-to-seed variance of one contrast, pooled over groups (methods sharing a recipe):

        s_p² = Σ_m Σ_s (d_ms − d̄_m)² / Σ_m (n_m − 1),   df = Σ_m (n_m − 1)

    var None (df 0) when no group has two seeds."""

    var: float | None
    df: int
    groups: int

    @classmethod
    def pooled(cls, groups: Iterable[Sequence[float]]) -> "SeedNoise":
        ss, df, used = 0.0, 0, 0
        for values in groups:
            values = [v for v in values if v is not None and math.isfinite(v)]
            if len(values) >= 2:
                mean = statistics.fmean(values)
                ss += sum((v - mean) ** 2 for v in values)
                df += len(values) - 1
                used += 1
        return cls(ss / df if df else None, df, used)

    def to_dict(self) -> dict:
        return {"var": self.var, "df": self.df, "groups": self.groups}

    @classmethod
    def from_dict(cls, d: dict | None) -> "SeedNoise":
        d = d or {"var": None, "df": 0, "groups": 0}
        return cls(None if d.get("var") is None else float(d["var"]), int(d["df"]), int(d["groups"]))


NO_NOISE = SeedNoise(None, 0, 0)


# ---------------------------------------------------------------------------------------------
# One contrast over a method's seeds
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def _quantile(p: float, df: float) -> float:
    from scipy import stats
    return float(stats.norm.ppf(p) if math.isinf(df) else stats.t.ppf(p, df))


def _sf(x: float, df: float) -> float:
    """P(T > x) for Student's t with df degrees of freedom (normal at df = ∞)."""
    from scipy import stats
    return float(stats.norm.sf(x) if math.isinf(df) else stats.t.sf(x, df))


@dataclass(frozen=True)
class Contrast:
    """A paired contrast a − b over a method's seeds and the shared test set.

    values: the per-seed differences of accuracy; mean: their mean. seed_var / seed_df /
    seed_source: the seed-to-seed variance used (max of the pooled and this contrast's own, with
    that estimate's df); example_var: the variance over the N test examples of the seed-averaged
    per-example difference (or its bound), example_source says which. var: the variance of the
    mean, seed_var/n + example_var/N; df: Welch–Satterthwaite's ν. var None: nothing measures how
    another seed would land (one seed, no pooled spread)."""

    name: str
    values: tuple[float, ...]
    seed_var: float | None = None
    seed_df: float = 0
    seed_source: str = ""
    example_var: float = 0.0
    n_examples: int | None = None
    example_source: str = ""
    noise: SeedNoise = NO_NOISE
    example_set_var: float | None = None    # the part of example_var more seeds do not shrink

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def seed_term(self) -> float | None:
        return None if self.seed_var is None else self.seed_var / self.n

    @property
    def example_term(self) -> float:
        return self.example_var / self.n_examples if self.n_examples else 0.0

    @property
    def var(self) -> float | None:
        return None if self.seed_term is None else self.seed_term + self.example_term

    @property
    def df(self) -> float | None:
        """ν = (a + b)² / (a²/ν_a + b²/ν_b), a the seed term (ν_a its df), b the example term
        (ν_b = N − 1 from per-example records, ∞ for the bound, which has no sampling error)."""
        a, b = self.seed_term, self.example_term
        if a is None:
            return None
        df_b = (self.n_examples - 1 if self.example_source == RECORDED and self.n_examples
                and self.n_examples > 1 else math.inf)
        denom = (a * a / self.seed_df if self.seed_df else 0.0) + (b * b / df_b if b else 0.0)
        return math.inf if denom == 0 else (a + b) ** 2 / denom

    @property
    def se(self) -> float | None:
        return None if self.var is None else math.sqrt(self.var)

    def bounds(self, alpha: float = ERROR_RATE) -> tuple[float, float] | None:
        """The one-sided (1 − alpha) lower and upper bounds of the mean (None: undecidable)."""
        if self.se is None:
            return None
        half = _quantile(1 - alpha, self.df) * self.se if self.se > 0 else 0.0
        return self.mean - half, self.mean + half

    def p_above(self, margin: float) -> float:
        """The one-sided p-value of "the true mean ≤ margin" (small: it lies above the margin)."""
        if self.se is None:
            return 1.0
        x = self.mean - (margin - ACC_TOLERANCE)
        if self.se == 0:
            return 0.0 if x >= 0 else 1.0
        return _sf(x / self.se, self.df)

    def p_below(self, margin: float) -> float:
        """The one-sided p-value of "the true mean ≥ margin" (small: it lies below the margin)."""
        if self.se is None:
            return 1.0
        x = (margin - ACC_TOLERANCE) - self.mean
        if self.se == 0:
            return 0.0 if x > 0 else 1.0
        return _sf(x / self.se, self.df)

    def seeds_needed(self, margin: float, effect: float = DECIDING_EFFECT, alpha: float = ERROR_RATE) -> int | None:
        """The smallest seed count at which a true mean `effect` from the margin (on the side the
        mean lies) would be decided with probability POWER: effect ≥ (t_{1−α,ν} + t_{POWER,ν})·√V(n'),
        V(n') = s²_seed/n' + (σ²_set + σ²_int·n/n')/N — the test set's own variance σ²_set does
        not shrink with seeds, so when it alone is too wide no seed count decides (None). A
        bisection; None beyond MAX_SEEDS."""
        if self.seed_var is None:
            return None

        fixed = self.example_var if self.example_set_var is None else self.example_set_var

        def decides(n_new: int) -> bool:
            df = (self.seed_df + (n_new - self.n)) if self.noise.df else max(n_new - 1, 1)
            # the test-set term at n' seeds: σ²_set stays, the interaction part falls as n/n'
            ex = (fixed + (self.example_var - fixed) * self.n / n_new) / self.n_examples if self.n_examples else 0.0
            var = self.seed_var / n_new + ex
            return effect >= (_quantile(1 - alpha, df) + _quantile(POWER, df)) * math.sqrt(var)
        if not decides(MAX_SEEDS):
            return None
        lo, hi = max(self.n, 1), MAX_SEEDS
        if decides(lo):
            return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if decides(mid) else (mid, hi)
        return hi

    def describe(self) -> str:
        """Where the variance comes from, in one clause."""
        parts = [self.seed_source] if self.seed_source else []
        if self.example_source:
            parts.append(f"test set: {self.example_source}")
        return "; ".join(parts)

    def to_dict(self, margin: float | None = None, alpha: float = ERROR_RATE) -> dict:
        """JSON; "lower" is the one-sided bound at `alpha` (the level a clear is tested at: Holm's
        in an audit), "upper" the one at ERROR_RATE (an undercut's)."""
        lo, hi = self.bounds(alpha), self.bounds(ERROR_RATE)
        b = None if lo is None else (lo[0], hi[1])
        out = {"name": self.name, "values": list(self.values), "n": self.n, "mean": self.mean,
               "seed_var": self.seed_var, "seed_df": self.seed_df, "seed_source": self.seed_source,
               "example_var": self.example_var, "n_examples": self.n_examples,
               "example_source": self.example_source, "example_set_var": self.example_set_var,
               "noise": self.noise.to_dict(),
               "var": self.var, "se": self.se, "df": self.df,
               "lower": None if b is None else b[0], "upper": None if b is None else b[1]}
        if margin is not None:
            out.update(p_above=self.p_above(margin), p_below=self.p_below(margin))
        return out

    @classmethod
    def from_dict(cls, d: dict | None) -> "Contrast | None":
        if not d:
            return None
        num = lambda k: None if d.get(k) is None else _num(d[k])
        return cls(str(d["name"]), tuple(float(v) for v in d["values"]), num("seed_var"),
                   float(num("seed_df") or 0), str(d.get("seed_source") or ""),
                   float(num("example_var") or 0.0), d.get("n_examples"),
                   str(d.get("example_source") or ""), SeedNoise.from_dict(d.get("noise")),
                   num("example_set_var"))


RECORDED = "per-example records"
BOUNDED = "bound: no per-example record (the chance two arms disagree on an example)"


def contrast(name: str, pairs: Sequence[PairedGap], a: str, b: str,
             noise: SeedNoise = NO_NOISE) -> Contrast:
    """The contrast arm `a` − arm `b` ("run", "control", "yardstick") over `pairs` (every pair has
    both arms), with `noise` the seed spread of this contrast pooled over the methods sharing the
    recipe (NO_NOISE: this method's own only)."""
    accs = [(p.arm(a)[0], p.arm(b)[0]) for p in pairs]
    values = tuple(x - y for x, y in accs)
    candidates = []               # the first of equals wins: this method's own spread
    if len(values) >= 2:
        candidates.append((statistics.variance(values), len(values) - 1, "this method's own seed spread"))
    if noise.var is not None:
        candidates.append((noise.var, noise.df, f"seed spread pooled over {noise.groups} method(s) "
                                                f"sharing the recipe, {noise.df} df"))
    seed_var, seed_df, seed_source = max(candidates, key=lambda c: c[0]) if candidates else (None, 0, "")
    bits = [(p.arm(a)[1], p.arm(b)[1]) for p in pairs]
    set_var = None
    sizes = {len(x) for pair in bits for x in pair if x is not None}
    n_test = next((p.n_test for p in pairs if p.n_test), None)
    if len(sizes) > 1 or (sizes and n_test and sizes != {n_test}):
        raise CreditAuditError(f"the per-example records of {', '.join(p.label for p in pairs)} are of "
                               f"different lengths ({', '.join(map(str, sorted(sizes)))} examples"
                               f"{f'; the test set has {n_test}' if n_test else ''}): they were not "
                               "measured on one test set; measure every arm on the same test batches")
    if all(x is not None and y is not None for x, y in bits) and len(sizes) == 1:
        diffs = np.stack([x.astype(np.int8) - y.astype(np.int8) for x, y in bits]).astype(float)
        n_ex, n = int(diffs.shape[1]), int(diffs.shape[0])
        ex_var = float(diffs.mean(axis=0).var(ddof=1)) if n_ex > 1 else 0.0
        if n >= 2 and n_ex > 1:
            # var_i of the seed mean = σ²_set + σ²_int/n, var_i within one seed = σ²_set + σ²_int:
            # σ²_set, the part more seeds do not shrink (`Contrast.seeds_needed` projects with it)
            within = float(diffs.var(axis=1, ddof=1).mean())
            set_var = min(ex_var, max(0.0, (n * ex_var - within) / (n - 1)))
        source = RECORDED
    elif n_test:
        n_ex = int(n_test)
        ex_var = statistics.fmean(min(x + y, 2.0 - x - y) for x, y in accs)
        source = BOUNDED
    else:
        n_ex, ex_var, source = None, 0.0, ""
    if not source and seed_var == 0:
        # identical bare gaps and no test-set size: nothing measures the noise, so nothing decides
        seed_var, seed_df, seed_source = None, 0, ""
    return Contrast(name, values, seed_var, seed_df, seed_source, ex_var, n_ex, source, noise,
                    ex_var if set_var is None else set_var)


# ---------------------------------------------------------------------------------------------
# One method's decision
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DepthDecision:
    """(d) for one method over its seeds (see the module docstring for the rule).

    outcome: "clears", "undercut", "undetermined" or "not evaluated" (no seed paired with a
    finished control). per_claim: the outcome at 5 % per claim, before the audit's Holm step;
    alpha: the level the clear was tested at (Holm's α/(K − j + 1); ERROR_RATE alone);
    family: the number K of methods the audit tested. control / yardstick / shortfall: the
    contrasts (yardstick and shortfall None without a yardstick). paper_undercut: the paper's
    rule, mean gap to the control < margin."""

    outcome: str
    margin: float
    gaps: tuple[PairedGap, ...] = ()
    control: Contrast | None = None
    yardstick: Contrast | None = None
    shortfall: Contrast | None = None
    per_claim: str | None = None
    alpha: float = ERROR_RATE
    family: int = 1
    paper_undercut: bool | None = None

    @property
    def fires(self) -> bool | None:
        return {"clears": False, "undercut": True}.get(self.outcome)

    @property
    def n(self) -> int:
        return len(self.gaps)

    @property
    def mean(self) -> float | None:
        return None if self.control is None else self.control.mean

    def _bounds(self, c: Contrast | None, alpha: float | None = None) -> tuple[float, float] | None:
        return None if c is None else c.bounds(self.alpha if alpha is None else alpha)

    @property
    def lower(self) -> float | None:
        b = self._bounds(self.control)
        return None if b is None else b[0]

    @property
    def upper(self) -> float | None:
        b = self._bounds(self.control, ERROR_RATE)
        return None if b is None else b[1]

    @property
    def unpooled(self) -> bool:
        """One seed, and no method sharing its recipe has two: the seed spread is unmeasured."""
        return self.control is not None and self.control.seed_var is None

    @property
    def p_clear(self) -> float:
        """The IUT p-value of "clears": the larger of the two contrasts' (the control's alone
        without a yardstick)."""
        if self.control is None:
            return 1.0
        ps = [self.control.p_above(self.margin)]
        if self.yardstick is not None:
            ps.append(self.yardstick.p_above(self.margin))
        return 1.0 if any(math.isnan(p) for p in ps) else max(ps)

    @property
    def binding(self) -> Contrast | None:
        """The contrast that keeps an undetermined (d) from clearing."""
        if self.control is None:
            return None
        b = self._bounds(self.control)
        if self.yardstick is not None and b is not None and b[0] >= self.margin - ACC_TOLERANCE:
            return self.yardstick
        return self.control

    @property
    def seeds_needed(self) -> int | None:
        c = self.binding
        return None if c is None or self.outcome != "undetermined" else c.seeds_needed(self.margin, alpha=self.alpha)

    @property
    def weak_control(self) -> bool:
        """The control falls short of the yardstick (one-sided 5 %: shortfall's lower bound > 0)."""
        b = self._bounds(self.shortfall, ERROR_RATE)
        return b is not None and b[0] > 0

    def control_note(self) -> str | None:
        """The control's weakness as its own statistic, in one sentence (None: no yardstick, or a
        control not measurably short of it)."""
        s = self.shortfall
        if s is None or (s.mean == 0 and not any(s.values) and s.example_var == 0):
            return None           # the yardstick is the rule's own control (bp's): nothing to say
        b = s.bounds()
        bounds = "" if b is None else f", one-sided 95 % bounds [{_pts(b[0])}, {_pts(b[1])}]"
        head = (f"the frozen control falls short of the yardstick (bp's frozen control under the same "
                f"recipe) by {_pts(s.mean)} points over {s.n} seed{'s' if s.n != 1 else ''}{bounds}")
        if self.weak_control:
            return (f"{head}: the control is weak, so a gap to it overstates what the blocks add; "
                    "(d) clears only if the run also beats the yardstick by the margin")
        return None         # not measurably short: the shortfall stays in audit.json, unsaid

    def _clause(self, c: Contrast, alpha: float) -> str:
        lo, hi = c.bounds(alpha), c.bounds(ERROR_RATE)
        per = ", ".join(f"{100 * v:+.1f}" for v in c.values)
        if lo is None:
            bounds = ""
        elif alpha == ERROR_RATE:
            bounds = f"; one-sided 95 % bounds [{100 * lo[0]:+.1f}, {100 * hi[1]:+.1f}]"
        else:       # a Holm-adjusted clear: the lower bound at its level, the upper at 95 %
            bounds = (f"; one-sided bounds [{100 * lo[0]:+.1f} at {100 * (1 - alpha):.3g} %, "
                      f"{100 * hi[1]:+.1f} at 95 %]")
        return f"{100 * c.mean:+.1f} points over {c.n} seed{'s' if c.n != 1 else ''} ({per}){bounds}"

    def explain(self) -> str:
        """The sentence: both gaps, their bounds, where the noise comes from, and the call."""
        if self.outcome == "not evaluated" or self.control is None:
            return "(d) not evaluated: no seed has a finished frozen-blocks control"
        head = f"the paired gap to the frozen control is {self._clause(self.control, self.alpha)}"
        if self.control.describe():
            head += f" (noise: {self.control.describe()})"
        if self.yardstick is not None:
            head += f"; the gap to the yardstick is {self._clause(self.yardstick, self.alpha)}"
        else:
            head += "; no yardstick was trained or given, so the control was checked only against the untrained model"
        if self.outcome == "undetermined":
            if self.unpooled:
                return (f"(d) undetermined: {head}; no seed spread to judge it by: with one seed and "
                        "no other method sharing its recipe that has two, nothing measures how far "
                        "another seed would land — add a seed")
            if self.per_claim == "clears":
                return (f"(d) undetermined: {head}; it clears at 5 % as one claim, but not at the "
                        f"audit-wide level (Holm over the {self.family} methods tested: this one "
                        f"needed p ≤ {self.alpha:.3g}, it has p = {self.p_clear:.3g})")
            if self.binding is self.yardstick:
                call = (f"the gap to the frozen control clears the +{100 * self.margin:g}-point margin, "
                        "the gap to the yardstick does not (at 5 % error), and a clear needs both")
            else:
                call = (f"the gap to the frozen control neither clears nor falls below the "
                        f"+{100 * self.margin:g}-point margin at 5 % error")
            return f"(d) undetermined: {head}; {call}; {self.more()}"
        return head

    def more(self) -> str:
        """How many seeds would likely decide it, at a stated effect (not the observed one)."""
        n = self.seeds_needed
        at = f"if the true gap lay {100 * DECIDING_EFFECT:g} point from the margin"
        if n is None:
            return (f"{at}, no seed count up to {MAX_SEEDS} would likely decide it"
                    + (" (the shared test set's own noise is wider than that)" if self.binding is not None
                       and self.binding.example_term > 0 else ""))
        return f"{at}, about {n} seeds would decide it with {POWER:.0%} chance"

    def short(self) -> str:
        """One clause for the verdict line."""
        if self.outcome != "undetermined" or self.control is None:
            return f"(d) {self.outcome}"
        if self.unpooled:
            return (f"(d) undetermined: paired gap {100 * self.mean:+.1f} points on one seed, and no "
                    "seed spread to judge it by; add a seed")
        if self.per_claim == "clears":
            return (f"(d) undetermined: clears as one claim (p = {self.p_clear:.2g}) but not at the "
                    f"audit-wide 5 % (Holm over {self.family} methods)")
        c = self.binding
        lo, hi = c.bounds(self.alpha)[0], c.bounds(ERROR_RATE)[1]
        to = "to the yardstick" if c is self.yardstick else "to the control"
        return (f"(d) undetermined: gap {to} {100 * c.mean:+.1f} points over {c.n} seed"
                f"{'s' if c.n != 1 else ''}, one-sided bounds [{100 * lo:+.1f}, {100 * hi:+.1f}] "
                f"around the +{100 * self.margin:g}-point margin")

    def caveat(self) -> str | None:
        """What one seed can and cannot say (None with two seeds or more, and with one seed whose
        spread is unmeasured: that (d) is then undetermined, and `explain`/`short` already say why
        and to add a seed, so the reason is printed once)."""
        if self.n != 1 or self.control is None or self.unpooled:
            return None
        g = self.gaps[0]
        return (f"(d) rests on one seed ({g.label}); its seed-to-seed spread is borrowed from the "
                f"audit's other methods under the same recipe ({self.control.noise.df} df), which "
                "assumes this method varies across seeds as much as they do")

    def to_dict(self) -> dict:
        ctl = self.control
        return {"outcome": self.outcome, "fires": self.fires, "margin": self.margin,
                "per_claim": self.per_claim, "alpha": self.alpha, "family": self.family,
                "p_clear": self.p_clear if ctl is not None else None,
                "gaps": [g.to_dict() for g in self.gaps], "n": self.n,
                "mean": self.mean, "lower": self.lower, "upper": self.upper,
                "var_source": ctl.describe() if ctl is not None else "",
                "seeds_needed": self.seeds_needed, "deciding_effect": DECIDING_EFFECT,
                "paper_undercut": self.paper_undercut,
                "control": None if ctl is None else ctl.to_dict(self.margin, self.alpha),
                "yardstick": None if self.yardstick is None else self.yardstick.to_dict(self.margin, self.alpha),
                "shortfall": None if self.shortfall is None else self.shortfall.to_dict(0.0),
                "yardstick_gap": None if self.yardstick is None else self.yardstick.mean,
                "weak_control": self.weak_control, "control_note": self.control_note(),
                "error_rate": ERROR_RATE}

    @classmethod
    def from_dict(cls, d: dict) -> "DepthDecision":
        return cls(str(d["outcome"]), float(d["margin"]),
                   tuple(PairedGap.from_dict(g) for g in d.get("gaps") or ()),
                   Contrast.from_dict(d.get("control")), Contrast.from_dict(d.get("yardstick")),
                   Contrast.from_dict(d.get("shortfall")), d.get("per_claim"),
                   float(d.get("alpha", ERROR_RATE)), int(d.get("family", 1)), d.get("paper_undercut"))


def _pts(v: float) -> str:
    """An accuracy difference in points, signed; a nonzero one under 0.05 points keeps two decimals
    (so that a bound above 0 never reads "+0.0")."""
    p = 100 * v
    return f"{p:+.2f}" if 0 < abs(p) < 0.05 else f"{p:+.1f}"


def _pairs(gaps: Sequence[PairedGap | float]) -> tuple[PairedGap, ...]:
    pairs = tuple(g if isinstance(g, PairedGap) else PairedGap(f"seed {i}", float(g), 0.0)
                  for i, g in enumerate(gaps))
    return tuple(p for p in pairs if math.isfinite(p.gap))


def _outcome(control: Contrast, yardstick: Contrast | None, margin: float, alpha: float) -> str:
    b = control.bounds(alpha)
    if b is None:
        return "undetermined"
    below = control.bounds(ERROR_RATE)
    if below[1] < margin - ACC_TOLERANCE:
        return "undercut"
    clears = b[0] >= margin - ACC_TOLERANCE
    if clears and yardstick is not None:
        y = yardstick.bounds(alpha)
        clears = y is not None and y[0] >= margin - ACC_TOLERANCE
    return "clears" if clears else "undetermined"


def depth_decision(gaps: Sequence[PairedGap | float], margin: float,
                   noise: SeedNoise | None = None, yardstick_noise: SeedNoise | None = None,
                   alpha: float = ERROR_RATE) -> DepthDecision:
    """(d) across one method's seeds, as one claim at level `alpha` (see the module docstring).

    gaps: the method's seeds (PairedGap, or a bare gap acc − frozen with no test-set size).
    noise / yardstick_noise: each contrast's seed spread pooled over the methods sharing the
    recipe (None: these seeds' own only). The yardstick contrast uses the seeds that have one; with
    none, (d) is decided on the control alone (the control was then checked against the untrained
    model by the evidence gate). One seed with no pooled spread is never decided."""
    pairs = _pairs(gaps)
    if not pairs:
        return DepthDecision("not evaluated", margin)
    ctl = contrast("control", pairs, "run", "control", noise or NO_NOISE)
    with_yard = [p for p in pairs if p.yardstick_acc is not None]
    yard = contrast("yardstick", with_yard, "run", "yardstick", yardstick_noise or NO_NOISE) if with_yard else None
    short = contrast("shortfall", with_yard, "yardstick", "control") if with_yard else None
    paper = statistics.fmean(p.gap for p in pairs) < margin - ACC_TOLERANCE
    outcome = _outcome(ctl, yard, margin, alpha)
    return DepthDecision(outcome, margin, pairs, ctl, yard, short, outcome, alpha, 1, paper)


def redecide(decision: DepthDecision, margin: float, alpha: float = ERROR_RATE) -> DepthDecision:
    """The same contrasts (same seeds, same variances) decided at another margin and level."""
    if decision.control is None:
        return replace(decision, margin=margin)
    outcome = _outcome(decision.control, decision.yardstick, margin, alpha)
    paper = statistics.fmean(decision.control.values) < margin - ACC_TOLERANCE
    return replace(decision, outcome=outcome, margin=margin, per_claim=outcome, alpha=alpha,
                   family=1, paper_undercut=paper)


def holm(decisions: Mapping[str, DepthDecision], alpha: float = ERROR_RATE) -> dict[str, DepthDecision]:
    """Holm's step-down over the K methods tested (those with a decidable control contrast): sort
    by the clear's p-value; the j-th (1-based) clear stands only if p ≤ alpha/(K − j + 1) and every
    earlier one stood. A clear that does not survive becomes undetermined (`per_claim` keeps
    "clears"); undercuts are untouched. The family-wise chance of a false clear is ≤ alpha."""
    tested = {k: d for k, d in decisions.items() if d.control is not None and d.control.se is not None}
    K = len(tested)
    order = sorted(tested, key=lambda k: tested[k].p_clear)
    out = dict(decisions)
    standing = True
    for j, name in enumerate(order):
        d = tested[name]
        level = alpha / (K - j)
        standing = standing and d.p_clear <= level
        outcome = _outcome(d.control, d.yardstick, d.margin, level)
        if outcome == "clears" and not standing:
            outcome = "undetermined"
        out[name] = replace(d, outcome=outcome, per_claim=d.per_claim or d.outcome, alpha=level, family=K)
    return out


def recipe_noise(pairs_by_method: Mapping[str, Sequence[PairedGap]],
                 recipe_of: Mapping[str, str | None]) -> dict[str, tuple[SeedNoise, SeedNoise]]:
    """Each method's (control, yardstick) seed spread, pooled over the methods that share its
    recipe (`recipe_of`: method → a key of its resolved recipe; None: unknown, pooled with no
    other method)."""
    out = {}
    for m, pairs in pairs_by_method.items():
        key = recipe_of.get(m)
        peers = [q for q in pairs_by_method if q == m or (key is not None and recipe_of.get(q) == key)]
        groups = [_pairs(pairs_by_method[q]) for q in peers]
        out[m] = (SeedNoise.pooled([[g.gap for g in ps] for ps in groups]),
                  SeedNoise.pooled([[g.yardstick_gap for g in ps if g.yardstick_acc is not None] for ps in groups]))
    return out


def decide_audit(pairs_by_method: Mapping[str, Sequence[PairedGap]], margin: float,
                 recipe_of: Mapping[str, str | None] | None = None,
                 alpha: float = ERROR_RATE) -> dict[str, DepthDecision]:
    """Every method's (d) in an audit: each contrast's seed spread pooled over the methods sharing
    a recipe, each method decided as one claim, then Holm over the K methods tested."""
    noise = recipe_noise(pairs_by_method, recipe_of or {})
    per = {m: depth_decision(p, margin, *noise[m], alpha=alpha) for m, p in pairs_by_method.items()}
    return holm(per, alpha)


def redecide_audit(decisions: Mapping[str, DepthDecision], margin: float,
                   alpha: float = ERROR_RATE) -> dict[str, DepthDecision]:
    """An audit's decisions re-made at another margin (same contrasts), Holm included."""
    return holm({m: redecide(d, margin, alpha) for m, d in decisions.items()}, alpha)
