"""(d) across seeds (issue 33), with the pairing kept: every arm of a seed scored on one shared
test set, control and yardstick correlated across seeds. Two contrasts (to the rule's own control,
to the yardstick under the same recipe), a clear needs both, an undercut comes only from the own
control, a variance over seeds and the shared test set, Holm over an audit's methods, and the
error rates measured by the calibration harness (benchmarks/decision_calibration.py) that calls
the same `decide_audit` the audit calls."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

from creditaudit.config import RunConfig
from creditaudit.data import load_dataset
from creditaudit.depth import (ERROR_RATE, PairedGap, decide_audit, depth_decision, holm,
                               redecide_audit)
from creditaudit.experiments import eval_batches
from creditaudit.experiments.common import diagnose_run
from creditaudit.sensitivity import threshold_sensitivity
from creditaudit.train import train_run
from creditaudit.verdict import SeedEvidence, Thresholds, method_verdict, stop_rule

T = Thresholds()
MARGIN = T.depth_margin
_spec = importlib.util.spec_from_file_location(
    "decision_calibration", Path(__file__).resolve().parents[1] / "benchmarks" / "decision_calibration.py")
calib = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(calib)


def _audit(rng, **kw):
    """One simulated audit's evidence (accuracies and per-example bits on one shared test set)."""
    kw = {"methods": 1, "seeds": 3, "n_test": 1000, "rho": 0.55, "seed_sd": 0.01, "shortfall": 0.0, **kw}
    return calib.simulate_audit(rng, **kw)


def _outcomes(rng, reps, **kw):
    out = []
    for _ in range(reps):
        ev = _audit(rng, **kw)
        out += [d.outcome for d in decide_audit(ev, MARGIN, {m: "r" for m in ev}).values()]
    return out


# -- the two statistics and how they combine ---------------------------------------------------

def test_a_rule_well_over_its_own_control_is_never_walked_back_for_a_weak_control():
    """+3 points over its own control, which is 5 points short of the yardstick: the gap to the
    yardstick is −2, so the rule cannot clear — but its own control never walks it back (the old
    per-seed switch did, 99.6 % of the time)."""
    rng = np.random.default_rng(1)
    outcomes = _outcomes(rng, 150, gap=0.03, shortfall=0.05)
    assert outcomes.count("undercut") == 0
    assert outcomes.count("clears") == 0


def test_bp_under_another_rules_recipe_is_never_walked_back_by_that_recipes_yardstick():
    """bp's frozen control *is* the recipe's yardstick: bp +10 points over it clears, and a bp
    barely over it is never undercut by a yardstick trained under another recipe."""
    rng = np.random.default_rng(2)
    for gap in (0.10, 0.025):
        ev = _audit(rng, gap=gap, shortfall=0.0)
        # the run's own control is the yardstick: same accuracies, same bits
        ev = {m: [PairedGap(p.label, p.acc, p.yardstick_acc, p.n_test, p.yardstick_acc, p.correct,
                            p.yardstick_correct, p.yardstick_correct) for p in ps] for m, ps in ev.items()}
        d = decide_audit(ev, MARGIN, {"m0": "r"})["m0"]
        assert d.outcome != "undercut"
        assert d.shortfall.mean == 0 and d.control_note() is None
    assert d.yardstick.values == d.control.values


def test_a_clear_needs_both_statistics():
    """Constructed contrasts: clearing the own control while sitting under the yardstick is
    undetermined; clearing both clears; an undercut needs the own control's upper bound."""
    base = np.zeros(1000, dtype=bool)
    def pg(acc, frozen, yard, i):
        return PairedGap(f"s{i}", acc, frozen, 1000, yard)
    own_only = [pg(0.70 + 0.002 * i, 0.60, 0.69, i) for i in range(5)]
    assert depth_decision(own_only, MARGIN).outcome == "undetermined"
    both = [pg(0.80 + 0.002 * i, 0.60, 0.65, i) for i in range(5)]
    assert depth_decision(both, MARGIN).outcome == "clears"
    below_own = [pg(0.45 + 0.002 * i, 0.61, 0.50, i) for i in range(5)]
    assert depth_decision(below_own, MARGIN).outcome == "undercut"
    del base


