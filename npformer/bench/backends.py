"""The backends the suite measures: npformer on numpy or cupy, and reference frameworks as plug-ins.

A backend knows how to put a host array on its device, bring a result back, wait for the device,
measure a call's peak memory and its own float32 matmul rate (:class:`Device`). npformer's are
:class:`Backend`. A reference framework (PyTorch: the source checkout's
``benchmarks/torch_reference.py``) is a :class:`ReferenceBackend` registered by name with
:func:`register_reference`, so that the installed package names the ops it compares but never
imports the framework. cupy is imported only when its backend is made.
"""
from __future__ import annotations

import os
import platform
import re
from typing import Any, Callable

import numpy

from npformer.bench.harness import host_peak_mb, time_call

__all__ = ["Device", "Backend", "ReferenceBackend", "REFERENCE", "REFERENCES", "NPFORMER", "TORCH_BESIDE",
           "register_reference", "reference_backend", "make_backends", "device_name"]

NPFORMER = ("numpy", "cupy")                  # npformer's backends; every other column is a reference's
REFERENCE = "torch"                           # the reference of the parity checks and the vs_torch ratios
TORCH_BESIDE = {"numpy": "torch-cpu", "cupy": "torch-cuda"}     # the PyTorch column of each npformer one
REFERENCES: dict[str, Callable[[str, int], ReferenceBackend | None]] = {}     # filled by register_reference
UNREGISTERED = ("the PyTorch reference is the source checkout's benchmarks/torch_reference.py (PyTorch stays "
                "out of the installed package): python benchmarks/run.py runs the PyTorch columns and parity "
                "(with PyTorch installed)")


class Device:
    """One framework on one device, as the suite measures it; the host's memory meters are here,
    a GPU backend overrides ``free_bytes`` and ``peak_mb``."""
    framework = ""

    def __init__(self, name: str, device: str, threads: int):
        self.name, self.device, self.threads = name, device, threads

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def takes(self, case: dict) -> bool:
        """Whether this column measures ``case``: every case (a reference may take only some; the
        ``torch-compile`` column, the GPT training steps)."""
        return True

    def sync(self) -> None:
        """Wait for the device (nothing to wait for on the host)."""

    def asarray(self, host: numpy.ndarray, dtype: str | None = None) -> Any:
        """``host`` on this backend's device, cast there to ``dtype`` (a name: "float16", "bfloat16")
        when given: a bfloat16 case's inputs travel as float32, which every framework reads."""
        raise NotImplementedError

    def to_host(self, a: Any) -> numpy.ndarray:
        """A host (numpy) copy of an array of this backend."""
        raise NotImplementedError

    def versions(self) -> dict[str, str]:
        """{library: version} of what this backend runs, for the report."""
        raise NotImplementedError

    def gpu_name(self) -> str:
        raise NotImplementedError

    def allow_tf32(self) -> None:
        """float32 matmuls on TF32 tensor cores from now on (--tf32; GPU backends)."""
        raise NotImplementedError

    def free_bytes(self) -> int:
        """Memory available now: the host's MemAvailable (a GPU backend: the device's free memory)."""
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))

    def peak_mb(self, fn: Callable[[], Any], min_s: float = 0.2) -> float | None:
        """The most memory calls of ``fn`` add over what was held before (MB)."""
        return host_peak_mb(fn, min_s)

    def matmul_gflops(self, n: int, budget_s: float, warmup_s: float, precision: str = "float32") -> float:
        """Measured n x n matmul rate in ``precision`` (float32, or float16 or bfloat16 on a GPU: tensor
        cores with float32 accumulation): the peak each row's MFU is a share of."""
        rng = numpy.random.default_rng(0)
        a, b = (self.asarray(rng.standard_normal((n, n), dtype=numpy.float32), precision) for _ in range(2))
        t = time_call(lambda: a @ b, self.sync, 2, 10, budget_s, warmup_s)
        return 2.0 * n ** 3 / (t["ms"] * 1e-3) / 1e9


class Backend(Device):
    """npformer on ``numpy`` (the CPU) or ``cupy`` (the GPU)."""
    framework = "npformer"

    def __init__(self, name: str, threads: int):
        from npformer.backend import get_backend
        super().__init__(name, "cuda" if name == "cupy" else "cpu", threads)
        self.xp = get_backend(name)

    def sync(self) -> None:
        if self.device == "cuda":
            self.xp.cuda.get_current_stream().synchronize()

    def asarray(self, host: numpy.ndarray, dtype: str | None = None):
        from npformer.backend import resolve_dtype
        a = self.xp.asarray(host)
        return a if dtype is None else a.astype(resolve_dtype(self.xp, dtype))   # bfloat16: ml_dtypes', named there

    def to_host(self, a: Any) -> numpy.ndarray:
        from npformer.backend import to_numpy
        return numpy.asarray(to_numpy(a))

    def versions(self) -> dict[str, str]:
        return {self.xp.__name__: self.xp.__version__}

    def gpu_name(self) -> str:
        return self.xp.cuda.runtime.getDeviceProperties(0)["name"].decode()

    def allow_tf32(self) -> None:
        from npformer.backend import set_float32_matmul_precision
        set_float32_matmul_precision("tf32", "cupy")

    def free_bytes(self) -> int:
        return self.xp.cuda.runtime.memGetInfo()[0] if self.device == "cuda" else super().free_bytes()

    def peak_mb(self, fn: Callable[[], Any], min_s: float = 0.2) -> float | None:
        if self.device == "cpu":
            return super().peak_mb(fn, min_s)
        pool = self.xp.get_default_memory_pool()
        pool.free_all_blocks()
        base = pool.used_bytes()
        fn()
        self.sync()
        return (pool.total_bytes() - base) / 2**20


