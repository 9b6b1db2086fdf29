"""Optimisers (SGD, Adam, AdamW) and global gradient-norm clipping, with PyTorch's update rules.

    SGD:   d = g + wd*p;  buf = d (first step) | momentum*buf + (1 - dampening)*d;
           d = d + momentum*buf (nesterov) | buf;  p -= lr*d
    Adam:  g = g + wd*p (L2);  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g;
           p -= lr * m_hat / (sqrt(v_hat) + eps),  m_hat = m/(1-b1^t),  v_hat = v/(1-b2^t)
    AdamW: p *= 1 - lr*wd first (decoupled decay, Loshchilov & Hutter 2019), then Adam without L2
    clip:  n = ||concat(grads)||_2;  g *= min(1, max_norm/(n + eps))

Sources: the algorithm boxes of torch.optim.SGD/Adam/AdamW and torch.nn.utils.clip_grad_norm_.
Adam is evaluated as torch does it: denom = sqrt(v)/sqrt(1-b2^t) + eps, p -= lr/(1-b1^t) * m/denom.
State (step counts, moments in the parameter's dtype) lives here, never in the layers; parameters
are updated in place, so views of ``p.data`` held elsewhere (tied embeddings) stay shared.
"""
from __future__ import annotations

import math
from numbers import Real
from typing import Any

from npformer.backend import backend_name, get_array_module, to_device
from npformer.checks import describe, expect_float, real
from npformer.errors import InputTypeError
from npformer.nn.module import Module, Parameter

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm"]

INF = math.inf
# hyperparameter -> (low, high, low excluded, high excluded); a pair (PAIRS) is checked per item
RULES = {"lr": (0, INF, False, False), "weight_decay": (0, INF, False, False),
         "momentum": (0, INF, False, False), "dampening": (0, 1, False, False),
         "betas": (0, 1, False, True), "eps": (0, INF, True, False)}
PAIRS = ("betas",)              # hyperparameters given as a pair, each item checked by its rule


def _entries(items: Any, where: str) -> list:
    """[(name or None, Parameter)] from Parameters or (name, Parameter) pairs."""
    out = []
    for it in items:
        name, p = it if isinstance(it, tuple) and len(it) == 2 else (None, it)
        if not isinstance(p, Parameter):
            raise TypeError(f"{where}: expected Parameter or (name, Parameter), got {describe(it)}")
        expect_float(p.data, f"{where}: data of parameter {name or len(out)}")
        out.append((name, p))
    return out


