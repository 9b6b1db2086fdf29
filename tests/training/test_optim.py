"""SGD / Adam / AdamW / clip_grad_norm: float64 reference loops, state dicts, in-place updates, errors."""
import contextlib
import io
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.errors import InputTypeError, RangeError
from npformer.kernels import disabled
from npformer.nn.module import Module, Parameter
from npformer.ops.optim import adam_update, sgd_update
from npformer.training import SGD, Adam, AdamW, clip_grad_norm
from tests.helpers import batch, host, randn, seeds, seq

SHAPES = [(3, 4), (4,), (2, 1, 3)]
DECAY = [True, False, True]                 # the (4,) parameter plays a bias


def make_params(xp, shapes=SHAPES, seed=0, dtype="float64", decay=DECAY):
    return [Parameter(randn(xp, s, seed + k, dtype), decay=d) for k, (s, d) in
            enumerate(zip(shapes, decay))]


def make_grads(shapes, steps, seed=100):
    """Fixed host gradients: grads[t][k] for step t and parameter k (float64)."""
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(s) for s in shapes] for _ in range(steps)]


def run(xp, opt, params, grads, lrs=None, dtype="float64"):
    """Step ``opt`` through ``grads`` (host arrays); returns host copies of the params after each step."""
    traj = []
    for t, gs in enumerate(grads):
        if lrs is not None:
            opt.lr = lrs[t]
        for p, g in zip(params, gs):
            p.grad = None if g is None else xp.asarray(g.astype(dtype))
        opt.step()
        traj.append([host(p.data).copy() for p in params])
    return traj


# -- independent float64 references, one parameter at a time, textbook formulas -------------------
def ref_sgd(p, grads, lrs, momentum=0.0, dampening=0.0, nesterov=False, wd=0.0):
    p, buf, out = np.array(p, dtype=np.float64), None, []
    for g, lr in zip(grads, lrs):
        d = g + wd * p
        if momentum != 0:
            buf = d.copy() if buf is None else momentum * buf + (1 - dampening) * d
            d = d + momentum * buf if nesterov else buf
        p = p - lr * d
        out.append(p)
    return out


def ref_adam(p, grads, lrs, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, decoupled=False):
    p = np.array(p, dtype=np.float64)
    m, v, out = np.zeros_like(p), np.zeros_like(p), []
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        if decoupled:
            p = p - lr * wd * p
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        p = p - lr * m_hat / (np.sqrt(v_hat) + eps)
        out.append(p)
    return out


def check_against(traj, p0s, grads, lrs, ref, rtol=1e-13, atol=1e-15, **kw_per_param):
    for k, p0 in enumerate(p0s):
        kw = {name: val[k] for name, val in kw_per_param.items()}
        expected = ref(p0, [gs[k] for gs in grads], lrs, **kw)
        for t, e in enumerate(expected):
            np.testing.assert_allclose(traj[t][k], e, rtol=rtol, atol=atol, err_msg=f"param {k} step {t}")


SGD_VARIANTS = [dict(momentum=0.0), dict(momentum=0.9), dict(momentum=0.9, dampening=0.5),
                dict(momentum=0.8, nesterov=True), dict(momentum=0.9, weight_decay=0.1),
                dict(momentum=0.7, nesterov=True, weight_decay=0.05), dict(weight_decay=0.2)]


@pytest.mark.parametrize("kw", SGD_VARIANTS)
def test_sgd_matches_reference(xp, kw):
    params, grads = make_params(xp), make_grads(SHAPES, 7)
    p0s = [host(p.data).copy() for p in params]
    traj = run(xp, SGD(params, lr=0.05, **kw), params, grads)
    ref_kw = dict(momentum=kw.get("momentum", 0.0), dampening=kw.get("dampening", 0.0),
                  nesterov=kw.get("nesterov", False), wd=kw.get("weight_decay", 0.0))
    check_against(traj, p0s, grads, [0.05] * 7, lambda *a: ref_sgd(*a, **ref_kw))


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.5, 0.9), (0.0, 0.0)])
def test_adam_matches_reference(xp, wd, betas):
    params, grads = make_params(xp), make_grads(SHAPES, 6)
    p0s = [host(p.data).copy() for p in params]
    traj = run(xp, Adam(params, lr=0.01, betas=betas, eps=1e-6, weight_decay=wd), params, grads)
    check_against(traj, p0s, grads, [0.01] * 6,
                  lambda *a: ref_adam(*a, b1=betas[0], b2=betas[1], eps=1e-6, wd=wd))


