"""The audit: every method × seed with its frozen and shallow controls → one diagnosed table,
written to <out>/audit.json (the report is drawn from that file alone)."""
from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Sequence

from .. import __version__, store
from ..config import AuditConfig, RunConfig, recipe_key, recipe_yardstick
from ..depth import ERROR_RATE, DepthDecision, decide_audit
from ..errors import CreditAuditError
from ..store import json_number as _num
from ..methods import REFERENCE_METHOD, method_class
from ..protocol import deep_gamma
from ..runs import canonical_control, refuse_run_folder
from ..sensitivity import threshold_sensitivity
from ..verdict import SeedEvidence, Thresholds, flag_table, interval, method_verdict, verdict_of
from .common import Execution, Outcome, dataset, mean_std, median_of, run_all

STRATEGIES = ("accuracy only", "accuracy + Γ", "full protocol")


def execution_of(config: AuditConfig, compile_step: bool | None = False, label_probe: bool = True) -> Execution:
    """compile_step: False (eager, the library default), True, or None = on CUDA only (the
    command line's default; `train.compile_mode_for`). label_probe: False silences the warning
    about labels a linear probe cannot predict (`--no-label-probe`)."""
    return Execution(data_dir=config.data_dir, device=config.device, jobs=config.jobs,
                     executor=config.executor, address=config.address, max_retries=config.max_retries,
                     stack=config.stack, compile_step=compile_step, label_probe=label_probe)


def _frozen_by_seed(method: str, outcomes: Sequence[Outcome]) -> dict[int, Outcome]:
    """seed → the finished frozen control of each main run of `method` among `outcomes`: the run's
    own (`frozen_control_of`, by run key: a yardstick trained under another recipe is a frozen
    control of the reference method too, never this run's); for a user's loop, by method and seed."""
    done = [o for o in outcomes if o.config.control == "frozen" and o.test_acc is not None
            and o.status == "finished"]
    by_key = {o.config.run_key: o for o in done}
    out = {}
    for o in outcomes:
        if o.config.method != method or o.config.control != "none":
            continue
        if isinstance(o.config, RunConfig):
            frozen = frozen_control_of(o.config)
            control = None if frozen is None else by_key.get(frozen.run_key)
        else:
            control = next((c for c in done if c.config.method == method and c.config.seed == o.config.seed), None)
        if control is not None:
            out[o.config.seed] = control
    return out


def _correct(o: Outcome | None) -> dict | None:
    """The per-example correctness a run recorded beside its reported accuracy (None: a run
    recorded before runs kept it, or a loop that measured no test set itself)."""
    return (o.history[-1].get("test_correct") if o is not None and o.history else None)


Yardstick = Callable[[Outcome], "Outcome | None"]


def recipe_yardsticks(outcomes: Sequence[Outcome]) -> Yardstick:
    """run → its yardstick among `outcomes`: the reference method's (bp's) finished frozen control
    under the run's own recipe (`config.recipe_yardstick`), trained by the audit beside every
    method's (`AuditConfig.yardstick_configs`); None when it is missing or did not finish."""
    by_key = {o.config.run_key: o for o in outcomes if o.status == "finished" and o.test_acc is not None}

    def of(o: Outcome) -> Outcome | None:
        yard = recipe_yardstick(o.config)
        return None if yard is None else by_key.get(canonical_control(yard).run_key)
    return of


def method_evidence(method: str, outcomes: Sequence[Outcome], n_test: int | None = None,
                    yardstick_of: Yardstick | None = None,
                    yardsticks_expected: bool = False) -> list[SeedEvidence]:
    """One SeedEvidence per main run of `method`: its diagnosis, the seed-paired control's
    accuracy, the run's yardstick (`yardstick_of`; None: none), and each arm's per-example
    correctness on the test set where recorded."""
    frozen_by_seed = _frozen_by_seed(method, outcomes)
    evidence = []
    for o in outcomes:
        if o.config.method != method or o.config.control != "none":
            continue
        frozen = frozen_by_seed.get(o.config.seed)
        yard = yardstick_of(o) if yardstick_of else None
        evidence.append(SeedEvidence(
            o.config.label, o.status, o.report, o.test_acc, None if frozen is None else frozen.test_acc,
            n_test, None if yard is None else yard.test_acc, _correct(o), _correct(frozen), _correct(yard),
            # a yardstick the audit trains (or the user gave) that is missing for this seed — failed,
            # diverged, refused — is missing evidence, never "no yardstick"
            yardstick_expected=yardsticks_expected))
    return evidence


