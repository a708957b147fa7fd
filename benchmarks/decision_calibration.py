"""How often (d) decides wrongly: whole audits simulated and decided by the project's own code.

Every simulated audit has K methods sharing one recipe, S seeds and one test set of N examples.
Per seed each method has a run and its own frozen control; the K methods share the recipe's
yardstick (bp's frozen control under that recipe), as in a real audit. What is simulated:

  - the test set: each example i has a difficulty b_i ~ N(0, 1), shared by every arm of every
    seed, so errors correlate across runs as they do on one real test set;
  - each arm's accuracy at seed s: a_arm + sd·z, with z ~ N(0, 1) — the control's z correlated with
    the yardstick's at ρ across seeds, the run's independent (seed-to-seed training noise);
  - each arm's per-example correctness: example i is right with probability Φ(θ − b_i), θ chosen
    so that the arm's accuracy over the population of examples is its seed's accuracy;
  - true means: control A, yardstick A + D (D: the control's shortfall), run A + G (G: the gap to
    the own control; the gap to the yardstick is G − D).

Each audit is decided by `creditaudit.depth.decide_audit` — the function the audit calls — on
PairedGap records carrying the simulated per-example correctness. The last line is
`p_clears=X p_undercut=Y familywise_false_clear=Z`: the fraction of methods that clear, that are
undercut, and the fraction of audits in which any of the K methods clears.

    python benchmarks/decision_calibration.py --seeds 3 --gap 2 --shortfall 0
    python benchmarks/decision_calibration.py --table      # docs/PROTOCOL.md's table
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
from scipy import stats

from creditaudit.depth import PairedGap, decide_audit
from creditaudit.verdict import Thresholds

MARGIN_POINTS = 100 * Thresholds().depth_margin
BASE_ACC = 0.60          # the control's true accuracy (MNIST-1D's frozen controls sit near it)


def _correct(rng: np.random.Generator, acc: np.ndarray, difficulty: np.ndarray) -> np.ndarray:
    """Per-example correctness (S × N) of arms whose population accuracies are `acc` (S,)."""
    theta = stats.norm.ppf(np.clip(acc, 1e-4, 1 - 1e-4)) * math.sqrt(1 + 1.0)   # Var(b) = 1
    p = stats.norm.cdf(theta[:, None] - difficulty[None, :])
    return rng.random(p.shape) < p


def simulate_audit(rng: np.random.Generator, *, methods: int, seeds: int, n_test: int, gap: float,
                   shortfall: float, rho: float, seed_sd: float) -> dict[str, list[PairedGap]]:
    """One audit's evidence: method → its seeds' PairedGap records (accuracies and per-example
    correctness on the one shared test set). gap, shortfall, seed_sd in accuracy (fractions)."""
    difficulty = rng.normal(0.0, 1.0, n_test)
    z_yard = rng.normal(size=seeds)
    yard = _correct(rng, BASE_ACC + shortfall + seed_sd * z_yard, difficulty)
    out = {}
    for m in range(methods):
        z_ctl = rho * z_yard + math.sqrt(1 - rho * rho) * rng.normal(size=seeds)
        ctl = _correct(rng, BASE_ACC + seed_sd * z_ctl, difficulty)
        run = _correct(rng, BASE_ACC + gap + seed_sd * rng.normal(size=seeds), difficulty)
        out[f"m{m}"] = [PairedGap(f"m{m}/s{s}", float(run[s].mean()), float(ctl[s].mean()), n_test,
                                  float(yard[s].mean()), run[s], ctl[s], yard[s]) for s in range(seeds)]
    return out


def calibrate(*, seeds: int, methods: int, n_test: int, gap: float, shortfall: float, rho: float,
              seed_sd: float, reps: int, margin: float, rng_seed: int = 0,
              decide=None) -> dict[str, float]:
    """Fractions over `reps` simulated audits (all quantities in points, as the flags take them).
    `decide(evidence, margin) -> {method: outcome}` defaults to the project's `decide_audit`."""
    rng = np.random.default_rng(rng_seed)
    decide = decide or (lambda ev, mg: {m: d.outcome for m, d in
                                        decide_audit(ev, mg, {m: "one recipe" for m in ev}).items()})
    clears = undercut = any_clear = 0
    for _ in range(reps):
        evidence = simulate_audit(rng, methods=methods, seeds=seeds, n_test=n_test, gap=gap / 100,
                                  shortfall=shortfall / 100, rho=rho, seed_sd=seed_sd / 100)
        outcomes = list(decide(evidence, margin / 100).values())
        clears += outcomes.count("clears")
        undercut += outcomes.count("undercut")
        any_clear += "clears" in outcomes
    return {"p_clears": clears / (reps * methods), "p_undercut": undercut / (reps * methods),
            "familywise_false_clear": any_clear / reps}


