"""The frozen-init identity check of a run's architecture on real inputs, over seeds;
writes <out>/identity_check.json."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from .. import __version__, store
from ..config import RunConfig
from ..data import load_dataset
from ..errors import CreditAuditError
from ..metrics import identity_check
from ..runs import build_model


def identity_check_experiment(config: RunConfig, seeds: Sequence[int], out: Path, *,
                              data_dir: str, device: str | torch.device = "cpu",
                              n_samples: int = 128) -> dict:
    """The check on the first `n_samples` test inputs, with every model built on `device`.

    Seeds listed twice are refused (as `audit` refuses them), and so is an `out` holding the
    identity check of another configuration (architecture, width, seeds, samples…): a report is
    never silently replaced; the same check run again may rewrite it."""
    seeds = list(seeds)
    if len(set(seeds)) != len(seeds):
        raise CreditAuditError(f"--seeds lists a seed more than once ({seeds}); list each once")
    path = Path(out) / "identity_check.json"
    data = load_dataset(config.dataset, data_dir, device, label_probe=False)   # no label is read
    x, _ = data.eval_batch(0, n_samples)
    if path.exists():
        old = store.read_sealed_json(path, "identity-check result")
        now = store.json_safe({"config": config.to_dict(), "seeds": seeds, "n_samples": len(x)})
        differ = [k for k in now if store.json_safe(old.get(k)) != now[k]]
        if differ:
            raise CreditAuditError(f"{out} already holds the identity check of another configuration "
                                   f"(its {', '.join(differ)} differ); give this one its own --out, or "
                                   "delete that folder to replace it")
    check = identity_check(lambda seed: build_model(config.replace(seed=seed), data.input_shape,
                                                    data.n_classes).to(device), seeds, x)
    result = {"experiment": "identity-check", "creditaudit_version": __version__,
              "config": config.to_dict(), "seeds": seeds, "n_samples": len(x),
              **check.to_dict()}
    store.write_sealed_json(path, store.json_safe(result))
    return store.read_sealed_json(path, "identity-check result")
