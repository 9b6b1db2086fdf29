"""noam / cosine-with-warm-up / constant schedules and LRScheduler: formulas, shape, state, errors."""
import io
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.nn.module import Parameter
from npformer.training import SGD, Adam, LRScheduler, constant_lr, cosine_with_warmup, noam_lr
from tests.helpers import host

steps = st.integers(0, 10_000)


def noam_reference(step, d_model, warmup, factor=1.0):
    """Written piecewise: linear rise s / warmup^1.5 up to warmup, then 1 / sqrt(s)."""
    s = max(step, 1)
    rise_or_fall = s / warmup ** 1.5 if s <= warmup else 1.0 / math.sqrt(s)
    return factor * rise_or_fall / math.sqrt(d_model)


def cosine_reference(step, base, warmup, total, floor=0.0):
    if step < warmup:
        return base * step / warmup
    if step > total:
        return floor
    angle = math.pi * (step - warmup) / (total - warmup)
    return floor + (base - floor) * (1.0 + np.cos(angle)) / 2.0


@pytest.mark.parametrize("step", [0, 1, 2, 399, 400, 401, 1000, 4000, 10 ** 6])
def test_noam_values(step):
    for d_model, factor in [(512, 1.0), (64, 2.0)]:
        got = noam_lr(step, d_model, 400, factor)
        assert isinstance(got, float)
        assert got == pytest.approx(noam_reference(step, d_model, 400, factor), rel=1e-13)
    assert noam_lr(0, 512, 400) == noam_lr(1, 512, 400)
    assert noam_lr(4000, 512, 4000) == pytest.approx(512 ** -0.5 * 4000 ** -0.5, rel=1e-14)


@given(d_model=st.integers(1, 2048), warmup=st.integers(1, 500), step=steps,
       factor=st.sampled_from([0.5, 1.0, 2.0]))
def test_noam_reference_property(d_model, warmup, step, factor):
    got = noam_lr(step, d_model, warmup, factor)
    assert got > 0 and got == pytest.approx(noam_reference(step, d_model, warmup, factor), rel=1e-12)


@given(d_model=st.integers(1, 1024), warmup=st.integers(1, 60))
def test_noam_peaks_at_warmup_and_is_monotonic_on_each_side(d_model, warmup):
    values = np.array([noam_lr(s, d_model, warmup) for s in range(1, 4 * warmup + 2)])
    assert int(np.argmax(values)) + 1 == warmup
    assert np.all(np.diff(values[:warmup]) > 0)              # rising up to step == warmup
    assert np.all(np.diff(values[warmup - 1:]) < 0)          # falling after it


def test_cosine_values_at_landmarks():
    base, floor, warmup, total = 3e-4, 1e-5, 100, 1100
    f = lambda s: cosine_with_warmup(s, base, warmup, total, floor)  # noqa: E731
    assert f(0) == 0.0 and isinstance(f(0), float)
    assert f(50) == pytest.approx(base / 2, rel=1e-14)
    assert f(warmup) == pytest.approx(base, rel=1e-14)
    assert f(600) == pytest.approx((base + floor) / 2, rel=1e-12)   # half-way down the cosine
    assert f(total) == pytest.approx(floor, rel=1e-12)
    assert f(total + 1) == f(10 ** 9) == floor                      # constant after the end
    for s in [1, 37, 99, 100, 101, 333, 1000, 1099, 1100, 5000]:
        assert f(s) == pytest.approx(cosine_reference(s, base, warmup, total, floor), rel=1e-12)
    assert cosine_with_warmup(0, 0.1, 0, 10) == 0.1                 # no warm-up: starts at base_lr
    assert cosine_with_warmup(2.5, 1.0, 5, 10) == 0.5               # fractional steps are allowed


@given(base=st.sampled_from([1e-4, 0.1, 1.0]), warmup=st.integers(0, 40),
       length=st.integers(1, 200), floor_frac=st.sampled_from([0.0, 0.1, 1.0]))
def test_cosine_pieces_are_monotonic_and_continuous(base, warmup, length, floor_frac):
    total, floor = warmup + length, base * floor_frac
    values = np.array([cosine_with_warmup(s, base, warmup, total, floor) for s in range(total + 5)])
    expected = [cosine_reference(s, base, warmup, total, floor) for s in range(total + 5)]
    np.testing.assert_allclose(values, expected, rtol=1e-12, atol=1e-18)
    assert np.all(np.diff(values[:warmup + 1]) > 0)                # warm-up: strictly rising
    assert np.all(np.diff(values[warmup:]) <= 1e-18)               # then never rising
    assert values[warmup] == pytest.approx(base) and np.all(values[total:] == floor)
    assert np.all(values[warmup:] >= floor - 1e-18) and np.all(values <= base * (1 + 1e-12))


def test_constant_lr():
    assert [constant_lr(s, 0.25) for s in (0, 1, 10 ** 7)] == [0.25] * 3


def sgd_on_ones(n_params=1):
    params = [Parameter(np.zeros(3)) for _ in range(n_params)]
    return params, SGD(params, lr=1.0)


