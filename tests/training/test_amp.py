"""Mixed precision (npformer.training.amp) on the CPU with NumPy float16: a tiny GPT trained in float16
with float32 masters and loss scaling tracks float32 training from the same seed; the scaler skips a
step and halves the scale on overflow, and grows it after ``growth_interval`` finite steps; masters
stay float32 and tied weights stay tied; checkpoints of masters and scaler; bad input."""
import numpy as np
import pytest

from npformer.backend import backend_name
from npformer.models.gpt import GPT, GPTConfig
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.training.amp import DynamicLossScaler, MixedPrecision
from npformer.training.optim import AdamW, clip_grad_norm
from tests.helpers import host

V, T, B = 12, 16, 8
CONFIG = GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=2, d_model=32, dropout=0.1)
# Float16 keeps 11 significant bits (relative spacing 2^-11 ~ 5e-4): each step's loss is a mean of
# float16-computed logits, and 30 Adam steps compound the rounding; on this model the float16 curve
# stays within 2e-4 of the float32 one. The tolerance, stated once, is 50 times that.
LOSS_TOL = 1e-2


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


def test_float16_with_loss_scaling_tracks_float32(xp):
    ref, _, _ = train(xp, None, 30)
    losses, model, amp = train(xp, "float16", 30)
    assert np.abs(losses - ref).max() < LOSS_TOL, np.c_[ref, losses]
    assert losses[-5:].mean() < losses[:5].mean() - 0.5          # it learns
    assert all(p.dtype == np.float16 for p in model.parameters())
    assert all(m.dtype == np.float32 for m in amp.parameters())
    assert model.head.weight is model.wte.weight and "head.weight" not in dict(amp.named_parameters())  # one master
    for name, m in amp.named_parameters():                          # the model holds the rounded masters
        np.testing.assert_array_equal(host(dict(model.named_parameters())[name].data),
                                      host(m.data).astype(np.float16))


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


def test_master_checkpoint_round_trip(xp):
    model = GPT(CONFIG, dtype=xp.float32, backend=backend_name(xp), rng=0)
    original = {k: host(v).copy() for k, v in model.state_dict().items()}
    amp = MixedPrecision(model, "float16")
    sd = amp.master_state_dict()
    assert list(sd) == list(model.state_dict()) and "head.weight" in sd          # tied: under both names
    assert all(v.dtype == np.float32 and np.array_equal(host(v), original[k]) for k, v in sd.items())
    other = MixedPrecision(GPT(CONFIG, dtype=xp.float32, backend=backend_name(xp), rng=1), "float16")
    other.load_master_state_dict({k: host(v) for k, v in sd.items()})            # host arrays, as from a file
    for (name, m), (_, n) in zip(amp.named_parameters(), other.named_parameters()):
        np.testing.assert_array_equal(host(m.data), host(n.data))
        assert n.dtype == np.float32
    for p, q in zip(model.parameters(), other.model.parameters()):
        np.testing.assert_array_equal(host(p.data), host(q.data))
        assert q.dtype == np.float16


def test_bad_input(xp):
    model = GPT(CONFIG, dtype=xp.float32, backend=backend_name(xp), rng=0)
    with pytest.raises(TypeError, match="dtype bfloat16: backend numpy has no bfloat16 dtype") if xp is np \
            else pytest.raises(TypeError, match="dtype bfloat16: backend cupy has no bfloat16 dtype"):
        MixedPrecision(model, "bfloat16")
    with pytest.raises(ValueError, match=r"dtype \(mixed precision\): expected one of 'float16', 'bfloat16', got 'float32'"):
        MixedPrecision(model, "float32")
    with pytest.raises(TypeError, match="model: expected an npformer Module"):
        MixedPrecision([1, 2], "float16")
    for kw, exc, msg in [({"init_scale": 0}, ValueError, "init_scale: expected a finite number > 0, got 0"),
                         ({"init_scale": float("inf")}, ValueError, "init_scale: expected a finite number > 0"),
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
    with pytest.raises(ValueError, match="optimizer holds 1 parameters that are not this MixedPrecision's"):
        amp.step(AdamW([amp.parameters()[0], model.wpe.weight]))


def test_bfloat16_that_only_resolves_as_a_name_is_refused(monkeypatch):
    """The GPU run found bfloat16 accepted on CuPy 14, which has no cupy.bfloat16: with ml_dtypes
    installed, numpy.dtype("bfloat16") (which cupy.dtype is) resolves. Simulated here: a backend whose
    dtype() knows the name but whose module has no bfloat16 attribute is refused all the same."""
    from npformer.training.amp import low_precision_dtype
    import types
    fake = types.SimpleNamespace(__name__="cupy", float16=np.float16, dtype=lambda name: np.dtype("float16"))
    with pytest.raises(TypeError, match="dtype bfloat16: backend cupy has no bfloat16 dtype"):
        low_precision_dtype("bfloat16", fake)
    assert low_precision_dtype("float16", fake) == np.float16
    with_bf16 = types.SimpleNamespace(__name__="somebackend", bfloat16=np.float32, dtype=np.dtype)
    assert low_precision_dtype("bfloat16", with_bf16) == np.float32      # a backend that has one is used
