"""Split-K paged decode attention as a native Triton kernel, called from JAX via jax-triton.

An alternative to the Pallas (Triton lowering) kernel in `decode.py`, written
directly in `triton.language` so that an H200 can tell us whether going
native wins anything. Same contract as `reference.paged_attention_ref`, for
Q * G <= MAX_ROWS (decode, Q = 1, and short speculative windows).

Grid (R, KVH, S): program (r, kvh, s) packs every (query token, query head)
pair of batch row r that reads kv head kvh (Q * G rows, padded to a power of
two >= 16 for tl.dot) and walks the s-th of S equal shares of the row's
*visible* KV blocks, gathering slots from req_to_token. With S == 1 it
normalises and writes [R, Q, H, HD] directly; otherwise it writes partial
(acc, max, sum) states that `combine.combine_splits` merges in jnp.

One launch plan (`plan_launch`: grid, constexprs, output shapes) feeds two
launchers: `paged_decode_attention_triton` (jax_triton.triton_call, GPU) and
`launch_torch` (a plain Triton launch on torch tensors, which is how the CPU
tests run the very same kernel under TRITON_INTERPRET=1).

triton and jax_triton are optional: this module imports without them, and
`available()` says whether the JAX path can run here.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np
import jax
import jax.numpy as jnp

from . import _tile
from .combine import combine_splits
from .decode import MAX_ROWS, choose_splits
from .reference import MASK_VALUE

try:  # optional: the kernel exists only where triton is installed
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None


def available() -> bool:
    """True when triton, jax_triton and a JAX GPU backend are all present."""
    if triton is None:
        return False
    try:
        import jax_triton  # noqa: F401  (raises ImportError on a CPU-only jaxlib)
    except ImportError:
        return False
    return jax.default_backend() == "gpu"


# ----------------------------------------------------------------------------- kernel

if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        # inputs (pointers), in the order of `kernel_inputs`
        layer_ptr,  # [1] int32: a device scalar, so one compiled kernel serves every layer
        req_ptr,  # [E, MAX_CTX] int32 slot of each position
        entries_ptr,  # [R] int32
        qpos_ptr,  # [R, NUM_Q] int32
        kvlen_ptr,  # [R] int32
        q_ptr,  # [R, NUM_Q, NUM_HEADS, HEAD_DIM]
        k_ptr,  # [L, num_slots, KVH, HEAD_DIM]
        v_ptr,  # [L, num_slots, KVH, HEAD_DIM]
        # outputs (pointers), in the order of `LaunchPlan.out_shapes`
        out_ptr,  # S == 1: [R, NUM_Q, NUM_HEADS, HEAD_DIM] q.dtype; else acc [S, R, ...] f32
        m_ptr,  # S > 1: [S, R, NUM_Q, NUM_HEADS] f32 running max; S == 1: unused [1]
        l_ptr,  # S > 1: [S, R, NUM_Q, NUM_HEADS] f32 running sum; S == 1: unused [1]
        # compile-time constants (jax_triton passes keyword metaparams as constexprs;
        # they must follow every pointer argument)
        SCALE: tl.constexpr,
        CTX_LEN: tl.constexpr,
        MAX_CTX: tl.constexpr,
        NUM_Q: tl.constexpr,
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        GROUP: tl.constexpr,
        KV_STRIDE_LAYER: tl.constexpr,
        KV_STRIDE_SLOT: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        MASK: tl.constexpr,
    ):
        r = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        # The batch size is read from the grid, not a constexpr, so every batch
        # bucket shares one compiled kernel.
        num_batch = tl.num_programs(0)

        # int64 from here on for cache addressing: L * num_slots * KVH * HD
        # exceeds 2**31 elements for a realistically sized cache.
        layer = tl.load(layer_ptr).to(tl.int64)
        entry = tl.load(entries_ptr + r).to(tl.int64)
        kv_len = tl.minimum(tl.maximum(tl.load(kvlen_ptr + r), 0), CTX_LEN)

        # Row i of the tile is token i // G, head kvh * G + i % G (see _tile.row_map).
        rows = tl.arange(0, BLOCK_ROWS)  # [BM]
        tok_raw = rows // GROUP  # [BM]
        valid = tok_raw < NUM_Q  # [BM]; padding rows past the last token
        tok = tl.minimum(tok_raw, NUM_Q - 1)  # [BM] clamped so loads stay in bounds
        head = kvh * GROUP + rows % GROUP  # [BM]
        dims = tl.arange(0, HEAD_DIM)  # [HD]

        qrow = (r * NUM_Q + tok) * NUM_HEADS + head  # [BM] flat index of (r, tok, head)
        q = tl.load(q_ptr + qrow[:, None] * HEAD_DIM + dims[None, :])  # [BM, HD]
        q = q.to(k_ptr.dtype.element_ty)  # cache dtype: bf16 tensor-core matmuls
        qpos = tl.load(qpos_ptr + r * NUM_Q + tok)  # [BM]

        # Share out the row's *visible* blocks (not CTX_LEN), so a short row in a
        # long-ctx batch still spreads its work over all S programs.
        nvis = tl.minimum(tl.maximum(tl.max(qpos, 0) + 1, 0), kv_len)
        nblk = tl.cdiv(nvis, BLOCK_K)
        per_split = tl.cdiv(nblk, NUM_SPLITS)
        lo = split * per_split
        hi = tl.minimum(lo + per_split, nblk)

        # Positions past kv_len are clamped onto the last written slot and masked
        # below, so stale or dummy-page slots (possibly NaN) are never read.
        last = tl.minimum(tl.maximum(kv_len - 1, 0), MAX_CTX - 1)
        req_row = req_ptr + entry * MAX_CTX
        kv_base = layer * KV_STRIDE_LAYER + kvh * HEAD_DIM  # int64 scalar

        acc = tl.zeros([BLOCK_ROWS, HEAD_DIM], dtype=tl.float32)
        m_i = tl.full([BLOCK_ROWS], MASK, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for b in range(lo, hi):
            cpos = b * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK] cache positions
            slots = tl.load(req_row + tl.minimum(cpos, last)).to(tl.int64)  # [BK]
            kv_off = kv_base + slots * KV_STRIDE_SLOT  # [BK] start of each K/V row
            k = tl.load(k_ptr + kv_off[:, None] + dims[None, :])  # [BK, HD]
            v = tl.load(v_ptr + kv_off[:, None] + dims[None, :])  # [BK, HD]
            # [BM, HD] x [HD, BK] -> [BM, BK]
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * SCALE
            visible = (cpos[None, :] <= qpos[:, None]) & (cpos[None, :] < kv_len)  # [BM, BK]
            s = tl.where(visible, s, MASK)
            m_new = tl.maximum(m_i, tl.max(s, 1))  # [BM]
            alpha = tl.exp(m_i - m_new)  # [BM] rescale of what was accumulated
            # where() rather than relying on exp(MASK - m): a row with no visible
            # key yet has m_new == MASK and would otherwise get weight 1.
            p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)  # [BM, BK]
            l_i = alpha * l_i + tl.sum(p, 1)  # [BM]
            # [BM, BK] x [BK, HD] -> [BM, HD]
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        # Every program writes, even one with no blocks (acc 0, m MASK, l 0):
        # the outputs are not zero-initialised.
        if NUM_SPLITS == 1:
            # acc / l; rows with l == 0 (nothing visible) become exactly 0.
            inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)  # [BM]
            out = acc * inv[:, None]  # [BM, HD]
            tl.store(out_ptr + qrow[:, None] * HEAD_DIM + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=valid[:, None])
        else:
            # Flat index of (split, r, tok, head) in [S, R, Q, H].
            srow = split * (num_batch * NUM_Q * NUM_HEADS) + qrow  # [BM]
            tl.store(out_ptr + srow[:, None] * HEAD_DIM + dims[None, :], acc,
                     mask=valid[:, None])
            tl.store(m_ptr + srow, m_i, mask=valid)
            tl.store(l_ptr + srow, l_i, mask=valid)

else:
    _paged_decode_kernel = None


# ----------------------------------------------------------------------------- launch plan


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Everything about a launch except the arrays: shared by both launchers."""

    grid: tuple[int, int, int]  # (R, KVH, S)
    out_shapes: tuple[tuple[tuple[int, ...], np.dtype], ...]  # (shape, dtype) per output
    constexprs: dict  # keyword constexpr arguments of _paged_decode_kernel
    num_splits: int
    num_warps: int
    num_stages: int
    out_dtype: np.dtype  # dtype of the final [R, Q, H, HD] result
    name: str


