"""Runs the fused kernels' CUDA C on the CPU, so their logic is tested where no GPU is present.

The kernel source (npformer.kernels.cuda.source.KERNELS_SOURCE, everything but the two PTX float16
conversions) is compiled by g++ with a small shim: ``__global__``/``__device__`` vanish,
``__shared__`` becomes ``static`` (one block runs at a time), float16 conversions use ``_Float16``
(round to nearest even, as ``cvt.rn``), and every CUDA thread of a block is a fiber (``ucontext``).
The fibers run one after another up to each ``__syncthreads``, a legal CUDA schedule with the
largest skew between threads, so a missing barrier changes results here; a barrier that not every
thread of the block reaches is reported as an error instead of hanging.

:class:`EmulatedModule` stands in for ``cupy.RawModule``: ``get_function(name)`` returns a callable
with ``RawKernel``'s signature ``(grid, block, args)``, which checks what a GPU would not: every
array argument is a C-contiguous NumPy array of the pointer's element type, every scalar a NumPy
scalar of the parameter's exact type, and the launch shape is legal.
"""
from __future__ import annotations

import ctypes
import hashlib
import re
import subprocess
from pathlib import Path

import numpy as np

from npformer.kernels.cuda.flash_source import STRIDED
from npformer.kernels.cuda.source import KERNELS_SOURCE, MAX_THREADS

SHIM = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#include <ucontext.h>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

struct npf_uint3 { unsigned x, y, z; };
npf_uint3 threadIdx, blockIdx, blockDim, gridDim;      // external linkage: reloaded after every switch

static inline float npf_load(unsigned short h) { _Float16 f; std::memcpy(&f, &h, 2); return (float)f; }
static inline void npf_store(unsigned short* p, float v) { _Float16 f = (_Float16)v; std::memcpy(p, &f, 2); }

struct NpfFiber { ucontext_t ctx; unsigned tx, ty; bool done, at_barrier; };
static ucontext_t npf_scheduler;
static std::vector<NpfFiber> npf_fibers;
static std::vector<std::vector<char>> npf_stacks;
static size_t npf_current;
static const std::function<void()>* npf_body;
static int npf_error;

static void __syncthreads() {
    NpfFiber& f = npf_fibers[npf_current];
    f.at_barrier = true;
    swapcontext(&f.ctx, &npf_scheduler);
}

static void npf_fiber_main() {
    (*npf_body)();
    npf_fibers[npf_current].done = true;      // returning resumes uc_link, the scheduler
}

// Runs the grid block by block; returns 0, or 1 when a block's threads disagreed on a barrier.
static int npf_run_grid(unsigned gx, unsigned gy, unsigned bx, unsigned by, const std::function<void()>& body) {
    gridDim = {gx, gy, 1};
    blockDim = {bx, by, 1};
    npf_body = &body;
    size_t n = (size_t)bx * by;
    npf_fibers.assign(n, NpfFiber());
    if (npf_stacks.size() < n) npf_stacks.resize(n, std::vector<char>(1 << 16));
    for (unsigned j = 0; j < gy; ++j) {
        for (unsigned i = 0; i < gx; ++i) {
            blockIdx = {i, j, 0};
            for (size_t k = 0; k < n; ++k) {
                NpfFiber& f = npf_fibers[k];
                f.tx = (unsigned)(k % bx);
                f.ty = (unsigned)(k / bx);
                f.done = f.at_barrier = false;
                getcontext(&f.ctx);
                f.ctx.uc_stack.ss_sp = npf_stacks[k].data();
                f.ctx.uc_stack.ss_size = npf_stacks[k].size();
                f.ctx.uc_link = &npf_scheduler;
                makecontext(&f.ctx, npf_fiber_main, 0);
            }
            for (;;) {                        // one round: every live thread runs to a barrier or its end
                for (size_t k = 0; k < n; ++k) {
                    NpfFiber& f = npf_fibers[k];
                    if (f.done) continue;
                    f.at_barrier = false;
                    npf_current = k;
                    threadIdx = {f.tx, f.ty, 0};
                    swapcontext(&npf_scheduler, &f.ctx);
                }
                size_t done = 0;
                for (size_t k = 0; k < n; ++k) done += npf_fibers[k].done;
                if (done == n) break;
                if (done != 0) {
                    std::fprintf(stderr, "emulator: __syncthreads reached by %zu of %zu threads of block (%u, %u)\n",
                                 n - done, n, i, j);
                    return 1;
                }
            }
        }
    }
    return 0;
}
"""

_ENTRY = re.compile(r'extern "C" __global__ void (npf_\w+)\(([^)]*)\)')
_POINTEE = {"unsigned short": np.float16, "float": np.float32, "double": np.float64, "bool": np.bool_,
            "long long": np.int64, "unsigned long long": np.uint64}
_SCALAR = {"long long": (np.int64, ctypes.c_longlong), "int": (np.int32, ctypes.c_int),
           "float": (np.float32, ctypes.c_float), "double": (np.float64, ctypes.c_double)}
_ROW_KERNELS = ("npf_softmax_", "npf_layer_norm_")


def _parse(params: str):
    """[(c type, is_pointer, name)] of a kernel's parameter list."""
    out = []
    for p in params.split(","):
        m = re.fullmatch(r"\s*(?:const\s+)?([\w ]+?)\s*(\*?)\s*(\w+)\s*", p)
        out.append((m.group(1), bool(m.group(2)), m.group(3)))
    return out


