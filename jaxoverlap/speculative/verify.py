"""Acceptance of a verified window, and the random draws of speculative steps.

Greedy rows accept draft tokens while they equal the target's argmax and take the target's
token at the first mismatch (or after the last draft) as the bonus. Rows with temperature
> 0 use rejection sampling (pallas_kernels.acceptance): draft x drawn from q is accepted
with probability min(1, p(x)/q(x)); at the first rejection the token is drawn from
normalize(max(0, p - q)); after the last accepted draft the bonus is drawn from p. p and q
are the temperature / min-p / top-k / top-p filtered distributions, with sampling.py's
rules (sampling.sorted_filter), so the output is distributed as plain sampling's.
Deterministic drafts (the n-gram drafters) have a one-hot q.

Keys are fold_in(fold_in(key(seed), position), tag) with the position of the token the
draw is about, as in sampling.py, so a request's draws depend on neither its batch nor on
overlap. (Except where speculation pauses, speculative_disable_by_batch_size: a step that
drafts nothing samples as plain decoding does, so a seeded sampled request's tokens then
depend on the batch sizes it met; their distribution does not.) A step starting at length
L tests draft j (position L + j) with the ACCEPT key of L + j and draws its final token
with the FINAL key of L, which no other step uses.

`sampling` is static, as in sampling.py: the host knows whether any row of the batch
samples, and all-greedy programs leave out the vocabulary sorts. (Not a `lax.cond`: on GPU
XLA reads a conditional's predicate back to the host, which would block the dispatch of
the step and with it the overlap.)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxoverlap.pallas_kernels import acceptance
from jaxoverlap.sampling import sorted_filter

TAG_DRAFT, TAG_ACCEPT, TAG_FINAL = 1, 2, 3


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingRows:
    """Per-row sampling parameters, gathered from the relay (or the prefill inputs)."""

    temperature: jax.Array  # [B] float32 (0 = greedy)
    top_k: jax.Array  # [B] int32
    top_p: jax.Array  # [B] float32
    min_p: jax.Array  # [B] float32
    seed: jax.Array  # [B] uint32

    @classmethod
    def from_relay(cls, relay, entries) -> "SamplingRows":
        return cls(relay.temperature[entries], relay.top_k[entries], relay.top_p[entries],
                   relay.min_p[entries], relay.seed[entries])

    def repeat(self, n: int) -> "SamplingRows":
        """Each row's params n times in a row: [B] -> [B * n], to match logits [B, n, V] -> [B * n, V]."""
        return jax.tree.map(lambda x: jnp.repeat(x, n, axis=0), self)


def row_keys(seeds: jax.Array, positions: jax.Array, tag: int) -> jax.Array:
    """seeds [N], positions [N] -> [N] keys fold_in(fold_in(key(seed), position), tag)."""
    def one(seed, pos):
        return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), pos), tag)

    return jax.vmap(one)(seeds, positions)


def filtered_probs(logits: jax.Array, sp: SamplingRows) -> jax.Array:
    """logits [N, V] -> probabilities [N, V] of sampling.py's filtered distribution
    (temperature, then min-p, top-k and top-p: sampling.sorted_filter), zero elsewhere."""
    N = logits.shape[0]
    scaled = logits.astype(jnp.float32) / jnp.maximum(sp.temperature, 1e-6)[:, None]
    order, _, probs, keep = sorted_filter(scaled, sp.top_k, sp.top_p, sp.min_p)  # [N, V] each
    kept = jnp.where(keep, probs, 0.0)
    kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
    # Back from sorted order to vocabulary order.
    return jnp.zeros_like(kept).at[jnp.arange(N)[:, None], order].set(kept)