@pytest.mark.parametrize("decay_filter", ["auto", None])
def test_adamw_matches_reference_and_decays_by_filter(xp, decay_filter):
    params, grads = make_params(xp), make_grads(SHAPES, 6)
    p0s = [host(p.data).copy() for p in params]
    traj = run(xp, AdamW(params, lr=0.02, weight_decay=0.3, decay_filter=decay_filter), params, grads)
    wds = [0.3 if (d or decay_filter is None) else 0.0 for d in DECAY]
    check_against(traj, p0s, grads, [0.02] * 6, lambda *a, wd: ref_adam(*a, wd=wd, decoupled=True),
                  wd=wds)


def test_adamw_with_zero_grads_only_shrinks_decay_params(xp):
    """With g = 0 the Adam step is 0, so p_t = p_0 (1 - lr wd)^t exactly where decay applies."""
    for decay_filter in ("auto", None):
        params = make_params(xp)
        p0s = [host(p.data).copy() for p in params]
        traj = run(xp, AdamW(params, lr=0.1, weight_decay=0.5, decay_filter=decay_filter), params,
                   [[np.zeros(s) for s in SHAPES]] * 5)
        for k, p0 in enumerate(p0s):
            shrink = 0.95 ** 5 if (DECAY[k] or decay_filter is None) else 1.0
            np.testing.assert_allclose(traj[-1][k], p0 * shrink, rtol=1e-14)
            if shrink == 1.0:
                assert np.array_equal(traj[-1][k], p0)


@given(b=batch, t=seq, c=st.integers(1, 5), seed=seeds, kind=st.sampled_from(["sgd", "adam", "adamw"]),
       lr=st.sampled_from([1e-3, 0.1, 1.0]), wd=st.sampled_from([0.0, 0.01]))
def test_reference_over_shapes(xp, b, t, c, seed, kind, lr, wd):
    shapes = [(b, t, c), (c,), (t, c)]
    params, grads = make_params(xp, shapes, seed), make_grads(shapes, 5, seed + 7)
    p0s = [host(p.data).copy() for p in params]
    if kind == "sgd":
        traj = run(xp, SGD(params, lr, momentum=0.9, nesterov=True, weight_decay=wd), params, grads)
        ref = lambda *a: ref_sgd(*a, momentum=0.9, nesterov=True, wd=wd)  # noqa: E731
    else:
        cls = Adam if kind == "adam" else AdamW
        traj = run(xp, cls(params, lr, weight_decay=wd, **({} if cls is Adam else {"decay_filter": None})),
                   params, grads)
        ref = lambda *a: ref_adam(*a, wd=wd, decoupled=kind == "adamw")  # noqa: E731
    check_against(traj, p0s, grads, [lr] * 5, ref)


OPTIMIZERS = [lambda ps: SGD(ps, 0.1, momentum=0.9, weight_decay=0.01),
              lambda ps: Adam(ps, 0.01, weight_decay=0.01), lambda ps: AdamW(ps, 0.01)]


@pytest.mark.parametrize("factory", OPTIMIZERS, ids=["sgd", "adam", "adamw"])
def test_none_grad_is_skipped_and_keeps_its_own_step_count(xp, factory):
    params, grads = make_params(xp), make_grads(SHAPES, 6)
    for gs in grads[:3]:
        gs[1] = None
    p1 = host(params[1].data).copy()
    opt = factory(params)
    traj = run(xp, opt, params, grads)
    assert all(np.array_equal(traj[s][1], p1) for s in range(3))
    assert 1 not in opt.state or opt.state[1]["step"] == 3
    alone = make_params(xp)[1:2]                # the same parameter, stepped only when it had a grad
    traj_alone = run(xp, factory(alone), alone, [[gs[1]] for gs in grads[3:]])
    for s in range(3):
        assert np.array_equal(traj[3 + s][1], traj_alone[s][0])


@pytest.mark.parametrize("which", ["opt.lr", "group"])
def test_lr_change_midway_is_honoured(xp, which):
    params, grads = make_params(xp), make_grads(SHAPES, 6)
    p0s = [host(p.data).copy() for p in params]
    lrs = [0.01, 0.01, 0.01, 0.003, 0.0, 0.05]
    opt = Adam(params, lr=0.01)
    traj = []
    for t, gs in enumerate(grads):
        if which == "opt.lr":
            opt.lr = lrs[t]
        else:
            opt.param_groups[0]["lr"] = lrs[t]
        traj += run(xp, opt, params, [gs])
    assert opt.lr == 0.05
    check_against(traj, p0s, grads, lrs, ref_adam)


class Tiny(Module):
    def __init__(self, xp):
        super().__init__()
        self.weight = Parameter(randn(xp, (3, 2), 1))
        self.bias = Parameter(randn(xp, (2,), 2), decay=False)
        self.gain = Parameter(randn(xp, (2,), 3), decay=False)


