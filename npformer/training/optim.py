"""Optimisers (SGD, Adam, AdamW) and global gradient-norm clipping, with PyTorch's update rules.

    SGD:   d = g + wd*p;  buf = d (first step) | momentum*buf + (1 - dampening)*d;
           d = d + momentum*buf (nesterov) | buf;  p -= lr*d
    Adam:  g = g + wd*p (L2);  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g;
           p -= lr * m_hat / (sqrt(v_hat) + eps),  m_hat = m/(1-b1^t),  v_hat = v/(1-b2^t)
    AdamW: p *= 1 - lr*wd first (decoupled decay, Loshchilov & Hutter 2019), then Adam without L2
    clip:  n = ||concat(grads)||_2;  g *= min(1, max_norm/(n + eps))

Sources: the algorithm boxes of torch.optim.SGD/Adam/AdamW and torch.nn.utils.clip_grad_norm_.
Adam is evaluated as torch does it: denom = sqrt(v)/sqrt(1-b2^t) + eps, p -= lr/(1-b1^t) * m/denom.
The update rules themselves are the ops :func:`~npformer.ops.optim.adam_update` and
:func:`~npformer.ops.optim.sgd_update`. State (step counts, moments in the parameter's dtype) lives
here, never in the layers; parameters are updated in place, so views of ``p.data`` held elsewhere
(tied embeddings) stay shared.

Flat buffers (:mod:`npformer.nn.flat`): when the parameters live in flat buffers and their grads in
the flat gradient buffers, a step updates each run of neighbouring parameters with one call of the
update op (:mod:`npformer.training.flat_runs` finds the runs and keeps the flat moment buffers), and
``clip_grad_norm`` takes one sum of squares per buffer. The numbers are those of the per-parameter loop
(the update is element-wise; the norm's additions come in another order). The per-parameter loop runs
for parameters outside flat buffers, and for everything inside ``npformer.kernels.disabled()``.
``state_dict`` is the same either way (``state.{i}.exp_avg`` is parameter i's view of the flat moment
buffer, saved as a copy).
"""
from __future__ import annotations

import math
from numbers import Real
from typing import Any

from npformer.backend import backend_name, get_array_module, to_device
from npformer.checks import describe, expect_float, positive_in_dtype, real
from npformer.dispatch import enabled
from npformer.errors import InputTypeError
from npformer.nn.module import Module, Parameter, clear_grads
from npformer.training.flat_runs import FlatRuns
from npformer.ops.optim import PAIRS, RULES, adam_update, grad_dtype_fits, hyperparameter, sgd_update, sum_of_squares

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm", "clip_coefficient", "covered_buffers"]

INF = math.inf


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


def _mirror_view(p: Parameter) -> Any:
    """The parameter's part of its flat buffer's mirror (mixed precision's model weights), or None."""
    slot = p.flat
    if slot is None or slot.buffer.mirror is None:
        return None
    return slot.buffer.mirror[slot.start:slot.stop].reshape(p.shape)