def _null_note(method: str) -> str:
    """The rule's `Method.null_note`; "" for a name no class answers to (a method named in the
    user's own loop, `audit_own_runs`)."""
    try:
        return method_class(method).null_note
    except CreditAuditError:
        return ""


def _deep(report: dict) -> dict:
    """`protocol.deep_gamma` of a stored diagnosis (a report without `gamma_exact`, written before
    exact positions were declared, keeps every position)."""
    return deep_gamma(report.get("gamma"), report.get("gamma_exact") or (), report.get("null"))


def _z(gamma: float | None, mean: float | None, std: float | None) -> float | None:
    """(Γ − null mean)/null std of the seed means; None without a null or with a zero spread."""
    return None if gamma is None or mean is None or not std else (gamma - mean) / std


def alignment_over_training(main: Sequence[Outcome]) -> dict | None:
    """The alignment the monitor recorded over training (train._alignment), per epoch it probed,
    as the mean over the method's main runs (seeds) that have it: "gamma" Γ_l per position
    (l = 0 … L), "weight_alignment" cos(W, B) per feedback pair (rules with feedback weights);
    "seeds" how many runs each epoch's mean is over. None when no run recorded any (a run of an
    older trainer, or a run from the user's own loop)."""
    epochs = sorted({int(r["epoch"]) for o in main for r in o.history if r.get("gamma") is not None})
    if not epochs:
        return None
    at = {e: [r for o in main for r in o.history if int(r["epoch"]) == e and r.get("gamma") is not None]
          for e in epochs}
    n_pos = max(len(r["gamma"]) for rs in at.values() for r in rs)
    gamma = [[mean_std([_num(r["gamma"][l]) for r in at[e] if len(r["gamma"]) == n_pos])[0]
              for l in range(n_pos)] for e in epochs]
    names = sorted({n for rs in at.values() for r in rs for n in (r.get("weight_alignment") or {})})
    weights = {n: [mean_std([_num((r.get("weight_alignment") or {}).get(n)) for r in at[e]])[0]
                   for e in epochs] for n in names}
    return {"epochs": epochs, "seeds": [len(at[e]) for e in epochs], "gamma": gamma,
            "weight_alignment": weights}


