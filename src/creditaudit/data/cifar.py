"""CIFAR-10 and CIFAR-100 from the standard python-pickle batches, with checksummed download.

Format (https://www.cs.toronto.edu/~kriz/cifar.html). Each batch file is a Python 2 pickle
(protocol 2) of a dict with byte-string keys:

    b"data"                      uint8 ndarray (N, 3072): 1024 red, then 1024 green, then 1024 blue
                                 values of a 32×32 image in row-major order, i.e. (N, 3, 32, 32)
    b"labels" / b"fine_labels"   list of N ints in [0, 10) for CIFAR-10 / [0, 100) for CIFAR-100

    <data_dir>/cifar-10-batches-py/  data_batch_1 … data_batch_5 (10 000 each), test_batch (10 000)
    <data_dir>/cifar-100-python/     train (50 000), test (10 000)

Pickles can run arbitrary code, so the batches are read with an unpickler that resolves only the
three numpy globals an ndarray needs (`_reconstruct`, `ndarray`, `dtype`) and refuses every other
global. The class-name files (`batches.meta`, `meta`) are not needed and not read.
"""
from __future__ import annotations

import http.client
import pickle
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from ..errors import CreditAuditError
from .download import fetch
from .tensors import ArrayDataset

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy < 2 has no numpy._core
    from numpy.core.multiarray import _reconstruct

CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

CIFAR100_FOLDER = "cifar-100-python"
CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
CIFAR100_MD5 = "eb9058c3a382ffc7106e4002c42a8d85"
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

# The only globals a pickled uint8 ndarray needs. Files written by Python 2 / numpy 1 name the
# module numpy.core.multiarray, files written under numpy 2 numpy._core.multiarray.
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays; any other global is refused, never imported."""

    def find_class(self, module: str, name: str):
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refused global {module}.{name} (a CIFAR batch holds only numpy arrays)") from None


def load_cifar10(data_dir: Path, download: bool = True) -> ArrayDataset:
    """CIFAR-10: 50 000 / 10 000 uint8 images (N, 3, 32, 32), 10 classes, crop + flip augmentation."""
    return _load_cifar("cifar10", Path(data_dir), CIFAR10_FOLDER, CIFAR10_URL, CIFAR10_MD5, download,
                       train_files=[f"data_batch_{i}" for i in range(1, 6)], test_files=["test_batch"],
                       label_key=b"labels", n_classes=10, mean=CIFAR10_MEAN, std=CIFAR10_STD)


def load_cifar100(data_dir: Path, download: bool = True) -> ArrayDataset:
    """CIFAR-100 (fine labels): 50 000 / 10 000 uint8 images (N, 3, 32, 32), 100 classes."""
    return _load_cifar("cifar100", Path(data_dir), CIFAR100_FOLDER, CIFAR100_URL, CIFAR100_MD5,
                       download, train_files=["train"], test_files=["test"],
                       label_key=b"fine_labels", n_classes=100, mean=CIFAR100_MEAN, std=CIFAR100_STD)


def _load_cifar(name: str, data_dir: Path, folder: str, url: str, md5: str, download: bool, *,
                train_files: list[str], test_files: list[str], label_key: bytes, n_classes: int,
                mean: tuple[float, ...], std: tuple[float, ...]) -> ArrayDataset:
    root = data_dir / folder
    if not root.is_dir():
        if not download:
            raise CreditAuditError(_missing_message(data_dir, folder, url, md5))
        download_cifar(data_dir, folder, url, md5)
    x_train, y_train = _read_batches(root, train_files, label_key, n_classes)
    x_test, y_test = _read_batches(root, test_files, label_key, n_classes)
    as_channel = lambda v: torch.tensor(v, dtype=torch.float32).view(3, 1, 1)
    return ArrayDataset(name, x_train, y_train, x_test, y_test, n_classes=n_classes,
                        mean=as_channel(mean), std=as_channel(std), augment=True, pad=4,
                        source=f"folder {root}")


def _read_batches(root: Path, files: list[str], label_key: bytes, n_classes: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate batch files → uint8 images (N, 3, 32, 32) and int64 labels (N,)."""
    xs, ys = zip(*(_read_batch(root / f, label_key, n_classes) for f in files))
    return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))


