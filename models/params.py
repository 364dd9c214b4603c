"""Model weights as registered pytree dataclasses.

Layout (chosen for the decode path, design.md section 5): the forward walks the layers in
an unrolled Python loop (no `lax.scan`, which materializes per-layer slices: 2.9x the
bandwidth floor). The small per-layer vectors (norm weights, biases) are stacked `[L, ...]`
so the step has few pytree leaves (dispatch cost grows with the leaf count). The four big
matrices of each layer come from the loader as one LayerParams per layer. With
`layers_per_weight_stack` G > 1 (one device; engine config) the engine stacks them too
(`stack_layers`): `layers` is then a tuple of LayerParams of `[G, in, out]` arrays, read
through static slices `w[i % G]`. `layer_at` reads every form. Matrices are stored
`x @ W` style: `[in, out]`.

Mixture-of-experts layers (models/moe.py) hold their experts' MLPs in the same two fields,
with an expert axis first: `w_gate_up [E, D, 2F]`, `w_down [E, F, D]`, and the router
`w_router [D, E]` (None in dense layers). Stacking puts the layer axis before the expert axis.
Qwen2-MoE's shared expert is a dense MLP of its own width Fs beside them: `w_shared_gate_up
[D, 2Fs]` (per-shard [gate | up] blocks, as a dense `w_gate_up`), `w_shared_down [Fs, D]`,
and its output gate `w_shared_gate [D, 1]` (all None in layers without one).

Fused column blocks under tensor parallelism. `wqkv` (and `bqkv`) fuse q, k and v on the
output axis, `w_gate_up` fuses gate and up. Sharding such an axis over N devices in the
plain order [q | k | v] would cut across the q/k/v boundaries, and XLA would then move
activations between devices to split q, k and v. So the output axis is stored as N
contiguous per-shard blocks, `[in, N, per_shard]` flattened:

    wqkv      [D, N * (H/N + 2 KVH/N) * HD]   block s = [q heads of s | k heads of s | v heads of s]
    w_gate_up [D, N * 2F/N]                    block s = [gate cols of s | up cols of s]

with shard s holding q heads s*H/N .. (s+1)*H/N - 1, kv heads s*KVH/N .., and MLP columns
s*F/N .. (s+1)*F/N - 1 (the rows of wo / w_down that the same device holds), so GQA groups
stay on one device. N = 1 is the plain HF order. `LayerParams.qkv_shards` and
`gate_up_shards` record N (static pytree metadata; `gate_up_shards` is that of the shared
expert's `w_shared_gate_up` too); a shape that does not divide by the tensor-parallel size
keeps N = 1 (see `layout_shards`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxoverlap.models import quant
from jaxoverlap.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerParams:
    wqkv: jax.Array  # [D, (H + 2 * KVH) * HD]: per-shard [q | k | v] blocks (module docstring)
    wo: jax.Array  # [H * HD, D]
    w_gate_up: jax.Array  # [D, 2 * F]: per-shard [gate | up] blocks ([E, D, 2 * F] in a MoE layer)
    w_down: jax.Array  # [F, D] ([E, F, D] in a MoE layer)
    w_router: jax.Array | None = None  # [D, E]: a MoE layer's router; None in a dense layer
    # A MoE layer's shared expert (Qwen2-MoE), None without one: its SwiGLU MLP of width Fs,
    # in the per-shard [gate | up] layout of `gate_up_shards`, and its output gate.
    w_shared_gate_up: jax.Array | None = None  # [D, 2 * Fs]
    w_shared_down: jax.Array | None = None  # [Fs, D]
    w_shared_gate: jax.Array | None = None  # [D, 1]
    # Static, so the forward knows how to split the fused outputs at trace time.
    qkv_shards: int = dataclasses.field(default=1, metadata=dict(static=True))
    gate_up_shards: int = dataclasses.field(default=1, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelParams:
    embed: jax.Array  # [V, D]
    final_norm: jax.Array  # [D]
    attn_norm: jax.Array  # [L, D]
    mlp_norm: jax.Array  # [L, D]
    layers: tuple[LayerParams, ...] | LayerParams  # one per layer, or one of [L, ...] arrays (stack_layers)
    lm_head: jax.Array | None = None  # [D, V]; None when tied to `embed`
    q_norm: jax.Array | None = None  # [L, HD] (Qwen3 qk-norm)
    k_norm: jax.Array | None = None  # [L, HD]
    bqkv: jax.Array | None = None  # [L, (H + 2 * KVH) * HD] (Qwen2 qkv bias), in the layers' qkv_shards layout
    # [L, 2] float32: an 8-bit KV cache's scale of K and of V per layer (a checkpoint's
    # calibrated k_scale / v_scale; the engine sets it); None: 1.
    kv_scales: jax.Array | None = None


MATRICES = ("wqkv", "wo", "w_gate_up", "w_down", "w_router", "w_shared_gate_up", "w_shared_down", "w_shared_gate")


def matrices(layer: LayerParams) -> tuple[str, ...]:
    """The names of `layer`'s weight arrays (MATRICES less those its kind of layer lacks)."""
    return tuple(name for name in MATRICES if getattr(layer, name) is not None)


