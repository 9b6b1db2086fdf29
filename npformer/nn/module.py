"""Parameters and the module base class, shaped like ``torch.nn.Module`` but with explicit backward.

A :class:`Module` owns :class:`Parameter` objects (an array ``data`` and its accumulated ``grad``)
and child modules, both found by attribute assignment exactly as in PyTorch, so the dotted names of
:meth:`Module.named_parameters` and :meth:`Module.state_dict` are the ones the PyTorch counterpart
uses and weights copy across unchanged.

The rules that make hand-written backward work for shared and repeated use:

* ``forward`` pushes the op caches of that call onto ``self._saved`` (a stack, one entry a call);
  ``backward`` pops the newest. A module applied k times in one pass (ALBERT's shared layers, a
  decoder stepped token by token) gets k backward calls, in reverse order.
* Parameter gradients always accumulate (``+=``, :meth:`Parameter.accumulate`) and are reset in one
  place, :meth:`Module.zero_grad`.
* Inside ``with no_grad():`` (evaluation, decoding) forward saves nothing, so nothing piles up.

*Buffers* (:meth:`Module.register_buffer`) are state that is saved, loaded and moved with the
parameters but never trained, such as BatchNorm's running statistics: ``state_dict`` lists each
module's parameters then its buffers, as PyTorch does, and neither the optimisers nor ``grads()``
see them.

*Randomness is owned, never global.* A module's dropout masks come from its :class:`RandomStream`,
which :meth:`Module.manual_seed` gives to the module and every submodule at once (one stream per
model, so the layers draw one after another from it). A model built with an int ``rng`` seeds its
stream from it, so it draws the same masks whatever else runs in the process; the trainers reseed
it from (seed, step) before every step, which makes resumed runs exact. A module that was never
seeded draws from fresh OS entropy (like ``numpy.random.default_rng()``).
"""
from __future__ import annotations

import contextvars
import copy
from collections import OrderedDict
from contextlib import contextmanager
from numbers import Integral
from typing import Any, Iterator, Mapping

import numpy

from npformer.backend import (backend_name, default_rng, get_array_module, get_backend, is_cupy_array, is_float_dtype,
                              to_device)
from npformer.checks import NUMBER_KINDS, boolean, describe, expect_float, float_dtype, non_negative_int
from npformer.errors import CallOrderError, InputTypeError, ShapeError, StateDictError

__all__ = ["Parameter", "clear_grads", "Module", "ModuleList", "RandomStream", "StateDictError", "no_grad",
           "is_grad_enabled"]

# Per thread (and per asyncio task), as the fast-path switch of npformer.dispatch: one thread's
# evaluation under no_grad does not stop another thread's training from keeping its caches.
_GRAD_ENABLED = contextvars.ContextVar("npformer_grad_enabled", default=True)


@contextmanager
def no_grad():
    """Forward passes inside keep no caches (and cannot be back-propagated), as ``torch.no_grad``;
    for this thread only."""
    token = _GRAD_ENABLED.set(False)
    try:
        yield
    finally:
        _GRAD_ENABLED.reset(token)


def is_grad_enabled() -> bool:
    """False inside :func:`no_grad` on this thread."""
    return _GRAD_ENABLED.get()


class _Generators(dict):
    """backend name -> ``default_rng(seed, backend)``, each made when first looked up."""

    def __init__(self, seed: Any):
        super().__init__()
        self.seed = seed

    def __missing__(self, backend: str):
        gen = self[backend] = default_rng(self.seed, backend)
        return gen


def _check_seed(seed: Any) -> None:
    """A stream's seed: an int >= 0, a sequence of them such as ``(seed, step)``, or None, checked when
    it is given (the generators are made at the first dropout forward, which raised NumPy's errors)."""
    if isinstance(seed, (tuple, list)):
        for i, s in enumerate(seed):
            non_negative_int(s, f"seed[{i}]")
    elif seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, Integral):
            raise InputTypeError(f"seed: expected an int >= 0, a sequence of them such as (seed, step), "
                                 f"or None (OS entropy), got {describe(seed)}")
        non_negative_int(seed, "seed")


