"""The EAGLE head's one decoder layer over its own one-layer paged KV cache.

Columns. The head's sequence is EAGLE's: column i holds the pair (h_i, t_{i+1}) of the
target's hidden state at position i and the token after it, at RoPE position i, and its
output predicts t_{i+2}. Column i is stored in the slot of token position i + 1, i.e. the
head reads `req_to_token` shifted left by one column. That keeps everything the head
stores for a page of positions a function of the tokens up to that page's end (like the
target's K/V), so the prefix cache shares the head's cache with the target's pages, and
position 0's slot (which has no pair) is never read.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxoverlap.models.config import ModelConfig
from jaxoverlap.models.eagle import EagleParams
from jaxoverlap.models.params import ModelParams
from jaxoverlap.models.transformer import apply_rope, gated_mlp, lm_logits, rms_norm, split_qkv, write_cache


def head_table(req_to_token: jax.Array, entries: jax.Array) -> jax.Array:
    """[E, W] table, [B] entries -> [B, W] slots of head columns (column c -> position c + 1)."""
    rows = req_to_token[entries, 1:]  # [B, W - 1]
    return jnp.pad(rows, ((0, 0), (0, 1)))  # past the table: the dummy slot


def head_forward(
    hp: EagleParams,
    hcfg: ModelConfig,
    target: ModelParams,
    k_cache: jax.Array,
    v_cache: jax.Array,
    table: jax.Array,
    tokens: jax.Array,
    feats: jax.Array,
    cols: jax.Array,
    q_valid: jax.Array,
    kv_lens: jax.Array,
    *,
    ctx_len: int,
    attention,
):
    """Run the head over B rows of Q columns, writing their K/V into the head's cache first.

    table [B, W] from head_table; tokens, cols, q_valid [B, Q]; feats [B, Q, D] the hidden
    state paired with each token; kv_lens [B] valid columns per row after this call.
    Returns (hidden [B, Q, D] for the LM head, k_cache, v_cache), caches [1, S, KVH, HD].
    """
    B, Q = tokens.shape
    H, KVH, HD = hcfg.num_heads, hcfg.num_kv_heads, hcfg.head_dim
    width = table.shape[1]
    embed = hp.embed if hp.embed is not None else target.embed
    e = embed[jnp.maximum(tokens, 0)]  # [B, Q, D]
    x = jnp.dot(jnp.concatenate([e, feats.astype(e.dtype)], axis=-1), hp.fc)  # [B, Q, 2D] @ [2D, D]
    if hp.fc_bias is not None:
        x = x + hp.fc_bias
    in_table = q_valid & (cols >= 0) & (cols < width)
    slots = jnp.where(in_table, table[jnp.arange(B)[:, None], jnp.clip(cols, 0, width - 1)], 0)  # [B, Q]
    # The layer body of models/transformer.forward, with no input norm (EAGLE's layer 0).
    qkv = jnp.dot(x, hp.layer.wqkv)  # [B, Q, (H + 2KVH) * HD]
    if hp.bqkv is not None:
        qkv = qkv + hp.bqkv
    q, k, v = split_qkv(qkv, H, KVH, HD, hp.layer.qkv_shards)  # [B, Q, H | KVH, HD]
    if hp.q_norm is not None:
        q = rms_norm(q, hp.q_norm, hcfg.rms_norm_eps)
        k = rms_norm(k, hp.k_norm, hcfg.rms_norm_eps)
    inv_freq = hcfg.rope_inv_freq()
    q = apply_rope(q, cols, inv_freq)
    k = apply_rope(k, cols, inv_freq)
    flat, writes = slots.reshape(B * Q), in_table.reshape(B * Q)  # [B, Q] -> [B*Q]
    # [B, Q, KVH, HD] -> [B*Q, KVH, HD], one row per slot; the donated caches update in place.
    k_cache = write_cache(k_cache, 0, flat, writes, k.reshape(B * Q, KVH, HD))
    v_cache = write_cache(v_cache, 0, flat, writes, v.reshape(B * Q, KVH, HD))
    rows = jnp.arange(B, dtype=jnp.int32)  # the table is already gathered per row
    o = attention(q, k_cache, v_cache, 0, table, rows, cols, kv_lens, scale=1.0 / float(np.sqrt(HD)), ctx_len=ctx_len)
    x = x + jnp.dot(o.reshape(B, Q, H * HD), hp.layer.wo)  # [B, Q, D]
    h = rms_norm(x, hp.mlp_norm, hcfg.rms_norm_eps)
    x = x + gated_mlp(h, hp.layer)  # [B, Q, D]
    if hp.final_norm is not None:
        x = rms_norm(x, hp.final_norm, hcfg.rms_norm_eps)
    return x, k_cache, v_cache


def head_logits(hp: EagleParams, target: ModelParams, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V] with the head's own LM head, else the target's."""
    if hp.lm_head is not None:
        return jnp.dot(hidden, hp.lm_head, preferred_element_type=jnp.float32)
    return lm_logits(target, hidden)
