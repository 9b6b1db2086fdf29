"""NVIDIA's compiler on every CUDA kernel npformer ships, on a machine without a GPU::

    python benchmarks/cuda_kernels.py [--arch 80,90] [--out benchmarks/results]

needs the wheels ``nvidia-cuda-nvrtc-cu12`` (NVRTC, what CuPy compiles with), ``nvidia-cuda-nvcc-cu12``
(ptxas), ``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm`` (the machine code's disassembly). For each module of
:func:`npformer.kernels.cuda.runtime.shipped_modules` (the list the runtime compiles from) and each
architecture: NVRTC makes the PTX with the module's options and the ones CuPy appends
(:data:`CUPY_OPTIONS`), ptxas makes the machine code for ``sm_<arch>`` and reports each kernel's
registers, spills, stack and static shared memory, cuobjdump gives its SASS. The table per
architecture (``cuda-kernels-sm<arch>.md``) has, per kernel: those resources, the dynamic shared
memory and the block size its launcher uses, the theoretical occupancy at that block size with the
resource that limits it, and the instruction mix (FFMA, HMMA: tensor cores, LDGSTS: cp.async, LDSM:
ldmatrix, SHFL, BAR); and for each tensor-core kernel its main loop's instructions per HMMA, in all and
by issue pipe (:func:`main_loop`). ``tests/kernels/cuda/test_compile.py`` holds the kernels to these
numbers.

Occupancy is the theoretical one of NVIDIA's occupancy calculator: resident warps per SM over the
SM's 64, the fewest blocks that threads (2048 an SM), blocks (32), registers (65,536 an SM, given
out 256 a warp) or shared memory (164 KiB an SM on sm_80, 228 KiB on sm_90; 1 KiB more per block
kept by the system) allow.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

__all__ = ["CUPY_OPTIONS", "ARCHS", "SM_LIMITS", "MIX", "PIPES", "LOOP_COLUMNS", "Kernel",
           "Tools", "find_tools", "sass_functions", "main_loop", "simt_tile_loop", "compile_module", "compile_all",
           "block_threads", "dynamic_shared", "occupancy", "occupancy_floor", "report", "main"]

CUPY_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")   # CuPy 14 adds these (and -arch)
ARCHS = (80, 90)
# per SM: max warps, max blocks, registers, shared memory for blocks (bytes), shared memory per block
SM_LIMITS = {80: dict(warps=64, blocks=32, registers=65536, shared=167936, block_shared=166912),
             90: dict(warps=64, blocks=32, registers=65536, shared=233472, block_shared=232448)}
RESERVED_SHARED = 1024           # per block, kept by the system (compute capability 8.0 and later)
MIX = ("FFMA", "HMMA", "HGMMA", "LDGSTS", "LDSM", "SHFL", "BAR")   # SASS opcodes counted (HMMA, HGMMA: tensor cores)
# The issue pipes of the opcodes in a tensor-core kernel's main loop (Volta and later: integer
# multiply-add issues to the FMA pipe, min/max, compares, selects and moves to the ALU, MUFU and
# conversions to XU, shared memory to LSU); "other" is the rest (branches, barriers, shuffles, global
# memory). An mma.sync keeps Hopper's tensor cores busy only with about 5 others issued per HMMA.
PIPES = {"FMA": ("FFMA", "FMUL", "FADD", "IMAD", "HFMA2", "HADD2", "HMUL2", "FSWZADD"),
         "ALU": ("IADD3", "LOP3", "ISETP", "FSETP", "SHF", "SEL", "FSEL", "FMNMX", "IMNMX", "VIMNMX", "VIADD", "LEA",
                 "IABS", "PRMT", "PLOP3", "MOV", "UMOV", "P2R", "R2P", "CS2R", "S2R", "FCHK", "IADD", "ULEA",
                 "UIADD3", "USEL", "ULOP3", "UISETP", "USHF", "UIMAD", "UPRMT", "F2FP"),
         "XU": ("MUFU", "F2F", "I2F", "F2I", "I2FP", "F2IP", "FRND"),
         "LDS": ("LDS", "LDSM", "STS")}
LOOP_COLUMNS = ("FMA", "ALU", "XU", "LDS", "other")
# NVRTC compiles one program at a time in this process (its guide does not promise concurrent compiles
# for every release the wheels bring); ptxas and cuobjdump are processes of their own, so compile_all's
# threads overlap one module's NVRTC with another's ptxas, cuobjdump and SASS parsing
_NVRTC_LOCK = threading.Lock()


@dataclass
class Kernel:
    """One kernel of one module on one architecture, as ptxas and cuobjdump report it."""

    module: str
    name: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    static_shared: int = 0
    dynamic_shared: int = 0
    threads: int = 0
    mix: dict = field(default_factory=dict)
    loop: dict = field(default_factory=dict)      # the main loop's instructions by pipe (main_loop), HMMA kernels
    tile: dict = field(default_factory=dict)      # the SIMT flash kernels' tile loop (simt_tile_loop)
    occupancy: float = 0.0
    limit: str = ""


@dataclass
class Tools:
    nvrtc: str          # libnvrtc.so path
    ptxas: str
    cuobjdump: str
    nvdisasm: str       # what cuobjdump -sass runs (found through NVDISASM_PATH)


def _first(patterns: list[str]) -> str | None:
    for pattern in patterns:
        found = sorted(glob.glob(pattern))
        if found:
            return found[-1]
    return None


def find_tools() -> Tools | None:
    """The compiler wheels' files in this Python's site-packages (None when one is missing)."""
    roots = [p for p in sys.path if p.endswith("site-packages")]
    nvrtc = _first([os.path.join(r, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*") for r in roots]
                   + [os.path.join(r, "nvidia", "cu1*", "lib", "libnvrtc.so*") for r in roots])
    ptxas = _first([os.path.join(r, "nvidia", "cuda_nvcc", "bin", "ptxas") for r in roots]
                   + [os.path.join(r, "nvidia", "cu1*", "bin", "ptxas") for r in roots])
    cuobjdump = _first([os.path.join(r, "nvidia", "cu1*", "bin", "cuobjdump") for r in roots]
                       + [os.path.join(r, "nvidia", "cuda_cuobjdump", "bin", "cuobjdump") for r in roots])
    nvdisasm = _first([os.path.join(r, "nvidia", "cu1*", "bin", "nvdisasm") for r in roots]
                      + [os.path.join(r, "nvidia", "cuda_nvdisasm", "bin", "nvdisasm") for r in roots])
    if not (nvrtc and ptxas and cuobjdump and nvdisasm):
        return None
    return Tools(nvrtc, ptxas, cuobjdump, nvdisasm)


def nvrtc_ptx(tools: Tools, source: str, options: tuple, name_expressions=()) -> tuple[str, str, dict[str, str]]:
    """(PTX, NVRTC's log, ``{name expression: lowered name}``) of ``source`` compiled with ``options`` and the
    template instantiations ``name_expressions`` (as CuPy's RawModule asks NVRTC for them); RuntimeError
    with the log on failure."""
    with _NVRTC_LOCK:
        return _nvrtc_ptx(ctypes.CDLL(tools.nvrtc), source, options, name_expressions)


def _nvrtc_ptx(lib, source: str, options: tuple, name_expressions) -> tuple[str, str, dict[str, str]]:
    prog = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"npformer.cu", 0, None, None), "create")
    try:
        for expression in name_expressions:
            _check(lib.nvrtcAddNameExpression(prog, expression.encode()), f"add name expression {expression}")
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace").strip()
        if status != 0:
            raise RuntimeError(f"NVRTC failed ({status}): {text}")
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetPTX(prog, ptx), "get PTX")
        lowered = {}
        for expression in name_expressions:
            name = ctypes.c_char_p()
            _check(lib.nvrtcGetLoweredName(prog, expression.encode(), ctypes.byref(name)), f"lower {expression}")
            lowered[expression] = name.value.decode()
        return ptx.value.decode(), text, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"NVRTC {what} failed with status {status}")


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for 'sm_\d+a?'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")


_PROPERTIES = re.compile(r"Function properties for (\w+)")


def parse_ptxas(module: str, text: str) -> dict[str, Kernel]:
    """The kernels of ``ptxas -v``'s report: registers, stack, spills, static shared memory. A frame
    line belongs to the function named by the "Function properties for" line before it (a kernel's
    own, or a non-inlined function's, which is not the kernel's)."""
    kernels, current, described = {}, None, None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = kernels[m.group(1)] = Kernel(module, m.group(1))
            continue
        m = _PROPERTIES.search(line)
        if m:
            described = m.group(1)
            continue
        if current is None:
            continue
        m = _FRAME.search(line)
        if m and described == current.name:
            current.stack, current.spill_stores, current.spill_loads = (int(g) for g in m.groups())
        m = _USED.search(line)
        if m:
            current.registers = int(m.group(1))
            current.static_shared = int(m.group(2) or 0)
    return kernels


def parse_sass(text: str) -> dict[str, collections.Counter]:
    """Opcode counts per function of ``cuobjdump -sass`` (an opcode's modifiers dropped: HMMA.16816 -> HMMA)."""
    counts, current = {}, None
    for line in text.splitlines():
        m = re.search(r"Function : (\w+)", line)
        if m:
            current = counts[m.group(1)] = collections.Counter()
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m and current is not None:
            current[m.group(1)] += 1
    return counts


_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\S*)\s*([^;]*);")


def sass_functions(text: str) -> dict[str, list[tuple[int, str, str, str]]]:
    """Each function of ``cuobjdump -sass`` as its instructions: (address, opcode without modifiers,
    operands, modifiers)."""
    functions, current = {}, None
    for line in text.splitlines():
        m = re.search(r"Function : (\w+)", line)
        if m:
            current = functions[m.group(1)] = []
            continue
        m = _LINE.match(line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(2), m.group(4).strip(), m.group(3)))
    return functions


def _hmma(opcode: str, modifiers: str) -> int:
    """The warp's m16n8k16 products an instruction stands for: 1 an HMMA, N / 8 a wgmma (HGMMA.64xNx16: a
    warpgroup's 64 rows, 16 a warp), 0 the rest."""
    if opcode == "HMMA":
        return 1
    m = re.match(r"\.64x(\d+)x16", modifiers) if opcode == "HGMMA" else None
    return int(m.group(1)) // 8 if m else 0


def _loops(instructions: list[tuple[int, str, str, str]]) -> dict[tuple[int, int], list[tuple[str, str]]]:
    """The loops of a function, statically: each branch back to an earlier address closes one, ``{(first
    address, branch's address): its instructions as (opcode, modifiers), NOPs left out}``."""
    spans = []
    for address, opcode, operands, _ in instructions:
        m = re.match(r"(0x[0-9a-f]+)", operands)
        if opcode == "BRA" and m and int(m.group(1), 16) <= address:
            spans.append((int(m.group(1), 16), address))
    return {span: [(op, mods) for a, op, _, mods in instructions if span[0] <= a <= span[1] and op != "NOP"]
            for span in spans}


def _innermost(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The spans that hold none of the others."""
    return [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]


def main_loop(instructions: list[tuple[int, str, str, str]]) -> dict[str, int]:
    """The main loop of a tensor-core kernel, statically: of the innermost loops holding HMMA or HGMMA (a
    branch back to an earlier address closes a loop; the loop over heads around the tile loops is not
    innermost), the one with the most tensor work, the smallest of those (the dense kernels' loop over the
    tiles that need no masks, beside the loop over those that do), its instructions counted by pipe
    (:data:`PIPES`) with "total" (NOPs left out, tensor instructions in) and "HMMA": the warp's m16n8k16
    products (an HGMMA.64xNx16 counts N / 8, :func:`_hmma`). Every instruction counts once, whether its
    branch is taken or not: what the loop body is, not what one pass runs. "calls": the loop's CALLs, whose
    callees' instructions are not in the counts (a function the compiler kept out of line); "copies": its
    cp.async copies (LDGSTS), in the counts. Empty without such a loop."""
    bodies = _loops(instructions)
    work = {span: sum(_hmma(*i) for i in body) for span, body in bodies.items()}
    innermost = _innermost([span for span in bodies if work[span]])
    if not innermost:
        return {}
    span = min(innermost, key=lambda s: (-work[s], len(bodies[s])))
    pipe_of = {op: pipe for pipe, ops in PIPES.items() for op in ops}
    counts = collections.Counter(pipe_of.get(op, "tensor" if _hmma(op, mods) else "other") for op, mods in bodies[span])
    opcodes = [op for op, _ in bodies[span]]
    return {"total": len(bodies[span]), "HMMA": work[span], **{p: counts[p] for p in LOOP_COLUMNS},
            "calls": opcodes.count("CALL"), "copies": opcodes.count("LDGSTS")}


def simt_tile_loop(instructions: list[tuple[int, str, str, str]]) -> dict[str, int]:
    """The tile loop of a SIMT flash kernel, statically (as :func:`main_loop`: every instruction once, its
    branch taken or not): of the loops that hold the tile products' loops (npf_fa_dot's, npf_fa_acc's: loops
    of under 200 instructions, at least 32 of them and 60% FFMA or DFMA), the innermost, the smallest of
    those (a dense kernel's loop over the tiles that need no mask). "products": how many product loops it
    holds, "product": one pass of one (instructions, on average), "rest": its other instructions (the
    scores, softmax, stores, copies, barriers), "calls": its CALLs (their callees not counted, as in
    :func:`main_loop`). Empty without such a loop, or with tensor-core instructions."""
    if any(_hmma(op, mods) for _, op, _, mods in instructions):
        return {}
    bodies = {span: [op for op, _ in body] for span, body in _loops(instructions).items()}
    fma = {s: body.count("FFMA") + body.count("DFMA") for s, body in bodies.items()}
    products = [s for s, body in bodies.items() if len(body) < 200 and fma[s] >= max(32, 0.6 * len(body))]
    inside = {s: [p for p in products if s[0] < p[0] and p[1] < s[1]] for s in bodies}
    innermost = _innermost([s for s in bodies if inside[s]])
    if not innermost:
        return {}
    span = min(innermost, key=lambda s: len(bodies[s]))
    product = sum(len(bodies[p]) for p in inside[span])
    return {"products": len(inside[span]), "product": product // len(inside[span]),
            "rest": len(bodies[span]) - product, "calls": bodies[span].count("CALL")}


def compile_module(tools: Tools, name: str, source: str, options: tuple, arch: int, workdir: str,
                   threads: dict[str, int] | None = None, instances: dict[str, str] | None = None
                   ) -> tuple[dict[str, Kernel], str]:
    """Every kernel of one module for ``sm_<arch>`` and the compilers' warnings (NVRTC's log, ptxas's).
    ``threads``: each kernel's block size, for a module npformer does not launch (the tests'); else
    :func:`block_threads`. ``instances``: the module's template instantiations, ``{name: name
    expression}`` (runtime.Module.kernels), each kernel reported under its name, not its mangled one."""
    instances = instances or {}
    ptx, log, lowered = nvrtc_ptx(tools, source, tuple(options) + CUPY_OPTIONS + (f"-arch=compute_{arch}",),
                                  tuple(instances.values()))
    named = {lowered[expression]: label for label, expression in instances.items()}
    ptx_path, cubin = os.path.join(workdir, f"{name}_{arch}.ptx"), os.path.join(workdir, f"{name}_{arch}.cubin")
    with open(ptx_path, "w") as f:
        f.write(ptx)
    target = re.search(r"^\.target (sm_\w+)", ptx, re.M).group(1)     # sm_90a where the options ask for it
    run = subprocess.run([tools.ptxas, f"-arch={target}", "-v", "-o", cubin, ptx_path], capture_output=True,
                         text=True, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"ptxas failed on {name} for sm_{arch}: {run.stderr}")
    kernels = {named.get(fn, fn): k for fn, k in parse_ptxas(name, run.stdout + run.stderr).items()}
    for fn, k in kernels.items():
        k.name = fn
    warnings = "\n".join(x for x in (log, "\n".join(line for line in (run.stdout + run.stderr).splitlines()
                                                     if "warning" in line.lower())) if x)
    sass = subprocess.run([tools.cuobjdump, "-sass", cubin], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, NVDISASM_PATH=os.path.dirname(tools.nvdisasm)))
    if sass.returncode != 0:
        raise RuntimeError(f"cuobjdump failed on {name} for sm_{arch}: {sass.stderr}")
    for fn, counts in parse_sass(sass.stdout).items():
        if named.get(fn, fn) in kernels:
            kernels[named.get(fn, fn)].mix = {op: counts.get(op, 0) for op in MIX}
    for fn, instructions in sass_functions(sass.stdout).items():
        if named.get(fn, fn) in kernels:
            kernels[named.get(fn, fn)].loop = main_loop(instructions)
            kernels[named.get(fn, fn)].tile = simt_tile_loop(instructions) if "npf_fa_" in named.get(fn, fn) else {}
    for k in kernels.values():
        k.threads = threads[k.name] if threads is not None else block_threads(k.name)
        k.dynamic_shared = dynamic_shared(k.name)
        k.occupancy, k.limit = occupancy(k, arch)
    return kernels, warnings


def _base(name: str) -> str:
    """An entry point's name without ``npf_``, the dtype suffix and the flash head-size bucket."""
    return re.sub(r"(_d\d+)?_(f16|bf16|f32|f64)$", "", name.removeprefix("npf_"))