class Optimizer:
    """Base class: param groups, per-parameter state by global index, lr, zero_grad, state dicts.

    ``params``: Parameters, (name, Parameter) pairs (``model.named_parameters()``), or a list of
    group dicts ``{"params": [...], "lr": ..., "weight_decay": ...}`` whose missing keys take the
    constructor's values. ``self.state[i]`` holds parameter i's "step" and moment arrays.
    """

    moments: tuple = ()         # names of the per-parameter arrays in the state

    def __init__(self, params: Any, lr: float, defaults: dict | None = None):
        self.defaults = {"lr": lr, **(defaults or {})}
        if isinstance(params, Module):
            raise TypeError(f"pass model.parameters() or model.named_parameters(), not the "
                            f"{type(params).__name__} module itself")
        items = [params] if isinstance(params, (dict, Parameter)) else list(params)
        if not items:
            raise ValueError("optimizer got an empty parameter list")
        self.param_groups, seen = [], set()
        for j, g in enumerate(items if all(isinstance(g, dict) for g in items) else [{"params": items}]):
            if "params" not in g or set(g) - set(self.defaults) - {"params"}:
                raise ValueError(f"param group {j}: expected keys 'params' and any of "
                                 f"{sorted(self.defaults)}, got {sorted(g)}")
            entries = _entries(g["params"], f"param group {j}")
            ids = [id(p) for _, p in entries]
            if not entries or len(set(ids)) < len(ids) or seen.intersection(ids):
                raise ValueError(f"param group {j}: " + ("a parameter appears more than once"
                                                          if entries else "empty parameter list"))
            seen.update(ids)
            group = self._checked({**self.defaults, **g})
            group.update(params=[p for _, p in entries], names=[n for n, _ in entries])
            self.param_groups.append(group)
        self.state: dict[int, dict[str, Any]] = {}

    def _checked(self, group: dict) -> dict:
        """The group with every hyperparameter validated and made a Python number."""
        out = dict(group)
        for k, (low, high, low_open, high_open) in RULES.items():
            if k in out and k in PAIRS:
                v = out[k]
                if not isinstance(v, (tuple, list)) or len(v) != 2:
                    raise InputTypeError(f"{k}: expected a pair, got {describe(v)}")
                out[k] = tuple(real(x, f"{k}[{n}]", low, high, low_open=low_open, high_open=high_open)
                               for n, x in enumerate(v))
            elif k in out:
                out[k] = real(out[k], k, low, high, low_open=low_open, high_open=high_open)
        return out

    def _indexed(self):
        """(global index, group, name, Parameter) for every parameter, in order."""
        i = 0
        for group in self.param_groups:
            for name, p in zip(group["names"], group["params"]):
                yield i, group, name, p
                i += 1

    @property
    def lr(self) -> float:
        """The learning rate; setting it sets every group's (reading needs all groups to agree)."""
        lrs = sorted({g["lr"] for g in self.param_groups})
        if len(lrs) != 1:
            raise ValueError(f"param groups have different lr {lrs}; read param_groups[j]['lr']")
        return lrs[0]

    @lr.setter
    def lr(self, value: float) -> None:
        value = real(value, "lr", 0)
        for g in self.param_groups:
            g["lr"] = value

    def zero_grad(self) -> None:
        """Set every parameter's grad to None."""
        for _, _, _, p in self._indexed():
            p.grad = None

    def step(self) -> None:
        """One update of every parameter whose grad is not None (the others are skipped).

        Hyperparameters and grads are all checked first, so a bad one leaves every parameter as it was.
        """
        groups = [self._checked(group) for group in self.param_groups]   # may have been edited
        todo = [item for item in self._indexed() if item[3].grad is not None]
        for i, _, name, p in todo:
            get_array_module(p.data, p.grad)     # one backend, or a TypeError naming both
            if tuple(p.grad.shape) != p.shape or p.grad.dtype != p.dtype:
                raise ValueError(f"parameter {name or i}: grad is {describe(p.grad)} but data is "
                                 f"{describe(p.data)}; they must match in shape and dtype")
        for group, checked in zip(self.param_groups, groups):
            group.update(checked)
        for i, group, _, p in todo:
            self._update(p, p.grad, self.state.setdefault(i, {}), group)

    def _update(self, p: Parameter, g: Any, state: dict, group: dict) -> None:
        raise NotImplementedError

    def _header(self) -> dict[str, Any]:
        out: dict[str, Any] = {"param_count": sum(len(g["params"]) for g in self.param_groups)}
        for j, g in enumerate(self.param_groups):
            out[f"group.{j}.param_count"] = len(g["params"])
            for k in self.defaults:              # a tuple (betas) is stored item by item
                items = enumerate(g[k]) if isinstance(g[k], tuple) else [(None, g[k])]
                out.update({f"group.{j}.{k}" + ("" if n is None else f".{n}"): v for n, v in items})
        return out

    def state_dict(self) -> dict[str, Any]:
        """Flat {str: number | array copy}: ``group.{j}.{name}``, ``state.{i}.{step | moment}``.

        Ready for ``np.savez`` and back from ``np.load(..., allow_pickle=False)`` (0-d arrays are
        accepted wherever a number is).
        """
        out = self._header()
        for i, st in sorted(self.state.items()):
            out.update({f"state.{i}.{k}": (v.copy() if k in self.moments else v) for k, v in st.items()})
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> "Optimizer":
        """Restore from :meth:`state_dict` output; everything is checked before anything is written."""
        head, params = self._header(), [p for *_, p in self._indexed()]
        problems = [f"missing key {k!r}" for k in head if k not in sd]
        problems += [f"{k}: expected {head[k]}, got {sd[k]}" for k in head
                     if k.endswith("param_count") and k in sd and int(sd[k]) != head[k]]
        staged: dict[int, dict[str, Any]] = {}
        for k in sorted(set(sd) - set(head)):
            _, i, name = (k.split(".", 2) + ["", ""])[:3]
            if not (k.startswith("state.") and i.isdigit() and int(i) < len(params)
                    and name in ("step",) + self.moments):
                problems.append(f"unexpected key {k!r}")
            elif name == "step":
                staged.setdefault(int(i), {})[name] = int(sd[k])
            else:
                p = params[int(i)]
                v = get_array_module(p.data).array(to_device(sd[k], backend_name(p.data)), dtype=p.dtype)
                if tuple(v.shape) != p.shape:
                    problems.append(f"{k}: expected shape {p.shape}, got {tuple(v.shape)}")
                staged.setdefault(int(i), {})[name] = v
        problems += [f"state.{i}: incomplete, has {sorted(st)}" for i, st in staged.items()
                     if not self._complete(st)]
        groups = []
        for j, g in enumerate(self.param_groups if not problems else []):
            new = {k: tuple(sd[f"group.{j}.{k}.{n}"] for n in range(len(g[k])))
                   if isinstance(g[k], tuple) else sd[f"group.{j}.{k}"] for k in self.defaults}
            try:
                groups.append(self._checked(new))
            except (TypeError, ValueError) as exc:
                problems.append(f"group {j}: {exc}")
        if problems:
            raise ValueError(f"cannot load state dict into {type(self).__name__}: " + "; ".join(problems))
        for g, new in zip(self.param_groups, groups):
            g.update(new)
        self.state = staged
        return self

    def _complete(self, st: dict) -> bool:
        return set(st) == {"step", *self.moments}


