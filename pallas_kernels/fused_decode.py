"""One kernel for a decode layer's attention: q/k norm, RoPE, the KV-cache write and
split-K paged attention of the new token.

Why: at batch 1 the decode step is a chain of ~20 kernels per layer, and the small ones
(the q/k norms, RoPE, two cache scatters, attention) each cost a few microseconds of
launch and tail on the GPU however little they compute. This kernel takes the fused qkv
projection as it leaves the matmul and does all of that in one program per (row, kv head,
split); the unfused path (models/transformer.py) stays the reference.

Grid (R, KVH, S), as in decode.py. Program (r, kvh, s):
- loads the G query heads of kv head kvh and that head's new k and v from qkv, applies
  the per-head RMS norms (Qwen3) and rotate-half RoPE at the row's position;
- split 0 stores the rotated k and v into the cache slot reserved for the token (the
  caches are aliased in and out, so the write is in place);
- attends over the row's cached positions [0, pos) in its share of the KV blocks; split 0
  also folds in the new token itself, from registers, so no program ever reads the slot
  that is being written in the same launch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from . import _tile
from ._compat import masked_store, triton_params
from .decode import MAX_ROWS, choose_splits, merge_splits, split_out_shapes, split_range, store_split
from .reference import to_cache_dtype


def _rms(x32, eps, head_dim):
    """1 / rms over the last axis of a float32 tile (per head)."""
    return lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) / head_dim + eps)


def _norm_rope(x, x_partner, w, w_partner, cos, sin, sign, *, eps, has_norm, dtype):
    """RMS norm (optional) then rotate-half RoPE, rounding where the XLA path rounds.

    x / x_partner: [..., HD] the head vector and the same vector with its halves swapped
    (element d holds x[(d + HD/2) % HD]), so rotate-half needs no slicing in the kernel:
    out[d] = x[d] cos[d] + sign[d] x_partner[d] sin[d], sign = -1 on the first half."""
    head_dim = x.shape[-1]
    x32, xp32 = x.astype(jnp.float32), x_partner.astype(jnp.float32)
    if has_norm:
        inv = _rms(x32, eps, head_dim)  # the partner has the same elements, so the same rms
        x32 = (w * (x32 * inv).astype(dtype)).astype(jnp.float32)
        xp32 = (w_partner * (xp32 * inv).astype(dtype)).astype(jnp.float32)
    return (x32 * cos + sign * xp32 * sin).astype(dtype)


def _kernel(layer_ref, req_ref, entries_ref, pos_ref, kvlen_ref, slot_ref, qkv_ref, qnorm_ref, knorm_ref,
            freq_ref, kv_scale_ref, k_ref, v_ref, *out_refs, num_heads, group, block_rows, block_k, num_splits,
            scale, ctx_len, eps, has_norm, has_scales):
    r = pl.program_id(0)
    kvh = pl.program_id(1)
    split = pl.program_id(2)
    head_dim = k_ref.shape[3]
    num_kv_heads = k_ref.shape[2]
    half = head_dim // 2
    dtype = qkv_ref.dtype
    layer = layer_ref[0]
    entry = entries_ref[r]
    pos = pos_ref[r]
    kv_len = jnp.clip(kvlen_ref[r], 0, ctx_len)

    d = lax.iota(jnp.int32, head_dim)  # [HD]
    partner = jnp.where(d < half, d + half, d - half)  # [HD]
    sign = jnp.where(d < half, -1.0, 1.0).astype(jnp.float32)  # [HD]
    angle = pos.astype(jnp.float32) * freq_ref[:]  # [HD]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    nl = layer if has_norm else 0  # stacked [L, HD] norm weights, or one row of ones
    qn, qn_p = qnorm_ref[nl, :], qnorm_ref[nl, partner]  # [HD]
    kn, kn_p = knorm_ref[nl, :], knorm_ref[nl, partner]
    nr = functools.partial(_norm_rope, cos=cos, sin=sin, sign=sign, eps=eps, has_norm=has_norm, dtype=dtype)

    # The G query heads of this kv head, padded to block_rows rows (tensor-core M >= 16).
    tok, head, valid = _tile.row_map(0, block_rows, group, 1, kvh)  # tok == 0 everywhere
    head2 = jnp.broadcast_to(head[:, None], (block_rows, head_dim))  # [BM, HD]
    partner2 = jnp.broadcast_to(partner[None, :], (block_rows, head_dim))  # [BM, HD]
    # The layer's cache scales, where the cache has them: it holds k / k_scale and
    # v / v_scale, so q is multiplied by k_scale here and the output by v_scale (the wrapper).
    k_scale = kv_scale_ref[layer, 0] if has_scales else None
    v_scale = kv_scale_ref[layer, 1] if has_scales else None
    q = nr(qkv_ref[r, head, :], qkv_ref[r, head2, partner2], qn, qn_p)  # [BM, HD]
    if has_scales:
        q = (q.astype(jnp.float32) * k_scale).astype(dtype)
    k_head = num_heads + kvh
    # Rounded to the cache's dtype (saturating into an 8-bit one) before use, so that the new
    # token's own term below sees what the cache holds, as the unfused path does.
    k_new = to_cache_dtype(nr(qkv_ref[r, k_head, :], qkv_ref[r, k_head, partner], kn, kn_p), k_ref.dtype,
                           k_scale)  # [HD]
    v_new = to_cache_dtype(qkv_ref[r, k_head + num_kv_heads, :], v_ref.dtype, v_scale)  # [HD]

    # Split 0 writes the token's k and v; the other splits store nothing (mask off).
    k_out_ref, v_out_ref = out_refs[-2:]
    slot = slot_ref[r]
    mine = (d >= 0) & (split == 0)  # [HD]
    masked_store(k_out_ref.at[layer, slot, kvh, d], k_new, mine)
    masked_store(v_out_ref.at[layer, slot, kvh, d], v_new, mine)

    # The cached positions [0, pos) this split covers, from the cache as decode.py does.
    cached = jnp.clip(jnp.minimum(pos, kv_len), 0, ctx_len)
    lo, hi = split_range(lax.div(cached + (block_k - 1), jnp.int32(block_k)), split, num_splits)
    qpos = jnp.full((block_rows,), pos, jnp.int32)
    acc, m, l = _tile.attend_blocks(
        q, qpos, k_ref=k_ref, v_ref=v_ref, req_ref=req_ref, layer=layer, entry=entry, kvh=kvh,
        kv_len=cached, blk_lo=lo, blk_hi=hi, block_k=block_k, scale=scale)

    # The new token itself, once (split 0), if the row sees it (padded rows have kv_len 0).
    sees_new = (pos < kv_len) & (split == 0)
    s_new = jnp.sum(q.astype(jnp.float32) * k_new.astype(jnp.float32)[None, :], axis=1) * scale  # [BM]
    m_new = jnp.where(sees_new, jnp.maximum(m, s_new), m)
    alpha = jnp.exp(m - m_new)
    p_new = jnp.where(sees_new, jnp.exp(s_new - m_new), 0.0)  # [BM]
    l = alpha * l + p_new
    acc = acc * alpha[:, None] + p_new[:, None] * v_new.astype(jnp.float32)[None, :]
    m = m_new

    store_split(out_refs, r, split, num_splits, tok, head, acc, m, l, valid)


def rope_frequencies(inv_freq: np.ndarray) -> np.ndarray:
    """[HD/2] inverse frequencies -> [HD] float32, the half repeated: element d rotates at
    inv_freq[d % (HD/2)], as rotate-half RoPE pairs d with d + HD/2."""
    inv_freq = np.asarray(inv_freq, np.float32)
    return np.concatenate([inv_freq, inv_freq])


@functools.partial(jax.jit, static_argnames=(
    "num_heads", "num_kv_heads", "eps", "scale", "ctx_len", "interpret", "block_k", "num_splits", "num_warps",
    "num_stages"), donate_argnames=("k_cache", "v_cache"))
def fused_decode_attention(qkv, k_cache, v_cache, layer, req_to_token, entries, positions, kv_lens, slots,
                           q_norm, k_norm, rope_freq, kv_scales=None, *, num_heads: int, num_kv_heads: int, eps: float,
                           scale: float, ctx_len: int, interpret: bool = False, block_k: int = 128,
                           num_splits: int | None = None, num_warps: int | None = None, num_stages: int = 2):
    """Decode attention of one new token per row, with its norm, RoPE and cache write.

    Args:
      qkv: [R, (H + 2 KVH) * HD] the fused projection (bias added), one shard's [q | k | v].
      k_cache, v_cache: [L, S, KVH, HD], donated; returned with the token written at
        layer `layer`, slot `slots[r]`, for every row (padded rows write the dummy slot 0).
      positions: [R] each row's token position; kv_lens: [R] its visible length including
        the token (0 on padded rows); slots: [R] where its k/v go.
      q_norm, k_norm: [L, HD] per-head RMS norm weights of every layer, or None (Llama,
        Qwen2). Stacked, indexed in the kernel: a per-layer slice outside would be a kernel.
      rope_freq: [HD] float32 from `rope_frequencies`.
      kv_scales: [L, 2] float32, an 8-bit cache's K and V scale per layer, or None (1).
    Returns (o [R, H, HD], k_cache, v_cache); o matches the unfused path's attention output.
    """
    R = qkv.shape[0]
    HD = k_cache.shape[3]
    H, KVH = num_heads, num_kv_heads
    if qkv.shape[1] != (H + 2 * KVH) * HD or k_cache.shape[2] != KVH:
        raise ValueError(f"qkv {qkv.shape} / cache {k_cache.shape} do not match H={H}, KVH={KVH}, HD={HD}")
    group = _tile.check_shapes(jax.ShapeDtypeStruct((1, 1, H, HD), qkv.dtype), k_cache, v_cache)  # reads shapes
    if group > MAX_ROWS:
        raise ValueError(f"G = {group} > {MAX_ROWS}")
    block_rows = max(16, _tile.next_pow2(group))
    block_k = min(block_k, max(16, _tile.next_pow2(ctx_len)))
    if num_splits is None:
        num_splits = choose_splits(R, KVH, ctx_len, block_k)
    if num_warps is None:
        num_warps = 4 if block_rows <= 32 else 8
    has_norm = q_norm is not None
    if not has_norm:
        q_norm = k_norm = jnp.ones((1, HD), qkv.dtype)
    has_scales = kv_scales is not None
    # [L, 2]; without scales a placeholder the kernel does not read.
    kv_scales = jnp.asarray(kv_scales, jnp.float32) if has_scales else jnp.ones((1, 2), jnp.float32)

    attn_shapes = split_out_shapes(num_splits, R, 1, H, HD, qkv.dtype)
    cache_shapes = [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                    jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
    kernel = functools.partial(
        _kernel, num_heads=H, group=group, block_rows=block_rows, block_k=block_k, num_splits=num_splits,
        scale=scale, ctx_len=ctx_len, eps=eps, has_norm=has_norm, has_scales=has_scales)
    n_attn = len(attn_shapes)
    outs = pl.pallas_call(
        kernel,
        grid=(R, KVH, num_splits),
        out_shape=attn_shapes + cache_shapes,
        # Inputs 11 and 12 are the caches: written in place, read only at other slots.
        input_output_aliases={11: n_attn, 12: n_attn + 1},
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"fused_decode_bm{block_rows}_bk{block_k}_s{num_splits}",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),  # [1]
        req_to_token.astype(jnp.int32),
        entries.astype(jnp.int32),
        positions.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        slots.astype(jnp.int32),
        qkv.reshape(R, H + 2 * KVH, HD),  # [R, (H+2KVH)*HD] -> [R, H+2KVH, HD]: head-major, free
        q_norm.astype(qkv.dtype), k_norm.astype(qkv.dtype),
        jnp.asarray(rope_freq, jnp.float32),
        kv_scales,
        k_cache, v_cache,
    )
    k_cache, v_cache = outs[n_attn:]
    o = merge_splits(outs[:n_attn], num_splits, qkv.dtype)
    if has_scales:  # the cache holds v / v_scale: the weighted sum comes out v_scale too small
        o = (o.astype(jnp.float32) * kv_scales[layer, 1]).astype(qkv.dtype)
    return o.reshape(R, H, HD), k_cache, v_cache  # [R, 1, H, HD] -> [R, H, HD]
