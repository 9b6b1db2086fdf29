"""The CUDA flash attention kernels against the reference (npformer.ops.flash_attention): outputs, lse
and gradients over shapes (ragged T, Tq != Tk, head sizes 1..128), every mask kind, both causal
alignments, fully masked rows and dropout, in float64/32/16 and bfloat16 (also against the float32
reference: compare); the dropout keep rule position by
position; float64 gradient checks through the kernels; either backward on either forward's cache;
dispatch, fall-back and bad input; shared memory and entry points; "auto" attention on device arrays.

Each runs emulated here (tests/kernels/cuda/emulator.py) and on a GPU where one is present (``fx``).

Tolerances: ``TOL[dtype]`` (tests/helpers.py) times the largest magnitude in play: for each result,
the same sum taken over absolute values in float64 (``|P_drop| |v|`` for out, ``|P| (|dP| + |D|)``
through |k|, |q| for dq, dk, ``|P_drop|^T |dO|`` for dv), at least 1.
"""
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from npformer.backend import backend_name, default_rng
from npformer.errors import RangeError
from npformer.kernels import cuda, disabled, implementation
from npformer.kernels.cuda import flash_attention as kernel, flash_source
from npformer.ops import multihead as multihead_op
from npformer.nn.attention import MultiheadAttention
from npformer.ops.attention import scaled_dot_product_attention_forward as sdpa_forward
from npformer.ops.dropout import keep_threshold, seed_draws, seed_of
from npformer.ops.flash_attention import (FlashAttentionCache, _keep, flash_attention_backward as flash_backward,
                                          flash_attention_forward as flash_forward)
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, assert_same_bits, assert_scores_beyond_float16, host, randn, seeds
from tests.kernels.cuda import emulator, sources
from tests.kernels.cuda.conftest import DTYPES, assert_close
from tests.ops.test_flash_attention import CAUSAL, causal_kw, draw_masks
from tests.ops.test_flash_attention import test_bad_input as reference_bad_input_cases

LENGTHS = st.integers(1, 80)          # one tile or several (32 rows for float64, 64 for float32/16), ragged


# The reference tests' mask kinds, and float key-padding masks alone and with a float attention mask.
MASKS = st.sampled_from(["none", "padding", "float_padding", "bool2d", "bool3d", "bool4d", "float2d", "float4d",
                         "padding+bool2d", "float_padding+float4d"])


def masks(data, xp, kind, b, h, tq, tk, seed):
    """draw_masks of the reference tests, plus a float (B, Tk) key-padding mask (finite values and -inf)."""
    if not kind.startswith("float_padding"):
        return draw_masks(data, xp, kind, b, h, tq, tk, seed)
    kw = draw_masks(data, xp, kind.split("+")[1], b, h, tq, tk, seed) if "+" in kind else {}
    pad = host(randn(xp, (b, tk), seed + 6, scale=2.0))
    pad[np.random.default_rng(seed).random((b, tk)) < 0.3] = -np.inf
    return {**kw, "key_padding_mask": xp.asarray(pad)}


def qkv(xp, b, h, tq, tk, hs, hv, seed, dtype):
    return (randn(xp, (b, h, tq, hs), seed, dtype), randn(xp, (b, h, tk, hs), seed + 1, dtype),
            randn(xp, (b, h, tk, hv), seed + 2, dtype))


def magnitudes(q, k, v, dout, out, kw, p=0.0):
    """The largest magnitude in play for out, dq, dk, dv (module docstring), from float64 host copies."""
    f64 = {name: host(a).astype(np.float64) for name, a in (("q", q), ("k", k), ("v", v), ("dout", dout),
                                                             ("out", out))}
    masks = {key: (host(val) if hasattr(val, "shape") else val) for key, val in kw.items()
             if key in ("attn_mask", "key_padding_mask", "is_causal", "causal_alignment", "scale")}
    with disabled():
        _, probs, _ = sdpa_forward(f64["q"], f64["k"], f64["v"], need_weights=True, **masks)   # (B, H, Tq, Tk)
    scale = 1.0 / np.sqrt(q.shape[-1]) if masks.get("scale") is None else abs(masks["scale"])
    drop = 1.0 / (1.0 - p)
    dv_abs, do_abs, out_abs = np.abs(f64["v"]), np.abs(f64["dout"]), np.abs(f64["out"])
    dp = do_abs @ dv_abs.swapaxes(-1, -2) * drop                                                  # |dP|
    ds = probs * (dp + (do_abs * out_abs).sum(-1, keepdims=True)) * scale                         # |dS|
    bounds = {"out": (probs * drop) @ dv_abs, "dq": ds @ np.abs(f64["k"]),
              "dk": ds.swapaxes(-1, -2) @ np.abs(f64["q"]), "dv": (probs * drop).swapaxes(-1, -2) @ do_abs}
    return {name: max(1.0, float(b.max(initial=0.0))) for name, b in bounds.items()}


def compare(fx, q, k, v, dout, kw, dtype, p=0.0, rng_seed=None):
    """The kernel (through the dispatcher) against the reference: out, lse, dq, dk, dv; both backwards
    on both caches. Dropout: both draw their seed from a generator seeded ``rng_seed``."""
    name = backend_name(fx.xp)
    drop = {} if not p else {"dropout_p": p}
    assert implementation(flash_forward, q, k, v, **kw) == "cuda"
    out, cache = flash_forward(q, k, v, **kw, **drop, **({"rng": default_rng(rng_seed, name)} if p else {}))
    with disabled():
        ref, ref_cache = flash_forward(q, k, v, **kw, **drop, **({"rng": default_rng(rng_seed, name)} if p else {}))
    scales = magnitudes(q, k, v, dout, ref, kw, p)
    assert isinstance(cache, FlashAttentionCache) and cache.lse.dtype == ref_cache.lse.dtype
    assert_close(out, ref, dtype, scale=scales["out"], what="out")
    assert_close(cache.lse, ref_cache.lse, str(cache.lse.dtype), what="lse")
    if p:
        np.testing.assert_array_equal(host(cache.seed_draws), host(ref_cache.seed_draws))
    assert implementation(flash_backward, dout, cache) == "cuda"
    grads = flash_backward(dout, cache)
    with disabled():
        ref_grads = flash_backward(dout, ref_cache)
        plain_on_kernel_cache = flash_backward(dout, cache)
    kernel_on_plain_cache = flash_backward(dout, ref_cache)
    for what, g, r, other, other2 in zip(("dq", "dk", "dv"), grads, ref_grads, plain_on_kernel_cache,
                                         kernel_on_plain_cache):
        assert_close(g, r, dtype, scale=scales[what], what=what)
        assert_close(other, r, dtype, scale=scales[what], what=f"reference {what} on the kernel's cache")
        assert_close(other2, r, dtype, scale=scales[what], what=f"kernel {what} on the reference's cache")
    if dtype == "bfloat16":
        against_float32(q, k, v, dout, kw, out, grads, scales, p, rng_seed)
    return out, cache, grads


