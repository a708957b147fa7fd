"""MNIST and Fashion-MNIST from IDX files (LeCun's format), plain or gzipped, from a local folder.

IDX format: a 4-byte magic number 0x00 0x00 <type> <ndim>, then `ndim` big-endian uint32 sizes,
then the values in row-major order. Both datasets use type 0x08 (unsigned byte) only:

    train-images-idx3-ubyte  (60000, 28, 28)      train-labels-idx1-ubyte  (60000,)
    t10k-images-idx3-ubyte   (10000, 28, 28)      t10k-labels-idx1-ubyte   (10000,)

each optionally gzipped (`.gz`, as distributed). Folders searched, the first holding any of the
four files wins:

    MNIST           <data_dir>/mnist/, <data_dir>/MNIST/raw/ (torchvision's layout), <data_dir>/
    Fashion-MNIST   <data_dir>/fashion-mnist/, <data_dir>/FashionMNIST/raw/

(Fashion-MNIST uses the same file names as MNIST, so it is never looked for in <data_dir> itself.)
Nothing is downloaded; a missing file raises CreditAuditError saying where to put it.
"""
from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path

import numpy as np
import torch

from ..errors import CreditAuditError
from .tensors import ArrayDataset

IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530
_UBYTE = 0x08


def load_mnist(data_dir: Path, download: bool = True) -> ArrayDataset:
    """MNIST: uint8 images (N, 1, 28, 28), 60 000 / 10 000, 10 classes, no augmentation.

    `download` is accepted for the common loader signature; MNIST is only read from disk.
    """
    return _load_idx_dataset("mnist", "MNIST", Path(data_dir), ("mnist", "MNIST/raw", "."),
                             MNIST_MEAN, MNIST_STD, source="http://yann.lecun.com/exdb/mnist/")


def load_fashion_mnist(data_dir: Path, download: bool = True) -> ArrayDataset:
    """Fashion-MNIST: uint8 images (N, 1, 28, 28), 60 000 / 10 000, 10 classes, no augmentation.

    `download` is accepted for the common loader signature; Fashion-MNIST is only read from disk.
    """
    return _load_idx_dataset("fashion-mnist", "Fashion-MNIST", Path(data_dir),
                             ("fashion-mnist", "FashionMNIST/raw"), FASHION_MEAN, FASHION_STD,
                             source="https://github.com/zalandoresearch/fashion-mnist")


def _load_idx_dataset(name: str, title: str, data_dir: Path, folders: tuple[str, ...],
                      mean: float, std: float, source: str) -> ArrayDataset:
    candidates = [data_dir / f for f in folders]
    folder = next((d for d in candidates if any(_locate(d, f) for f in IDX_FILES)), None)
    if folder is None:
        raise CreditAuditError(
            f"{title} not found: put the four IDX files {', '.join(IDX_FILES)} (plain or .gz, from "
            f"{source}) in {candidates[0]}; looked in {', '.join(map(str, candidates))}. "
            f"{title} is not downloaded automatically; --data-dir sets the data folder.")
    x_train, y_train = _read_split(folder, "train")
    x_test, y_test = _read_split(folder, "t10k")
    as_channel = lambda v: torch.tensor([v], dtype=torch.float32).view(1, 1, 1)
    return ArrayDataset(name, x_train, y_train, x_test, y_test, n_classes=10,
                        mean=as_channel(mean), std=as_channel(std), augment=False,
                        source=f"folder {folder}")


def _read_split(folder: Path, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`<prefix>-images-idx3-ubyte` + labels → uint8 (N, 1, 28, 28) and int64 (N,), validated."""
    images_path = _require(folder, f"{prefix}-images-idx3-ubyte")
    labels_path = _require(folder, f"{prefix}-labels-idx1-ubyte")
    images, labels = read_idx(images_path, ndim=3), read_idx(labels_path, ndim=1)
    if len(images) == 0:
        raise CreditAuditError(f"{images_path} holds 0 images (its header says so): a split to train or "
                               "test on needs samples; replace it with the original file")
    if images.shape[1:] != (28, 28):
        raise CreditAuditError(f"{images_path}: expected 28×28 images, found {images.shape[1:]}")
    if len(labels) != len(images):
        raise CreditAuditError(f"{labels_path} has {len(labels)} labels but {images_path} has "
                               f"{len(images)} images; replace the mismatched file")
    if len(labels) and labels.max() >= 10:
        raise CreditAuditError(f"{labels_path}: labels must lie in [0, 10), found {labels.max()}")
    return torch.from_numpy(images[:, None]), torch.from_numpy(labels.astype(np.int64))


def _locate(folder: Path, stem: str) -> Path | None:
    """`folder/stem` or `folder/stem.gz`, whichever exists (plain first)."""
    return next((p for p in (folder / stem, folder / f"{stem}.gz") if p.is_file()), None)


def _require(folder: Path, stem: str) -> Path:
    path = _locate(folder, stem)
    if path is None:
        raise CreditAuditError(f"{folder / stem}[.gz] is missing; all four IDX files "
                               f"({', '.join(IDX_FILES)}) must be in {folder}")
    return path


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """An unsigned-byte IDX file (gzipped if it ends in .gz) with `ndim` dimensions → uint8 array."""
    fix = "the file is corrupt, truncated or of another kind; replace it with the original"
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise CreditAuditError(f"cannot read {path} ({exc}); {fix}") from exc
    magic = bytes([0, 0, _UBYTE, ndim])
    if raw[:4] != magic:
        raise CreditAuditError(f"{path}: IDX magic number is {raw[:4].hex()}, expected "
                               f"{magic.hex()} (unsigned bytes, {ndim} dimensions); {fix}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise CreditAuditError(f"{path}: the IDX header is cut short; {fix}")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    size = math.prod(dims)  # exact: np.prod would wrap around in int64 for a corrupt header
    if len(raw) != header + size:
        raise CreditAuditError(f"{path}: the header promises {dims} = {size} bytes "
                               f"of data, the file holds {len(raw) - header}; {fix}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims).copy()