class SGD(Optimizer):
    """``SGD(params, lr, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0)``.

    State: "step" and, once momentum is non-zero, "momentum_buffer". Weight decay is L2 on every
    parameter of the group, as in torch.
    """

    moments = ("momentum_buffer",)

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0):
        super().__init__(params, lr, {"momentum": momentum, "dampening": dampening,
                                      "nesterov": nesterov, "weight_decay": weight_decay})

    def _checked(self, group):
        out = super()._checked(group)
        v = out["nesterov"]                      # a bool, or a 0-d bool array (from np.load)
        if not (isinstance(v, bool) or getattr(v, "dtype", None) is not None
                and v.dtype.kind == "b" and v.ndim == 0):
            raise TypeError(f"nesterov must be a bool, got {describe(v)}")
        out["nesterov"] = bool(v)
        if out["nesterov"] and (out["momentum"] <= 0 or out["dampening"] != 0):
            raise ValueError("nesterov momentum requires momentum > 0 and dampening == 0, got "
                             f"momentum={out['momentum']}, dampening={out['dampening']}")
        return out

    def _complete(self, st):                     # the buffer is absent while momentum is 0
        return "step" in st and set(st) <= {"step", "momentum_buffer"}

    def _update(self, p, g, state, group):
        mom, wd = group["momentum"], group["weight_decay"]
        d = g + wd * p.data if wd != 0 else g                      # (same as p)
        if mom != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = d.copy()           # (same as p), first step: buf = d
            else:
                buf *= mom                                          # buf = mom*buf + (1-damp)*d
                buf += (1.0 - group["dampening"]) * d
            d = d + mom * buf if group["nesterov"] else buf         # (same as p)
        state["step"] = state.get("step", 0) + 1
        p.data -= group["lr"] * d                                   # in place: views stay shared


