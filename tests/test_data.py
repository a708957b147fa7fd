"""Data loaders: CIFAR pickles (restricted unpickling, checksummed download), IDX files, crop + flip
augmentation, and the locally generated datasets."""
from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import os
import pickle
import socket
import struct
import tarfile
import threading
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from creditaudit.data import DATASET_NAMES, ArrayDataset, load_dataset, random_crop_flip
from creditaudit.data import cifar
from creditaudit.data.cifar import load_cifar10, load_cifar100
from creditaudit.errors import CreditAuditError

N = 20  # images per CIFAR batch file in these fixtures
CIFAR10_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


# ---------------------------------------------------------------- writing the real formats

class _Py2Pickler(pickle._Pickler):
    """Writes what Python 2's cPickle wrote into the CIFAR archives: protocol 2 with every string
    as a byte string (SHORT_BINSTRING / BINSTRING), which Python 3 reads back as bytes."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_py2_str(self, obj):
        raw = obj.encode("ascii") if isinstance(obj, str) else obj
        if len(raw) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(raw)]) + raw)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(raw)) + raw)

    dispatch[str] = save_py2_str
    dispatch[bytes] = save_py2_str


def py2_pickle(obj) -> bytes:
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    # numpy 1 (which wrote the archives) named the module numpy.core.multiarray
    return buf.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")


def mark_labels(x: np.ndarray, y, n_classes: int) -> np.ndarray:
    """Random uint8 images (N, D) whose first n_classes·k pixels show the label as a one-hot block
    of k = D // n_classes // 2 white pixels: a loader refuses data whose labels a linear probe cannot
    predict (data/checks.py), so the format fixtures carry labels the inputs predict."""
    k = x.shape[1] // n_classes // 2
    x[:, :n_classes * k] = 0
    for i, c in enumerate(int(v) for v in y):
        x[i, c * k:(c + 1) * k] = 255
    return x


def write_cifar10(root: Path, seed: int = 0) -> dict[str, tuple[np.ndarray, list[int]]]:
    """A CIFAR-10 folder in the archive's format with N random images per batch (labels marked)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    batches = {}
    for name in CIFAR10_FILES:
        y = [int(v) for v in rng.integers(0, 10, N)]
        x = mark_labels(rng.integers(0, 256, (N, 3072), dtype=np.uint8), y, 10)
        (folder / name).write_bytes(py2_pickle(
            {"batch_label": f"{name} of 6", "labels": y, "data": x,
             "filenames": [f"img_{i}.png" for i in range(N)]}))
        batches[name] = (x, y)
    (folder / "batches.meta").write_bytes(py2_pickle(
        {"label_names": [f"class{i}" for i in range(10)], "num_cases_per_batch": N, "num_vis": 3072}))
    return batches


