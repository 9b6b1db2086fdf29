"""The backends the suite measures: npformer on numpy or cupy, PyTorch on cpu or cuda.

A :class:`Backend` knows how to put a host array on its device, bring a result back, wait for the
device, measure a call's peak memory and its own float32 matmul rate. torch and cupy are imported
only when a backend of theirs is made.
"""
from __future__ import annotations

import os
import platform
import re
from typing import Any, Callable

import numpy

from benchmarks.harness import host_peak_mb, time_call

__all__ = ["Backend", "TORCH_BESIDE", "make_backends", "device_name"]

TORCH_BESIDE = {"numpy": "torch-cpu", "cupy": "torch-cuda"}     # the PyTorch column of each npformer one


class Backend:
    """One framework on one device: ``numpy`` / ``cupy`` (npformer), ``torch-cpu`` / ``torch-cuda``."""

    def __init__(self, name: str, threads: int):
        self.name, self.threads = name, threads
        self.framework = "torch" if name.startswith("torch") else "npformer"
        self.device = "cuda" if name in ("cupy", "torch-cuda") else "cpu"
        self.xp = self.torch = None
        if self.framework == "torch":
            import torch
            torch.set_num_threads(threads)
            # The suite is float32 throughout; a caller (a test session) may have changed torch's
            # default dtype, which would build float64 modules beside float32 inputs.
            torch.set_default_dtype(torch.float32)
            self.torch = torch
        else:
            from npformer.backend import get_backend
            self.xp = get_backend(name)

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"

    def sync(self) -> None:
        if self.name == "cupy":
            self.xp.cuda.get_current_stream().synchronize()
        elif self.name == "torch-cuda":
            self.torch.cuda.synchronize()

    def asarray(self, host: numpy.ndarray):
        if self.torch is not None:
            return self.torch.from_numpy(numpy.array(host, order="C")).to(self.device)   # 0-d stays 0-d
        return self.xp.asarray(host)

    def to_host(self, a: Any) -> numpy.ndarray:
        """A host (numpy) copy of an array or tensor of this backend."""
        if self.torch is not None:
            return a.detach().cpu().numpy()
        from npformer.backend import to_numpy
        return numpy.asarray(to_numpy(a))

    def free_bytes(self) -> int:
        """Memory available now: the host's MemAvailable, or the device's free memory."""
        if self.device == "cpu":
            with open("/proc/meminfo") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
        if self.name == "cupy":
            return self.xp.cuda.runtime.memGetInfo()[0]
        return self.torch.cuda.mem_get_info()[0]

    def peak_mb(self, fn: Callable[[], Any], min_s: float = 0.2) -> float | None:
        """The most memory calls of ``fn`` add over what was held before (MB)."""
        if self.device == "cpu":
            return host_peak_mb(fn, min_s)
        if self.name == "cupy":
            pool = self.xp.get_default_memory_pool()
            pool.free_all_blocks()
            base = pool.used_bytes()
            fn()
            self.sync()
            return (pool.total_bytes() - base) / 2**20
        t = self.torch
        t.cuda.synchronize()
        t.cuda.reset_peak_memory_stats()
        base = t.cuda.memory_allocated()
        fn()
        t.cuda.synchronize()
        return (t.cuda.max_memory_allocated() - base) / 2**20

    def matmul_gflops(self, n: int, budget_s: float, warmup_s: float, precision: str = "float32") -> float:
        """Measured n x n matmul rate in ``precision`` (float32, or float16 on a GPU: tensor cores with
        float32 accumulation): the peak each row's MFU is a share of."""
        rng = numpy.random.default_rng(0)
        a, b = (self.asarray(rng.standard_normal((n, n), dtype=numpy.float32).astype(precision)) for _ in range(2))
        t = time_call(lambda: a @ b, self.sync, 2, 10, budget_s, warmup_s)
        return 2.0 * n ** 3 / (t["ms"] * 1e-3) / 1e9


def make_backends(names: list[str], threads: int) -> tuple[list[Backend], list[str]]:
    """Backends that can run here, and a note for each one that was asked for and cannot."""
    from npformer.backend import cupy_available
    out, notes = [], []
    try:
        import torch
        has_torch, has_cuda = True, torch.cuda.is_available()
    except ImportError:
        has_torch = has_cuda = False
    for name in names:
        if name == "numpy":
            out.append("numpy")
        elif name == "cupy":
            if cupy_available():
                out.append("cupy")
            else:
                notes.append("cupy: CuPy or a CUDA device is absent; GPU columns unmeasured")
        elif name == "torch":
            if not has_torch:
                notes.append("torch: not importable; no PyTorch columns")
                continue
            out += [TORCH_BESIDE[n] for n in ("numpy", "cupy") if n in names and (n == "numpy" or has_cuda)]
        else:
            raise ValueError(f"unknown backend {name!r}; expected numpy, cupy or torch")
    return [Backend(n, threads) for n in out], notes


def device_name(backends: list[Backend]) -> str:
    """A file-name slug of the device measured: the GPU's name when one ran, else the CPU's."""
    for b in backends:
        if b.device == "cuda":
            name = (b.xp.cuda.runtime.getDeviceProperties(0)["name"].decode() if b.name == "cupy"
                    else b.torch.cuda.get_device_name(0))
            return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    model = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1] for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
    return f"cpu-{slug}-{len(os.sched_getaffinity(0))}c"
