"""The depth ladder: accuracy vs the number of trainable blocks k = 0 … L (k = 0 is the frozen
control, k = L the full run), per method; writes <out>/ladder.json."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .. import __version__, store
from ..config import AuditConfig, RunConfig, default
from ..store import json_number as _num
from ..verdict import Thresholds
from .common import Execution, mean_std, median_of, run_all


def ladder(base: Sequence[RunConfig], out: Path, *, execution: Execution = Execution(),
           thresholds: Thresholds = Thresholds(), n_eval: int = default(AuditConfig, "eval_batches"), progress: bool = True) -> dict:
    """Every base config at k = 0 … L trainable blocks, diagnosed on `n_eval` eval batches."""
    configs = [c.replace(trainable_blocks=k) for c in base for k in range(c.blocks + 1)]
    outcomes = run_all(configs, out, execution=execution, thresholds=thresholds, n_eval=n_eval,
                       rho=False, progress=progress)
    rows = []
    for method in dict.fromkeys(c.method for c in base):
        mine = [o for o in outcomes if o.config.method == method]
        for k in range(base[0].blocks + 1):
            at_k = [o for o in mine if len(o.config.trainable_block_ids) == k]
            acc, sd = mean_std([o.test_acc for o in at_k if o.status == "finished"])
            rows.append({"method": method, "k": k, "acc": acc, "acc_std": sd,
                         "per_seed": {str(o.config.seed): o.test_acc for o in at_k},
                         "h_L": median_of([_num(o.report["residual_norms"][-1]) for o in at_k if o.report]),
                         "statuses": [o.status for o in at_k],
                         "epochs": [f"{o.epochs_completed}/{o.config.epochs}" for o in at_k]})
    result = {"experiment": "ladder", "creditaudit_version": __version__,
              "base": [c.to_dict() for c in base], "rows": rows,
              "runs": [o.to_dict() for o in outcomes]}
    store.write_sealed_json(Path(out) / "ladder.json", store.json_safe(result))
    return store.read_sealed_json(Path(out) / "ladder.json", "ladder result")
