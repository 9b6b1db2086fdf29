"""The benchmark suite (``npformer bench``): npformer's ops and training steps timed on numpy and cupy,
each checked first against a reference framework. The reference is a plug-in
(:func:`register_reference`, :class:`ReferenceBackend`): PyTorch's is the source checkout's
``benchmarks/torch_reference.py``, which ``python benchmarks/run.py`` registers, so that the installed
package never imports torch. Not imported by ``import npformer``."""
from npformer.bench.backends import Backend, ReferenceBackend, register_reference
from npformer.bench.cases import FULL, QUICK, fits_memory, flash_sweep_case, sweep_case
from npformer.bench.suite import DEFAULT_OUT, main, run_suite

__all__ = ["main", "run_suite", "DEFAULT_OUT", "Backend", "ReferenceBackend", "register_reference", "QUICK", "FULL",
           "sweep_case", "flash_sweep_case", "fits_memory"]
