"""The CUDA C of npformer's kernels lives in the ``.cu`` and ``.cuh`` files beside this module (package
data), one home each: ``prelude.cuh`` (what every module starts with), ``half.cuh`` (float16's two PTX
conversions), ``elementwise.cu``, ``fused.cu``, ``optim.cu``, ``warp.cuh``, ``flash.cu``. The Python
modules beside them assemble NVRTC's sources from these (constants filled in, ``extern "C"`` entry
points written per dtype); the CPU emulator (tests/kernels/cuda) and the compile check
(benchmarks/cuda_kernels.py) read those same assembled sources. The kernels only the tests launch
are the tests' (tests/kernels/cuda/*.cu).
"""
from __future__ import annotations

from importlib import resources

__all__ = ["read_source"]


def read_source(name: str) -> str:
    """The text of the CUDA C file ``name`` shipped with this package."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
