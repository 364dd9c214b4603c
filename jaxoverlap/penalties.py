"""Repetition, frequency and presence penalties, applied on the device.

Semantics as in vLLM and SGLang (and OpenAI's API for the last two), per request:
  repetition_penalty r (> 0, 1 = off): a token that occurs in the prompt or the output so
      far has its logit divided by r where positive, multiplied by r where negative;
  frequency_penalty f (-2..2, 0 = off): f x (times the token was generated) is subtracted;
  presence_penalty p (-2..2, 0 = off): p is subtracted from every token generated before.
They shape which token is chosen (greedy or sampled); reported logprobs stay those of the
raw model distribution, as without penalties.

Each relay entry keeps a [V] row of history on the device (`PenaltyState`), so the host
sends nothing per step and the overlap loop needs no token it has not seen yet: a decode
step first records its input token (the one the step before generated), then penalizes.
A prefill records its chunk's tokens: prompt positions as seen, positions at or past the
prompt's end (a retracted request's output, prefilled again) as generated too. A request's
first chunk clears the row that the entry's previous owner left. So a request with
penalties must prefill its whole prompt and never read the prefix cache
(`SamplingParams.has_penalties`, Scheduler._admit).

Only sampling programs (static `sampling=True`) read or write the history: the host routes
every batch with a penalized row to one (runner.batch_samples), and prefill programs always
sample. Rows without penalties (1, 0, 0) pass through `apply` unchanged, whatever their
entry's row holds.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SEEN = 1 << 24  # history bit: the token occurs in the prompt or the output
COUNT = SEEN - 1  # history bits 0-23: how many times the request generated the token
NEUTRAL = (1.0, 0.0, 0.0)  # (repetition, frequency, presence) of a request without penalties


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PenaltyState:
    history: jax.Array  # [E, V] int32: per entry and token, SEEN | times generated
    params: jax.Array  # [E, 3] float32: repetition, frequency, presence


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillPenaltyInputs:
    """What a prefill needs to keep its rows' histories (steps.PrefillInputs.penalties)."""

    params: jax.Array  # [R, 3] float32: repetition, frequency, presence (NEUTRAL for padding)
    prompt_lens: jax.Array  # [R] int32: positions from here on hold generated tokens


def init_penalty_state(num_entries: int, vocab_size: int) -> PenaltyState:
    return PenaltyState(
        history=jnp.zeros((num_entries, vocab_size), jnp.int32),
        params=jnp.tile(jnp.asarray(NEUTRAL, jnp.float32), (num_entries, 1)),  # [3] -> [E, 3]
    )


def state_bytes(num_entries: int, vocab_size: int) -> int:
    return num_entries * (vocab_size + 3) * 4


def apply(logits: jax.Array, history: jax.Array, params: jax.Array) -> jax.Array:
    """logits [B, V] float32; history [B, V] int32 and params [B, 3] of the rows' entries."""
    rep, freq, pres = params[:, 0:1], params[:, 1:2], params[:, 2:3]  # [B, 1] each
    seen = (history & SEEN) != 0
    counts = history & COUNT
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - freq * counts.astype(logits.dtype) - pres * (counts > 0).astype(logits.dtype)


def record_generated(pen: PenaltyState, entries: jax.Array, tokens: jax.Array) -> PenaltyState:
    """A decode step's input tokens [B] (each row's last generated token), counted once for
    their entries [B]. Entries are distinct but for padded rows, which all use entry 0 and
    may leave anything in its row (no request reads it)."""
    old = pen.history[entries, tokens]  # [B]
    return dataclasses.replace(pen, history=pen.history.at[entries, tokens].set((old + 1) | SEEN))


def record_prefill(pen: PenaltyState, entries, tokens, starts, chunk_lens, inp: PrefillPenaltyInputs) -> PenaltyState:
    """A prefill chunk of R rows: entries [R], tokens [R, Q], starts / chunk_lens [R]. A row
    starting at position 0 clears its entry's history first."""
    R, Q = tokens.shape
    history = pen.history
    fresh = (starts == 0)[:, None]  # [R, 1]
    history = history.at[entries].set(jnp.where(fresh, 0, history[entries]))  # padded rows: entry 0, all zero
    offsets = jnp.arange(Q, dtype=jnp.int32)[None, :]
    valid = offsets < chunk_lens[:, None]  # [R, Q]
    generated = valid & (starts[:, None] + offsets >= inp.prompt_lens[:, None])
    # Padding positions go to entry 0, so that no scatter below writes a request's row twice
    # with different values (a row's token 0 may be both a real and a padding position).
    rows = jnp.where(valid, entries[:, None], 0)  # [R, Q]
    history = history.at[rows, tokens].add(generated.astype(jnp.int32))
    history = history.at[rows, tokens].set(history[rows, tokens] | SEEN)
    return PenaltyState(history=history, params=pen.params.at[entries].set(inp.params))
