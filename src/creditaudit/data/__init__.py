"""Datasets by name. Each loader returns an `ArrayDataset` of whole tensors (see tensors.py).

    load_dataset("mnist1d")                      # generated locally, cached in data_dir
    load_dataset("cifar10", data_dir="./data")   # cifar-10-batches-py/ under data_dir
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CreditAuditError
from .checks import LabelProbeWarning, check_learnable, warn_if_labels_unpredicted
from .cifar import load_cifar10, load_cifar100
from .generated import load_digits, load_mnist1d, load_synthetic
from .idx import load_fashion_mnist, load_fashion_mnist_unit, load_mnist, load_mnist_unit
from .tensors import ArrayDataset, random_crop_flip

DEFAULT_DATA_DIR = Path("data")
LOADERS = {
    "mnist1d": load_mnist1d,
    "digits": load_digits,
    "synthetic": load_synthetic,
    "cifar10": load_cifar10,
    "cifar100": load_cifar100,
    "mnist": load_mnist,
    "mnist-01": load_mnist_unit,              # the same files, pixels in [0, 1] (not standardised)
    "fashion-mnist": load_fashion_mnist,
    "fashion-mnist-01": load_fashion_mnist_unit,
}
DATASET_NAMES = tuple(LOADERS)     # --help, validation and the docs take the names from here


def load_dataset(name: str, data_dir: str | Path | None = None, device: str | torch.device = "cpu",
                 download: bool = True, label_probe: bool = True) -> ArrayDataset:
    """Load a dataset by name onto `device`; user-fixable problems raise CreditAuditError.
    Its content digest (part of every run's key) is computed here, once, on the CPU copy, and data
    that cannot carry a verdict by construction (one class, constant, non-finite or overflowing
    inputs: checks.py) are refused here. Labels a linear probe cannot tell from random are only
    warned about (`LabelProbeWarning`), unless `label_probe` is False (`--no-label-probe`)."""
    if name not in LOADERS:
        raise CreditAuditError(
            f"unknown dataset {name!r}; choose one of: {', '.join(DATASET_NAMES)}")
    data = LOADERS[name](Path(data_dir) if data_dir else DEFAULT_DATA_DIR, download=download)
    data.digest                     # cached on the object; `to` carries it to every device copy
    check_learnable(data, data.describe())     # before any training or diagnosis reads them
    if label_probe:
        warn_if_labels_unpredicted(data, data.describe())
    return data.to(device)


__all__ = ["ArrayDataset", "DATASET_NAMES", "LabelProbeWarning", "warn_if_labels_unpredicted", "LOADERS", "DEFAULT_DATA_DIR", "load_dataset", "random_crop_flip"]
