import pytest

from npformer import kernels


@pytest.fixture(autouse=True)
def numpy_fast_paths():
    """These tests hold the NumPy fast paths to the reference: the compiled ones (numba installed),
    which would otherwise run first, are switched off (tests/kernels/numba_cpu tests those)."""
    with kernels.disabled("numba"):
        yield
