"""N-gram drafting on the device: match each request's trailing n-gram against its own token
history, so the drafts never need the host (no wait for the previous step, unlike the
host trie in ngram_host.py).

History: `slot_tokens[slot]` is the token whose K/V a slot holds, so the history of a row
is `slot_tokens[req_to_token[entry, :L]]` plus the bonus token t_L from the relay (it has
no K/V yet). Keeping tokens per slot rather than per entry lets a prefix-cached page bring
its tokens along. Prefill writes the chunk's tokens, and each step writes the window's
accepted tokens next to their K/V.

Lookup: for n = max .. min, the most recent earlier occurrence of the last n tokens
(ending at j < L); the longest n that occurs wins. The drafts are the k tokens after it;
past L (not known yet) the text is taken to repeat with period L - j (a run of one token
drafts k more of it).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxoverlap.scatter import dropped_where_invalid


def write_tokens(slot_tokens: jax.Array, req_to_token: jax.Array, entries, positions, tokens, valid) -> jax.Array:
    """Record tokens [R, Q] at positions [R, Q] where valid [R, Q]; the rest write nothing
    (jaxoverlap/scatter.py)."""
    width = req_to_token.shape[1]
    ok = valid & (positions >= 0) & (positions < width)
    slots = req_to_token[entries[:, None], jnp.clip(positions, 0, width - 1)]  # [R, Q]
    slots = dropped_where_invalid(slots, ok, slot_tokens.shape[0]).reshape(-1)  # [R, Q] -> [R*Q]
    return slot_tokens.at[slots].set(tokens.reshape(-1).astype(slot_tokens.dtype), mode="drop")


def propose(slot_tokens: jax.Array, req_to_token: jax.Array, *, entries, lens, bonus, num_draft: int,
            min_match: int, max_match: int, ctx_len: int):
    """Drafts [B, k] int32 and num_draft [B] int32 (0 where nothing matches)."""
    B = entries.shape[0]
    cols = jnp.arange(ctx_len)[None, :]  # [1, C]
    hist = slot_tokens[req_to_token[entries, :ctx_len]]  # [B, C] token at each position
    hist = jnp.where(cols == lens[:, None], bonus[:, None], hist)  # position L: the bonus token
    rows = jnp.arange(B)[:, None]
    match = jnp.ones((B, ctx_len), bool)  # match[b, j]: the last n tokens also end at j
    best_j = jnp.full((B,), -1, jnp.int32)
    for n in range(1, min(max_match, ctx_len) + 1):  # (no match is longer than the context)
        i = n - 1
        tail = hist[rows[:, 0], jnp.maximum(lens - i, 0)]  # [B] the token n-1 before the end
        earlier = jnp.where(cols - i >= 0, jnp.roll(hist, i, axis=1), -1)  # [B, C]: hist[b, j - i]
        match &= (earlier == tail[:, None]) & (cols - i >= 0) & (lens - i >= 0)[:, None]
        if n >= min_match:
            found = jnp.max(jnp.where(match & (cols < lens[:, None]), cols, -1), axis=1)  # [B] most recent j
            best_j = jnp.where(found >= 0, found, best_j)  # a longer match replaces a shorter one
    # The tokens after the match, hist[j + 1 .. L]; where they run out before k drafts (a match
    # close to the end: the text repeats with period L - j, as in a run of one token), the
    # period goes on: draft i is hist[j + 1 + i mod (L - j)].
    period = jnp.maximum(lens - best_j, 1)  # [B]
    take = best_j[:, None] + 1 + jnp.arange(num_draft)[None, :] % period[:, None]  # [B, k]
    drafts = jnp.take_along_axis(hist, jnp.clip(take, 0, ctx_len - 1), axis=1)
    count = jnp.where(best_j >= 0, num_draft, 0)
    count = jnp.where(entries != 0, count, 0)
    drafts = jnp.where(jnp.arange(num_draft)[None, :] < count[:, None], drafts, 0)
    return drafts.astype(jnp.int32), count.astype(jnp.int32)
