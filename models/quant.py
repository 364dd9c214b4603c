"""FP8 weights: the engine's `quantization="fp8"`, weight-only 8-bit matrices.

A decode step at small batch reads every weight once, so its time follows the weight bytes;
8-bit weights halve them (and free half the weights' memory for the KV cache). Each weight
matrix [in, out] becomes an `Fp8Weight`: its values divided by one scale per output column
(the column's largest magnitude over e4m3's largest, 448) in float8_e4m3fn, and the float32
scales. A matmul with it (`linear`) converts the 8-bit matrix to the activations' dtype
inside the program and multiplies the output columns by their scales, which is the
weight's matmul up to where the scale is applied (after the sum instead of before each
product). Activations, the KV cache, the embedding, the LM head and the norms stay in the
model's dtype, as vLLM's weight-only schemes keep them.

Per-column scales rather than one per tensor: a column's few outliers then cost only that
column precision. FP8 checkpoints whose scales cover 128 x 128 blocks (models/loader.py
multiplies those out at load) are quantized again per column here: a second rounding, at
most half a unit of e4m3's last place more per weight.

The layers' matrices are quantized (QUANTIZED_MATRICES): attention, the MLP, and in a
mixture-of-experts layer every expert's (one scale per expert and column) and the shared
expert's; the router stays in the model's dtype. The experts' XLA plans (models/moe.py) take
8-bit experts through `batched_linear`, `take` and `index`; the Pallas expert-matmul kernel
reads them too (models/moe.kernel_fits says when it is chosen). Leading axes
(stacked layers [G, in, out], experts [E, in, out]) carry through: `scale` is then
[G, out] or [E, out].
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
# Every matrix a token's hidden state goes through but the router and the shared expert's
# [D, 1] gate (a MoE layer's w_gate_up / w_down hold its experts: [E, in, out]).
QUANTIZED_MATRICES = ("wqkv", "wo", "w_gate_up", "w_down", "w_shared_gate_up", "w_shared_down")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Fp8Weight:
    q: jax.Array  # [..., in, out] float8_e4m3fn: the weight over its column's scale
    scale: jax.Array  # [..., out] float32

    # Read like the array it stands for, where the layer code looks at a weight's form.
    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def ndim(self) -> int:
        return self.q.ndim

    @property
    def size(self) -> int:
        return self.q.size

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def __getitem__(self, i) -> "Fp8Weight":
        """A static index or slice on the leading axis of stacked weights ([G, in, out]):
        layer i's matrix. (On one matrix an index would pick rows of `q` but columns'
        scales, so it is refused.)"""
        if self.q.ndim < 3 or not isinstance(i, (int, slice)):
            raise TypeError(f"an Fp8Weight of shape {self.shape} takes an index on its leading (layer) axis "
                            f"of stacked weights only, not {i!r}")
        return Fp8Weight(self.q[i], self.scale[i])

    def delete(self) -> None:
        self.q.delete()
        self.scale.delete()

    def dequantized(self, dtype=jnp.float32) -> jax.Array:
        return (self.q.astype(jnp.float32) * self.scale[..., None, :]).astype(dtype)


@jax.jit
def quantize_fp8(w: jax.Array) -> Fp8Weight:
    """w [..., in, out] -> Fp8Weight with one scale per output column."""
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=-2)  # [..., out]
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)  # an all-zero column keeps scale 1
    q = (w32 / scale[..., None, :]).astype(FP8)  # [..., in, out]
    return Fp8Weight(q, scale)


def linear(x: jax.Array, w, preferred_element_type=None, kernel=None) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] in `preferred_element_type` (x's dtype when
    None), for a plain or an Fp8Weight matrix. The 8-bit matrix is converted in the program
    and the scales multiply the float32 output columns. The conversion happens in `kernel`
    (the attention backend's `fp8_matmul`: x [M, in], q [in, out] -> float32 [M, out];
    pallas_kernels/fp8_matmul.py) where one is given and takes the shape, else in XLA's
    fusion of it into the matmul."""
    if not isinstance(w, Fp8Weight):
        return jnp.dot(x, w, preferred_element_type=preferred_element_type)
    rows = math.prod(x.shape[:-1])
    if kernel is not None and w.q.ndim == 2 and _kernel_fits(rows, *w.q.shape):
        y = kernel(x.reshape(rows, x.shape[-1]), w.q).reshape(*x.shape[:-1], w.q.shape[1])  # [M, out] -> [..., out]
    else:
        y = jnp.dot(x, w.q.astype(x.dtype), preferred_element_type=jnp.float32)  # [..., out]
    return (y * w.scale).astype(preferred_element_type or x.dtype)


