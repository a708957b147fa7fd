"""Experiments that compose training, methods and the protocol: the audit and the paper's studies.

    audit            every method × seed + its frozen and shallow controls → one diagnosed table
    ladder           accuracy vs number of trainable blocks k = 0 … L, per method
    penalty_sweep    dfa-penalty over λ: accuracy, ‖h_L‖, ‖g_L‖, deep Γ with its null, deep ρ
    identity_check   the frozen-init identity check over seeds

Runs are keyed by their resolved config (RunConfig.run_key) and live in `<out>/runs/`, so a
second call reuses finished runs and resumes interrupted ones. Runs train in worker processes
(`jobs`); a run that raises is recorded as failed and the rest go on.
"""
from __future__ import annotations

import math
import os
import statistics
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from . import __version__, store
from .store import json_number as _num
from .config import AuditConfig, RunConfig
from .data import ArrayDataset, load_dataset
from .errors import CreditAuditError
from .protocol import FLAG_NAMES, PAPER_FLAGS, PROJECT_FLAGS, Thresholds, diagnose
from .train import load_run, read_status, resolve_device, train_run

DONE = ("finished", "diverged", "stopped")


def run_dir_for(root: Path, config: RunConfig) -> Path:
    """<root>/runs/<method>[-lamλ]-<control>-s<seed>-<key>: readable, and unique per config."""
    lam = f"-lam{config.lam:g}" if config.lam else ""
    return Path(root) / "runs" / f"{config.method}{lam}-{config.control}-s{config.seed}-{config.run_key}"