def against_float32(q, k, v, dout, kw, out, grads, scales, p, rng_seed):
    """bfloat16 results against the float32 reference on the same (exactly widened) inputs, rounded once
    to bfloat16: the kernels compute in float32 and round P and dS to bfloat16 as tensor-core operands,
    within TOL["bfloat16"] (4 ulp) of the magnitudes in play with the reference's half ulp."""
    name, f32 = backend_name(q), [a.astype("float32") for a in (q, k, v, dout)]
    drop = {} if not p else {"dropout_p": p, "rng": default_rng(rng_seed, name)}
    with disabled():
        ref, ref_cache = flash_forward(*f32[:3], **kw, **drop)
        ref_grads = flash_backward(f32[3], ref_cache)
    for what, got, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert_close(got, r.astype(got.dtype), "bfloat16", scale=scales[what], what=f"{what} against float32")


@given(b=st.integers(1, 2), h=st.integers(1, 2), tq=LENGTHS, tk=LENGTHS, hs=st.integers(1, 40),
       hv=st.integers(1, 40), dtype=st.sampled_from(DTYPES), causal=CAUSAL, kind=MASKS,
       p=st.sampled_from([0.0, 0.0, 0.3]), scale=st.sampled_from([None, 0.3, -0.3, 0.0]), seed=seeds, data=st.data())