def test_named_parameters_and_param_groups(xp):
    model = Tiny(xp)
    names = [n for n, _ in model.named_parameters()]
    p0s = [host(p.data).copy() for p in model.parameters()]
    shapes = [p.shape for p in model.parameters()]
    grads = make_grads(shapes, 5)
    opt = AdamW(model.named_parameters(), lr=0.01, weight_decay=0.1)
    assert opt.param_groups[0]["names"] == names == ["weight", "bias", "gain"]
    traj = run(xp, opt, list(model.parameters()), grads)
    check_against(traj, p0s, grads, [0.01] * 5, lambda *a, wd: ref_adam(*a, wd=wd, decoupled=True),
                  wd=[0.1, 0.0, 0.0])
    model = Tiny(xp)                            # two groups: its own lr and L2 for the weight only
    opt = SGD([{"params": [model.weight], "lr": 0.2, "weight_decay": 0.1},
               {"params": [("bias", model.bias), ("gain", model.gain)]}], lr=0.05, momentum=0.5)
    traj = run(xp, opt, list(model.parameters()), grads)
    check_against(traj, p0s, grads, [None] * 5,
                  lambda p, g, _, lr, wd: ref_sgd(p, g, [lr] * 5, momentum=0.5, wd=wd),
                  lr=[0.2, 0.05, 0.05], wd=[0.1, 0.0, 0.0])


def npz_round_trip(sd):
    """Save with np.savez and load back without pickle: proves the state dict is plain data."""
    assert all(isinstance(k, str) for k in sd)
    assert all(isinstance(v, (int, float, bool)) or hasattr(v, "shape") for v in sd.values())
    buf = io.BytesIO()
    np.savez(buf, **{k: host(v) if hasattr(v, "shape") else v for k, v in sd.items()})
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.parametrize("factory", OPTIMIZERS, ids=["sgd", "adam", "adamw"])
def test_state_dict_round_trip_continues_identically(xp, factory):
    grads = make_grads(SHAPES, 8)
    params = make_params(xp)
    opt = factory(params)
    run(xp, opt, params, grads[:4], lrs=[0.02] * 4)
    sd, saved = opt.state_dict(), [host(p.data).copy() for p in params]
    kept = {k: host(v).copy() if hasattr(v, "shape") else v for k, v in sd.items()}
    uninterrupted = run(xp, opt, params, grads[4:])
    for k, v in sd.items():                     # the saved dict holds copies, not live state
        assert np.array_equal(host(v), kept[k])
    resumed_params = [Parameter(xp.asarray(a), decay=d) for a, d in zip(saved, DECAY)]
    resumed = factory(resumed_params).load_state_dict(npz_round_trip(sd))
    assert resumed.lr == 0.02 and isinstance(resumed.lr, float)
    for state in resumed.state.values():
        assert isinstance(state["step"], int) and state["step"] == 4
    traj = run(xp, resumed, resumed_params, grads[4:])
    for a, b in zip(uninterrupted, traj):
        for x, y in zip(a, b):
            assert np.array_equal(x, y)


def test_load_state_dict_rejects_mismatches_and_writes_nothing(xp):
    params = make_params(xp)
    opt = Adam(params, lr=0.01)
    run(xp, opt, params, make_grads(SHAPES, 2))
    good = opt.state_dict()
    other = Adam(make_params(xp)[:2], lr=0.5)
    with pytest.raises(ValueError, match="param_count: expected 2, got 3"):
        other.load_state_dict(good)
    bad_shape = dict(good, **{"state.0.exp_avg": xp.zeros((4, 3))})
    bad_key = dict(good, **{"state.0.momentum_buffer": xp.zeros((3, 4))})
    missing = {k: v for k, v in good.items() if k != "group.0.lr"}
    incomplete = {k: v for k, v in good.items() if k != "state.1.exp_avg_sq"}
    bad_lr = dict(good, **{"group.0.lr": -1.0})
    fresh = Adam(make_params(xp), lr=0.3)
    for sd, match in [(bad_shape, r"state.0.exp_avg: expected shape \(3, 4\), got \(4, 3\)"),
                      (bad_key, "unexpected key 'state.0.momentum_buffer'"),
                      (missing, "missing key 'group.0.lr'"), (incomplete, "state.1: incomplete"),
                      (bad_lr, r"group 0: lr: expected a finite number >= 0, got -1.0")]:
        with pytest.raises(ValueError, match=match):
            fresh.load_state_dict(sd)
        assert fresh.state == {} and fresh.lr == 0.3
    with pytest.raises(ValueError, match="unexpected key 'state.1.exp_avg'"):
        SGD(make_params(xp), lr=0.1).load_state_dict(good)