def _kernel_fits(rows: int, k: int, n: int) -> bool:
    from jaxoverlap.pallas_kernels.fp8_matmul import supported

    return supported(rows, k, n)


def batched_linear(spec: str, x: jax.Array, w, preferred_element_type=None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a batch of matrices w [B, in, out] (experts), contracting
    x [B, rows, in] into [B, rows, out]; for an Fp8Weight (scales [B, out]) the product is
    taken in float32, scaled per batch and column, and cast to `preferred_element_type` (x's
    dtype when None), as the plain einsum returns it."""
    if not isinstance(w, Fp8Weight):
        return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)
    y = jnp.einsum(spec, x, w.q.astype(x.dtype), preferred_element_type=jnp.float32)  # [B, rows, out]
    return (y * w.scale[:, None, :]).astype(preferred_element_type or x.dtype)


def take(w, experts: jax.Array):
    """w[experts] (an index array into the leading, expert axis) for a plain or an Fp8Weight
    stack of expert matrices: a gather of the 8-bit matrices and their scales alike."""
    return jax.tree.map(lambda a: a[experts], w)


def index(w, e: jax.Array):
    """Expert e's matrix (a traced index) of a plain or an Fp8Weight stack: dynamic slices."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, e, axis=0, keepdims=False), w)


def stack(parts) -> jax.Array | Fp8Weight:
    """G matrices of one kind -> one [G, ...] matrix, plain or Fp8Weight."""
    if isinstance(parts[0], Fp8Weight):
        return Fp8Weight(jnp.stack([p.q for p in parts]), jnp.stack([p.scale for p in parts]))
    return jnp.stack(parts)


def quantize_layer(layer, *, delete_source: bool = False):
    """One LayerParams (or a group or stack of layers) with its QUANTIZED_MATRICES as
    Fp8Weight; already quantized matrices stay as they are. With `delete_source`, each
    matrix is deleted as soon as its 8-bit copy exists."""
    out = {}
    for name in QUANTIZED_MATRICES:
        w = getattr(layer, name)
        if w is None or isinstance(w, Fp8Weight):
            continue
        out[name] = quantize_fp8(w)
        if delete_source:
            jax.block_until_ready(out[name])
            w.delete()
    return dataclasses.replace(layer, **out)


def quantize_params(params, *, delete_source: bool = False):
    """ModelParams with the layers' matrices (QUANTIZED_MATRICES) as Fp8Weight, in any
    layer form (per layer, groups, one stack) and sharding (each matrix's quantized arrays
    keep its layout: the scale that of its output axis). With `delete_source` (weights the
    engine loaded itself), each matrix is deleted as soon as its 8-bit copy exists, so the
    memory peak is the weights plus one matrix. (The loader can quantize each layer as it
    loads it: load_params' `quantization`.) Already quantized matrices stay as they are."""
    from jaxoverlap.models.params import LayerParams

    layers = params.layers
    if isinstance(layers, LayerParams):
        new = quantize_layer(layers, delete_source=delete_source)
    else:
        new = tuple(quantize_layer(l, delete_source=delete_source) for l in layers)
    return dataclasses.replace(params, layers=new)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_params(params, dtype=jnp.float32):
    """The weights an Fp8Weight tree stands for, as plain matrices of `dtype` (tests and
    reference checks)."""
    return jax.tree.map(lambda w: w.dequantized(dtype) if isinstance(w, Fp8Weight) else w, params,
                        is_leaf=lambda w: isinstance(w, Fp8Weight))
