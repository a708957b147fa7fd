"""Shared fixtures. The device-relevant tests (training, methods, metrics, diagnose, audit, stack)
take their device from the `device` fixture: `CREDITAUDIT_TEST_DEVICE=cuda python -m pytest` (or
`--device cuda`) runs them on the GPU; the default is the CPU."""
import os
import urllib.error
import urllib.request

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--device", default=None,
                     help="device for the device-relevant tests (default: $CREDITAUDIT_TEST_DEVICE or cpu)")


def pytest_collection_modifyitems(items):
    """Every test that takes the `device` fixture is marked `device`, so that on a lent GPU, where
    time is counted, `CREDITAUDIT_TEST_DEVICE=cuda python -m pytest -m device` runs only the tests
    the GPU changes (benchmarks/gpu_session.sh)."""
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device)


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """The device the device-relevant tests run on (cpu unless asked)."""
    name = request.config.getoption("--device") or os.environ.get("CREDITAUDIT_TEST_DEVICE") or "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.exit(f"CREDITAUDIT_TEST_DEVICE={name} asked for, but this machine has no CUDA GPU", 2)
    return dev


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """The tests use small nets on a 2-core CI machine: one intra-op thread is as fast, never
    oversubscribes the cores when a test starts a subprocess, and does not collapse when the
    cores are shared (two spinning OpenMP threads on a busy 2-core box run ~20× slower).
    Session-scoped, so it is in force before any module-scoped fixture trains a model."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def digits():
    from creditaudit.data.generated import load_digits
    return load_digits()


@pytest.fixture(autouse=True)
def no_internet(monkeypatch):
    """Tests never download: a URL other than a local test server fails at once, so a loader that
    would fetch a dataset (MNIST, CIFAR) refuses instead of reaching the network."""
    real = urllib.request.urlopen

    def local_only(url, *args, **kwargs):
        target = url.full_url if isinstance(url, urllib.request.Request) else str(url)
        if not target.startswith(("http://127.0.0.1:", "http://localhost:")):
            raise urllib.error.URLError(f"tests do not use the network ({target})")
        return real(url, *args, **kwargs)

    monkeypatch.setattr(urllib.request, "urlopen", local_only)


@pytest.fixture
def every_epoch(monkeypatch):
    """A checkpoint after every epoch (`train.CHECKPOINT_ENV` = 0), in this process and the ones
    it starts: for the tests that stop a run right after epoch k's checkpoint. By default a run
    writes one every `train.CHECKPOINT_SECONDS`, which the tests' runs never reach before they end."""
    from creditaudit.train import CHECKPOINT_ENV
    monkeypatch.setenv(CHECKPOINT_ENV, "0")