def summarize_method(method: str, outcomes: Sequence[Outcome], thresholds: Thresholds,
                     depth: DepthDecision | None = None, n_test: int | None = None,
                     yardstick_of: Yardstick | None = None, yardsticks_expected: bool = False) -> dict:
    """Seed-aggregated row of the audit table for one method (its main runs and controls).
    `depth`: the method's (d) as the audit decided it (`depth.decide_audit`: seed spread pooled
    over the methods sharing its recipe, Holm over the audit; None = its seeds alone); `n_test`: the
    test-set size every accuracy was measured on; `yardstick_of`: each run's yardstick (bp's
    frozen control under the run's recipe; None: none)."""
    yardstick_of = yardstick_of or (lambda o: None)
    mine = [o for o in outcomes if o.config.method == method]
    main = [o for o in mine if o.config.control == "none"]
    frozen = [o for o in mine if o.config.control == "frozen"]
    shallow = [o for o in mine if o.config.control == "shallow"]
    diagnosed = [o for o in main if o.report]
    frozen_by_seed = {seed: o.test_acc for seed, o in _frozen_by_seed(method, outcomes).items()}
    judged = method_verdict(method_evidence(method, outcomes, n_test, yardstick_of, yardsticks_expected),
                            thresholds, depth)
    paired = [o for o in main if o.test_acc is not None and o.config.seed in frozen_by_seed]
    acc, acc_sd = mean_std([o.test_acc for o in main if o.test_acc is not None])
    facc, facc_sd = mean_std([frozen_by_seed[o.config.seed] for o in paired] or list(frozen_by_seed.values()))
    sacc, sacc_sd = mean_std([o.test_acc for o in shallow if o.test_acc is not None
                              and o.status == "finished"])      # not one the evidence gate refused
    rep = lambda key: [_num(o.report[key]) for o in diagnosed]
    gammas = [o.report["gamma"] for o in diagnosed if o.report.get("gamma")]
    nulls = [o.report["null"] for o in diagnosed if o.report.get("null")]
    # deep Γ per seed, from protocol.deep_gamma (exact positions left out; the paper's beside it)
    deeps = [_deep(o.report) for o in diagnosed if o.report.get("gamma")]
    deep_over_seeds = lambda key: mean_std([d[key] for d in deeps])[0]
    rhos = [o.report["rho"] for o in diagnosed if o.report.get("rho")]
    deep_rho = lambda key: mean_std([statistics.fmean(_num(r[key]) for r in rs) for rs in rhos
                                     if all(r.get(key) is not None for r in rs)])
    failed = [o for o in main if o.status not in ("finished", "diverged", "stopped") or not o.report]
    unfinished_controls = [o for o in frozen + shallow if o.status != "finished"]
    mean_gamma = mean_std([statistics.fmean(_num(g) for g in gs) for gs in gammas
                           if all(g is not None for g in gs)])[0]
    first_fire = {k: [(o.report.get("first_fire") or {}).get(k) for o in diagnosed]
                  for k in ("a", "a_prime", "b", "b_prime")}
    per_seed = {}
    for o in main:
        r = o.report or {}
        frozen_acc = frozen_by_seed.get(o.config.seed)
        yard = yardstick_of(o)
        yard = None if yard is None else yard.test_acc
        per_seed[str(o.config.seed)] = {
            "status": o.status, "epochs": f"{o.epochs_completed}/{o.config.epochs}",
            "acc": o.test_acc, "frozen_acc": frozen_acc,
            "gap": None if o.test_acc is None or frozen_acc is None else o.test_acc - frozen_acc,
            "yardstick_acc": yard,
            "yardstick_gap": None if o.test_acc is None or yard is None else o.test_acc - yard,
            "control_shortfall": None if frozen_acc is None or yard is None else yard - frozen_acc,
            "h_L": (r.get("residual_norms") or [None])[-1], "gain": r.get("readout_gain"),
            "max_growth": r.get("max_growth"), "init_growth": r.get("init_growth"),
            "stack_growth": r.get("stack_growth"), "gamma_deep": _deep(r)["gamma_deep"],
            "gamma_deep_paper": _deep(r)["gamma_deep_paper"], "gamma_deep_exact": _deep(r)["gamma_deep_exact"],
            "gamma_deep_trained": r.get("gamma_deep_trained"),
            "rho_bp_model_precision": r.get("rho_bp_model_precision"),
            "verdict": r.get("verdict", o.status), "verdicts": r.get("verdicts")}
    return {
        "method": method, "lam": main[0].config.lam if main else 0.0,
        "recipe": (main or mine)[0].config.recipe_record if mine else None,
        "null_note": _null_note(method),
        "n_seeds": len(main), "n_diagnosed": len(diagnosed),
        "statuses": {o.config.seed: o.status for o in main},
        "failed": [{"label": o.config.label, "status": o.status, "message": o.message}
                   for o in failed + unfinished_controls],
        "acc": acc, "acc_std": acc_sd, "frozen_acc": facc, "frozen_acc_std": facc_sd,
        "acc_interval": interval([o.test_acc for o in main if o.status == "finished"], bounds=(0.0, 1.0)),
        "depth_gap_interval": judged["depth_gap_interval"], "depth": judged["depth"],
        "per_seed": per_seed,
        "init_growth": median_of(rep("init_growth")), "stack_growth": median_of(rep("stack_growth")),
        "rho_bp_model_precision": mean_std([_num(o.report.get("rho_bp_model_precision"))
                                            for o in diagnosed])[0],
        "shallow_acc": sacc, "shallow_acc_std": sacc_sd, "depth_gap": judged["depth_gap"],
        # the yardstick (bp's frozen control under this method's recipe): its accuracy, the gap to
        # it (the second statistic of (d)) and the control's shortfall to it, with their bounds
        "yardstick_acc": mean_std([y.test_acc for y in (yardstick_of(o) for o in main) if y is not None])[0],
        "yardstick_gap": judged["depth"].get("yardstick_gap"),
        "control_shortfall": (judged["depth"].get("shortfall") or {}).get("mean"),
        "weak_control": judged["depth"].get("weak_control"),
        "n_paired_with_frozen": judged["n_paired_with_frozen"],
        "h_L": median_of([_num(o.report["residual_norms"][-1]) for o in diagnosed]),
        "g_L": median_of([_num(o.report["bp_grad_norms"][-1]) for o in diagnosed]),
        "gain": median_of(rep("readout_gain")), "max_growth": median_of(rep("max_growth")),
        "stability_mid": mean_std(rep("stability_mid"))[0],
        "gamma_layers": [mean_std([_num(g[l]) for g in gammas])[0] for l in range(len(gammas[0]))] if gammas else None,
        "gamma_deep": deep_over_seeds("gamma_deep"),
        "gamma_deep_paper": deep_over_seeds("gamma_deep_paper"),
        # ep, pc: the deep Γ of the credit exactly as training computes it (protocol, Report)
        "gamma_deep_trained": mean_std([o.report.get("gamma_deep_trained") for o in diagnosed
                                        if o.report.get("gamma_deep_trained") is not None])[0],
        "gamma_exact": sorted({l for d in deeps for l in d["gamma_exact"]}),
        "gamma_deep_exact": bool(deeps) and all(d["gamma_deep_exact"] for d in deeps),
        "gamma_mean_all": mean_gamma,
        "gamma_interpretable": all(o.report.get("gamma_interpretable") for o in diagnosed) if gammas else None,
        "null_deep_mean": deep_over_seeds("null_deep_mean"),
        "null_deep_std": deep_over_seeds("null_deep_std"),
        "gamma_deep_z": _z(deep_over_seeds("gamma_deep"), deep_over_seeds("null_deep_mean"),
                           deep_over_seeds("null_deep_std")),
        "null_layers": ([mean_std([_num(n["mean"][l]) for n in nulls])[0] for l in range(len(nulls[0]["mean"]))],
                        [mean_std([_num(n["std"][l]) for n in nulls])[0] for l in range(len(nulls[0]["std"]))])
        if nulls else None,
        "rho_deep": deep_rho("method")[0], "rho_deep_std": deep_rho("method")[1],
        "rho_bp": deep_rho("bp")[0], "rho_random": deep_rho("random")[0],
        "rho_layers": {key: [mean_std([_num(rs[i][key]) for rs in rhos])[0] for i in range(len(rhos[0]))]
                       for key in ("method", "bp", "random")} if rhos else None,
        "first_fire": first_fire,
        "alignment": alignment_over_training(main),
        "flag_counts": judged["flag_counts"], "flags": judged["flags"],
        "paper_flags": judged["paper_flags"], "verdicts": judged["verdicts"],
        "verdict": judged["verdict"], "paper_verdict": judged["paper_verdict"],
        "reasons": judged["reasons"], "missing": judged["missing"], "notes": judged["notes"],
    }


