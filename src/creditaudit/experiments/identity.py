"""The frozen-init identity check of a run's architecture on real inputs, over seeds;
writes <out>/identity_check.json."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from .. import __version__, store
from ..config import RunConfig
from ..data import load_dataset
from ..metrics import identity_check
from ..runs import build_model


def identity_check_experiment(config: RunConfig, seeds: Sequence[int], out: Path, *,
                              data_dir: str, device: str | torch.device = "cpu",
                              n_samples: int = 128) -> dict:
    """The check on the first `n_samples` test inputs, with every model built on `device`."""
    data = load_dataset(config.dataset, data_dir, device)
    x, _ = data.eval_batch(0, n_samples)
    check = identity_check(lambda seed: build_model(config.replace(seed=seed), data.input_shape,
                                                    data.n_classes).to(device), seeds, x)
    result = {"experiment": "identity-check", "creditaudit_version": __version__,
              "config": config.to_dict(), "seeds": list(seeds), "n_samples": len(x),
              **check.to_dict()}
    store.write_sealed_json(Path(out) / "identity_check.json", store.json_safe(result))
    return store.read_sealed_json(Path(out) / "identity_check.json", "identity-check result")
