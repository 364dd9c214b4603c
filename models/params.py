"""Model weights as registered pytree dataclasses.

Layout (chosen for the decode path, design.md section 5): the four big matrices of each
layer are separate arrays walked by an unrolled Python loop (no `lax.scan`, which
materializes per-layer slices: 2.9x the bandwidth floor), while the small per-layer
vectors (norm weights, biases) are stacked `[L, ...]` so the step has few pytree leaves
(dispatch cost grows with the leaf count). Matrices are stored `x @ W` style: `[in, out]`.
"""
from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerParams:
    wqkv: jax.Array  # [D, (H + 2 * KVH) * HD]: q, k, v projections concatenated on the output axis
    wo: jax.Array  # [H * HD, D]
    w_gate_up: jax.Array  # [D, 2 * F]: gate then up
    w_down: jax.Array  # [F, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelParams:
    embed: jax.Array  # [V, D]
    final_norm: jax.Array  # [D]
    attn_norm: jax.Array  # [L, D]
    mlp_norm: jax.Array  # [L, D]
    layers: tuple[LayerParams, ...]
    lm_head: jax.Array | None = None  # [D, V]; None when tied to `embed`
    q_norm: jax.Array | None = None  # [L, HD] (Qwen3 qk-norm)
    k_norm: jax.Array | None = None  # [L, HD]
    bqkv: jax.Array | None = None  # [L, (H + 2 * KVH) * HD] (Qwen2 qkv bias)
