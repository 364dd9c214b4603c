"""In-kernel building blocks shared by the paged attention kernels.

A kernel program owns one batch row r, one kv head and a tile of BM "rows",
where a row is one (query token, query head of this kv head's group) pair:
flattened row i is token i // G, head kvh * G + i % G. Packing the G heads of
a group together is what lets one K/V block feed a [BM, HD] x [HD, BK] matmul
(GQA) instead of G matrix-vector products, and makes decode (Q=1), the
speculative window (Q=1+k) and prefill tiles the same code.

All gathers index the full refs directly (no masks needed on loads): indices
are clamped into bounds and the softmax mask drops whatever the clamp read.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ._compat import masked_store
from .reference import MASK_VALUE


def row_map(row0, block_rows: int, group: int, num_q: int, kvh):
    """Token index, query head and validity of the rows [row0, row0 + BM)."""
    rows = row0 + lax.iota(jnp.int32, block_rows)  # [BM]
    tok_raw = lax.div(rows, jnp.int32(group))  # [BM]
    valid = tok_raw < num_q  # [BM]; padding rows past the last token
    tok = jnp.minimum(tok_raw, num_q - 1)  # [BM] clamped so loads stay in bounds
    head = kvh * group + lax.rem(rows, jnp.int32(group))  # [BM]
    return tok, head, valid


def attend_blocks(q, qpos, *, k_ref, v_ref, req_ref, layer, entry, kvh, kv_len,
                  blk_lo, blk_hi, block_k: int, scale: float):
    """Online-softmax attention of q over KV blocks [blk_lo, blk_hi).

    Args:
      q: [BM, HD] query rows in the matmuls' dtype (`reference.compute_dtype`): the
        cache's, or the model's where the cache is 8-bit and its blocks are cast up.
      qpos: [BM] int32 absolute position of each row's token.
      kv_len: scalar, number of valid cache positions (already <= ctx_len).
    Returns:
      (acc [BM, HD] f32 unnormalised, m [BM] running max, l [BM] running sum);
      rows that saw no key keep acc = 0, l = 0, m = MASK_VALUE.
    """
    block_rows, head_dim = q.shape
    max_pos = req_ref.shape[1] - 1
    last = jnp.clip(kv_len - 1, 0, max_pos)  # clamp target for padding columns

    def body(b, carry):
        acc, m_i, l_i = carry
        cpos = b * block_k + lax.iota(jnp.int32, block_k)  # [BK] cache positions
        # Slot of every position read from the request's req_to_token row (4
        # bytes per token next to the 2 * KVH * HD * 2 of K/V it addresses, and
        # no page size needed in the signature); positions past kv_len are
        # clamped onto written slots and masked below, so stale or dummy-page
        # slots are never read.
        slots = req_ref[entry, jnp.minimum(cpos, last)]  # [BK]
        k = k_ref[layer, slots, kvh, :].astype(q.dtype)  # [BK, HD]
        v = v_ref[layer, slots, kvh, :].astype(q.dtype)  # [BK, HD]
        # [BM, HD] x [BK, HD] -> [BM, BK], contracting HD
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
        s = s * scale
        visible = (cpos[None, :] <= qpos[:, None]) & (cpos[None, :] < kv_len)  # [BM, BK]
        s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))  # [BM]
        alpha = jnp.exp(m_i - m_new)  # [BM] rescale of what was accumulated
        # where() rather than relying on exp(MASK - m): a row with no visible
        # key yet has m_new == MASK and would otherwise get weight 1.
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)  # [BM, BK]
        l_new = alpha * l_i + jnp.sum(p, axis=1)  # [BM]
        # [BM, BK] x [BK, HD] -> [BM, HD]
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, l_new

    init = (
        jnp.zeros((block_rows, head_dim), jnp.float32),
        jnp.full((block_rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((block_rows,), jnp.float32),
    )
    return lax.fori_loop(blk_lo, blk_hi, body, init)


def visible_blocks(qpos, kv_len, block_k: int):
    """Number of KV blocks any row of the tile can see (causal upper bound)."""
    nvis = jnp.clip(jnp.max(qpos) + 1, 0, kv_len)
    return lax.div(nvis + (block_k - 1), jnp.int32(block_k))


def normalize(acc, l):
    """acc / l per row; rows with l == 0 (nothing visible) become exactly 0."""
    inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)  # [BM]
    return acc * inv[:, None]  # [BM, HD]


def _drop_index(tok, valid, num_q: int):
    """Send masked-off rows to token index num_q (one past the end).

    Padding rows were clamped onto a real row's token; interpret mode
    discharges a masked store as a scatter that writes the old value back
    under the mask, and such a duplicate index would race with the real
    row's write. Out of bounds, the scatter drops it; on GPU the predicated
    store never touches the address.
    """
    return jnp.where(valid, tok, num_q)  # [BM]


def store_rows(ref, lead, tok, head, value, valid):
    """ref[*lead, tok[i], head[i], :] = value[i] for the valid rows i.

    Every index is a full [BM, HD] integer array: interpret mode can only
    scatter when no index is a slice, and on GPU the iota on the last axis
    still gives contiguous, vectorised stores.
    """
    block_rows, head_dim = value.shape
    shape = (block_rows, head_dim)
    tok = _drop_index(tok, valid, ref.shape[len(lead)])
    tok2 = jnp.broadcast_to(tok[:, None], shape)  # [BM, HD]
    head2 = jnp.broadcast_to(head[:, None], shape)  # [BM, HD]
    dim2 = jnp.broadcast_to(lax.iota(jnp.int32, head_dim)[None, :], shape)  # [BM, HD]
    mask2 = jnp.broadcast_to(valid[:, None], shape)  # [BM, HD]
    masked_store(ref.at[(*lead, tok2, head2, dim2)], value.astype(ref.dtype), mask2)


def store_row_stats(ref, lead, tok, head, value, valid):
    """ref[*lead, tok[i], head[i]] = value[i] for the valid rows i."""
    tok = _drop_index(tok, valid, ref.shape[len(lead)])
    masked_store(ref.at[(*lead, tok, head)], value.astype(ref.dtype), valid)


def check_shapes(q, k_cache, v_cache):
    """Shape rules of the Pallas path (Triton tensors must be powers of two)."""
    _, _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k/v cache shapes differ: {k_cache.shape} vs {v_cache.shape}")
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: q {head_dim}, cache {k_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} not a multiple of {num_kv_heads=}")
    if not head_dim_fits(head_dim):
        raise NotImplementedError(f"Pallas path needs a power-of-two head_dim >= 16, got {head_dim}")
    return num_heads // num_kv_heads


def head_dim_fits(head_dim: int) -> bool:
    """Whether the kernels' tiles take this head_dim: a power of two of at least 16."""
    return head_dim >= 16 and not head_dim & (head_dim - 1)


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


__all__ = [
    "row_map", "attend_blocks", "visible_blocks", "normalize", "store_rows",
    "store_row_stats", "check_shapes", "head_dim_fits", "next_pow2",
]