def table(args) -> None:
    """docs/PROTOCOL.md's table: the false-clear rate at the boundary, the power, the family-wise rate."""
    common = dict(rho=args.rho, seed_sd=args.seed_sd, reps=args.reps, margin=args.margin)
    print(f"false clears at the boundary: the gap to the yardstick G − D = margin (G = margin + D), "
          f"rho {args.rho}, seed sd {args.seed_sd} points, {args.reps} audits of 1 method per cell")
    print("| shortfall D | " + " | ".join(f"{s} seeds, N {n}" for n in (200, 1000) for s in (3, 5, 10)) + " |")
    print("|---|" + "---|" * 6)
    for d in (0, 1, 2, 3, 4, 5):
        cells = [calibrate(seeds=s, methods=1, n_test=n, gap=args.margin + d, shortfall=d, **common)["p_clears"]
                 for n in (200, 1000) for s in (3, 5, 10)]
        print(f"| {d} | " + " | ".join(f"{100 * c:.1f} %" for c in cells) + " |", flush=True)
    print("\npower: G = margin + 3, D = 0 (P(clears)); and the undercut rate at G = margin − 3")
    print("| | " + " | ".join(f"{s} seeds, N {n}" for n in (200, 1000) for s in (3, 5, 10)) + " |")
    print("|---|" + "---|" * 6)
    for label, g, key in (("P(clears), G = margin + 3", args.margin + 3, "p_clears"),
                          ("P(undercut), G = margin − 3", args.margin - 3, "p_undercut")):
        cells = [calibrate(seeds=s, methods=1, n_test=n, gap=g, shortfall=0, **common)[key]
                 for n in (200, 1000) for s in (3, 5, 10)]
        print(f"| {label} | " + " | ".join(f"{100 * c:.1f} %" for c in cells) + " |", flush=True)
    print("\nfamily-wise: K = 14 methods at the boundary (G = margin, D = 0), N 1000")
    for s in (3, 5, 10):
        r = calibrate(seeds=s, methods=14, n_test=1000, gap=args.margin, shortfall=0, **common)
        print(f"{s} seeds: familywise_false_clear {100 * r['familywise_false_clear']:.1f} %, "
              f"per method p_clears {100 * r['p_clears']:.2f} %", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds per method (default 3)")
    p.add_argument("--methods", type=int, default=1, help="methods K per audit, sharing one recipe (default 1)")
    p.add_argument("--n-test", type=int, default=1000, help="test examples N (default 1000)")
    p.add_argument("--gap", type=float, default=MARGIN_POINTS,
                   help="true mean of run − own control, points (default: the margin)")
    p.add_argument("--shortfall", type=float, default=0.0,
                   help="true mean of yardstick − control, points; the gap to the yardstick is gap − shortfall")
    p.add_argument("--rho", type=float, default=0.55, help="seed-level correlation of control and yardstick")
    p.add_argument("--seed-sd", type=float, default=1.0, help="seed sd of each arm's accuracy, points")
    p.add_argument("--reps", type=int, default=1000, help="simulated audits (default 1000)")
    p.add_argument("--margin", type=float, default=MARGIN_POINTS, help="the (d) margin, points")
    p.add_argument("--rng-seed", type=int, default=0)
    p.add_argument("--table", action="store_true", help="print docs/PROTOCOL.md's calibration table")
    args = p.parse_args(argv)
    bad = [f"--{k.replace('_', '-')}" for k, ok in (("seeds", args.seeds >= 1), ("methods", args.methods >= 1),
           ("n_test", args.n_test >= 2), ("reps", args.reps >= 1), ("rho", -1 <= args.rho <= 1),
           ("seed_sd", args.seed_sd >= 0)) if not ok]
    if bad:
        print(f"decision_calibration: {', '.join(bad)} out of range (seeds, methods, reps ≥ 1; "
              "n-test ≥ 2; rho in [-1, 1]; seed-sd ≥ 0)", file=sys.stderr)
        return 2
    if args.table:
        table(args)
        return 0
    t0 = time.perf_counter()
    r = calibrate(seeds=args.seeds, methods=args.methods, n_test=args.n_test, gap=args.gap,
                  shortfall=args.shortfall, rho=args.rho, seed_sd=args.seed_sd, reps=args.reps,
                  margin=args.margin, rng_seed=args.rng_seed)
    print(f"{args.reps} audits × {args.methods} methods × {args.seeds} seeds, N {args.n_test}, "
          f"G {args.gap:g}, D {args.shortfall:g}, rho {args.rho:g}, seed sd {args.seed_sd:g}, "
          f"margin {args.margin:g} points: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(f"p_clears={r['p_clears']:.4f} p_undercut={r['p_undercut']:.4f} "
          f"familywise_false_clear={r['familywise_false_clear']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
