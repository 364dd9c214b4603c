"""Scatters that skip padding.

A step's padded rows and tokens must write nothing, and must not all write one cell
either: colliding updates are what XLA's GPU scatter serializes. Padded prefill tokens
that all wrote their K/V to slot 0 cost about 1.4 ms each on the H100, 21 s for a prefill
of 8 rows x 2048 tokens with 1536 real (benchmarks/RESULTS.md, 2026-12-05, seventh
session). So every scatter that padding reaches gives padding distinct indices past the
target's end, and scatters with mode="drop", which skips them.

A prefill batch may also hold several rows of one request (segments of its chunk:
buckets.PrefillShapes); of those only the last writes the request's per-entry state
(`last_segments`), so that no entry is written twice either.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def dropped_where_invalid(indices: jax.Array, valid: jax.Array, end: int) -> jax.Array:
    """Scatter indices (any shape; valid broadcasts to it) whose invalid entries become
    distinct indices from `end` on, which a scatter with mode="drop" skips."""
    past_end = end + jnp.arange(indices.size, dtype=indices.dtype).reshape(indices.shape)
    return jnp.where(valid, indices, past_end)


def entry_rows(entries: jax.Array, num_entries: int) -> jax.Array:
    """Rows of a per-entry scatter (relay, penalty state) with the padded rows, which use
    the dummy entry 0, dropped: entry 0 is never written and keeps its initial state
    (length 0)."""
    return dropped_where_invalid(entries, entries != 0, num_entries)


def set_rows(array: jax.Array, entries: jax.Array, values: jax.Array) -> jax.Array:
    """array[entries[i]] = values[i] for every real row i (entry != 0)."""
    return array.at[entry_rows(entries, array.shape[0])].set(values.astype(array.dtype), mode="drop")


def last_segments(entries: jax.Array, starts: jax.Array) -> jax.Array:
    """entries [R] of a prefill batch with 0 in every row that another row of the same
    entry follows (a later segment of the same chunk: a larger start), so that only the
    chunk's last segment writes the entry's relay and penalty state."""
    later = (entries[None, :] == entries[:, None]) & (starts[None, :] > starts[:, None])  # [R, R]
    return jnp.where(later.any(axis=1), 0, entries)


def last_segment_rows(entries: jax.Array, starts: jax.Array, count: int) -> jax.Array:
    """[count] indices of a prefill batch's rows that are a chunk's last segment (real rows
    only; one per request of the batch, so `count` = its most requests holds them all), in
    row order, then distinct indices from R on: past the end, for gathers with mode="clip"
    (whose rows are then thrown away) and scatters back with mode="drop"."""
    (rows,) = jnp.nonzero(last_segments(entries, starts) != 0, size=count, fill_value=-1)
    return dropped_where_invalid(rows, rows >= 0, entries.shape[0])
