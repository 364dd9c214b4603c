"""The decoder-only transformer shared by Qwen3, Qwen2, Llama 3.x, Mistral and their
mixture-of-experts kin (Qwen3-MoE, Qwen2-MoE, Mixtral: models/moe.py), over a paged KV cache.

One forward covers every kind of step: a batch is `R` rows of `Q` query tokens each
(decode: Q=1; speculative verify: Q=1+k; chunked prefill: Q=chunk), every row belongs to
one relay entry whose `req_to_token` row maps token positions to KV-cache slots.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxoverlap.models.config import ModelConfig
from jaxoverlap.models.moe import moe_mlp, swiglu_mlp
from jaxoverlap.models.params import LayerParams, ModelParams, layer_at, num_layers
from jaxoverlap.models.quant import linear  # a plain or an FP8 weight matrix (engine's quantization)
# The XLA gather path is the CPU production path and the reference of the Pallas kernels.
from jaxoverlap.pallas_kernels.reference import paged_attention_ref as xla_paged_attention
from jaxoverlap.pallas_kernels.reference import to_cache_dtype  # an 8-bit cache saturates
from jaxoverlap.scatter import dropped_where_invalid

# attention(q, k_cache, v_cache, layer, req_to_token, entries, q_positions, kv_lens, *, scale, ctx_len)
AttentionFn = Callable[..., jax.Array]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # Normalize in float32 and cast back before the weight, as the HF reference does.
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE. x: [R, Q, N, HD]; positions: [R, Q]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [R, Q, HD/2]
    cos = jnp.cos(angles)[:, :, None, :]  # [R, Q, 1, HD/2]
    sin = jnp.sin(angles)[:, :, None, :]
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def split_qkv(qkv: jax.Array, H: int, KVH: int, HD: int, shards: int):
    """Fused [R, Q, (H + 2KVH) * HD] projections in the per-shard layout of models/params.py
    -> q [R, Q, H, HD], k, v [R, Q, KVH, HD].

    The split happens inside each shard's block, so when the fused axis is sharded over
    `shards` devices every device splits its own block: no data crosses devices, and q, k, v
    come out sharded on their head axes (shard s holds q heads s*H/N.., kv heads s*KVH/N..).
    """
    R, Q = qkv.shape[:2]
    hs, kvs = H // shards, KVH // shards  # heads per shard
    blocks = qkv.reshape(R, Q, shards, (hs + 2 * kvs) * HD)  # [R, Q, N*per] -> [R, Q, N, per]
    # [R, Q, N, hs*HD] -> [R, Q, H, HD]: shard-major, so head s*hs + j is shard s's j-th head.
    q = blocks[..., : hs * HD].reshape(R, Q, H, HD)
    k = blocks[..., hs * HD : (hs + kvs) * HD].reshape(R, Q, KVH, HD)  # [R, Q, N, kvs*HD] -> [R, Q, KVH, HD]
    v = blocks[..., (hs + kvs) * HD :].reshape(R, Q, KVH, HD)  # [R, Q, N, kvs*HD] -> [R, Q, KVH, HD]
    return q, k, v


def gated_mlp(h: jax.Array, lw: LayerParams, fp8_matmul=None) -> jax.Array:
    """SwiGLU MLP over [R, Q, D] with `w_gate_up` in its per-shard [gate | up] layout (the
    math lives in models/moe.py, whose shared experts are such MLPs too)."""
    return swiglu_mlp(h, lw.w_gate_up, lw.w_down, lw.gate_up_shards, fp8_matmul)  # [R, Q, D]


def mlp(h: jax.Array, lw: LayerParams, cfg: ModelConfig, expert_matmul=None, fp8_matmul=None) -> jax.Array:
    """The layer's MLP over [R, Q, D]: routed experts (and a shared expert where the layer
    has one) in a MoE layer, with the backend's `expert_matmul` kernel where it has one;
    else one SwiGLU. 8-bit matrices go through the backend's `fp8_matmul` where it has one."""
    if lw.w_router is not None:
        return moe_mlp(h, lw, top_k=cfg.experts_per_token, normalize=cfg.norm_topk_prob, expert_matmul=expert_matmul,
                       fp8_matmul=fp8_matmul)
    return gated_mlp(h, lw, fp8_matmul)


