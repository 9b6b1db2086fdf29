"""Flat parameter and gradient buffers: a module's parameters as views into one array per dtype.

    flat = flatten_parameters(model)      # copies the parameters into the buffers; p.data is now a view
    model.zero_grad()                     # one fill per gradient buffer (nn.module.clear_grads)
    model.backward(dlogits)               # each parameter's gradient lands in the flat gradient buffer
    for dtype, grads in flat_gradients(model):
        allreduce(grads)                  # data parallel: one call per dtype (in place, then divide)
    opt.step()                            # the optimisers update whole runs of the buffers at once

Why: a training step updates every parameter with the same element-wise formula. Over separate
arrays that is a dozen small operations per parameter (on a GPU, a dozen kernel launches each);
over one buffer it is a dozen operations in all, and zeroing, clipping's norm, mixed precision's
copies and a data-parallel all-reduce each become one call per buffer.

Layout, per dtype (in the order dtypes first appear in ``named_parameters()``): the parameters
with ``decay`` True first, then the others, each group in ``named_parameters()`` order (a shared
parameter once), every one starting at a multiple of :data:`ALIGN` elements. The gaps hold zeros
in both buffers and stay zero under every update (Adam and SGD map a zero parameter with zero
gradient and zero moments to zero), so an optimiser may run over a gap. Two modules with the same
parameter shapes, decays and order get the same offsets whatever their dtypes (mixed precision
relies on it: the float16 model and its float32 master copies share one layout).

Gradients: ``Module.zero_grad`` fills the gradient buffers with zeros and sets every ``p.grad`` to None;
the first gradient a parameter receives is written into its slot and ``p.grad`` becomes the slot's
view, later ones add to it. After a backward the gradient buffer holds every parameter's gradient,
zeros for those that received none (their ``p.grad`` stays None, so an optimiser skips them, as
it does without flattening). A data-parallel all-reduce over :func:`flat_gradients` therefore sums
zeros for a parameter one rank did not use; :meth:`FlatParameters.attach_grads` then makes every
``p.grad`` its slot's view, so each parameter steps with the reduced sum.

The buffers stay in use as long as each parameter's ``data`` is its view (:meth:`FlatParameters.intact`).
Assigning a new array to ``p.data`` takes that parameter out (``p.flat`` becomes None) and
everything falls back to per-parameter work; ``Module.to`` flattens again into new buffers, and
``Module.load_state_dict`` writes into the views. A deep copy of a flattened module is not
flattened.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.backend import get_array_module
from npformer.checks import describe
from npformer.errors import InputTypeError, ShapeError
from npformer.nn.module import Module, Parameter

__all__ = ["ALIGN", "FlatSlot", "FlatBuffer", "FlatParameters", "flatten_parameters", "flat_parameters",
           "flat_gradients"]

ALIGN = 64          # elements: slots start 128 bytes apart or more (float16), 256 (float32)


class FlatSlot(NamedTuple):
    """One parameter's place in a :class:`FlatBuffer`: elements ``[start, stop)``, the next slot
    at ``end`` (``stop`` rounded up to ALIGN), and the two views, shaped like the parameter."""

    buffer: "FlatBuffer"
    start: int
    stop: int
    end: int
    data: Any          # view of buffer.data[start:stop]
    grad: Any          # view of buffer.grad[start:stop]


class FlatBuffer:
    """The parameters of one dtype: ``data`` and ``grad``, 1-d arrays of ``size`` elements, and
    ``names``/``params``/``slots`` in layout order.

    ``mirror``: an array of the buffer's size that every optimiser update also writes, rounded to
    its dtype (mixed precision sets it to the float16 model's buffer of the same layout); None by
    default. ``grad``: a zeroed array of its own, or ``grad`` when given, a 1-d float array of the
    buffer's size that another buffer of the same layout owns (mixed precision's float32 masters read
    the 16-bit model's gradients: no float32 copy of them is kept)."""

    def __init__(self, xp: Any, dtype: Any, named: list[tuple[str, Parameter]], grad: Any = None):
        starts, size = [], 0
        for _, p in named:
            starts.append(size)
            size += -(-p.size // ALIGN) * ALIGN
        self.dtype = xp.dtype(dtype)
        self.size = size
        self.data = xp.zeros(size, dtype=self.dtype)     # (size,)
        if grad is not None and tuple(grad.shape) != (size,):
            raise ShapeError(f"flat buffer: a shared gradient must be ({size},), got {describe(grad)}")
        self.grad = xp.zeros(size, dtype=self.dtype) if grad is None else grad   # (size,)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.mirror = None
        self.slots = []
        for start, (_, p) in zip(starts, named):
            stop = start + p.size
            slot = FlatSlot(self, start, stop, -(-stop // ALIGN) * ALIGN,
                            self.data[start:stop].reshape(p.shape), self.grad[start:stop].reshape(p.shape))
            slot.data[...] = p.data
            self.slots.append(slot)

    def __repr__(self) -> str:
        return f"FlatBuffer({self.dtype}, {len(self.params)} parameters, {self.size} elements)"


class FlatParameters:
    """The flat buffers of a list of (name, Parameter) pairs; see the module docstring.

    Making one copies every parameter's values into its buffer and attaches the parameter to its
    slot (``p.data`` becomes the view; any gradient is dropped). With ``grads_of`` (another
    FlatParameters) each buffer's gradient is that one's buffer of the same place and size, shared
    (mixed precision's masters, whose layout is the model's); a buffer without such a partner gets a
    gradient of its own."""

    def __init__(self, named_params: Any, grads_of: "FlatParameters | None" = None):
        named, seen = [], set()
        for item in named_params:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Parameter)):
                raise InputTypeError(f"flat parameters: expected (name, Parameter) pairs, got {describe(item)}")
            if id(item[1]) not in seen:
                seen.add(id(item[1]))
                named.append(item)
        if not named:
            raise ValueError("flat parameters: the module has no parameters")
        xp = get_array_module(*[p.data for _, p in named])
        by_dtype: dict[Any, list] = {}
        for name, p in named:
            by_dtype.setdefault(p.dtype, []).append((name, p))
        groups = [[e for e in group if e[1].decay] + [e for e in group if not e[1].decay]
                  for group in by_dtype.values()]
        partners = list(grads_of.buffers) if grads_of is not None else []
        self.buffers = tuple(FlatBuffer(xp, dtype, group, _shared_grad(partners, k, group))
                             for k, (dtype, group) in enumerate(zip(by_dtype, groups)))
        for b in self.buffers:
            for p, slot in zip(b.params, b.slots):
                p.attach(slot)

    def intact(self) -> bool:
        """Whether every parameter's data is still its view of the buffer."""
        return all(p.flat is slot for b in self.buffers for p, slot in zip(b.params, b.slots))

    def attach_grads(self) -> None:
        """Make every ``p.grad`` its slot's view (after writing gradients into the buffer directly,
        e.g. a data-parallel all-reduce: parameters without a local gradient then step too)."""
        for b in self.buffers:
            for p, slot in zip(b.params, b.slots):
                p.grad = slot.grad

    def gradients(self) -> list[tuple[Any, Any]]:
        """[(dtype, flat gradient buffer)], one per dtype, the live arrays."""
        return [(b.dtype, b.grad) for b in self.buffers]

    def offsets(self) -> dict[str, tuple[Any, int, int]]:
        """{parameter name: (dtype, start, stop)}: where its values lie in that dtype's buffers."""
        return {n: (b.dtype, s.start, s.stop) for b in self.buffers for n, s in zip(b.names, b.slots)}

    def rebuilt(self, module: Module) -> "FlatParameters":
        """New buffers for ``module``'s parameters as they are now (after ``Module.to``)."""
        return FlatParameters(list(module.named_parameters()))

    def __deepcopy__(self, memo: dict) -> None:
        return None          # a deep-copied module owns separate arrays: it is not flattened

    def __repr__(self) -> str:
        return f"FlatParameters({', '.join(map(repr, self.buffers))})"


def _shared_grad(partners: list, k: int, group: list) -> Any:
    """Partner buffer k's gradient when its parameters have the shapes of ``group`` in order (the same
    layout), else None (the buffer makes its own)."""
    if k >= len(partners):
        return None
    partner = partners[k]
    same = len(partner.params) == len(group) and all(q.shape == p.shape and q.decay == p.decay
                                                     for q, (_, p) in zip(partner.params, group))
    return partner.grad if same else None


def flatten_parameters(module: Module) -> FlatParameters:
    """Put ``module``'s parameters into flat buffers, one per dtype, and keep them on the module
    (``Module.zero_grad`` then fills the gradient buffers). Returns the FlatParameters."""
    if not isinstance(module, Module):
        raise InputTypeError(f"flatten_parameters: expected an npformer Module, got {describe(module)}")
    flat = FlatParameters(list(module.named_parameters()))
    object.__setattr__(module, "_flat", flat)
    return flat


def flat_parameters(module: Module) -> FlatParameters | None:
    """The module's FlatParameters while every parameter is still in its buffer, else None."""
    flat = module._flat
    return flat if flat is not None and flat.intact() else None


def flat_gradients(module: Module) -> list[tuple[Any, Any]]:
    """[(dtype, flat gradient buffer)] of a flattened module (the live 1-d arrays, one per dtype,
    in place for an all-reduce); [] when the module is not flattened or has left its buffers.

    After ``model.zero_grad()`` and a backward, each buffer holds every parameter's gradient and
    zeros elsewhere (see the module docstring); after reducing into it, call
    ``flat_parameters(model).attach_grads()`` so every parameter steps with its reduced slot."""
    flat = flat_parameters(module)
    return [] if flat is None else flat.gradients()
