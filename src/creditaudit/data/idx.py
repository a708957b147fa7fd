"""MNIST and Fashion-MNIST from IDX files (LeCun's format), plain or gzipped, with checksummed download.

IDX format: a 4-byte magic number 0x00 0x00 <type> <ndim>, then `ndim` big-endian uint32 sizes,
then the values in row-major order. Both datasets use type 0x08 (unsigned byte) only:

    train-images-idx3-ubyte  (60000, 28, 28)      train-labels-idx1-ubyte  (60000,)
    t10k-images-idx3-ubyte   (10000, 28, 28)      t10k-labels-idx1-ubyte   (10000,)

each optionally gzipped (`.gz`, as distributed). Folders searched, the first holding any of the
four files wins:

    MNIST           <data_dir>/mnist/, <data_dir>/MNIST/raw/ (torchvision's layout), <data_dir>/
    Fashion-MNIST   <data_dir>/fashion-mnist/, <data_dir>/FashionMNIST/raw/

(Fashion-MNIST uses the same file names as MNIST, so it is never looked for in <data_dir> itself.)
A missing file is downloaded as `<name>.gz` into that folder (the first one when none exists),
mirror after mirror, and kept only if its md5 is the published one (`gz_md5`); with
download=False a missing file raises CreditAuditError naming the folder and the URLs.

Every file of the official shape is checked, downloaded or put there by hand, plain or
recompressed, against the md5 of the official file's decompressed bytes (`raw_md5`): a corrupt
file, or the other dataset's file under the same name, is refused. A file of any other shape
(a subset you cut, the tests' tiny files) is not one of the official files and is read unchecked;
`describe()` says so, and the data digest in every run's key records what it held.
"""
from __future__ import annotations

import gzip
import hashlib
import http.client
import math
import os
import sys
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import CreditAuditError
from .download import fetch
from .tensors import ArrayDataset

IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
OFFICIAL_SHAPES = {"train-images-idx3-ubyte": (60000, 28, 28), "train-labels-idx1-ubyte": (60000,),
                   "t10k-images-idx3-ubyte": (10000, 28, 28), "t10k-labels-idx1-ubyte": (10000,)}
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530
_UBYTE = 0x08


@dataclass(frozen=True)
class IdxSource:
    """Where one IDX dataset lives on disk and online, and the md5s that identify its files."""
    name: str                   # the dataset's name in LOADERS
    title: str                  # for messages
    folders: tuple[str, ...]    # searched under data_dir in order; the first holding a file is used
    mirrors: tuple[str, ...]    # base URLs, tried in order; each serves <file>.gz
    gz_md5: dict[str, str]      # md5 of each official <file>.gz, as published
    raw_md5: dict[str, str]     # md5 of each official file's decompressed bytes
    mean: float
    std: float


# gz_md5: as published with LeCun's files (and in torchvision). raw_md5: the md5 of each file
# decompressed from a .gz whose md5 matched gz_md5, except train-images', whose .gz was not at
# hand when these were computed: its value is the one several independent loaders list for the
# extracted file (they list the other three exactly as computed here).
MNIST = IdxSource(
    "mnist", "MNIST", ("mnist", "MNIST/raw", "."),
    ("https://ossci-datasets.s3.amazonaws.com/mnist/",
     "https://storage.googleapis.com/cvdf-datasets/mnist/",
     "http://yann.lecun.com/exdb/mnist/"),
    gz_md5={"train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432",
            "t10k-images-idx3-ubyte": "9fb629c4189551a2d022fa330f9573f3",
            "t10k-labels-idx1-ubyte": "ec29112dd5afa0611ce80d1b7f02629c"},
    raw_md5={"train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
             "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
             "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
             "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637"},
    mean=MNIST_MEAN, std=MNIST_STD)

# gz_md5: the Fashion-MNIST README (github.com/zalandoresearch/fashion-mnist, "Get the Data").
# raw_md5: the md5 of each file decompressed from a .gz whose md5 matched gz_md5.
FASHION_MNIST = IdxSource(
    "fashion-mnist", "Fashion-MNIST", ("fashion-mnist", "FashionMNIST/raw"),
    ("https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
     "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"),
    gz_md5={"train-images-idx3-ubyte": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train-labels-idx1-ubyte": "25c81989df183df01b3e8a0aad5dffbe",
            "t10k-images-idx3-ubyte": "bef4ecab320f06d8554ea6380940ec79",
            "t10k-labels-idx1-ubyte": "bb300cfdad3c16e7a12a480ee83cd310"},
    raw_md5={"train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
             "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
             "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
             "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965"},
    mean=FASHION_MEAN, std=FASHION_STD)


