"""Residual add and RMS norm in one kernel, for the decode path.

XLA compiles `x = x + delta; h = rms_norm(x) * w` into three kernels (the add, the sum of
squares, the scaling), and a decode step has two such sites per layer. At decode batch
sizes each kernel is a few microseconds of launch and tail for almost no work, so the
three become one here: one program per row holds the whole hidden vector.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._compat import triton_params


def supported(hidden: int) -> bool:
    """Triton blocks are powers of two; the row must fit one program's registers."""
    return hidden >= 16 and hidden & (hidden - 1) == 0 and hidden <= 16384


def _kernel(x_ref, d_ref, w_ref, x_out_ref, h_ref, *, eps):
    x = x_ref[...] + d_ref[...]  # [1, D], rounded to the dtype as XLA's add rounds it
    x_out_ref[...] = x
    x32 = x.astype(jnp.float32)
    inv = lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)  # [1, 1]
    h_ref[...] = w_ref[...] * (x32 * inv).astype(x.dtype)  # models/transformer.rms_norm's rounding


@functools.partial(jax.jit, static_argnames=("row", "eps", "interpret", "num_warps"))
def add_rms_norm(x, delta, weights, *, row: int, eps: float, interpret: bool = False, num_warps: int = 4):
    """(x + delta, rms_norm(x + delta) * weights[row]).

    x, delta: [R, D]; weights: [N, D] stacked norm weights (the layer's row is picked by
    the kernel's block index, so no slice of the stack runs as a kernel of its own).
    """
    R, D = x.shape
    if not supported(D):
        raise ValueError(f"hidden size {D} is not a power of two in [16, 16384]")
    row_spec = pl.BlockSpec((1, D), lambda r: (r, 0))
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        grid=(R,),
        in_specs=[row_spec, row_spec, pl.BlockSpec((1, D), lambda r: (row, 0))],
        out_specs=[row_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct((R, D), x.dtype), jax.ShapeDtypeStruct((R, D), x.dtype)],
        interpret=interpret,
        compiler_params=triton_params(num_warps, 1),
        name="add_rms_norm",
    )(x, delta.astype(x.dtype), weights.astype(x.dtype))
