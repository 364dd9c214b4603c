"""Matmuls of a few rows (decode steps, small verify windows, short prefill chunks) with 8-bit
weights: x [M, K] @ q [K, N], q in float8 e4m3, in float32, for models/quant.linear to scale
per column. Off in the engine until it has run on a GPU (PallasAttention(fp8_matmul=True)).

Why: XLA fuses the 8-bit matrix's conversion into its matmul, but that fusion read Qwen3-8B's
8-bit weights at 1.5 TB/s on an H100 against 2.8 TB/s for the bf16 matmul
(benchmarks/quant_matmul_probe.py, RESULTS.md 2026-12-07), so halving the bytes saved only
9% of a decode step. Here each program loads its blocks of the 8-bit matrix once, converts
them in registers and multiplies on the tensor cores.

Grid (N / BN, S): program (n, s) takes every row of x (padded to BM >= 16 rows, the
tensor-core dot's least) and the columns n*BN .. (n+1)*BN - 1, over the s-th of S equal
parts of the contraction in blocks of BK, accumulating in float32. A decode step's matrices
have few column blocks (Qwen3-8B's o_proj: 4096 / 128 = 32), so S splits the contraction
until there are about two programs per SM; their partial sums are added after the kernel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._compat import triton_params
from ._tile import next_pow2

# Rows one program holds: a decode batch of 64, or a few speculative windows. The f32
# [BM, BN] accumulator must stay in registers; more rows go through XLA's matmul.
MAX_ROWS = 64
BLOCK_N = 128
BLOCK_K = 128
# Programs to aim for: about two per SM of an H100 / H200 (132 SMs).
TARGET_PROGRAMS = 264


def supported(rows: int, k: int, n: int) -> bool:
    """Whether x [rows, k] @ [k, n] is a shape the kernel takes."""
    return 0 < rows <= MAX_ROWS and k % BLOCK_K == 0 and n % BLOCK_N == 0


def choose_splits(k: int, n: int, block_k: int = BLOCK_K, block_n: int = BLOCK_N) -> int:
    """The contraction's split: the largest power of two that keeps programs near
    TARGET_PROGRAMS and divides the contraction's blocks."""
    want = max(1, TARGET_PROGRAMS // (n // block_n))
    splits = 1
    while splits * 2 <= want and (k // block_k) % (splits * 2) == 0:
        splits *= 2
    return splits


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, block_n: int, steps: int):
    """Program (n, s): columns block n of every row over contraction blocks
    [s * steps, (s + 1) * steps), into o_ref[s]."""
    n = pl.program_id(0)
    first = pl.program_id(1) * steps
    cols = pl.ds(n * block_n, block_n)

    def body(i, acc):
        ks = pl.ds((first + i) * block_k, block_k)
        xk = x_ref[:, ks]  # [BM, BK]
        wk = w_ref[ks, cols].astype(xk.dtype)  # [BK, BN], converted in registers
        return acc + jnp.dot(xk, wk, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((x_ref.shape[0], block_n), jnp.float32))
    o_ref[pl.program_id(1), :, cols] = acc


@functools.partial(jax.jit, static_argnames=("interpret", "splits", "num_warps", "num_stages"))
def fp8_matmul(x: jax.Array, q: jax.Array, *, interpret: bool = False, splits: int | None = None,
               num_warps: int = 4, num_stages: int = 3) -> jax.Array:
    """x [M, K] (bf16 or f32) @ q [K, N] (an 8-bit float matrix) -> float32 [M, N], the
    product of x with q converted to x's dtype. `splits` (None: `choose_splits`) programs
    share each column block's contraction."""
    M, K = x.shape
    N = q.shape[1]
    if q.shape[0] != K or not supported(M, K, N):
        raise ValueError(f"fp8_matmul takes x [M <= {MAX_ROWS}, K] and q [K, N] with K % {BLOCK_K} == 0 and "
                         f"N % {BLOCK_N} == 0; got x {list(x.shape)}, q {list(q.shape)}")
    splits = splits or choose_splits(K, N)
    if (K // BLOCK_K) % splits:
        raise ValueError(f"fp8_matmul: {K // BLOCK_K} contraction blocks do not split {splits} ways")
    rows = max(16, next_pow2(M))
    xp = jnp.pad(x, ((0, rows - M), (0, 0)))  # [M, K] -> [BM, K]: zero rows, sliced off below
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=BLOCK_K, block_n=BLOCK_N, steps=K // BLOCK_K // splits),
        grid=(N // BLOCK_N, splits),
        out_shape=jax.ShapeDtypeStruct((splits, rows, N), jnp.float32),
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"fp8_matmul_bm{rows}_s{splits}",
    )(xp, q)
    return out.sum(axis=0)[:M]  # [S, BM, N] -> [M, N]