def load_mnist(data_dir: Path, download: bool = True) -> ArrayDataset:
    """MNIST: uint8 images (N, 1, 28, 28), 60 000 / 10 000, 10 classes, no augmentation; the
    network sees pixels standardised with MNIST's mean and std."""
    return _load_idx_dataset(MNIST, Path(data_dir), download)


def load_mnist_unit(data_dir: Path, download: bool = True) -> ArrayDataset:
    """"mnist-01": the same files as "mnist", and the network sees pixels in [0, 1] (x / 255, not
    standardised), as torchvision's ToTensor gives them and most reference codes train on."""
    return _load_idx_dataset(MNIST, Path(data_dir), download, standardise=False)


def load_fashion_mnist(data_dir: Path, download: bool = True) -> ArrayDataset:
    """Fashion-MNIST: uint8 images (N, 1, 28, 28), 60 000 / 10 000, 10 classes, no augmentation;
    standardised with Fashion-MNIST's mean and std."""
    return _load_idx_dataset(FASHION_MNIST, Path(data_dir), download)


def load_fashion_mnist_unit(data_dir: Path, download: bool = True) -> ArrayDataset:
    """"fashion-mnist-01": the Fashion-MNIST files, pixels in [0, 1] (x / 255, not standardised)."""
    return _load_idx_dataset(FASHION_MNIST, Path(data_dir), download, standardise=False)


# the name a dataset read with pixels in [0, 1] goes by: "<name>-01" (its digest differs from the
# standardised one's, so its runs are other runs)
UNIT_SUFFIX = "-01"


def _load_idx_dataset(src: IdxSource, data_dir: Path, download: bool, standardise: bool = True) -> ArrayDataset:
    candidates = [data_dir / f for f in src.folders]
    folder = next((d for d in candidates if any(_locate(d, f) for f in IDX_FILES)), candidates[0])
    for stem in IDX_FILES:       # a folder where a file belongs is the user's to move, not a download
        blocked = [p for p in (folder / stem, folder / f"{stem}.gz") if p.exists() and not p.is_file()]
        if blocked and _locate(folder, stem) is None:
            raise CreditAuditError(f"{blocked[0]} is a folder, not {src.title}'s IDX file; move it "
                                   f"away and put the file {stem}[.gz] there, or point --data-dir elsewhere")
    missing = [stem for stem in IDX_FILES if _locate(folder, stem) is None]
    if missing and not download:
        raise CreditAuditError(_missing_message(src, folder, missing, candidates))
    paths = {stem: _locate(folder, stem) or download_idx_file(src, folder, stem) for stem in IDX_FILES}
    (x_train, y_train), train_checked = _read_split(src, paths, "train")
    (x_test, y_test), test_checked = _read_split(src, paths, "t10k")
    checked = ("official files, md5 checked" if train_checked and test_checked
               else "not the official files' sizes, so not md5-checked")
    as_channel = lambda v: torch.tensor([v], dtype=torch.float32).view(1, 1, 1)
    if not standardise:        # `prepare` scales uint8 pixels to [0, 1] and, without a mean, stops there
        return ArrayDataset(src.name + UNIT_SUFFIX, x_train, y_train, x_test, y_test, n_classes=10,
                            augment=False, source=f"folder {folder}, {checked}, pixels in [0, 1]")
    return ArrayDataset(src.name, x_train, y_train, x_test, y_test, n_classes=10,
                        mean=as_channel(src.mean), std=as_channel(src.std), augment=False,
                        source=f"folder {folder}, {checked}")


def _missing_message(src: IdxSource, folder: Path, missing: list[str], candidates: list[Path]) -> str:
    where = ", ".join(map(str, candidates))
    urls = ", ".join(f"{src.mirrors[0]}{stem}.gz (md5 {src.gz_md5[stem]})" for stem in missing)
    names = ", ".join(f"{stem}[.gz]" for stem in missing)
    return (f"{src.title} not found: {names} missing in {folder} (looked in {where}); put the "
            f"files there (plain or .gz): {urls}. --data-dir sets the data folder.")