def test_matches_the_reference(fx, b, h, tq, tk, hs, hv, dtype, causal, kind, p, scale, seed, data):
    q, k, v = qkv(fx.xp, b, h, tq, tk, hs, hv, seed, dtype)
    kw = {**masks(data, fx.xp, kind, b, h, tq, tk, seed), **causal_kw(causal), "scale": scale}
    compare(fx, q, k, v, randn(fx.xp, (b, h, tq, hv), seed + 3, dtype), kw, dtype, p, rng_seed=seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hs, hv, tq, tk", [(128, 128, 70, 45), (65, 7, 33, 97), (33, 64, 64, 64), (1, 1, 130, 3)])
def test_head_size_buckets_and_long_ragged_tiles(fx, dtype, hs, hv, tq, tk):
    q, k, v = qkv(fx.xp, 2, 1, tq, tk, hs, hv, 0, dtype)
    pad = fx.xp.asarray(np.arange(tk)[None, :] >= np.array([[tk], [max(1, tk - 5)]]))
    for kw in ({}, {"key_padding_mask": pad, "is_causal": True, "causal_alignment": "bottom_right"}):
        compare(fx, q, k, v, randn(fx.xp, (2, 1, tq, hv), 3, dtype), kw, dtype)


@settings(max_examples=6)
@given(b=st.integers(1, 2), h=st.integers(1, 2), tq=st.integers(1, 5), tk=st.integers(1, 5), hs=st.integers(1, 3),
       causal=CAUSAL, kind=MASKS, p=st.sampled_from([0.0, 0.4]), seed=seeds, data=st.data())
def test_gradcheck_float64_through_the_kernels(fx, b, h, tq, tk, hs, causal, kind, p, seed, data):
    q, k, v = qkv(fx.xp, b, h, tq, tk, hs, 2, seed, "float64")
    kw = {**masks(data, fx.xp, kind, b, h, tq, tk, seed), **causal_kw(causal)}
    name = backend_name(fx.xp)

    def forward(q, k, v):   # a fresh generator per call: every evaluation draws the same seed, so the same masks
        return cuda.flash_attention_forward(q, k, v, dropout_p=p, rng=default_rng(seed, name) if p else None, **kw)
    report = gradcheck(forward, cuda.flash_attention_backward, {"q": q, "k": k, "v": v}, seed=seed,
                       max_elements=10)
    assert_gradcheck(report)


def _test_module():
    """The module of the test kernels (sources.FLASH_TEST_SOURCE; emulated: the flash library)."""
    from npformer.kernels.cuda import runtime
    return runtime.compile_module(sources.FLASH_TEST_SOURCE, flash_source.FLASH_NVRTC_OPTIONS,
                                  sources.FLASH_TEST_KERNELS)


# -- dropout: the reference's keep rule, element by element ------------------------------------------
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_mask_equals_the_references_position_by_position(fx, p):
    xp = fx.xp
    shape = (2, 3, 37, 41)
    draws = seed_draws(default_rng(11, backend_name(xp)), xp.zeros(1), xp)     # the kernel makes the seed
    keep = xp.zeros(int(np.prod(shape)), dtype=bool)
    flash_module = _test_module()
    flash_module.get_function("npf_fa_keep_mask")((64,), (128,), (draws, np.int32(keep_threshold(p)), keep,
                                                                  np.int64(keep.size)))
    oracle = _keep(seed_of(draws, xp), p, shape, 0, shape[2], 0, shape[3], np.float64, xp)   # (B, H, Tq, Tk)
    np.testing.assert_array_equal(host(keep).reshape(shape), host(oracle) > 0)
    assert 0 < host(keep).mean() < 1


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_dropout_drops_the_same_entries_as_the_reference(fx, dtype):
    # v = I (Tk x Tk): out is P_drop itself, so its zeros are the dropped entries (P > 0 elsewhere).
    xp, name = fx.xp, backend_name(fx.xp)
    b, h, tq, tk, p = 2, 2, 45, 70, 0.4
    q, k, _ = qkv(xp, b, h, tq, tk, 8, 1, 0, dtype)
    eye = xp.asarray(np.broadcast_to(np.eye(tk, dtype=dtype), (b, h, tk, tk)).copy())
    out, cache = flash_forward(q, k, eye, dropout_p=p, rng=default_rng(5, name), is_causal=True,
                               causal_alignment="bottom_right")
    with disabled():
        ref, _ = flash_forward(q, k, eye, dropout_p=p, rng=default_rng(5, name), is_causal=True,
                               causal_alignment="bottom_right")
    visible = ~host(xp.asarray(np.arange(tk)[None, :] > np.arange(tq)[:, None] + (tk - tq)))   # (Tq, Tk)
    dropped, ref_dropped = host(out) == 0, host(ref) == 0
    np.testing.assert_array_equal(dropped, ref_dropped)
    oracle = host(_keep(seed_of(cache.seed_draws, xp), p, (b, h, tq, tk), 0, tq, 0, tk, np.float64, xp)) == 0
    np.testing.assert_array_equal(dropped, oracle | ~visible)
    assert 0.3 < dropped[..., visible].mean() < 0.5
    assert_close(out, ref, dtype, scale=1.0 / (1.0 - p))


def test_dropout_p_one_and_eval_mode(fx):
    xp, name = fx.xp, backend_name(fx.xp)
    q, k, v = qkv(xp, 2, 2, 5, 6, 4, 3, 0, "float64")
    out, cache = flash_forward(q, k, v, dropout_p=1.0, rng=default_rng(0, name))
    assert not host(out).any() and not any(host(g).any() for g in flash_backward(randn(xp, out.shape, 3), cache))
    evald, _ = flash_forward(q, k, v, dropout_p=0.5, training=False)
    with disabled():
        assert_close(evald, flash_forward(q, k, v)[0], "float64")
    with pytest.raises(ValueError, match="dropout with p > 0 in training mode needs rng"):
        flash_forward(q, k, v, dropout_p=0.5)


# -- masks as bits, padding as lengths -----------------------------------------------------------------
@pytest.mark.parametrize("shape", [(3, 1), (2, 31), (2, 32), (4, 33), (2, 3, 5, 70), (0, 7), (3, 0)])
def test_bool_masks_are_packed_32_keys_a_word(fx, shape):
    xp = fx.xp
    mask = np.random.default_rng(sum(shape)).random(shape) < 0.4
    words = host(kernel.pack_bits(xp, xp.asarray(mask)))
    assert words.dtype == np.uint32 and words.shape == shape[:-1] + (-(-shape[-1] // 32),)
    bit = (words[..., np.arange(shape[-1]) // 32] >> (np.arange(shape[-1]) % 32).astype(np.uint32)) & 1
    np.testing.assert_array_equal(bit.astype(bool), mask)                 # key j: bit j % 32 of word j // 32
    if shape[-1] % 32:                                                    # the ragged word's other bits: 0
        assert not (words[..., -1] >> np.uint32(shape[-1] % 32)).any()


def test_key_end_is_one_past_the_last_visible_key(fx):
    xp = fx.xp
    pad = np.ones((5, 70), bool)
    pad[1, :1] = pad[2, :33] = pad[3, ::3] = False                       # 1 key; 33 keys; holes to the end
    pad[4, [5, 40]] = False                                               # visible keys 5 and 40 only
    assert host(kernel.key_end(xp, xp.asarray(pad))).tolist() == [0, 1, 33, 70, 41]
    assert host(kernel.key_end(xp, xp.zeros((2, 0), bool))).tolist() == [0, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_key_tiles_past_the_padding_are_skipped_whole(fx, dtype):
    """Bool key padding: the kernels stop at each batch's key end (kernel.key_end), rounded up to a
    tile. Keys in the skipped tiles are set to NaN: had a kernel read them, NaN would reach out and dq
    (a masked score is NaN + -inf = NaN); the results equal those of finite keys (which match the
    reference), and those keys' dk, dv are zero."""
    xp = fx.xp
    b, h, tq, tk, hs = 5, 2, 40, 200, 16
    ends = [0, 1, 33, 64, 130]
    pad = np.arange(tk)[None, :] >= np.array(ends)[:, None]
    pad[4, 100:130:3] = True                                              # holes before the end
    q, k, v = qkv(xp, b, h, tq, tk, hs, hs, 0, dtype)
    dout = randn(xp, (b, h, tq, hs), 3, dtype)
    for causal in ({}, {"is_causal": True, "causal_alignment": "bottom_right"}):
        kw = {"key_padding_mask": xp.asarray(pad), **causal}
        out, _, grads = compare(fx, q, k, v, dout, kw, dtype)
        poisoned_k, poisoned_v = host(k).copy(), host(v).copy()
        for i, end in enumerate(ends):
            skipped = -(-end // 64) * 64                                  # every tile size divides 64
            poisoned_k[i, :, skipped:] = poisoned_v[i, :, skipped:] = np.nan
        out2, cache2 = flash_forward(q, xp.asarray(poisoned_k), xp.asarray(poisoned_v), **kw)
        dq2, dk2, dv2 = flash_backward(dout, cache2)
        np.testing.assert_array_equal(host(out2), host(out))
        np.testing.assert_array_equal(host(dq2), host(grads[0]))
        for i, end in enumerate(ends):
            for g2, g in ((dk2, grads[1]), (dv2, grads[2])):
                assert not host(g2)[i, :, end:].any()
                np.testing.assert_array_equal(host(g2)[i, :, :end], host(g)[i, :, :end])


# -- edge cases ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_zero_output_inf_lse_zero_gradients(fx, dtype):
    xp = fx.xp
    q, k, v = qkv(xp, 2, 2, 70, 40, 4, 4, 0, dtype)
    mask = np.zeros((70, 40), bool)
    mask[[1, 66]] = True                                 # queries 1 and 66 may attend nothing
    pad = np.zeros((2, 40), bool)
    pad[1] = True                                        # and batch 1 has only padding
    kw = {"attn_mask": xp.asarray(mask), "key_padding_mask": xp.asarray(pad)}
    dout = randn(xp, (2, 2, 70, 4), 3, dtype)
    out, cache, (dq, dk, dv) = compare(fx, q, k, v, dout, kw, dtype)
    assert all(np.isfinite(host(a)).all() for a in (out, dq, dk, dv))
    assert np.isinf(host(cache.lse)[:, :, [1, 66]]).all() and np.isinf(host(cache.lse)[1]).all()
    assert not host(out)[:, :, [1, 66]].any() and not host(out)[1].any()
    assert not host(dq)[:, :, [1, 66]].any() and not any(host(g)[1].any() for g in (dq, dk, dv))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_before_the_first_key_bottom_right(fx, dtype):
    # Tq > Tk aligned bottom-right: the first Tq - Tk queries see nothing, whole query tiles see nothing.
    q, k, v = qkv(fx.xp, 1, 2, 100, 3, 4, 2, 0, dtype)
    kw = {"is_causal": True, "causal_alignment": "bottom_right"}
    out, cache, _ = compare(fx, q, k, v, randn(fx.xp, (1, 2, 100, 2), 1, dtype), kw, dtype)
    assert not host(out)[:, :, :97].any() and np.isinf(host(cache.lse)[:, :, :97]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_scores_of_1e4_stay_finite_and_pick_the_largest(fx, dtype):
    xp = fx.xp
    q = xp.asarray(np.full((1, 1, 2, 4), 50.0, dtype))
    k = xp.asarray(np.array([[[[-50.0] * 4] * 40 + [[50.0] * 4, [49.0] * 4]]], dtype))   # the largest in tile 2
    v = randn(xp, (1, 1, 42, 2), 2, dtype=dtype)
    out, cache = flash_forward(q, k, v, scale=1.0 if dtype == "float16" else 2.0)
    grads = flash_backward(xp.ones_like(out), cache)
    assert all(np.isfinite(host(a)).all() for a in (out, *grads))
    np.testing.assert_array_equal(host(out), np.broadcast_to(host(v)[:, :, 40:41], out.shape))


def test_views_in_no_mutation_dtypes_out(fx):
    xp = fx.xp
    q64, k64, v64 = qkv(xp, 2, 3, 7, 9, 8, 4, 0, "float32")
    k = xp.ascontiguousarray(k64.swapaxes(-1, -2)).swapaxes(-1, -2)                      # a transposed view
    v = xp.ascontiguousarray(v64.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)            # a head-split view
    assert not k.flags.c_contiguous and not v.flags.c_contiguous
    before = [host(a).copy() for a in (q64, k, v)]
    out, cache, grads = compare(fx, q64, k, v, randn(xp, (2, 3, 7, 4), 3, "float32"), {"is_causal": True},
                                "float32")
    assert all(np.array_equal(host(a), b) for a, b in zip((q64, k, v), before))
    assert all(a.dtype == np.float32 for a in (out, *grads)) and cache.lse.shape == (2, 3, 7, 1)


# -- dispatch, fall-back, bad input ------------------------------------------------------------------
def test_head_sizes_beyond_128_fall_back_to_the_reference(fx):
    xp = fx.xp
    q, k, v = qkv(xp, 1, 1, 3, 4, 129, 2, 0, "float64")
    assert implementation(flash_forward, q, k, v) == "reference"
    assert implementation(flash_forward, q[..., :128], k[..., :128], v) == "cuda"
    assert implementation(flash_forward, q[..., :8], k[..., :8], randn(xp, (1, 1, 4, 129), 1)) == "reference"
    out, cache = flash_forward(q, k, v)                 # the reference, through the dispatcher
    assert implementation(flash_backward, out, cache) == "reference"
    with pytest.raises(RangeError, match="the CUDA flash attention kernel takes head sizes up to 128, got hs=129"):
        cuda.flash_attention_forward(q, k, v)
    with pytest.raises(RangeError, match="head sizes up to 128"):
        cuda.flash_attention_backward(out, cache)


def test_bad_input_gets_the_references_messages(fx):
    """The reference op's bad-input cases, now through the dispatcher with device arrays: what the
    kernel's predicate takes is checked by the reference's own functions (need_weights=True, block
    sizes, dropout_p, masks, alignment), the rest goes to the reference."""
    reference_bad_input_cases(fx.xp)
    q = randn(fx.xp, (2, 1, 2, 4), 0)
    out, cache = flash_forward(q, q, q)
    with pytest.raises(ValueError, match=r"dout: expected the shape of the forward's output, \(2, 1, 2, 4\)"):
        flash_backward(out[:, :, :1], cache)
    with pytest.raises(TypeError, match="dout: expected the dtype of the forward's output, float64"):
        flash_backward(out.astype(np.float32), cache)


def test_numpy_arrays_are_refused_by_the_kernels_with_a_clear_error():
    q = np.ones((1, 1, 2, 4), np.float32)
    assert not kernel.accepts_forward(q, q, q)
    with pytest.raises(TypeError, match=r"the fused CUDA kernels take CuPy arrays; got numpy\.ndarray"):
        cuda.flash_attention_forward(q, q, q)


def test_accepts_device_masks_only(fx):
    xp = fx.xp
    q = randn(xp, (2, 1, 3, 4), 0, "float32")
    assert kernel.accepts_forward(q, q, q, attn_mask=xp.zeros((3, 3), bool), key_padding_mask=xp.zeros((2, 3)))
    assert not kernel.accepts_forward(q, q, q, attn_mask=xp.zeros((3, 3), xp.int32))   # the reference raises
    assert not kernel.accepts_forward(q, q, q.astype(xp.float64))
    assert not kernel.accepts_forward(q[0], q[0], q[0])
    if fx.name == "cuda":                                                            # a host mask: the reference
        assert not kernel.accepts_forward(q, q, q, attn_mask=np.zeros((3, 3), bool))  # raises the mismatch


def test_launch_geometry_is_the_traits(fx):
    """The host's one copy of each instantiation's launch (flash_source.geometry: block, rows a block, shared
    memory, from GEOMETRY) is its traits' in flash.cu (THREADS, ROWS, SHARED), compiled; every shipped
    kernel fits an A100's 163 KiB a block, and the tensor-core dense ones two blocks an SM (float32's dense
    kernels, SIMT, are held by their occupancy floors: tests/kernels/cuda/test_compile.py)."""
    module = _test_module()
    for (dtype, d), kernels in flash_source.MODULE_KERNELS.items():
        for name in flash_source.kernels(dtype) + (flash_source.wgmma_kernels(dtype) if d > 32 else ()):
            got = fx.xp.zeros(3, dtype=np.int64)
            kernel = sources.geometry_kernel(flash_source.name_expression(name, dtype, d))
            module.get_function(kernel)((1,), (1,), (got,))
            assert tuple(host(got)) == flash_source.geometry(name, dtype, d), (name, dtype, d)
    assert max(shared for _, shared in flash_source.GEOMETRY.values()) <= 163 * 1024   # (an H100: 227 KiB)
    assert all(shared <= 163 * 1024 // 2 for key, (_, shared) in flash_source.GEOMETRY.items()
               if "Dense<" in key and "float" not in key)


def _offsets(dtype) -> list:
    """The offset of each field of the params dtype, NpfFaArgs's fields (``a``) in place of it."""
    args, at = dtype.fields["a"][:2]
    return [dtype.fields[n][1] for n in dtype.names if n != "a"] + [at + args.fields[n][1] for n in args.names]


@pytest.mark.parametrize("acc", ["float32", "float64"])
def test_the_params_dtype_is_the_kernels_struct(fx, acc):
    """flash_source.params_dtype (what Python fills) has the compiled NpfFaParams's layout: every
    field's offset, in order, and its size (flash_test.cu's npf_fa_params_layout reads them)."""
    dtype = flash_source.params_dtype(np.dtype(acc))
    want = _offsets(dtype) + [dtype.itemsize]
    got = fx.xp.zeros(len(want), dtype=np.int64)
    _test_module().get_function(f"npf_fa_params_layout_f{acc[-2:]}")((1,), (1,), (got,))
    assert host(got).tolist() == want


def test_every_module_names_its_instantiations():
    """A module per (dtype, D), dtypes by name: the SIMT kernels and bwd_pre, float16's, bfloat16's and
    float32's tensor-core ones, the dense ones (float16's and bfloat16's on tensor cores, float32's SIMT) of all
    three, each npf_fa_kernel<traits>; the source
    has no extern "C" entry point and every constant filled in; the test kernels are the tests' module only."""
    assert {dtype for dtype, _ in flash_source.MODULE_KERNELS} == {"float16", "bfloat16", "float32", "float64"}
    for (dtype, d), kernels in flash_source.MODULE_KERNELS.items():
        variant = {"float16": "_tc", "bfloat16": "_tc", "float32": "_tf32"}.get(dtype, "")
        tensor_cores = tuple(k + variant for k in ("fwd", "bwd_dq", "bwd_dkdv")) if variant else ()
        dense = tuple(f"{k}_dense{c}" for k in ("fwd", "bwd_dq", "bwd_dkdv") for c in ("", "_causal"))
        names = ("fwd", "bwd_dq", "bwd_dkdv") + tensor_cores + (dense if variant else ())
        want = {flash_source.entry_name(n, dtype, d) for n in names} | {flash_source.entry_name("bwd_pre", dtype)}
        assert set(kernels) == want
        assert all(re.fullmatch(r"npf_fa_kernel<NpfFa\w+<[\w ,]+>>", e) for e in kernels.values()), kernels
    assert set(flash_source.WGMMA_MODULE_KERNELS) == {(t, d) for t in ("float16", "bfloat16") for d in (64, 128)}
    for (dtype, d), kernels in flash_source.WGMMA_MODULE_KERNELS.items():           # the Hopper modules
        names = tuple(f"{k}_wgmma{c}" for k in ("fwd", "bwd_dq", "bwd_dkdv") for c in ("", "_causal"))
        assert set(kernels) == {flash_source.entry_name(n, dtype, d) for n in names}
        assert all(re.fullmatch(r"npf_fa_kernel<NpfFa(Fwd|Dq|Dkdv)Wgmma<[\w ]+, \d+, (true|false)>>", e)
                   for e in kernels.values())
    for text in (flash_source.FLASH_SOURCE, flash_source.FLASH_EMULATED_SOURCE):
        assert "@" not in text and 'extern "C" __global__' not in text and "npf_fa_geometry" not in text
    test_names = re.findall(r'extern "C" __global__ void (npf_\w+)\(', sources.FLASH_TEST_SOURCE)
    assert test_names == ["npf_fa_keep_mask", "npf_fa_params_layout_f32", "npf_fa_params_layout_f64"]


# -- the module: "auto" runs the kernel on device arrays without weights ------------------------------
def test_multihead_attention_auto_runs_the_kernel_on_device_arrays(fx, monkeypatch):
    xp = fx.xp
    if fx.name == "emulated":                            # NumPy arrays pose as CuPy's for the module too
        monkeypatch.setattr(multihead_op, "is_cupy_array", lambda a: isinstance(a, np.ndarray))
    ran = []
    path = flash_forward.fast_paths[0]                   # the dispatcher's own list: restored after
    flash_forward.fast_paths[0] = path._replace(run=lambda *a, **kw: (ran.append(1), path.run(*a, **kw))[1])
    try:
        check_auto(xp, ran)
    finally:
        flash_forward.fast_paths[0] = path


def check_auto(xp, ran):
    kw = dict(dtype=xp.float64, backend=backend_name(xp), rng=3)
    auto, plain = MultiheadAttention(8, 2, **kw), MultiheadAttention(8, 2, attention="plain", **kw)
    assert auto.attention == "auto"
    x = randn(xp, (2, 70, 8), 0)
    dout = randn(xp, (2, 70, 8), 1)
    results = []
    for m in (auto, plain):
        out, weights = m(x, need_weights=False, is_causal=True)
        results.append((out, weights, m.backward(dout)[0]))
    assert ran == [1] and results[0][1] is None
    for a, b in zip(results[0][::2], results[1][::2]):
        assert_close(a, b, "float64", scale=10.0)
    _, weights = auto(x, need_weights=True)              # weights asked for: plain
    auto.backward(dout)
    assert weights is not None and ran == [1]


def test_the_benchmarks_flash_sweep_runs_the_kernel(fx):
    """npformer/bench/cases.py's flash sweep row (timed on CuPy where present) runs the CUDA kernel,
    forward and backward, and agrees with the reference (here NumPy arrays pose as CuPy's)."""
    from npformer import bench
    from npformer.bench import cases, paths
    b = bench.Backend("numpy" if fx.name == "emulated" else "cupy", 1)
    cfg, t = dict(bench.QUICK, d=16, H=2), 70
    flash = bench.flash_sweep_case(cfg, t).build(b)
    assert paths.label(paths.fast_paths_run(flash["fwd"])) == "cuda"
    assert paths.fast_paths_run(flash["bwd"]) == ["cuda:flash_attention_backward"]
    out, grads = flash["fwd"]()[0], flash["bwd"]()
    with disabled():
        ref, ref_grads = flash["fwd"]()[0], flash["bwd"]()
    q, k, v = (cases.host_normal((1, 2, t, 8), s) for s in (1, 2, 3))      # the case's inputs
    scales = magnitudes(q, k, v, cases.upstream_gradient(out.shape), host(ref), {})
    assert_close(out, ref, "float32", scale=scales["out"])
    for what, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, r, "float32", scale=scales[what], what=what)


# -- float16 on tensor cores ------------------------------------------------------------------------
def _launched(monkeypatch) -> list:
    names = []
    real = kernel._launch
    monkeypatch.setattr(kernel, "_launch", lambda name, *a: (names.append(name), real(name, *a))[1])
    return names


def test_float16_runs_on_tensor_cores_from_compute_capability_8(fx, monkeypatch):
    """Float16's forward and backward are the tensor-core kernels on sm_80 and later (the dense forward
    without masks and dropout, causal or not), the SIMT kernels before; float32 keeps SIMT arithmetic (its
    dense kernels there, from sm_80: cp.async), as float64 does."""
    from npformer.kernels.cuda import runtime
    names = _launched(monkeypatch)
    q, k, v = qkv(fx.xp, 1, 2, 20, 20, 16, 16, 0, "float16")
    padding = fx.xp.asarray(np.array([[False] * 19 + [True]]))

    def step(dtype, **masks):
        out, cache = flash_forward(*(a.astype(dtype) for a in (q, k, v)), is_causal=True, **masks)
        flash_backward(out, cache)
    step("float16")
    step("float16", key_padding_mask=padding)
    step("float32")
    tc, simt = ["fwd_dense_causal", "bwd_dkdv_dense_causal", "bwd_dq_dense_causal", "fwd_tc", "bwd_dkdv_tc",
                "bwd_dq_tc"], ["fwd", "bwd_dkdv", "bwd_dq"]
    if fx.name == "emulated":
        monkeypatch.setattr(runtime, "compute_capability", lambda: 75)
        step("float16")
        assert names == tc + tc[:3] + simt               # float32: the dense kernels, SIMT
        step("float32")
        assert names[-3:] == simt                        # (before sm_80: the general ones)
    else:
        assert names == (tc + tc[:3] if runtime.compute_capability() >= 80 else simt * 3)


def test_bfloat16_runs_on_tensor_cores_and_needs_compute_capability_8(fx, monkeypatch):
    """bfloat16 takes float16's kernels (the dense ones without masks and dropout, the _tc ones with them:
    m16n8k16 .bf16) from compute capability 8.0 on; below it no kernel, fused or flash, takes bfloat16:
    a clear error (a GPU below 8.0 has no bfloat16 conversions nor products), not the SIMT kernels."""
    from npformer.kernels.cuda import runtime
    names = _launched(monkeypatch)
    q, k, v = qkv(fx.xp, 1, 2, 20, 20, 16, 16, 0, "bfloat16")
    out, cache = flash_forward(q, k, v, is_causal=True)
    flash_backward(out, cache)
    out, cache = flash_forward(q, k, v, is_causal=True, key_padding_mask=fx.xp.asarray(np.array([[False] * 20])))
    flash_backward(out, cache)
    assert names == ["fwd_dense_causal", "bwd_dkdv_dense_causal", "bwd_dq_dense_causal", "fwd_tc", "bwd_dkdv_tc",
                     "bwd_dq_tc"]
    if fx.name == "emulated":
        monkeypatch.setattr(runtime, "compute_capability", lambda: 75)
        monkeypatch.setattr(runtime, "_cache", {})
        for launch in (lambda: flash_forward(q, k, v), lambda: cuda.softmax_forward(q)):
            with pytest.raises(TypeError, match=r"bfloat16 arrays on a GPU of compute capability 7\.5: the CUDA "
                                                r"kernels take bfloat16 from compute capability 8\.0 on"):
                launch()


# -- the Hopper forward (wgmma, sm_90a): the dense forward's products on warpgroup MMAs ----------------
@pytest.fixture
def wgmma(fx):
    """fx with the Hopper forward opted in (flash_attention.use_wgmma), on a GPU of compute capability 9.0
    (emulated: the fixture says 9.0)."""
    from npformer.kernels.cuda import runtime
    if fx.name == "cuda" and runtime.compute_capability() != 90:
        pytest.skip(f"the Hopper forward needs compute capability 9.0, this GPU's is {runtime.compute_capability()}")
    kernel.use_wgmma(True)
    yield fx
    kernel.use_wgmma(False)


@pytest.mark.parametrize("dtype, hs, tq, tk, kind, fwd", [
    ("float64", 40, 70, 50, "mask+dropout", "fwd"), ("float32", 64, 70, 130, "padding", "fwd"),
    ("float32", 64, 70, 130, "top_left", "fwd_dense_causal"), ("float32", 64, 70, 130, "padding+tf32", "fwd_tf32"),
    ("float16", 64, 70, 130, "padding+dropout", "fwd_tc"), ("float16", 64, 200, 70, "top_left", "fwd_dense_causal"),
    ("float16", 128, 130, 200, "none", "fwd_dense"),
    ("float16", 64, 130, 200, "bottom_right+wgmma", "fwd_wgmma_causal"),
    ("float16", 128, 70, 260, "top_left+wgmma", "fwd_wgmma_causal")])
def test_the_kernels_results_do_not_depend_on_their_threads_order(fx, request, monkeypatch, dtype, hs, tq, tk, kind,
                                                                   fwd):
    """Emulated: each kind of kernel (SIMT general and dense, TF32, float16 general, dense and Hopper) run
    again with its blocks, warps and each warp's lanes last first (emulator.reversed_schedule) gives out, lse, dq,
    dk, dv bit for bit as in the threads' order, so no result hangs on a race the forward order hides (a
    thread reading before a barrier what a later thread writes). The kernels have no atomics: their sums'
    order is fixed."""
    if fx.name != "emulated":
        pytest.skip("the emulator's schedules; a GPU keeps its own")
    from npformer.kernels.cuda import runtime
    if "tf32" in kind:
        monkeypatch.setattr(runtime, "float32_on_tf32", lambda: True)
    if "wgmma" in kind:
        kernel.use_wgmma(True)
        request.addfinalizer(lambda: kernel.use_wgmma(False))
    names = _launched(monkeypatch)
    xp, r = fx.xp, np.random.default_rng(tq + tk)
    q, k, v = qkv(xp, 2, 2, tq, tk, hs, hs, tq + tk, dtype)
    dout = randn(xp, (2, 2, tq, hs), 4, dtype)
    kw = {"is_causal": True, "causal_alignment": kind.split("+")[0]} if kind.startswith(("top", "bottom")) else {}
    if kind.startswith("mask"):
        kw["attn_mask"] = xp.asarray(r.random((tq, tk)) < 0.3)
    if kind.startswith("padding"):
        kw["key_padding_mask"] = xp.asarray(r.random((2, tk)) < 0.2)

    def run():
        drop = {"dropout_p": 0.2, "rng": default_rng(7, backend_name(xp))} if "dropout" in kind else {}
        out, cache = flash_forward(q, k, v, **kw, **drop)
        return [host(a) for a in (out, cache.lse, *flash_backward(dout, cache))]
    first = run()
    assert names[0] == fwd and not any(np.isnan(a.astype(np.float64)).any() for a in first), names
    with emulator.reversed_schedule(request.getfixturevalue("emulated_flash_module")):
        again = run()
    for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, again):
        assert_same_bits(b, a, what)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in ("float16", "bfloat16")])
@pytest.mark.parametrize("hs, tq, tk, alignment", [
    (64, 1, 1, None), (64, 128, 128, "top_left"), (64, 130, 300, None), (40, 200, 70, "top_left"),
    (128, 129, 256, "bottom_right"), (72, 300, 100, "bottom_right"), (128, 64, 200, None), (64, 70, 260, "top_left")])
def test_the_wgmma_kernels_match_the_reference(wgmma, monkeypatch, hs, tq, tk, alignment, dtype):
    """npf_fa_forward_wgmma, npf_fa_bwd_dq_wgmma, npf_fa_bwd_dkdv_wgmma (opted in, compute capability 9.0): out,
    lse, dq, dk, dv as the reference's, causal (both alignments: rows before the first key see none, zeros
    and lse +inf; keys past Tq under top_left, which no query sees: zeros in dK, dV) or not, ragged ends of
    both lengths (blocks of 128 rows or keys, tiles of 128 keys, dQ's of 64 keys, dK dV's of 64 queries), both
    head-size buckets (hs below D: zero columns); each backward on each forward's cache. Emulated, the wgmmas
    run at their waits and the cp.async copies land at theirs, so a tile overwritten or an accumulator read
    too early shows, as does a block that leaves a copy in flight (rows that see no key)."""
    names = _launched(monkeypatch)
    q, k, v = qkv(wgmma.xp, 1, 2, tq, tk, hs, hs, tq + 2 * tk, dtype)
    dout = randn(wgmma.xp, (1, 2, tq, hs), 5, dtype)
    kw = {} if alignment is None else {"is_causal": True, "causal_alignment": alignment}
    out, cache, _ = compare(wgmma, q, k, v, dout, kw, dtype)
    causal = "_causal" if alignment else ""
    assert names[:3] == [f"fwd_wgmma{causal}", f"bwd_dkdv_wgmma{causal}", f"bwd_dq_wgmma{causal}"]
    empty = np.isinf(host(cache.lse))[..., 0]
    assert empty.any() == (alignment == "bottom_right" and tq > tk) and not host(out)[empty].any()


def test_the_wgmma_kernels_run_only_where_they_may(wgmma, monkeypatch):
    """The dense kernels instead: opted out; head sizes in the bucket of 32, or not a multiple of 8 values
    (cp.async copies 16 bytes); a row stride of an odd number of values, or a tensor not 16-byte aligned
    (the backward: dout's too); another compute capability (emulated); masks or dropout go to the _tc
    kernels as before."""
    from npformer.kernels.cuda import runtime
    names = _launched(monkeypatch)
    xp = wgmma.xp
    q, k, v = qkv(xp, 1, 2, 70, 70, 64, 64, 3, "float16")

    def forward(*qkv_, **kw):
        names.clear()
        flash_forward(*qkv_, is_causal=True, **kw)
        return names[0]
    assert forward(q, k, v) == "fwd_wgmma_causal"
    assert forward(q[..., :32], k[..., :32], v[..., :32]) == "fwd_dense_causal"     # bucket 32
    assert forward(q[..., :60], k[..., :60], v[..., :60]) == "fwd_dense_causal"     # 60 values a row
    wide = randn(xp, (1, 2, 70, 65), 4, "float16")
    assert forward(wide[..., :64], k, v) == "fwd_dense_causal"                      # rows 65 values apart
    flat = randn(xp, (1 * 2 * 70 * 64 + 1,), 5, "float16")
    shifted = flat[1:].reshape(1, 2, 70, 64)                                        # 2 bytes past alignment
    assert forward(shifted, k, v) == "fwd_dense_causal"
    assert forward(q, k, v, key_padding_mask=xp.asarray(np.zeros((1, 70), bool))) == "fwd_tc"
    kernel.use_wgmma(False)
    assert forward(q, k, v) == "fwd_dense_causal"
    kernel.use_wgmma(True)
    out, cache = flash_forward(q, k, v, is_causal=True)
    names.clear()
    flash_backward(randn(xp, out.shape, 6, "float16"), cache)
    assert names == ["bwd_dkdv_wgmma_causal", "bwd_dq_wgmma_causal"]
    names.clear()
    flash_backward(randn(xp, (1, 2, 70, 65), 7, "float16")[..., :64], cache)   # dout's rows 65 values apart
    assert names == ["bwd_dkdv_dense_causal", "bwd_dq_dense_causal"]
    if wgmma.name == "emulated":
        monkeypatch.setattr(runtime, "compute_capability", lambda: 80)
        assert forward(q, k, v) == "fwd_dense_causal"


# -- the dense kernels (float16, bfloat16 on tensor cores; float32 SIMT): the common case without masks or dropout
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in ("float32", "float16", "bfloat16")])
@pytest.mark.parametrize("hs, tq, tk, alignment", [
    (8, 1, 1, None), (24, 17, 130, "top_left"), (64, 128, 128, "top_left"), (64, 200, 70, "top_left"),
    (64, 130, 200, None), (100, 70, 200, "bottom_right"), (128, 200, 70, "bottom_right"), (32, 257, 96, None),
    (64, 300, 300, "top_left"), (30, 33, 40, None), (58, 65, 130, "top_left")])
def test_the_dense_kernels_match_the_reference(fx, monkeypatch, hs, tq, tk, alignment, dtype):
    """No attention mask, no padding, no dropout: the dense forward and backward (npf_fa_forward_dense,
    npf_fa_bwd_dkdv_dense, npf_fa_bwd_dq_dense; float32's npf_fa_forward_simt_dense, npf_fa_bwd_dkdv_simt_dense,
    npf_fa_bwd_dq_simt_dense), causal (both alignments: rows before the first key see
    none, zeros and lse +inf) or not, ragged ends of both lengths, every head-size bucket (hs below D:
    zeros padded); out, lse, dq, dk, dv as the reference's (compare: each backward on each forward's
    cache too), within the dtype's tolerance of the magnitudes in play (bfloat16: and the float32 reference's)."""
    names = _launched(monkeypatch)
    q, k, v = qkv(fx.xp, 2, 3, tq, tk, hs, hs, tq + tk, dtype)
    dout = randn(fx.xp, (2, 3, tq, hs), 3, dtype)
    kw = {} if alignment is None else {"is_causal": True, "causal_alignment": alignment}
    out, cache, _ = compare(fx, q, k, v, dout, kw, dtype)
    causal = "_causal" if alignment else ""
    assert names[:3] == [f"fwd_dense{causal}", f"bwd_dkdv_dense{causal}", f"bwd_dq_dense{causal}"]
    empty = np.isinf(host(cache.lse))[..., 0]                          # rows that see no key
    assert empty.any() == (alignment == "bottom_right" and tq > tk) and not host(out)[empty].any()


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in ("float32", "float16", "bfloat16")])
@pytest.mark.parametrize("scale", [-0.3, 0.0])
@pytest.mark.parametrize("causal", [False, True])
def test_a_scale_of_zero_or_below_runs_the_general_kernels(fx, monkeypatch, dtype, scale, causal):
    """The dense kernels take a row's maximum of the unscaled scores and fold the scale into exp2 after it,
    which holds for a positive scale only (a negative one turns the maximum into the minimum; 0 times a
    masked score's -inf is NaN): a scale of 0 or below runs the general kernels, which scale each score
    first, and gives the reference's numbers (0: every visible key weighted alike)."""
    names = _launched(monkeypatch)
    q, k, v = qkv(fx.xp, 1, 2, 70, 70, 64, 64, 5, dtype)
    kw = {"is_causal": causal, "scale": scale}
    out, _, _ = compare(fx, q, k, v, randn(fx.xp, (1, 2, 70, 64), 3, dtype), kw, dtype)
    general = "" if dtype == "float32" else "_tc"
    assert names[:3] == [f"fwd{general}", f"bwd_dkdv{general}", f"bwd_dq{general}"]
    if scale == 0.0 and not causal:                               # each row the mean of v's rows
        assert_close(out, fx.xp.broadcast_to(v.mean(axis=2, keepdims=True), out.shape), dtype, what="out")


