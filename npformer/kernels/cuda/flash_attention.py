"""Flash attention as CUDA kernels (reference: :mod:`npformer.ops.flash_attention`, the version to read).

One launch forward (a block per query tile and head, an online softmax over the key tiles), and
three backward (D = rowsum(dO O); a block per key tile for dk and dv; a block per query tile for
dq), all recomputing P from the cached lse. The CUDA C and its map to the reference's lines are in
:mod:`npformer.kernels.cuda.flash_source`. The contract is the reference's: the same arguments,
checks and messages (its own check functions), the same ``(out, FlashAttentionCache)`` and
``(dq, dk, dv)``, so either backward takes either forward's cache; masks of every kind, both
causal alignments, zeros and lse = +inf for fully masked rows, and dropout masks equal to the
reference's element by element for one seed. float16 and bfloat16 are computed in float32 (bfloat16 from
compute capability 8.0 on: an InputTypeError below), float32 in float32, float64 in float64 (for gradient
checks); head sizes up to 128, any Tq and Tk.

``block_q`` and ``block_k`` are checked and kept in the cache (the reference's backward tiles by
them), but the kernels use their own tiles (their traits in flash.cu).

No copies for the heads: the kernels read and write (B, H, T, hs) arrays through their strides (the
last axis contiguous), so the heads of a packed (B, T, 3E) projection are read where they are, and
the output and the gradients are written as (B, T, H, hs) arrays seen as (B, H, T, hs): merging the
heads back to (B, T, E) is then a view (:func:`npformer.ops.multihead.merge_heads`).
:func:`flash_attention_backward_into` writes dq, dk, dv into arrays the caller gives (the
self-attention fast path gives the three thirds of one packed (B, T, 3E) gradient).
"""
from __future__ import annotations

import numpy

from npformer.backend import accumulation_dtype
from npformer.checks import expect_grad, expect_row_buffer
from npformer.errors import RangeError
from npformer.kernels.cuda import runtime
from npformer.kernels.cuda.flash_source import (HEAD_SIZES, MAX_HEAD_SIZE, TC_VARIANT_OF, TENSORS, WGMMA_HEAD_SIZES,
                                                geometry, layout_field, name_expression, params_dtype)
from npformer.kernels.cuda.runtime import MAX_GRID, contiguous, device_xp
from npformer.kernels.cuda.source import TYPES, dtype_name
from npformer.ops.dropout import keep_threshold, seed_draws
from npformer.ops.flash_attention import FlashAttentionCache, check_flash_arguments, flash_masks

__all__ = ["flash_attention_forward", "flash_attention_backward", "flash_attention_backward_into",
           "accepts_forward", "accepts_backward", "head_bucket", "flash_module", "heads_layout",
           "merged_heads", "tensor_cores", "tensor_core_variant", "pack_bits", "key_end", "dense", "dense_suffix",
           "use_wgmma", "wgmma_applies"]

_DEFAULT_SHARED = 48 * 1024     # dynamic shared memory a kernel may use without opting in


def flash_module(dtype, d: int, wgmma: bool = False):
    """The compiled (dtype, D) module, or its Hopper module (``wgmma``; NVRTC, once per process, on first use;
    CuPy caches the binary)."""
    key = ("flash_module", numpy.dtype(dtype), d, wgmma)
    if key not in runtime._cache:
        module = runtime.shipped_modules()[runtime.flash_module_name(dtype, d, wgmma)]
        runtime._cache[key] = runtime.compile_module(module.source, module.options, tuple(module.kernels.values()))
    return runtime._cache[key]


def _kernel(name: str, dtype, d: int):
    """Kernel ``name`` ("fwd", "bwd_dq_tc", "fwd_dense_causal", "fwd_wgmma", "bwd_pre", ...) of the (dtype, D)
    module (the Hopper module's for "_wgmma"): its instantiation (flash_source.name_expression), with the
    shared memory it needs opted in."""
    key = ("flash", name, numpy.dtype(dtype), d)
    fn = runtime._cache.get(key)
    if fn is None:
        runtime.check_capability(dtype)
        fn = flash_module(dtype, d, "_wgmma" in name).get_function(name_expression(name, dtype, d))
        shared = geometry(name, dtype, d)[2]
        if shared > _DEFAULT_SHARED:
            fn.max_dynamic_shared_size_bytes = shared                         # opt in beyond 48 KiB
        runtime._cache[key] = fn
    return fn