def reporting_strategies(row: dict) -> dict[str, str]:
    """What each reporting strategy concludes for one method (docs/PROTOCOL.md, reference figures).

    accuracy only:  the reported accuracy stands — nothing is checked against it.
    accuracy + Γ:   the usual reading: accept when the credit's Γ, averaged over the residual
                    positions, is positive (it "aligns with backprop"); walk back otherwise.
    full protocol:  the project verdict: accept, walk back, or incomplete (not enough evidence).
    """
    g = row.get("gamma_mean_all")
    verdict = verdict_of(row)
    if row.get("acc") is None:                 # nothing was trained: no strategy has a number to read
        return {s: "n/a (no run)" for s in STRATEGIES}
    return {"accuracy only": "accept",
            "accuracy + Γ": "n/a (no credit)" if g is None else ("accept" if g > 0 else "walk back"),
            "full protocol": ("accept" if verdict.trustworthy else
                              "walk back" if verdict.walks_back else "incomplete")}


def recipe_of(config) -> str | None:
    """The key of a run's resolved recipe (None: a run of the user's own loop, recipe unknown)."""
    return recipe_key(config) if isinstance(config, RunConfig) else None


def decide_depths(methods: Sequence[str], outcomes: Sequence[Outcome], thresholds: Thresholds,
                  n_test: int | None, yardstick_of: Yardstick | None,
                  yardsticks_expected: bool = False) -> dict[str, DepthDecision]:
    """Every method's (d), decided together: seed spread pooled over the methods that share a
    recipe, then Holm over the methods tested (`depth.decide_audit`)."""
    pairs = {m: [s.paired for s in method_evidence(m, outcomes, n_test, yardstick_of, yardsticks_expected)
                 if s.paired is not None] for m in methods}
    recipes = {m: next((recipe_of(o.config) for o in outcomes if o.config.method == m
                        and o.config.control == "none"), None) for m in methods}
    return decide_audit(pairs, thresholds.depth_margin, recipes)