def test_float32_stays_float32_in_place_and_through_views(xp):
    """Non-contiguous (transposed) parameter views are updated in place and stay shared."""
    grads = make_grads(SHAPES, 5)
    for cls in (SGD, Adam, AdamW):
        base = randn(xp, (4, 3), 0, "float32")
        params = [Parameter(base.T), Parameter(randn(xp, (4,), 1, "float32"), decay=False),
                  Parameter(randn(xp, (2, 1, 3), 2, "float32"))]
        assert not params[0].data.flags.c_contiguous
        p0s = [host(p.data).astype(np.float64) for p in params]
        arrays = [p.data for p in params]
        opt = cls(params, lr=0.01, **(dict(momentum=0.9) if cls is SGD else {}))
        traj = run(xp, opt, params, grads, dtype="float32")
        assert all(p.data is a and a.dtype == xp.float32 for p, a in zip(params, arrays))
        assert all(v.dtype == xp.float32 for v in opt.state_dict().values() if hasattr(v, "dtype"))
        np.testing.assert_array_equal(host(base).T, host(params[0].data))   # the view saw it all
        if cls is SGD:
            ref, kw = (lambda *a: ref_sgd(*a, momentum=0.9)), {}
        else:
            ref = lambda *a, wd: ref_adam(*a, wd=wd, decoupled=cls is AdamW)  # noqa: E731
            kw = {"wd": [0.01, 0.0, 0.01] if cls is AdamW else [0.0] * 3}
        check_against(traj, p0s, grads, [0.01] * 5, ref, rtol=2e-5, atol=1e-6, **kw)


@pytest.mark.parametrize("factory", OPTIMIZERS, ids=["sgd", "adam", "adamw"])
def test_grads_are_not_mutated_nor_aliased(xp, factory):
    params = make_params(xp)
    opt = factory(params)
    for gs in make_grads(SHAPES, 3):
        for p, g in zip(params, gs):
            p.grad = xp.asarray(g)
        opt.step()
        for p, g in zip(params, gs):
            np.testing.assert_array_equal(host(p.grad), g)
    before = opt.state_dict()
    for p in params:
        p.grad *= 100.0                         # the optimiser kept no reference to the grads
    after = opt.state_dict()
    assert all(np.array_equal(host(before[k]), host(after[k])) for k in before)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    snapshot = [host(p.data).copy() for p in params]
    opt.step()                                  # nothing has a grad: nothing moves
    assert all(np.array_equal(host(p.data), s) for p, s in zip(params, snapshot))


@pytest.mark.parametrize("factory", OPTIMIZERS, ids=["sgd", "adam", "adamw"])
def test_grad_scale_steps_as_the_scaled_grads_and_leaves_them_as_they_are(xp, factory):
    """step(grad_scale=c) is step() with every grad multiplied by c first (in the parameter's dtype),
    and the grads themselves are not changed; a float16 grad steps a float32 parameter as its
    float32 value would; c must be a finite number >= 0."""
    scaled, plain = make_params(xp), make_params(xp)
    half = [Parameter(xp.asarray(host(p.data).astype(np.float32))) for p in make_params(xp)]
    half_ref = [Parameter(xp.asarray(host(p.data).astype(np.float32))) for p in make_params(xp)]
    opts = [factory(ps) for ps in (scaled, plain, half, half_ref)]
    c = 0.37 * 2.0 ** -10
    for gs in make_grads(SHAPES, 3):
        for a, b, h, r, g in zip(scaled, plain, half, half_ref, gs):
            a.grad = xp.asarray(g)
            b.grad = xp.asarray(g) * c
            h.grad = xp.asarray(g.astype(np.float16))
            r.grad = xp.asarray(g.astype(np.float16).astype(np.float32)) * np.float32(c)
        opts[0].step(grad_scale=c)
        opts[1].step()
        opts[2].step(grad_scale=c)
        opts[3].step()
        for a, g in zip(scaled, gs):
            np.testing.assert_array_equal(host(a.grad), g)
    for pair in ((scaled, plain), (half, half_ref)):
        for a, b in zip(*pair):
            np.testing.assert_array_equal(host(a.data), host(b.data))
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(RangeError, match="grad_scale: expected a finite number"):
            opts[0].step(grad_scale=bad)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("scale", [1e-4, 1.0, 1e4])
def test_adam_first_step_is_bounded_by_lr_at_any_grad_scale(xp, dtype, scale):
    """Stability / invariant: step 1 is -lr g / (|g| + eps), so |dp| <= lr whatever the grad scale."""
    p = Parameter(randn(xp, (5, 4), 0, dtype))
    p0 = host(p.data).astype(np.float64)
    g = host(randn(xp, (5, 4), 1)) * scale
    traj = run(xp, Adam([p], lr=0.1, eps=1e-8), [p], [[g]], dtype=dtype)
    delta = traj[0][0].astype(np.float64) - p0
    assert np.all(np.isfinite(delta)) and np.all(np.abs(delta) <= 0.1 * (1 + 1e-6))
    np.testing.assert_allclose(delta, -0.1 * g / (np.abs(g) + 1e-8), rtol=0,
                               atol=2e-7 if dtype == "float32" else 1e-15)


