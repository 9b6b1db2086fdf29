"""Shared fixtures: the ``xp`` backend fixture and the hypothesis profiles.

Profiles (``pytest --hypothesis-profile=NAME``, or ``HYPOTHESIS_PROFILE=NAME``):

* ``ci`` (default): derandomized, 15 examples a test, no deadline; what ``.ci/run`` uses;
* ``deep``: 300 random examples a test, for a long run by hand.

The tests run in a temporary working directory (``npformer train`` writes its run directory under
``runs/`` there, never into the checkout); a test that needs the checkout names it by its path.
"""
import os

import pytest
from hypothesis import HealthCheck, settings

from npformer.backend import cupy_available, get_backend

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
settings.register_profile("ci", derandomize=True, max_examples=15, deadline=None,
                          suppress_health_check=_SUPPRESS, print_blob=True)
settings.register_profile("deep", max_examples=300, deadline=None,
                          suppress_health_check=_SUPPRESS, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module", autouse=True)
def _module_working_directory(tmp_path_factory):
    """A fresh working directory for each test module, where its module fixtures run, the checkout's
    restored after it."""
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(before)


@pytest.fixture(autouse=True)
def _working_directory(_module_working_directory, tmp_path_factory):
    """A fresh working directory for each test (not its tmp_path). A run that writes the default run
    directory (runs/TASK-MODEL) never meets another test's or module's, which npformer train refuses
    to replace."""
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(before)


@pytest.fixture(scope="session", params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    """The array module under test; the cupy case is skipped when CuPy or a GPU is absent."""
    if request.param == "cupy" and not cupy_available():
        pytest.skip("CuPy is not installed or no CUDA device is visible")
    return get_backend(request.param)
