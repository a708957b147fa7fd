import pytest
import torch


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
