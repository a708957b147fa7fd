import pytest
import torch


@pytest.fixture(autouse=True)
def _small_threads():
    """Tests use small nets on a 2-core CI machine: one intra-op thread is as fast and never
    oversubscribes the cores when a test starts a subprocess."""
    torch.set_num_threads(1)
    yield