def tensor_core_variant(dtype) -> str:
    """Which kernels ``dtype`` runs: "tc" (float16 or bfloat16 on tensor cores: mma.sync m16n8k16, ldmatrix) or
    "tf32" (float32 on TF32 tensor cores: m16n8k8, while the TF32 opt-in is on,
    :func:`npformer.backend.set_float32_matmul_precision`), each on a GPU of compute capability 8.0 or
    later; "" for the SIMT kernels (float64, float32 without the opt-in, older GPUs)."""
    variant = TC_VARIANT_OF.get(dtype_name(dtype), "")
    if not variant or runtime.compute_capability() < 80:
        return ""
    return variant if variant == "tc" or runtime.float32_on_tf32() else ""


_WGMMA = {"on": False}


def use_wgmma(on: bool) -> None:
    """Opt in (or out) of the Hopper kernels (``npf_fa_forward_wgmma``, ``npf_fa_bwd_dq_wgmma``,
    ``npf_fa_bwd_dkdv_wgmma``: the dense kernels' tile products on wgmma, sm_90a) for float16 and bfloat16 at
    head sizes 64 and 128 on a GPU of compute capability 9.0 (H100, H200). Off by default: their tests pass
    on the CPU emulator and they compile to HGMMA, but no GPU has run them yet; the GPU check's tests run
    them, and the bench times them beside the mma.sync kernels (``flash-train``)."""
    _WGMMA["on"] = bool(on)


def wgmma_applies(q, k, v, *more) -> bool:
    """Whether the Hopper kernels take these (B, H, T, hs) arrays (q, k, v; and dout for the backward): opted in
    (:func:`use_wgmma`), float16 or bfloat16 on tensor cores, head-size bucket 64 or 128, compute
    capability 9.0, and every row in whole 16-byte chunks, as cp.async copies them (a head size and row
    stride of multiples of 8 values, 16-byte aligned); otherwise the dense kernels run."""
    if not (_WGMMA["on"] and tensor_core_variant(q.dtype) == "tc" and runtime.compute_capability() == 90):
        return False
    if head_bucket(q.shape[3], v.shape[3]) not in WGMMA_HEAD_SIZES:
        return False
    return all(a.shape[3] % 8 == 0 and a.strides[2] % 16 == 0 and runtime.address(a) % 16 == 0
               for a in (q, k, v, *more))


def tensor_cores(dtype) -> bool:
    """Whether ``dtype``'s kernels run on tensor cores (:func:`tensor_core_variant`)."""
    return bool(tensor_core_variant(dtype))


def head_bucket(hs: int, hv: int) -> int:
    """The smallest instantiated head size D >= hs and hv; RangeError beyond MAX_HEAD_SIZE."""
    for d in HEAD_SIZES:
        if max(hs, hv) <= d:
            return d
    raise RangeError(f"the CUDA flash attention kernel takes head sizes up to {MAX_HEAD_SIZE}, got hs={hs}, "
                     f"hv={hv}; the reference op (npformer.kernels.disabled()) takes any")