def test_per_example_bits_enter_the_variance_and_a_missing_record_uses_the_stated_bound():
    rng = np.random.default_rng(3)
    ev = _audit(rng, gap=0.05, shortfall=0.0)["m0"]
    recorded = depth_decision(ev, MARGIN)
    bare = depth_decision([PairedGap(p.label, p.acc, p.frozen_acc, p.n_test, p.yardstick_acc) for p in ev], MARGIN)
    assert recorded.control.example_source.startswith("per-example")
    assert bare.control.example_source.startswith("bound")
    # the bound is conservative: never narrower than what the bits measure
    assert bare.control.example_var >= recorded.control.example_var
    # the example term is the variance over examples of the seed-averaged difference, / N
    diff = np.mean([p.correct.astype(int) - p.frozen_correct.astype(int) for p in ev], axis=0)
    assert recorded.control.example_term == pytest.approx(diff.var(ddof=1) / 1000)


def test_an_edited_per_example_record_is_refused():
    from creditaudit.errors import CreditAuditError
    from creditaudit.store import pack_correct
    bits = np.arange(1000) % 3 == 0
    rec = pack_correct(bits)
    report = {"flags": dict.fromkeys(("a", "a_prime", "b", "b_prime", "c"), False), "reasons": []}
    ok = SeedEvidence("m/s1", "finished", report, float(bits.mean()), 0.2, 1000, None, rec, None)
    assert ok.paired.correct.sum() == bits.sum()
    flipped = pack_correct(~bits)                       # bits of another run beside this accuracy
    with pytest.raises(CreditAuditError, match="edited or belongs to another run"):
        SeedEvidence("m/s1", "finished", report, float(bits.mean()), 0.2, 1000, None, flipped, None).paired
    with pytest.raises(CreditAuditError, match="malformed"):
        SeedEvidence("m/s1", "finished", report, float(bits.mean()), 0.2, 1000, None,
                     {"n": 1000, "bits": "not base64!"}, None).paired


# -- the error rates, measured with the pairing kept -------------------------------------------

@pytest.mark.parametrize("seeds,shortfall", [(3, 0.0), (10, 0.015), (5, 0.03)])
def test_boundary_false_clear_rate_stays_under_five_percent(seeds, shortfall):
    """The calibration harness, short and fixed-seed: the true gap to the yardstick on the margin
    (G − D = margin). The rate stays under 5 % plus three Monte-Carlo standard errors."""
    reps = 300
    r = calib.calibrate(seeds=seeds, methods=1, n_test=500, gap=100 * MARGIN + 100 * shortfall,
                        shortfall=100 * shortfall, rho=0.55, seed_sd=1.0, reps=reps, margin=100 * MARGIN,
                        rng_seed=seeds)
    mc = 3 * math.sqrt(ERROR_RATE * (1 - ERROR_RATE) / reps)
    assert r["p_clears"] <= ERROR_RATE + mc, r


def test_the_familywise_false_clear_rate_over_fourteen_methods_stays_under_five_percent():
    reps = 120
    r = calib.calibrate(seeds=3, methods=14, n_test=300, gap=100 * MARGIN, shortfall=0.0, rho=0.55,
                        seed_sd=1.0, reps=reps, margin=100 * MARGIN, rng_seed=7)
    assert r["familywise_false_clear"] <= ERROR_RATE + 3 * math.sqrt(ERROR_RATE * (1 - ERROR_RATE) / reps), r


def test_the_rule_has_power_so_the_rate_is_not_bought_by_never_deciding():
    r = calib.calibrate(seeds=5, methods=1, n_test=1000, gap=100 * MARGIN + 6, shortfall=0.0, rho=0.55,
                        seed_sd=1.0, reps=100, margin=100 * MARGIN, rng_seed=11)
    assert r["p_clears"] > 0.8
    r = calib.calibrate(seeds=5, methods=1, n_test=1000, gap=100 * MARGIN - 6, shortfall=0.0, rho=0.55,
                        seed_sd=1.0, reps=100, margin=100 * MARGIN, rng_seed=12)
    assert r["p_undercut"] > 0.8