def _is_grouped(layers) -> bool:
    """Whether `layers` is a tuple of [G, in, out] groups (not one LayerParams per layer)."""
    return isinstance(layers, tuple) and bool(layers) and layers[0].wqkv.ndim == 3


def layers_per_stack(params) -> int:
    """How many layers share one weight array: 1 per layer (and for weights without
    `layers`, such as EAGLE's), G for groups, L for one stack. A static property of the
    pytree: programs compiled for one layout do not take the other."""
    layers = getattr(params, "layers", None)
    if isinstance(layers, LayerParams):
        return layers.wqkv.shape[0]
    if _is_grouped(layers):
        return layers[0].wqkv.shape[0]
    return 1


def num_layers(params: ModelParams) -> int:
    layers = params.layers
    if isinstance(layers, LayerParams):
        return layers.wqkv.shape[0]
    return sum(l.wqkv.shape[0] for l in layers) if _is_grouped(layers) else len(layers)


def layer_at(params: ModelParams, i: int) -> LayerParams:
    """Layer i's weights, from any form of `params.layers`. A static slice of a stacked
    matrix, which XLA's matmul reads in place: the unrolled chain over stacked weights runs
    at the bandwidth floor (benchmarks/scan_probe.py), unlike a loop over them."""
    layers = params.layers
    if isinstance(layers, LayerParams):
        # [L, in, out] -> [in, out]
        return dataclasses.replace(layers, **{name: getattr(layers, name)[i] for name in matrices(layers)})
    if _is_grouped(layers):  # groups of G consecutive layers (the last may hold fewer)
        G = layers[0].wqkv.shape[0]
        group = layers[i // G]
        # [G, in, out] -> [in, out]
        return dataclasses.replace(group, **{name: getattr(group, name)[i % G] for name in matrices(group)})
    return layers[i]


def stack_layers(params: ModelParams, *, group_size: int | None = None, delete_source: bool = False) -> ModelParams:
    """The same weights with each of the four matrices of `group_size` consecutive layers in
    one `[G, in, out]` array: `layers` becomes a tuple of such groups (the last may hold
    fewer layers), or, with `group_size=None`, one LayerParams of `[L, in, out]` arrays. Why:
    every array is an argument leaf of each jitted step, and the host's cost per call grows
    with the leaf count (Qwen3-8B: 151 weight leaves; 43 in groups of 4; 11 in one stack).

    Why groups and not one stack: XLA autotunes each distinct matmul fusion once, and the
    static slice `w[i % G]` fused into a Triton GEMM is part of the fusion, so the layers'
    matmuls are 4 G distinct fusions (4 per layer). One stack of 36 layers compiled the
    Qwen3-8B forward in 31.6 s against 4.6 s per layer, groups of 4 in 6.6 s, with the
    same forward time (H200, benchmarks/stack_compile_probe.py; RESULTS.md).

    With `delete_source` (weights the engine loaded itself), each kind's per-layer arrays
    are deleted as soon as its stack exists, so the memory peak is the weights plus one
    group's stacks, not twice the weights. Group by group, each group's largest kind first:
    the layers were loaded one after another, so one group's arrays sit together in device
    memory and, deleted, leave one free block that the next group's stacks fit. Kind by kind
    over all groups left holes of one layer's array between live ones: Qwen3-30B-A3B (57 GiB)
    on an 80 GB H100 found no free 3 GiB block for a group's experts (RESULTS.md, 2026-12-07
    twelfth session). Under tensor parallelism the engine keeps per-layer arrays."""
    if not isinstance(params.layers, tuple) or _is_grouped(params.layers):
        return params  # already stacked
    layers = params.layers
    first = layers[0]
    if any((l.qkv_shards, l.gate_up_shards) != (first.qkv_shards, first.gate_up_shards) for l in layers):
        raise ValueError("layers with different fused-column layouts cannot be stacked")
    G = len(layers) if group_size is None else group_size
    if G < 1:
        raise ValueError(f"group_size must be at least 1, not {G}")
    groups = [dict() for _ in range(0, len(layers), G)]
    names = sorted(matrices(first), key=lambda name: -getattr(first, name).size)  # largest first
    for g, start in enumerate(range(0, len(layers), G)):
        for name in names:
            parts = [getattr(l, name) for l in layers[start:start + G]]
            groups[g][name] = quant.stack(parts)  # G x [in, out] -> [G, in, out] (plain or FP8)
            if delete_source:
                jax.block_until_ready(groups[g][name])  # the stack has read them
                for x in parts:
                    x.delete()
    stacked = tuple(dataclasses.replace(first, **arrays) for arrays in groups)
    return dataclasses.replace(params, layers=stacked[0] if group_size is None else stacked)


def unstack_layers(params: ModelParams) -> ModelParams:
    """The inverse of `stack_layers`: one LayerParams per layer (copies of the slices)."""
    if isinstance(params.layers, tuple) and not _is_grouped(params.layers):
        return params
    return dataclasses.replace(params, layers=tuple(layer_at(params, i) for i in range(num_layers(params))))


# ----------------------------------------------------------------------------------------
# Per-shard layout of fused column blocks
# ----------------------------------------------------------------------------------------


def layout_shards(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(qkv_shards, gate_up_shards) for tensor-parallel size `tp`: `tp` where the heads
    (both H and KVH, so that no GQA group straddles two devices) or F divide by it, else 1:
    the plain layout, whose axis parallel.py then shards or replicates as before."""
    qkv = tp if cfg.num_heads % tp == 0 and cfg.num_kv_heads % tp == 0 else 1
    # F is the MLP's width, each expert's in a MoE model (whose experts split the same way).
    # A shared expert's width must divide too: one layout (one static field) serves both.
    fits = cfg.intermediate_size % tp == 0 and cfg.shared_expert_intermediate_size % tp == 0
    return qkv, tp if fits else 1


def qkv_sizes(cfg: ModelConfig) -> tuple[int, int, int]:
    """Widths of the q, k and v parts of the fused qkv axis."""
    return cfg.q_size, cfg.kv_size, cfg.kv_size


def gate_up_sizes(cfg: ModelConfig) -> tuple[int, int]:
    return cfg.intermediate_size, cfg.intermediate_size


def shared_gate_up_sizes(cfg: ModelConfig) -> tuple[int, int]:
    """Widths of the gate and up parts of a shared expert's fused axis."""
    return cfg.shared_expert_intermediate_size, cfg.shared_expert_intermediate_size


def to_shard_blocks(x: jax.Array, sizes: tuple[int, ...], shards: int) -> jax.Array:
    """Plain order [b_0 | b_1 | ...] (widths `sizes`) on the last axis -> `shards` blocks of
    [b_0/N | b_1/N | ...]. The identity for shards == 1."""
    if shards == 1:
        return x
    lead = x.shape[:-1]
    parts, start = [], 0
    for size in sizes:
        # [..., size] -> [..., N, size/N]: column slice s of this part goes to shard s.
        parts.append(x[..., start:start + size].reshape(*lead, shards, size // shards))
        start += size
    blocks = jnp.concatenate(parts, axis=-1)  # [..., N, sum(sizes)/N]
    return blocks.reshape(*lead, start)  # [..., N, sum/N] -> [..., sum]


def from_shard_blocks(x: jax.Array, sizes: tuple[int, ...], shards: int) -> jax.Array:
    """The inverse of `to_shard_blocks`."""
    if shards == 1:
        return x
    lead, total = x.shape[:-1], x.shape[-1]
    blocks = x.reshape(*lead, shards, total // shards)  # [..., sum] -> [..., N, sum/N]
    parts, start = [], 0
    for size in sizes:
        part = blocks[..., start:start + size // shards]  # [..., N, size/N]
        parts.append(part.reshape(*lead, size))  # [..., N, size/N] -> [..., size]
        start += size // shards
    return jnp.concatenate(parts, axis=-1)  # [..., sum]


@functools.partial(jax.jit, static_argnames=("sizes", "have", "want"))
def _relayout_one(x: jax.Array, sizes: tuple[int, ...], have: int, want: int) -> jax.Array:
    # Through the plain order: one device-side copy of the matrix.
    return to_shard_blocks(from_shard_blocks(x, sizes, have), sizes, want)


def relayout(params, cfg: ModelConfig, tp: int):
    """`params` (ModelParams, or EagleParams with its one `.layer`) with the fused blocks in
    the layout of tensor-parallel size `tp` for `cfg`'s shapes, converted on the device from
    whatever layout they have. Returns `params` itself when the layout already matches
    (weights loaded with the engine's `tensor_parallel_size` do)."""
    want_qkv, want_gu = layout_shards(cfg, tp)
    single = not hasattr(params, "layers")
    # One LayerParams: EagleParams' layer, or stacked layers (the conversions below work on
    # the last axis, so a stack converts as one array).
    one = single or isinstance(params.layers, LayerParams)
    layers = (params.layer,) if single else (params.layers,) if one else params.layers
    if all(l.qkv_shards == want_qkv and l.gate_up_shards == want_gu for l in layers):
        return params

    def convert(x, sizes, have, want):
        if have == want or x is None:
            return x
        if isinstance(x, quant.Fp8Weight):  # its scales [.., out] permute with its columns
            return quant.Fp8Weight(_relayout_one(x.q, sizes, have, want), _relayout_one(x.scale, sizes, have, want))
        return _relayout_one(x, sizes, have, want)

    new_layers = tuple(
        dataclasses.replace(
            l, wqkv=convert(l.wqkv, qkv_sizes(cfg), l.qkv_shards, want_qkv),
            w_gate_up=convert(l.w_gate_up, gate_up_sizes(cfg), l.gate_up_shards, want_gu),
            # The shared expert's gate_up shares the layer's gate_up_shards, with its own widths.
            w_shared_gate_up=convert(l.w_shared_gate_up, shared_gate_up_sizes(cfg), l.gate_up_shards, want_gu),
            qkv_shards=want_qkv, gate_up_shards=want_gu)
        for l in layers
    )
    # The bias follows its layers' qkv layout (all layers share one).
    bqkv = None if params.bqkv is None else convert(params.bqkv, qkv_sizes(cfg), layers[0].qkv_shards, want_qkv)
    if single:
        return dataclasses.replace(params, layer=new_layers[0], bqkv=bqkv)
    return dataclasses.replace(params, layers=new_layers[0] if one else new_layers, bqkv=bqkv)