def test_scheduler_sets_lr_for_each_step_and_sgd_uses_it(xp):
    """Step k runs with fn(k): with grad 1 and no momentum, p_n = -sum_{k<n} fn(k) exactly."""
    fn = lambda s: noam_lr(s, d_model=16, warmup=4)  # noqa: E731
    p = Parameter(xp.zeros(3))
    opt = SGD([{"params": [p]}, {"params": [Parameter(xp.zeros(2))], "lr": 5.0}], lr=1.0)
    sched = LRScheduler(opt, fn)
    assert sched.last_step == 0 and opt.lr == fn(0)           # every group gets the schedule's lr
    used, expected = [], 0.0
    for _ in range(10):
        p.grad = xp.ones(3)
        used.append(opt.lr)
        expected -= opt.lr
        opt.step()
        assert sched.step() == opt.lr == sched.last_lr
    assert used == [fn(k) for k in range(10)] and sched.last_step == 10
    np.testing.assert_allclose(host(p.data), expected, rtol=1e-15)


def test_scheduler_state_dict_resumes_identically(xp):
    fn = lambda s: cosine_with_warmup(s, 0.1, 3, 12, 0.01)  # noqa: E731
    params = [Parameter(xp.asarray(np.linspace(-1, 1, 4)))]
    opt = Adam(params, lr=0.1)
    sched = LRScheduler(opt, fn)
    for _ in range(5):
        params[0].grad = xp.asarray(np.array([0.3, -1.0, 2.0, 0.5]))
        opt.step()
        sched.step()
    saved_sd, saved_p = sched.state_dict(), host(params[0].data).copy()
    buf = io.BytesIO()
    np.savez(buf, **saved_sd, **{k: host(v) if hasattr(v, "shape") else v
                                 for k, v in opt.state_dict().items()})
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as f:
        loaded = {k: f[k] for k in f.files}
    lrs_a = [sched.step() for _ in range(8)]
    params_b = [Parameter(xp.asarray(saved_p))]
    opt_b = Adam(params_b, lr=0.5).load_state_dict({k: v for k, v in loaded.items()
                                                   if not k.startswith("last_")})
    sched_b = LRScheduler(opt_b, fn).load_state_dict({k: loaded[k] for k in saved_sd})
    assert sched_b.last_step == 5 and opt_b.lr == fn(5) == saved_sd["last_lr"]
    assert [sched_b.step() for _ in range(8)] == lrs_a


def test_bad_schedule_inputs_raise():
    cases = [(lambda: noam_lr(-1, 512, 10), ValueError, r"step: expected a finite number >= 0, got -1"),
             (lambda: noam_lr(float("nan"), 512, 10), ValueError, "step: expected a finite number >= 0"),
             (lambda: noam_lr(float("inf"), 512, 10), ValueError, "step: expected a finite number >= 0"),
             (lambda: noam_lr("3", 512, 10), TypeError, "step: expected a real number"),
             (lambda: noam_lr(1, 0, 10), ValueError, r"d_model: expected a finite number > 0"),
             (lambda: noam_lr(1, 512, 0), ValueError, r"warmup: expected a finite number > 0"),
             (lambda: noam_lr(1, 512, 10, factor=-1.0), ValueError, "factor: expected a finite number >= 0"),
             (lambda: cosine_with_warmup(1, -0.1, 0, 10), ValueError, "base_lr: expected a finite number >= 0"),
             (lambda: cosine_with_warmup(1, 0.1, 10, 10), ValueError,
              r"total_steps: expected a finite number > 10, got 10"),
             (lambda: cosine_with_warmup(1, 0.1, -1, 10), ValueError, "warmup: expected a finite number >= 0"),
             (lambda: cosine_with_warmup(1, 0.1, 2, 10, min_lr=0.2), ValueError,
              r"min_lr: expected a finite number in \[0, 0.1\], got 0.2"),
             (lambda: constant_lr(-2, 0.1), ValueError, "step: expected a finite number >= 0"),
             (lambda: constant_lr(0, -0.1), ValueError, "base_lr: expected a finite number >= 0")]
    for make, exc, match in cases:
        with pytest.raises(exc, match=match):
            make()


def test_bad_scheduler_inputs_raise():
    params, opt = sgd_on_ones()
    with pytest.raises(TypeError, match="fn must be a callable step -> lr, got float"):
        LRScheduler(opt, 0.1)
    with pytest.raises(TypeError, match="optimizer must be an npformer Optimizer, got list"):
        LRScheduler(params, lambda s: 0.1)
    with pytest.raises(ValueError, match=r"schedule fn\(0\) gave an invalid learning rate: lr: expected a finite number >= 0"):
        LRScheduler(opt, lambda s: -0.1)
    sched = LRScheduler(opt, lambda s: 0.1 if s < 2 else float("nan"))
    sched.step()
    with pytest.raises(ValueError, match=r"schedule fn\(2\) gave an invalid"):
        sched.step()
    assert sched.last_step == 1 and opt.lr == 0.1               # a failed step changes nothing
    with pytest.raises(TypeError, match=r"schedule fn\(0\) gave an invalid learning rate"):
        LRScheduler(opt, lambda s: "0.1")
    with pytest.raises(ValueError, match="needs key 'last_step'"):
        sched.load_state_dict({"last_lr": 0.1})
    with pytest.raises(ValueError, match="needs key 'last_step'"):
        sched.load_state_dict({"last_step": 3, "epoch": 1})
    with pytest.raises(ValueError, match="last_step must be a whole number, got 2.5"):
        sched.load_state_dict({"last_step": 2.5})
