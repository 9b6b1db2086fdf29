"""CUDA graph capture of a training step on CuPy (opt-in): record the kernels of one step once, then
replay all of them with one launch per step.

Why: a GPT step launches thousands of small kernels, and for a small model the GPU waits on Python
and the launch queue rather than on arithmetic. A CUDA graph (``cudaStreamBeginCapture`` ...
``cudaGraphLaunch``) replays the recorded launches without Python in between.

The step function ``fn(*inputs)`` returns device arrays (or a tuple of them). Its contract:

* **static shapes**: every call passes inputs of the first call's shapes and dtypes (they are copied
  into static input buffers, which the graph reads); another shape is a ShapeError naming the
  input, and another dtype an InputTypeError;
* **device work only**: nothing inside reads device data on the host: ``float(loss)``, ``bool(...)``,
  ``.item()``, ``.get()``, ``cupy.asnumpy``, a shape that depends on the data (``nonzero``, a boolean
  mask). CUDA refuses those during a capture; the step then fails with :class:`CaptureError` naming
  the causes. npformer's training ops are written for this: their checks of array values (ids in
  range) are skipped inside the capture (:func:`npformer.checks.values_unchecked`; the eager warm-up
  calls check them), cross-entropy keeps its count on the device, the embedding backward's
  scatter-add has fixed shapes on CuPy. What stays on the host goes after the call: the trainer's
  ``float(loss)``, the optimiser's and the loss scaler's decisions;
* **Python state happens once**: what ``fn`` does in Python (appending to lists, setting attributes,
  drawing from a host generator, computing a learning rate) runs at the capture only; a replay
  repeats the device work on the same memory. So the outputs are the same arrays after every call
  (copy what must be kept), arrays made inside the step (a parameter's gradient allocated by its first
  ``accumulate``) are rewritten in place by each replay, and anything that must change per step
  lives in device arrays updated in place before the call;
* **products through npformer's ops**: CuPy refuses every cuBLAS call while a stream captures, so
  the matrix products inside must be npformer's linear ops on their CUDA path
  (:mod:`npformer.kernels.cuda.gemm` calls cuBLAS itself there), not a plain ``a @ b``, nor with the
  fast paths switched off.

Calls: the first ``warmup`` calls run eagerly (kernels compile, cuBLAS makes its workspace, the memory
pool grows), the next one captures and then replays the graph, later ones replay it. All of them run
on a stream of this object, ordered after the caller's stream and before the caller's later work
(events both ways). Memory made during the capture comes from a pool of this object that nothing
else allocates from, so the graph's buffers are never handed to other arrays.

NumPy has no graphs: passing NumPy arrays is an InputTypeError saying to call the step itself.

``npformer train --cuda-graph`` (:meth:`npformer.training.loop.Trainer.train_step`, the GPT trainers)
captures the forward and backward this way; the gradient clipping and AdamW run after each replay, and
:func:`reseed_in_place` gives each step the dropout stream of (seed, step). Under mixed precision the
captured backward starts from the loss scale's device array
(:meth:`npformer.training.amp.MixedPrecision.scaled_dloss`), which the trainer rewrites before each
replay when the scale has moved; the finite check, the skipped step and the scaler's update run
after the replay, on the host, as in an eager step.
"""
from __future__ import annotations

from typing import Any, Callable

from npformer.backend import default_rng, get_array_module, is_cupy_array
from npformer.checks import describe, non_negative_int, values_unchecked
from npformer.errors import CaptureError, InputTypeError, ShapeError
from npformer.kernels.cuda.gemm import prepare_capture

__all__ = ["CudaGraphStep", "check_static_inputs", "reseed_in_place", "HOST_SYNC_CAUSES"]

HOST_SYNC_CAUSES = ("float(), int() or bool() of a device array (an `if` on one), .item(), .get(), "
                    "cupy.asnumpy, printing an array, a shape that depends on the data (nonzero, a boolean "
                    "mask), a host-to-device copy from a NumPy array")


def check_static_inputs(expected: list[tuple[tuple, Any]], inputs: tuple) -> None:
    """Each input must have the shape and dtype the step was captured with (``expected``:
    (shape, dtype) per input, from the first call)."""
    if len(inputs) != len(expected):
        raise ShapeError(f"CudaGraphStep: the step was captured with {len(expected)} inputs, got {len(inputs)}")
    for i, (a, (shape, dtype)) in enumerate(zip(inputs, expected)):
        if tuple(a.shape) != shape:
            raise ShapeError(f"CudaGraphStep input {i}: a captured step has static shapes, {shape} at the capture, "
                             f"got {describe(a)}; capture one step per shape (pad to a fixed length), or run "
                             "without the graph")
        if a.dtype != dtype:
            raise InputTypeError(f"CudaGraphStep input {i}: captured with dtype {dtype}, got {describe(a)}")


