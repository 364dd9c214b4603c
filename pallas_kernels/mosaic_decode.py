"""Paged decode attention (Q = 1) as a Pallas Mosaic GPU (Hopper) kernel.

An alternative to the Triton-lowered `decode.paged_decode_attention`, with the
same contract as `reference.paged_attention_ref` for one query per row.

Grid (R, KVH, S): program (r, kvh, s) takes the G = H // KVH query heads of
batch row r that read kv head kvh and the s-th of S equal shares of the row's
visible KV blocks (split-K, merged by `combine.combine_splits`).

Why this shape of kernel:
  * The engine cache is slot-addressed and a page of `page_size` positions
    occupies `page_size` consecutive slots, page-aligned (slot = page * P +
    offset), so one K (or V) block of `block_k` keys is `block_k // page_size`
    rectangular [page_size, HD] boxes of `k_cache[layer, :, kvh, :]`. Each box
    is one TMA copy (`plgpu.copy_gmem_to_smem`) with a dynamic slot offset;
    all the boxes of a block arrive on one barrier (num_arrivals = pages per
    block). TMA into the (8, *)-tiled SMEM layout needs box starts on whole
    tiles, hence page_size % 8 == 0 and the page-aligned slots.
  * Decode is memory bound, so what matters is keeping copies in flight:
    `num_stages` K/V buffers, refilled as soon as the block in them has been
    consumed, while the warpgroup computes on the oldest one.
  * The matmuls are tiny (G <= 8 rows), but wgmma needs M = 64: the query tile
    is a 64-row box of the per-program query rows, starting at this program's
    G rows. Rows past G belong to the next programs (or to zero padding) and
    are never stored; matmul rows are independent, so they cannot disturb the
    real ones. The wasted tensor-core work is negligible next to the HBM
    traffic.

Masking: every processed block has its first key visible (blocks are counted
from the visible length), so running maxima are finite after the first block.
Pages past the visible length are redirected onto the last visible page, so a
copy never reads another request's or the dummy page's slots; only the tail of
the last visible page is read past kv_len, and its scores are masked to
-inf (p = 0). Those tail slots belong to the request itself (allocated, not
yet written); as with any 0 * x in the PV matmul they must hold finite values
(true for a zero-initialised cache that is only written with real K/V).

Only 16-bit caches (bf16 / f16) are supported: the PV wgmma reads V
"MN-major" (transposed), which Hopper's tf32 wgmma cannot do.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from .combine import combine_splits
from .decode import choose_splits  # the same split rule as the Triton-lowered kernel
from .reference import MASK_VALUE

try:  # Mosaic GPU ships with jaxlib, but guard so CPU-only installs still import.
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    _IMPORT_ERROR: Exception | None = None
except Exception as e:  # pragma: no cover - depends on the installed jax
    pl = plgpu = None
    _IMPORT_ERROR = e

try:  # GPU interpret mode (runs the kernel on CPU); private API, may move.
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except Exception:  # pragma: no cover
    InterpretGPUParams = None

# wgmma M of one warpgroup: the query tile is padded to this many rows.
WGMMA_M = 64
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def available() -> bool:
    """True if this JAX has the Pallas Mosaic GPU API (not whether a GPU is present)."""
    return plgpu is not None


def interpret_params():
    """The `interpret=` value that runs the kernel with GPU interpret mode on CPU."""
    if InterpretGPUParams is None:
        raise RuntimeError("this JAX has no Mosaic GPU interpret mode")
    return InterpretGPUParams()


def _kernel(layer_ref, req_ref, entries_ref, qpos_ref, kvlen_ref, q_ref, k_ref, v_ref,
            *refs, group, num_heads, page_size, block_k, num_stages, num_splits,
            scale, ctx_len, interpreting):
    """One program: G heads of row r against kv head kvh, split s of its blocks.

    Refs (all GMEM): layer [1], req_to_token [E, max_ctx], entries [R], qpos [R],
    kv_lens [R], q [R * KVH * G8 + 64, HD] (G rows per program padded to G8, a
    multiple of 8), k/v caches [L, slots, KVH, HD]; outputs
    either out [R * H, HD] (S == 1) or acc [S, R * H, HD] f32, m and l
    [S, R * KVH, 64] f32; then the scratch refs of `_scratch`.
    """
    def cast(x, layout):
        # Register layouts mean nothing to the CPU interpreter, which has no rule
        # for layout_cast; on the GPU they pick wgmma-compatible fragments.
        return x if interpreting else plgpu.layout_cast(x, layout)

    n_out = 1 if num_splits == 1 else 3
    out_refs, scratch = refs[:n_out], refs[n_out:]
    (q_smem, k_smem, v_smem, o_smem, stat_smem, q_bar, k_bar, v_bar) = scratch
    head_dim = q_smem.shape[1]
    pages_per_block = block_k // page_size
    # Last page start of the table (its width is a whole number of pages).
    max_page_pos = req_ref.shape[1] - page_size

    r = lax.axis_index("r")
    kvh = lax.axis_index("kvh")
    split = lax.axis_index("s")
    layer = layer_ref[0]
    entry = entries_ref[r]
    kv_len = jnp.clip(kvlen_ref[r], 0, ctx_len)
    # Decode: every row of the program is the same token, so one visible length.
    nvis = jnp.clip(qpos_ref[r] + 1, 0, kv_len)
    nblk = lax.div(nvis + (block_k - 1), jnp.int32(block_k))
    per_split = lax.div(nblk + (num_splits - 1), jnp.int32(num_splits))
    blk_lo = split * per_split
    blk_hi = jnp.minimum(blk_lo + per_split, nblk)
    nsteps = jnp.maximum(blk_hi - blk_lo, 0)
    # Start of the last visible page: pages past it are redirected there.
    last_page_pos = jnp.maximum(nvis - 1, 0) // page_size * page_size

    prog = r * (num_heads // group) + kvh
    # The program's rows in q (padded to G8 per program, so tile-aligned) and in the output.
    q_row0 = pl.multiple_of(prog * (-(-group // 8) * 8), 8)
    out_row0 = prog * group  # == r * H + kvh * G
    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q_row0, WGMMA_M)], q_smem, q_bar)

    def issue(step):
        """Start the page copies of block blk_lo + step into buffer step % num_stages."""
        buf = lax.rem(step, num_stages)
        pos0 = (blk_lo + step) * block_k
        for p in range(pages_per_block):  # static unroll: one TMA box per page
            # Page-aligned, so the box below is one whole page of slots.
            pos = jnp.minimum(jnp.minimum(pos0 + p * page_size, last_page_pos), max_page_pos)
            # First slot of this page (pages are contiguous and page-aligned);
            # the hint lets Mosaic prove the TMA box starts on a whole SMEM tile.
            slot0 = pl.multiple_of(req_ref[entry, pos], page_size)
            rows = pl.ds(p * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_ref.at[layer, pl.ds(slot0, page_size), kvh],
                                    k_smem.at[buf, rows], k_bar.at[buf])
            plgpu.copy_gmem_to_smem(v_ref.at[layer, pl.ds(slot0, page_size), kvh],
                                    v_smem.at[buf, rows], v_bar.at[buf])

    for st in range(num_stages):  # prologue: fill every buffer we will use
        @pl.when(st < nsteps)
        def _():
            issue(jnp.int32(st))

    plgpu.barrier_wait(q_bar)

    def body(step, carry):
        acc, m_i, l_i = carry
        buf = lax.rem(step, num_stages)
        plgpu.barrier_wait(k_bar.at[buf])

        if interpreting:  # [64, HD] x [BK, HD] -> [64, BK], contracting HD
            s = lax.dot_general(q_smem[...], k_smem[buf], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        else:
            def qk(acc_ref):  # [64, HD] x [HD, BK] -> [64, BK]
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[buf].transpose((1, 0)))
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((WGMMA_M, block_k), jnp.float32))
        # Scores in log2 units (exp2 is the native instruction).
        s = s * (scale * _LOG2E)
        cpos = (blk_lo + step) * block_k + cast(
            lax.broadcasted_iota(jnp.int32, (WGMMA_M, block_k), 1), plgpu.Layout.WGMMA)  # [64, BK]
        s = jnp.where(cpos < nvis, s, -jnp.inf)
        m_new = jnp.maximum(m_i, s.max(axis=1))  # [64]; finite: key 0 of the block is visible
        alpha = jnp.exp2(m_i - m_new)  # [64]
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))  # [64, BK]
        l_new = l_i * alpha + p.sum(axis=1)  # [64]
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])  # [64, HD]
        plgpu.barrier_wait(v_bar.at[buf])

        p16 = p.astype(v_smem.dtype)  # [64, BK], the PV matmul runs in the cache dtype
        if interpreting:  # [64, BK] x [BK, HD] -> [64, HD]
            pv = lax.dot_general(p16, v_smem[buf], (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        else:
            def pv_mma(acc_ref):  # [64, BK] (registers) x [BK, HD] (SMEM) -> [64, HD]
                plgpu.wgmma(acc_ref, p16, v_smem.at[buf])
                return acc_ref[...]  # waits for the wgmma
            # A fresh zero accumulator plus a register add rather than run_state on
            # `acc`, so the two paths share the code around it; the add is free.
            pv = pl.run_scoped(pv_mma, plgpu.ACC((WGMMA_M, head_dim), jnp.float32))
        acc = acc + pv

        # Both wgmmas on this buffer are complete: refill it with a later block.
        @pl.when(step + num_stages < nsteps)
        def _():
            issue(step + num_stages)
        return acc, m_new, l_new

    init = (
        cast(jnp.zeros((WGMMA_M, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        cast(jnp.full((WGMMA_M,), MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        cast(jnp.zeros((WGMMA_M,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )
    acc, m_i, l_i = lax.fori_loop(0, nsteps, body, init)

    if num_splits == 1:
        # Rows that saw nothing have acc == 0 and l == 0: divide by 1, stay 0.
        inv = 1.0 / jnp.where(l_i > 0, l_i, 1.0)  # [64]
        o_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)],
                                out_refs[0].at[pl.ds(out_row0, group)])
    else:
        acc_ref, m_ref, l_ref = out_refs
        o_smem[...] = acc
        # combine_splits works in natural-log units; empty splits keep MASK_VALUE.
        stat_smem[0] = m_i * _LN2
        stat_smem[1] = l_i
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)],
                                acc_ref.at[split, pl.ds(out_row0, group)])
        plgpu.copy_smem_to_gmem(stat_smem.at[0], m_ref.at[split, prog])
        plgpu.copy_smem_to_gmem(stat_smem.at[1], l_ref.at[split, prog])
    plgpu.wait_smem_to_gmem(0)


def _scratch(head_dim: int, block_k: int, num_stages: int, pages_per_block: int,
             dtype, out_dtype):
    """SMEM buffers and barriers of one program.

    Q and K/V use the (8, 64)-tiled, 128-byte-swizzled layout wgmma reads;
    the output tile stays untiled so that its first G rows (G may be < 8)
    can be copied out on their own.
    """
    elems = 128 // jnp.dtype(dtype).itemsize  # elements per 128-byte swizzle row
    transforms = (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(128))
    return [
        plgpu.SMEM((WGMMA_M, head_dim), dtype, transforms=transforms),  # q
        plgpu.SMEM((num_stages, block_k, head_dim), dtype, transforms=transforms),  # k
        plgpu.SMEM((num_stages, block_k, head_dim), dtype, transforms=transforms),  # v
        plgpu.SMEM((WGMMA_M, head_dim), out_dtype),  # output / partial acc
        plgpu.SMEM((2, WGMMA_M), jnp.float32),  # partial max and sum
        plgpu.Barrier(num_arrivals=1),  # q
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=num_stages),  # k pages
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=num_stages),  # v pages
    ]


def _compiler_params():
    """Lane lowering semantics (per-thread SIMT code generation) where the
    field exists: the path this module was written and CPU-lowered against;
    fast exp2 for the softmax."""
    kw = dict(approx_math=True)
    lane = getattr(getattr(plgpu, "LoweringSemantics", None), "Lane", None)
    if lane is not None:
        kw["lowering_semantics"] = lane
    return plgpu.CompilerParams(**kw)


@functools.partial(jax.jit, static_argnames=(
    "scale", "ctx_len", "page_size", "block_k", "num_splits", "num_stages", "interpret"))
def paged_decode_attention_mgpu(q, k_cache, v_cache, layer, req_to_token, entries,
                                q_positions, kv_lens, *, scale: float, ctx_len: int,
                                page_size: int, block_k: int = 64,
                                num_splits: int | None = None, num_stages: int = 2,
                                interpret=None):
    """Mosaic GPU paged decode attention; `reference.paged_attention_ref`'s contract for Q = 1.

    Args:
        q: [R, 1, H, HD] bf16/f16 queries; k_cache, v_cache: [L, slots, KVH, HD].
        page_size: engine page size (positions per page, consecutive slots).
        block_k: keys per pipeline step, a multiple of 64 and of page_size
            (clamped down for short contexts).
        num_splits: split-K count S (None: `choose_splits`).
        num_stages: K/V buffers in flight. Measured on an H200 (JAX 0.11.2, bf16,
            KVH 8, HD 128): block_k 64 with 2 stages is best at batch 32 x 2k
            (its ~112 KB of SMEM fits two programs per SM; 3+ stages or block_k
            128 fit one and run ~1.7x slower) and ties block_k 128 at 1 x 8k.
        interpret: None for the GPU, or `interpret_params()` to run on CPU.
    Returns:
        [R, 1, H, HD] in q.dtype.
    """
    if not available():
        raise RuntimeError(f"Mosaic GPU Pallas is unavailable: {_IMPORT_ERROR!r}")
    R, Q, H, HD = q.shape
    L, num_slots, KVH, _ = k_cache.shape
    if Q != 1:
        raise NotImplementedError(f"decode kernel takes one query per row, got Q={Q}")
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != HD or H % KVH:
        raise ValueError(f"bad shapes q {q.shape}, k {k_cache.shape}, v {v_cache.shape}")
    if jnp.dtype(k_cache.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise NotImplementedError(f"Mosaic GPU decode needs a bf16/f16 cache, got {k_cache.dtype}")
    if HD % 64:
        raise NotImplementedError(f"head_dim must be a multiple of 64, got {HD}")
    group = H // KVH
    if group > WGMMA_M:
        raise NotImplementedError(f"G = {group} > {WGMMA_M}")
    if req_to_token.shape[1] % page_size:
        raise ValueError("req_to_token width must be a whole number of pages")
    # TMA boxes land in (8, *)-tiled SMEM, and the tiled view of the cache
    # needs its slot dimension to be a whole number of tiles.
    if page_size % 8 or num_slots % 8:
        raise NotImplementedError(f"{page_size=} and {num_slots=} must be multiples of 8")
    # A block never needs to be longer than the (page-rounded) context.
    ctx_pages = -(-ctx_len // page_size) * page_size
    block_k = max(64, min(block_k, -(-ctx_pages // 64) * 64))
    if block_k % 64 or block_k % page_size:
        raise ValueError(f"block_k={block_k} must be a multiple of 64 and of {page_size=}")
    if num_splits is None:
        num_splits = choose_splits(R, KVH, ctx_len, block_k)

    dtype = k_cache.dtype
    # Each program's G query rows, padded to a multiple of 8 rows, then all
    # programs back to back: a TMA box into (8, *)-tiled SMEM must start on a
    # whole tile, so program p's 64-row box starts at row p * G8. The zero tail
    # keeps the last program's box in bounds.
    g8 = -(-group // 8) * 8
    q_prog = q.astype(dtype).reshape(R * KVH, group, HD)  # [R, 1, H, HD] -> [R * KVH, G, HD]
    q_prog = jnp.pad(q_prog, ((0, 0), (0, g8 - group), (0, 0)))  # [R * KVH, G8, HD]
    q_flat = q_prog.reshape(R * KVH * g8, HD)  # [R * KVH, G8, HD] -> [R * KVH * G8, HD]
    q_flat = jnp.pad(q_flat, ((0, WGMMA_M), (0, 0)))  # [R * KVH * G8 + 64, HD]

    if num_splits == 1:
        out_type = jax.ShapeDtypeStruct((R * H, HD), q.dtype)
        out_dtype = q.dtype
    else:
        out_type = (
            jax.ShapeDtypeStruct((num_splits, R * H, HD), jnp.float32),  # acc
            jax.ShapeDtypeStruct((num_splits, R * KVH, WGMMA_M), jnp.float32),  # max (natural log)
            jax.ShapeDtypeStruct((num_splits, R * KVH, WGMMA_M), jnp.float32),  # sum
        )
        out_dtype = jnp.float32

    kernel = functools.partial(
        _kernel, group=group, num_heads=H, page_size=page_size, block_k=block_k,
        num_stages=num_stages, num_splits=num_splits, scale=scale, ctx_len=ctx_len,
        interpreting=interpret is not None)
    kwargs = {}
    if interpret is not None:
        kwargs["interpret"] = interpret
    outs = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=_scratch(HD, block_k, num_stages, block_k // page_size, dtype, out_dtype),
        grid=(R, KVH, num_splits),
        grid_names=("r", "kvh", "s"),
        compiler_params=_compiler_params(),
        **kwargs,
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),  # [1]
        req_to_token.astype(jnp.int32),
        entries.astype(jnp.int32),
        q_positions.astype(jnp.int32).reshape(R),  # [R, 1] -> [R]
        kv_lens.astype(jnp.int32),
        q_flat, k_cache, v_cache,
    )
    if num_splits == 1:
        return outs.reshape(R, 1, H, HD)  # [R * H, HD] -> [R, 1, H, HD]
    acc, m, l = outs
    acc = acc.reshape(num_splits, R, 1, H, HD)  # [S, R * H, HD] -> [S, R, 1, H, HD]
    # [S, R * KVH, 64] -> [S, R * KVH, G] (real rows) -> [S, R, 1, H]
    m = m[:, :, :group].reshape(num_splits, R, 1, H)
    l = l[:, :, :group].reshape(num_splits, R, 1, H)
    return combine_splits(acc, m, l, q.dtype)


# -- on-GPU check (run on the H200: python -m jaxoverlap.pallas_kernels.mosaic_decode) --------


def _time_ms(fn, args, num_layers: int, iters: int = 100) -> float:
    """Device time per call of attention fn, from `iters` calls inside one jit.

    Calls queued from Python measure dispatch (~0.1 ms), not the kernel, so the
    loop runs on the device; each call reads another layer and its output is
    summed, so no call can be hoisted or dropped.
    """
    import time
    q, k, v, _, *rest = args

    @jax.jit
    def many(q, k, v, *rest):
        def body(i, total):
            out = fn(q, k, v, lax.rem(i, num_layers), *rest)
            return total + out.astype(jnp.float32)
        return lax.fori_loop(0, iters, body, jnp.zeros(q.shape, jnp.float32))

    jax.block_until_ready(many(q, k, v, *rest))  # compile + warm up
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(many(q, k, v, *rest))
        best = min(best, time.perf_counter() - t0)
    return best / iters * 1e3


def gpu_self_check(bench: bool = True) -> bool:
    """Compile and run the kernel on the GPU against `paged_attention_ref`.

    Shapes: a small GQA case, then Qwen3-8B-like bf16 decode (H=32, KVH=8,
    HD=128, page 16, page-scattered slots) at batch 32 x 2k and batch 1 x 8k.
    Prints the max abs error per case and split count (and, with bench, the
    device time of the Mosaic GPU kernel over a few tunings next to the Triton
    kernel and the XLA reference, each including its jnp pre/post-processing
    and split merge). Returns True when every case is within tolerance.
    """
    import numpy as np
    from .decode import paged_decode_attention
    from .reference import paged_attention_ref
    from .testing import make_paged_batch

    print("jax", jax.__version__, "devices", jax.devices())
    rng = np.random.default_rng(0)
    cases = [
        ("small G4 hd64 p8", dict(kv_lens=[37, 5, 130], num_heads=8, num_kv_heads=2,
                                  head_dim=64, page_size=8, padded_rows=1)),
        ("B32 ctx2048", dict(kv_lens=list(2048 - rng.integers(0, 200, 32)), num_heads=32,
                             num_kv_heads=8, head_dim=128, page_size=16, ctx_len=2048)),
        ("B1 ctx8192", dict(kv_lens=[8192 - 7], num_heads=32, num_kv_heads=8,
                            head_dim=128, page_size=16, ctx_len=8192)),
    ]
    ok = True
    for name, kw in cases:
        b = make_paged_batch(num_q=1, dtype=jnp.bfloat16, num_layers=2, **kw)
        scale = kw["head_dim"] ** -0.5
        ref = paged_attention_ref(*b.args(), scale=scale, ctx_len=b.ctx_len)
        ref32 = np.asarray(ref.astype(jnp.float32))
        auto = choose_splits(len(b.entries), kw["num_kv_heads"], b.ctx_len, 128)
        for s in sorted({1, 2, auto}):
            out = paged_decode_attention_mgpu(*b.args(), scale=scale, ctx_len=b.ctx_len,
                                              page_size=kw["page_size"], num_splits=s)
            err = float(np.abs(np.asarray(out.astype(jnp.float32)) - ref32).max())
            good = bool(np.isfinite(err) and err < 2e-2)
            ok &= good
            print(f"{name:18s} S={s:<3d} max|err|={err:.3e} {'ok' if good else 'FAIL'}",
                  flush=True)
        if not bench:
            continue
        nl = b.k_cache.shape[0]
        kv_bytes = (2 * sum(min(int(n), b.ctx_len) for n in b.kv_lens) * b.k_cache.shape[2]
                    * b.k_cache.shape[3] * b.k_cache.dtype.itemsize)
        f_ref = functools.partial(paged_attention_ref, scale=scale, ctx_len=b.ctx_len)
        f_tri = functools.partial(paged_decode_attention, scale=scale, ctx_len=b.ctx_len)
        print(f"  K+V read {kv_bytes / 1e6:.1f} MB; xla ref {_time_ms(f_ref, b.args(), nl):.4f} ms,"
              f" triton {_time_ms(f_tri, b.args(), nl):.4f} ms", flush=True)
        for bk, st in [(64, 2), (64, 3), (64, 4), (128, 2)]:
            f = functools.partial(paged_decode_attention_mgpu, scale=scale, ctx_len=b.ctx_len,
                                  page_size=kw["page_size"], block_k=bk, num_stages=st)
            try:
                ms = _time_ms(f, b.args(), nl)
                print(f"  mosaic block_k={bk} stages={st} S={auto}: {ms:.4f} ms"
                      f" ({kv_bytes / ms / 1e9:.2f} TB/s)", flush=True)
            except Exception as e:  # a tuning that does not fit (SMEM) must not hide the rest
                print(f"  mosaic block_k={bk} stages={st}: failed {type(e).__name__}: {e}"[:300])
    print("ALL OK" if ok else "SOME FAILED")
    return ok


if __name__ == "__main__":
    import sys
    sys.exit(0 if gpu_self_check(bench="--no-bench" not in sys.argv) else 1)