@pytest.mark.parametrize("odd", ["v", "k", "dout"])
@pytest.mark.parametrize("hs", [64, 128])
def test_the_dense_kernels_copy_a_pair_of_tiles_with_one_not_aligned(fx, monkeypatch, odd, hs):
    """The dense kernels copy K and V (Q and dO in dK, dV) as a pair, in line where both are whole and
    16-byte aligned (NpfFaTilePair); one of the two with rows an odd number of values apart (V, dO) or 2
    bytes past alignment (K) sends every tile of the pair to the out-of-line loader: out, lse, dq, dk, dv
    as the reference's, causal, ragged ends (the last tiles of both lengths not whole)."""
    names = _launched(monkeypatch)
    xp = fx.xp
    q, k, v = qkv(xp, 1, 2, 150, 140, hs, hs, 11, "float16")
    dout = randn(xp, (1, 2, 150, hs), 12, "float16")
    if odd == "v":
        v = xp.ascontiguousarray(randn(xp, (1, 2, 140, hs + 1), 13, "float16"))[..., :hs]
    elif odd == "k":
        flat = randn(xp, (2 * 140 * hs + 1,), 14, "float16")
        k = flat[1:].reshape(1, 2, 140, hs)
    else:
        dout = randn(xp, (1, 2, 150, hs + 1), 15, "float16")[..., :hs]
    compare(fx, q, k, v, dout, {"is_causal": True}, "float16")
    assert names[:3] == ["fwd_dense_causal", "bwd_dkdv_dense_causal", "bwd_dq_dense_causal"], names