def test_bad_hyperparameters_and_params_raise(xp):
    ps = make_params(xp)
    cases = [(lambda: SGD(ps, lr=-0.1), ValueError, r"lr: expected a finite number >= 0, got -0.1"),
             (lambda: Adam(ps, lr=-1e-3), ValueError, "lr: expected a finite number >= 0"),
             (lambda: Adam(ps, betas=(1.0, 0.999)), ValueError, r"betas\[0\]: expected a finite number in \[0, 1\), got 1.0"),
             (lambda: Adam(ps, betas=(0.9, -0.1)), ValueError, r"betas\[1\]: expected a finite number in \[0, 1\)"),
             (lambda: AdamW(ps, betas=(0.9,)), TypeError, "betas: expected a pair"),
             (lambda: Adam(ps, eps=0.0), ValueError, r"eps: expected a finite number > 0, got 0.0"),
             (lambda: AdamW(ps, eps=-1e-8), ValueError, "eps: expected a finite number > 0"),
             (lambda: Adam(ps, lr="fast"), TypeError, "lr: expected a real number, got str"),
             (lambda: Adam(ps, lr=float("nan")), ValueError, "lr: expected a finite number"),
             (lambda: Adam(ps, lr=float("inf")), ValueError, "lr: expected a finite number"),
             (lambda: SGD([], lr=0.1), ValueError, "empty parameter list"),
             (lambda: Adam(iter([])), ValueError, "empty parameter list"),
             (lambda: Adam([{"params": []}]), ValueError, "param group 0: empty parameter list"),
             (lambda: Adam([ps[0], ps[0]]), ValueError, "appears more than once"),
             (lambda: Adam([{"params": ps[:2]}, {"params": ps[1:]}]), ValueError,
              "param group 1: a parameter appears more than once"),
             (lambda: Adam([ps[0], host(ps[1].data)]), TypeError, "expected Parameter or"),
             (lambda: Adam([Parameter(xp.zeros(3, dtype=xp.int64))]), TypeError, "floating-point"),
             (lambda: Adam([{"params": ps, "momentum": 0.9}]), ValueError, "param group 0: expected keys"),
             (lambda: SGD(ps, 0.1, nesterov=True), ValueError, "nesterov momentum requires momentum > 0"),
             (lambda: SGD(ps, 0.1, momentum=0.9, dampening=0.1, nesterov=True), ValueError,
              "dampening == 0"),
             (lambda: SGD(ps, 0.1, nesterov="yes"), TypeError, "nesterov must be a bool"),
             (lambda: SGD(ps, 0.1, momentum=-0.9), ValueError, "momentum: expected a finite number >= 0"),
             (lambda: SGD(ps, 0.1, dampening=1.5), ValueError, r"dampening: expected a finite number in \[0, 1\]"),
             (lambda: AdamW(ps, weight_decay=-0.01), ValueError, "weight_decay: expected a finite number >= 0"),
             (lambda: AdamW(ps, decay_filter="all"), ValueError, "decay_filter must be 'auto', 'matrices' or None")]
    for make, exc, match in cases:
        with pytest.raises(exc, match=match):
            make()
    opt = SGD([{"params": ps[:1], "lr": 0.1}, {"params": ps[1:]}], lr=0.2)
    with pytest.raises(ValueError, match=r"different lr \[0.1, 0.2\]"):
        opt.lr
    with pytest.raises(ValueError, match="lr: expected a finite number >= 0, got -1.0"):
        opt.lr = -1.0
    opt.param_groups[0]["lr"] = -5.0            # edited by hand: caught at the next step
    with pytest.raises(ValueError, match="lr: expected a finite number >= 0, got -5.0"):
        opt.step()


