"""Repetition, frequency and presence penalties, logit_bias and min_new_tokens, applied on
the device.

Semantics as in vLLM and SGLang (and OpenAI's API for the two penalties), per request:
  repetition_penalty r (> 0, 1 = off): a token that occurs in the prompt or the output so
      far has its logit divided by r where positive, multiplied by r where negative;
  frequency_penalty f (-2..2, 0 = off): f x (times the token was generated) is subtracted;
  presence_penalty p (-2..2, 0 = off): p is subtracted from every token generated before;
  logit_bias {token: b} (OpenAI's): b (-100..100) is added to the token's logit, before
      the penalties apply (vLLM's order);
  min_new_tokens m (0 = off): the request's stop tokens (EOS unless ignore_eos, and its
      stop_token_ids) cannot be chosen for its first m output tokens.
They shape which token is chosen (greedy or sampled); reported logprobs stay those of the
raw model distribution.

Each relay entry keeps a [V] row of history on the device (`PenaltyState`), so the host
sends nothing per step and the overlap loop needs no token it has not seen yet: a decode
step first records its input token (the one the step before generated), then applies the
rules. A prefill records its chunk's tokens: prompt positions as seen, positions at or past
the prompt's end (a retracted request's output, prefilled again) as generated too. A
request's first chunk since admission clears the row that the entry's previous owner left
and marks the request's stop tokens. Positions a prefill does not compute are never
recorded, so a request with penalties prefills its whole prompt and never reads the prefix
cache (Scheduler._admit); min_new_tokens alone needs only the stop marks and may.

A speculative step records its input token too, chooses each column of the verified window
with the drafts before that column counted (`apply_window`), and records the drafts it
accepted (`record_drafts`); its bonus token is the next step's input.

Only sampling programs (static `sampling=True`) read or write the history: the host routes
every batch with such a row to one (runner.batch_samples), and prefill programs always
sample. Rows without rules (NEUTRAL params, min_end 0, no bias) pass through `apply` unchanged,
whatever their entry's row holds.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxoverlap.sampling_params import MAX_LOGIT_BIAS
from jaxoverlap.scatter import dropped_where_invalid, entry_rows, last_segments, set_rows

SEEN = 1 << 24  # history bit: the token occurs in the prompt or the output
COUNT = SEEN - 1  # history bits 0-23: how many times the request generated the token
STOP = 1 << 25  # history bit: the token ends the request (banned before min_end)
NEUTRAL = (1.0, 0.0, 0.0)  # (repetition, frequency, presence) of a request without penalties
MAX_STOP_IDS = 16  # stop tokens a request with min_new_tokens may have (EOS ids included)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PenaltyState:
    history: jax.Array  # [E, V] int32: per entry and token, STOP | SEEN | times generated
    params: jax.Array  # [E, 3] float32: repetition, frequency, presence
    min_end: jax.Array  # [E] int32: stop tokens are banned at positions before this one
    bias_ids: jax.Array  # [E, MAX_LOGIT_BIAS] int32: logit_bias tokens, -1 past them
    bias_values: jax.Array  # [E, MAX_LOGIT_BIAS] float32: their biases (0 past them)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillPenaltyInputs:
    """What a prefill needs to keep its rows' histories (steps.PrefillInputs.penalties)."""

    params: jax.Array  # [R, 3] float32: repetition, frequency, presence (NEUTRAL for padding)
    prompt_lens: jax.Array  # [R] int32: positions from here on hold generated tokens
    first: jax.Array  # [R] bool: the row's first chunk since admission (clears the entry's row)
    stop_ids: jax.Array  # [R, MAX_STOP_IDS] int32: the request's stop tokens, -1 past them
    min_end: jax.Array  # [R] int32: prompt length + min_new_tokens
    bias_ids: jax.Array  # [R, MAX_LOGIT_BIAS] int32: logit_bias tokens, -1 past them
    bias_values: jax.Array  # [R, MAX_LOGIT_BIAS] float32