class CudaGraphStep:
    """``step = CudaGraphStep(fn, warmup=2)``; ``outputs = step(*inputs)`` (module docstring)."""

    def __init__(self, fn: Callable[..., Any], *, warmup: int = 2):
        if not callable(fn):
            raise InputTypeError(f"CudaGraphStep: fn must be callable, got {describe(fn)}")
        self.fn, self.warmup = fn, non_negative_int(warmup, "warmup")
        self.calls = 0                    # eager calls made so far (up to warmup)
        self.graph = None                 # the captured cupy.cuda.Graph
        self._expected: list[tuple[tuple, Any]] | None = None
        self._static: list | None = None  # the input buffers the graph reads
        self._outputs: Any = None         # what the capture returned: rewritten by every replay
        self._stream = self._pool = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, *inputs):
        xp = self._check(inputs)
        caller = xp.cuda.get_current_stream()
        if self._stream is None:
            self._stream = xp.cuda.Stream(non_blocking=True)
            self._pool = xp.cuda.MemoryPool()
        self._stream.wait_event(caller.record())          # after the caller's work (the optimiser's update)
        with self._stream:
            if self._static is None:
                self._static = [xp.empty(a.shape, dtype=a.dtype) for a in inputs]
            for buffer, a in zip(self._static, inputs):
                buffer[...] = a                           # device to device, before the graph reads it
            if self.calls < self.warmup:
                self.calls += 1
                out = self.fn(*self._static)
            else:
                if self.graph is None:
                    self._capture(xp)
                self.graph.launch(self._stream)
                out = self._outputs
        caller.wait_event(self._stream.record())          # the caller's next work after the step
        return out

    def _check(self, inputs: tuple):
        if not inputs:
            raise InputTypeError("CudaGraphStep: the step needs at least one input array (the batch)")
        for i, a in enumerate(inputs):
            if not is_cupy_array(a):
                raise InputTypeError(f"CudaGraphStep input {i}: CUDA graphs replay CuPy work; got {describe(a)}. "
                                     "On the NumPy backend there is no graph to capture: call the step itself")
        if self._expected is None:
            self._expected = [(tuple(a.shape), a.dtype) for a in inputs]
        check_static_inputs(self._expected, inputs)
        return get_array_module(*inputs)

    def _capture(self, xp) -> None:
        stream = self._stream
        prepare_capture(xp)                               # npformer's cuBLAS handle and workspace: not the graph's
        with xp.cuda.using_allocator(self._pool.malloc), values_unchecked():
            stream.begin_capture()
            try:
                outputs = self.fn(*self._static)
            except Exception as exc:
                _end_quietly(stream)
                raise CaptureError(f"CudaGraphStep: the step could not be captured in a CUDA graph ({exc}). "
                                   f"Inside a captured step nothing may read device data on the host: "
                                   f"{HOST_SYNC_CAUSES}; move it after the call. Matrix products must be "
                                   "npformer's linear ops with the fast paths on (CuPy refuses cuBLAS calls "
                                   "during a capture)") from exc
            graph = stream.end_capture()
        self._outputs, self.graph = outputs, graph


def reseed_in_place(generator, seed, backend: str = "cupy") -> None:
    """Give ``generator`` the state ``default_rng(seed)`` starts with, in the memory it already has: a
    replayed graph draws from the state memory it was captured with (so ``npformer train
    --cuda-graph`` gets the dropout masks of (seed, step) at every step, as without the graph).

    A CuPy generator keeps its cuRAND states in one device array of its bit generator (``_state``, a
    CuPy internal): the fresh generator's array is copied into it; CaptureError where that array is
    not there (another CuPy), saying to train without the graph."""
    fresh = default_rng(seed, backend)
    have, new = (getattr(getattr(g, "bit_generator", None), "_state", None) for g in (generator, fresh))
    if have is None or new is None or have.shape != new.shape or have.dtype != new.dtype:
        raise CaptureError("reseed_in_place: this CuPy keeps its random generator's state where npformer cannot "
                           "rewrite it, so a captured step cannot draw each step's dropout masks; train without "
                           "--cuda-graph")
    have[...] = new


def _end_quietly(stream) -> None:
    """Leave capture mode after a failed capture (the partial graph is discarded)."""
    try:
        stream.end_capture()
    except Exception:            # the capture was already invalidated by the failure
        pass
