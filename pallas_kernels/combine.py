"""Merge split-K partial softmax results into the final attention output."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array, dtype) -> jax.Array:
    """Exact merge of S partial online-softmax states.

    Args:
      acc: [S, R, Q, H, HD] f32 unnormalised sum_j exp(s_j - m_s) v_j per split.
      m: [S, R, Q, H] f32 running max of each split (MASK_VALUE if empty).
      l: [S, R, Q, H] f32 sum_j exp(s_j - m_s) of each split (0 if empty).
    Returns:
      [R, Q, H, HD] in dtype; rows where every split is empty are 0.
    """
    m_all = jnp.max(m, axis=0)  # [R, Q, H]
    # Empty splits have l == 0 and acc == 0, so their weight never matters.
    w = jnp.exp(m - m_all[None])  # [S, R, Q, H]
    l_all = jnp.sum(w * l, axis=0)  # [R, Q, H]
    o = jnp.sum(w[..., None] * acc, axis=0)  # [S, R, Q, H, HD] -> [R, Q, H, HD]
    o = o / jnp.where(l_all > 0, l_all, 1.0)[..., None]  # empty rows stay 0
    return o.astype(dtype)