def download_idx_file(src: IdxSource, folder: Path, stem: str) -> Path:
    """Download `<stem>.gz` into `folder`, keeping it only if its md5 is the published one.

    Each mirror in turn is streamed into a temporary file in `folder` and hashed on the way; a
    mirror that fails or serves other bytes is skipped, and the temporary file deleted, so that
    `folder/<stem>.gz` appears (by an atomic rename) only once verified. When no mirror gives
    the published file, CreditAuditError lists what each one did and where to put the file."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CreditAuditError(f"{src.title}'s {stem} is missing and cannot be downloaded into "
                               f"{folder} ({exc}); point --data-dir at a folder you can write, or "
                               f"put the files there (see docs/USAGE.md, Datasets)") from exc
    dest, expected, failures = folder / f"{stem}.gz", src.gz_md5[stem], []
    for base in src.mirrors:
        url = f"{base}{stem}.gz"
        try:
            fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=f".{stem}.", suffix=".download")
        except OSError as exc:
            raise CreditAuditError(f"{src.title}'s {stem} is missing and {folder} cannot be written "
                                   f"({exc.strerror or exc}); point --data-dir at a folder you can "
                                   f"write, or put the files there (see docs/USAGE.md, Datasets)") from exc
        os.close(fd)
        print(f"downloading {url} to {folder} ...", file=sys.stderr)
        tmp = Path(tmp_name)
        try:
            digest = fetch(url, tmp)
            if digest == expected:
                tmp.replace(dest)
                return dest
            failures.append(f"{url} served md5 {digest}, expected {expected} (corrupt or altered)")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            failures.append(f"{url} failed ({exc})")
        finally:
            tmp.unlink(missing_ok=True)     # also on Ctrl-C: no partial file is ever left
    raise CreditAuditError(
        f"could not download a verified {stem}.gz for {src.title}: {'; '.join(failures)}; nothing "
        f"was kept. Try again, or put the official file (md5 {expected}) in {folder} yourself.")


def _read_split(src: IdxSource, paths: dict[str, Path], prefix: str
                ) -> tuple[tuple[torch.Tensor, torch.Tensor], bool]:
    """`<prefix>-images-idx3-ubyte` + labels → (uint8 (N, 1, 28, 28), int64 (N,)), validated, and
    whether both files were the official ones (md5-checked)."""
    images_path = paths[f"{prefix}-images-idx3-ubyte"]
    labels_path = paths[f"{prefix}-labels-idx1-ubyte"]
    images, images_checked = _read_checked(src, images_path, f"{prefix}-images-idx3-ubyte", ndim=3)
    labels, labels_checked = _read_checked(src, labels_path, f"{prefix}-labels-idx1-ubyte", ndim=1)
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
    tensors = torch.from_numpy(images[:, None]), torch.from_numpy(labels.astype(np.int64))
    return tensors, images_checked and labels_checked


def _read_checked(src: IdxSource, path: Path, stem: str, ndim: int) -> tuple[np.ndarray, bool]:
    """Read one IDX file; one of the official shape must have the official content (md5 of the
    decompressed bytes, so a recompressed or unzipped copy passes too). Returns (array, checked)."""
    raw = _read_bytes(path)
    array = _parse_idx(raw, path, ndim)
    if array.shape != OFFICIAL_SHAPES[stem]:
        return array, False
    got, expected = hashlib.md5(raw).hexdigest(), src.raw_md5[stem]
    if got != expected:
        raise CreditAuditError(
            f"{path} has the shape of {src.title}'s {stem} but not its content: the md5 of its "
            f"decompressed bytes is {got}, expected {expected} (a corrupt or altered copy, or the "
            f"other dataset's file: MNIST and Fashion-MNIST share file names); delete it and load "
            f"again to download it, or put the official {src.mirrors[0]}{stem}.gz "
            f"(md5 {src.gz_md5[stem]}) there")
    return array, True


def _locate(folder: Path, stem: str) -> Path | None:
    """`folder/stem` or `folder/stem.gz`, whichever exists (plain first)."""
    return next((p for p in (folder / stem, folder / f"{stem}.gz") if p.is_file()), None)


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """An unsigned-byte IDX file (gzipped if it ends in .gz) with `ndim` dimensions → uint8 array."""
    return _parse_idx(_read_bytes(path), path, ndim)


_FIX = "the file is corrupt, truncated or of another kind; replace it with the original"


def _read_bytes(path: Path) -> bytes:
    """The file's IDX bytes, decompressed if its name ends in .gz (the gzip CRC is checked)."""
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            return f.read()
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise CreditAuditError(f"cannot read {path} ({exc}); {_FIX}") from exc


def _parse_idx(raw: bytes, path: Path, ndim: int) -> np.ndarray:
    magic = bytes([0, 0, _UBYTE, ndim])
    if raw[:4] != magic:
        raise CreditAuditError(f"{path}: IDX magic number is {raw[:4].hex()}, expected "
                               f"{magic.hex()} (unsigned bytes, {ndim} dimensions); {_FIX}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise CreditAuditError(f"{path}: the IDX header is cut short; {_FIX}")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    size = math.prod(dims)  # exact: np.prod would wrap around in int64 for a corrupt header
    if len(raw) != header + size:
        raise CreditAuditError(f"{path}: the header promises {dims} = {size} bytes "
                               f"of data, the file holds {len(raw) - header}; {_FIX}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims).copy()