def covered_buffers(params: Any) -> list | None:
    """The flat buffers whose gradients are exactly these parameters' grads, or None.

    Each parameter's grad must be its slot's view of a flat gradient buffer, and every parameter of
    each such buffer must be among ``params``; then a sum or a scaling over the buffers is one over
    the grads (the gaps between slots hold zeros)."""
    params = list(params)
    ids, buffers = {id(p) for p in params}, {}
    for p in params:
        slot = p.flat
        if slot is None or p.grad is not slot.grad:
            return None
        buffers[id(slot.buffer)] = slot.buffer
    for b in buffers.values():
        if not all(id(q) in ids and q.flat is slot for q, slot in zip(b.params, b.slots)):
            return None
    return list(buffers.values())


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
            group = self._checked({**self.defaults, **g, "params": [p for _, p in entries],
                                   "names": [n for n, _ in entries]})
            self.param_groups.append(group)
        self.state: dict[int, dict[str, Any]] = {}
        self._flat = FlatRuns()        # the flat-buffer path's moment buffers (npformer.training.flat_runs)

    def _checked(self, group: dict) -> dict:
        """The group with every hyperparameter validated (by the update ops' :data:`RULES`) and made a
        Python number; ``group["params"]``, its Parameters, where the checks need their dtypes."""
        out = dict(group)
        for k in RULES:
            if k in out and k in PAIRS:
                v = out[k]
                if not isinstance(v, (tuple, list)) or len(v) != 2:
                    raise InputTypeError(f"{k}: expected a pair, got {describe(v)}")
                out[k] = tuple(hyperparameter(x, f"{k}[{n}]", k) for n, x in enumerate(v))
            elif k in out:
                out[k] = hyperparameter(out[k], k)
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
        """Set every parameter's grad to None (and zero their parts of flat gradient buffers)."""
        clear_grads(p for *_, p in self._indexed())

    def step(self, *, grad_scale: float = 1.0) -> None:
        """One update of every parameter whose grad is not None (the others are skipped).

        Each parameter steps with ``p.grad * grad_scale``, in the parameter's dtype; a grad may be
        float16 or bfloat16 for a wider parameter. Mixed precision (:mod:`npformer.training.amp`) passes
        its float32 masters the model's 16-bit gradients and the factor 1 / S times the clipping
        factor, which the update applies as it reads them (as torch's fused optimisers take the
        scaler's), so no float32 copy of the gradients is made.

        Hyperparameters and grads are all checked first, so a bad one leaves every parameter as it was.
        """
        grad_scale = real(grad_scale, "grad_scale", 0)
        groups = [self._checked(group) for group in self.param_groups]   # may have been edited
        todo = [item for item in self._indexed() if item[3].grad is not None]
        for i, _, name, p in todo:
            get_array_module(p.data, p.grad)     # one backend, or a TypeError naming both
            if tuple(p.grad.shape) != p.shape or not grad_dtype_fits(p.grad.dtype, p.dtype):
                raise ValueError(f"parameter {name or i}: grad is {describe(p.grad)} but data is "
                                 f"{describe(p.data)}; they must match in shape and dtype (or the grad be "
                                 "float16 or bfloat16, a wider parameter's under mixed precision)")
        for group, checked in zip(self.param_groups, groups):
            group.update(checked)
        runs = self._flat.runs(todo, self.state, self._run_key) if enabled() else None
        if runs is None:
            for i, group, _, p in todo:
                self._update(p, p.grad, self.state.setdefault(i, {}), group, _mirror_view(p), grad_scale)
            return
        for buffer, start, end, items in runs:
            self._update_run(buffer, start, end, items, grad_scale)

    def _update(self, p: Parameter, g: Any, state: dict, group: dict, copy: Any, grad_scale: float) -> None:
        """Update one parameter with ``g * grad_scale`` (and write ``copy``, its buffer's mirror, when
        not None)."""
        raise NotImplementedError

    # -- flat buffers ------------------------------------------------------------------------------
    def _run_key(self, p: Parameter, state: dict, group: dict) -> tuple:
        """What parameters of one run share (beside their group): the update's per-parameter inputs."""
        raise NotImplementedError

    def _update_run(self, buffer, start: int, end: int, items: list, grad_scale: float) -> None:
        """Update elements [start, end) of ``buffer``: the parameters ``items`` [(index, group, p)],
        with ``buffer.grad * grad_scale``."""
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
                groups.append(self._checked({**new, "params": g["params"]}))
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

    def _sgd_args(self, group):
        return {k: group[k] for k in ("lr", "momentum", "dampening", "nesterov", "weight_decay")}

    def _update(self, p, g, state, group, copy, grad_scale):
        first = group["momentum"] != 0 and "momentum_buffer" not in state
        if first:
            state["momentum_buffer"] = get_array_module(p.data).empty_like(p.data)   # (same as p), set to d
        state["step"] = state.get("step", 0) + 1
        sgd_update(p.data, g, state.get("momentum_buffer") if group["momentum"] != 0 else None,
                   first=first, param_copy=copy, grad_scale=grad_scale, **self._sgd_args(group))   # in place

    def _run_key(self, p, state, group):
        return (state.get("step", 0), "momentum_buffer" in state)

    def _update_run(self, buffer, start, end, items, grad_scale):
        group = items[0][1]
        first = group["momentum"] != 0 and "momentum_buffer" not in self.state.get(items[0][0], {})
        moments = self._flat.moments(self, buffer, start, end, items,
                                     self.moments if group["momentum"] != 0 else ())
        for i, _, _ in items:
            self.state[i]["step"] = self.state[i].get("step", 0) + 1
        sgd_update(buffer.data[start:end], buffer.grad[start:end], moments.get("momentum_buffer"), first=first,
                   param_copy=None if buffer.mirror is None else buffer.mirror[start:end], grad_scale=grad_scale,
                   **self._sgd_args(group))


class Adam(Optimizer):
    """``Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)``, L2 in the grad.

    State: "step" (t), "exp_avg" (m) and "exp_avg_sq" (v), the moments in the parameter's dtype, in
    which the update is computed: eps must stay > 0 there (1e-8 is 0 in float16; a 16-bit model steps
    float32 masters, :mod:`npformer.training.amp`).
    """

    moments = ("exp_avg", "exp_avg_sq")
    decoupled = False           # AdamW: decay multiplies the parameter instead of joining the grad

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, lr, {"betas": betas, "eps": eps, "weight_decay": weight_decay})

    def _checked(self, group):
        """The base checks, then eps against the dtype of each of the group's parameters, which Adam
        computes in: eps > 0 may still round to 0 there (1e-50 in float32), and a zero gradient's
        update be 0 / 0 = NaN."""
        out = super()._checked(group)
        for dtype in {p.dtype for p in out.get("params", ())}:
            positive_in_dtype(out["eps"], "eps", dtype)
        return out

    def _decays(self, p: Parameter) -> bool:
        return True

    def _adam_args(self, p: Parameter, group: dict, step: int) -> dict:
        """The keyword arguments of adam_update for parameter ``p`` (its weight decay) at ``step``."""
        b1, b2 = group["betas"]
        wd = group["weight_decay"] if not self.decoupled or self._decays(p) else 0.0
        return dict(step=step, lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"], weight_decay=wd,
                    decoupled=self.decoupled)

    def _update(self, p, g, state, group, copy, grad_scale):
        xp = get_array_module(p.data)
        if not state:
            state.update(step=0, exp_avg=xp.zeros_like(p.data), exp_avg_sq=xp.zeros_like(p.data))
        state["step"] += 1
        adam_update(p.data, g, state["exp_avg"], state["exp_avg_sq"], param_copy=copy, grad_scale=grad_scale,
                    **self._adam_args(p, group, state["step"]))          # in place: views stay shared

    def _run_key(self, p, state, group):
        return (state.get("step", 0), self._adam_args(p, group, 1)["weight_decay"])

    def _update_run(self, buffer, start, end, items, grad_scale):
        for i, _, _ in items:
            self.state.setdefault(i, {}).setdefault("step", 0)     # first, as _update orders the state
        moments = self._flat.moments(self, buffer, start, end, items, self.moments)
        for i, _, _ in items:
            self.state[i]["step"] += 1
        i, group, p = items[0]
        adam_update(buffer.data[start:end], buffer.grad[start:end], moments["exp_avg"], moments["exp_avg_sq"],
                    param_copy=None if buffer.mirror is None else buffer.mirror[start:end], grad_scale=grad_scale,
                    **self._adam_args(p, group, self.state[i]["step"]))


