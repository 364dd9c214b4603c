"""The standalone draft model: a smaller model of the same tokenizer with its own KV cache
under the target's slot numbers.

Invariant: when a step starts at length L, the draft model's K/V is final for positions
0 .. L-2. The first draft pass reads two tokens, the one at L-1 (`relay.last_token`) and
the bonus t_L, so position L-1 is (re)written there: after a step that accepted every
draft, the token at L-1 is the last draft, which no draft pass had read. Rewriting K/V of
the same token at the same position is harmless. Passes 2 .. k read one draft each, so k
drafts cost k passes and no extend pass is needed. Position L-1 is thus not final for the
prefix cache until the next step: SpecConfig.cache_lag = 1.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxoverlap.models.config import ModelConfig
from jaxoverlap.models.params import ModelParams
from jaxoverlap.models.transformer import forward, lm_logits
from jaxoverlap.speculative.verify import SamplingRows, pick_draft


def _logits(params: ModelParams, hidden, vocab: int):
    """The draft model's logits over the target's vocabulary (models of one tokenizer may pad
    their vocabularies to different sizes; ids past the smaller one are never drafted)."""
    logits = lm_logits(params, hidden)  # [B, Vd]
    if logits.shape[-1] >= vocab:
        return logits[..., :vocab]
    return jnp.pad(logits, ((0, 0), (0, vocab - logits.shape[-1])), constant_values=-jnp.inf)


def prefill(dp: ModelParams, dcfg: ModelConfig, k_cache, v_cache, req_to_token, *,
            tokens, positions, entries, q_valid, kv_lens, ctx_len, attention):
    """The draft model's K/V for a prefill chunk (same rows, positions and write mask as the
    target's pass). Returns (k_cache, v_cache)."""
    _, k_cache, v_cache = forward(dp, dcfg, k_cache, v_cache, req_to_token, tokens=tokens, positions=positions,
                                  entries=entries, q_valid=q_valid, kv_lens=kv_lens, ctx_len=ctx_len,
                                  attention=attention)
    return k_cache, v_cache


def propose(dp: ModelParams, dcfg: ModelConfig, k_cache, v_cache, req_to_token, relay, *,
            entries, lens, bonus, sp: SamplingRows, num_draft: int, vocab: int, sampling: bool, ctx_len, attention):
    """The k drafts of each row. Returns (drafts [B, k], draft_probs: () -> q [B, k, V],
    k_cache, v_cache); draft_probs is called only in sampling programs."""
    real = entries != 0
    offsets = jnp.arange(2)[None, :]  # the first pass: positions L-1 and L
    tokens = jnp.stack([relay.last_token[entries], bonus], axis=1)  # [B, 2]
    positions = lens[:, None] - 1 + offsets  # [B, 2]
    q_valid = real[:, None] & (positions >= 0)
    drafts, qs = [], []
    for j in range(num_draft):
        hidden, k_cache, v_cache = forward(dp, dcfg, k_cache, v_cache, req_to_token, tokens=tokens,
                                           positions=positions, entries=entries, q_valid=q_valid,
                                           kv_lens=lens + j + 1, ctx_len=ctx_len, attention=attention)
        d, q = pick_draft(_logits(dp, hidden[:, -1], vocab), sp, lens + j + 1,  # d_{j+1} sits at L + j + 1
                          sampling=sampling)
        drafts.append(d)
        qs.append(q)
        tokens, positions, q_valid = d[:, None], (lens + j + 1)[:, None], real[:, None]
    return jnp.stack(drafts, axis=1), (lambda: jnp.stack(qs, axis=1)), k_cache, v_cache


def write_last(dp: ModelParams, dcfg: ModelConfig, k_cache, v_cache, req_to_token, relay, *, entries, lens,
               ctx_len, attention):
    """A step that drafts nothing still owes the draft model's K/V at L - 1 (the token
    before the bonus; see `propose`'s first pass): one draft-model pass over that token.
    Returns (k_cache, v_cache)."""
    positions = (lens - 1)[:, None]  # [B, 1]
    q_valid = (entries != 0)[:, None] & (positions >= 0)
    _, k_cache, v_cache = forward(dp, dcfg, k_cache, v_cache, req_to_token, tokens=relay.last_token[entries][:, None],
                                  positions=positions, entries=entries, q_valid=q_valid, kv_lens=lens,
                                  ctx_len=ctx_len, attention=attention)
    return k_cache, v_cache


def last_token(window: jnp.ndarray, accept_len: jnp.ndarray) -> jnp.ndarray:
    """The token at the new length - 1 (= L + a): window [B, W] = [t_L, d_1 .. d_k] -> [B]."""
    return jnp.take_along_axis(window, (accept_len - 1)[:, None], axis=1)[:, 0]