def _trampolines(kernels) -> str:
    text = []
    for name, params in kernels:
        names = ", ".join(p[2] for p in _parse(params))
        text.append(f'extern "C" int launch_{name}(unsigned gx, unsigned gy, unsigned bx, unsigned by, {params}) {{\n'
                    f"    return npf_run_grid(gx, gy, bx, by, [&]() {{ {name}({names}); }});\n}}\n")
    return "\n".join(text)


def build(directory: Path, kernels_source: str = KERNELS_SOURCE) -> Path:
    """Compiles the kernels with the shim into a shared library in ``directory`` (cached by hash)."""
    source = SHIM + kernels_source + "\n" + _trampolines(_ENTRY.findall(kernels_source))
    lib = Path(directory) / f"npf_emulated_{hashlib.sha256(source.encode()).hexdigest()[:16]}.so"
    if not lib.exists():
        src = lib.with_suffix(".cpp")
        src.write_text(source)
        cmd = ["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(lib), str(src)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"g++ failed on the emulated kernels:\n{res.stderr[-4000:]}")
    return lib


class EmulatedKernel:
    def __init__(self, lib, name: str, params: str):
        self.name, self.params = name, _parse(params)
        self.fn = getattr(lib, f"launch_{name}")
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.c_uint] * 4 + [
            ctypes.c_void_p if ptr else _SCALAR[ctype][1] for ctype, ptr, _ in self.params]

    def __call__(self, grid, block, args, shared_mem=0):
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        assert grid[2] == 1 and block[2] == 1, f"{self.name}: 3-d launches are not used"
        assert 1 <= grid[0] < 2 ** 31 and 1 <= grid[1] <= 65535, f"{self.name}: illegal grid {grid}"
        assert all(b >= 1 for b in block) and block[0] * block[1] <= 1024, f"{self.name}: illegal block {block}"
        if self.name.startswith(_ROW_KERNELS):
            bx = block[0]
            assert bx & (bx - 1) == 0 and bx <= MAX_THREADS and block[1] == 1, \
                f"{self.name}: row kernels need a power-of-two block <= {MAX_THREADS}, got {block}"
        assert len(args) == len(self.params), f"{self.name}: {len(args)} arguments for {len(self.params)} parameters"
        values = []
        for a, (ctype, ptr, pname) in zip(args, self.params):
            if ptr:
                assert isinstance(a, np.ndarray), f"{self.name}.{pname}: expected an array, got {type(a)}"
                if self.name.startswith("npf_fa_") and pname in STRIDED:   # strided heads: rows may be apart
                    assert a.strides[-1] == a.itemsize and min(a.strides) >= 0, \
                        f"{self.name}.{pname}: strides {a.strides} (the last axis must be contiguous)"
                else:
                    assert a.flags.c_contiguous, f"{self.name}.{pname}: array is not C-contiguous"
                assert a.dtype == _POINTEE[ctype], f"{self.name}.{pname}: {a.dtype} for a {ctype}*"
                values.append(a.ctypes.data)
            else:
                want = _SCALAR[ctype][0]
                assert type(a) is want, f"{self.name}.{pname}: {type(a).__name__} for a {ctype} (pass {want.__name__})"
                values.append(a.item())
        rc = self.fn(grid[0], grid[1], block[0], block[1], *values)
        assert rc == 0, f"{self.name}: threads of one block disagreed on a __syncthreads (see stderr)"


class EmulatedModule:
    """``cupy.RawModule`` for the emulated kernels."""

    def __init__(self, lib_path: Path, kernels_source: str = KERNELS_SOURCE):
        self.lib = ctypes.CDLL(str(lib_path))
        self.entries = dict(_ENTRY.findall(kernels_source))

    def get_function(self, name: str) -> EmulatedKernel:
        return EmulatedKernel(self.lib, name, self.entries[name])