def test_float16_scores_beyond_float16_on_tensor_cores(fx, monkeypatch):
    """The op test that failed on the first H200 (tests/ops/test_attention.py, float16 scores of 1e8)
    through the tensor-core kernels: emulated, dq comes out near the float32 path's 324 (the emulator's
    mma adds in order with float32 rounding), on the H200 at 0 in 79 of 160 entries (tensor cores add
    the products with more bits and truncate); the exact value is 0, and both are within the float32
    arithmetic's bound of it, which assert_scores_beyond_float16 checks (the test compared with the
    float32 path's rounding noise before)."""
    names = _launched(monkeypatch)
    assert_scores_beyond_float16(fx.xp, flash_forward, flash_backward)
    if fx.name == "emulated":
        assert names == ["fwd_tc", "bwd_dkdv_tc", "bwd_dq_tc"]


@pytest.mark.parametrize("hs, causal", [(32, False), (64, True), (128, False), (80, True)])
def test_float16_on_tensor_cores_is_as_close_to_float64_as_the_simt_kernels(fx, monkeypatch, hs, causal):
    """||x - ref|| / ||ref|| for out, dq, dk, dv against the float64 reference of the same float16
    inputs: at most 2e-3, and at most 1.6 times the SIMT kernels' (which keep P and dS in float32; the
    tensor cores take them as float16). Emulated: 2.3-3.2e-4 against 2.0-2.4e-4."""
    from npformer.kernels.cuda import runtime
    q, k, v = qkv(fx.xp, 2, 2, 96, 80, hs, hs, 7, "float16")
    dout = randn(fx.xp, (2, 2, 96, hs), 8, "float16")
    with disabled():
        want, cache = flash_forward(*(host(a).astype(np.float64) for a in (q, k, v)), is_causal=causal)
        want = [want, *flash_backward(host(dout).astype(np.float64), cache)]
    err = {}
    for capability in (90, 75):
        if fx.name == "emulated":
            monkeypatch.setattr(runtime, "compute_capability", lambda c=capability: c)
        elif (capability >= 80) != (runtime.compute_capability() >= 80):
            continue
        out, cache = flash_forward(q, k, v, is_causal=causal)
        got = [out, *flash_backward(dout, cache)]
        err[capability] = [np.linalg.norm(host(g).astype(np.float64) - w) / np.linalg.norm(w)
                           for g, w in zip(got, want)]
    assert max(max(e) for e in err.values()) <= 2e-3, err
    if len(err) == 2:
        assert all(tc <= 1.6 * simt + 1e-4 for tc, simt in zip(err[90], err[75])), err


