"""The trainer keeps freed host memory (train.keep_freed_host_memory): a step's large temporaries
reuse pages instead of faulting in fresh ones every step."""
from __future__ import annotations

import platform
import resource

import pytest
import torch

from creditaudit.train import keep_freed_host_memory


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="mallopt is glibc's")
def test_large_temporaries_stop_faulting_pages():
    """After the setting, 50 steps that each allocate a 4 MiB and a 2 MiB tensor and free them
    fault in their pages about once (1536 pages), not every step (glibc's default: ~30000)."""
    assert keep_freed_host_memory()
    assert keep_freed_host_memory()                    # idempotent
    torch.ones(2 ** 20).sum()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):
        big, small = torch.ones(2 ** 20), torch.ones(2 ** 19)     # 4 MiB and 2 MiB, filled
        del big
        small.sum()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 4 * 1024, faults