def _read_batch(path: Path, label_key: bytes, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """One pickled batch → (uint8 (N, 3, 32, 32), int64 (N,)), validated."""
    fix = f"delete {path.parent} and download it again (or re-extract the archive)"
    if not path.is_file():
        raise CreditAuditError(f"CIFAR batch file {path} is missing; {fix}")
    try:
        with open(path, "rb") as f:
            batch = _ArrayOnlyUnpickler(f, encoding="bytes").load()
    except OSError as exc:
        raise CreditAuditError(f"cannot read CIFAR batch file {path} ({exc}); {fix}") from exc
    except Exception as exc:  # any failure to unpickle means the file is corrupt or foreign
        raise CreditAuditError(f"CIFAR batch file {path} is corrupt or not a CIFAR python batch "
                               f"({type(exc).__name__}: {exc}); {fix}") from exc
    data = batch.get(b"data") if isinstance(batch, dict) else None
    labels = batch.get(label_key) if isinstance(batch, dict) else None
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2
            and data.shape[1] == 3 * 32 * 32 and isinstance(labels, list)):
        raise CreditAuditError(f"CIFAR batch file {path} does not hold a uint8 {label_key.decode()!r} "
                               f"batch of shape (N, 3072) with a label list; {fix}")
    y = np.asarray(labels)
    if not (y.shape == (len(data),) and y.dtype.kind in "iu" and ((y >= 0) & (y < n_classes)).all()):
        raise CreditAuditError(f"CIFAR batch file {path}: expected {len(data)} integer labels in "
                               f"[0, {n_classes}); {fix}")
    return data.reshape(-1, 3, 32, 32), y.astype(np.int64)


def _missing_message(data_dir: Path, folder: str, url: str, md5: str) -> str:
    return (f"CIFAR data not found: expected the python batches in {data_dir / folder}. "
            f"Download {url} (md5 {md5}) and extract it under --data-dir (currently {data_dir}), "
            f"so that {data_dir / folder} exists.")


def download_cifar(data_dir: Path, folder: str, url: str, md5: str) -> Path:
    """Download the tar.gz at `url`, check its md5, and extract `folder` into `data_dir` atomically.

    The archive is streamed to a temporary file in `data_dir` and hashed on the way; a checksum
    mismatch deletes it and raises. Extraction goes to a temporary folder (regular files and
    folders only; absolute paths and `..` are rejected) that is renamed to `data_dir/folder` only
    once complete, so an interrupted download never leaves a half-filled dataset behind.
    Returns `data_dir / folder`; network failures raise CreditAuditError with the manual route.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    print(f"downloading {url} to {data_dir} ...", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=data_dir, prefix=".download-") as tmp:
        archive = Path(tmp) / "archive.tar.gz"
        try:
            digest = fetch(url, archive)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise CreditAuditError(f"could not download {url} ({exc}). "
                                   + _missing_message(data_dir, folder, url, md5)) from exc
        if digest != md5:  # leaving the with-block deletes the temporary folder and the archive
            raise CreditAuditError(f"checksum mismatch for {url}: md5 {digest}, expected {md5}; "
                                   "the download is corrupt or was altered, and has been deleted. "
                                   "Try again, or " + _missing_message(data_dir, folder, url, md5))
        extracted = Path(tmp) / "extracted"
        _extract_safely(archive, extracted, url)
        if not (extracted / folder).is_dir():
            raise CreditAuditError(f"the archive from {url} has no {folder}/ folder")
        (extracted / folder).replace(data_dir / folder)
    return data_dir / folder


def _extract_safely(archive: Path, dest: Path, url: str) -> None:
    """Extract regular files and folders of a tar.gz under `dest`, refusing unsafe member names."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = tar.getmembers()
            for m in members:
                parts = PurePosixPath(m.name).parts
                if m.name.startswith(("/", "\\")) or ".." in parts or not (m.isfile() or m.isdir()):
                    raise CreditAuditError(f"refusing to extract the archive from {url}: unsafe "
                                           f"member {m.name!r} (absolute path, '..', or a link)")
            for m in members:
                target = dest.joinpath(*PurePosixPath(m.name).parts)
                if m.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(m) as src, open(target, "wb") as out:
                        shutil.copyfileobj(src, out)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise CreditAuditError(f"the archive from {url} is not a readable tar.gz ({exc})") from exc