def block_threads(name: str) -> int:
    """Threads per block of the launch that starts entry point ``name`` (the most a row launch uses)."""
    from npformer.kernels.cuda import flash_source, optim_source, runtime, source
    base = _base(name)
    kinds = {entry[0]: entry[3] for entry in source._ENTRY_POINTS}
    threads = {"row": source.MAX_THREADS, "col": source.COL_X * source.COL_Y, "": runtime.ELEMENT_THREADS}
    special = {"cross_entropy_bwd": source.MAX_THREADS,          # launch_rows, no shared buffer
               "adam_update": runtime.ELEMENT_THREADS, "adam_bf16_copy_update": runtime.ELEMENT_THREADS,
               "adam_f16_grad_update": runtime.ELEMENT_THREADS, "adam_bf16_grad_update": runtime.ELEMENT_THREADS,
               "sum_squares": optim_source.SQUARES_THREADS}
    flash = _flash(name)
    if flash:
        return flash_source.geometry(*flash)[0]
    if base in special:
        return special[base]
    if base in kinds:
        return threads[kinds[base]]
    raise KeyError(f"no launch block size known for the entry point {name}: add it to block_threads")


def occupancy_floor(name: str, arch: int) -> float | None:
    """The occupancy entry point ``name`` states it keeps on ``sm_<arch>`` (runtime.OCCUPANCY_FLOORS,
    flash_source.OCCUPANCY_FLOORS). KeyError for a kernel that states none."""
    from npformer.kernels.cuda import flash_source, runtime
    column = ARCHS.index(arch)
    base = _base(name)
    m = re.match(r"npf_fa_(fwd|bwd_dq|bwd_dkdv|bwd_pre)(_tc|_tf32|_dense|_wgmma)?(?:_causal)?(?:_d(\d+))?"
                 r"_(f16|bf16|f32|f64)$", name)
    if m:
        acc = "double" if m.group(4) == "f64" else "float"
        kernel = {"fwd": "fwd", "bwd_dq": "dq", "bwd_dkdv": "dkdv", "bwd_pre": "pre"}[m.group(1)] + (m.group(2) or "")
        if m.group(2) == "_dense" and m.group(4) == "f32":                  # float32's dense kernels are SIMT
            kernel += "_simt"
        return flash_source.OCCUPANCY_FLOORS[kernel, acc, int(m.group(3)) if m.group(3) else None][column]
    return runtime.OCCUPANCY_FLOORS[base][column]


