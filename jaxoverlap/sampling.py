"""Sampling on the device: greedy, temperature, top-k, top-p, min-p, a per-request seed.

The key of each draw is fold_in(key(seed), position of the sampled token), so a request's
samples depend on neither the batch it ran in nor on overlap: the same seed gives the same
tokens with and without overlap, and after a retraction.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxoverlap.penalties import apply as apply_penalties


def sorted_filter(scaled, top_k, top_p, min_p):
    """The top-k / top-p / min-p filters of temperature-scaled logits [N, V], with per-row
    params [N]. Returns (order [N, V]: token ids, most likely first; sorted_logits [N, V]:
    `scaled` in that order; probs [N, V]: their softmax; keep [N, V] bool: the sorted tokens
    the filters keep).

    The rules apply in vLLM's order (as HF's warpers do, each on what the one before left):
    min-p drops tokens less likely than min_p times the most likely token of the full
    distribution; top-k keeps the k most likely of the rest, and any tied with the k-th (as
    vLLM and HF compare against the k-th value); top-p keeps the smallest prefix of what is
    left whose mass, renormalized over it, reaches top_p (1 = off). The first
    token is always kept. One sort serves all three: min-p and top-k each keep a prefix of
    the sorted order. Shared by the sampler and the speculative verifier
    (speculative/verify.filtered_probs), so both draw from the same distribution."""
    V = scaled.shape[-1]
    order = jnp.argsort(-scaled, axis=-1)  # [N, V] token ids, most likely first
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    rank = jnp.arange(V)[None, :]
    keep = probs >= min_p[:, None] * probs[:, :1]
    k = jnp.clip(jnp.where(top_k > 0, top_k, V), 1, V)  # [N]
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)  # [N, 1]
    keep &= (rank < k[:, None]) | (sorted_logits >= kth)  # both keep the first token (min_p <= 1)
    kept = jnp.where(keep, probs, 0.0)
    kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
    # top-p on the mass min-p and top-k left. top_p = 1 keeps all of it: in float32 the
    # cumulative mass before a tail token can round up to 1.
    mass_before = jnp.cumsum(kept, axis=-1) - kept
    keep &= (mass_before < top_p[:, None]) | (top_p >= 1.0)[:, None]
    keep = keep.at[:, 0].set(True)
    return order, sorted_logits, probs, keep


def _sample_filtered(logits, temperature, top_k, top_p, min_p, seeds, positions):
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order, sorted_logits, _, keep = sorted_filter(scaled, top_k, top_p, min_p)
    masked = jnp.where(keep, sorted_logits, -jnp.inf)

    def draw(seed, pos, row):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), pos)
        return jax.random.categorical(key, row)

    choice = jax.vmap(draw)(seeds, positions, masked)  # [B] index into the sorted order
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def allowed_mask(allowed: jax.Array, vocab: int) -> jax.Array:
    """[..., W] int32 bitmask (bit t % 32 of word t // 32: token t allowed) -> [..., vocab] bool."""
    ids = jnp.arange(vocab, dtype=jnp.int32)
    words = jnp.take(allowed, ids // 32, axis=-1)  # [..., vocab]: each token's word
    return ((words >> (ids % 32)) & 1) == 1


def keep_allowed(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """logits [..., V] with -inf wherever the bitmask `allowed` [..., ceil(V / 32)] forbids the token."""
    return jnp.where(allowed_mask(allowed, logits.shape[-1]), logits, -jnp.inf)


def keep_allowed_after_rules(raw: jax.Array, ruled: jax.Array, allowed: jax.Array) -> jax.Array:
    """`ruled` (the raw logits [..., V] after penalties, logit_bias and min_new_tokens, as
    float32) with -inf wherever the bitmask `allowed` forbids the token. Where the grammar
    allows only tokens that min_new_tokens bans (the stop tokens: the grammar can only end
    there), the grammar wins, as no token could be chosen otherwise: those rows keep the raw
    logits under the mask. (The other rules are finite, so only that ban empties a row.)"""
    keep = allowed_mask(allowed, raw.shape[-1])
    masked = jnp.where(keep, ruled, -jnp.inf)
    stuck = jnp.max(masked, axis=-1, keepdims=True) == -jnp.inf  # [..., 1]
    return jnp.where(stuck & keep, raw.astype(masked.dtype), masked)


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions, *, sampling: bool = True, penalties=None,
           allowed=None):
    """logits [B, V] float32; per-row params [B]; positions [B] of the token being sampled.

    `sampling` is static: the host knows whether any row of a decode batch samples, and
    passes False for all-greedy batches so the program skips the sort over the vocabulary
    (prefill programs always pass True: runner._prefill_program). Greedy rows get the same
    argmax either way. (A `lax.cond` on the device would do the same, but on GPU XLA reads
    a conditional's predicate back to the host, which blocks the dispatch of the step until
    the device has caught up: exactly the wait the overlap loop exists to avoid.)

    `penalties`: None, or the rows' state from `penalties.rows` (history, params, min_end,
    logit bias); the token is chosen from the logits those rules give, greedy rows too.

    `allowed`: None, or [B, ceil(V / 32)] int32, each row's allowed tokens as a bitmask
    (structured output): the others are set to -inf before the choice, greedy rows too
    (`keep_allowed_after_rules`: where min_new_tokens bans all the grammar allows, the
    grammar wins).

    Returns (tokens [B] int32, logprobs [B] float32 of the chosen tokens under the raw model
    distribution).
    """
    if penalties is None:
        chosen_from = logits if allowed is None else keep_allowed(logits, allowed)
    else:
        chosen_from = apply_penalties(logits, positions, *penalties)
        if allowed is not None:
            chosen_from = keep_allowed_after_rules(logits, chosen_from, allowed)
    tokens = jnp.argmax(chosen_from, axis=-1).astype(jnp.int32)
    if sampling:
        sampled = _sample_filtered(chosen_from, temperature, top_k, top_p, min_p, seeds, positions)
        tokens = jnp.where(temperature > 0, sampled, tokens)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
