"""``RNN`` (Elman, tanh) and ``LSTM`` modules, as ``torch.nn.RNN``/``torch.nn.LSTM`` with one layer and
``batch_first=True``; the math and the backward through time are in :mod:`npformer.ops.rnn`.

Parameters keep PyTorch's names and layout, so a ``state_dict`` copies across unchanged:
``weight_ih_l0`` (G*H, I), ``weight_hh_l0`` (G*H, H), ``bias_ih_l0`` and ``bias_hh_l0`` (G*H,), with
G = 1 (RNN) or 4 (LSTM, gate blocks i, f, g, o). All start U(-1/sqrt(H), 1/sqrt(H)), as PyTorch.

As in PyTorch, ``forward(input, hx)`` returns ``(output, h_n)`` (RNN) or ``(output, (h_n, c_n))``
(LSTM), where output (B, T, H) holds every step and the states are (1, B, H). ``backward`` takes
the gradients of those outputs (any may be None, meaning zero) and returns the gradients of the
input and of the initial state(s); parameter gradients accumulate.
"""
from __future__ import annotations

import math

from npformer.backend import get_array_module
from npformer.checks import describe, expect_shape, positive_int
from npformer.errors import InputTypeError, RangeError
from npformer.nn import init
from npformer.nn.module import Module, Parameter
from npformer.ops.rnn import lstm_backward, lstm_forward, rnn_backward, rnn_forward

__all__ = ["RNN", "LSTM"]


class _Recurrent(Module):
    _gates = 1

    def __init__(self, input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                 dtype, backend, rng):
        super().__init__()
        input_size, hidden_size = positive_int(input_size, "input_size"), positive_int(hidden_size, "hidden_size")
        unsupported = [(num_layers != 1, f"num_layers=1 (stack modules for more), got {num_layers!r}"),
                       (not batch_first, "batch_first=True: inputs are (B, T, input_size)"),
                       (dropout != 0, f"dropout=0 (it acts only between stacked layers), got {dropout!r}"),
                       (bidirectional, "bidirectional=False")]
        for bad, what in unsupported:
            if bad:
                raise RangeError(f"{type(self).__name__} supports only {what}")
        rng = init.host_generator(rng)
        self.input_size, self.hidden_size = input_size, hidden_size
        g, bound = self._gates * hidden_size, 1.0 / math.sqrt(hidden_size)
        kw = dict(rng=rng, dtype=dtype, backend=backend)
        self.weight_ih_l0 = Parameter(init.uniform((g, input_size), bound, **kw))
        self.weight_hh_l0 = Parameter(init.uniform((g, hidden_size), bound, **kw))
        if bias:
            self.bias_ih_l0 = Parameter(init.uniform((g,), bound, **kw), decay=False)
            self.bias_hh_l0 = Parameter(init.uniform((g,), bound, **kw), decay=False)
        else:
            self.register_parameter("bias_ih_l0", None)
            self.register_parameter("bias_hh_l0", None)

    def _weights(self):
        return tuple(None if p is None else p.data
                     for p in (self.weight_ih_l0, self.weight_hh_l0, self.bias_ih_l0, self.bias_hh_l0))

    def _state(self, s, name, x):
        """A (1, B, H) state as the op's (B, H), or None."""
        if s is None:
            return None
        if getattr(x, "ndim", 0) != 3:
            return s        # the op reports the bad input
        expect_shape(s, name, (1, x.shape[0], self.hidden_size), "(num_layers=1, B, hidden_size)")
        return s[0]

    def _dout(self, doutput, dh_n):
        """The op's ``dout``: doutput with dh_n (1, B, H) added to its last step (None: zeros)."""
        cache = self._saved[-1] if self._saved else None
        if cache is None:
            return doutput
        shape = cache.h.shape
        if doutput is not None:
            expect_shape(doutput, "doutput", shape, "(B, T, hidden_size)")
        if dh_n is None:
            return doutput if doutput is not None else get_array_module(cache.h).zeros_like(cache.h)
        expect_shape(dh_n, "dh_n", (1, shape[0], shape[2]), "(1, B, hidden_size)")
        d = get_array_module(cache.h).zeros_like(cache.h) if doutput is None else doutput.copy()
        d[:, -1] += dh_n[0]
        return d                                         # (B, T, H)

    def _accumulate(self, grads):
        for p, g in zip((self.weight_ih_l0, self.weight_hh_l0, self.bias_ih_l0, self.bias_hh_l0), grads):
            if p is not None:
                p.accumulate(g)

    def extra_repr(self) -> str:
        bias = "" if self.bias_ih_l0 is not None else ", bias=False"
        return f"{self.input_size}, {self.hidden_size}, batch_first=True{bias}"


class RNN(_Recurrent):
    """Elman RNN, ``h_t = tanh(x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh)``."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, nonlinearity: str = "tanh",
                 bias: bool = True, batch_first: bool = True, dropout: float = 0.0,
                 bidirectional: bool = False, *, dtype=None, backend=None, rng=None):
        if nonlinearity != "tanh":
            raise RangeError(f"RNN supports only nonlinearity='tanh', got {nonlinearity!r}")
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         dtype, backend, rng)

    def forward(self, input, hx=None):
        """Returns ``(output (B, T, H), h_n (1, B, H))``; ``hx`` (1, B, H) or None (zeros)."""
        out, cache = rnn_forward(input, self._state(hx, "hx", input), *self._weights())
        self._push(cache)
        return out, out[:, -1][None].copy()

    def backward(self, doutput=None, dh_n=None):
        """Returns ``(dinput (B, T, I), dhx (1, B, H))``."""
        d = self._dout(doutput, dh_n)
        dx, dh0, *grads = rnn_backward(d, self._pop())
        self._accumulate(grads)
        return dx, dh0[None]


class LSTM(_Recurrent):
    """LSTM with PyTorch's gate order i, f, g, o in every (4H, .) parameter."""

    _gates = 4

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = True, dropout: float = 0.0, bidirectional: bool = False, *,
                 dtype=None, backend=None, rng=None):
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         dtype, backend, rng)

    def forward(self, input, hx=None):
        """Returns ``(output (B, T, H), (h_n, c_n))``; ``hx = (h_0, c_0)``, each (1, B, H), or None."""
        if hx is not None and not (isinstance(hx, tuple) and len(hx) == 2):
            raise InputTypeError(f"hx: expected a tuple (h_0, c_0) or None, got {describe(hx)}")
        h0, c0 = (None, None) if hx is None else hx
        out, c_n, cache = lstm_forward(input, self._state(h0, "h_0", input), self._state(c0, "c_0", input),
                                       *self._weights())
        self._push(cache)
        return out, (out[:, -1][None].copy(), c_n[None])

    def backward(self, doutput=None, dh_n=None, dc_n=None):
        """Returns ``(dinput (B, T, I), (dh_0, dc_0))``, the states (1, B, H)."""
        d = self._dout(doutput, dh_n)
        if dc_n is not None and self._saved:
            expect_shape(dc_n, "dc_n", (1,) + tuple(self._saved[-1].c0.shape), "(1, B, hidden_size)")
            dc_n = dc_n[0]
        dx, dh0, dc0, *grads = lstm_backward(d, self._pop(), dc_n)
        self._accumulate(grads)
        return dx, (dh0[None], dc0[None])