# -- float32 on TF32 tensor cores (the opt-in) ----------------------------------------------------------
@pytest.fixture
def tf32(fx, monkeypatch):
    """float32 flash attention on TF32 tensor cores for the test: the opt-in itself on a GPU (compute
    capability 8.0 or later), its switch in the emulation."""
    from npformer.kernels.cuda import runtime
    if fx.name == "emulated":
        monkeypatch.setattr(runtime, "float32_on_tf32", lambda: True)
        yield fx
        return
    if runtime.compute_capability() < 80:
        pytest.skip("TF32 tensor cores need compute capability 8.0 or later")
    from npformer.backend import set_float32_matmul_precision
    set_float32_matmul_precision("tf32", "cupy")
    try:
        yield fx
    finally:
        set_float32_matmul_precision("highest", "cupy")


def test_float32_runs_on_tf32_tensor_cores_only_under_the_opt_in(fx, monkeypatch):
    from npformer.kernels.cuda import runtime
    names = _launched(monkeypatch)
    q, k, v = qkv(fx.xp, 1, 2, 20, 20, 16, 16, 0, "float32")

    def step():
        out, cache = flash_forward(q, k, v, is_causal=True)
        flash_backward(out, cache)
    if fx.name != "emulated" and (runtime.float32_on_tf32() or runtime.compute_capability() < 80):
        pytest.skip("needs a GPU of compute capability 8.0 or later with TF32 off")
    step()                                               # SIMT: the dense kernels (no mask, no dropout)
    assert names == ["fwd_dense_causal", "bwd_dkdv_dense_causal", "bwd_dq_dense_causal"], names
    assert kernel.tensor_core_variant(np.float32) == ""
    names.clear()
    if fx.name == "emulated":
        monkeypatch.setattr(runtime, "float32_on_tf32", lambda: True)
    else:
        from npformer.backend import set_float32_matmul_precision
        set_float32_matmul_precision("tf32", "cupy")
    try:
        step()
        assert names == ["fwd_tf32", "bwd_dkdv_tf32", "bwd_dq_tf32"], names      # (TF32 has no dense kernels)
        assert kernel.tensor_core_variant(np.float64) == "" and kernel.tensor_core_variant(np.float16) == "tc"
        if fx.name == "emulated":                        # before Ampere: no TF32, the SIMT kernels
            monkeypatch.setattr(runtime, "compute_capability", lambda: 75)
            assert kernel.tensor_core_variant(np.float32) == ""
    finally:
        if fx.name != "emulated":
            set_float32_matmul_precision("highest", "cupy")