class RandomStream:
    """A seeded stream of random numbers for dropout: one backend Generator per backend (the arrays'
    backend decides), each made from ``seed`` on first use. ``seed`` None: fresh OS entropy."""

    def __init__(self, seed: Any = None):
        _check_seed(seed)
        self.generators = _Generators(seed)      # backend name -> its Generator, made on first lookup

    @property
    def seed(self) -> Any:
        return self.generators.seed

    def __repr__(self) -> str:
        return f"RandomStream(seed={self.seed!r})"


class Parameter:
    """A trainable array and its accumulated gradient.

    ``decay`` says whether weight decay applies by default (False for biases, norm gains and
    embeddings, which the optimisers leave undecayed unless told otherwise).

    After :func:`npformer.nn.flat.flatten_parameters`, ``data`` is a view into a flat buffer and
    ``flat`` says where (a :class:`~npformer.nn.flat.FlatSlot`); the first gradient of a step is
    then written into the slot's view of the flat gradient buffer, and ``grad`` is that view.
    Assigning a different array to ``data`` takes the parameter out of the buffer (``flat`` None).
    Why the slot is here and not beside the parameter: ``grad`` stays None until a gradient arrives
    (PyTorch's convention, which the optimisers and the gradient checks rely on), so the place the
    first gradient goes to must be known where it arrives, in :meth:`accumulate`.
    """

    __slots__ = ("data", "grad", "decay", "_slot")

    def __init__(self, data: Any, *, decay: bool = True):
        if isinstance(data, numpy.generic):          # a NumPy scalar cannot be updated in place
            raise InputTypeError(f"Parameter data: expected a numpy or cupy array, got the NumPy scalar {data!r}; "
                                 "numpy.asarray makes it a 0-d array")
        expect_float(data, "Parameter data")         # a list or a string failed later, at .shape
        self._slot = None
        self.data = data
        self.grad = None
        self.decay = decay

    @property
    def flat(self):
        """Where ``data`` and the gradient live in a flat buffer (a FlatSlot), or None: the slot given
        by :meth:`attach` while ``data`` is still its view (another array assigned to ``data`` takes
        the parameter out of the buffer)."""
        slot = self._slot
        return slot if slot is not None and self.data is slot.data else None

    def attach(self, slot) -> None:
        """Make ``slot.data`` (a view of a flat buffer holding this parameter's values) the data,
        and ``slot.grad`` the place its gradients accumulate (used by flatten_parameters)."""
        if tuple(slot.data.shape) != self.shape or slot.data.dtype != self.dtype:
            raise ShapeError(f"flat slot of {describe(slot.data)} for a parameter of {describe(self.data)}")
        self.data, self._slot, self.grad = slot.data, slot, None

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def size(self) -> int:
        return int(self.data.size)

    def accumulate(self, g: Any) -> None:
        """``grad += g`` (allocating on first use, or writing into the flat gradient buffer when the
        parameter has a flat slot); ``g`` must have the parameter's shape."""
        data, slot = self.data, self._slot
        if tuple(g.shape) != tuple(data.shape):
            raise ShapeError(f"gradient of shape {tuple(g.shape)} for a parameter of shape {self.shape}")
        if self.grad is not None:
            self.grad += g
        elif slot is not None and data is slot.data:     # in a flat buffer (see flat)
            slot.grad[...] = g                       # cast to the parameter's dtype, as astype below
            self.grad = slot.grad
        else:
            self.grad = g.astype(self.data.dtype, copy=True)

    def __deepcopy__(self, memo: dict) -> "Parameter":
        """A copy owns its arrays: it is never in the original's flat buffer."""
        out = Parameter(copy.deepcopy(self.data, memo), decay=self.decay)
        out.grad = copy.deepcopy(self.grad, memo)
        memo[id(self)] = out
        return out

    def __repr__(self) -> str:
        return f"Parameter({describe(self.data)})"