def plan_launch(q_shape, q_dtype, cache_shape, cache_dtype, req_shape, *, scale: float,
                ctx_len: int, block_k: int = 64, num_splits: int | None = None,
                num_warps: int | None = None, num_stages: int = 2) -> LaunchPlan:
    """Grid, constexprs and outputs for q [R, Q, H, HD] over caches [L, slots, KVH, HD].

    Shapes and dtypes only (numpy dtypes, or anything np.dtype accepts), so the
    same plan drives a JAX trace and a torch interpreter launch. Raises like
    the Pallas path on shapes the kernel does not cover.
    """
    R, Q, H, HD = map(int, q_shape)
    _, num_slots, KVH, _ = map(int, cache_shape)  # the layer is a runtime argument
    max_ctx = int(req_shape[1])
    # _tile.check_shapes wants array-likes with .shape; only shapes matter here.
    shaped = lambda s: jax.ShapeDtypeStruct(tuple(s), jnp.float32)  # noqa: E731
    group = _tile.check_shapes(shaped(q_shape), shaped(cache_shape), shaped(cache_shape))
    if Q * group > MAX_ROWS:
        raise ValueError(f"Q * G = {Q * group} > {MAX_ROWS}; use the prefill kernel")
    block_rows = max(16, _tile.next_pow2(Q * group))  # tl.dot needs M >= 16
    block_k = min(int(block_k), max(16, _tile.next_pow2(ctx_len)))  # and N, K >= 16
    if num_splits is None:
        num_splits = choose_splits(R, KVH, ctx_len, block_k)
    num_splits = int(num_splits)
    if num_warps is None:  # the f32 [BM, HD] accumulator must fit in registers
        num_warps = 4 if block_rows <= 32 else 8

    q_dtype, cache_dtype = np.dtype(q_dtype), np.dtype(cache_dtype)
    if cache_dtype.itemsize == 1:  # the kernel casts q to the cache's dtype for its matmuls
        raise NotImplementedError("the native Triton decode kernel reads 16-bit caches only, not an 8-bit one")
    if num_splits == 1:
        # m / l are not needed; 1-element placeholders keep one kernel signature.
        out_shapes = (((R, Q, H, HD), q_dtype), ((1,), np.dtype(np.float32)),
                      ((1,), np.dtype(np.float32)))
    else:
        f32 = np.dtype(np.float32)
        out_shapes = (((num_splits, R, Q, H, HD), f32),  # acc
                      ((num_splits, R, Q, H), f32),  # max
                      ((num_splits, R, Q, H), f32))  # sum
    constexprs = dict(
        SCALE=float(scale), CTX_LEN=int(ctx_len), MAX_CTX=max_ctx, NUM_Q=Q, NUM_HEADS=H,
        HEAD_DIM=HD, GROUP=group,
        KV_STRIDE_LAYER=num_slots * KVH * HD, KV_STRIDE_SLOT=KVH * HD,  # row-major caches
        BLOCK_ROWS=block_rows, BLOCK_K=block_k, NUM_SPLITS=num_splits,
        # f32 caches: exact matmuls (Triton defaults to tf32); ignored for 16-bit inputs.
        DOT_PRECISION="ieee" if cache_dtype == np.float32 else "tf32",
        MASK=float(MASK_VALUE),
    )
    return LaunchPlan(
        grid=(R, KVH, num_splits), out_shapes=out_shapes, constexprs=constexprs,
        num_splits=num_splits, num_warps=int(num_warps), num_stages=int(num_stages),
        out_dtype=q_dtype, name=f"triton_paged_decode_bm{block_rows}_bk{block_k}_s{num_splits}")