ADAM = dict(step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)
BAD_ADAM = [({"step": 0}, RangeError, "step: expected an int >= 1, got 0"),
            ({"step": -1}, RangeError, "step: expected an int >= 1, got -1"),
            ({"step": 1.5}, InputTypeError, "step: expected an int, got float 1.5"),
            ({"step": True}, InputTypeError, "step: expected an int, got bool"),
            ({"beta1": 1.0}, RangeError, r"beta1: expected a finite number in \[0, 1\), got 1.0"),
            ({"beta2": -0.5}, RangeError, r"beta2: expected a finite number in \[0, 1\), got -0.5"),
            ({"lr": math.nan}, RangeError, "lr: expected a finite number >= 0, got nan"),
            ({"lr": -1e-3}, RangeError, "lr: expected a finite number >= 0"),
            ({"eps": -1.0}, RangeError, "eps: expected a finite number > 0, got -1.0"),
            ({"eps": 0.0}, RangeError, "eps: expected a finite number > 0, got 0.0"),
            ({"eps": 1e-50}, RangeError, "eps: expected a number that stays > 0 in float32, .* float32 rounds to 0"),
            ({"weight_decay": math.inf}, RangeError, "weight_decay: expected a finite number >= 0, got inf"),
            ({"grad_scale": -1.0}, RangeError, "grad_scale: expected a finite number >= 0, got -1.0")]


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("bad, exc, match", BAD_ADAM)
def test_adam_update_checks_its_numbers_before_writing(xp, fast, bad, exc, match):
    """The op checks every number by the optimisers' rules, on every path, and raises npformer's
    errors before anything is written (step 0 divided by 1 - b1^0 = 0 after the reference had
    rewritten param and both moments); one good step after it is the usual one."""
    p, g = xp.ones(4, dtype=xp.float32), xp.full(4, 0.5, dtype=xp.float32)
    m, v = xp.zeros(4, dtype=xp.float32), xp.zeros(4, dtype=xp.float32)
    with contextlib.nullcontext() if fast else disabled():
        with pytest.raises(exc, match=match):
            adam_update(p, g, m, v, **{**ADAM, **bad})
        assert not host(m).any() and not host(v).any() and (host(p) == 1).all()
        adam_update(p, g, m, v, **{**ADAM, "step": 1})
    np.testing.assert_allclose(host(m), 0.05, rtol=1e-6)                 # (1 - b1) g
    np.testing.assert_allclose(host(v), 0.00025, rtol=1e-6)              # (1 - b2) g^2
    np.testing.assert_allclose(host(p), 1 - 1e-4 - 1e-3, rtol=1e-6)      # decay, then -lr g / |g|


SGD_STEP = dict(lr=0.1, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0, first=True)
BAD_SGD = [({"lr": math.nan}, "lr: expected a finite number >= 0, got nan"),
           ({"lr": -1.0}, "lr: expected a finite number >= 0, got -1.0"),
           ({"momentum": math.inf}, "momentum: expected a finite number >= 0, got inf"),
           ({"dampening": 2.0}, r"dampening: expected a finite number in \[0, 1\], got 2.0"),
           ({"weight_decay": -0.1}, "weight_decay: expected a finite number >= 0, got -0.1"),
           ({"grad_scale": math.nan}, "grad_scale: expected a finite number >= 0, got nan")]


@pytest.mark.parametrize("bad, match", BAD_SGD)
def test_sgd_update_checks_its_numbers_before_writing(xp, bad, match):
    """As adam_update: npformer's error before the parameter or the momentum buffer is written (a NaN
    lr made every parameter NaN); one good step after it is the usual one."""
    p, g, buf = xp.ones(4, dtype=xp.float32), xp.full(4, 0.5, dtype=xp.float32), xp.zeros(4, dtype=xp.float32)
    with pytest.raises(RangeError, match=match):
        sgd_update(p, g, buf, **{**SGD_STEP, **bad})
    assert not host(buf).any() and (host(p) == 1).all()
    sgd_update(p, g, buf, **SGD_STEP)
    np.testing.assert_allclose(host(buf), 0.5)                           # buf = d on the first step
    np.testing.assert_allclose(host(p), 0.95, rtol=1e-6)                 # p - lr buf


def test_adam_eps_must_stay_positive_in_the_parameters_dtype(xp):
    """eps = 1e-50 is > 0 but float32 rounds it to 0, and a zero gradient's update is then 0 / 0 =
    NaN: refused for float32 parameters when the optimiser is made, loaded or stepped after an edit,
    before anything is written; float64 parameters keep it and stay finite."""
    ps = make_params(xp, dtype="float32")
    with pytest.raises(RangeError, match="eps: expected a number that stays > 0 in float32, the dtype it is added "
                                         "in, got 1e-50, which float32 rounds to 0"):
        Adam(ps, eps=1e-50)
    with pytest.raises(RangeError, match="which float32 rounds to 0"):
        AdamW([{"params": ps[:1], "eps": 1e-8}, {"params": ps[1:], "eps": 1e-50}])
    opt = AdamW(ps, eps=1e-8)
    for p in ps:
        p.grad = xp.zeros(p.shape, dtype=xp.float32)
    before = [host(p.data).copy() for p in ps]
    opt.param_groups[0]["eps"] = 1e-50
    with pytest.raises(RangeError, match="which float32 rounds to 0"):
        opt.step()
    assert opt.state == {} and all(np.array_equal(host(p.data), b) for p, b in zip(ps, before))
    sd = {**AdamW(ps, eps=1e-8).state_dict(), "group.0.eps": 1e-50}
    with pytest.raises(ValueError, match="group 0: eps: .* which float32 rounds to 0"):
        AdamW(ps, eps=1e-8).load_state_dict(sd)
    p64 = Parameter(xp.ones((2, 3)))
    p64.grad = xp.zeros((2, 3))
    Adam([p64], lr=1e-3, eps=1e-50).step()
    np.testing.assert_array_equal(host(p64.data), 1.0)


