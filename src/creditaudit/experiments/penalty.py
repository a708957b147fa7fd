"""The penalty sweep: a method with a residual penalty over its λ values (λ = 0 is the method
without it), each with its frozen-blocks control (λ acts only on trainable blocks, so one control,
trained once, serves every λ: `runs.canonical_control`): accuracy, ‖h_L‖, ‖g_L‖, readout gain, deep Γ
with its fresh-feedback null, deep ρ, verdict. Writes <out>/penalty_sweep.json."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .. import __version__, store
from ..config import PENALTY_OPTION, AuditConfig, RunConfig, default
from ..depth import decide_audit
from ..verdict import Thresholds
from .audit import frozen_control_of, method_evidence, summarize_method
from .common import Execution, dataset, run_all


def penalty_sweep(base: Sequence[RunConfig], out: Path, *, lambdas: Sequence[float],
                  execution: Execution = Execution(), thresholds: Thresholds = Thresholds(),
                  n_eval: int = default(AuditConfig, "eval_batches"), progress: bool = True) -> dict:
    """`base`: one config per seed of the swept method (its schedule, model and other options)."""
    mains = [c.replace(options={**c.options, PENALTY_OPTION: float(lam)}) for c in base for lam in lambdas]
    configs = []
    for c in mains:
        configs.append(c)
        frozen = frozen_control_of(c)
        if frozen is not None and frozen not in configs:
            configs.append(frozen)
    outcomes = run_all(configs, out, execution=execution, thresholds=thresholds, n_eval=n_eval,
                       rho=True, frozen_of=frozen_control_of, progress=progress)
    rows = []
    by_key = {o.config.run_key: o for o in outcomes}
    at_lam = {}
    for lam in lambdas:
        mains_at = [o for o in outcomes if o.config.control == "none" and o.config.lam == float(lam)]
        controls = [by_key[f.run_key] for f in (frozen_control_of(o.config) for o in mains_at)
                    if f is not None and f.run_key in by_key]     # one control may serve every λ
        at_lam[lam] = mains_at + list({id(o): o for o in controls}.values())
    # (d) decided for every λ together, as in an audit: one recipe, so the seed spread is pooled
    # over every λ (each with its controls), and Holm over the λ values tested
    n_test = len(dataset(base[0].dataset, execution.data_dir, "cpu").y_test)
    pairs = {lam: [e.paired for e in method_evidence(base[0].method, at_lam[lam], n_test) if e.paired is not None]
             for lam in lambdas}
    decisions = decide_audit(pairs, thresholds.depth_margin, {lam: "one recipe" for lam in lambdas})
    for lam in lambdas:
        row = summarize_method(base[0].method, at_lam[lam], thresholds, decisions[lam], n_test)
        row["lam"] = float(lam)
        rows.append(row)
    result = {"experiment": "penalty-sweep", "creditaudit_version": __version__,
              "lambdas": list(lambdas), "base": [c.to_dict() for c in base], "rows": rows,
              "runs": [o.to_dict() for o in outcomes]}
    store.write_sealed_json(Path(out) / "penalty_sweep.json", store.json_safe(result))
    return store.read_sealed_json(Path(out) / "penalty_sweep.json", "penalty-sweep result")