def _flash(name: str) -> tuple | None:
    """(kernel, dtype, D) of a flash attention kernel's name (flash_source.entry_name), else None."""
    from npformer.kernels.cuda.source import TYPES
    m = re.match(r"npf_fa_(\w+?)(?:_d(\d+))?_(f16|bf16|f32|f64)$", name)
    if not m:
        return None
    dtype = next(dt for dt, (_, _, suffix) in TYPES.items() if suffix == m.group(3))
    return m.group(1), dtype, int(m.group(2)) if m.group(2) else None


def dynamic_shared(name: str) -> int:
    """Dynamic shared memory of one block of entry point ``name`` (the flash kernels' traits; 0 elsewhere)."""
    from npformer.kernels.cuda import flash_source
    flash = _flash(name)
    return flash_source.geometry(*flash)[2] if flash else 0


def occupancy(k: Kernel, arch: int) -> tuple[float, str]:
    """(resident warps per SM / max warps, the limiting resource) of ``k`` at its block size."""
    lim = SM_LIMITS[arch]
    warps = -(-k.threads // 32)
    by = {"blocks": lim["blocks"], "threads": lim["warps"] // warps}
    regs_per_warp = -(-max(k.registers, 1) * 32 // 256) * 256
    by["registers"] = (lim["registers"] // regs_per_warp) // warps
    shared = k.static_shared + k.dynamic_shared
    if shared > lim["block_shared"]:
        return 0.0, "shared memory (over the per-block maximum)"
    per_block = -(-(shared + RESERVED_SHARED) // 128) * 128
    by["shared memory"] = lim["shared"] // per_block
    limit = min(by, key=lambda r: (by[r], r != "threads"))
    return min(by.values()) * warps / lim["warps"], limit


def compile_all(tools: Tools, archs=ARCHS, workdir: str | None = None) -> dict[int, tuple[list[Kernel], dict]]:
    """``{arch: (kernels, {module: warnings})}`` over every shipped module, each for the architectures it is
    for (the Hopper modules: sm_90, as sm_90a). The modules compile on a few threads (NVRTC one at a time,
    ptxas and cuobjdump beside it); the result is in the modules' order whatever the threads' order."""
    from npformer.kernels.cuda.runtime import shipped_modules
    jobs = [(arch, name, module) for arch in archs for name, module in shipped_modules().items()
            if arch in module.archs]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        futures = [pool.submit(compile_module, tools, name, module.source, module.options, arch, workdir or tmp,
                               instances=module.kernels) for arch, name, module in jobs]
        out = {arch: ([], {}) for arch in archs}
        for (arch, name, _), future in zip(jobs, futures):
            found, warned = future.result()
            out[arch][0].extend(found.values())
            out[arch][1][name] = warned
    return out


def report(arch: int, kernels: list[Kernel], command: str) -> str:
    """The markdown table of one architecture."""
    from npformer.kernels.cuda.runtime import shipped_modules
    options = {name: " ".join(module.options) for name, module in shipped_modules().items()}
    flash = next(opts for name, opts in options.items() if name != "common")
    hopper = next(opts for name, opts in options.items() if name.endswith("_sm90a"))
    lines = [f"# npformer's CUDA kernels compiled for sm_{arch}", "",
             f"Made by `{command}` (NVRTC, ptxas and cuobjdump from NVIDIA's wheels; no GPU). NVRTC options: "
             f"each module's own (common: `{options['common']}`, flash: `{flash}`"
             + (f", the Hopper flash modules `*_sm90a`: `{hopper}`" if arch == 90 else "")
             + f") then CuPy's `{' '.join(CUPY_OPTIONS)} -arch=compute_{arch}`; ptxas `-arch=sm_{arch}`"
             + (" (sm_90a for the Hopper modules)." if arch == 90 else "."), "",
             "Occupancy: resident warps per SM over 64 at the launcher's block size, and what limits it.", "",
             "| module | kernel | regs | spill st/ld (B) | stack (B) | smem static + dynamic (B) | threads "
             "| occupancy | limited by | floor | " + " | ".join(MIX) + " |",
             "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(MIX)]
    for k in kernels:
        floor = occupancy_floor(k.name, arch)
        lines.append(f"| {k.module} | {k.name} | {k.registers} | {k.spill_stores}/{k.spill_loads} | {k.stack} | "
                     f"{k.static_shared} + {k.dynamic_shared} | {k.threads} | {k.occupancy:.1%} | {k.limit} | "
                     f"{floor:.1%} | "
                     + " | ".join(str(k.mix.get(op, 0)) for op in MIX) + " |")
    looped = [k for k in kernels if k.loop]
    if looped:
        lines += ["", "## The tensor-core kernels' main loops", "",
                  "The loop over key (or query) tiles in the SASS, every instruction of its body counted once "
                  "(main_loop): instructions per HMMA in all and by issue pipe. An mma.sync m16n8k16 keeps "
                  "Hopper's tensor cores busy only when about 5 other instructions or fewer issue per HMMA; "
                  "with time ~ instructions / issue rate, this column predicts a change's effect before a GPU "
                  "measures it. The `_wgmma` kernels' HMMA are m16n8k16 equivalents: an HGMMA.64xNx16 counts "
                  "N / 8 (a warp's share of the warpgroup's product), itself in the instructions. Calls: the "
                  "CALL instructions in the loop, whose callees' instructions are not counted (the flash kernels' tile "
                  "loaders: the dense float16 and bfloat16 kernels copy a whole tile in line, counted, and call "
                  "only for a ragged last tile or unaligned rows, all but the forward at head size 32; the "
                  "others call for every tile).", "",
                  "| module | kernel | regs | occupancy | loop instructions | HMMA | per HMMA | "
                  + " | ".join(f"{c} / HMMA" for c in LOOP_COLUMNS) + " | calls |",
                  "|---|---|---|---|---|---|---|" + "---|" * (len(LOOP_COLUMNS) + 1)]
        for k in looped:
            h = k.loop["HMMA"]
            lines.append(f"| {k.module} | {k.name} | {k.registers} | {k.occupancy:.1%} | {k.loop['total']} | {h} | "
                         f"{k.loop['total'] / h:.1f} | " + " | ".join(f"{k.loop[c] / h:.1f}" for c in LOOP_COLUMNS)
                         + f" | {k.loop['calls']} |")
    tiled = [k for k in kernels if k.tile]
    if tiled:
        lines += ["", "## The SIMT flash kernels' tile loops", "",
                  "The loop over key (or query) tiles of the kernels without tensor cores (float32 without TF32, "
                  "float64, and the 16-bit types before sm_80), statically as above (simt_tile_loop): the tile "
                  "products' loops (npf_fa_dot, npf_fa_acc; one pass each, run D / 4 or tile / 4 times a tile) and "
                  "the rest of the loop's body. The general kernels' rest counts every feature's branch once, "
                  "taken or not; the dense ones (`_dense`: no masks, padding or dropout) hold only what their "
                  "tiles run. The products' loops are FFMA-dense, so the rest, run once a tile, is the overhead "
                  "that time ~ instructions / issue rate sees. Calls as above: these kernels' tile loaders, not "
                  "counted.", "",
                  "| module | kernel | regs | occupancy | product loops | instructions a pass "
                  "| rest of the tile loop | calls |",
                  "|---|---|---|---|---|---|---|---|"]
        for k in tiled:
            lines.append(f"| {k.module} | {k.name} | {k.registers} | {k.occupancy:.1%} | {k.tile['products']} | "
                         f"{k.tile['product']} | {k.tile['rest']} | {k.tile['calls']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/cuda_kernels.py", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default=",".join(map(str, ARCHS)), help="comma list of compute capabilities")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"), help="folder for the tables")
    args = ap.parse_args(argv)
    archs = tuple(int(a) for a in args.arch.split(","))
    if set(archs) - set(SM_LIMITS):
        ap.error(f"--arch: expected some of {', '.join(map(str, SM_LIMITS))}, got {args.arch}")
    tools = find_tools()
    if tools is None:
        ap.error("NVIDIA's compiler wheels are missing: pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12 "
                 "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    os.makedirs(args.out, exist_ok=True)
    for arch, (kernels, warnings) in compile_all(tools, archs).items():
        path = os.path.join(args.out, f"cuda-kernels-sm{arch}.md")
        with open(path, "w") as f:
            f.write(report(arch, kernels, "python benchmarks/cuda_kernels.py"))
        warned = {m: w for m, w in warnings.items() if w}
        print(f"sm_{arch}: {len(kernels)} kernels, {sum(k.spill_stores + k.stack > 0 for k in kernels)} with "
              f"spills or stack, {len(warned)} modules with warnings -> {path}")
        for m, w in warned.items():
            print(f"  {m}: {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
