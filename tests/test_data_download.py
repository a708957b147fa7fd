"""MNIST / Fashion-MNIST: checksummed download and the checks on files put in the folder by hand.

No test touches the network: the mirrors are a local HTTP server (or a patched `fetch`), and
conftest's `no_internet` refuses any other URL."""
from __future__ import annotations

import gzip
import hashlib
import http.server
import threading
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest

from creditaudit.data import idx, load_dataset
from creditaudit.errors import CreditAuditError
from test_data import write_idx_set

FILES = idx.IDX_FILES


@pytest.fixture(autouse=True)
def local_servers_unproxied(monkeypatch):
    monkeypatch.setenv("no_proxy", "*")      # conftest's `no_internet` refuses any other URL


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder; a path under /cut/ sends half the file but announces all of it, then
    hangs up (a connection dropped mid-download)."""
    requested: list[str]

    def do_GET(self):
        self.requested.append(self.path)
        if self.path.startswith("/cut/"):
            body = (Path(self.directory) / self.path.removeprefix("/cut/")).read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:len(body) // 2])
            self.close_connection = True
            return
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path):
    """(base URL, served folder, list of requested paths) of a local HTTP server."""
    root = tmp_path / "served"
    root.mkdir()
    requested: list[str] = []
    handler = type("Handler", (_Handler,), {"requested": requested})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", root, requested
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def serve_tiny_set(root: Path, seed: int = 0) -> tuple[dict, dict[str, str]]:
    """The four tiny IDX files, gzipped, in `root` (30 train / 12 test samples, labels the images
    show); returns (arrays, md5 of each .gz) — the md5s play the published ones."""
    arrays = write_idx_set(root, gz=(True,) * 4, seed=seed)
    return arrays, {stem: hashlib.md5((root / f"{stem}.gz").read_bytes()).hexdigest() for stem in FILES}


def use_mirrors(monkeypatch, *mirrors: str, gz_md5: dict[str, str], source: str = "MNIST") -> None:
    monkeypatch.setattr(idx, source, replace(getattr(idx, source), mirrors=mirrors, gz_md5=gz_md5))


def only_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- files put there by hand

def test_a_tiny_folder_in_the_exact_format_loads_unchecked(tmp_path):
    """Tiny files are not the official ones (other shapes): read as they are, and said so."""
    arrays = write_idx_set(tmp_path / "mnist", gz=(True, False, True, False))
    ds = load_dataset("mnist", data_dir=tmp_path, download=False)
    assert ds.x_train.shape == (30, 1, 28, 28)
    assert ds.y_test.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()
    assert "not md5-checked" in ds.describe()


@pytest.fixture
def official_tiny(monkeypatch, tmp_path):
    """Make the tiny set 'official': its shapes and decompressed md5s stand in for MNIST's."""
    arrays = write_idx_set(tmp_path / "reference", gz=(False,) * 4)
    for stem, array in arrays.items():
        monkeypatch.setitem(idx.OFFICIAL_SHAPES, stem, array.shape)
    raw_md5 = {stem: hashlib.md5((tmp_path / "reference" / stem).read_bytes()).hexdigest()
               for stem in FILES}
    monkeypatch.setattr(idx, "MNIST", replace(idx.MNIST, raw_md5=raw_md5))
    return tmp_path / "reference", raw_md5


def test_official_files_are_checked_plain_or_recompressed(tmp_path, official_tiny):
    reference, _ = official_tiny
    folder = tmp_path / "data" / "mnist"
    folder.mkdir(parents=True)
    for i, stem in enumerate(FILES):        # two plain copies, two recompressed at another level
        raw = (reference / stem).read_bytes()
        if i % 2:
            (folder / stem).write_bytes(raw)
        else:
            (folder / f"{stem}.gz").write_bytes(gzip.compress(raw, compresslevel=1, mtime=0))
    ds = load_dataset("mnist", data_dir=tmp_path / "data", download=False)
    assert "official files, md5 checked" in ds.describe()


def test_a_corrupt_official_file_is_refused_in_one_line(tmp_path, official_tiny):
    reference, raw_md5 = official_tiny
    folder = tmp_path / "data" / "mnist"
    folder.mkdir(parents=True)
    for stem in FILES:
        (folder / stem).write_bytes((reference / stem).read_bytes())
    bad = folder / "t10k-images-idx3-ubyte"
    raw = bytearray(bad.read_bytes())
    raw[-1] ^= 0xFF                          # one pixel flipped: still a well-formed IDX file
    bad.write_bytes(bytes(raw))
    with pytest.raises(CreditAuditError) as err:
        load_dataset("mnist", data_dir=tmp_path / "data", download=False)
    message = only_line(err)
    assert str(bad) in message
    assert raw_md5["t10k-images-idx3-ubyte"] in message                      # expected
    assert hashlib.md5(bytes(raw)).hexdigest() in message                    # got
    assert "delete it and load again to download it" in message              # the fix
    assert f"{idx.MNIST.mirrors[0]}t10k-images-idx3-ubyte.gz" in message


def test_the_other_datasets_file_under_the_same_name_is_refused(tmp_path, official_tiny):
    """MNIST and Fashion-MNIST share file names: the wrong one in a folder is caught."""
    reference, _ = official_tiny
    write_idx_set(tmp_path / "data" / "mnist", gz=(True,) * 4, seed=9)     # same shapes, other data
    with pytest.raises(CreditAuditError, match="train-images-idx3-ubyte.gz has the shape of MNIST's "
                                               "train-images-idx3-ubyte but not its content"):
        load_dataset("mnist", data_dir=tmp_path / "data", download=False)