class AdamW(Adam):
    """``AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decay_filter="auto")``.

    ``decay_filter="auto"`` decays only parameters whose ``.decay`` is True (not biases, norm gains
    or embeddings); ``"matrices"`` every parameter of two or more axes (the embeddings too, as nanoGPT
    and GPT-2); ``None`` every parameter, as torch.optim.AdamW does.
    """

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 decay_filter="auto"):
        if decay_filter not in ("auto", "matrices", None):
            raise ValueError(f"decay_filter must be 'auto', 'matrices' or None, got {decay_filter!r}")
        self.decay_filter = decay_filter
        super().__init__(params, lr, betas, eps, weight_decay)

    def _decays(self, p):
        if self.decay_filter == "matrices":                  # nanoGPT's rule: every 2-d parameter
            return p.data.ndim >= 2
        return self.decay_filter is None or bool(p.decay)


def clip_grad_norm(params: Any, max_norm: float, eps: float = 1e-6,
                   error_if_nonfinite: bool = True) -> float:
    """Scale every grad in place by min(1, max_norm/(norm + eps)) (:func:`clip_coefficient`: 1 for a
    zero norm, even with eps 0); return the norm before clipping.

    ``params``: Parameters or (name, Parameter) pairs. Grads that are None are skipped, a parameter
    listed twice counts once, and with no grads at all the norm is 0.0. Squares are summed in
    float64, so float32/16 grads cannot overflow (float64 grads beyond ~1e154 can). A non-finite
    norm raises FloatingPointError naming the parameters with non-finite grads when
    ``error_if_nonfinite`` (the default); otherwise the grads are left unchanged and the non-finite
    norm is returned so the caller can skip the step (torch would write NaN into them instead).
    When the grads fill whole flat gradient buffers (:func:`covered_buffers`), the sum of squares
    and the scaling run once per buffer.
    """
    if not (isinstance(max_norm, Real) and max_norm == INF):        # inf: measure without clipping
        max_norm = real(max_norm, "max_norm", 0, what="inf (no clipping) or a number")
    eps = real(eps, "eps", 0)
    entries, seen = [], set()
    for name, p in _entries(params, "clip_grad_norm"):
        if p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            entries.append((name, p))
    if not entries:
        return 0.0
    xp = get_array_module(*[p.grad for _, p in entries])
    flat = covered_buffers(p for _, p in entries) if enabled() else None
    grads = [p.grad for _, p in entries] if flat is None else [b.grad for b in flat]   # one per buffer, if flat
    total = math.sqrt(float(xp.stack([sum_of_squares(g) for g in grads]).sum()))  # squares in float64
    if not math.isfinite(total):
        if error_if_nonfinite:
            bad = [n or f"#{k}" for k, (n, p) in enumerate(entries) if not bool(xp.isfinite(p.grad).all())]
            raise FloatingPointError(f"total gradient norm is not finite ({total}); non-finite grads "
                                     f"in parameters {bad}; grads left unchanged")
        return total
    coef = clip_coefficient(total, max_norm, eps)
    if coef < 1.0:
        for g in grads:
            g *= coef
    return total


def clip_coefficient(norm: float, max_norm: float, eps: float = 1e-6) -> float:
    """What clipping multiplies the gradients by: ``max_norm / (norm + eps)`` when that is below 1,
    else 1 (``max_norm`` inf: never clips; a zero norm with eps 0: every gradient is zero, nothing to
    clip, whatever ``max_norm``)."""
    if not (isinstance(max_norm, Real) and max_norm == INF):
        max_norm = real(max_norm, "max_norm", 0, what="inf (no clipping) or a number")
    if norm + eps == 0.0:                                # no division by zero
        return 1.0
    coef = max_norm / (norm + eps)
    return coef if coef < 1.0 else 1.0
