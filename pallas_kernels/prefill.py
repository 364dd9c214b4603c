"""Ragged chunked-prefill (extend) attention over a paged cache.

Grid (R, KVH, T): program (r, kvh, t) takes rows [t*BM, (t+1)*BM) of the
row-major (query token, group head) list of batch row r and kv head kvh, and
streams KV blocks from position 0 up to the last position any of its rows
can see (causal: the new tokens see the cached prefix plus the chunk up to
themselves; the engine has already scattered the chunk's K/V into the cache).
Each row's chunk may be shorter than Q (ragged batch): padded queries are
computed like any other and ignored by the caller, and a tile's loop bound
comes from its own positions, so early tiles skip the later blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _tile
from ._compat import triton_params
from .reference import compute_dtype


def _kernel(layer_ref, req_ref, entries_ref, qpos_ref, kvlen_ref, q_ref, k_ref, v_ref,
            o_ref, *, group, block_rows, block_k, scale, ctx_len):
    r = pl.program_id(0)
    kvh = pl.program_id(1)
    tile = pl.program_id(2)
    num_q = q_ref.shape[1]
    layer = layer_ref[0]
    entry = entries_ref[r]
    kv_len = jnp.clip(kvlen_ref[r], 0, ctx_len)

    tok, head, valid = _tile.row_map(tile * block_rows, block_rows, group, num_q, kvh)
    q = q_ref[r, tok, head, :].astype(compute_dtype(q_ref.dtype, k_ref.dtype))  # [BM, HD]
    qpos = qpos_ref[r, tok]  # [BM]
    nblk = _tile.visible_blocks(qpos, kv_len, block_k)
    acc, _, l = _tile.attend_blocks(
        q, qpos, k_ref=k_ref, v_ref=v_ref, req_ref=req_ref, layer=layer,
        entry=entry, kvh=kvh, kv_len=kv_len, blk_lo=0, blk_hi=nblk,
        block_k=block_k, scale=scale)
    _tile.store_rows(o_ref, (r,), tok, head, _tile.normalize(acc, l), valid)


@functools.partial(jax.jit, static_argnames=(
    "scale", "ctx_len", "interpret", "block_rows", "block_k", "num_warps", "num_stages"))
def paged_prefill_attention(q, k_cache, v_cache, layer, req_to_token, entries,
                            q_positions, kv_lens, *, scale: float, ctx_len: int,
                            interpret: bool = False, block_rows: int = 128,
                            block_k: int = 64, num_warps: int = 4, num_stages: int = 2):
    """Pallas paged attention for long Q; same contract as
    `reference.paged_attention_ref` (q [R, Q, H, HD] -> [R, Q, H, HD])."""
    R, Q, H, HD = q.shape
    KVH = k_cache.shape[2]
    group = _tile.check_shapes(q, k_cache, v_cache)
    rows = Q * group
    block_rows = max(16, min(block_rows, _tile.next_pow2(rows)))  # tensor-core M >= 16
    block_k = min(block_k, max(16, _tile.next_pow2(ctx_len)))
    num_tiles = -(-rows // block_rows)
    kernel = functools.partial(
        _kernel, group=group, block_rows=block_rows, block_k=block_k,
        scale=scale, ctx_len=ctx_len)
    return pl.pallas_call(
        kernel,
        grid=(R, KVH, num_tiles),
        out_shape=jax.ShapeDtypeStruct((R, Q, H, HD), q.dtype),
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"paged_prefill_bm{block_rows}_bk{block_k}",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),  # [1]
        req_to_token.astype(jnp.int32),
        entries.astype(jnp.int32),
        q_positions.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        q, k_cache, v_cache,
    )