def pack_bits(xp, mask):
    """A bool (..., Tk) mask as uint32 words (..., ceil(Tk / 32)): key j at bit j % 32 of word j // 32
    (a kernel reads 32 keys' mask in one 4-byte load instead of a byte per score). Packed little-endian,
    bit by bit (``packbits(..., bitorder="little")``, 4 bytes a word), as GPUs and x86 store words."""
    tk = mask.shape[-1]
    words = -(-tk // 32)
    if mask.size == 0:
        return xp.zeros(mask.shape[:-1] + (words,), dtype=xp.uint32)
    rows = mask.reshape(-1, tk)
    if tk != words * 32:                                                          # rows padded to whole words
        padded = xp.zeros((rows.shape[0], words * 32), dtype=bool)
        padded[:, :tk] = rows
        rows = padded
    packed = xp.packbits(xp.ascontiguousarray(rows).reshape(-1), bitorder="little")
    return packed.view(xp.uint32).reshape(mask.shape[:-1] + (words,))


def key_end(xp, padding):
    """One past each batch's last key that a bool (B, Tk) key_padding_mask leaves visible (0 when it hides
    every key), as int32: the kernels skip the key tiles at and past it whole."""
    b, tk = padding.shape
    if tk == 0:
        return xp.zeros((b,), dtype=xp.int32)
    visible = ~padding
    last_from_end = xp.argmax(visible[:, ::-1], axis=1)                           # 0 where none is visible
    return xp.where(visible.any(axis=1), tk - last_from_end, 0).astype(xp.int32)


def _params(xp, q, k, v, masks, scale, acc, p: float, draws, bits: bool, **tensors):
    """The kernels' one argument (flash.cu's NpfFaParams, :func:`~npformer.kernels.cuda.flash_source.params_dtype`):
    a 1-element structured array filled field by field, and the arrays it points to that were made here
    (keep them until the launch is issued). ``tensors``: out, dout, dq, dk, dv, lse, dvec as the kernel
    needs them. Masks: bool as bytes, or packed to bits for the tensor-core kernels when ``bits``; float as
    the accumulation dtype, as mask_bias casts them; bool padding also as its key ends. Unused pointers
    are null."""
    params = numpy.zeros(1, dtype=params_dtype(acc))
    made = []

    def point(name, array, into=params):
        into[name] = runtime.address(array)
        made.append(array)
    for name, a in (("q", q), ("k", k), ("v", v), *tensors.items()):
        point(name, a)
        if name in TENSORS:
            params[layout_field(name)] = heads_layout(a)
    args = params["a"]
    for prefix, m in (("mask", masks.attn), ("pad", masks.padding)):
        if m is None:
            continue
        if m.dtype == bool and bits:
            packed = pack_bits(xp, m)
            point(f"{prefix}_bits", packed, args)
            args[f"{prefix}_ld"], args[f"{prefix}_kind"] = packed.shape[-1], 1
        elif m.dtype == bool:
            point(f"{prefix}_b", contiguous(xp, m), args)
            args[f"{prefix}_ld"], args[f"{prefix}_kind"] = m.shape[-1], 1
        else:
            point(f"{prefix}_f", contiguous(xp, m.astype(acc, copy=False)), args)
            args[f"{prefix}_ld"], args[f"{prefix}_kind"] = m.shape[-1], 2
    if masks.attn is not None and masks.attn.ndim > 2:
        args["mask_bh"] = masks.attn.shape[-2] * int(args["mask_ld"][0])
    if masks.padding is not None and masks.padding.dtype == bool:
        point("key_end", key_end(xp, masks.padding), args)
    if p > 0:
        point("seed_draws", contiguous(xp, draws), args)
        args["keep_min"] = keep_threshold(p)
        args["keep_scale"] = 1.0 / (1.0 - p) if p < 1 else 0.0                 # _keep's 1 / (1 - p), in A
    b, h, tq, hs = q.shape
    args["bh_count"], args["H"], args["Tq"], args["Tk"] = b * h, h, tq, k.shape[2]
    args["hs"], args["hv"], args["scale"] = hs, v.shape[3], scale
    if masks.shift is not None:
        args["causal"], args["shift"] = 1, masks.shift
    return params, made


def strided_heads(xp, a):
    """``a`` itself when its last axis is contiguous and its strides are not negative (the kernels
    take the other strides), else a contiguous copy."""
    if a.strides[-1] == a.itemsize and min(a.strides) >= 0:
        return a
    return xp.ascontiguousarray(a)


def heads_layout(a) -> tuple:
    """The (B, H, T) element strides of a (B, H, T, hs) array, as the kernels' NpfFaLayout."""
    return tuple(st // a.itemsize for st in a.strides[:3])


def merged_heads(xp, b: int, h: int, t: int, hs: int, dtype):
    """A fresh (B, T, H, hs) array seen as (B, H, T, hs): its heads merge to (B, T, E) as a view."""
    return xp.empty((b, t, h, hs), dtype=dtype).transpose(0, 2, 1, 3)            # (B, H, T, hs)


def _launch(name, dtype, d, t: int, bh: int, params) -> None:
    """Kernel ``name`` over ``t`` rows (queries; keys for dK, dV) and ``bh`` heads: a block per ROWS rows and
    head (heads past MAX_GRID by a grid-stride loop), its traits' block and shared memory."""
    threads, rows, shared = geometry(name, dtype, d)
    _kernel(name, dtype, d)((-(-t // rows), min(bh, MAX_GRID)), (threads,), (params,), shared_mem=shared)


def flash_attention_forward(q, k, v, *, attn_mask=None, key_padding_mask=None, is_causal: bool = False,
                            causal_alignment: str = "top_left", dropout_p: float = 0.0, rng=None,
                            training: bool = True, scale: float | None = None, need_weights: bool = False,
                            block_q: int = 128, block_k: int = 128):
    """Returns ``(out, FlashAttentionCache)`` as the reference op; arguments as there."""
    scale, block_q, block_k = check_flash_arguments(q, k, v, scale, dropout_p, need_weights, block_q, block_k)
    xp = device_xp(q, k, v)
    b, h, tq, hs = q.shape
    tk, hv = k.shape[2], v.shape[3]
    d = head_bucket(hs, hv)
    masks = flash_masks(b, h, tq, tk, attn_mask, key_padding_mask, is_causal, causal_alignment, xp)
    acc = accumulation_dtype(q.dtype)
    p = float(dropout_p) if training and dropout_p > 0 else 0.0
    draws = seed_draws(rng, q, xp) if p > 0 else None      # (2,) the kernels make the seed of them
    q, k, v = strided_heads(xp, q), strided_heads(xp, k), strided_heads(xp, v)
    out = merged_heads(xp, b, h, tq, hv, q.dtype)                                 # (B, H, Tq, hv) view
    lse = xp.empty((b, h, tq, 1), dtype=acc)                                      # (B, H, Tq, 1)
    if b * h and tq:
        variant = tensor_core_variant(q.dtype)
        args, _made = _params(xp, q, k, v, masks, scale, acc, p, draws, bool(variant), out=out, lse=lse)
        _launch("fwd" + _kernel_suffix(variant, masks, p, scale, q, k, v), q.dtype, d, tq, b * h, args)
    return out, FlashAttentionCache(q, k, v, out, lse, masks, p, draws, scale, block_q, block_k)


def flash_attention_backward(dout, cache: FlashAttentionCache):
    """Returns ``(dq, dk, dv)`` for ``dout`` (B, H, Tq, hv), as the reference op (any forward's cache);
    each a (B, T, H, hs) array seen as (B, H, T, hs)."""
    expect_grad(dout, "dout", cache.out.shape, cache.out.dtype)
    xp = device_xp(dout, cache.q, cache.k, cache.v, cache.out)
    b, h, tq, hs = cache.q.shape
    tk, hv = cache.k.shape[2], cache.v.shape[3]
    dq = merged_heads(xp, b, h, tq, hs, cache.q.dtype)                           # (B, H, Tq, hs)
    dk = merged_heads(xp, b, h, tk, hs, cache.k.dtype)                           # (B, H, Tk, hs)
    dv = merged_heads(xp, b, h, tk, hv, cache.v.dtype)                           # (B, H, Tk, hv)
    flash_attention_backward_into(dout, cache, dq, dk, dv)
    return dq, dk, dv


def flash_attention_backward_into(dout, cache: FlashAttentionCache, dq, dk, dv) -> None:
    """The backward of :func:`flash_attention_backward`, writing into ``dq``, ``dk``, ``dv``: arrays
    of q's, k's and v's shapes and dtype whose last axis is contiguous (views of a larger array
    included: every element is written)."""
    q, k, v, out, lse, masks, p, draws, scale, _, _ = cache
    expect_grad(dout, "dout", out.shape, out.dtype)
    xp = device_xp(dout, q, k, v, out, dq, dk, dv)
    for name, g, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        expect_row_buffer(g, name, like)
    b, h, tq, hs = q.shape
    tk, hv = k.shape[2], v.shape[3]
    d = head_bucket(hs, hv)
    acc = accumulation_dtype(q.dtype)
    q, k, v, out, dout = (strided_heads(xp, a) for a in (q, k, v, out, dout))
    lse = contiguous(xp, lse.astype(acc, copy=False))
    if not b * h:
        return
    dvec = xp.empty((b, h, tq), dtype=acc)                                        # (B, H, Tq) D = rowsum(dO * O)
    variant = tensor_core_variant(q.dtype)
    args, _made = _params(xp, q, k, v, masks, scale, acc, p, draws, bool(variant), out=out, dout=dout, dq=dq, dk=dk,
                          dv=dv, lse=lse, dvec=dvec)
    rows = b * h * tq
    if rows:                                                                      # bwd_pre: a warp per row
        threads, rows_a_block, _ = geometry("bwd_pre", q.dtype, d)
        _kernel("bwd_pre", q.dtype, d)((max(1, min(-(-rows // rows_a_block), MAX_GRID)),), (threads,), (args,))
    suffix = _kernel_suffix(variant, masks, p, scale, q, k, v, dout)
    _launch("bwd_dkdv" + suffix, q.dtype, d, tk, b * h, args)
    if tq:
        _launch("bwd_dq" + suffix, q.dtype, d, tq, b * h, args)


def _causal(masks) -> str:
    return "_causal" if masks.shift is not None else ""


def dense(masks, p: float, scale: float) -> bool:
    """Whether the dense kernels run: no attention mask, no key padding, no dropout, a positive scale; causal or
    not, any lengths (:func:`dense_suffix` says which). They fold the scale into exp2 after a row's maximum of
    the unscaled scores, which is the maximum of the scaled ones only for scale > 0 (a scale of 0 or below
    runs the general kernels, which scale each score first)."""
    return masks.attn is None and masks.padding is None and p == 0 and scale > 0


def dense_suffix(variant: str, masks, p: float, scale: float, q, k, v, *more) -> str:
    """The suffix of the dense kernels that take these arrays (``variant``: :func:`tensor_core_variant` of their
    dtype; ``more``: dout for the backward), "_causal" added where causal: "_wgmma" where
    :func:`wgmma_applies`, else "_dense" for float16 and bfloat16 on tensor cores and for float32 in SIMT
    arithmetic (without the TF32 opt-in, compute capability 8.0 or later: their copies are cp.async); "" where
    the general kernels run (masks, padding or dropout; a scale of 0 or below; float64; float32 under TF32;
    older GPUs)."""
    if not dense(masks, p, scale):
        return ""
    if variant == "tc":
        return ("_wgmma" if wgmma_applies(q, k, v, *more) else "_dense") + _causal(masks)
    if not variant and dtype_name(q.dtype) == "float32" and runtime.compute_capability() >= 80:
        return "_dense" + _causal(masks)
    return ""


def _kernel_suffix(variant: str, masks, p: float, scale: float, q, k, v, *more) -> str:
    """The suffix of the kernels that take these arrays: the dense kernels' where they apply
    (:func:`dense_suffix`), else the general kernels' of ``variant`` ("_tc", "_tf32"; "" for SIMT)."""
    return dense_suffix(variant, masks, p, scale, q, k, v, *more) or (f"_{variant}" if variant else "")


def _device_masks(*masks) -> bool:
    return all(m is None or (runtime.is_device_array(m) and (m.dtype == bool or m.dtype.name in TYPES)) for m in masks)


def accepts_forward(q, k, v, *, attn_mask=None, key_padding_mask=None, **options) -> bool:
    """CuPy arrays of one dtype among float16/bfloat16/float32/float64, 4-d, head sizes <= 128, masks on the device (bool
    or float); anything else goes to the reference, which also gives the messages for bad input."""
    return (runtime.device_floats(q, k, v) and q.ndim == k.ndim == v.ndim == 4
            and q.shape[-1] <= MAX_HEAD_SIZE and v.shape[-1] <= MAX_HEAD_SIZE
            and _device_masks(attn_mask, key_padding_mask))


def accepts_backward(dout, cache) -> bool:
    """As :func:`accepts_forward`, for a flash cache (of either forward) and its upstream gradient."""
    if not isinstance(cache, FlashAttentionCache):
        return False
    return (accepts_forward(cache.q, cache.k, cache.v, attn_mask=cache.masks.attn,
                            key_padding_mask=cache.masks.padding)
            and runtime.device_floats(dout, cache.out, dtype=cache.q.dtype)
            and runtime.is_device_array(cache.lse)
            and (cache.seed_draws is None or runtime.is_device_array(cache.seed_draws)))
