"""retain_freed_memory: glibc keeps what a step freed, so the next step's arrays fault no pages in."""
import ctypes
import ctypes.util
import subprocess
import sys

import pytest

from npformer.backend import host_memory

GLIBC = ctypes.util.find_library("c") is not None and hasattr(ctypes.CDLL(None), "mallopt")

# a step's pattern: a dozen arrays of 1-12 MB made and filled, then all freed; ten times over
STEPS = """
import resource, numpy as np
from npformer.backend.host_memory import retain_freed_memory
sizes = np.random.default_rng(0).integers(1 << 18, 3 << 20, 12)
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        arrays = []
        for n in sizes:
            a = np.empty(int(n), np.float32); a.fill(1.0); arrays.append(a)
        del arrays
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
default = faults()
assert retain_freed_memory()
faults()
print(default, faults())
"""


@pytest.mark.skipif(not GLIBC, reason="needs glibc's mallopt")
def test_a_steps_arrays_reuse_freed_pages():
    """In a fresh process (the setting is process-wide): tens of thousands of page faults over ten
    'steps' by default, none once the freed memory is kept."""
    out = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, check=True).stdout
    default, retained = map(int, out.split())
    assert default > 10_000 and retained < 100, (default, retained)


def test_without_mallopt_it_reports_false(monkeypatch):
    class NoMallopt:
        def __init__(self, *args):
            pass
    monkeypatch.setattr(host_memory.ctypes, "CDLL", NoMallopt)
    assert host_memory.retain_freed_memory() is False
