"""Split-K paged attention for few queries per row: decode and speculative verify.

Grid (R, KVH, S): program (r, kvh, s) takes every query row of batch row r
that reads kv head kvh (the Q * G (token, head) pairs, padded to a power of
two >= 16 for the tensor-core matmul) and the s-th of S equal shares of the
row's visible KV blocks. Decode is memory bound, so the split exists only to
give the GPU enough programs to saturate HBM when R * KVH is small; with
S == 1 the kernel normalises and writes the output directly, otherwise it
writes partial (acc, max, sum) states that `combine_splits` merges.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import _tile
from ._compat import triton_params
from .combine import combine_splits
from .reference import compute_dtype

# Rows (Q * G) one program holds: a window of 8 tokens at G = 8. Beyond this
# the f32 [rows, HD] accumulator plus [rows, BK] scores crowd the registers and
# the prefill kernel's row tiling is the better fit.
MAX_ROWS = 64
# Programs to aim for when choosing S: about two per SM of an H200 (132 SMs).
# Measured there (bf16, KVH 8, block_k 128): batch 32 x 2k context is fastest
# unsplit (256 programs), batch 8 x 32k with S=4, batch 1 x 8k with S=32;
# splitting past ~2 programs per SM only adds partial-result traffic.
TARGET_PROGRAMS = 264


def choose_splits(batch: int, num_kv_heads: int, ctx_len: int, block_k: int,
                  min_blocks_per_split: int = 2) -> int:
    """Static split count: enough programs to fill the GPU, never tiny splits."""
    programs = batch * num_kv_heads
    want = TARGET_PROGRAMS // programs
    most = -(-ctx_len // (block_k * min_blocks_per_split))
    return max(1, min(want, most))


def _kernel(layer_ref, req_ref, entries_ref, qpos_ref, kvlen_ref, q_ref, k_ref, v_ref,
            *out_refs, group, block_rows, block_k, num_splits, scale, ctx_len):
    r = pl.program_id(0)
    kvh = pl.program_id(1)
    split = pl.program_id(2)
    num_q = q_ref.shape[1]
    layer = layer_ref[0]
    entry = entries_ref[r]
    kv_len = jnp.clip(kvlen_ref[r], 0, ctx_len)

    tok, head, valid = _tile.row_map(0, block_rows, group, num_q, kvh)
    q = q_ref[r, tok, head, :].astype(compute_dtype(q_ref.dtype, k_ref.dtype))  # [BM, HD]
    qpos = qpos_ref[r, tok]  # [BM]

    # Split the row's *visible* blocks (not ctx_len) so that short rows in a
    # long-ctx_len batch still spread their work over all S programs.
    lo, hi = split_range(_tile.visible_blocks(qpos, kv_len, block_k), split, num_splits)
    acc, m, l = _tile.attend_blocks(
        q, qpos, k_ref=k_ref, v_ref=v_ref, req_ref=req_ref, layer=layer,
        entry=entry, kvh=kvh, kv_len=kv_len, blk_lo=lo, blk_hi=hi,
        block_k=block_k, scale=scale)
    store_split(out_refs, r, split, num_splits, tok, head, acc, m, l, valid)


# -- split-K plumbing shared with fused_decode.py ------------------------------------------


def split_range(nblk, split, num_splits: int):
    """Blocks [lo, hi) of split `split` when nblk blocks are shared out over num_splits."""
    per_split = lax.div(nblk + (num_splits - 1), jnp.int32(num_splits))
    lo = split * per_split
    return lo, jnp.minimum(lo + per_split, nblk)


def split_out_shapes(num_splits: int, R: int, Q: int, H: int, HD: int, dtype) -> list:
    """The output [R, Q, H, HD] itself (one split), or every split's partial state."""
    if num_splits == 1:
        return [jax.ShapeDtypeStruct((R, Q, H, HD), dtype)]
    return [
        jax.ShapeDtypeStruct((num_splits, R, Q, H, HD), jnp.float32),  # acc
        jax.ShapeDtypeStruct((num_splits, R, Q, H), jnp.float32),  # max
        jax.ShapeDtypeStruct((num_splits, R, Q, H), jnp.float32),  # sum
    ]


def store_split(out_refs, r, split, num_splits: int, tok, head, acc, m, l, valid) -> None:
    """Write a program's result into the outputs of `split_out_shapes` (the first ones)."""
    if num_splits == 1:
        _tile.store_rows(out_refs[0], (r,), tok, head, _tile.normalize(acc, l), valid)
    else:
        acc_ref, m_ref, l_ref = out_refs[:3]
        _tile.store_rows(acc_ref, (split, r), tok, head, acc, valid)
        _tile.store_row_stats(m_ref, (split, r), tok, head, m, valid)
        _tile.store_row_stats(l_ref, (split, r), tok, head, l, valid)


def merge_splits(outs, num_splits: int, dtype):
    """[R, Q, H, HD] from the outputs of `split_out_shapes`."""
    return outs[0] if num_splits == 1 else combine_splits(*outs, dtype)


@functools.partial(jax.jit, static_argnames=(
    "scale", "ctx_len", "interpret", "block_k", "num_splits", "num_warps", "num_stages"))
def paged_decode_attention(q, k_cache, v_cache, layer, req_to_token, entries,
                           q_positions, kv_lens, *, scale: float, ctx_len: int,
                           interpret: bool = False, block_k: int = 128,
                           num_splits: int | None = None, num_warps: int | None = None,
                           num_stages: int = 2):
    """Pallas paged attention for Q * (H // KVH) <= MAX_ROWS; same contract as
    `reference.paged_attention_ref` (q [R, Q, H, HD] -> [R, Q, H, HD])."""
    R, Q, H, HD = q.shape
    KVH = k_cache.shape[2]
    group = _tile.check_shapes(q, k_cache, v_cache)
    if Q * group > MAX_ROWS:
        raise ValueError(f"Q * G = {Q * group} > {MAX_ROWS}; use the prefill kernel")
    block_rows = max(16, _tile.next_pow2(Q * group))  # tensor-core M >= 16
    block_k = min(block_k, max(16, _tile.next_pow2(ctx_len)))
    if num_splits is None:
        num_splits = choose_splits(R, KVH, ctx_len, block_k)
    if num_warps is None:  # the f32 [BM, HD] accumulator must fit in registers
        num_warps = 4 if block_rows <= 32 else 8

    out_shape = split_out_shapes(num_splits, R, Q, H, HD, q.dtype)
    kernel = functools.partial(
        _kernel, group=group, block_rows=block_rows, block_k=block_k,
        num_splits=num_splits, scale=scale, ctx_len=ctx_len)
    outs = pl.pallas_call(
        kernel,
        grid=(R, KVH, num_splits),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"paged_decode_bm{block_rows}_bk{block_k}_s{num_splits}",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),  # [1]
        req_to_token.astype(jnp.int32),
        entries.astype(jnp.int32),
        q_positions.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        q, k_cache, v_cache,
    )
    return merge_splits(outs, num_splits, q.dtype)