def tabulate(methods: Sequence[str], outcomes: Sequence[Outcome], thresholds: Thresholds,
             n_test: int, yardstick_of: Yardstick | None = None,
             yardsticks_expected: bool | None = None) -> dict:
    """audit.json's table from the outcomes of its runs: one row per method, its reporting
    strategies and their totals, the audit-wide error of (d) and the threshold sensitivity.

    (d) is decided for every method together (`decide_depths`); the sensitivity's depth_margin
    row re-decides them. `yardstick_of`: each run's yardstick (None: bp's frozen control under
    the run's recipe among `outcomes`, `recipe_yardsticks`)."""
    if yardsticks_expected is None:         # the audit's own: it trains one per recipe × seed
        yardsticks_expected = yardstick_of is None
    yardstick_of = recipe_yardsticks(outcomes) if yardstick_of is None else yardstick_of
    decisions = decide_depths(methods, outcomes, thresholds, n_test, yardstick_of, yardsticks_expected)
    rows = [summarize_method(m, outcomes, thresholds, decisions[m], n_test, yardstick_of, yardsticks_expected)
            for m in methods]
    for row in rows:
        row["strategies"] = reporting_strategies(row)
    reports = [o.report for o in outcomes if o.report and o.config.control == "none"]
    sensitivity = (threshold_sensitivity(reports, thresholds, depth=decisions)[0] if reports else None)
    tested = sum(d.control is not None and d.control.se is not None for d in decisions.values())
    yards = {}
    for o in outcomes:
        y = yardstick_of(o) if o.config.control == "none" else None
        if y is not None:
            yards[y.config.run_key] = {"label": y.config.label, "seed": y.config.seed, "acc": y.test_acc,
                                       "recipe": getattr(y.config, "recipe_record", None),
                                       "for": sorted({*yards.get(y.config.run_key, {}).get("for", []), o.config.method})}
    return {"flag_table": flag_table(), "n_test": n_test,
            "yardstick": {"method": REFERENCE_METHOD, "runs": list(yards.values())},
            # a false "clears" anywhere among the K methods tested is held to ERROR_RATE (Holm);
            # each undercut is a one-sided ERROR_RATE claim of its own
            "depth_error_rate": {"per_claim": ERROR_RATE, "methods_tested": tested,
                                 "familywise_false_clear_at_most": ERROR_RATE if tested else None,
                                 "method": "Holm step-down over the methods tested; each clear an "
                                           "intersection–union test of the gaps to the control and "
                                           "to the yardstick",
                                 "calibration": "benchmarks/decision_calibration.py"},
            "strategies": list(STRATEGIES), "methods": rows,
            "strategy_totals": {s: sum(r["strategies"][s] == "walk back" for r in rows) for s in STRATEGIES},
            "sensitivity": sensitivity}


def yardstick_control(config: RunConfig) -> RunConfig | None:
    """The yardstick of a run's frozen control: bp's frozen control under the run's recipe."""
    yard = recipe_yardstick(config)
    return None if yard is None else canonical_control(yard)


def frozen_control_of(config: RunConfig) -> RunConfig | None:
    """The frozen-blocks control of the same method and seed (None for a control itself)."""
    if config.control != "none" or config.blocks == 0:
        return None
    return canonical_control(config.replace(trainable_blocks=0))


