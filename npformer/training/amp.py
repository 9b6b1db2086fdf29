"""Mixed-precision training: the model computes in float16 or bfloat16, the optimiser updates float32
master weights, and (float16 alone) a dynamic loss scale keeps small gradients from flushing to zero
(Micikevicius et al. 2018, "Mixed Precision Training"; the rules of ``torch.amp.GradScaler``).

One step (:meth:`MixedPrecision.step` does the part after the backward)::

    model weights (16-bit) = master weights (float32), rounded     in place, so tied weights stay tied
    loss = L(model(x)) in float32;  backward from dL = S             S: the loss scale; grads hold S * g
    all finite?  ->  optimiser step on the masters with g = float32(grad) * c / S, else skip the step
                     (c: the clipping factor, 1 without clipping; the update applies it as it reads grad)
    scaler: inf/NaN  -> S *= backoff_factor (0.5) and the step is skipped;
            growth_interval finite steps in a row -> S *= growth_factor (2)

Why: float16 has 5 exponent bits (largest 65504, smallest normal 6.1e-5, subnormals down to 6e-8).
Gradients of a small model fall below that and vanish; multiplying the loss by S lifts them into
range, and dividing by S in float32 undoes it exactly (S stays a power of two). An update lr * g of
1e-6 added to a float16 weight near 1 (spacing 2^-10 there) is rounded away, so the weights the
optimiser updates are float32. bfloat16 keeps float32's exponent range, so nothing flushes to zero and
it trains without a loss scaler (as PyTorch's autocast(bfloat16) does, with no GradScaler; asking for
one is an error), with 8 significant bits (u = 2^-8). Its gradients are those of the loss itself
(S = 1); non-finite ones mean the run diverged, as in float32: ``step`` raises NonFiniteError (a
FloatingPointError).

Recipe (a GPT; the loss is computed in float32 from the float16 logits, with no float32 copy of them)::

    amp = MixedPrecision(model, "float16")           # rounds the model's weights, keeps float32 masters
    opt = AdamW(amp.named_parameters(), lr=3e-4)     # the optimiser sees the masters only
    for step in ...:
        logits = model(x)                                            # (B, T, V) float16
        loss, cache = cross_entropy_forward(logits, y, loss_dtype=xp.float32)   # () float32
        model.backward(cross_entropy_backward(amp.scaled_dloss(), cache))       # (B, T, V) float16
        result = amp.step(opt, max_norm=1.0)          # unscale, check, clip, update, round down, zero grads

No float32 copy of the gradients is made: the optimiser steps the masters with the model's 16-bit
gradients and the factor c / S (``Optimizer.step(grad_scale=...)``), converting and scaling each as
it reads it, as torch's fused AdamW takes the GradScaler's scale. S is a power of two, so the update
sees the bits of the float32 gradient divided by S and then clipped; the one sum of squares of the
16-bit gradients (in float64) is the finite check and, divided by S^2, the clipping norm. So the
training state is 16 bytes a parameter, not 20 (GPT-2 124M: 498 MB less; ``benchmarks/saved_memory.py``),
and before the update a step reads the gradients once, where it made four passes (copy, unscale,
check, the clip's norm; five when it clipped).

Flat buffers (:mod:`npformer.nn.flat`): for a flattened model the masters are flattened too, in
the model's layout, their gradient buffer being the model's own, and a step works on whole buffers:
the check is one sum of squares per buffer, and the optimiser writes the rounded model weights in
the same pass as the masters (the master buffer's ``mirror`` is the model's buffer; on CuPy the
AdamW kernel reads the 16-bit gradients and stores both). The numbers are those of the per-parameter
path, which runs for a model that is not flattened and inside ``npformer.kernels.disabled()``.

Works on any backend: NumPy float16 runs on the CPU (slowly: NumPy has no float16 BLAS); bfloat16 is
ml_dtypes' dtype (:func:`npformer.backend.bfloat16`; the extra ``npformer[bfloat16]``, a
MissingExtraError naming it when absent), which NumPy computes with in software and CuPy on the GPU.
A float16 model whose gradients are non-finite at every scale never steps (the scale keeps halving,
as torch's does); ``scaler.skipped`` counts the skipped steps.
"""
from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from typing import Any, Mapping, NamedTuple

import numpy