def write_cache(cache: jax.Array, layer: int, slots: jax.Array, valid: jax.Array, values: jax.Array,
                scale=None) -> jax.Array:
    """cache[layer, slots[t]] = values[t] (over the layer's cache `scale` where given),
    rounded to the cache's dtype, for every token t with valid[t]; the others write nothing
    (jaxoverlap/scatter.py says why not one shared slot). cache: [L, S, KVH, HD]; slots,
    valid: [N]; values: [N, KVH, HD]."""
    slots = dropped_where_invalid(slots, valid, cache.shape[1])
    return cache.at[layer, slots].set(to_cache_dtype(values, cache.dtype, scale), mode="drop")


def forward(
    params: ModelParams,
    cfg: ModelConfig,
    k_cache: jax.Array,
    v_cache: jax.Array,
    req_to_token: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    entries: jax.Array,
    q_valid: jax.Array,
    kv_lens: jax.Array,
    *,
    ctx_len: int,
    attention: AttentionFn = xla_paged_attention,
):
    """Run all layers over R rows of Q tokens, writing their K/V into the cache first.

    tokens, positions, q_valid: [R, Q]; entries, kv_lens: [R]; caches [L, S, KVH, HD].
    Returns (hidden [R, Q, D] after the final norm, k_cache, v_cache).
    """
    R, Q = tokens.shape
    H, KVH, HD = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    table_width = req_to_token.shape[1]
    # Where each new token's K/V goes. Invalid (padded) tokens and positions past the table
    # write nothing (`write_cache`); the fused decode kernel sends them to slot 0 of the
    # dummy page, which no request reads.
    in_table = q_valid & (positions < table_width)
    slots = jnp.where(in_table, req_to_token[entries[:, None], jnp.minimum(positions, table_width - 1)], 0)
    slots = slots.reshape(R * Q)  # [R, Q] -> [R*Q]
    writes = in_table.reshape(R * Q)  # [R, Q] -> [R*Q]
    inv_freq = cfg.rope_inv_freq()
    scale = 1.0 / float(np.sqrt(HD))
    # One kernel per layer for norm + RoPE + cache write + attention of one-token rows, where
    # the backend has it (pallas_kernels/fused_decode.py) and qkv is in the layout it takes
    # (one shard, or one per device under tensor parallelism: `fused_qkv_shards`); and one
    # for each residual add + RMS norm (pallas_kernels/add_norm.py).
    # An 8-bit cache's per-layer K and V scales ([L, 2]), or None (scale 1): see
    # pallas_kernels/reference.py for how attention takes them.
    kv_scales = params.kv_scales
    fused_scales = {} if kv_scales is None else {"kv_scales": kv_scales}
    fused = getattr(attention, "fused_decode", None) if Q == 1 else None
    fused_shards = getattr(attention, "fused_qkv_shards", 1)
    fused_add_norm = getattr(attention, "add_rms_norm", None) if Q == 1 else None
    expert_matmul = getattr(attention, "expert_matmul", None)  # models/moe.py: the "pallas" plan
    fp8_matmul = getattr(attention, "fp8_matmul", None)  # 8-bit weight matrices (models/quant.linear)
    D = params.embed.shape[1]
    if fused is not None or fused_add_norm is not None:
        from jaxoverlap.pallas_kernels import add_norm as add_norm_kernel
        from jaxoverlap.pallas_kernels.fused_decode import rope_frequencies

        rope_freq = rope_frequencies(inv_freq)
        if not add_norm_kernel.supported(D):  # e.g. hidden 5120: the XLA ops below
            fused_add_norm = None
    eps = cfg.rms_norm_eps

    def add_norm(x, delta, weights, row):
        """(x + delta, rms_norm(x + delta, weights[row])) with x, delta [R, Q, D]."""
        if fused_add_norm is not None:
            x, h = fused_add_norm(x.reshape(R * Q, D), delta.reshape(R * Q, D), weights, row=row, eps=eps)
            return x.reshape(R, Q, D), h.reshape(R, Q, D)  # [R*Q, D] -> [R, Q, D]
        x = x + delta
        return x, rms_norm(x, weights[row], eps)

    x = params.embed[tokens]  # [R, Q, D]
    h = rms_norm(x, params.attn_norm[0], eps)
    # An unrolled loop over per-layer arrays (not lax.scan): see models/params.py.
    L = num_layers(params)
    for i in range(L):
        lw = layer_at(params, i)
        qkv = linear(h, lw.wqkv, kernel=fp8_matmul)  # [R, Q, (H + 2KVH) * HD]
        if params.bqkv is not None:
            qkv = qkv + params.bqkv[i]
        if fused is not None and lw.qkv_shards == fused_shards:
            o, k_cache, v_cache = fused(
                qkv.reshape(R, -1), k_cache, v_cache, i, req_to_token, entries, positions[:, 0], kv_lens,
                slots, params.q_norm, params.k_norm, rope_freq, num_heads=H, num_kv_heads=KVH,
                eps=eps, scale=scale, ctx_len=ctx_len, **fused_scales)  # qkv [R, 1, W] -> [R, W]
        else:
            q, k, v = split_qkv(qkv, H, KVH, HD, lw.qkv_shards)  # [R, Q, H | KVH, HD]
            if params.q_norm is not None:
                q = rms_norm(q, params.q_norm[i], eps)
                k = rms_norm(k, params.k_norm[i], eps)
            q = apply_rope(q, positions, inv_freq)
            k = apply_rope(k, positions, inv_freq)
            k_scale, v_scale = (None, None) if kv_scales is None else (kv_scales[i, 0], kv_scales[i, 1])
            # The cache buffers are donated by the step, so these scatters update in place.
            # [R, Q, KVH, HD] -> [R*Q, KVH, HD]
            k_cache = write_cache(k_cache, i, slots, writes, k.reshape(R * Q, KVH, HD), k_scale)
            v_cache = write_cache(v_cache, i, slots, writes, v.reshape(R * Q, KVH, HD), v_scale)
            if k_scale is not None:
                q = (q.astype(jnp.float32) * k_scale).astype(q.dtype)
            o = attention(q, k_cache, v_cache, i, req_to_token, entries, positions, kv_lens, scale=scale,
                          ctx_len=ctx_len)
            if v_scale is not None:
                o = (o.astype(jnp.float32) * v_scale).astype(o.dtype)
        x, h = add_norm(x, linear(o.reshape(R, Q, H * HD), lw.wo, kernel=fp8_matmul), params.mlp_norm, i)  # [R, Q, D]
        # The residual add of the MLP comes with the next layer's input norm (the final norm last).
        last = i == L - 1
        x, h = add_norm(x, mlp(h, lw, cfg, expert_matmul, fp8_matmul),
                        params.final_norm[None] if last else params.attn_norm, 0 if last else i + 1)
    return h, k_cache, v_cache