def init_penalty_state(num_entries: int, vocab_size: int) -> PenaltyState:
    return PenaltyState(
        history=jnp.zeros((num_entries, vocab_size), jnp.int32),
        params=jnp.tile(jnp.asarray(NEUTRAL, jnp.float32), (num_entries, 1)),  # [3] -> [E, 3]
        min_end=jnp.zeros((num_entries,), jnp.int32),
        bias_ids=jnp.full((num_entries, MAX_LOGIT_BIAS), -1, jnp.int32),
        bias_values=jnp.zeros((num_entries, MAX_LOGIT_BIAS), jnp.float32),
    )


def state_bytes(num_entries: int, vocab_size: int) -> int:
    return num_entries * (vocab_size + 4 + 2 * MAX_LOGIT_BIAS) * 4


def apply(logits: jax.Array, positions: jax.Array, history: jax.Array, params: jax.Array,
          min_end: jax.Array, bias_ids: jax.Array, bias_values: jax.Array) -> jax.Array:
    """logits [B, V] float32 of the tokens to be placed at positions [B]; history [B, V],
    params [B, 3], min_end [B], bias_ids and bias_values [B, K] of the rows' entries."""
    rep, freq, pres = params[:, 0:1], params[:, 1:2], params[:, 2:3]  # [B, 1] each
    # logit_bias first, then the penalties on the biased logits, as vLLM's sampler does
    # (so a seen token with a bias has (logit + bias) divided by the repetition penalty);
    # the min_new_tokens ban last. A row's bias ids are distinct; its unused slots (-1) are
    # dropped (scatter.py).
    rows = jnp.arange(logits.shape[0])[:, None]  # [B, 1]
    ids = dropped_where_invalid(bias_ids, bias_ids >= 0, logits.shape[1])
    logits = logits.at[rows, ids].add(bias_values.astype(logits.dtype), mode="drop")
    seen = (history & SEEN) != 0
    counts = history & COUNT
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - freq * counts.astype(logits.dtype) - pres * (counts > 0).astype(logits.dtype)
    banned = ((history & STOP) != 0) & (positions < min_end)[:, None]
    return jnp.where(banned, -jnp.inf, logits)


def apply_window(logits: jax.Array, lens: jax.Array, drafts: jax.Array, history: jax.Array, params: jax.Array,
                 min_end: jax.Array, bias_ids: jax.Array, bias_values: jax.Array) -> jax.Array:
    """`apply` for a speculative step's verified window: logits [B, W, V] at positions
    L .. L + k (lens [B] = L) of the window [input token, drafts [B, k]]. Column j's logits
    choose the token at L + j + 1 after drafts 0 .. j - 1, so each column sees the history
    (input token recorded) plus those drafts as generated. Returns [B, W, V] float32."""
    B, W, V = logits.shape
    k = W - 1
    hist = jnp.repeat(history, W, axis=0)  # [B, V] -> [B * W, V]: column j of row b at b * W + j
    if k:
        column = jnp.arange(W)[None, :, None]  # [1, W, 1]
        before = jnp.broadcast_to(jnp.arange(k)[None, None, :] < column, (B, W, k))  # draft i precedes column j > i
        cells = jnp.broadcast_to(jnp.arange(B)[:, None, None] * W + column, (B, W, k))  # [B, W, k] rows of hist
        toks = jnp.broadcast_to(drafts[:, None, :], (B, W, k))
        hist = hist.at[cells, toks].add(before.astype(jnp.int32))
        # `max`, not `set`: a token drafted twice writes its cell from two places.
        hist = hist.at[cells, toks].max(jnp.where(before, hist[cells, toks] | SEEN, 0))
    positions = (lens[:, None] + 1 + jnp.arange(W)[None, :]).reshape(B * W)  # [B, W] -> [B * W]
    out = apply(logits.reshape(B * W, V).astype(jnp.float32), positions, hist,  # [B, W, V] -> [B * W, V]
                *(jnp.repeat(x, W, axis=0) for x in (params, min_end, bias_ids, bias_values)))
    return out.reshape(B, W, V)  # [B * W, V] -> [B, W, V]