from npformer.backend import get_backend, resolve_dtype, to_device
from npformer.checks import describe, non_negative_int, one_of, positive_int, real
from npformer.dispatch import enabled
from npformer.errors import InputTypeError, NonFiniteError, RangeError
from npformer.nn.flat import FlatParameters, flat_parameters
from npformer.nn.module import Module, Parameter
from npformer.ops.optim import sum_of_squares
from npformer.training.optim import Optimizer, clip_coefficient

__all__ = ["DynamicLossScaler", "MixedPrecision", "AmpStep", "low_precision_dtype"]


# The scales a float32 holds as a normal number: scaled_dloss() is S in float32 (finfo(float32).tiny, .max)
_MIN_SCALE, _MAX_SCALE = float(numpy.finfo(numpy.float32).tiny), float(numpy.finfo(numpy.float32).max)
_MAX_GROWN = 2.0 ** 127          # float32's largest power of two: growth stops there (inf would skip every step)


class DynamicLossScaler:
    """The loss scale S: halved (``backoff_factor``) on a step with inf/NaN gradients, which is
    skipped; doubled (``growth_factor``) after ``growth_interval`` finite steps in a row.
    Defaults are ``torch.amp.GradScaler``'s, with two bounds torch lacks: ``init_scale`` must be a
    number float32 holds (a normal float32 up to 3.4e38: ``scaled_dloss`` is S in float32, and 1e300
    there is inf, which would skip every step until ~870 halvings brought it back), and growth stops
    at 2^127, float32's largest power of two (a large ``growth_factor`` took S to inf, where it stayed);
    backoff stops at float32's smallest normal number, 2^-126 (a model non-finite at every scale took
    S to 0.0 after ~1,100 skipped steps, and ``step`` divided by it).

    :meth:`load_state_dict` takes what :meth:`state_dict` gives: exactly the keys ``scale`` (a
    finite number > 0 that float32 holds as a normal number: ``scaled_dloss`` is float32),
    ``growth_tracker`` and ``skipped`` (ints >= 0). A ``growth_tracker`` at or past this scaler's
    ``growth_interval`` (a checkpoint of a longer interval) is kept: the next finite step grows S."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale = real(init_scale, "init_scale", _MIN_SCALE, _MAX_SCALE,
                          what="a finite number float32 holds (a normal float32)")
        self.growth_factor = real(growth_factor, "growth_factor", 1, low_open=True)
        self.backoff_factor = real(backoff_factor, "backoff_factor", 0, 1, low_open=True, high_open=True)
        self.growth_interval = positive_int(growth_interval, "growth_interval")
        self.growth_tracker = 0        # finite steps since the scale last changed
        self.skipped = 0               # steps skipped for inf/NaN gradients, in all

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, _MIN_SCALE)   # 0 would divide by zero in step
            self.growth_tracker = 0
            self.skipped += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:     # >=: a loaded tracker may be past it
            self.scale = max(self.scale, min(self.scale * self.growth_factor, _MAX_GROWN))   # capped, never lowered
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "skipped": self.skipped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict`'s keys, each checked (the class docstring) before any is set."""
        if not isinstance(state, Mapping):
            raise InputTypeError(f"loss scaler state: expected a dict with keys 'growth_tracker', 'scale', "
                                 f"'skipped', got {describe(state)}")
        keys = {"scale", "growth_tracker", "skipped"}
        missing, unexpected = keys - set(state), set(state) - keys
        if missing:
            raise RangeError(f"loss scaler state: missing keys {sorted(missing)}, got {sorted(map(str, state))}")
        if unexpected:
            raise RangeError(f"loss scaler state: unexpected keys {sorted(map(str, unexpected))}, "
                             f"expected {sorted(keys)}")
        scale = real(state["scale"], "loss scaler state: scale", _MIN_SCALE, _MAX_SCALE,
                     what="a finite number float32 holds (a normal float32)")
        tracker = non_negative_int(state["growth_tracker"], "loss scaler state: growth_tracker")
        skipped = non_negative_int(state["skipped"], "loss scaler state: skipped")
        self.scale, self.growth_tracker, self.skipped = scale, tracker, skipped


class AmpStep(NamedTuple):
    stepped: bool              # False: inf/NaN gradients, the step was skipped
    scale: float               # the loss scale the gradients carried (1.0 without a scaler: bfloat16)
    grad_norm: float | None    # the unscaled norm before clipping (max_norm given; inf or NaN when skipped), else None


