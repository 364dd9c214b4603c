"""Expert matmuls of a few tokens (mixture-of-experts decode), reading each chosen expert's
weights where they are.

`expert_matmul(x, w, experts)[a] = x[a] @ w[experts[a]]`: row a of x times the matrix of
expert experts[a]. XLA computes this by gathering the experts' matrices into a new array
and then multiplying (models/moe.py, "grouped" with blocks of one row): the chosen weights
are read, written and read again. Here each program reads its block of the expert's
matrix straight from the weights, once.

Grid (A, N / BN): program (a, n) computes columns n*BN .. (n+1)*BN - 1 of row a, over the
contraction axis in blocks of BK rows, accumulating in float32. The weights are [E, K, N]
(`x @ W` layout), so a program reads BK segments of BN contiguous elements per block;
BN >= 64 keeps each segment at least a 128-byte line in bf16. At decode sizes the work is
a matrix-vector product per row, bound by the bytes of the experts, so the elementwise
product and sum (no tensor-core dot, which wants 16 rows) costs nothing that matters.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._compat import triton_params

# Programs to aim for: about two per SM of an H200 (132 SMs), as the attention kernels.
TARGET_PROGRAMS = 264
MIN_BLOCK_N, MAX_BLOCK_N = 64, 256
BLOCK_K = 64


def block_n(rows: int, n: int) -> int | None:
    """The column block for `rows` rows of width n: the largest power of two in
    [MIN_BLOCK_N, MAX_BLOCK_N] dividing n that still gives TARGET_PROGRAMS programs (or the
    smallest allowed one), None where none divides n."""
    choice = None
    b = MIN_BLOCK_N
    while b <= MAX_BLOCK_N and n % b == 0:
        if choice is None or rows * (n // b) >= TARGET_PROGRAMS:
            choice = b
        b *= 2
    return choice


def supported(rows: int, k: int, n: int) -> bool:
    return k % BLOCK_K == 0 and block_n(rows, n) is not None


def _kernel(experts_ref, x_ref, w_ref, o_ref, *, block_k: int, block_n: int, steps: int):
    a = pl.program_id(0)
    n = pl.program_id(1)
    e = experts_ref[a]
    cols = pl.ds(n * block_n, block_n)

    def body(i, acc):
        rows = pl.ds(i * block_k, block_k)
        xk = x_ref[a, rows].astype(jnp.float32)  # [BK]
        wk = w_ref[e, rows, cols].astype(jnp.float32)  # [BK, BN]
        return acc + jnp.sum(xk[:, None] * wk, axis=0)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((block_n,), jnp.float32))
    o_ref[a, cols] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def expert_matmul(x: jax.Array, w: jax.Array, experts: jax.Array, *, interpret: bool = False,
                  num_warps: int = 4) -> jax.Array:
    """x [A, K], w [E, K, N], experts [A] int -> [A, N] in x's dtype, row a = x[a] @ w[experts[a]]."""
    A, K = x.shape
    N = w.shape[2]
    bn = block_n(A, N)
    if K % BLOCK_K or bn is None:
        raise ValueError(f"expert_matmul needs K % {BLOCK_K} == 0 and N divisible by {MIN_BLOCK_N}; "
                         f"got K={K}, N={N}")
    return pl.pallas_call(
        functools.partial(_kernel, block_k=BLOCK_K, block_n=bn, steps=K // BLOCK_K),
        grid=(A, N // bn),
        out_shape=jax.ShapeDtypeStruct((A, N), x.dtype),
        interpret=interpret,
        compiler_params=triton_params(num_warps, 2),
        name=f"expert_matmul_bn{bn}",
    )(experts.astype(jnp.int32), x, w.astype(x.dtype))
