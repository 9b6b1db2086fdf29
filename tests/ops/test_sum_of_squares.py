"""The sum of squares (gradient clipping's norm) adds in the order its definition gives
(npformer.ops.optim: lane i mod L, each lane in index order, lanes added in pairs), so every CPU
implementation gives the same bits on every CPU: the reference against a plain-Python reading of
the definition, the result whatever the chunk size, each CPU fast path bit for bit, and numba's
kernel compiled for another vector width (a generic x86-64 target: SSE2, two doubles a register)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npformer import kernels
from npformer.kernels import numba_cpu
from npformer.ops import optim
from tests.helpers import seeds

DTYPES = ("float64", "float32", "float16")
# sizes around the lanes (64), the CPU blocks (65536) and the ones seen to differ before (176, 1000)
SIZES = (0, 1, 7, 63, 64, 65, 176, 1000, 4096, 65535, 65536 + 77, 3 * 65536 + 5)


def _values(n: int, seed: int, dtype: str) -> np.ndarray:
    """Magnitudes over 16 orders (float16: 4), so that another order of additions shows in the bits."""
    r = np.random.default_rng(seed)
    spread = 2 if dtype == "float16" else 8
    return (r.standard_normal(n) * 10.0 ** r.integers(-spread, spread, n)).astype(dtype)


def _by_definition(x: np.ndarray) -> float:
    """The definition read literally, one Python float at a time."""
    lanes = [0.0] * optim.SQUARES_LANES
    for i, v in enumerate(x.reshape(-1).tolist()):
        lanes[i % optim.SQUARES_LANES] += v * v
    while len(lanes) > 1:
        lanes = [lanes[k] + lanes[k + 1] for k in range(0, len(lanes), 2)]
    return lanes[0]


@given(n=st.integers(0, 700), seed=seeds, dtype=st.sampled_from(DTYPES))
def test_reference_follows_the_definition_bit_for_bit(n, seed, dtype):
    x = _values(n, seed, dtype)
    with kernels.disabled():
        got = optim.sum_of_squares(x)
    assert got.dtype == np.float64 and got.shape == ()
    assert float(got) == _by_definition(x)


@pytest.mark.parametrize("chunk", [64, 128, 64 * 3])
def test_the_chunk_size_does_not_change_a_bit(monkeypatch, chunk):
    x = _values(64 * 7 + 5, 1, "float64")
    with kernels.disabled():
        whole = optim.sum_of_squares(x)
        monkeypatch.setattr(optim, "SQUARES_CHUNK", chunk)
        assert optim.sum_of_squares(x) == whole == _by_definition(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_cpu_fast_path_gives_the_reference_bits(monkeypatch, dtype):
    for n in SIZES:
        x = _values(n, n, dtype)
        with kernels.disabled():
            ref = optim.sum_of_squares(x)
        numba_takes = numba_cpu.AVAILABLE and dtype != "float16"     # (float16 goes to the NumPy path)
        for ran in ("numba", "cpu") if numba_takes else ("cpu",):
            with monkeypatch.context() as m:
                if ran == "cpu":
                    m.setattr(numba_cpu, "AVAILABLE", False)
                assert kernels.implementation(optim.sum_of_squares, x) == ran
                got = optim.sum_of_squares(x)
            assert got.dtype == np.float64 and got.shape == ()
            assert got.tobytes() == ref.tobytes(), f"{ran}, n={n}: {float(got)!r} vs {float(ref)!r}"


_OTHER_TARGET = """
import json, sys
import numpy as np
from npformer.kernels.numba_cpu import optim
from tests.ops.test_sum_of_squares import SIZES, _values
print(json.dumps([float(optim.sum_of_squares(_values(n, n, "float32"))).hex() for n in SIZES]))
"""


@pytest.mark.skipif(not numba_cpu.AVAILABLE, reason="numba not installed: the compiled CPU paths are off")
def test_numba_gives_the_same_bits_compiled_for_another_vector_width(tmp_path):
    """NUMBA_CPU_NAME=generic compiles for a baseline x86-64 (or the baseline of this machine's
    architecture): the loop vectorises at another width, and the bits must not change."""
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _OTHER_TARGET], env=env, cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    with kernels.disabled():
        ref = [float(optim.sum_of_squares(_values(n, n, "float32"))).hex() for n in SIZES]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ref