def low_precision_dtype(dtype, xp):
    """float16 or bfloat16 of backend ``xp``. Neither NumPy nor CuPy has a bfloat16 of its own (no
    ``xp.bfloat16``); ml_dtypes' dtype serves both (NumPy computes with it, CuPy 14 allocates, casts
    and multiplies it), resolved by :func:`npformer.backend.resolve_dtype`: a MissingExtraError
    naming the extra without ml_dtypes."""
    name = str(getattr(dtype, "__name__", dtype))
    one_of(name, "dtype (mixed precision)", ("float16", "bfloat16"))
    return resolve_dtype(xp, name)


class MixedPrecision:
    """Float32 master copies of ``model``'s parameters; the model itself is rounded to ``dtype``.

    Build the optimiser over :meth:`named_parameters` (the masters) and call :meth:`step` after each
    backward; see the module docstring for the whole loop. float16 takes ``scaler`` (None: a
    :class:`DynamicLossScaler` of torch's defaults); bfloat16 has none (``scaler`` is None).
    """

    def __init__(self, model: Module, dtype: Any = "float16", scaler: DynamicLossScaler | None = None):
        if not isinstance(model, Module):
            raise InputTypeError(f"model: expected an npformer Module, got {describe(model)}")
        self.xp = get_backend(model.backend)
        self.dtype = low_precision_dtype(dtype, self.xp)
        self.model = model
        if scaler is not None and not isinstance(scaler, DynamicLossScaler):
            raise InputTypeError(f"scaler: expected a DynamicLossScaler or None (float16: torch's defaults), "
                                 f"got {describe(scaler)}")
        if self.dtype.name == "bfloat16":
            if scaler is not None:
                raise RangeError("scaler: bfloat16 keeps float32's exponent range and trains without loss "
                                 f"scaling (as torch.autocast(dtype=torch.bfloat16)); got {describe(scaler)}: "
                                 "pass scaler=None, or use float16, which needs one")
            self.scaler = None
        else:
            self.scaler = scaler if scaler is not None else DynamicLossScaler()
        self._pairs = [(name, p, Parameter(p.data.astype(self.xp.float32, copy=True), decay=p.decay))
                       for name, p in model.named_parameters()]      # tied parameters appear once
        self._master_of = {id(p): m for _, p, m in self._pairs}
        model.to(dtype=self.dtype)                 # a flattened model is flattened again, in 16 bits
        # masters in the model's flat layout (nn.flat: same shapes, decays and order, same offsets), whose
        # gradients are the model's buffers
        model_flat = flat_parameters(model)
        self._flat = None if model_flat is None else FlatParameters(self.named_parameters(), grads_of=model_flat)
        self._dloss_scale = self._scale()           # what scaled_dloss's array holds
        self._dloss = self.xp.full((), self._dloss_scale, dtype=self.xp.float32)

    def named_parameters(self):
        """(name, float32 master) pairs, for the optimiser."""
        return [(name, m) for name, _, m in self._pairs]

    def parameters(self):
        return [m for _, _, m in self._pairs]

    def scaled_dloss(self):
        """The upstream gradient of a float32 loss, S, as a 0-d float32 array: the loss's backward
        takes it in place of 1 (and it is 1 without a scaler).

        It is the same array at every call, S written into it when the scale has changed since the
        last call. So a backward captured in a CUDA graph reads the scale of the step it replays,
        provided this is called before each replay (``npformer train --cuda-graph`` does): a
        graph keeps the arrays its capture read, not the host values they were made from."""
        scale = self._scale()
        if scale != self._dloss_scale:
            self._dloss.fill(scale)                 # outside a capture: the scale changes between steps
            self._dloss_scale = scale
        return self._dloss

    def _scale(self) -> float:
        return 1.0 if self.scaler is None else self.scaler.scale

    def overflows_expected(self):
        """A context for a step's forward and backward. Under float16 an overflow of the scaled
        gradients is the loss scaler's to handle (the step is skipped, the scale halved), so NumPy's
        warnings about it ("overflow encountered", "invalid value encountered") are off inside; bfloat16,
        which has no scale to lower, keeps them. (CuPy never warns.)"""
        if self.scaler is None:
            return contextlib.nullcontext()
        return numpy.errstate(over="ignore", invalid="ignore")

    def step(self, optimizer, max_norm: float | None = None) -> AmpStep:
        """Check the model's gradients, skip on inf/NaN, step ``optimizer`` on the masters with the
        gradients unscaled and clipped to ``max_norm`` as it reads them, round the masters back into
        the model, and zero every gradient. Without a scaler (bfloat16) non-finite gradients raise
        NonFiniteError (a FloatingPointError): there is no scale to lower. ``optimizer`` must be an
        npformer Optimizer over :meth:`named_parameters` (InputTypeError, RangeError)."""
        if not isinstance(optimizer, Optimizer):
            raise InputTypeError(f"optimizer: expected an npformer Optimizer built over amp.named_parameters(), "
                                 f"got {describe(optimizer)}")
        xp, scale = self.xp, self._scale()
        masters = {id(m) for m in self.parameters()}
        foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in masters]
        if foreign:
            raise RangeError(f"optimizer holds {len(foreign)} parameters that are not this MixedPrecision's "
                             "float32 masters; build it over amp.named_parameters()")
        flat = self._flat_pairs()
        for _, p, m in self._pairs:              # the masters' gradients are the model's (16-bit, S g)
            if p.grad is None:
                m.grad = None
            else:
                m.grad = m.flat.grad if flat is not None else p.grad   # flat: the slot's view of the shared buffer
        if flat is not None:
            grads = [model_buffer.grad for _, model_buffer in flat]
        else:
            grads = [m.grad for m in self.parameters() if m.grad is not None]
        # one sum of squares per buffer (or per gradient), in float64: finite iff every element is
        squares = float(xp.stack([sum_of_squares(g) for g in grads]).sum()) if grads else 0.0   # one sync
        ok = math.isfinite(squares)
        # fwd: the model's loss was multiplied by S  ->  g = grad / S;  clipping: g = c g
        norm = None if max_norm is None else math.sqrt(squares) / scale   # the norm of g (S a power of two: exact)
        if ok:
            coef = 1.0 if max_norm is None else clip_coefficient(norm, max_norm)
            for master_buffer, model_buffer in flat or ():
                master_buffer.mirror = model_buffer.data            # the optimiser rounds into it
            optimizer.step(grad_scale=coef / scale)                 # flat: also writes the model's weights
            if flat is None:
                for _, p, m in self._pairs:
                    p.data[...] = m.data                                  # rounded to the model's dtype, in place
        for master_buffer, _ in flat or ():
            master_buffer.mirror = None
        for _, p, m in self._pairs:
            m.grad = None
        self.model.zero_grad()
        if self.scaler is None:
            if not ok:
                raise NonFiniteError(f"{self.dtype} gradients are not finite and there is no loss scale to "
                                     "lower (bfloat16 trains without one): the run diverged")
        else:
            self.scaler.update(not ok)
        return AmpStep(ok, scale, norm)

    def _flat_pairs(self) -> list | None:
        """[(master buffer, model buffer)] when the masters and the model are both flat in one layout,
        the masters' gradient buffers being the model's, with every model grad in its buffer (and fast
        paths are on); else None."""
        if self._flat is None or not enabled() or flat_parameters(self.model) is None or not self._flat.intact():
            return None
        pairs: dict[int, tuple] = {}
        for _, p, m in self._pairs:
            ps, ms = p.flat, m.flat
            pair = pairs.setdefault(id(ms.buffer), (ms.buffer, ps.buffer))
            same_layout = (ps.start, ps.stop) == (ms.start, ms.stop) and ms.buffer.grad is ps.buffer.grad
            if not same_layout or pair[1] is not ps.buffer or (p.grad is not None and p.grad is not ps.grad):
                return None
        return list(pairs.values())

    def master_state_dict(self) -> "OrderedDict[str, Any]":
        """The float32 masters under the model's state_dict names (tied weights under each name)."""
        return OrderedDict((n, self._master_of[id(p)].data)
                           for n, p in self.model.named_parameters(remove_duplicate=False))

    def load_master_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load float32 weights (a checkpoint) into the masters, checked by the model, then round them
        into the model."""
        self.model.load_state_dict(state)                                 # checks names and shapes, rounds
        for name, _, m in self._pairs:
            m.data[...] = to_device(state[name], self.model.backend)      # cast to float32 in place