def write_cifar100(root: Path) -> dict[str, tuple[np.ndarray, list[int]]]:
    """A CIFAR-100 folder as a Python 3 / numpy 2 tool would re-save it (protocol 4)."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    batches = {}
    for name in ("train", "test"):
        y = [int(v) for v in rng.choice([3, 42, 99], N)]     # few classes: each seen in training
        y[0] = 99
        x = mark_labels(rng.integers(0, 256, (N, 3072), dtype=np.uint8), y, 100)
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": x, b"fine_labels": y, b"coarse_labels": [v // 5 for v in y]},
                        f, protocol=4)
        batches[name] = (x, y)
    return batches


def write_idx(path: Path, array: np.ndarray) -> None:
    """IDX: 0x00 0x00 0x08 ndim, big-endian uint32 dims, then the bytes; gzipped if path ends in .gz."""
    raw = bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)


def normalise(x: torch.Tensor, mean, std) -> torch.Tensor:
    """(x / 255 − mean) / std in float64, per channel; x uint8 (N, C, H, W)."""
    m = torch.tensor(mean, dtype=torch.float64).view(-1, 1, 1)
    s = torch.tensor(std, dtype=torch.float64).view(-1, 1, 1)
    return (x.double() / 255 - m) / s


# ---------------------------------------------------------------- CIFAR reading

def test_cifar10_round_trip(tmp_path):
    batches = write_cifar10(tmp_path)
    ds = load_dataset("cifar10", data_dir=tmp_path, download=False)

    x_train = np.concatenate([batches[f"data_batch_{i}"][0] for i in range(1, 6)])
    y_train = sum((batches[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    assert ds.x_train.shape == (5 * N, 3, 32, 32) and ds.x_train.dtype == torch.uint8
    assert ds.x_test.shape == (N, 3, 32, 32) and ds.x_test.dtype == torch.uint8
    assert ds.y_train.dtype == ds.y_test.dtype == torch.int64
    assert np.array_equal(ds.x_train.reshape(5 * N, -1).numpy(), x_train)
    assert ds.y_train.tolist() == y_train
    assert np.array_equal(ds.x_test.reshape(N, -1).numpy(), batches["test_batch"][0])
    assert ds.y_test.tolist() == batches["test_batch"][1]
    # channel-major layout: value (c, row, col) sits at c·1024 + row·32 + col
    assert ds.x_train[7, 2, 5, 9] == x_train[7, 2 * 1024 + 5 * 32 + 9]
    assert (ds.n_classes, ds.augment, ds.pad, ds.d_in) == (10, True, 4, 3072)
    assert ds.mean.shape == ds.std.shape == (3, 1, 1)

    expected = normalise(ds.x_test, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    got = ds.prepare(ds.x_test)                # images stay images: (N, *input_shape)
    assert ds.input_shape == (3, 32, 32)
    assert got.dtype == torch.float32 and got.shape == (N, 3, 32, 32)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)


def test_cifar100_round_trip(tmp_path):
    batches = write_cifar100(tmp_path)
    ds = load_cifar100(tmp_path, download=False)
    assert ds.name == "cifar100" and ds.n_classes == 100 and ds.augment
    for x, y, name in ((ds.x_train, ds.y_train, "train"), (ds.x_test, ds.y_test, "test")):
        assert x.shape == (N, 3, 32, 32) and x.dtype == torch.uint8 and y.dtype == torch.int64
        assert np.array_equal(x.reshape(N, -1).numpy(), batches[name][0])
        assert y.tolist() == batches[name][1]
    expected = normalise(ds.x_train, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
    torch.testing.assert_close(ds.prepare(ds.x_train).double(), expected, rtol=0, atol=1e-5)


def test_truncated_batch_names_the_file(tmp_path):
    write_cifar10(tmp_path)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(CreditAuditError, match="data_batch_3.*corrupt.*download it again"):
        load_cifar10(tmp_path, download=False)


def test_missing_batch_names_the_file(tmp_path):
    write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(CreditAuditError, match="test_batch is missing"):
        load_cifar10(tmp_path, download=False)


def test_labels_out_of_range_are_rejected(tmp_path):
    write_cifar10(tmp_path)
    x = np.zeros((N, 3072), np.uint8)
    (tmp_path / "cifar-10-batches-py" / "data_batch_2").write_bytes(
        py2_pickle({"data": x, "labels": [10] * N}))
    with pytest.raises(CreditAuditError, match=r"data_batch_2.*\[0, 10\)"):
        load_cifar10(tmp_path, download=False)


def test_missing_folder_without_download_names_the_expected_path(tmp_path):
    with pytest.raises(CreditAuditError) as err:
        load_cifar10(tmp_path, download=False)
    message = str(err.value)
    assert str(tmp_path / "cifar-10-batches-py") in message
    assert cifar.CIFAR10_URL in message and "extract it under --data-dir" in message


def test_malicious_global_is_refused_not_run(tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(
        py2_pickle({"data": Exploit(), "labels": []}))
    with pytest.raises(CreditAuditError, match="data_batch_1.*refused global (posix|os|nt).system"):
        load_cifar10(tmp_path, download=False)
    assert not marker.exists()


# ---------------------------------------------------------------- CIFAR download

class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_dir(tmp_path, monkeypatch):
    """(base URL, folder) of a local HTTP server serving that folder."""
    monkeypatch.setenv("no_proxy", "*")
    root = tmp_path / "served"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", root
    server.shutdown()
    server.server_close()
    thread.join()


def make_archive(path: Path, src: Path, extra: list[tarfile.TarInfo] = ()) -> str:
    """tar.gz of `src/cifar-10-batches-py` (plus raw `extra` members); returns its md5."""
    with tarfile.open(path, "w:gz") as tar:
        tar.add(src / "cifar-10-batches-py", arcname="cifar-10-batches-py")
        for info in extra:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isfile() else None)
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_download_checks_md5_extracts_and_loads(tmp_path, http_dir, monkeypatch):
    url, served = http_dir
    batches = write_cifar10(tmp_path / "src")
    md5 = make_archive(served / "cifar-10-python.tar.gz", tmp_path / "src")
    monkeypatch.setattr(cifar, "CIFAR10_URL", f"{url}/cifar-10-python.tar.gz")
    monkeypatch.setattr(cifar, "CIFAR10_MD5", md5)

    data_dir = tmp_path / "data"
    ds = load_dataset("cifar10", data_dir=data_dir)          # download=True is the default
    assert np.array_equal(ds.x_test.reshape(N, -1).numpy(), batches["test_batch"][0])
    assert sorted(p.name for p in data_dir.iterdir()) == ["cifar-10-batches-py"]  # no temp left


def test_download_with_wrong_md5_leaves_nothing(tmp_path, http_dir):
    url, served = http_dir
    write_cifar10(tmp_path / "src")
    make_archive(served / "c.tar.gz", tmp_path / "src")
    data_dir = tmp_path / "data"
    with pytest.raises(CreditAuditError, match="checksum mismatch"):
        cifar.download_cifar(data_dir, "cifar-10-batches-py", f"{url}/c.tar.gz", "0" * 32)
    assert list(data_dir.iterdir()) == []


def _member(name: str, kind: bytes = tarfile.REGTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    if kind == tarfile.SYMTYPE:
        info.linkname = "/etc/passwd"
    else:
        info.size = 3
    return info


@pytest.mark.parametrize("member", [_member("../escaped"), _member("/tmp/absolute"),
                                    _member("cifar-10-batches-py/../../escaped"),
                                    _member("cifar-10-batches-py/link", tarfile.SYMTYPE)],
                         ids=["dotdot", "absolute", "nested-dotdot", "symlink"])
def test_download_rejects_unsafe_archive_members(tmp_path, http_dir, member):
    url, served = http_dir
    write_cifar10(tmp_path / "src")
    md5 = make_archive(served / "c.tar.gz", tmp_path / "src", extra=[member])
    data_dir = tmp_path / "deep" / "data"
    with pytest.raises(CreditAuditError, match="unsafe member"):
        cifar.download_cifar(data_dir, "cifar-10-batches-py", f"{url}/c.tar.gz", md5)
    assert list(data_dir.iterdir()) == []
    assert not (tmp_path / "deep" / "escaped").exists() and not (tmp_path / "escaped").exists()


def test_download_failure_says_where_to_put_the_data(tmp_path, monkeypatch):
    with socket.socket() as s:                               # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("no_proxy", "*")
    monkeypatch.setattr(cifar, "CIFAR100_URL", f"http://127.0.0.1:{port}/cifar-100-python.tar.gz")
    with pytest.raises(CreditAuditError) as err:
        load_cifar100(tmp_path)
    message = str(err.value)
    assert "could not download" in message
    assert str(tmp_path / "cifar-100-python") in message
    assert "extract it under --data-dir" in message
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- IDX (MNIST, Fashion-MNIST)

def write_idx_set(folder: Path, gz: tuple[bool, bool, bool, bool], seed: int = 0):
    rng = np.random.default_rng(seed)
    y, yt = (rng.permutation(np.arange(n) % 10).astype(np.uint8) for n in (30, 12))   # every class
    images = lambda labels: mark_labels(rng.integers(0, 256, (len(labels), 784), dtype=np.uint8),
                                        labels, 10).reshape(-1, 28, 28)
    arrays = {"train-images-idx3-ubyte": images(y), "train-labels-idx1-ubyte": y,
              "t10k-images-idx3-ubyte": images(yt), "t10k-labels-idx1-ubyte": yt}
    for (name, array), zipped in zip(arrays.items(), gz):
        write_idx(folder / (name + ".gz" if zipped else name), array)
    return arrays


def check_idx_dataset(ds: ArrayDataset, arrays: dict, mean: float, std: float) -> None:
    assert ds.x_train.shape == (30, 1, 28, 28) and ds.x_train.dtype == torch.uint8
    assert ds.x_test.shape == (12, 1, 28, 28) and ds.y_test.dtype == torch.int64
    assert np.array_equal(ds.x_train[:, 0].numpy(), arrays["train-images-idx3-ubyte"])
    assert np.array_equal(ds.y_train.numpy(), arrays["train-labels-idx1-ubyte"])
    assert np.array_equal(ds.x_test[:, 0].numpy(), arrays["t10k-images-idx3-ubyte"])
    assert np.array_equal(ds.y_test.numpy(), arrays["t10k-labels-idx1-ubyte"])
    assert ds.n_classes == 10 and not ds.augment and ds.d_in == 784
    assert ds.input_shape == (1, 28, 28)
    assert ds.mean.shape == ds.std.shape == (1, 1, 1)
    torch.testing.assert_close(ds.prepare(ds.x_test).double(),
                               normalise(ds.x_test, (mean,), (std,)), rtol=0, atol=1e-5)


@pytest.mark.parametrize("subdir", ["mnist", "MNIST/raw", "."])
def test_mnist_idx_round_trip(tmp_path, subdir):
    arrays = write_idx_set(tmp_path / subdir, gz=(True, False, False, True))
    check_idx_dataset(load_dataset("mnist", data_dir=tmp_path), arrays, 0.1307, 0.3081)


def test_fashion_mnist_idx_round_trip(tmp_path):
    arrays = write_idx_set(tmp_path / "fashion-mnist", gz=(True, True, True, True), seed=3)
    ds = load_dataset("fashion-mnist", data_dir=tmp_path)
    assert ds.name == "fashion-mnist"
    check_idx_dataset(ds, arrays, 0.2860, 0.3530)


@pytest.mark.parametrize("name, folder", [("mnist", "mnist"), ("fashion-mnist", "fashion-mnist")])
def test_the_01_variant_reads_the_same_files_with_pixels_in_0_1(tmp_path, name, folder):
    """"<name>-01" is the reference codes' input (torchvision's ToTensor): the same files, each pixel
    x / 255 and nothing subtracted; its digest differs from the standardised dataset's, so a run on
    one is never reused for the other."""
    arrays = write_idx_set(tmp_path / folder, gz=(False, True, False, True), seed=5)
    unit = load_dataset(f"{name}-01", data_dir=tmp_path)
    standard = load_dataset(name, data_dir=tmp_path)
    assert unit.name == f"{name}-01" and "pixels in [0, 1]" in unit.describe()
    assert unit.mean is None and unit.std is None
    assert np.array_equal(unit.x_test[:, 0].numpy(), arrays["t10k-images-idx3-ubyte"])
    assert torch.equal(unit.y_train, standard.y_train)
    x = unit.prepare(unit.x_test)
    assert x.dtype == torch.float32 and float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    torch.testing.assert_close(x.double(), unit.x_test.double() / 255, rtol=0, atol=1e-7)
    assert not torch.allclose(x, standard.prepare(standard.x_test))
    assert unit.digest != standard.digest and unit.test_digest != standard.test_digest


def test_idx_bad_magic_is_a_clear_error(tmp_path):
    write_idx_set(tmp_path / "mnist", gz=(False,) * 4)
    path = tmp_path / "mnist" / "t10k-labels-idx1-ubyte"
    path.write_bytes(b"\x00\x00\x08\x03" + path.read_bytes()[4:])   # claims 3 dims
    with pytest.raises(CreditAuditError, match="t10k-labels-idx1-ubyte: IDX magic number is 00000803"):
        load_dataset("mnist", data_dir=tmp_path)


def test_idx_truncated_files_are_clear_errors(tmp_path):
    write_idx_set(tmp_path / "mnist", gz=(False, False, True, False))
    plain = tmp_path / "mnist" / "train-images-idx3-ubyte"
    plain.write_bytes(plain.read_bytes()[:-10])
    with pytest.raises(CreditAuditError, match="train-images-idx3-ubyte: the header promises"):
        load_dataset("mnist", data_dir=tmp_path)
    write_idx_set(tmp_path / "mnist", gz=(False, False, True, False))
    zipped = tmp_path / "mnist" / "t10k-images-idx3-ubyte.gz"
    zipped.write_bytes(zipped.read_bytes()[:100])
    with pytest.raises(CreditAuditError, match="cannot read .*t10k-images-idx3-ubyte.gz"):
        load_dataset("mnist", data_dir=tmp_path)


def test_idx_missing_files_name_the_folder(tmp_path):
    """Offline (download=False): one line naming the folder to fill and the URLs to fill it from
    (the download itself is tested in test_data_download.py)."""
    with pytest.raises(CreditAuditError, match="MNIST not found.*put the files there") as err:
        load_dataset("mnist", data_dir=tmp_path, download=False)
    assert str(tmp_path / "mnist") in str(err.value) and "--data-dir" in str(err.value)
    assert "train-images-idx3-ubyte.gz (md5 f68b3c2dcbeaaa9fbdd348bbdeb94873)" in str(err.value)

    write_idx_set(tmp_path, gz=(False,) * 4)           # MNIST names, but not in fashion-mnist/
    with pytest.raises(CreditAuditError, match="Fashion-MNIST not found") as err:
        load_dataset("fashion-mnist", data_dir=tmp_path, download=False)
    assert str(tmp_path / "fashion-mnist") in str(err.value)

    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(CreditAuditError, match=r"not found: t10k-labels-idx1-ubyte\[\.gz\] missing in") as err:
        load_dataset("mnist", data_dir=tmp_path, download=False)
    assert "train-images" not in str(err.value)       # only the missing file is asked for


# ---------------------------------------------------------------- augmentation

def match_translation(original: np.ndarray, augmented: np.ndarray, pad: int
                      ) -> list[tuple[int, int, bool]]:
    """All (dy, dx, mirrored) with augmented = [mirror of] original shifted by (dy, dx), zeros in.

    Shift convention: augmented[:, i, j] = original[:, i + dy, j + dx] (0 outside the image).
    """
    c, h, w = original.shape
    padded = np.pad(original, ((0, 0), (pad, pad), (pad, pad)))
    found = []
    for dy in range(-pad, pad + 1):
        for dx in range(-pad, pad + 1):
            shifted = padded[:, pad + dy:pad + dy + h, pad + dx:pad + dx + w]
            for mirrored in (False, True):
                if np.array_equal(augmented, shifted[:, :, ::-1] if mirrored else shifted):
                    found.append((dy, dx, mirrored))
    return found


def image_batch(n: int, c: int = 3, size: int = 32) -> torch.Tensor:
    # values ≥ 1, so a 0 can only be padding, and random, so each candidate matches at most once
    return torch.randint(1, 256, (n, c, size, size), generator=torch.Generator().manual_seed(5),
                         dtype=torch.uint8)


def test_random_crop_flip_is_a_translation_with_zero_fill():
    x = image_batch(200)
    out = random_crop_flip(x, 4, torch.Generator().manual_seed(0))
    assert out.shape == x.shape and out.dtype == torch.uint8
    moves = []
    for orig, aug in zip(x.numpy(), out.numpy()):
        found = match_translation(orig, aug, pad=4)
        assert len(found) == 1, found
        moves.append(found[0])
    assert {dy for dy, _, _ in moves} == set(range(-4, 5))
    assert {dx for _, dx, _ in moves} == set(range(-4, 5))
    assert 0.3 < np.mean([m for _, _, m in moves]) < 0.7
    assert any(dy or dx for dy, dx, _ in moves)


def test_prepare_augments_training_batches_only():
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    x = image_batch(64)
    ds = ArrayDataset("img", x, torch.zeros(64, dtype=torch.long), x, torch.zeros(64, dtype=torch.long),
                      n_classes=10, mean=torch.tensor(mean).view(3, 1, 1),
                      std=torch.tensor(std).view(3, 1, 1), augment=True, pad=4)

    train = ds.prepare(x, train=True, gen=torch.Generator().manual_seed(11))
    raw = random_crop_flip(x, 4, torch.Generator().manual_seed(11))
    torch.testing.assert_close(train.double(), normalise(raw, mean, std), rtol=0, atol=1e-5)
    padding = (raw == 0)
    assert padding.any()
    fill = (-torch.tensor(mean) / torch.tensor(std)).view(1, 3, 1, 1).expand_as(raw)
    torch.testing.assert_close(train.view_as(raw)[padding], fill[padding], rtol=0, atol=1e-5)

    again = ds.prepare(x, train=True, gen=torch.Generator().manual_seed(11))
    other = ds.prepare(x, train=True, gen=torch.Generator().manual_seed(12))
    assert torch.equal(train, again) and not torch.equal(train, other)

    torch.testing.assert_close(ds.prepare(x, train=False).double(), normalise(x, mean, std),
                               rtol=0, atol=1e-5)
    x_eval, _ = ds.eval_batch(0, batch_size=16)
    assert torch.equal(x_eval, ds.prepare(x[:16]))


def test_no_augmentation_when_dataset_has_it_off():
    x = image_batch(8, c=1, size=28)
    ds = ArrayDataset("gray", x, torch.zeros(8, dtype=torch.long), x, torch.zeros(8, dtype=torch.long),
                      n_classes=10, mean=torch.full((1, 1, 1), 0.5), std=torch.full((1, 1, 1), 0.25))
    assert torch.equal(ds.prepare(x, train=True, gen=torch.Generator().manual_seed(0)), ds.prepare(x))


# ---------------------------------------------------------------- generated datasets and the registry

def test_mnist1d_is_generated_once_then_cached(tmp_path, monkeypatch):
    np.random.seed(7)
    expected_next = np.random.rand()
    np.random.seed(7)
    ds = load_dataset("mnist1d", data_dir=tmp_path)
    assert np.random.rand() == expected_next            # generation leaves the global RNG alone
    assert ds.x_train.shape == (4000, 40) and ds.x_test.shape == (1000, 40)
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert ds.d_in == 40 and ds.input_shape == (40,) and ds.n_classes == 10 and set(ds.y_train.tolist()) == set(range(10))
    assert (tmp_path / "mnist1d.npz").is_file()

    import mnist1d.data

    def no_regeneration(*args, **kwargs):
        raise AssertionError("the cached mnist1d.npz should have been used")

    monkeypatch.setattr(mnist1d.data, "make_dataset", no_regeneration)
    cached = load_dataset("mnist1d", data_dir=tmp_path)
    assert torch.equal(cached.x_train, ds.x_train) and torch.equal(cached.y_test, ds.y_test)


def test_digits_and_synthetic_shapes(tmp_path):
    digits = load_dataset("digits", data_dir=tmp_path)
    # standardised float images (N, 1, 8, 8), sklearn's row-major pixel order
    assert digits.x_train.shape == (1437, 1, 8, 8) and digits.x_test.shape == (360, 1, 8, 8)
    assert digits.input_shape == (1, 8, 8) and digits.d_in == 64
    assert digits.mean is None and digits.n_classes == 10
    from sklearn.datasets import load_digits as sk_digits
    raw = sk_digits()
    order = np.random.default_rng(0).permutation(len(raw.target))
    flat = raw.data[order][:1437]
    assert torch.equal(digits.y_train, torch.from_numpy(raw.target[order][:1437]).long())
    # flattening an image gives sklearn's 64 features in their order (one global standardisation)
    expected = torch.from_numpy((flat - flat.mean()) / flat.std()).float()
    torch.testing.assert_close(digits.x_train.flatten(1), expected, rtol=0, atol=1e-4)
    assert abs(float(digits.x_train.mean())) < 1e-4 and abs(float(digits.x_train.std()) - 1) < 1e-2

    synthetic = load_dataset("synthetic", data_dir=tmp_path)
    assert synthetic.x_train.shape == (2000, 32) and synthetic.x_test.shape == (500, 32)
    assert synthetic.input_shape == (32,)
    assert synthetic.y_train.dtype == torch.int64 and len(set(synthetic.y_train.tolist())) > 5
    assert torch.equal(load_dataset("synthetic").y_test, synthetic.y_test)   # same data every time
    assert list(tmp_path.iterdir()) == []                                    # nothing written


def test_unknown_dataset_lists_the_names():
    with pytest.raises(CreditAuditError) as err:
        load_dataset("nope")
    assert all(name in str(err.value) for name in DATASET_NAMES)


def test_your_data_guide_runs(tmp_path, monkeypatch):
    """docs/YOUR_DATA.md's Python session runs as written: prepared batches train a user's model,
    its weights are saved, and the protocol diagnoses it."""
    import re
    guide = (Path(__file__).resolve().parents[1] / "docs" / "YOUR_DATA.md").read_text()
    code = re.search(r"```python\n(.*?)```", guide, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "your_data_guide"}
    exec(compile(code, "docs/YOUR_DATA.md", "exec"), scope)
    assert scope["test_acc"] > 0.5                             # it learned from the prepared inputs
    assert (tmp_path / "trained.safetensors").exists() and (tmp_path / "init.safetensors").exists()
    assert scope["report"].verdict.startswith("incomplete")     # no frozen control: never trustworthy


@pytest.fixture(scope="module")
def mnist1d_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("mnist1d")
    return load_dataset("mnist1d", root), root / "mnist1d.npz"


@pytest.mark.parametrize("fault", ["truncated", "pickled", "foreign", "bad labels"])
def test_a_corrupt_mnist1d_cache_is_regenerated_never_unpickled(fault, mnist1d_cache, tmp_path):
    """The cache is derived data: a broken one is made again (and never unpickled)."""
    fresh, good = mnist1d_cache
    cache = tmp_path / "bad" / "mnist1d.npz"
    cache.parent.mkdir()
    if fault == "truncated":
        cache.write_bytes(good.read_bytes()[:1000])
    elif fault == "pickled":
        class Boom:
            def __reduce__(self):
                return (pytest.fail, ("the cache was unpickled",))
        np.savez(cache, x=np.array([Boom()], dtype=object), y=np.zeros(1), x_test=np.zeros(1),
                 y_test=np.zeros(1))
    elif fault == "foreign":
        cache.write_bytes(b"not a zip file at all")
    else:
        with np.load(good) as z:
            arrays = dict(z)
        arrays["y"] = arrays["y"] + 100
        np.savez(cache, **arrays)
    data = load_dataset("mnist1d", tmp_path / "bad")
    assert torch.equal(data.x_train, fresh.x_train) and torch.equal(data.y_train, fresh.y_train)
    assert torch.equal(data.y_test, fresh.y_test)
    with np.load(cache, allow_pickle=False) as z:             # replaced by an intact cache
        assert z["x"].shape == tuple(fresh.x_train.shape)