def audit(config: AuditConfig, progress: bool = True, compile_step: bool | None = False,
          label_probe: bool = True, reproduction: dict | None = None,
          while_training: Callable[[], None] | None = None, keep_workers: list | None = None) -> dict:
    """Train, diagnose and tabulate an audit; writes <out>/audit.json and returns it as read back.
    `reproduction`: the paper's setting and numbers the audit reproduces (`papers.Paper.record`),
    sealed into audit.json so the report compares them with the audit's own. `while_training`:
    `run_all`'s (work the caller needs later, done while the runs train); `keep_workers`: the
    same (the list the worker pool is left open in, for the caller to close)."""
    out = Path(config.out)
    refuse_run_folder(out)
    check_same_audit(out, config)
    thresholds = Thresholds(**config.thresholds)
    canonical = [canonical_control(c) for c in config.run_configs()]
    runs = list({c.run_key: c for c in canonical}.values())     # provably equal runs, trained once
    t0 = time.perf_counter()
    outcomes = run_all(runs, out, execution=execution_of(config, compile_step, label_probe), thresholds=thresholds,
                       n_eval=config.eval_batches, frozen_of=frozen_control_of,
                       yardstick_of=yardstick_control, progress=progress, diagnose_controls=False,
                       while_training=while_training, keep_workers=keep_workers)
    # accuracies are measured on the whole test split: (d)'s test-set term
    data = dataset(config.dataset, config.data_dir, "cpu")
    n_test = len(data.y_test)
    table = tabulate(config.methods, outcomes, thresholds, n_test)
    names = rule_names(config.methods)
    for row in table["methods"]:
        if row["method"] in names:
            row["rule_name"] = names[row["method"]]
    result = {
        "creditaudit_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "header": header(config, runs[0], data.describe()),
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()},
        "thresholds": asdict(thresholds),
        "wall_time": time.perf_counter() - t0,
        "runs_trained_now": sum(o.trained for o in outcomes),
        # how large a stack could be and why (experiments.sizing); None with stacking off
        "schedule": next((o.stack["sizing"] for o in outcomes if o.stack and o.stack.get("sizing")), None),
        "diagnoses": sum(o.report is not None for o in outcomes),
        "diagnoses_reused": sum(o.diagnosis_reused for o in outcomes),   # sealed, of the same run and settings
        **table,
        **({"reproduction": reproduction} if reproduction is not None else {}),
        "runs": [o.to_dict() for o in outcomes],
    }
    store.write_sealed_json(out / "audit.json", store.json_safe(result))
    return read_audit(out)


def rule_names(methods: Sequence[str]) -> dict[str, str]:
    """A user's rule (PKG.MODULE:CLASS) → its `name`, which the tables show (audit.md lists its
    import path once); a rule whose name another method of the audit also has keeps its path."""
    names = {m: method_class(m).name if ":" in m else m for m in methods}
    taken = Counter(names.values())
    return {m: n for m, n in names.items() if ":" in m and taken[n] == 1}


# what an audit's result depends on; where and how it ran (device, jobs, executor, …) and the
# preset's name do not change it, so a rerun that differs only there may rewrite the report
_RESULT_KEYS = ("dataset", "methods", "seeds", "epochs", "controls", "eval_batches", "model",
                "training", "thresholds", "options", "recipe", "recipes")


def check_same_audit(out: Path, config: AuditConfig) -> None:
    """Refuse to replace <out>/audit.json (and its report) with an audit of another configuration:
    the finished report is kept, and the user picks another --out or deletes the folder. An audit
    that extends the old one (more methods or seeds, every other setting equal) is allowed: its
    report holds every row of the old one, so nothing is lost."""
    path = Path(out) / "audit.json"
    if not path.exists():
        return
    old = {"recipe": "published", "recipes": {},                 # before --recipe: published
           **(read_audit(out).get("config") or {})}
    new = json.loads(json.dumps({k: (list(v) if isinstance(v, tuple) else v)
                                 for k, v in asdict(config).items()}))
    extends = lambda k: k in ("methods", "seeds") and set(old.get(k) or []) <= set(new.get(k) or [])
    differ = [k for k in _RESULT_KEYS if old.get(k) != new.get(k) and not extends(k)]
    if differ:
        shown = ", ".join(f"{k} {old.get(k)!r} there, {new.get(k)!r} now" for k in differ[:2])
        raise CreditAuditError(f"{out} already holds the report of a different audit ({shown}); give "
                               "this audit its own --out, or delete that folder to replace it")


def read_audit(out: Path) -> dict:
    """audit.json of an audit folder, integrity-checked."""
    path = Path(out) / "audit.json"
    if Path(out).is_file():
        path = Path(out)
    return store.read_sealed_json(path, "creditaudit audit (audit.json)")


def header(config: AuditConfig, base: RunConfig, data: str | None = None) -> str:
    """One line saying what was audited (`data`: what was loaded, ArrayDataset.describe); names
    the preset only when one was used."""
    preset = f"preset {config.preset}: " if config.preset else ""
    seeds = ", ".join(map(str, config.seeds))
    return (f"{preset}{data or config.dataset}, {base.arch} d={base.width} L={base.blocks}, "
            f"{config.epochs} epochs; seed{'s' if len(config.seeds) > 1 else ''} {seeds}; "
            f"controls: {', '.join(config.controls) or 'none'}; {config.eval_batches} eval batches; "
            f"{base.precision} training; "
            f"{'the papers’' if config.recipes else config.recipe} recipes")
