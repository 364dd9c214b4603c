"""The EAGLE drafter: prefill of the head, the draft passes, and draft extend.

With a request of length L (target K/V for positions 0 .. L-1) and its bonus token t_L:
the head has columns 0 .. L-1 (eagle_head.py: column i = (h_i, t_{i+1})), and the relay
holds the first draft d_1 (predicted by column L-1) and that column's output g.

- draft passes j = 1 .. k-1: column L-1+j = (g, d_j) -> new g, d_{j+1} (EAGLE feeds its own
  output back as the feature). So k drafts cost k-1 passes.
- verify (step.py): the target over positions L .. L+k gives hidden states h_{L..L+k}.
- draft extend, with a drafts accepted: columns L+j = (h_{L+j}, t_{L+j+1}) for j = 0 .. a,
  where t_{L+j+1} is the accepted draft d_{j+1} or, for j = a, the bonus. This overwrites
  the draft passes' columns with the verified features, and column L+a's output gives the
  next step's d_1 and g. The new length is L + a + 1 and the head again has exactly that
  many columns.

The head's columns L .. L+a live in the slots of positions L+1 .. L+a+1: one position past
the window, hence SpecConfig.lookahead = 1.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxoverlap.models.config import ModelConfig
from jaxoverlap.models.eagle import EagleParams
from jaxoverlap.models.params import ModelParams
from jaxoverlap.speculative.eagle_head import head_forward, head_logits, head_table
from jaxoverlap.speculative.verify import SamplingRows, filtered_probs, pick_draft


def prefill(hp: EagleParams, hcfg: ModelConfig, target: ModelParams, k_cache, v_cache, req_to_token, *,
            tokens, positions, entries, chunk_lens, is_last, hidden, sampled, sp: SamplingRows, sampling: bool,
            ctx_len, attention):
    """Head columns for a prefill chunk.

    tokens, positions [R, T]: column 0 is the token before the chunk (position s - 1, read
    only), columns 1 .. c the chunk; hidden [R, T, D] the target's states there; sampled [R]
    the token after the chunk. Column s-1 is (re)computed here because its pair needs t_s:
    it lives in the slot of position s, which is this request's own page even when the
    positions before s come from the prefix cache. A chunk that does not end the prompt
    leaves its last column to the next chunk, which recomputes it the same way.
    Returns (d_1 [R], g [R, D], k_cache, v_cache).
    """
    R, T = tokens.shape
    idx = jnp.arange(T)[None, :]  # [1, T]
    c = chunk_lens[:, None]
    nxt = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))  # [R, T]: the token after each column's position
    nxt = jnp.where(idx == c, sampled[:, None], nxt)
    valid = (idx < c) | ((idx == c) & is_last[:, None])
    valid &= (positions >= 0) & (entries[:, None] != 0)
    kv_lens = positions[:, 0] + chunk_lens + is_last.astype(jnp.int32)  # = s + c (last chunk) or s + c - 1
    table = head_table(req_to_token, entries)
    h, k_cache, v_cache = head_forward(hp, hcfg, target, k_cache, v_cache, table, nxt, hidden, positions, valid,
                                       kv_lens, ctx_len=ctx_len, attention=attention)
    g = jnp.take_along_axis(h, chunk_lens[:, None, None], axis=1)[:, 0]  # [R, D] column s + c - 1
    d1, _ = pick_draft(head_logits(hp, target, g), sp, positions[:, 0] + chunk_lens + 2,  # d_1 sits at s + c + 1
                       sampling=sampling)
    return d1, g, k_cache, v_cache


def propose(hp: EagleParams, hcfg: ModelConfig, target: ModelParams, k_cache, v_cache, req_to_token, relay, *,
            entries, lens, sp: SamplingRows, num_draft: int, sampling: bool, ctx_len, attention):
    """The k drafts of each row. Returns (drafts [B, k], draft_probs: () -> q [B, k, V],
    k_cache, v_cache); draft_probs is called only in sampling programs."""
    real = (entries != 0)[:, None]  # [B, 1]
    table = head_table(req_to_token, entries)
    d = relay.draft_token[entries]  # [B]
    g = relay.draft_hidden[entries]  # [B, D]
    g_first = g
    drafts, qs = [d], []
    for j in range(1, num_draft):
        col = (lens - 1 + j)[:, None]  # [B, 1]
        h, k_cache, v_cache = head_forward(hp, hcfg, target, k_cache, v_cache, table, d[:, None], g[:, None], col,
                                           real, lens + j, ctx_len=ctx_len, attention=attention)
        g = h[:, 0]
        d, q = pick_draft(head_logits(hp, target, g), sp, lens + j + 1, sampling=sampling)
        drafts.append(d)
        qs.append(q)

    def draft_probs():
        # q_1 belongs to the previous step's draft extend: recompute it from g rather than
        # keep a vocabulary-sized row per entry in the relay.
        q1 = filtered_probs(head_logits(hp, target, g_first), sp)  # [B, V]
        return jnp.stack([q1] + qs, axis=1)  # [B, k, V]

    return jnp.stack(drafts, axis=1), draft_probs, k_cache, v_cache


def extend(hp: EagleParams, hcfg: ModelConfig, target: ModelParams, k_cache, v_cache, req_to_token, *,
           entries, lens, out_tokens, accept_len, hidden, sp: SamplingRows, sampling: bool, ctx_len, attention):
    """Draft extend over the verified window. out_tokens [B, W] (accepted drafts, bonus,
    then -1), accept_len [B], hidden [B, W, D] the verify pass's states.
    Returns (next d_1 [B], its g [B, D], k_cache, v_cache)."""
    B, W = out_tokens.shape
    j = jnp.arange(W)[None, :]  # [1, W]
    cols = lens[:, None] + j  # [B, W]
    valid = (j < accept_len[:, None]) & (entries != 0)[:, None]
    table = head_table(req_to_token, entries)
    h, k_cache, v_cache = head_forward(hp, hcfg, target, k_cache, v_cache, table, out_tokens, hidden, cols, valid,
                                       lens + accept_len, ctx_len=ctx_len, attention=attention)
    g = jnp.take_along_axis(h, (accept_len - 1)[:, None, None], axis=1)[:, 0]  # [B, D] column L + a
    d1, _ = pick_draft(head_logits(hp, target, g), sp, lens + accept_len + 1, sampling=sampling)  # d_1 at L' + 1
    return d1, g, k_cache, v_cache
