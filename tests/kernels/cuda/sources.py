"""The CUDA C only the tests compile, beside the shipped sources it is compiled with: the kernels that
test each warp primitive (warp_test.cu, after npformer's warp.cuh and prelude.cuh) and flash attention's test kernels
(flash_test.cu, after flash.cu, with :data:`FLASH_TEST_KERNELS`: each shipped instantiation's
``npf_fa_geometry``). On a GPU each is a module of its own; emulated, the flash test kernels join the
one flash library (:data:`FLASH_EMULATED_SOURCE`, :data:`FLASH_EMULATED_KERNELS`)."""
from __future__ import annotations

from pathlib import Path

from npformer.kernels.cuda import flash_source
from npformer.kernels.cuda.source import PRELUDE
from npformer.kernels.cuda.warp_source import WARP_PRIMITIVES, WARPGROUP_NVRTC_OPTIONS, WARPGROUP_PRIMITIVES

__all__ = ["PRIMITIVES_SOURCE", "PRIMITIVES_NVRTC_OPTIONS", "WARPGROUP_TEST_SOURCE", "WARPGROUP_TEST_OPTIONS",
           "WARPGROUP_TEST_KERNELS", "FLASH_TEST_SOURCE", "FLASH_TEST_KERNELS", "FLASH_EMULATED_SOURCE",
           "FLASH_EMULATED_KERNELS", "geometry_kernel"]

_HERE = Path(__file__).parent

# the primitives, the prelude (bfloat16's type and conversions), the test kernels
PRIMITIVES_SOURCE = WARP_PRIMITIVES + PRELUDE + (_HERE / "warp_test.cu").read_text(encoding="utf-8")
PRIMITIVES_NVRTC_OPTIONS = ("--fmad=true",)

# Hopper's warpgroup primitives and their test kernel (warpgroup_test.cu), a module for sm_90a; the kernel
# is a template, one name expression per shape (N, K), operand source and type
WARPGROUP_TEST_SOURCE = (WARP_PRIMITIVES + WARPGROUP_PRIMITIVES + PRELUDE
                         + (_HERE / "warpgroup_test.cu").read_text(encoding="utf-8"))
WARPGROUP_TEST_OPTIONS = PRIMITIVES_NVRTC_OPTIONS + WARPGROUP_NVRTC_OPTIONS
WARPGROUP_TEST_KERNELS = tuple(f"npf_test_wgmma<{n}, {k}, {rs}, {trans_b}, {bf16}>"
                               for n in (64, 128) for k in (16, 64)
                               for rs, trans_b in (("false", 0), ("true", 0), ("true", 1))
                               for bf16 in ("false", "true"))


def geometry_kernel(expression: str) -> str:
    """The ``npf_fa_geometry`` instantiation of the traits of ``npf_fa_kernel<K>``'s name expression."""
    return expression.replace("npf_fa_kernel<", "npf_fa_geometry<", 1)


_FLASH_TESTS = (_HERE / "flash_test.cu").read_text(encoding="utf-8")
_SHIPPED = tuple(dict.fromkeys(e for modules in (flash_source.MODULE_KERNELS, flash_source.WGMMA_MODULE_KERNELS)
                               for kernels in modules.values() for e in kernels.values()))
FLASH_TEST_SOURCE = flash_source.FLASH_SOURCE + "\n" + _FLASH_TESTS
FLASH_TEST_KERNELS = tuple(geometry_kernel(e) for e in _SHIPPED)
FLASH_EMULATED_SOURCE = flash_source.FLASH_EMULATED_SOURCE + "\n" + _FLASH_TESTS
FLASH_EMULATED_KERNELS = _SHIPPED + FLASH_TEST_KERNELS