@settings(max_examples=30)
@given(b=st.integers(1, 2), h=st.integers(1, 2), tq=LENGTHS, tk=LENGTHS, hs=st.integers(1, 40),
       hv=st.integers(1, 40), causal=CAUSAL, kind=MASKS, p=st.sampled_from([0.0, 0.0, 0.3]),
       scale=st.sampled_from([None, 0.3, -0.3, 0.0]), seed=seeds, data=st.data())
def test_float32_on_tf32_matches_the_reference(tf32, b, h, tq, tk, hs, hv, causal, kind, p, scale, seed, data):
    """TF32 keeps 10 mantissa bits of each operand, as float16 does: float16's tolerance against the
    float32 reference (lse too, scaled by its magnitude), over every mask kind, causal alignment,
    dropout and ragged tile; the kernels' caches and the reference's are interchangeable."""
    xp, name = tf32.xp, backend_name(tf32.xp)
    q, k, v = qkv(xp, b, h, tq, tk, hs, hv, seed, "float32")
    dout = randn(xp, (b, h, tq, hv), seed + 3, "float32")
    kw = {**masks(data, xp, kind, b, h, tq, tk, seed), **causal_kw(causal), "scale": scale}
    drop = {"dropout_p": p, "rng": default_rng(seed, name)} if p else {}
    out, cache = flash_forward(q, k, v, **kw, **drop)
    with disabled():
        ref, ref_cache = flash_forward(q, k, v, **kw, **({**drop, "rng": default_rng(seed, name)} if p else {}))
        ref_grads = flash_backward(dout, ref_cache)
    scales = magnitudes(q, k, v, dout, ref, kw, p)
    assert_close(out, ref, "float32", scale=scales["out"], what="out", arithmetic="float16")
    assert_close(cache.lse, ref_cache.lse, "float32", what="lse", arithmetic="float16")
    for what, g, r in zip(("dq", "dk", "dv"), flash_backward(dout, cache), ref_grads):
        assert_close(g, r, "float32", scale=scales[what], what=what, arithmetic="float16")


