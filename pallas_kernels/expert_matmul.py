"""Expert matmuls of a few tokens (mixture-of-experts decode), reading each chosen expert's
weights where they are.

`expert_matmul(x, w, experts)[a] = x[a] @ w[experts[a]]`: row a of x times the matrix of
expert experts[a]. XLA computes this by gathering the experts' matrices into a new array
and then multiplying (models/moe.py, "grouped" with blocks of one row): the chosen weights
are read, written and read again. Here each program reads its block of the expert's
matrix straight from the weights, once.

Grid (A, N / BN, S): program (a, n, s) computes columns n*BN .. (n+1)*BN - 1 of row a over
the s-th of S equal parts of the contraction axis (S = 1 unless split), in blocks of BK
rows, accumulating in float32. BK, BN, S, warps and pipeline stages are arguments;
benchmarks/expert_matmul_bench.py sweeps them on the GPU. The weights are [E, K, N]
(`x @ W` layout), so a program reads BK segments of BN contiguous elements per block;
BN >= 64 keeps each segment at least a 128-byte line in bf16. At decode sizes the work is
a matrix-vector product per row, bound by the bytes of the experts, so the elementwise
product and sum (no tensor-core dot, which wants 16 rows) costs nothing that matters.

8-bit experts (models/quant.py's Fp8Weight: w in e4m3, a scale per expert and column) are
read as they are, converted in registers, and their columns scaled after the sum.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._compat import triton_params

MIN_BLOCK_N = 64
MIN_BLOCK_K = 64


def tuning(k: int, n: int) -> dict:
    """The default setting for a [k, n] expert matrix (keyword arguments of `expert_matmul`):
    among the fastest of benchmarks/expert_matmul_bench.py on Qwen3-30B-A3B's shapes at 8
    and 64 rows on an H100 (RESULTS.md, 2026-12-07 twelfth session):
    - columns in blocks of 128 (64 where n does not divide);
    - a long contraction (k >= 1024: gate_up, [2048, 1536]) split 4 ways, in blocks of 64:
      four times the programs, which a few rows need to keep enough loads in flight;
    - a shorter one (down, [768, 2048]) unsplit, in blocks of 256 with three pipeline stages.
    That sweep's first setting of each case read slow, so how much this gains over the first
    default (blocks of 64, unsplit) is not settled; a sweep with warm-up calls is to tell."""
    bn = 128 if n % 128 == 0 else MIN_BLOCK_N
    if k >= 1024 and (k // MIN_BLOCK_K) % 4 == 0:
        return dict(bk=MIN_BLOCK_K, bn=bn, splits=4, num_warps=4, num_stages=2)
    return dict(bk=block_k(k, 256), bn=bn, splits=1, num_warps=4, num_stages=3)


def supported(k: int, n: int) -> bool:
    """Whether a [k, n] expert matrix is a shape the kernel takes (any number of rows)."""
    return k % MIN_BLOCK_K == 0 and n % MIN_BLOCK_N == 0


def block_k(k: int, want: int) -> int:
    """The largest power of two <= `want` (and >= MIN_BLOCK_K) dividing k."""
    b = want
    while b > MIN_BLOCK_K and k % b:
        b //= 2
    return b


def _kernel(experts_ref, x_ref, w_ref, o_ref, *, block_k: int, block_n: int, steps: int):
    """Program (a, n, s): columns block n of row a over the s-th of the K splits (steps
    blocks of block_k rows each), into o_ref[s] (float32 partial sums where split)."""
    a = pl.program_id(0)
    n = pl.program_id(1)
    first = pl.program_id(2) * steps
    e = experts_ref[a]
    cols = pl.ds(n * block_n, block_n)

    def body(i, acc):
        rows = pl.ds((first + i) * block_k, block_k)
        xk = x_ref[a, rows].astype(jnp.float32)  # [BK]
        wk = w_ref[e, rows, cols].astype(jnp.float32)  # [BK, BN]
        return acc + jnp.sum(xk[:, None] * wk, axis=0)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((block_n,), jnp.float32))
    o_ref[pl.program_id(2), a, cols] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps", "num_stages", "bk", "bn", "splits",
                                             "out_dtype"))
def expert_matmul(x: jax.Array, w: jax.Array, experts: jax.Array, *, interpret: bool = False,
                  num_warps: int | None = None, num_stages: int | None = None, bk: int | None = None,
                  bn: int | None = None, splits: int | None = None, out_dtype=None, scale=None) -> jax.Array:
    """x [A, K], w [E, K, N], experts [A] int -> [A, N] in `out_dtype` (default x's dtype),
    row a = x[a] @ w[experts[a]] (times scale[experts[a]], [E, N] float32, where given: an
    8-bit w's column scales; w is then read in its own dtype).
    `bk`: the contraction block wanted (the largest power of two up to it dividing K);
    `bn`: the column block; `splits`: programs that share one output block's contraction
    (more programs in flight for few rows), their float32 partial sums added after the
    kernel (K / bk must divide by it). Each left None takes `tuning`'s value."""
    A, K = x.shape
    N = w.shape[2]
    given = dict(bk=bk, bn=bn, splits=splits, num_warps=num_warps, num_stages=num_stages)
    t = {**tuning(K, N), **{name: v for name, v in given.items() if v is not None}}
    bk, bn, splits, num_warps, num_stages = t["bk"], t["bn"], t["splits"], t["num_warps"], t["num_stages"]
    if K % MIN_BLOCK_K or N % bn:
        raise ValueError(f"expert_matmul needs K % {MIN_BLOCK_K} == 0 and N divisible by the column block "
                         f"{bn}; got K={K}, N={N}")
    bk = block_k(K, bk)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if (K // bk) % splits:
        raise ValueError(f"expert_matmul: {K // bk} contraction blocks do not split {splits} ways")
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=bk, block_n=bn, steps=K // bk // splits),
        grid=(A, N // bn, splits),
        # float32 partial sums where split, or where the scales come after.
        out_shape=jax.ShapeDtypeStruct((splits, A, N), out_dtype if splits == 1 and scale is None else jnp.float32),
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"expert_matmul_bk{bk}_bn{bn}_s{splits}",
    )(experts.astype(jnp.int32), x, w if scale is not None else w.astype(x.dtype))
    if scale is None:
        return out[0] if splits == 1 else out.sum(axis=0).astype(out_dtype)  # [S, A, N] -> [A, N]
    y = out.sum(axis=0)  # [S, A, N] float32 -> [A, N]
    return (y * scale[experts]).astype(out_dtype)  # [E, N][experts] -> [A, N]
