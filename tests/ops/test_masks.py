"""causal_mask (pictures of both alignments, loop reference) and attention_bias (every mask kind
merged into one 0 / -inf / float bias, against a loop reference), and their bad input."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.ops.masks import attention_bias, causal_mask
from tests.helpers import batch, heads, host, padding_masks, randn, seeds, seq

ALIGN = st.sampled_from(["top_left", "bottom_right"])


def picture(mask):
    """Rows of '.' (may attend) and 'x' (may not attend)."""
    return ["".join("x" if blocked else "." for blocked in row) for row in host(mask)]


def test_causal_mask_pictures(xp):
    assert picture(causal_mask(2, 4, xp=xp)) == [".xxx",
                                                 "..xx"]
    assert picture(causal_mask(2, 4, alignment="bottom_right", xp=xp)) == ["...x",
                                                                           "...."]
    assert picture(causal_mask(3, 2, xp=xp)) == [".x",
                                                 "..",
                                                 ".."]
    assert picture(causal_mask(3, 2, alignment="bottom_right", xp=xp)) == ["xx",    # sees nothing
                                                                           ".x",
                                                                           ".."]
    assert picture(causal_mask(1, 3, alignment="bottom_right", xp=xp)) == ["..."]  # one decoding step
    for align in ("top_left", "bottom_right"):
        assert picture(causal_mask(3, 3, alignment=align, xp=xp)) == [".xx",
                                                                      "..x",
                                                                      "..."]


@given(tq=seq, tk=seq, align=ALIGN)
def test_causal_mask_matches_loop(xp, tq, tk, align):
    m = causal_mask(tq, tk, alignment=align, xp=xp)
    assert m.dtype == bool and m.shape == (tq, tk)
    shift = 0 if align == "top_left" else tk - tq
    ref = [[not (j <= i + shift) for j in range(tk)] for i in range(tq)]
    assert host(m).tolist() == ref


def reference_bias(b, h, tq, tk, attn_mask=None, kpm=None, causal=None):
    """Loops over every (b, h, i, j): -inf for each bool mask that blocks, plus the float masks."""
    def term(mask, idx):
        if mask is None:
            return 0.0
        if mask.dtype == bool:
            return -np.inf if mask[idx] else 0.0
        return float(mask[idx])

    out = np.zeros((b, h, tq, tk))
    shift = 0 if causal in (None, "top_left") else tk - tq
    for bi in range(b):
        for hi in range(h):
            for i in range(tq):
                for j in range(tk):
                    a_idx = None if attn_mask is None else {2: (i, j), 3: (bi * h + hi, i, j),
                                                            4: (bi, hi, i, j)}[attn_mask.ndim]
                    total = term(attn_mask, a_idx) + term(kpm, (bi, j))
                    if causal is not None and j > i + shift:
                        total = -np.inf
                    out[bi, hi, i, j] = total
    return out


@given(b=batch, h=heads, tq=seq, tk=seq, seed=seeds, causal=st.sampled_from([None, "top_left", "bottom_right"]),
       attn=st.sampled_from([None, "bool2", "bool3", "bool4", "float2", "float3", "float4"]),
       kpm=st.sampled_from([None, "bool", "float"]), data=st.data())
def test_attention_bias_matches_loop(xp, b, h, tq, tk, seed, causal, attn, kpm, data):
    rng = np.random.default_rng(seed)
    attn_mask = kpm_mask = None
    if attn is not None:
        shape = {"2": (tq, tk), "3": (b * h, tq, tk), "4": (b, h, tq, tk)}[attn[-1]]
        attn_mask = rng.random(shape) < 0.3 if attn.startswith("bool") else rng.standard_normal(shape)
    if kpm == "bool":
        kpm_mask = data.draw(padding_masks(b, tk))
    elif kpm == "float":
        kpm_mask = rng.standard_normal((b, tk))
    given_masks = {k: (None if v is None else xp.asarray(v)) for k, v in
                   (("attn_mask", attn_mask), ("key_padding_mask", kpm_mask))}
    copies = {k: (None if v is None else v.copy()) for k, v in given_masks.items()}
    bias = attention_bias((b, h, tq, tk), xp.float64, **given_masks, is_causal=causal is not None,
                          causal_alignment=causal or "top_left", xp=xp)
    if attn is None and kpm is None and causal is None:
        assert bias is None
        return
    assert bias.ndim == 4 and bias.dtype == xp.float64
    full = np.broadcast_to(host(bias), (b, h, tq, tk))
    np.testing.assert_array_equal(full, reference_bias(b, h, tq, tk, attn_mask, kpm_mask, causal))
    for k, v in given_masks.items():                     # the masks are read, never written
        if v is not None:
            np.testing.assert_array_equal(host(v), host(copies[k]))


def test_bias_is_minus_inf_in_every_float_dtype_and_fresh(xp):
    kpm = xp.asarray([[False, False, True]] * 2)
    for dtype in (xp.float16, xp.float32, xp.float64):
        bias = attention_bias((2, 1, 2, 3), dtype, key_padding_mask=kpm, is_causal=True, xp=xp)
        assert bias.dtype == dtype
        assert np.isneginf(host(bias)[..., 2]).all()    # -inf, never a finite stand-in like -1e9
        assert (host(bias)[..., 0] == 0).all()
    float_mask = randn(xp, (2, 3), 0)
    bias = attention_bias((1, 1, 2, 3), xp.float64, attn_mask=float_mask, xp=xp)
    bias += 1.0                                          # the bias never aliases a mask passed in
    np.testing.assert_array_equal(host(float_mask), host(randn(xp, (2, 3), 0)))
    f32 = attention_bias((1, 1, 2, 3), xp.float32, attn_mask=float_mask, xp=xp)
    assert f32.dtype == xp.float32                       # float masks take the scores' dtype


def test_per_head_mask_rows_are_ordered_batch_then_head(xp):
    b, h, tq, tk = 2, 3, 1, 4
    m = np.zeros((b * h, tq, tk), bool)
    m[1 * h + 2, 0, 1] = True                            # batch 1, head 2, key 1 (torch's b*H + h)
    bias = host(attention_bias((b, h, tq, tk), xp.float32, attn_mask=xp.asarray(m), xp=xp))
    assert np.isneginf(bias[1, 2, 0, 1]) and np.isfinite(np.delete(bias.ravel(), 1 * h * tk + 2 * tk + 1)).all()


def test_bad_input(xp):
    with pytest.raises(ValueError, match="causal alignment: expected one of"):
        causal_mask(2, 2, alignment="left", xp=xp)
    with pytest.raises(TypeError, match="tq: expected an int, got float"):
        causal_mask(2.0, 2, xp=xp)
    with pytest.raises(ValueError, match="tk: expected an int >= 0, got -1"):
        causal_mask(2, -1, xp=xp)
    with pytest.raises(ValueError, match=r"scores_shape: expected 4 lengths \(B, H, Tq, Tk\)"):
        attention_bias((2, 3, 4), xp.float32, xp=xp)
    with pytest.raises(TypeError, match="dtype: expected the scores' floating dtype"):
        attention_bias((1, 1, 2, 3), xp.int32, is_causal=True, xp=xp)
    with pytest.raises(TypeError, match="is_causal: expected a bool"):
        attention_bias((1, 1, 2, 3), xp.float32, is_causal="yes", xp=xp)
    with pytest.raises(ValueError, match="causal alignment: expected one of"):
        attention_bias((1, 1, 2, 3), xp.float32, is_causal=True, causal_alignment="bottom", xp=xp)
    msg = r"attn_mask: expected shape \(Tq, Tk\)=\(3, 5\) or \(B\*H, Tq, Tk\)=\(4, 3, 5\) or " \
          r"\(B, H, Tq, Tk\)=\(2, 2, 3, 5\), got numpy bool array of shape \(5, 3\)"
    if xp.__name__ == "cupy":
        msg = msg.replace("numpy", "cupy")
    with pytest.raises(ValueError, match=msg):
        attention_bias((2, 2, 3, 5), xp.float32, attn_mask=xp.zeros((5, 3), bool), xp=xp)
    with pytest.raises(ValueError, match=r"attn_mask: expected shape .*got .* of shape \(2, 3, 5\)"):
        attention_bias((2, 2, 3, 5), xp.float32, attn_mask=xp.zeros((2, 3, 5), bool), xp=xp)
    with pytest.raises(TypeError, match="attn_mask: expected a bool mask .* got .*int64"):
        attention_bias((1, 1, 3, 5), xp.float32, attn_mask=xp.zeros((3, 5), xp.int64), xp=xp)
    with pytest.raises(TypeError, match="attn_mask: expected a numpy or cupy array, got list"):
        attention_bias((1, 1, 1, 2), xp.float32, attn_mask=[[True, False]], xp=xp)
    with pytest.raises(ValueError, match=r"key_padding_mask: expected shape \(B, Tk\)=\(2, 5\) .*\(5, 2\)"):
        attention_bias((2, 2, 3, 5), xp.float32, key_padding_mask=xp.zeros((5, 2), bool), xp=xp)
    with pytest.raises(TypeError, match="key_padding_mask: expected a bool mask"):
        attention_bias((2, 2, 3, 5), xp.float32, key_padding_mask=xp.zeros((2, 5), xp.uint8), xp=xp)