def record_drafts(pen: PenaltyState, entries: jax.Array, drafts: jax.Array, accept_lens: jax.Array) -> PenaltyState:
    """A speculative step's accepted drafts [B, k] (the first accept_lens - 1 of each row)
    counted as generated. The step's last token (its bonus) is the next step's input, which
    that step records (`record_generated`), as a plain decode step's token is."""
    accepted = jnp.arange(drafts.shape[1])[None, :] < (accept_lens - 1)[:, None]  # [B, k]
    # The rest, and padded rows, write nothing (jaxoverlap/scatter.py).
    rows = dropped_where_invalid(jnp.broadcast_to(entries[:, None], drafts.shape), accepted & (entries != 0)[:, None],
                                 pen.history.shape[0])  # [B, k]
    history = pen.history.at[rows, drafts].add(1, mode="drop")
    # `max`, not `set`: a token accepted twice in a row writes its cell from two places.
    history = history.at[rows, drafts].max(history[rows, drafts] | SEEN, mode="drop")
    return dataclasses.replace(pen, history=history)


def rows(pen: PenaltyState, entries: jax.Array) -> tuple:
    """The entries' (history, params, min_end, bias_ids, bias_values): what `apply` takes
    after the logits and positions."""
    return (pen.history[entries], pen.params[entries], pen.min_end[entries], pen.bias_ids[entries],
            pen.bias_values[entries])


def record_generated(pen: PenaltyState, entries: jax.Array, tokens: jax.Array) -> PenaltyState:
    """A decode step's input tokens [B] (each row's last generated token), counted once for
    their entries [B], which are distinct; padded rows (entry 0) write nothing."""
    old = pen.history[entries, tokens]  # [B]
    rows = entry_rows(entries, pen.history.shape[0])
    return dataclasses.replace(pen, history=pen.history.at[rows, tokens].set((old + 1) | SEEN, mode="drop"))


def record_prefill(pen: PenaltyState, entries, tokens, starts, chunk_lens, inp: PrefillPenaltyInputs) -> PenaltyState:
    """A prefill chunk of R rows: entries [R], tokens [R, Q], starts / chunk_lens [R]. A
    row's first chunk clears its entry's history and marks its stop tokens first. Rows may
    be segments of one request's chunk: each counts its tokens, and the last writes the
    entry's params (scatter.last_segments)."""
    R, Q = tokens.shape
    E = pen.history.shape[0]
    real = (entries != 0)[:, None]  # [R, 1]; padded rows (entry 0) write nothing (jaxoverlap/scatter.py)
    history = pen.history
    cleared = dropped_where_invalid(entries, inp.first & real[:, 0], E)  # [R]
    history = history.at[cleared].set(0, mode="drop")
    marked = inp.first[:, None] & (inp.stop_ids >= 0) & real  # [R, K]
    stop_rows = dropped_where_invalid(jnp.broadcast_to(entries[:, None], marked.shape), marked, E)  # [R, K]
    history = history.at[stop_rows, jnp.maximum(inp.stop_ids, 0)].set(STOP, mode="drop")
    offsets = jnp.arange(Q, dtype=jnp.int32)[None, :]
    valid = (offsets < chunk_lens[:, None]) & real  # [R, Q]
    generated = valid & (starts[:, None] + offsets >= inp.prompt_lens[:, None])
    # Padding positions write nothing, so that no scatter below writes a request's row twice
    # with different values (a row's token 0 may be both a real and a padding position).
    rows = dropped_where_invalid(jnp.broadcast_to(entries[:, None], (R, Q)), valid, E)  # [R, Q]
    history = history.at[rows, tokens].add(generated.astype(jnp.int32), mode="drop")
    history = history.at[rows, tokens].set(history[rows, tokens] | SEEN, mode="drop")
    owners = last_segments(entries, starts)  # one row per entry writes its params
    return PenaltyState(history=history, params=set_rows(pen.params, owners, inp.params),
                        min_end=set_rows(pen.min_end, owners, inp.min_end),
                        bias_ids=set_rows(pen.bias_ids, owners, inp.bias_ids),
                        bias_values=set_rows(pen.bias_values, owners, inp.bias_values))