class ReferenceBackend(Device):
    """Another framework's column (``<framework>-cpu``, ``<framework>-cuda``): the reference the
    parity checks compare with and a timed column beside npformer's. The package names each case's
    computation; the subclass, outside the package, writes it in its framework. Besides
    :class:`Device`'s methods (``sync``, ``asarray``, ``to_host``, ``versions``, ``gpu_name``,
    ``allow_tf32``, and ``free_bytes`` / ``peak_mb`` on a GPU) it gives, each computation on the
    case's host arrays with npformer's argument order and the same fixed upstream gradient
    (``npformer.bench.cases.upstream_gradient``) as npformer's backward:

    * ``op_calls(op, host_inputs, n_grad, dtype=None)``: ``{"fwd", "bwd"}`` calls of ``op`` ("linear",
      "softmax", "layer_norm", "gelu", "attention", "ffn", "cross_entropy") on the inputs cast to
      ``dtype`` on the device when given; ``bwd`` returns the gradients of the first ``n_grad`` inputs;
    * ``multi_head_calls(host_x, num_heads, weights)``: the same for self-attention with the packed
      (in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias); gradients of x, then of those;
    * ``dropout_calls(host_x, p)``: ``{"fwd", "bwd"}``, and ``"_probe"``: (x, y, dy) of the call
      ``bwd`` differentiates (what its parity compares depends on no generator);
    * ``model_outputs(m, src_ids, tgt_ids, state)``: host logits, loss and ``{name: gradient}`` of
      one forward and backward of the model spec ``m`` (``npformer.bench.steps.MODELS``) with
      dropout 0 and npformer's weights ``state`` (loaded by name);
    * ``train_step(m, src_ids, tgt_ids, dropout, precision)``: one timed training step (zero grads,
      forward, cross-entropy, backward, AdamW lr 3e-4; "float16", "bfloat16": the framework's mixed
      precision).
    """

    def op_calls(self, op: str, host_inputs: list, n_grad: int, dtype: str | None = None) -> dict:
        raise NotImplementedError

    def multi_head_calls(self, host_x, num_heads: int, weights: list) -> dict:
        raise NotImplementedError

    def dropout_calls(self, host_x, p: float) -> dict:
        raise NotImplementedError

    def model_outputs(self, m, src_ids, tgt_ids, state: dict[str, numpy.ndarray]) -> tuple:
        raise NotImplementedError

    def train_step(self, m, src_ids, tgt_ids, dropout: float, precision: str = "float32") -> Callable[[], Any]:
        raise NotImplementedError


def register_reference(name: str, factory: Callable[[str, int], ReferenceBackend | None]) -> None:
    """Make ``--backends NAME`` a reference column: ``factory(device, threads)`` gives its backend on
    "cpu" or "cuda", or None where that device is absent."""
    if name in NPFORMER:
        raise ValueError(f"{name!r} is npformer's own backend, not a reference")
    REFERENCES[name] = factory


def reference_backend(name: str, device: str, threads: int) -> ReferenceBackend | None:
    """The registered reference ``name`` on ``device``; None where it is not registered or the device
    is absent."""
    factory = REFERENCES.get(name)
    return None if factory is None else factory(device, threads)


def make_backends(names: list[str], threads: int) -> tuple[list[Device], list[str]]:
    """Backends that can run here, and a note for each one that was asked for and cannot. A reference
    runs beside each npformer backend asked for: on the CPU beside numpy, on the GPU beside cupy."""
    from npformer.backend import cupy_available
    known = dict.fromkeys((*NPFORMER, REFERENCE, *REFERENCES))
    out, notes = [], []
    for name in names:
        if name not in known:
            raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(known)}")
        if name == "numpy":
            out.append(Backend("numpy", threads))
        elif name == "cupy":
            if cupy_available():
                out.append(Backend("cupy", threads))
            else:
                notes.append("cupy: CuPy or a CUDA device is absent; GPU columns unmeasured")
        elif name not in REFERENCES:
            notes.append(f"{name}: {UNREGISTERED}")
        else:
            devices = [dev for n, dev in (("numpy", "cpu"), ("cupy", "cuda")) if n in names]
            out += [b for b in (reference_backend(name, dev, threads) for dev in devices) if b is not None]
    return out, notes


def device_name(backends: list[Device]) -> str:
    """A file-name slug of the device measured: the GPU's name when one ran, else the CPU's."""
    for b in backends:
        if b.device == "cuda":
            return re.sub(r"[^a-z0-9]+", "-", b.gpu_name().lower()).strip("-")
    model = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1] for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
    return f"cpu-{slug}-{len(os.sched_getaffinity(0))}c"