"""The trainer keeps freed host memory (train.keep_freed_host_memory): a step's large temporaries
reuse pages instead of faulting in fresh ones every step."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from creditaudit.train import keep_freed_host_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# cb's steps at the quick audit's shape (d = 256, batch 128: temporaries up to 2 MiB) in a fresh
# process, first under glibc's defaults, then with the setting; prints the minor page faults per
# step of each phase once its first steps have sized the heap
_CB_STEPS = """
import resource, torch
from creditaudit.methods import MethodSettings, method_class
from creditaudit.model import ResidualMLP
from creditaudit.train import keep_freed_host_memory
torch.set_num_threads(1)
torch.manual_seed(0)
cb = method_class("cb")(ResidualMLP(40, 256, 4, 10), MethodSettings(epochs=1, seed=0,
                                                                   trainable_blocks=(0, 1, 2, 3)))
x, y = torch.randn(128, 40), torch.randint(0, 10, (128,))
def faults_per_step():
    for _ in range(3):
        cb.train_step(x, y)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(6):
        cb.train_step(x, y)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 6
default = faults_per_step()
assert keep_freed_host_memory() and keep_freed_host_memory()          # idempotent
print(default, faults_per_step())
"""


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_cb_steps_stop_faulting_pages():
    """cb's steps fault in ~1500–1900 pages each under glibc's defaults (its large temporaries go
    back to the OS when freed); with the setting, almost none."""
    out = subprocess.run([sys.executable, "-c", _CB_STEPS], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
    default, kept = map(float, out.stdout.split()[-2:])
    assert kept < 50, kept
    assert default > 10 * (kept + 1), (default, kept)


def test_keep_freed_host_memory_says_whether_it_took():
    """True where glibc took the setting; elsewhere False, and nothing changed."""
    assert keep_freed_host_memory() is GLIBC