def merge_outputs(outs, plan: LaunchPlan):
    """[R, Q, H, HD] from the kernel outputs (jax or numpy arrays)."""
    if plan.num_splits == 1:
        return outs[0]
    return combine_splits(*outs, plan.out_dtype)


# ----------------------------------------------------------------------------- JAX launcher


def kernel_inputs(q, k_cache, v_cache, layer, req_to_token, entries, q_positions, kv_lens):
    """The kernel's input arrays in signature order (the same order for every launcher)."""
    return (layer, req_to_token, entries, q_positions, kv_lens, q, k_cache, v_cache)


@functools.partial(jax.jit, static_argnames=(
    "scale", "ctx_len", "block_k", "num_splits", "num_warps", "num_stages"))
def paged_decode_attention_triton(q, k_cache, v_cache, layer, req_to_token, entries,
                                  q_positions, kv_lens, *, scale: float, ctx_len: int,
                                  block_k: int = 64, num_splits: int | None = None,
                                  num_warps: int | None = None, num_stages: int = 2):
    """Native-Triton paged attention for Q * (H // KVH) <= MAX_ROWS (GPU, jax_triton).

    Same contract as `reference.paged_attention_ref`: q [R, Q, H, HD], caches
    [L, num_slots, KVH, HD], layer an int or int32 scalar (traced is fine: it
    reaches the kernel as a [1] device array), -> [R, Q, H, HD] in q.dtype.
    Tuning: block_k (KV positions per loop step), num_splits (None: as
    decode.choose_splits), num_warps, num_stages (software pipelining depth).
    """
    import jax_triton as jt  # deferred: it fails to import on a CPU-only jaxlib

    plan = plan_launch(q.shape, q.dtype, k_cache.shape, k_cache.dtype, req_to_token.shape,
                       scale=scale, ctx_len=ctx_len, block_k=block_k, num_splits=num_splits,
                       num_warps=num_warps, num_stages=num_stages)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k/v cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")
    inputs = kernel_inputs(
        q, k_cache, v_cache,
        jnp.asarray(layer, jnp.int32).reshape(1),  # [] -> [1]
        req_to_token.astype(jnp.int32), entries.astype(jnp.int32),
        q_positions.astype(jnp.int32), kv_lens.astype(jnp.int32))
    outs = jt.triton_call(
        *inputs,
        kernel=_paged_decode_kernel,
        out_shape=[jax.ShapeDtypeStruct(s, d) for s, d in plan.out_shapes],
        grid=plan.grid,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        name=plan.name,
        **plan.constexprs,
    )
    return merge_outputs(outs, plan)


