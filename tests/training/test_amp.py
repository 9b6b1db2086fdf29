"""Mixed precision (npformer.training.amp) on the CPU with NumPy float16 and bfloat16 (ml_dtypes'): a
tiny GPT trained in 16 bits with float32 masters (float16 with loss scaling, bfloat16 without) tracks
float32 training from the same seed; the scaler skips a step and halves the scale on overflow, and
grows it after ``growth_interval`` finite steps; bfloat16's non-finite gradients raise; masters stay
float32 and tied weights stay tied; checkpoints of masters and scaler; bad input."""
import importlib
import importlib.util

import numpy as np
import pytest

from npformer.backend import backend_name
from npformer.errors import InputTypeError, NonFiniteError, RangeError
from npformer.models.gpt import GPT, GPTConfig
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.training.amp import DynamicLossScaler, MixedPrecision
from npformer.training.optim import AdamW, clip_grad_norm
from tests.helpers import host

V, T, B = 12, 16, 8
CONFIG = GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=2, d_model=32, dropout=0.1)
# Float16 keeps 11 significant bits (unit roundoff u = 2^-11 ~ 5e-4): each step's loss is a mean of
# float16-computed logits, and 30 Adam steps compound the rounding; on this model the float16 curve
# stays within 2e-4 of the float32 one. The tolerance, stated once, is 50 times that: 1e-2, 20 u.
# The gap scales with u, so bfloat16 (u = 2^-8) has 20 of its u, 8e-2 (measured: 9.5e-4).
ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
LOSS_TOL = {name: 1e-2 / ROUNDOFF["float16"] * u for name, u in ROUNDOFF.items()}
PRECISIONS = [pytest.param("float16", id="float16"),
              pytest.param("bfloat16", id="bfloat16", marks=pytest.mark.skipif(
                  importlib.util.find_spec("ml_dtypes") is None,
                  reason="bfloat16 needs ml_dtypes (pip install 'npformer[bfloat16]')"))]


def batch(xp, step):
    """Arithmetic sequences mod V with a random start and stride 1 or 2 (learnable in a few steps)."""
    r = np.random.default_rng((0, step))
    seq = (r.integers(0, V, (B, 1)) + r.integers(1, 3, (B, 1)) * np.arange(T + 1)) % V     # (B, T + 1)
    return xp.asarray(seq[:, :-1]), xp.asarray(seq[:, 1:])


def train(xp, precision, steps, scaler=None):
    """Losses of ``steps`` AdamW steps (clip 1.0) from seed 0; precision None is plain float32."""
    model = GPT(CONFIG, dtype=xp.float32, backend=backend_name(xp), rng=0)
    amp = MixedPrecision(model, precision, scaler) if precision else None
    opt = AdamW(amp.named_parameters() if amp else model.named_parameters(), lr=3e-3)
    losses = []
    for step in range(1, steps + 1):
        model.manual_seed((0, step))                     # the same dropout masks in both runs
        x, y = batch(xp, step)
        logits = model(x)                                                         # (B, T, V)
        loss, cache = cross_entropy_forward(logits.astype(xp.float32), y)        # the loss in float32
        if amp is None:
            model.backward(cross_entropy_backward(xp.ones((), xp.float32), cache))
            clip_grad_norm(model.parameters(), 1.0)
            opt.step()
            model.zero_grad()
        else:
            model.backward(cross_entropy_backward(amp.scaled_dloss(), cache).astype(amp.dtype))
            assert amp.step(opt, max_norm=1.0).stepped
        losses.append(float(loss))
    return np.array(losses), model, amp


@pytest.mark.parametrize("precision", PRECISIONS)
def test_16_bit_training_tracks_float32(xp, precision):
    """float16 with loss scaling, bfloat16 without (amp.scaler is None: S = 1)."""
    ref, _, _ = train(xp, None, 30)
    losses, model, amp = train(xp, precision, 30)
    assert np.abs(losses - ref).max() < LOSS_TOL[precision], np.c_[ref, losses]
    assert losses[-5:].mean() < losses[:5].mean() - 0.5          # it learns
    assert all(p.dtype == amp.dtype and p.dtype.name == precision for p in model.parameters())
    assert all(m.dtype == np.float32 for m in amp.parameters())
    assert (amp.scaler is None) == (precision == "bfloat16")
    assert model.head.weight is model.wte.weight and "head.weight" not in dict(amp.named_parameters())  # one master
    for name, m in amp.named_parameters():                          # the model holds the rounded masters
        np.testing.assert_array_equal(host(dict(model.named_parameters())[name].data).astype(np.float32),
                                      host(m.data).astype(amp.dtype).astype(np.float32))