def pick_draft(logits: jax.Array, sp: SamplingRows, positions: jax.Array, *, sampling: bool):
    """A drafter's token for each row: argmax for greedy rows, a draw from the filtered q for
    sampled rows. logits [B, V]; positions [B] of the drafted token.
    Returns (tokens [B] int32, q [B, V] float32, or None in an all-greedy program)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sampling:
        return greedy, None
    q = filtered_probs(logits, sp)
    keys = row_keys(sp.seed, positions, TAG_DRAFT)
    draw = jax.vmap(lambda key, row: jax.random.categorical(key, jnp.log(row)))(keys, q).astype(jnp.int32)
    return jnp.where(sp.temperature > 0, draw, greedy), q


def accept(
    logits: jax.Array,
    drafts: jax.Array,
    num_draft: jax.Array,
    draft_probs,
    sp: SamplingRows,
    lens: jax.Array,
    *,
    sampling: bool,
    backend: str = "xla",
    rule_logits: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Accept a prefix of each row's drafts.

    logits [B, W, V]: the target's logits at the window positions L .. L + k;
    drafts [B, k]; num_draft [B]: real drafts per row (the rest are never accepted);
    draft_probs: q [B, k, V] for sampled drafts, or None when the drafts are deterministic
    (one-hot q) or the program samples nothing; lens [B]: L, the position of each window's first token;
    rule_logits [B, W, V]: where penalties (penalties.apply_window) or allowed tokens
    (structured output: -inf outside each position's mask) apply, the logits the tokens are
    chosen from, instead of `logits`.
    Returns (tokens [B, W] int32: accepted drafts then the bonus, then -1;
    accept_len [B] int32 = accepted drafts + 1; logprobs [B, W] float32 of the tokens under
    the unfiltered target distribution).
    """
    B, W, V = logits.shape
    k = W - 1
    choose = logits if rule_logits is None else rule_logits
    if k == 0:
        return _no_drafts(logits, choose, sp, lens, sampling=sampling)
    target_argmax = jnp.argmax(choose, axis=-1).astype(jnp.int32)  # [B, W]
    tokens, accept_len = acceptance.greedy_accept(drafts, target_argmax, num_draft, backend=backend)
    if sampling:
        p = filtered_probs(choose.reshape(B * W, V), sp.repeat(W)).reshape(B, W, V)  # [B*W, V] -> [B, W, V]
        q = draft_probs if draft_probs is not None else jax.nn.one_hot(drafts, V, dtype=jnp.float32)  # [B, k, V]
        draft_pos = lens[:, None] + 1 + jnp.arange(k)  # [B, k]: draft j+1 sits at L + j + 1
        u_keys = row_keys(jnp.repeat(sp.seed, k), draft_pos.reshape(B * k), TAG_ACCEPT)  # [B*k]
        u = jax.vmap(lambda key: jax.random.uniform(key))(u_keys).reshape(B, k)  # [B*k] -> [B, k]
        su = jax.vmap(lambda key: jax.random.uniform(key))(row_keys(sp.seed, lens, TAG_FINAL))  # [B]
        s_tokens, s_len = acceptance.rejection_sample(p, q, drafts, u, su, num_draft, backend=backend)
        rows = sp.temperature > 0
        tokens, accept_len = jnp.where(rows[:, None], s_tokens, tokens), jnp.where(rows, s_len, accept_len)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, W, V]
    logprobs = jnp.take_along_axis(logp, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]  # [B, W]
    return tokens, accept_len.astype(jnp.int32), logprobs


def _no_drafts(logits: jax.Array, choose: jax.Array, sp: SamplingRows, lens: jax.Array, *, sampling: bool):
    """The window of a step with speculation paused (no draft slots): the input token alone.
    Its one new token is the bonus of a window whose drafts were all rejected, drawn with
    the same key (FINAL of L), so a paused step gives what a step whose drafts all miss gives.
    The token comes from `choose` (the logits with any penalties), its logprob from `logits`."""
    B = logits.shape[0]
    tokens = jnp.argmax(choose[:, 0], axis=-1).astype(jnp.int32)  # [B]
    if sampling:
        p = filtered_probs(choose[:, 0], sp)  # [B, V]
        su = jax.vmap(lambda key: jax.random.uniform(key))(row_keys(sp.seed, lens, TAG_FINAL))  # [B]
        tokens = jnp.where(sp.temperature > 0, acceptance.inverse_cdf(p, su).astype(jnp.int32), tokens)
    logp = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1)  # [B, V]
    logprobs = jnp.take_along_axis(logp, tokens[:, None], axis=-1)  # [B, 1]
    return tokens[:, None], jnp.ones((B,), jnp.int32), logprobs