class Adam(Optimizer):
    """``Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)``, L2 in the grad.

    State: "step" (t), "exp_avg" (m) and "exp_avg_sq" (v), the moments in the parameter's dtype.
    """

    moments = ("exp_avg", "exp_avg_sq")
    decoupled = False           # AdamW: decay multiplies the parameter instead of joining the grad

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, lr, {"betas": betas, "eps": eps, "weight_decay": weight_decay})

    def _decays(self, p: Parameter) -> bool:
        return True

    def _update(self, p, g, state, group):
        xp = get_array_module(p.data)
        (b1, b2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
        if not state:
            state.update(step=0, exp_avg=xp.zeros_like(p.data), exp_avg_sq=xp.zeros_like(p.data))
        state["step"] += 1
        t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
        if wd != 0 and not self.decoupled:
            g = g + wd * p.data                                     # (same as p), Adam: L2 term
        elif wd != 0 and self._decays(p):
            p.data *= 1.0 - lr * wd                                 # AdamW: p -= lr*wd*p, first
        m *= b1                                                     # m = b1*m + (1-b1)*g
        m += (1.0 - b1) * g
        v *= b2                                                     # v = b2*v + (1-b2)*g*g
        v += (1.0 - b2) * (g * g)
        denom = xp.sqrt(v)                                          # (same as p)
        denom /= math.sqrt(1.0 - b2 ** t)                           # sqrt(v_hat) = sqrt(v/(1-b2^t))
        denom += group["eps"]
        upd = m / denom                                             # (same as p)
        upd *= lr / (1.0 - b1 ** t)                                 # lr * m_hat / (sqrt(v_hat)+eps)
        p.data -= upd


class AdamW(Adam):
    """``AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decay_filter="auto")``.

    ``decay_filter="auto"`` decays only parameters whose ``.decay`` is True (not biases, norm gains
    or embeddings); ``None`` decays every parameter, as torch.optim.AdamW does.
    """

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 decay_filter="auto"):
        if decay_filter not in ("auto", None):
            raise ValueError(f"decay_filter must be 'auto' or None, got {decay_filter!r}")
        self.decay_filter = decay_filter
        super().__init__(params, lr, betas, eps, weight_decay)

    def _decays(self, p):
        return self.decay_filter is None or bool(p.decay)


def clip_grad_norm(params: Any, max_norm: float, eps: float = 1e-6,
                   error_if_nonfinite: bool = True) -> float:
    """Scale every grad in place by min(1, max_norm/(norm + eps)); return the norm before clipping.

    ``params``: Parameters or (name, Parameter) pairs. Grads that are None are skipped, a parameter
    listed twice counts once, and with no grads at all the norm is 0.0. Squares are summed in
    float64, so float32/16 grads cannot overflow (float64 grads beyond ~1e154 can). A non-finite
    norm raises FloatingPointError naming the parameters with non-finite grads when
    ``error_if_nonfinite`` (the default); otherwise the grads are left unchanged and the non-finite
    norm is returned so the caller can skip the step (torch would write NaN into them instead).
    """
    if not (isinstance(max_norm, Real) and max_norm == INF):        # inf: measure without clipping
        max_norm = real(max_norm, "max_norm", 0, what="inf (no clipping) or a number")
    eps = real(eps, "eps", 0)
    entries, seen = [], set()
    for name, p in _entries(params, "clip_grad_norm"):
        if p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            entries.append((name, p.grad))
    if not entries:
        return 0.0
    xp = get_array_module(*[g for _, g in entries])
    squares = []
    for _, g in entries:
        g64 = g.astype(xp.float64)                                  # (same as g)
        squares.append((g64 * g64).sum())                           # ()
    total = math.sqrt(float(xp.stack(squares).sum()))
    if not math.isfinite(total):
        if error_if_nonfinite:
            bad = [n or f"#{k}" for k, (n, g) in enumerate(entries) if not bool(xp.isfinite(g).all())]
            raise FloatingPointError(f"total gradient norm is not finite ({total}); non-finite grads "
                                     f"in parameters {bad}; grads left unchanged")
        return total
    coef = max_norm / (total + eps)
    if coef < 1.0:
        for _, g in entries:
            g *= coef
    return total