@pytest.mark.parametrize("precision", PRECISIONS[1:])
def test_bfloat16_without_a_scaler_raises_on_non_finite_gradients(xp, precision):
    """No loss scale to lower: a NaN gradient is a diverged run (FloatingPointError, as float32's
    clip_grad_norm), and nothing is stepped."""
    model = GPT(CONFIG, dtype=xp.float32, backend=backend_name(xp), rng=0)
    amp = MixedPrecision(model, precision)
    opt = AdamW(amp.named_parameters(), lr=3e-3)
    assert float(amp.scaled_dloss()) == 1.0
    assert one_step(xp, amp, model, opt).stepped and one_step(xp, amp, model, opt, 2).scale == 1.0
    masters, _, state = snapshot(amp, model, opt)
    x, y = batch(xp, 3)
    _, cache = cross_entropy_forward(model(x).astype(xp.float32), y)
    model.backward(cross_entropy_backward(amp.scaled_dloss(), cache).astype(amp.dtype))
    model.wpe.weight.grad[0, 0] = np.nan
    with pytest.raises(NonFiniteError, match="bfloat16 gradients are not finite and there is no loss scale"):
        amp.step(opt)                                                # a FloatingPointError, npformer's
    assert all(np.array_equal(a, host(m.data)) for a, m in zip(masters, amp.parameters()))
    assert opt.state.keys() == state.keys() and all(p.grad is None for p in model.parameters())


def one_step(xp, amp, model, opt, step=1):
    x, y = batch(xp, step)
    loss, cache = cross_entropy_forward(model(x).astype(xp.float32), y)
    model.backward(cross_entropy_backward(amp.scaled_dloss(), cache).astype(amp.dtype))
    return amp.step(opt)


def snapshot(amp, model, opt):
    return ([host(m.data).copy() for m in amp.parameters()], [host(p.data).copy() for p in model.parameters()],
            dict(opt.state))


def test_overflow_skips_the_step_and_halves_the_scale(xp):
    model = GPT(CONFIG, dtype=xp.float32, backend=backend_name(xp), rng=0)
    amp = MixedPrecision(model, "float16", DynamicLossScaler(init_scale=2.0 ** 40, growth_interval=2))
    opt = AdamW(amp.named_parameters(), lr=3e-3)
    masters, weights, state = snapshot(amp, model, opt)
    # S = 2^40 makes dlogits ~ 2^40 / (B T) ~ 9e9, past float16's 65504: the gradients overflow.
    with np.errstate(over="ignore", invalid="ignore"):                # NumPy warns of the overflow it makes
        result = one_step(xp, amp, model, opt)
    assert not result.stepped and result.scale == 2.0 ** 40 and result.grad_norm is None
    assert amp.scaler.scale == 2.0 ** 39 and amp.scaler.skipped == 1 and amp.scaler.growth_tracker == 0
    after = snapshot(amp, model, opt)
    assert all(np.array_equal(a, b) for a, b in zip(masters + weights, after[0] + after[1]))
    assert state == after[2] == {}                                   # the optimiser never stepped
    assert all(p.grad is None for p in model.parameters()) and all(m.grad is None for m in amp.parameters())
    # A NaN planted in one gradient at a safe scale is caught too.
    amp.scaler.scale = 2.0 ** 8
    x, y = batch(xp, 2)
    loss, cache = cross_entropy_forward(model(x).astype(xp.float32), y)
    model.backward(cross_entropy_backward(amp.scaled_dloss(), cache).astype(amp.dtype))
    model.wpe.weight.grad[0, 0] = np.nan
    assert not amp.step(opt).stepped and amp.scaler.scale == 2.0 ** 7 and amp.scaler.skipped == 2
    assert opt.state == {}
    # Then finite steps: the masters change, and after growth_interval=2 of them the scale doubles.
    assert one_step(xp, amp, model, opt, 3).stepped and amp.scaler.scale == 2.0 ** 7
    assert one_step(xp, amp, model, opt, 4).stepped and amp.scaler.scale == 2.0 ** 8
    assert not np.array_equal(host(amp.parameters()[0].data), masters[0])
    assert all(m.dtype == np.float32 for m in amp.parameters())