def test_bad_grads_raise_before_any_update(xp):
    ps = make_params(xp)
    opt = Adam(ps)
    before = [host(p.data).copy() for p in ps]
    ps[0].grad, ps[2].grad = xp.ones((3, 4)), xp.zeros((3, 2, 1))
    with pytest.raises(ValueError, match=r"parameter 2: grad is .*\(3, 2, 1\) but data is .*\(2, 1, 3\)"):
        opt.step()
    assert opt.state == {} and all(np.array_equal(host(p.data), b) for p, b in zip(ps, before))
    with pytest.raises(TypeError, match="pass model.parameters"):
        Adam(Tiny(xp))
    named = Adam(Tiny(xp).named_parameters())
    named.param_groups[0]["params"][1].grad = xp.zeros(2, dtype=xp.float32)
    with pytest.raises(ValueError, match="parameter bias: grad is .*float32 .* data is .*float64"):
        named.step()


# -- clip_grad_norm --------------------------------------------------------------------------------
def with_grads(xp, shapes, seed, scale=1.0, dtype="float64"):
    ps = make_params(xp, shapes, seed, dtype, [True] * len(shapes))
    for k, p in enumerate(ps):
        p.grad = randn(xp, p.shape, seed + 50 + k, dtype, scale)
    return ps


@given(b=batch, t=seq, seed=seeds, scale=st.sampled_from([1e-3, 1.0, 30.0]),
       max_norm=st.sampled_from([0.5, 1.0, 5.0]))
def test_clip_grad_norm_reference(xp, b, t, seed, scale, max_norm):
    ps = with_grads(xp, [(b, t), (t,), (b, 2, t)], seed, scale)
    before = [host(p.grad).copy() for p in ps]
    arrays = [p.grad for p in ps]
    expected = np.linalg.norm(np.concatenate([g.ravel() for g in before]))
    total = clip_grad_norm(ps, max_norm)
    assert isinstance(total, float)
    np.testing.assert_allclose(total, expected, rtol=1e-13)
    after = [host(p.grad) for p in ps]
    assert all(p.grad is a for p, a in zip(ps, arrays))           # scaled in place
    if expected + 1e-6 > max_norm:
        coef = max_norm / (expected + 1e-6)
        for a, g in zip(after, before):
            np.testing.assert_allclose(a, g * coef, rtol=1e-13)
        new = np.linalg.norm(np.concatenate([a.ravel() for a in after]))
        np.testing.assert_allclose(new, max_norm * expected / (expected + 1e-6), rtol=1e-12)
    else:
        assert all(np.array_equal(a, g) for a, g in zip(after, before))


def test_clip_grad_norm_edge_cases(xp):
    ps = with_grads(xp, [(3, 4), (5,)], 0, dtype="float32")
    ps.append(Parameter(xp.ones(2, dtype=xp.float32)))              # grad None: skipped
    g0 = host(ps[0].grad).astype(np.float64)
    expected = np.linalg.norm(np.concatenate([g0.ravel(), host(ps[1].grad).ravel()]))
    total = clip_grad_norm([("w", ps[0]), ("b", ps[1]), ("c", ps[2]), ("w", ps[0])], 1.0)
    np.testing.assert_allclose(total, expected, rtol=1e-6)           # listed twice, counted once
    assert ps[0].grad.dtype == xp.float32 and ps[2].grad is None
    np.testing.assert_allclose(host(ps[0].grad), g0 / (expected + 1e-6), rtol=1e-6)
    assert clip_grad_norm([Parameter(xp.ones(3))], 1.0) == 0.0 and clip_grad_norm([], 1.0) == 0.0
    assert clip_grad_norm(ps, math.inf) == pytest.approx(1.0, rel=1e-5)   # only measures
    big = with_grads(xp, [(4,)], 1, scale=1e30, dtype="float32")     # float32 squares would overflow
    g = host(big[0].grad).astype(np.float64)
    np.testing.assert_allclose(clip_grad_norm(big, 1.0), np.sqrt((g * g).sum()), rtol=1e-12)
    np.testing.assert_allclose(host(big[0].grad), g / np.linalg.norm(g), rtol=1e-6)
    for bad in (math.inf, math.nan):
        ps = with_grads(xp, [(3,), (2,)], 2)
        ps[1].grad[0] = bad
        kept = [host(p.grad).copy() for p in ps]
        with pytest.raises(FloatingPointError, match=r"not finite .* parameters \['bias'\]"):
            clip_grad_norm([("weight", ps[0]), ("bias", ps[1])], 1.0)
        total = clip_grad_norm(ps, 1.0, error_if_nonfinite=False)
        assert not math.isfinite(total)
        assert all(np.array_equal(host(p.grad), k, equal_nan=True) for p, k in zip(ps, kept))
    with pytest.raises(ValueError, match=r"max_norm: expected inf \(no clipping\) or a number >= 0, got -1.0"):
        clip_grad_norm(ps, -1.0)
    with pytest.raises(TypeError, match="expected Parameter"):
        clip_grad_norm([ps[0].grad], 1.0)