@pytest.mark.parametrize("hs, causal", [(32, False), (64, True), (128, False), (80, True)])
def test_float32_on_tf32_is_as_close_to_float64_as_float16_on_tensor_cores(tf32, hs, causal):
    """||x - ref|| / ||ref|| for out, dq, dk, dv against float64: at most 2e-3 (the float16 kernels'
    bound); emulated: 3.3-5.4e-4 (every float32 input rounded to TF32, besides P and dS; the float16
    kernels' 2.3-3.2e-4 start from inputs that are float16 already)."""
    xp = tf32.xp
    q, k, v = qkv(xp, 2, 2, 96, 80, hs, hs, 7, "float32")
    dout = randn(xp, (2, 2, 96, hs), 8, "float32")
    with disabled():
        want, cache = flash_forward(*(host(a).astype(np.float64) for a in (q, k, v)), is_causal=causal)
        want = [want, *flash_backward(host(dout).astype(np.float64), cache)]
    out, cache = flash_forward(q, k, v, is_causal=causal)
    got = [out, *flash_backward(dout, cache)]
    err = [np.linalg.norm(host(g).astype(np.float64) - w) / np.linalg.norm(w) for g, w in zip(got, want)]
    assert max(err) <= 2e-3, err


@pytest.mark.parametrize("dtype, tf32_on, kernels", [("float16", False, "_tc"), ("float32", True, "_tf32"),
                                                     ("float32", False, "")])
def test_a_gpt_training_step_launches_the_tensor_core_kernels(fx, monkeypatch, dtype, tf32_on, kernels):
    """The GPT's attention on device arrays (attention="auto") is the flash kernel: a float16 model's
    step runs the float16 tensor-core kernels, a float32 model's the TF32 ones under the opt-in and the
    SIMT ones without it, forward and backward in each layer."""
    from npformer.kernels.cuda import runtime
    from npformer.models.gpt import GPT, GPTConfig
    from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
    if fx.name == "emulated":                            # NumPy arrays pose as CuPy's for the module too
        monkeypatch.setattr(multihead_op, "is_cupy_array", lambda a: isinstance(a, np.ndarray))
        monkeypatch.setattr(runtime, "float32_on_tf32", lambda: tf32_on)
    elif runtime.compute_capability() < 80 or runtime.float32_on_tf32() != tf32_on:
        pytest.skip("the GPU's compute capability or TF32 setting is not this case's")
    names = _launched(monkeypatch)
    xp = fx.xp
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=32), dtype=dtype,
                backend=backend_name(xp), rng=0)
    idx = xp.asarray(np.random.default_rng(0).integers(0, 11, (2, 8)))
    loss, cache = cross_entropy_forward(model(idx), idx)
    model.backward(cross_entropy_backward(xp.ones((), dtype=loss.dtype), cache))
    assert names == [f"fwd{kernels}"] * 2 + [f"bwd_dkdv{kernels}", f"bwd_dq{kernels}"] * 2, names
    assert all(np.isfinite(host(p.grad)).all() for _, p in model.named_parameters())