def test_scaler_rules():
    s = DynamicLossScaler(init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    for found_inf, scale, tracker in [(False, 8, 1), (False, 8, 2), (True, 2, 0), (False, 2, 1), (False, 2, 2),
                                      (False, 8, 0), (False, 8, 1)]:
        s.update(found_inf)
        assert (s.scale, s.growth_tracker) == (scale, tracker)
    assert s.skipped == 1
    t = DynamicLossScaler()
    assert (t.scale, t.growth_factor, t.backoff_factor, t.growth_interval) == (65536.0, 2.0, 0.5, 2000)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == {"scale": 8.0, "growth_tracker": 1, "skipped": 1}


def test_a_loaded_tracker_past_the_interval_grows_at_the_next_finite_step():
    """A checkpoint of a longer growth_interval (tracker 10 of an interval of 3) grew never again: the
    tracker counted past the interval, which update compared with ==."""
    s = DynamicLossScaler(growth_interval=3)
    s.load_state_dict({"scale": 8.0, "growth_tracker": 10, "skipped": 0})
    s.update(False)
    assert (s.scale, s.growth_tracker) == (16.0, 0)
    for _ in range(3):
        s.update(False)
    assert (s.scale, s.growth_tracker) == (32.0, 0)


def test_the_scale_stops_growing_at_float32s_largest_power_of_two():
    """growth_factor=1e300 took S to inf in two steps, and a skip left it inf (inf / 2): every later step
    was skipped. Growth stops at 2^127; a scale already above it (init_scale 3e38) is not lowered by growth."""
    s = DynamicLossScaler(growth_factor=1e300, growth_interval=1)
    s.update(False)
    s.update(False)
    assert s.scale == 2.0 ** 127
    s.update(True)
    assert s.scale == 2.0 ** 126 and np.isfinite(np.float32(s.scale))
    t = DynamicLossScaler(init_scale=3e38, growth_interval=1)
    t.update(False)
    assert t.scale == 3e38 and np.isfinite(np.float32(t.scale))
    u = DynamicLossScaler(init_scale=2.0 ** 126, growth_interval=1)
    for _ in range(3):
        u.update(False)
    assert u.scale == 2.0 ** 127
    v = DynamicLossScaler(init_scale=1.0)               # non-finite at every scale: 0.0 after ~1,100 skips
    for _ in range(1200):
        v.update(True)
    assert v.scale == 2.0 ** -126 and v.skipped == 1200


def test_a_bad_scaler_state_is_refused_before_anything_is_loaded():
    good = {"scale": 8.0, "growth_tracker": 1, "skipped": 2}
    for state, exc, msg in [
            (None, TypeError, r"loss scaler state: expected a dict with keys .*got None"),
            ({**good, "extra": 1}, ValueError, r"loss scaler state: unexpected keys \['extra'\]"),
            ({**good, "growth_tracker": None}, TypeError,
             "loss scaler state: growth_tracker: expected an int, got None"),
            ({**good, "growth_tracker": "x"}, TypeError, "loss scaler state: growth_tracker: expected an int, got str"),
            ({**good, "growth_tracker": float("nan")}, TypeError, "growth_tracker: expected an int, got float nan"),
            ({**good, "growth_tracker": -1}, ValueError,
             "loss scaler state: growth_tracker: expected an int >= 0, got -1"),
            ({**good, "skipped": -2}, ValueError, "loss scaler state: skipped: expected an int >= 0, got -2"),
            ({**good, "scale": float("nan")}, ValueError, "loss scaler state: scale: expected a finite number float32"),
            ({**good, "scale": 0.0}, ValueError, "loss scaler state: scale: expected a finite number float32 holds"),
            ({**good, "scale": 1e39}, ValueError, "loss scaler state: scale: expected a finite number float32 holds"),
            ({**good, "scale": "8"}, TypeError, "loss scaler state: scale: expected a real number, got str")]:
        s = DynamicLossScaler()
        with pytest.raises(exc, match=msg) as info:
            s.load_state_dict(state)
        assert type(info.value).__module__ == "npformer.errors"
        assert s.state_dict() == {"scale": 65536.0, "growth_tracker": 0, "skipped": 0}   # nothing half-loaded
    s.load_state_dict({"scale": np.float32(4.0), "growth_tracker": np.int64(0), "skipped": 0})
    assert s.state_dict() == {"scale": 4.0, "growth_tracker": 0, "skipped": 0}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_master_checkpoint_round_trip(xp, precision):
    model = GPT(CONFIG, dtype=xp.float32, backend=backend_name(xp), rng=0)
    original = {k: host(v).copy() for k, v in model.state_dict().items()}
    amp = MixedPrecision(model, precision)
    sd = amp.master_state_dict()
    assert list(sd) == list(model.state_dict()) and "head.weight" in sd          # tied: under both names
    assert all(v.dtype == np.float32 and np.array_equal(host(v), original[k]) for k, v in sd.items())
    other = MixedPrecision(GPT(CONFIG, dtype=xp.float32, backend=backend_name(xp), rng=1), precision)
    other.load_master_state_dict({k: host(v) for k, v in sd.items()})            # host arrays, as from a file
    for (name, m), (_, n) in zip(amp.named_parameters(), other.named_parameters()):
        np.testing.assert_array_equal(host(m.data), host(n.data))
        assert n.dtype == np.float32
    for p, q in zip(model.parameters(), other.model.parameters()):
        np.testing.assert_array_equal(host(p.data), host(q.data))
        assert q.dtype.name == precision


def test_bad_input(xp):
    model = GPT(CONFIG, dtype=xp.float32, backend=backend_name(xp), rng=0)
    with pytest.raises(ValueError, match=r"dtype \(mixed precision\): expected one of 'float16', 'bfloat16', got 'float32'"):
        MixedPrecision(model, "float32")
    with pytest.raises(TypeError, match="model: expected an npformer Module"):
        MixedPrecision([1, 2], "float16")
    for kw, exc, msg in [({"init_scale": 0}, ValueError, r"init_scale: expected a finite number float32 holds "
                                                             r"\(a normal float32\) in \[1.17549e-38, "
                                                             r"3.40282e\+38\], got 0"),
                         ({"init_scale": float("inf")}, ValueError, "init_scale: expected a finite number float32"),
                         ({"init_scale": 1e300}, ValueError, "init_scale: expected a finite number float32 holds"),
                         ({"init_scale": -1.0}, ValueError, "init_scale: expected a finite number float32 holds"),
                         ({"init_scale": "big"}, TypeError, "init_scale: expected a real number, got str"),
                         ({"growth_factor": 1.0}, ValueError, "growth_factor: expected a finite number > 1"),
                         ({"backoff_factor": 1.0}, ValueError, r"backoff_factor: expected a finite number in \(0, 1\)"),
                         ({"growth_interval": 0}, ValueError, "growth_interval: expected an int >= 1, got 0"),
                         ({"growth_interval": 2.5}, TypeError, "growth_interval: expected an int, got float 2.5")]:
        with pytest.raises(exc, match=msg):
            DynamicLossScaler(**kw)
    with pytest.raises(ValueError, match=r"loss scaler state: missing keys \['skipped'\]"):
        DynamicLossScaler().load_state_dict({"scale": 2.0, "growth_tracker": 0})
    amp = MixedPrecision(model, "float16")
    with pytest.raises(RangeError, match="optimizer holds 1 parameters that are not this MixedPrecision's"):
        amp.step(AdamW([amp.parameters()[0], model.wpe.weight], eps=1e-4))   # an eps float16 (wpe's) holds
    for optimizer in (None, [amp.parameters()[0]]):      # an AttributeError (param_groups) before
        with pytest.raises(InputTypeError, match="optimizer: expected an npformer Optimizer built over "
                                                 r"amp.named_parameters\(\), got (None|list)"):
            amp.step(optimizer)
    for scaler in (2.0, "dynamic", {"scale": 8.0}):      # 2.0 failed at scaled_dloss (AttributeError)
        with pytest.raises(InputTypeError, match="scaler: expected a DynamicLossScaler or None"):
            MixedPrecision(GPT(CONFIG, dtype=xp.float32, backend=backend_name(xp), rng=0), "float16", scaler)


@pytest.mark.parametrize("precision", PRECISIONS[1:])
def test_bfloat16_is_ml_dtypes_dtype_on_either_backend(xp, precision):
    """Neither NumPy nor CuPy has a bfloat16 attribute; ml_dtypes' dtype serves both (CuPy's dtypes
    are NumPy's), by its name or its type."""
    from npformer.training.amp import low_precision_dtype
    ml_dtypes = importlib.import_module("ml_dtypes")
    assert not hasattr(xp, "bfloat16")
    for name in (precision, ml_dtypes.bfloat16, np.dtype(ml_dtypes.bfloat16)):
        got = low_precision_dtype(name, xp)
        assert got == np.dtype(ml_dtypes.bfloat16) and got.itemsize == 2 and got.kind == "V"
    assert low_precision_dtype("float16", xp) == np.float16


@pytest.mark.parametrize("precision", PRECISIONS[1:])
def test_a_loss_scaler_with_bfloat16_is_refused(xp, precision):
    model = GPT(CONFIG, dtype=xp.float32, backend=backend_name(xp), rng=0)
    with pytest.raises(ValueError, match="scaler: bfloat16 keeps float32's exponent range and trains without loss "
                                         r"scaling .*got DynamicLossScaler.*pass scaler=None, or use float16"):
        MixedPrecision(model, precision, DynamicLossScaler())
    assert all(p.dtype == np.float32 for p in model.parameters())       # refused before the model was rounded