def clear_grads(params: Any) -> None:
    """Set each parameter's grad to None and zero its part of a flat gradient buffer, if it has one
    (:mod:`npformer.nn.flat`): one fill for a buffer whose parameters are all among ``params``, one
    per parameter otherwise. So a flat gradient buffer holds zeros where no gradient arrives."""
    params = list(params)
    ids = {id(p) for p in params}
    whole: dict[int, bool] = {}          # id(buffer) -> all its parameters are here (and filled once)
    for p in params:
        slot = p.flat
        if slot is not None:
            b = slot.buffer
            if id(b) not in whole:
                whole[id(b)] = all(id(q) in ids and q.flat is s for q, s in zip(b.params, b.slots))
                if whole[id(b)]:
                    b.grad.fill(0)
            if not whole[id(b)]:
                slot.grad.fill(0)
        p.grad = None


class Module:
    """Base class: parameters and children by attribute, per-call caches, train/eval, state dicts."""

    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_buffers", [])          # names of this module's buffers, in order
        object.__setattr__(self, "_saved", [])
        object.__setattr__(self, "_stream", None)         # RandomStream, shared across a model
        object.__setattr__(self, "_flat", None)           # FlatParameters, set by flatten_parameters
        object.__setattr__(self, "training", True)

    # -- registration by attribute, as in PyTorch ------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}.__init__ must call super().__init__() "
                                 f"before assigning {name!r}")
        self._parameters.pop(name, None)
        self._modules.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        self._parameters.pop(name, None)
        self._modules.pop(name, None)
        object.__delattr__(self, name)

    def register_buffer(self, name: str, value: Any) -> None:
        """An array attribute kept in ``state_dict`` and moved by ``to`` but not trained (``None``:
        an absent buffer, left out of the state dict). Reassign it as a plain attribute."""
        if name in self._parameters or name in self._modules:
            raise KeyError(f"{name!r} is already a parameter or submodule of {type(self).__name__}")
        if name not in self._buffers:
            self._buffers.append(name)
        object.__setattr__(self, name, value)

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        """(dotted name, array) of every buffer that is not None, module by module."""
        for mod_name, mod in self.named_modules(prefix):
            for name in mod._buffers:
                value = getattr(mod, name)
                if value is not None:
                    yield (f"{mod_name}.{name}" if mod_name else name), value

    def _buffer_owners(self) -> dict[str, tuple["Module", str]]:
        return {(f"{m}.{n}" if m else n): (mod, n) for m, mod in self.named_modules() for n in mod._buffers
                if getattr(mod, n) is not None}

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        """Like setting an attribute; ``None`` records an absent optional parameter (bias=False)."""
        if param is not None and not isinstance(param, Parameter):  # (setattr keeps it as a plain attribute)
            raise InputTypeError(f"register_parameter {name!r}: expected a Parameter or None, got {describe(param)}"
                                 "; wrap an array as Parameter(array)")
        if param is None:
            self._parameters.pop(name, None)
            object.__setattr__(self, name, None)
        else:
            setattr(self, name, param)

    # -- traversal -------------------------------------------------------------------------------
    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self) -> Iterator["Module"]:
        for _, m in self.named_modules():
            yield m

    def named_parameters(self, prefix: str = "", remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, Parameter]]:
        """(dotted name, parameter); a shared parameter is listed once, under its first name."""
        seen: set[int] = set()
        for mod_name, mod in self.named_modules(prefix):
            for name, p in mod._parameters.items():
                if remove_duplicate:
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                yield (f"{mod_name}.{name}" if mod_name else name), p

    def parameters(self) -> Iterator[Parameter]:
        for _, p in self.named_parameters():
            yield p

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    # -- gradients -------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Forget every accumulated gradient (the one place where gradients are reset); a flattened
        module also fills its flat gradient buffers with zeros (:func:`clear_grads`)."""
        clear_grads(self.parameters())

    def grads(self) -> dict[str, Any]:
        """Gradient per dotted parameter name (zeros for a parameter that received none)."""
        out = {}
        for name, p in self.named_parameters():
            xp = get_array_module(p.data)
            out[name] = p.grad if p.grad is not None else xp.zeros_like(p.data)
        return out

    def clear_saved(self) -> None:
        """Drop the caches of forward calls that will not be back-propagated (e.g. after eval)."""
        for m in self.modules():
            m._saved.clear()

    def _push(self, cache: Any) -> None:
        if _GRAD_ENABLED.get():
            self._saved.append(cache)

    def _pop(self) -> Any:
        if not self._saved:
            raise CallOrderError(f"{type(self).__name__}.backward called more times than forward "
                                 "(each forward call can be back-propagated once)")
        return self._saved.pop()

    # -- randomness ------------------------------------------------------------------------------
    def manual_seed(self, seed: Any) -> "Module":
        """Draw this module's and every submodule's dropout masks from one new stream seeded with
        ``seed`` (an int, a sequence of ints such as ``(seed, step)``, or None for OS entropy)."""
        return self.share_stream(RandomStream(seed))

    def share_stream(self, stream: RandomStream | None) -> "Module":
        """Make ``stream`` the random stream of this module and every submodule."""
        for m in self.modules():
            object.__setattr__(m, "_stream", stream)
        return self

    @property
    def random_stream(self) -> RandomStream | None:
        """The stream this module draws dropout masks from (None until seeded or first used)."""
        return self._stream

    def generator(self, like: Any):
        """The Generator this module draws from for arrays like ``like`` (an array, or a backend name).
        A module never seeded gets a stream of its own from OS entropy on first use."""
        if self._stream is None:
            object.__setattr__(self, "_stream", RandomStream(None))
        if isinstance(like, str):
            return self._stream.generators[like]
        return self._stream.generators["cupy" if is_cupy_array(like) else "numpy"]

    # -- modes and devices -----------------------------------------------------------------------
    def train(self, mode: bool = True) -> "Module":
        mode = boolean(mode, "mode")                     # bool("False") is True
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def to(self, backend: str | None = None, dtype: Any = None) -> "Module":
        """Move every parameter and buffer to ``backend`` ("numpy"/"cupy") and/or cast it to
        ``dtype`` (floating buffers only: a step counter stays an integer), a floating-point dtype:
        checked before anything moves."""
        if dtype is not None:
            dtype = float_dtype(get_backend(backend or self.backend), dtype)
        for p in self.parameters():
            data = p.data if backend is None else to_device(p.data, backend)
            if dtype is not None:
                data = data.astype(dtype, copy=False)
            p.data = data
            p.grad = None
        if self._flat is not None:       # new arrays left the flat buffers: flatten them again
            object.__setattr__(self, "_flat", self._flat.rebuilt(self))
        for mod, name in self._buffer_owners().values():
            v = getattr(mod, name)
            v = v if backend is None else to_device(v, backend)
            if dtype is not None and is_float_dtype(v.dtype):
                v = v.astype(dtype, copy=False)
            object.__setattr__(mod, name, v)
        self.clear_saved()
        return self

    @property
    def backend(self) -> str:
        for p in self.parameters():
            return backend_name(p.data)
        return "numpy"

    @property
    def dtype(self):
        for p in self.parameters():
            return p.dtype
        return get_backend("numpy").float32

    # -- state dicts -----------------------------------------------------------------------------
    def state_dict(self) -> "OrderedDict[str, Any]":
        """Name -> array (the live arrays, not copies), keyed as in the PyTorch counterpart: per
        module its parameters, then its buffers.

        Shared parameters appear under every name that uses them, as PyTorch's state_dict does.
        """
        out: OrderedDict[str, Any] = OrderedDict()
        for mod_name, mod in self.named_modules():
            dot = f"{mod_name}." if mod_name else ""
            for name, p in mod._parameters.items():
                out[dot + name] = p.data
            for name in mod._buffers:
                if getattr(mod, name) is not None:
                    out[dot + name] = getattr(mod, name)
        return out

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True, *,
                        allow_nonfinite: bool = False) -> "Module":
        """Copy arrays (NumPy, CuPy, or anything ``xp.asarray`` takes) into the parameters.

        Values are converted to each parameter's backend and dtype. A value must be a real numeric
        array (bool, int, uint or float, the dtype kinds a checkpoint holds: no strings, complex
        numbers, ragged lists or objects), and its dtype conversion must not change it beyond
        rounding: a float may round to a narrower float but not overflow to inf, and an int (or a
        value converted to an int or bool dtype) must be exactly representable. NaN and inf are
        refused, as :func:`npformer.training.checkpoint.load_checkpoint` refuses them, unless
        ``allow_nonfinite=True``. Every problem is reported at once in one :class:`StateDictError`
        naming each key, and nothing is written unless everything fits.
        """
        own = dict(self.named_parameters(remove_duplicate=False))
        buffers = self._buffer_owners()
        current = {**{k: p.data for k, p in own.items()}, **{k: getattr(m, n) for k, (m, n) in buffers.items()}}
        missing = [k for k in current if k not in state]
        unexpected = [k for k in state if k not in current]
        staged, bad = {}, []
        for k, old in current.items():
            if k not in state:
                continue
            v, problem = _converted(k, state[k], old, allow_nonfinite)
            if problem is None and tuple(v.shape) != tuple(old.shape):
                problem = f"{k}: expected shape {tuple(old.shape)}, got {tuple(v.shape)}"
            if problem is not None:
                bad.append(problem)
            staged[k] = v
        problems = bad + ([f"missing keys: {missing}"] if strict and missing else []) \
            + ([f"unexpected keys: {unexpected}"] if strict and unexpected else [])
        if problems:
            raise StateDictError(f"cannot load state dict into {type(self).__name__}: "
                                 + "; ".join(problems))
        for k, v in staged.items():
            if k in own and own[k].flat is not None:
                own[k].data[...] = v                 # in place: the parameter stays in its flat buffer
            elif k in own:
                own[k].data = v.copy()
            else:
                mod, name = buffers[k]
                object.__setattr__(mod, name, v.copy())
        self.clear_saved()
        return self

    # -- calling ---------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define backward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``module(x)`` is ``module.forward(x)``, as in PyTorch (which also runs hooks here; npformer
        has none)."""
        return self.forward(*args, **kwargs)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, child in self._modules.items():
            body = repr(child).replace("\n", "\n  ")
            lines.append(f"  ({name}): {body}")
        return lines[0] + ")" if len(lines) == 1 else "\n".join(lines) + "\n)"