@pytest.mark.parametrize("max_norm", [1.0, 0.0, math.inf])
def test_clip_grad_norm_with_eps_0(xp, max_norm):
    """eps = 0 is allowed: zero grads have norm 0 and nothing to clip, whatever max_norm (the
    coefficient was 0/0 or max_norm/0); nonzero grads are scaled by max_norm / norm exactly (0 for
    max_norm 0, untouched for inf)."""
    zero = Parameter(xp.ones((2, 3), xp.float32))
    zero.grad = xp.zeros((2, 3), xp.float32)
    assert clip_grad_norm([zero], max_norm, eps=0.0) == 0.0
    assert not host(zero.grad).any()
    ps = with_grads(xp, [(3, 4)], 0)
    g = host(ps[0].grad).copy()
    norm = float(np.linalg.norm(g))
    assert clip_grad_norm(ps, max_norm, eps=0.0) == pytest.approx(norm, rel=1e-13)
    np.testing.assert_allclose(host(ps[0].grad), g * min(1.0, max_norm / norm), rtol=1e-13)


# -- torch as an oracle ----------------------------------------------------------------------------
def torch_trajectory(torch, make_opt, p0s, grads, lrs):
    ts = [torch.tensor(p, dtype=torch.float64, requires_grad=True) for p in p0s]
    opt, out = make_opt(ts), []
    for gs, lr in zip(grads, lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        for t, g in zip(ts, gs):
            t.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        out.append([t.detach().numpy().copy() for t in ts])
    return out


TORCH_CASES = [("SGD", dict(momentum=0.9, dampening=0.2, weight_decay=0.01)),
               ("SGD", dict(momentum=0.9, nesterov=True, weight_decay=0.05)), ("SGD", {}),
               ("Adam", dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)), ("Adam", {}),
               ("AdamW", dict(weight_decay=0.2)), ("AdamW", dict(betas=(0.5, 0.9), weight_decay=0.0))]


@pytest.mark.torch
@pytest.mark.parametrize("name,kw", TORCH_CASES)
@pytest.mark.parametrize("decay_filter", ["auto", None])
def test_matches_torch_optim(xp, name, kw, decay_filter):
    torch = pytest.importorskip("torch", reason="torch not installed")
    grads, lrs = make_grads(SHAPES, 7), [0.03, 0.03, 0.01, 0.01, 0.05, 0.0, 0.02]
    params = make_params(xp)
    p0s = [host(p.data).copy() for p in params]
    ours = {"SGD": SGD, "Adam": Adam, "AdamW": AdamW}[name]
    extra = {"decay_filter": decay_filter} if name == "AdamW" else {}
    traj = run(xp, ours(params, lr=lrs[0], **kw, **extra), params, grads, lrs)

    def make(ts):       # torch decays every parameter: "auto" is torch with a wd=0 group for biases
        tcls = getattr(torch.optim, name)
        if name != "AdamW" or decay_filter is None:
            return tcls(ts, lr=lrs[0], **kw)
        wd = kw.get("weight_decay", 0.01)
        rest = {k: v for k, v in kw.items() if k != "weight_decay"}
        groups = [{"params": [t], "weight_decay": wd if d else 0.0} for t, d in zip(ts, DECAY)]
        return tcls(groups, lr=lrs[0], **rest)
    expected = torch_trajectory(torch, make, p0s, grads, lrs)
    for a, b in zip(traj, expected):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)


@pytest.mark.torch
def test_clip_grad_norm_matches_torch(xp):
    torch = pytest.importorskip("torch", reason="torch not installed")
    for max_norm, scale in [(1.0, 1.0), (100.0, 1.0), (0.1, 10.0)]:
        ps = with_grads(xp, SHAPES, 3, scale)
        ts = [torch.tensor(host(p.data), requires_grad=True) for p in ps]
        for t, p in zip(ts, ps):
            t.grad = torch.tensor(host(p.grad))
        expected = float(torch.nn.utils.clip_grad_norm_(ts, max_norm))
        np.testing.assert_allclose(clip_grad_norm(ps, max_norm), expected, rtol=1e-12)
        for t, p in zip(ts, ps):
            np.testing.assert_allclose(host(p.grad), t.grad.numpy(), rtol=1e-12, atol=1e-15)