# ---------------------------------------------------------------- download

def test_download_fetches_verifies_and_writes_only_the_four_files(tmp_path, server, monkeypatch):
    url, served, requested = server
    arrays, md5s = serve_tiny_set(served)
    use_mirrors(monkeypatch, f"{url}/", gz_md5=md5s)
    data_dir = tmp_path / "data"
    ds = load_dataset("mnist", data_dir=data_dir)                    # download=True is the default
    assert ds.y_train.tolist() == arrays["train-labels-idx1-ubyte"].tolist()
    assert sorted(p.name for p in data_dir.iterdir()) == ["mnist"]
    folder = data_dir / "mnist"
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{s}.gz" for s in FILES)  # no temp left
    for stem in FILES:
        assert (folder / f"{stem}.gz").read_bytes() == (served / f"{stem}.gz").read_bytes()

    requested.clear()
    again = load_dataset("mnist", data_dir=data_dir)                 # present: nothing fetched
    assert requested == [] and again.digest == ds.digest


def test_download_fetches_only_the_missing_files_into_the_folder_in_use(tmp_path, server, monkeypatch):
    url, served, requested = server
    _, md5s = serve_tiny_set(served, seed=4)
    use_mirrors(monkeypatch, f"{url}/", gz_md5=md5s, source="FASHION_MNIST")
    folder = tmp_path / "FashionMNIST" / "raw"                     # torchvision's layout, one file short
    folder.mkdir(parents=True)
    for stem in FILES[:3]:
        (folder / f"{stem}.gz").write_bytes((served / f"{stem}.gz").read_bytes())
    load_dataset("fashion-mnist", data_dir=tmp_path)
    assert requested == ["/t10k-labels-idx1-ubyte.gz"]
    assert (folder / "t10k-labels-idx1-ubyte.gz").is_file() and not (tmp_path / "fashion-mnist").exists()


def test_a_corrupt_mirror_is_skipped_for_the_next(tmp_path, server, monkeypatch):
    url, served, requested = server
    _, md5s = serve_tiny_set(served)
    bad = served / "bad"
    bad.mkdir()
    for stem in FILES:
        (bad / f"{stem}.gz").write_bytes(b"not what was published")
    use_mirrors(monkeypatch, f"{url}/bad/", f"{url}/", gz_md5=md5s)
    load_dataset("mnist", data_dir=tmp_path / "data")
    assert requested[:2] == ["/bad/train-images-idx3-ubyte.gz", "/train-images-idx3-ubyte.gz"]
    assert sorted(p.name for p in (tmp_path / "data" / "mnist").iterdir()) == sorted(f"{s}.gz" for s in FILES)


def test_a_download_with_the_wrong_checksum_leaves_nothing(tmp_path, server, monkeypatch):
    url, served, _ = server
    _, md5s = serve_tiny_set(served)
    expected = dict(md5s, **{"train-images-idx3-ubyte": "0" * 32})
    use_mirrors(monkeypatch, f"{url}/", gz_md5=expected)
    data_dir = tmp_path / "data"
    with pytest.raises(CreditAuditError) as err:
        load_dataset("mnist", data_dir=data_dir)
    message = only_line(err)
    assert "could not download a verified train-images-idx3-ubyte.gz for MNIST" in message
    assert f"served md5 {md5s['train-images-idx3-ubyte']}, expected {'0' * 32}" in message
    assert f"put the official file (md5 {'0' * 32}) in {data_dir / 'mnist'} yourself" in message
    assert list((data_dir / "mnist").iterdir()) == []               # train-images is fetched first


def test_an_interrupted_download_leaves_nothing(tmp_path, server, monkeypatch):
    url, served, _ = server
    _, md5s = serve_tiny_set(served)
    use_mirrors(monkeypatch, f"{url}/cut/", gz_md5=md5s)
    folder = tmp_path / "data" / "mnist"
    with pytest.raises(CreditAuditError) as err:
        load_dataset("mnist", data_dir=tmp_path / "data")
    assert "the connection closed after" in only_line(err)
    assert list(folder.iterdir()) == []


def test_ctrl_c_during_a_download_leaves_nothing(tmp_path, monkeypatch):
    """An interrupt is not caught (the user asked to stop), but the partial file goes with it."""
    def half_then_interrupt(url, dest):
        dest.write_bytes(b"\x1f\x8b partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(idx, "fetch", half_then_interrupt)
    use_mirrors(monkeypatch, "http://127.0.0.1:9/", gz_md5=idx.MNIST.gz_md5)
    folder = tmp_path / "mnist"
    with pytest.raises(KeyboardInterrupt):
        load_dataset("mnist", data_dir=tmp_path)
    assert list(folder.iterdir()) == []


def test_offline_with_missing_files_says_where_to_put_them_and_the_urls(tmp_path):
    with pytest.raises(CreditAuditError) as err:
        load_dataset("fashion-mnist", data_dir=tmp_path, download=False)
    message = only_line(err)
    assert f"missing in {tmp_path / 'fashion-mnist'}" in message
    for stem in FILES:
        assert f"{idx.FASHION_MNIST.mirrors[0]}{stem}.gz (md5 {idx.FASHION_MNIST.gz_md5[stem]})" in message
    assert not (tmp_path / "fashion-mnist").exists()                 # offline writes nothing