class ModuleList(Module):
    """A list of modules named "0", "1", ... (as ``torch.nn.ModuleList``)."""

    def __init__(self, modules: Any = ()):
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> "ModuleList":
        setattr(self, str(len(self._modules)), module)
        return self

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self._modules.values()))


def _converted(key: str, value: Any, like: Any, allow_nonfinite: bool) -> tuple[Any, str | None]:
    """``(value as an array of like's backend and dtype, None)``, or ``(None, the problem)`` when
    ``value`` is not a real numeric array, holds NaN or inf (unless ``allow_nonfinite``), or would be
    changed by the conversion beyond a float's rounding (see :meth:`Module.load_state_dict`)."""
    xp = get_array_module(like)
    try:
        src = xp.asarray(to_device(value, backend_name(like)))
    except (ValueError, TypeError) as exc:                  # a ragged list, a dict, ...
        return None, f"{key}: not a real numeric array ({describe(value)}: {str(exc)[:80]})"
    src_float = is_float_dtype(src.dtype)                    # bfloat16's kind is "V", not "f"
    if not src_float and (src.dtype.kind not in NUMBER_KINDS or src.dtype.fields is not None):
        return None, f"{key}: not a real numeric array (dtype {src.dtype})"
    if src_float and not allow_nonfinite:
        nonfinite = int((~xp.isfinite(src)).sum())
        if nonfinite:
            return None, f"{key}: not finite ({nonfinite:,} NaN or infinite values of {src.size:,})"
    with get_backend("numpy").errstate(all="ignore"):       # overflow is reported below, by key
        v = src.astype(like.dtype)
        if src_float and is_float_dtype(v.dtype):
            changed = xp.isinf(v) & xp.isfinite(src)         # rounding is fine; overflow is not
        else:
            changed = v.astype(src.dtype) != src
            if is_float_dtype(v.dtype):
                changed |= ~xp.isfinite(v)
    n = int(changed.sum())
    if n:
        return None, (f"{key}: {n:,} of {src.size:,} values ({src.dtype}) cannot be held by the parameter's "
                      f"dtype {v.dtype} (e.g. {src[changed].ravel()[0].item()!r} would become "
                      f"{v[changed].ravel()[0].item()!r})")
    return v, None