def eval_batches(data: ArrayDataset, k: int, size: int = 128) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K disjoint, fixed test batches for the diagnostics.

    Batches hold 128 samples (SPEC §6) when the test set has K × 128; a smaller test set
    (MNIST-1D has 1000) is split into K equal batches of ⌊n_test / K⌋ instead, so that the K ≥ 8
    batches of the stability measure stay disjoint.
    """
    size = min(size, len(data.y_test) // k)
    if size < 1:
        raise CreditAuditError(f"the test set ({len(data.y_test)} samples) is too small for {k} eval batches")
    return [data.eval_batch(i, size) for i in range(k)]


# -- one run, in a worker ---------------------------------------------------------------------
_DATA_CACHE: dict[tuple, ArrayDataset] = {}


def _dataset(name: str, data_dir: str, device: str) -> ArrayDataset:
    key = (name, str(data_dir), str(device))
    if key not in _DATA_CACHE:
        _DATA_CACHE[key] = load_dataset(name, data_dir, device)
    return _DATA_CACHE[key]


@dataclass
class Job:
    """What a worker needs: the run, where it lives, and how to diagnose it."""

    config: dict
    run_dir: str
    data_dir: str
    device: str
    threads: int
    thresholds: dict = field(default_factory=dict)


def _train_job(job: Job) -> dict[str, Any]:
    """Train (or reuse) one run; never raises — a failure comes back as a record."""
    torch.set_num_threads(job.threads)
    config = RunConfig.from_dict(job.config)
    run_dir = Path(job.run_dir)
    t0 = time.perf_counter()
    was_done = read_status(run_dir).get("status") in DONE if (run_dir / "status.json").exists() else False
    try:
        data = _dataset(config.dataset, job.data_dir, job.device)
        run = train_run(config, run_dir, data=data, device=job.device, progress=False,
                        thresholds=Thresholds(**job.thresholds))
        (run_dir / "error.txt").unlink(missing_ok=True)
        return {"status": run.status["status"], "message": run.status["message"],
                "trained": not was_done, "seconds": time.perf_counter() - t0}
    except Exception as err:  # noqa: BLE001 — one failed run must not stop the others
        run_dir.mkdir(parents=True, exist_ok=True)
        store.atomic_write_text(run_dir / "error.txt", traceback.format_exc())
        message = str(err) if isinstance(err, CreditAuditError) else f"{type(err).__name__}: {err}"
        return {"status": "failed", "message": f"{message} (traceback in {run_dir / 'error.txt'})",
                "trained": True, "seconds": time.perf_counter() - t0}


@dataclass
class DiagnoseJob(Job):
    frozen_acc: float | None = None
    n_eval: int = 8
    rho: bool = True


def _diagnose_job(job: DiagnoseJob) -> dict[str, Any]:
    """Diagnose one trained run from its checkpoint; the report dict is also saved beside it."""
    torch.set_num_threads(job.threads)
    try:
        run = load_run(job.run_dir, job.device)
        data = _dataset(run.config.dataset, job.data_dir, job.device)
        report = diagnose(run.model, eval_batches(data, job.n_eval), method=run.method,
                          frozen_acc=job.frozen_acc, test_acc=run.test_acc,
                          thresholds=Thresholds(**job.thresholds), monitor_history=run.history,
                          rho=job.rho, label=run.config.label,
                          diverged=run.status.get("message") if run.status.get("status") == "diverged"
                          else None).to_dict()
        store.atomic_write_json(Path(job.run_dir) / "diagnosis.json", report)
        return report
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {err}"}


def _map(fn: Callable, jobs: Sequence[Job], workers: int, on_done: Callable[[int, Any], None]) -> list:
    """Run fn over jobs, in `workers` spawned processes (1 = in this process); results in order."""
    results: list[Any] = [None] * len(jobs)
    if workers <= 1 or len(jobs) <= 1:
        for i, job in enumerate(jobs):
            results[i] = fn(job)
            on_done(i, results[i])
        return results
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(fn, job): i for i, job in enumerate(jobs)}
        for fut in as_completed(futures):
            i = futures[fut]
            try:
                results[i] = fut.result()
            except Exception as err:  # a worker died (out of memory, killed)
                results[i] = {"status": "failed", "message": f"worker died: {err!r}",
                              "error": f"worker died: {err!r}", "trained": True}
            on_done(i, results[i])
    return results


def default_workers(device: torch.device, n_jobs: int) -> int:
    """CPU: one single-threaded worker per core (small nets scale better across runs than
    within one); CUDA: one process owns the GPU."""
    if device.type == "cuda":
        return 1
    return max(1, min(os.cpu_count() or 1, n_jobs))


# -- running a set of runs --------------------------------------------------------------------
@dataclass
class Outcome:
    """One run of an experiment: its config, where it lives, how training ended, its diagnosis."""

    config: RunConfig
    run_dir: Path
    status: str
    message: str
    trained: bool
    test_acc: float | None = None
    history: list[dict] = field(default_factory=list)
    report: dict | None = None

    def to_dict(self) -> dict:
        return {"label": self.config.label, "key": self.config.run_key, "method": self.config.method,
                "seed": self.config.seed, "control": self.config.control, "lam": self.config.lam,
                "trainable_blocks": self.config.trainable_blocks, "status": self.status,
                "message": self.message, "trained_now": self.trained, "test_acc": self.test_acc,
                "run_dir": str(self.run_dir), "config": self.config.to_dict(),
                "monitor": [{k: r.get(k) for k in ("epoch", "test_acc", "train_loss", "h_norms",
                                                    "g_norms", "max_growth", "gain")}
                            for r in self.history],
                "report": self.report}


def run_all(configs: Sequence[RunConfig], root: Path, *, data_dir: str, device: str = "auto",
            jobs: int = 0, thresholds: Thresholds = Thresholds(), n_eval: int = 8,
            rho: bool = True, frozen_of: Callable[[RunConfig], RunConfig | None] | None = None,
            log: Callable[[str], None] = print) -> list[Outcome]:
    """Train every config (reusing finished runs), then diagnose each trained run.

    frozen_of(config) names the frozen control whose accuracy (d) compares against; a control
    itself is diagnosed without ρ (it only needs to exist as the yardstick).
    """
    dev = resolve_device(device)
    workers = jobs or default_workers(dev, len(configs))
    threads = 1 if workers > 1 else max(1, torch.get_num_threads())
    _dataset(configs[0].dataset, data_dir, "cpu")  # fail fast (missing data) before any worker starts
    dirs = [run_dir_for(root, c) for c in configs]
    train_jobs = [Job(c.to_dict(), str(d), data_dir, str(dev), threads, asdict(thresholds))
                  for c, d in zip(configs, dirs)]
    t0 = time.perf_counter()

    def said(i: int, res: dict) -> None:
        verb = "trained" if res.get("trained") else "reused"
        log(f"  [{time.perf_counter() - t0:6.1f} s] {configs[i].label:<28} {res['status']:<9} "
            f"({verb}{', ' + res['message'] if res['status'] not in ('finished',) else ''})")

    log(f"training {len(configs)} runs in {workers} worker(s) on {dev} → {Path(root) / 'runs'}")
    trained = _map(_train_job, train_jobs, workers, said)
    outcomes = []
    for c, d, res in zip(configs, dirs, trained):
        o = Outcome(c, d, res["status"], res["message"], bool(res.get("trained")))
        if o.status in DONE:
            run_meta = store.load_checkpoint(d)[1]
            o.history = run_meta["history"]
            o.test_acc = o.history[-1]["test_acc"]
        outcomes.append(o)

    by_key = {o.config.run_key: o for o in outcomes}
    diag_jobs, diag_index = [], []
    for i, o in enumerate(outcomes):
        if o.status not in DONE:
            continue
        frozen = frozen_of(o.config) if frozen_of else None
        frozen_acc = by_key[frozen.run_key].test_acc if frozen and frozen.run_key in by_key else None
        diag_jobs.append(DiagnoseJob(o.config.to_dict(), str(o.run_dir), data_dir, str(dev), threads,
                                     asdict(thresholds), frozen_acc, n_eval,
                                     rho and o.config.control == "none"))
        diag_index.append(i)
    log(f"diagnosing {len(diag_jobs)} runs")
    reports = _map(_diagnose_job, diag_jobs, workers, lambda i, r: None)
    for i, rep in zip(diag_index, reports):
        if "error" in rep:
            outcomes[i].message += f"; diagnosis failed: {rep['error']}"
        else:
            outcomes[i].report = rep
    return outcomes


# -- the audit --------------------------------------------------------------------------------
def _mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.pstdev(vals) if len(vals) > 1 else 0.0)


def _median(values: Sequence[float]) -> float | None:
    """Median of the measured values (NaN = not measured); None when there are none."""
    vals = [v for v in values if not math.isnan(v)]
    return statistics.median(vals) if vals else None


def _deep(values: Sequence[Any] | None) -> float | None:
    """Mean over the deep residual positions l = 1 … L (every block output)."""
    if not values or len(values) < 2:
        return None
    vals = [_num(v) for v in values[1:]]
    return None if any(math.isnan(v) for v in vals) else statistics.fmean(vals)


def summarize_method(method: str, outcomes: Sequence[Outcome], thresholds: Thresholds) -> dict:
    """Seed-aggregated row of the audit table for one method (its main runs and controls)."""
    mine = [o for o in outcomes if o.config.method == method]
    main = [o for o in mine if o.config.control == "none"]
    frozen = [o for o in mine if o.config.control == "frozen"]
    shallow = [o for o in mine if o.config.control == "shallow"]
    diagnosed = [o for o in main if o.report]
    # (d) compares the same seeds: only seeds where both the run and its frozen control finished
    frozen_by_seed = {o.config.seed: o.test_acc for o in frozen if o.test_acc is not None}
    paired = [o for o in main if o.test_acc is not None and o.config.seed in frozen_by_seed]
    acc, acc_sd = _mean_std([o.test_acc for o in main if o.test_acc is not None])
    facc, facc_sd = _mean_std([frozen_by_seed[o.config.seed] for o in paired] or list(frozen_by_seed.values()))
    sacc, sacc_sd = _mean_std([o.test_acc for o in shallow if o.test_acc is not None])
    rep = lambda key: [_num(o.report[key]) for o in diagnosed]
    gammas = [o.report["gamma"] for o in diagnosed if o.report.get("gamma")]
    nulls = [o.report["null"] for o in diagnosed if o.report.get("null")]
    rhos = [o.report["rho"] for o in diagnosed if o.report.get("rho")]
    deep_rho = lambda key: _mean_std([statistics.fmean(_num(r[key]) for r in rs) for rs in rhos
                                      if all(r.get(key) is not None for r in rs)])

    counts = {k: sum(bool(o.report["flags"].get(k)) for o in diagnosed) for k in ("a", "b", "b_prime", "c")}
    flags: dict[str, bool | None] = {k: (counts[k] > 0 if diagnosed else None) for k in counts}
    depth_gap = (statistics.fmean(o.test_acc - frozen_by_seed[o.config.seed] for o in paired)
                 if paired else None)
    flags["d"] = None if depth_gap is None else depth_gap < thresholds.depth_margin - 1e-9
    reasons = []
    for k in ("a", "b", "b_prime", "c"):
        if flags[k]:
            first = next(o for o in diagnosed if o.report["flags"].get(k))
            sentence = next((s for s in first.report["reasons"] if s.startswith(FLAG_NAMES[k])), FLAG_NAMES[k])
            reasons.append(f"{sentence} [{counts[k]}/{len(diagnosed)} seeds; e.g. {first.config.label}]")
    if flags["d"]:
        reasons.append(f"(d) UNDERCUT: over {len(paired)} seed(s), accuracy is "
                       f"{100 * depth_gap:+.1f} points from the frozen-blocks control of the same "
                       f"seed, short of +{100 * thresholds.depth_margin:g}, so the headline accuracy "
                       "does not show that the trained blocks add anything.")
    failed = [o for o in main if o.status not in DONE or not o.report]

    def verdict(keys) -> str:
        if not diagnosed:
            return f"incomplete: no diagnosed run ({len(failed)}/{len(main)} failed)"
        fired = [FLAG_NAMES[k] for k in keys if flags.get(k)]
        return "walk back: " + ", ".join(fired) if fired else "trustworthy"

    mean_gamma = _mean_std([statistics.fmean(_num(g) for g in gs) for gs in gammas
                            if all(g is not None for g in gs)])[0]
    first_fire = {k: [(o.report.get("first_fire") or {}).get(k) for o in diagnosed]
                  for k in ("a", "b", "b_prime")}
    return {
        "method": method, "lam": main[0].config.lam if main else 0.0,
        "n_seeds": len(main), "n_diagnosed": len(diagnosed),
        "statuses": {o.config.seed: o.status for o in main},
        "failed": [{"label": o.config.label, "status": o.status, "message": o.message} for o in failed],
        "acc": acc, "acc_std": acc_sd, "frozen_acc": facc, "frozen_acc_std": facc_sd,
        "shallow_acc": sacc, "shallow_acc_std": sacc_sd, "depth_gap": depth_gap,
        "n_paired_with_frozen": len(paired),
        "h_L": _median([_num(o.report["residual_norms"][-1]) for o in diagnosed]),
        "g_L": _median([_num(o.report["bp_grad_norms"][-1]) for o in diagnosed]),
        "gain": _median(rep("readout_gain")), "max_growth": _median(rep("max_growth")),
        "stability_mid": _mean_std(rep("stability_mid"))[0],
        "gamma_layers": [_mean_std([_num(g[l]) for g in gammas])[0] for l in range(len(gammas[0]))] if gammas else None,
        "gamma_deep": _mean_std([_deep(g) for g in gammas])[0],
        "gamma_mean_all": mean_gamma,
        "gamma_interpretable": all(o.report.get("gamma_interpretable") for o in diagnosed) if gammas else None,
        "null_deep_mean": _mean_std([_deep(n["mean"]) for n in nulls])[0],
        "null_deep_std": _mean_std([_deep(n["std"]) for n in nulls])[0],
        "null_layers": ([_mean_std([_num(n["mean"][l]) for n in nulls])[0] for l in range(len(nulls[0]["mean"]))],
                        [_mean_std([_num(n["std"][l]) for n in nulls])[0] for l in range(len(nulls[0]["std"]))])
        if nulls else None,
        "rho_deep": deep_rho("method")[0], "rho_deep_std": deep_rho("method")[1],
        "rho_bp": deep_rho("bp")[0], "rho_random": deep_rho("random")[0],
        "rho_layers": {key: [_mean_std([_num(rs[i][key]) for rs in rhos])[0] for i in range(len(rhos[0]))]
                       for key in ("method", "bp", "random")} if rhos else None,
        "first_fire": first_fire,
        "flag_counts": counts, "flags": flags,
        "verdict": verdict(PROJECT_FLAGS), "paper_verdict": verdict(PAPER_FLAGS),
        "reasons": reasons,
    }


STRATEGIES = ("accuracy only", "accuracy + Γ", "full protocol")


def reporting_strategies(row: dict) -> dict[str, str]:
    """What each reporting strategy concludes for one method (SPEC §7, last row).

    accuracy only:  the reported accuracy stands — nothing is checked against it.
    accuracy + Γ:   the usual reading: accept when the credit's Γ, averaged over the residual
                    positions, is positive (it "aligns with backprop"); walk back otherwise.
    full protocol:  the project verdict ((a), (b′), (d)).
    """
    g = row.get("gamma_mean_all")
    if row["verdict"].startswith("incomplete"):
        return {s: "n/a (no run)" for s in STRATEGIES}
    return {"accuracy only": "accept",
            "accuracy + Γ": "n/a (no credit)" if g is None else ("accept" if g > 0 else "walk back"),
            "full protocol": "accept" if row["verdict"] == "trustworthy" else "walk back"}


def frozen_control_of(config: RunConfig) -> RunConfig | None:
    """The frozen-blocks control of the same method and seed (None for a control itself)."""
    if config.control != "none" or config.blocks == 0:
        return None
    return config.replace(trainable_blocks=0)


def audit(config: AuditConfig, log: Callable[[str], None] = print) -> dict:
    """Train, diagnose and tabulate an audit; writes <out>/audit.json and returns it."""
    out = Path(config.out)
    thresholds = Thresholds(**config.thresholds)
    runs = config.run_configs()
    t0 = time.perf_counter()
    outcomes = run_all(runs, out, data_dir=config.data_dir, device=config.device, jobs=config.jobs,
                       thresholds=thresholds, n_eval=config.eval_batches, frozen_of=frozen_control_of,
                       log=log)
    rows = [summarize_method(m, outcomes, thresholds) for m in config.methods]
    for row in rows:
        row["strategies"] = reporting_strategies(row)
    from .protocol import threshold_sensitivity
    reports = [o.report for o in outcomes if o.report and o.config.control == "none"]
    sensitivity = threshold_sensitivity(reports, thresholds)[0] if reports else None
    base = runs[0]
    result = {
        "creditaudit_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "header": _header(config, base),
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()},
        "thresholds": asdict(thresholds),
        "wall_time": time.perf_counter() - t0,
        "runs_trained_now": sum(o.trained for o in outcomes),
        "methods": rows,
        "strategy_totals": {s: sum(r["strategies"][s] == "walk back" for r in rows) for s in STRATEGIES},
        "sensitivity": sensitivity,
        "runs": [o.to_dict() for o in outcomes],
    }
    store.atomic_write_json(out / "audit.json", store.json_safe(result))
    return result


def _header(config: AuditConfig, base: RunConfig) -> str:
    preset = f"preset {config.preset}: " if config.preset else ""
    note = ""
    if config.preset == "quick":
        note = (f" ({config.epochs} epochs rather than the paper's 100, chosen so that the whole "
                "audit fits in about ten minutes on a 2-core CPU)")
    return (f"{preset}{config.dataset}, ResidualMLP d={base.width} L={base.blocks}, "
            f"{config.epochs} epochs{note}; seeds {', '.join(map(str, config.seeds))}; "
            f"controls: {', '.join(config.controls) or 'none'}; "
            f"{config.eval_batches} eval batches")


# -- the paper's other experiments ------------------------------------------------------------
def ladder(base: Sequence[RunConfig], out: Path, *, data_dir: str, device: str = "auto", jobs: int = 0,
           thresholds: Thresholds = Thresholds(), log: Callable[[str], None] = print) -> dict:
    """Depth ladder: accuracy vs the number of trainable blocks k = 0 … L (k = 0: the frozen
    control, k = L: the full run), per method; mean ± std over the seeds given."""
    configs = [c.replace(trainable_blocks=k) for c in base for k in range(c.blocks + 1)]
    outcomes = run_all(configs, out, data_dir=data_dir, device=device, jobs=jobs,
                       thresholds=thresholds, rho=False, log=log)
    rows = []
    for method in dict.fromkeys(c.method for c in base):
        mine = [o for o in outcomes if o.config.method == method]
        for k in range(base[0].blocks + 1):
            at_k = [o for o in mine if len(o.config.trainable_block_ids) == k]
            acc, sd = _mean_std([o.test_acc for o in at_k])
            rows.append({"method": method, "k": k, "acc": acc, "acc_std": sd,
                         "h_L": _median([_num(o.report["residual_norms"][-1]) for o in at_k if o.report]),
                         "statuses": [o.status for o in at_k]})
    result = {"experiment": "ladder", "creditaudit_version": __version__,
              "base": [c.to_dict() for c in base], "rows": rows,
              "runs": [o.to_dict() for o in outcomes]}
    store.atomic_write_json(Path(out) / "ladder.json", store.json_safe(result))
    return result


PENALTY_LAMBDAS = (0.0, 1e-4, 1e-3, 1e-2, 1e-1)


def penalty_sweep(base: Sequence[RunConfig], out: Path, *, lambdas: Sequence[float] = PENALTY_LAMBDAS,
                  data_dir: str, device: str = "auto", jobs: int = 0,
                  thresholds: Thresholds = Thresholds(), log: Callable[[str], None] = print) -> dict:
    """dfa-penalty over λ (λ = 0 is plain DFA): accuracy, ‖h_L‖, ‖g_L‖, readout gain, deep Γ with
    its fresh-feedback null, deep ρ with its controls; `base` gives the seeds and the schedule."""
    configs = [c.replace(method="dfa-penalty", lam=float(lam)) for c in base for lam in lambdas]
    outcomes = run_all(configs, out, data_dir=data_dir, device=device, jobs=jobs,
                       thresholds=thresholds, rho=True, log=log)
    rows = []
    for lam in lambdas:
        at = [o for o in outcomes if o.config.lam == float(lam)]
        row = summarize_method("dfa-penalty", at, thresholds)
        row["lam"] = float(lam)
        rows.append(row)
    result = {"experiment": "penalty-sweep", "creditaudit_version": __version__,
              "lambdas": list(lambdas), "base": [c.to_dict() for c in base], "rows": rows,
              "runs": [o.to_dict() for o in outcomes]}
    store.atomic_write_json(Path(out) / "penalty_sweep.json", store.json_safe(result))
    return result


def identity_check_experiment(config: RunConfig, seeds: Sequence[int], out: Path, *,
                              data_dir: str, n_samples: int = 128) -> dict:
    """Frozen-init identity check (SPEC §6) of the run's architecture on real inputs."""
    from .metrics import identity_check
    from .train import build_model
    data = load_dataset(config.dataset, data_dir, "cpu")
    x, _ = data.eval_batch(0, n_samples)
    check = identity_check(lambda seed: build_model(config.replace(seed=seed), data), seeds, x)
    result = {"experiment": "identity-check", "creditaudit_version": __version__,
              "config": config.to_dict(), "seeds": list(seeds), "n_samples": len(x),
              **check.to_dict()}
    store.atomic_write_json(Path(out) / "identity_check.json", store.json_safe(result))
    return result
