"""The optimiser kernels against the reference ops (npformer.ops.optim): Adam/AdamW's update bit for bit
(the same operations, no fused multiply-add), with the float16 or bfloat16 copy of mixed precision; the float64
sum of squares over one block, many, and beyond the grid (grid-stride); which arrays they take;
and a flat AdamW step of a whole model through the kernel."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.backend import resolve_dtype
from npformer.kernels import cuda, disabled, implementation
from npformer.kernels.cuda.optim import SQUARES_BLOCKS
from npformer.ops import optim
from tests.helpers import host, randn, seeds
from tests.kernels.cuda.conftest import BFLOAT16, DTYPES, assert_close

HALVES = [d for d in DTYPES if d in ("float16", "bfloat16")]     # mixed precision's model weights
ADAM_CASES = [dict(weight_decay=0.0, decoupled=False), dict(weight_decay=0.05, decoupled=False),
              dict(weight_decay=0.05, decoupled=True)]


def _adam_arrays(xp, n, seed, dtype):
    p, g, m, v = (randn(xp, (n,), seed + k, dtype) for k in range(4))
    return [p, g, m, v * v]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", ADAM_CASES, ids=["no-decay", "adam-l2", "adamw"])
@given(n=st.integers(1, 700), step=st.integers(1, 50), seed=seeds)
def test_adam_update_gives_the_reference_bits(fx, dtype, case, n, step, seed):
    xp = fx.xp
    kw = dict(step=step, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, **case)
    got = [a.copy() for a in _adam_arrays(xp, n, seed, dtype)]
    ref = [host(a).copy() for a in got]
    cuda.adam_update(*got, **kw)
    with disabled():
        optim.adam_update(*ref, **kw)
    for name, a, b in zip(("param", "grad", "exp_avg", "exp_avg_sq"), got, ref):
        np.testing.assert_array_equal(host(a), b, err_msg=name)


@pytest.mark.parametrize("half", HALVES)
@given(n=st.integers(1, 600), seed=seeds)
def test_the_16_bit_copy_is_written_in_the_same_pass(fx, half, n, seed):
    """Mixed precision: float32 masters updated, the model's float16 or bfloat16 weights = the new
    masters rounded (to nearest, ties to even), bit for bit with the reference."""
    xp = fx.xp
    half = resolve_dtype(np, half)
    kw = dict(step=3, lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)
    got = [a.copy() for a in _adam_arrays(xp, n, seed, "float32")]
    ref = [host(a).copy() for a in got]
    copy, copy_ref = xp.zeros(n, half), np.zeros(n, half)
    assert implementation(optim.adam_update, *got, param_copy=copy, **kw) == "cuda"
    cuda.adam_update(*got, param_copy=copy, **kw)
    with disabled():
        optim.adam_update(*ref, param_copy=copy_ref, **kw)
    np.testing.assert_array_equal(host(got[0]), ref[0])
    np.testing.assert_array_equal(host(copy).view(np.uint16), copy_ref.view(np.uint16))
    np.testing.assert_array_equal(host(copy).view(np.uint16), ref[0].astype(half).view(np.uint16))


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("case", ADAM_CASES, ids=["no-decay", "adam-l2", "adamw"])
@given(n=st.integers(1, 600), scale=st.sampled_from([1.0, 2.0 ** -16, 0.37 * 2.0 ** -10]), seed=seeds)
def test_the_masters_step_with_the_models_16_bit_gradients_and_their_scale(fx, half, case, n, scale, seed):
    """Mixed precision without a float32 copy of the gradients: the kernel reads the model's float16
    or bfloat16 gradient and multiplies it by ``grad_scale`` (1 / S times a clipping factor), bit for bit
    with the reference, which is the float32 gradient made first and scaled."""
    xp = fx.xp
    half = resolve_dtype(np, half)
    kw = dict(step=4, lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, **case)
    got = [a.copy() for a in _adam_arrays(xp, n, seed, "float32")]
    got[1] = (got[1] * 1000).astype(half)                      # the model's gradient, loss-scaled
    ref = [host(a).copy() for a in got]
    copy, copy_ref = xp.zeros(n, half), np.zeros(n, half)
    assert implementation(optim.adam_update, *got, param_copy=copy, grad_scale=scale, **kw) == "cuda"
    cuda.adam_update(*got, param_copy=copy, grad_scale=scale, **kw)
    with disabled():
        g32 = ref[1].astype(np.float32) * np.float32(scale)
        optim.adam_update(ref[0], g32, ref[2], ref[3], param_copy=copy_ref, **kw)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), (got[0], got[2], got[3]), (ref[0], ref[2], ref[3])):
        np.testing.assert_array_equal(host(a), b, err_msg=name)
    np.testing.assert_array_equal(host(copy).view(np.uint16), copy_ref.view(np.uint16))


def test_the_dispatcher_sends_only_what_the_kernel_takes(fx):
    xp = fx.xp
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    p, g, m, v = _adam_arrays(xp, 12, 0, "float32")
    assert implementation(optim.adam_update, p, g, m, v, **kw) == "cuda"
    assert implementation(optim.adam_update, p, g, m, v, param_copy=xp.zeros(12, xp.float16), **kw) == "cuda"
    half = [a.astype(xp.float16) for a in (p, g, m, v)]        # float16 parameters compute in float16
    assert implementation(optim.adam_update, *half, **kw) != "cuda"
    strided = [a.reshape(3, 4).T for a in (p, g, m, v)]         # not C-contiguous
    assert implementation(optim.adam_update, *strided, **kw) != "cuda"
    wide = [a.astype(xp.float64) for a in (p, g, m, v)]         # a float16 copy only of float32 masters
    assert implementation(optim.adam_update, *wide, param_copy=xp.zeros(12, xp.float16), **kw) != "cuda"
    g16 = g.astype(xp.float16)                                  # 16-bit gradients: those of the copy's dtype
    assert implementation(optim.adam_update, p, g16, m, v, param_copy=xp.zeros(12, xp.float16), **kw) == "cuda"
    assert implementation(optim.adam_update, p, g16, m, v, **kw) != "cuda"
    if BFLOAT16:
        assert implementation(optim.adam_update, p, g16, m, v, param_copy=xp.zeros(12, resolve_dtype(np, "bfloat16")),
                              **kw) != "cuda"
    with pytest.raises(ValueError, match="exp_avg_sq: expected shape"):
        cuda.adam_update(p, g, m, v[:5], **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 255, 257, 5000])
@pytest.mark.parametrize("blocks", [SQUARES_BLOCKS, 3])
def test_sum_of_squares_in_float64(fx, monkeypatch, dtype, n, blocks):
    """Block partials in double: within float64 rounding of the reference; 16-bit squares cannot overflow."""
    xp = fx.xp
    monkeypatch.setattr(cuda.optim, "SQUARES_BLOCKS", blocks)     # 3 blocks: 5000 > 3 * 256, grid-stride
    x = randn(xp, (n,), n, dtype, scale=300.0)
    got = cuda.sum_of_squares(x)
    with disabled():
        ref = optim.sum_of_squares(host(x))
    assert got.dtype == np.float64 and got.shape == ()
    assert_close(got, ref, "float64", scale=float(ref))
    assert float(cuda.sum_of_squares(x.copy())) == float(got)          # a fixed grid: a fixed order of additions


def test_a_flat_adamw_step_of_a_model_runs_the_kernel_once_per_run(fx, monkeypatch):
    """A flattened GPT's AdamW step: two kernel launches (decayed weights, the rest), the same
    parameters as the per-parameter reference loop."""
    from npformer.models.gpt import GPT, GPTConfig
    from npformer.nn.flat import flatten_parameters
    from npformer.training.optim import AdamW, clip_grad_norm
    xp = fx.xp
    backend = "numpy" if fx.name == "emulated" else "cupy"
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=8, dropout=0.0)
    models = [GPT(cfg, dtype="float32", backend=backend, rng=0) for _ in range(2)]
    flatten_parameters(models[1])
    opts = [AdamW(m.named_parameters(), lr=1e-2, weight_decay=0.1) for m in models]
    launches = []
    monkeypatch.setattr(cuda.optim, "launch_elements",
                        lambda *a, _f=cuda.optim.launch_elements: (launches.append(a[0]), _f(*a))[1])
    rng = np.random.default_rng(0)
    for _ in range(3):
        grads = [rng.standard_normal(p.shape).astype(np.float32) for p in models[0].parameters()]
        for k, (model, opt) in enumerate(zip(models, opts)):
            model.zero_grad()
            for p, g in zip(model.parameters(), grads):
                p.accumulate(xp.asarray(g))
            if k == 0:
                with disabled():
                    clip_grad_norm(model.parameters(), 1.0)
                    opt.step()
            else:
                clip_grad_norm(model.parameters(), 1.0)
                opt.step()
    assert launches == ["adam_update"] * 2 * 3
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert_close(b.data, a.data, "float32")
