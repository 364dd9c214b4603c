"""Plain-XLA paged attention: the semantic reference and the CPU production path.

One function covers decode (Q=1), the speculative window (Q=1+k) and chunked
prefill (Q=chunk). The Pallas kernels in this package are tested against it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Finite stand-in for -inf: exp(MASK - m) underflows to 0 for any real logit m,
# and a fully masked row never produces inf - inf = NaN.
MASK_VALUE = -1e30


# -- what the cache holds ------------------------------------------------------------------
# The cache is in the model's dtype, or in an 8-bit float (EngineConfig.kv_cache_dtype): K/V
# are stored rounded to it, and read back converted to the queries' dtype before any
# product, so every attention path computes with the same rounded values. An 8-bit cache
# may have a scale per layer for K and one for V (a checkpoint's calibrated `k_scale` /
# `v_scale`; models/transformer.forward): it then holds K / k_scale, and attention takes
# q * k_scale and multiplies its output by v_scale, which is attention over the dequantized
# K/V without touching the cache inside the kernels.


def is_8bit(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 1


def to_cache_dtype(x: jax.Array, dtype, scale=None) -> jax.Array:
    """x (divided by `scale` where given, in float32) rounded to the cache's dtype. Into an
    8-bit float, values past its largest finite one saturate (e4m3fn has no infinity: a
    plain convert would turn them into NaN)."""
    if scale is not None:
        x = x.astype(jnp.float32) / scale
    if is_8bit(dtype):
        big = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -big, big)
    return x.astype(dtype)


def compute_dtype(q_dtype, cache_dtype):
    """The dtype of attention's matmul operands: the cache's (so the queries are cast to it,
    as always), or the queries' when the cache is 8-bit (the K/V blocks are cast up)."""
    return jnp.dtype(q_dtype) if is_8bit(cache_dtype) else jnp.dtype(cache_dtype)


@functools.partial(jax.jit, static_argnames=("scale", "ctx_len"))
def paged_attention_ref(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    req_to_token: jax.Array,
    entries: jax.Array,
    q_positions: jax.Array,
    kv_lens: jax.Array,
    *,
    scale: float,
    ctx_len: int,
) -> jax.Array:
    """Attention of paged-cache queries over their request's cached tokens.

    Args:
      q: [R, Q, H, HD] queries.
      k_cache, v_cache: [L, num_slots, KVH, HD] full stacked caches.
      layer: scalar layer index into the caches.
      req_to_token: [max_running + 1, max_context] int32 slot of each position.
      entries: [R] int32 req_to_token row of each batch row (0 = padding).
      q_positions: [R, Q] int32 absolute position of each query token.
      kv_lens: [R] int32 number of valid cache positions of each row.
      scale: softmax scale applied to q.k.
      ctx_len: static upper bound on kv_lens (the gather width).

    Returns:
      [R, Q, H, HD] in q.dtype. Query (r, j) sees cache positions c with
      c <= q_positions[r, j] and c < kv_lens[r]; rows that see nothing are 0.
    """
    R, Q, H, HD = q.shape
    KVH = k_cache.shape[2]
    G = H // KVH
    # Gather the slot of every position straight from the full table and the
    # K/V rows straight from the stacked caches (indexing k_cache[layer] first
    # would materialise a copy of the whole layer).
    slots = req_to_token[entries, :ctx_len]  # [R, C]
    k = k_cache[layer, slots]  # [R, C, KVH, HD]
    v = v_cache[layer, slots]  # [R, C, KVH, HD]
    if is_8bit(k.dtype):  # an FP8 cache: the einsums compute in the queries' dtype
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    cpos = jnp.arange(ctx_len, dtype=jnp.int32)
    # Columns past kv_len point at the dummy page or stale slots; zero their V
    # so garbage there (even NaN) cannot leak through 0 * NaN in the einsum.
    in_len = cpos[None, :] < kv_lens[:, None]  # [R, C]
    v = jnp.where(in_len[:, :, None, None], v, jnp.zeros((), v.dtype))

    qg = q.reshape(R, Q, KVH, G, HD)  # [R, Q, H, HD] -> [R, Q, KVH, G, HD]
    # [R, Q, KVH, G, HD] x [R, C, KVH, HD] -> [R, KVH, G, Q, C]
    logits = jnp.einsum(
        "rqkgd,rckd->rkgqc", qg, k, preferred_element_type=jnp.float32
    )
    logits = logits * scale

    visible = (cpos[None, None, :] <= q_positions[:, :, None]) & in_len[:, None, :]  # [R, Q, C]
    visible = visible[:, None, None, :, :]  # [R, 1, 1, Q, C]
    logits = jnp.where(visible, logits, MASK_VALUE)
    m = jnp.max(logits, axis=-1, keepdims=True)  # [R, KVH, G, Q, 1]
    # The where (not just the mask value) keeps fully masked rows at p == 0.
    p = jnp.where(visible, jnp.exp(logits - m), 0.0)  # [R, KVH, G, Q, C]
    denom = jnp.sum(p, axis=-1, keepdims=True)  # [R, KVH, G, Q, 1]
    p = p / jnp.where(denom > 0, denom, 1.0)  # empty rows stay 0, not 0/0

    # [R, KVH, G, Q, C] x [R, C, KVH, HD] -> [R, Q, KVH, G, HD]
    out = jnp.einsum(
        "rkgqc,rckd->rqkgd", p, v.astype(jnp.float32),
        preferred_element_type=jnp.float32,
    )
    return out.reshape(R, Q, H, HD).astype(q.dtype)  # -> [R, Q, H, HD]