def test_the_benchmark_prints_its_contract_line(capsys):
    assert calib.main(["--reps", "5", "--methods", "2", "--seeds", "2", "--n-test", "50"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    keys = [kv.split("=")[0] for kv in last.split()]
    assert keys == ["p_clears", "p_undercut", "familywise_false_clear"]
    assert all(0 <= float(kv.split("=")[1]) <= 1 for kv in last.split())
    assert calib.main(["--seeds", "0"]) == 2


# -- Holm, pooling, one seed, sensitivity ----------------------------------------------------

def test_holm_withholds_a_marginal_clear_that_one_claim_would_make():
    rng = np.random.default_rng(5)
    ev = _audit(rng, gap=0.06, shortfall=0.0, seeds=3)
    alone = depth_decision(ev["m0"], MARGIN)
    # add 13 more methods that clear by a mile: K = 14, the weakest clear is tested at α/1 only
    # if every other one stood; with the others far below the margin it is tested at α/14
    others = {f"o{i}": [PairedGap(p.label, p.acc - 0.2, p.frozen_acc, p.n_test, p.yardstick_acc,
                                  None, None, None) for p in ev["m0"]] for i in range(13)}
    family = holm({"m0": alone, **{k: depth_decision(v, MARGIN) for k, v in others.items()}})
    assert family["m0"].family == 14
    assert family["m0"].alpha == pytest.approx(ERROR_RATE / 14)
    if alone.outcome == "clears" and alone.p_clear > ERROR_RATE / 14:
        assert family["m0"].outcome == "undetermined" and family["m0"].per_claim == "clears"
        assert "Holm" in family["m0"].explain()


def test_seed_spread_is_pooled_only_over_methods_sharing_a_recipe():
    rng = np.random.default_rng(6)
    ev = {**_audit(rng, methods=2, seeds=3, gap=0.05)}
    one_seed = {"solo": [ev["m0"][0]], **ev}
    shared = decide_audit(one_seed, MARGIN, {"solo": "r", "m0": "r", "m1": "r"})
    apart = decide_audit(one_seed, MARGIN, {"solo": "other", "m0": "r", "m1": "r"})
    assert shared["solo"].control.seed_var is not None and shared["solo"].control.noise.groups == 2
    assert apart["solo"].control.seed_var is None and apart["solo"].outcome == "undetermined"
    assert "add a seed" in apart["solo"].explain()


def test_undetermined_names_the_seeds_at_a_stated_effect():
    d = depth_decision([PairedGap(f"s{i}", a, 0.5, 1000, 0.5) for i, a in enumerate((0.51, 0.54, 0.53))], MARGIN)
    assert d.outcome == "undetermined"
    assert "if the true gap lay 1 point from the margin" in d.explain()
    assert d.seeds_needed is None or d.seeds_needed > 3


def test_sensitivity_re_decides_the_audit_with_holm(tmp_path):
    rng = np.random.default_rng(8)
    ev = _audit(rng, methods=3, seeds=4, gap=0.06)
    decisions = decide_audit(ev, MARGIN, {m: "r" for m in ev})
    table, _ = threshold_sensitivity([], T, depth=decisions)
    row = table["depth_margin"]
    lo, hi = (float(v) for v in row["interval"])       # "inf" / "-inf" in JSON
    now = tuple(d.outcome for d in decisions.values())
    for m in (lo + 1e-4, (MARGIN + hi) / 2 if math.isfinite(hi) else MARGIN + 0.01):
        if lo < m <= hi:
            assert tuple(d.outcome for d in redecide_audit(decisions, m).values()) == now


def test_a_run_stopped_early_is_never_trustworthy(tmp_path):
    """--stop-when-flagged with a threshold under which (b′) fires at once stops the run at epoch 1
    of 3; diagnosed with today's thresholds no flag fires — and the verdict is incomplete."""
    config = RunConfig(method="bp", dataset="digits", epochs=3, width=16, blocks=2, stop_when_flagged=1)
    run = train_run(config, tmp_path / "run", data_dir=tmp_path / "data", progress=False,
                    stop_rule=stop_rule(1, Thresholds(gain=100.0)))
    assert run.status["status"] == "stopped" and run.epochs_completed == 1
    # the run kept its per-example record beside the accuracy it reports
    bits = run.history[-1]["test_correct"]
    assert bits["n"] == 360 and abs(sum(map(int, __import__("numpy").unpackbits(
        __import__("numpy").frombuffer(__import__("base64").b64decode(bits["bits"]), "uint8"))[:360])) / 360 - run.test_acc) < 1e-9
    data = load_dataset("digits", tmp_path / "data")
    report = diagnose_run(run, eval_batches(data, 8), frozen_acc=0.0, run_data=data)
    assert report.project.outcome == report.paper.outcome == "incomplete"
    seeds = [SeedEvidence("bp/s42", "stopped", report.to_dict(), run.test_acc, 0.0, 360, None, bits)]
    judged = method_verdict(seeds, T)
    assert judged["verdicts"]["project"]["outcome"] == "incomplete" and "stopped early" in judged["verdict"]


# -- what a review found (issue 33): evidence that is missing is said so, never decided around ----

def _flags_clean():
    return {"flags": dict.fromkeys(("a", "a_prime", "b", "b_prime", "c"), False), "reasons": [],
            "training": {"status": "finished", "epochs_completed": 1, "epochs_planned": 1}}


def test_a_yardstick_trained_for_every_seed_but_missing_keeps_the_verdict_incomplete():
    """The audit trains a yardstick per recipe × seed; when none finished (failed, diverged,
    refused), (d) must not clear on the rule's own control alone and call it trustworthy."""
    seeds = [SeedEvidence(f"fa/s{i}", "finished", _flags_clean(), 0.8 + 0.01 * i, 0.6, 1000,
                          yardstick_expected=True) for i in range(3)]
    v = method_verdict(seeds, T)
    assert v["verdicts"]["project"]["outcome"] == "incomplete"
    assert "finished yardstick for only 0/3 seeds" in v["verdict"]
    # without one expected (a user's loop that gave none), the control's own check stands in
    alone = method_verdict([SeedEvidence(s.label, s.status, s.report, s.acc, s.frozen_acc, 1000) for s in seeds], T)
    assert "yardstick" not in alone["verdict"]


def test_a_non_finite_accuracy_is_an_unpaired_seed_not_a_dropped_one():
    seeds = [SeedEvidence("m/s0", "finished", _flags_clean(), 0.80, 0.60, 1000),
             SeedEvidence("m/s1", "finished", _flags_clean(), 0.81, 0.61, 1000),
             SeedEvidence("m/s2", "finished", _flags_clean(), 0.30, float("nan"), 1000)]
    v = method_verdict(seeds, T)
    assert v["verdicts"]["project"]["outcome"] != "trustworthy"
    assert "only 2/3 seeds" in v["verdict"]


def test_records_of_other_lengths_are_refused_and_identical_bare_gaps_decide_nothing():
    from creditaudit.errors import CreditAuditError
    with pytest.raises(CreditAuditError, match="different lengths"):
        depth_decision([PairedGap("s0", 0.5, 0.4, None, None, np.ones(1000, bool), np.ones(500, bool))], MARGIN)
    with pytest.raises(CreditAuditError, match="the test set has 360"):
        depth_decision([PairedGap("s0", 0.5, 0.4, 360, None, np.ones(1000, bool), np.ones(1000, bool))], MARGIN)
    assert depth_decision([0.0205, 0.0205], MARGIN).outcome == "undetermined"


def test_the_seed_estimate_is_made_at_the_level_the_clear_is_tested_at():
    rng = np.random.default_rng(9)
    ev = _audit(rng, gap=0.035, seeds=3)["m0"]
    d = depth_decision(ev, MARGIN)
    c = d.binding
    assert c.seeds_needed(MARGIN, alpha=ERROR_RATE / 14) is None or \
        c.seeds_needed(MARGIN, alpha=ERROR_RATE / 14) >= (c.seeds_needed(MARGIN) or 0)