def lm_logits(params: ModelParams, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V]."""
    if params.lm_head is None:  # tied embeddings
        return jnp.einsum("...d,vd->...v", hidden, params.embed, preferred_element_type=jnp.float32)
    return jnp.dot(hidden, params.lm_head, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg", "cache_dtype"))
def dense_logits(params: ModelParams, cfg: ModelConfig, token_ids: jax.Array, cache_dtype=None) -> jax.Array:
    """Logits [T, V] of one sequence with a throwaway cache (in `cache_dtype`, by default the
    model's): a reference for tests and notebooks."""
    T = token_ids.shape[0]
    k_cache = jnp.zeros((cfg.num_layers, T + 1, cfg.num_kv_heads, cfg.head_dim), cache_dtype or params.embed.dtype)
    v_cache = jnp.zeros_like(k_cache)
    # Entry 1 maps position p to slot p + 1 (slot 0 is the dummy).
    req_to_token = jnp.stack([jnp.zeros((T,), jnp.int32), jnp.arange(1, T + 1, dtype=jnp.int32)])
    hidden, _, _ = forward(
        params, cfg, k_cache, v_cache, req_to_token,
        tokens=token_ids[None, :],
        positions=jnp.arange(T, dtype=jnp.int32)[None, :],
        entries=jnp.array([1], jnp.int32),
        q_valid=jnp.ones((1, T), bool),
        kv_lens=jnp.array([T], jnp.int32),
        ctx_len=T,
    )
    return lm_logits(params, hidden[0])