# ----------------------------------------------------------------------------- torch launcher


def launch_torch(q, k_cache, v_cache, layer, req_to_token, entries, q_positions, kv_lens,
                 *, scale: float, ctx_len: int, **tuning):
    """Run the kernel on torch tensors with a plain Triton launch; returns numpy [R, Q, H, HD].

    Used by the CPU tests under TRITON_INTERPRET=1 (the interpreter runs on CPU
    tensors), through the same plan, input order and merge as the JAX path.
    `layer` is a [1] int32 tensor; all tensors must be contiguous.
    """
    import torch

    np_dtype = lambda t: np.dtype(str(t.dtype).removeprefix("torch."))  # noqa: E731
    plan = plan_launch(q.shape, np_dtype(q), k_cache.shape, np_dtype(k_cache),
                       req_to_token.shape, scale=scale, ctx_len=ctx_len, **tuning)
    inputs = kernel_inputs(q, k_cache, v_cache, layer, req_to_token, entries,
                           q_positions, kv_lens)
    for t in inputs:
        if not t.is_contiguous():
            raise ValueError("launch_torch needs contiguous tensors (the kernel assumes row-major)")
    outs = [torch.empty(s, dtype=getattr(torch, d.name)) for s, d in plan.out_shapes]
    _paged_decode_kernel[plan.grid](*inputs, *outs, num_warps=plan.num_warps,
                                    num_stages=plan.num_stages, **plan.constexprs)
    merged = merge_outputs([jnp.asarray(o.numpy()) for o in outs], plan)
    return np.asarray(merged)


# ----------------------------------------------------------------------------- GPU self check


def _time_per_call_us(attn, b, calls: int = 20, reps: int = 10) -> float:
    """Median microseconds per attention call, `calls` of them inside one jit.

    The calls run in a lax.scan over a traced layer index, as the engine does
    per layer, so dispatch overhead is amortised and the [1] layer argument is
    exercised as a loop-carried device value.
    """
    num_layers = b.k_cache.shape[0]

    @jax.jit
    def run(q, k_cache, v_cache, req, ent, qpos, lens):
        def step(total, i):
            out = attn(q, k_cache, v_cache, i % num_layers, req, ent, qpos, lens)
            return total + out[0, 0, 0, 0].astype(jnp.float32), None  # keeps every call live
        return jax.lax.scan(step, jnp.float32(0), jnp.arange(calls, dtype=jnp.int32))[0]

    args = (b.q, b.k_cache, b.v_cache, b.req_to_token, b.entries, b.q_positions, b.kv_lens)
    jax.block_until_ready(run(*args))  # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(times)) / calls


