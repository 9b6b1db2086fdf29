"""The CUDA C only the tests compile, beside the shipped sources it is compiled with: the kernels that
test each warp primitive (warp_test.cu, after npformer's warp.cuh) and flash attention's test kernels
(flash_test.cu, after flash.cu). On a GPU each is a module of its own; emulated, the flash test
kernels join the one flash library (:data:`FLASH_EMULATED_SOURCE`)."""
from __future__ import annotations

from pathlib import Path

from npformer.kernels.cuda import flash_source
from npformer.kernels.cuda.warp_source import WARP_PRIMITIVES

__all__ = ["PRIMITIVES_SOURCE", "PRIMITIVES_NVRTC_OPTIONS", "FLASH_TEST_SOURCE", "FLASH_EMULATED_SOURCE"]

_HERE = Path(__file__).parent

PRIMITIVES_SOURCE = WARP_PRIMITIVES + (_HERE / "warp_test.cu").read_text(encoding="utf-8")
PRIMITIVES_NVRTC_OPTIONS = ("--fmad=true",)


def _shared_sizes() -> str:
    """npf_fa_shared_sizes: the shared-memory bytes each kernel carves, in flash_source.SHARED's order, then
    each dense kernel's traits (shared bytes, rows a block, tile) in flash_source.DENSE_SHARED's."""
    lines = [f"    bytes[n++] = (long long)(NpfFaShape<{acc}, {d}, {flash_source.TILES[acc, d][0]}, "
             f"{flash_source.TILES[acc, d][1]}>::{kernel.upper()} * sizeof({acc}));"
             for kernel, acc, d in flash_source.SHARED]
    block = {"fwd": "BR", "bwd_dq": "BR", "bwd_dkdv": "BC"}
    tile = {"fwd": "BC", "bwd_dq": "BC", "bwd_dkdv": "BQ"}
    for kernel, d in flash_source.DENSE_SHARED:
        traits = f"{flash_source.DENSE_TRAITS[kernel]}<{d}>"
        lines += [f"    bytes[n++] = {traits}::SHARED;", f"    bytes[n++] = {traits}::{block[kernel]};",
                  f"    bytes[n++] = {traits}::{tile[kernel]};"]
    body = "\n".join(lines)
    return ('extern "C" __global__ void npf_fa_shared_sizes(long long* bytes) {\n'
            "    if (threadIdx.x != 0 || blockIdx.x != 0) return;\n"
            f"    int n = 0;\n{body}\n}}\n")


_FLASH_TESTS = (_HERE / "flash_test.cu").read_text(encoding="utf-8") + "\n" + _shared_sizes()
FLASH_TEST_SOURCE = flash_source.FLASH_KERNELS + "\n" + _FLASH_TESTS
FLASH_EMULATED_SOURCE = flash_source.FLASH_EMULATED_SOURCE + "\n" + _FLASH_TESTS