def gpu_self_check(bench: bool = True) -> dict:
    """On a GPU with jax_triton: the jax_triton path vs paged_attention_ref.

    Prints the max abs error of small batches (f32 unsplit and split, a bf16
    Q=4 window, each with an empty padded row that must come out exactly 0)
    and of a Qwen3-8B-like decode batch (bf16, H 32, KVH 8, HD 128, B 32,
    ctx 2048, page-scattered slots; default split and S=4). With bench, also
    the time per call of this kernel (block_k 64 and 128) next to the Pallas
    `decode.paged_decode_attention` on the Qwen batch. Returns {case: max_err}.
    """
    from .decode import paged_decode_attention
    from .reference import paged_attention_ref
    from .testing import make_paged_batch

    if not available():
        raise RuntimeError("needs triton, jax_triton and a JAX GPU backend")
    rng = np.random.default_rng(0)
    small = dict(kv_lens=[5, 77, 130], num_q=1, num_heads=8, num_kv_heads=2, head_dim=64,
                 page_size=16, padded_rows=1, dtype=jnp.float32)
    window = dict(kv_lens=[3, 77, 200], num_q=4, num_heads=8, num_kv_heads=2, head_dim=128,
                  page_size=16, padded_rows=1, dtype=jnp.bfloat16, pad_positions="garbage")
    qwen = dict(kv_lens=[int(x) for x in rng.integers(1, 2049, size=32)], num_q=1,
                num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, ctx_len=2048,
                num_layers=2, dtype=jnp.bfloat16)
    # bf16 tolerance as in test_kernels_attention: the kernel feeds bf16
    # probabilities to the second matmul, the reference keeps them in f32.
    cases = [  # name, batch, tuning kwargs, tolerance
        ("small f32 S=1", small, dict(num_splits=1), 2e-5),
        ("small f32 S=3", small, dict(num_splits=3), 2e-5),
        ("window bf16 Q=4", window, dict(), 3e-2),
        ("qwen3-8b bf16 B=32 ctx=2048", qwen, dict(), 3e-2),
        ("qwen3-8b bf16 B=32 ctx=2048 S=4", qwen, dict(num_splits=4), 3e-2),
    ]
    batches = {}
    errors = {}
    for name, batch_kw, tuning, tol in cases:
        key = id(batch_kw)
        if key not in batches:
            batches[key] = make_paged_batch(**batch_kw)
        b = batches[key]
        scale = 1.0 / float(np.sqrt(batch_kw["head_dim"]))
        kw = dict(scale=scale, ctx_len=b.ctx_len)
        # XLA on the GPU runs f32 dots in tf32 by default (errors ~1e-3, seen on the H200
        # in the first run of this check); the f32 cases need an exact reference.
        with jax.default_matmul_precision("highest"):
            ref = np.asarray(paged_attention_ref(*b.args(), **kw), np.float32)
        out = np.asarray(paged_decode_attention_triton(*b.args(), **kw, **tuning), np.float32)
        err = float(np.max(np.abs(out - ref)))
        errors[name] = err
        ok = np.isfinite(out).all() and err <= tol
        if batch_kw.get("padded_rows"):
            ok = ok and bool((out[-batch_kw["padded_rows"]:] == 0).all())
        print(f"[triton_native] {name:34s} max_abs_err={err:.3e} (tol {tol:g}) "
              f"{'ok' if ok else 'FAIL'}")

    if bench:
        b = batches[id(qwen)]
        kw = dict(scale=1.0 / float(np.sqrt(qwen["head_dim"])), ctx_len=b.ctx_len)
        # K + V bytes one call must read: every visible position, all kv heads.
        kv_bytes = (2 * sum(qwen["kv_lens"]) * qwen["num_kv_heads"] * qwen["head_dim"]
                    * jnp.dtype(qwen["dtype"]).itemsize)
        for label, attn in [
            ("triton bk64", functools.partial(paged_decode_attention_triton, **kw)),
            ("triton bk128", functools.partial(paged_decode_attention_triton, **kw, block_k=128)),
            ("pallas bk128", functools.partial(paged_decode_attention, **kw)),
        ]:
            us = _time_per_call_us(attn, b)
            print(f"[triton_native] qwen3-8b decode {label:14s} {us:8.1f} us/call "
                  f"{kv_bytes / us / 1e3:7.0f} GB/s of K+V")
    return errors


if __name__ == "__main__":  # python -m jaxoverlap.pallas_kernels.triton_native
    gpu_self_check()
