"""The jitted step programs: pure functions of (params, donated device state, small int arrays).

The host hands a step only entry ids, its new page reservations and, for prefill, the
prompt tokens. Each step reads lengths and input tokens from the relay, writes K/V, samples,
writes the next tokens and lengths back into the relay, and returns the sampled tokens,
which the host reads one step later. Donating `state` lets XLA update the KV cache, the
relay and `req_to_token` in place.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxoverlap import penalties
from jaxoverlap.device_state import DeviceState, Relay
from jaxoverlap.models.config import ModelConfig
from jaxoverlap.models.params import ModelParams
from jaxoverlap.models.transformer import forward, lm_logits, xla_paged_attention
from jaxoverlap.penalties import PrefillPenaltyInputs
from jaxoverlap.sampling import sample
from jaxoverlap.sampling_params import MAX_TOP_LOGPROBS
from jaxoverlap.scatter import entry_rows, last_segment_rows, last_segments, set_rows


def pack_for_host(*columns: jax.Array) -> jax.Array:
    """The per-row results a step hands to the host, as one [R, C] int32 array.

    Each column group is [R] or [R, k], int32 or float32 (stored as its bits). One output
    array means one device-to-host copy per step to start and one output buffer whose
    address XLA's recorded CUDA graph must follow, instead of one per result."""
    parts = []
    for c in columns:
        c = c if c.dtype == jnp.int32 else jax.lax.bitcast_convert_type(c.astype(jnp.float32), jnp.int32)
        parts.append(c[:, None] if c.ndim == 1 else c)  # [R] -> [R, 1]
    return jnp.concatenate(parts, axis=1)


def float_bits(x) -> jax.Array | np.ndarray:
    """The float32 values whose bits an int32 column holds (device or host array)."""
    if isinstance(x, np.ndarray):
        return x.view(np.float32)
    return jax.lax.bitcast_convert_type(x, jnp.float32)


TOP_LOGPROBS = MAX_TOP_LOGPROBS  # alternatives a step returns per row, whatever each row asked for


def top_logprobs_of(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] -> ([B, K] token ids, [B, K] their logprobs), the K most likely tokens
    of the raw model distribution, most likely first."""
    values, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), TOP_LOGPROBS)
    return ids.astype(jnp.int32), values


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOutput:
    """The small per-row results that travel to the host (asynchronously), packed into one
    array (`pack_for_host`): column 0 the sampled token, column 1 its logprob's bits, and in
    programs for top logprobs (`has_top`, static) TOP_LOGPROBS token ids and their logprobs."""

    packed: jax.Array  # [R, 2] int32, or [R, 2 + 2K] with the top logprobs
    has_top: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def of(cls, tokens: jax.Array, logprobs: jax.Array, top=None) -> "StepOutput":
        """top: None, or ([R, K] ids, [R, K] logprobs) from `top_logprobs_of`."""
        return cls(pack_for_host(tokens, logprobs, *(top or ())), has_top=top is not None)

    def top_part(self, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """([R, K] ids, [R, K] float32 logprobs) from the host copy of `packed`, or None."""
        if not self.has_top:
            return None
        K = TOP_LOGPROBS
        return packed[:, 2 : 2 + K], float_bits(np.ascontiguousarray(packed[:, 2 + K : 2 + 2 * K]))

    @property
    def tokens(self):  # [R] int32
        return self.packed[:, 0]

    @property
    def logprobs(self):  # [R] float32
        return float_bits(self.packed[:, 1])

    @staticmethod
    def unpack(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
        """(tokens, logprobs, accept_lens=None) from the host copy of `packed`."""
        return packed[:, 0], float_bits(np.ascontiguousarray(packed[:, 1])), None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Reservations:
    """New pages for req_to_token: position block `page_index` of row `entry` gets `page`.

    One [3, N] int32 array (entries; page indices; pages): one buffer for a prefill, and
    part of the one input array of a decode step (DecodeInputs). Padded to a fixed
    capacity with (entry 0, block 0, page 0), which `apply_reservations` skips.
    """

    table: jax.Array  # [3, N] int32

    @classmethod
    def of(cls, entries, page_index, pages) -> "Reservations":
        return cls(np.stack([np.asarray(entries), np.asarray(page_index), np.asarray(pages)]).astype(np.int32))

    @classmethod
    def empty(cls, capacity: int) -> "Reservations":
        return cls(np.zeros((3, capacity), np.int32))

    @property
    def entries(self) -> jax.Array:  # [N]
        return self.table[0]

    @property
    def page_index(self) -> jax.Array:  # [N]
        return self.table[1]

    @property
    def pages(self) -> jax.Array:  # [N]
        return self.table[2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """Everything the host sends a decode step, in one int32 array: the rows' relay entries,
    then the step's reservations table, flattened.

    One array means one host-to-device transfer per launch, and one input buffer that
    XLA's recorded CUDA graph must follow. The host sends it with every step
    (EngineConfig.decode_inputs), so every step allocates the same buffers and the step's
    temp buffer keeps its address (benchmarks/RESULTS.md, 2026-12-04). The batch size is
    static (part of the pytree's structure), so that the split below is a static slice.
    """

    packed: jax.Array  # [B + 3 * N] int32: entries [B] (padded rows on entry 0), then the [3, N] table
    batch: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def of(cls, entries, res: Reservations) -> "DecodeInputs":
        """From host arrays: entries [B] and a reservations table [3, N]."""
        entries, table = np.asarray(entries, np.int32), np.asarray(res.table, np.int32)
        return cls(np.concatenate([entries, table.reshape(-1)]), batch=entries.shape[0])  # [3, N] -> [3 * N]

    @classmethod
    def empty(cls, batch: int, capacity: int) -> "DecodeInputs":
        """B rows on the dummy entry 0 and no reservation (shapes for compiling)."""
        return cls(np.zeros((batch + 3 * capacity,), np.int32), batch=batch)

    @property
    def entries(self):  # [B]
        return self.packed[: self.batch]

    @property
    def reservations(self) -> Reservations:
        return Reservations(self.packed[self.batch :].reshape(3, -1))  # [3 * N] -> [3, N]


def apply_reservations(req_to_token: jax.Array, res: Reservations, page_size: int) -> jax.Array:
    """Write the host's new reservations into the table, as the prologue of a step.

    Why there is no write-after-read hazard (the "fence" that SGLang needs, design.md
    sections 2 and 3): this scatter is part of the program of step N+1, and all programs of
    this process run in order on the device's queue. Step N, which may still read rows that
    the host has since freed and handed to another request, has finished every read of the
    table before this program starts. Donation does not break that: a donated buffer is
    reused only after the programs that read it. No table write ever happens outside a
    step program, so there is no other stream to fence.
    """
    offsets = jnp.arange(page_size, dtype=jnp.int32)
    cols = res.page_index[:, None] * page_size + offsets  # [N, page_size] positions
    slots = res.pages[:, None] * page_size + offsets  # [N, page_size] slot numbers
    # Padding (entry 0, the dummy row, which no reservation names) writes nothing, rather
    # than colliding writes into row 0 (jaxoverlap/scatter.py).
    rows = entry_rows(res.entries, req_to_token.shape[0])  # [N]
    rows = jnp.broadcast_to(rows[:, None], cols.shape)  # [N] -> [N, page_size]
    return req_to_token.at[rows, cols].set(slots, mode="drop")


def keep_layout(state: DeviceState, state_sharding) -> DeviceState:
    """Under tensor parallelism (`state_sharding`: parallel.StateSharding), the state a step
    returns keeps the layout it came in: otherwise XLA may hand an array back split
    differently (the penalty history like the vocabulary-split logits, a drafter cache like
    shard_map's heads), and a program compiled ahead for the first layout refuses it."""
    return state if state_sharding is None else state_sharding(state)


def _write_relay(relay: Relay, entries, new_lens, new_tokens, **params) -> Relay:
    # Padded rows (entry 0) write nothing, so entry 0 keeps length 0 and padded rows keep
    # reading position 0 of the dummy row.
    updates = dict(seq_lens=set_rows(relay.seq_lens, entries, new_lens),
                   tokens=set_rows(relay.tokens, entries, new_tokens))
    for name, value in params.items():
        updates[name] = set_rows(getattr(relay, name), entries, value)
    return dataclasses.replace(relay, **updates)


def _decode_forward(params: ModelParams, state: DeviceState, inputs: DecodeInputs, *, cfg: ModelConfig,
                    ctx_len: int, page_size: int, attention) -> tuple[DeviceState, jax.Array]:
    """The model part of a decode step: the step's reservations, one token per row through
    the model (K/V written at each row's length) and the LM head. The relay is only read.
    Returns (state, logits [B, V] float32)."""
    entries = inputs.entries  # [B] int32, padded rows on entry 0
    req_to_token = apply_reservations(state.req_to_token, inputs.reservations, page_size)
    lens = state.relay.seq_lens[entries]  # [B]: the position this step writes
    tokens = state.relay.tokens[entries]  # [B]: the token produced by the previous step
    hidden, k_cache, v_cache = forward(
        params, cfg, state.k_cache, state.v_cache, req_to_token,
        tokens=tokens[:, None],
        positions=lens[:, None],
        entries=entries,
        q_valid=(entries != 0)[:, None],
        kv_lens=lens + 1,
        ctx_len=ctx_len,
        attention=attention,
    )
    logits = lm_logits(params, hidden[:, 0])  # [B, V]
    return dataclasses.replace(state, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token), logits


def _decode_sample(state: DeviceState, inputs: DecodeInputs, logits: jax.Array, allowed: jax.Array | None, *,
                   sampling: bool, top_logprobs: bool) -> tuple[DeviceState, StepOutput]:
    """The sampling part of a decode step: each row's token from `logits` [B, V], written
    into the relay with the row's new length (the next step reads both there)."""
    entries, relay = inputs.entries, state.relay
    lens = relay.seq_lens[entries]  # [B]: the position the forward part wrote
    penalty, row_penalties = state.penalty, None
    if sampling and penalty is not None:  # the host sends every batch with a penalized row here
        penalty = penalties.record_generated(penalty, entries, relay.tokens[entries])
        row_penalties = penalties.rows(penalty, entries)
    next_tokens, logprobs = sample(
        logits, relay.temperature[entries], relay.top_k[entries], relay.top_p[entries],
        relay.min_p[entries], relay.seed[entries], lens + 1, sampling=sampling, penalties=row_penalties,
        allowed=allowed,
    )
    relay = _write_relay(relay, entries, lens + 1, next_tokens)
    state = dataclasses.replace(state, relay=relay, penalty=penalty)
    return state, StepOutput.of(next_tokens, logprobs, top_logprobs_of(logits) if top_logprobs else None)


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "ctx_len", "page_size", "attention", "sampling", "top_logprobs", "state_sharding"),
    donate_argnames=("state",),
)
def decode_step(
    params: ModelParams,
    state: DeviceState,
    inputs: DecodeInputs,
    *,
    cfg: ModelConfig,
    ctx_len: int,
    page_size: int,
    attention=xla_paged_attention,
    sampling: bool = True,
    top_logprobs: bool = False,
    state_sharding=None,
):
    """One plain decoding step for B rows: one token per row, everything read from the relay.
    `top_logprobs` (static): also return each row's TOP_LOGPROBS most likely tokens."""
    state, logits = _decode_forward(params, state, inputs, cfg=cfg, ctx_len=ctx_len, page_size=page_size,
                                    attention=attention)
    state, out = _decode_sample(state, inputs, logits, None, sampling=sampling, top_logprobs=top_logprobs)
    return keep_layout(state, state_sharding), out


# A decode step of a batch with structured output runs as the two halves above, one program
# each: the forward pass launches before the host knows the rows' allowed tokens (they follow
# from the tokens of the step in flight), and the sampling after it has built them, while the
# forward pass runs (engine.Engine._step_overlap; vLLM splits its step the same way).
@functools.partial(
    jax.jit, static_argnames=("cfg", "ctx_len", "page_size", "attention", "state_sharding"),
    donate_argnames=("state",),
)
def decode_forward_step(params: ModelParams, state: DeviceState, inputs: DecodeInputs, *, cfg: ModelConfig,
                        ctx_len: int, page_size: int, attention=xla_paged_attention, state_sharding=None):
    """A decode step's forward pass: (state, logits [B, V] float32) for `decode_sample_step`."""
    state, logits = _decode_forward(params, state, inputs, cfg=cfg, ctx_len=ctx_len, page_size=page_size,
                                    attention=attention)
    return keep_layout(state, state_sharding), logits


@functools.partial(jax.jit, static_argnames=("sampling", "top_logprobs", "state_sharding"),
                   donate_argnames=("state",))
def decode_sample_step(state: DeviceState, inputs: DecodeInputs, logits: jax.Array, allowed: jax.Array, *,
                       sampling: bool = True, top_logprobs: bool = False, state_sharding=None):
    """A decode step's sampling, after `decode_forward_step` on the same inputs. `allowed`
    [B, ceil(V / 32)] int32: the tokens each row may take (a bitmask, all bits set for rows
    without a constraint)."""
    state, out = _decode_sample(state, inputs, logits, allowed, sampling=sampling, top_logprobs=top_logprobs)
    return keep_layout(state, state_sharding), out


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptLogprobOutput(StepOutput):
    """A prefill's results when some row asked for its prompt's logprobs: the columns of a
    StepOutput, then for each of the chunk's Q positions the logprob of the prompt token
    that follows it, then whether that token was the argmax there."""

    packed: jax.Array  # [R, 2 (+ 2K) + 2Q] int32

    @classmethod
    def of(cls, tokens, logprobs, target_logprobs, target_is_top1, top=None) -> "PromptLogprobOutput":
        packed = pack_for_host(tokens, logprobs, *(top or ()), target_logprobs, target_is_top1.astype(jnp.int32))
        return cls(packed, has_top=top is not None)

    def prompt_part(self, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([R, Q] float32 logprobs, [R, Q] bool argmax flags) from the host copy of `packed`."""
        first = 2 + (2 * TOP_LOGPROBS if self.has_top else 0)
        Q = (packed.shape[1] - first) // 2
        return (float_bits(np.ascontiguousarray(packed[:, first : first + Q])),
                packed[:, first + Q :].astype(bool))


def token_logprobs(params: ModelParams, hidden: jax.Array, targets: jax.Array, block: int = 256):
    """The logprob of `targets` [R, Q] under the logits of `hidden` [R, Q, D], and whether
    each target is the argmax there. The [R*Q, V] float32 logits of a long chunk would be
    large (2048 positions x 152k vocabulary: 1.2 GB), so they are made `block` positions at
    a time."""
    R, Q, D = hidden.shape
    n = R * Q
    blocks = -(-n // block)
    pad = blocks * block - n
    h = jnp.pad(hidden.reshape(n, D), ((0, pad), (0, 0))).reshape(blocks, block, D)  # [R, Q, D] -> [nb, block, D]
    t = jnp.pad(targets.reshape(n), (0, pad)).reshape(blocks, block)  # [R, Q] -> [nb, block]

    def one_block(args):
        hb, tb = args
        logits = lm_logits(params, hb)  # [block, V] float32
        picked = jnp.take_along_axis(logits, tb[:, None], axis=1)[:, 0]
        return picked - jax.nn.logsumexp(logits, axis=-1), picked >= jnp.max(logits, axis=-1)

    lp, top1 = jax.lax.map(one_block, (h, t))
    return lp.reshape(-1)[:n].reshape(R, Q), top1.reshape(-1)[:n].reshape(R, Q)  # [nb, block] -> [R, Q]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillInputs:
    tokens: jax.Array  # [R, Q] int32 prompt tokens of this chunk (padded with 0)
    starts: jax.Array  # [R] int32 position of the chunk's first token
    chunk_lens: jax.Array  # [R] int32 valid tokens in the chunk (0 for padded rows)
    entries: jax.Array  # [R] int32
    temperature: jax.Array  # [R] float32 sampling params, stored into the relay on admission
    top_k: jax.Array  # [R] int32
    top_p: jax.Array  # [R] float32
    min_p: jax.Array  # [R] float32
    seed: jax.Array  # [R] uint32
    # Only for prefills with prompt_logprobs: [R, Q] int32, the prompt token after each of
    # the chunk's positions (the next chunk's first token after the last), 0 where none.
    targets: jax.Array | None = None
    # Where the engine serves penalties (DeviceState.penalty): the rows' penalty params,
    # stop tokens and min_new_tokens.
    penalties: PrefillPenaltyInputs | None = None
    # Some row asked for top logprobs (static: a program of its own, like `targets`).
    top_logprobs: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # Structured output: [R, ceil(V / 32)] int32, the tokens each row's sample may take (a
    # bitmask, all bits set for other rows); None (a program without it) when no row has one.
    allowed: jax.Array | None = None


def sample_after_chunks(params: ModelParams, last_hidden, entries, starts, kv_lens, row_params, penalty, *,
                        count: int, sampling: bool, top_logprobs: bool, allowed=None):
    """The token after each chunk of a prefill of R rows (last_hidden [R, D]; entries,
    starts, kv_lens [R]; row_params: temperature, top_k, top_p, min_p, seed, each [R]).

    Only a chunk's last segment needs its sample (scatter.last_segments), and a step holds
    at most `count` requests: with more rows than that, only those rows go through the LM
    head and the sampler (a sort over the vocabulary each), then back to their rows; the
    other rows get token 0 and logprob 0, which nothing reads. Returns (tokens [R],
    logprobs [R], top logprobs ([R, K], [R, K]) or None)."""
    R = last_hidden.shape[0]
    rows = last_segment_rows(entries, starts, count) if count < R else None  # [count]

    def picked(x):  # [R, ...] -> [count, ...] (past-end indices clip: their rows are dropped below)
        return x if rows is None else jnp.take(x, rows, axis=0, mode="clip")

    def back(x):  # [count, ...] -> [R, ...], zeros elsewhere
        return x if rows is None else jnp.zeros((R,) + x.shape[1:], x.dtype).at[rows].set(x, mode="drop")

    logits = lm_logits(params, picked(last_hidden))  # [count, V]
    row_penalties = penalties.rows(penalty, picked(entries)) if penalty is not None else None
    tokens, logprobs = sample(logits, *(picked(x) for x in row_params), picked(kv_lens), sampling=sampling,
                              penalties=row_penalties, allowed=None if allowed is None else picked(allowed))
    top = tuple(back(x) for x in top_logprobs_of(logits)) if top_logprobs else None
    return back(tokens), back(logprobs), top


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "ctx_len", "page_size", "attention", "sampling", "sampled_rows", "state_sharding"),
    donate_argnames=("state",),
)
def prefill_step(
    params: ModelParams,
    state: DeviceState,
    inp: PrefillInputs,
    res: Reservations,
    *,
    cfg: ModelConfig,
    ctx_len: int,
    page_size: int,
    attention=xla_paged_attention,
    sampling: bool = True,
    sampled_rows: int | None = None,
    state_sharding=None,
):
    """One chunk of prompt for each of R rows, over the cached prefix of each row.

    The relay entry of a row gets its length, sampling params and the token sampled after
    the chunk; for a row whose prompt is not finished the next chunk overwrites them, and
    no decode step reads the entry before the last chunk has run. `sampled_rows` (static;
    None: R): the most requests of the step, the rows that sample (`sample_after_chunks`).
    """
    req_to_token = apply_reservations(state.req_to_token, res, page_size)
    R, Q = inp.tokens.shape
    offsets = jnp.arange(Q, dtype=jnp.int32)
    positions = inp.starts[:, None] + offsets  # [R, Q]
    q_valid = offsets[None, :] < inp.chunk_lens[:, None]
    kv_lens = inp.starts + inp.chunk_lens
    hidden, k_cache, v_cache = forward(
        params, cfg, state.k_cache, state.v_cache, req_to_token,
        tokens=inp.tokens,
        positions=positions,
        entries=inp.entries,
        q_valid=q_valid,
        kv_lens=kv_lens,
        ctx_len=ctx_len,
        attention=attention,
    )
    last = jnp.maximum(inp.chunk_lens - 1, 0)
    last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [R, D]
    penalty = state.penalty
    if penalty is not None:
        penalty = penalties.record_prefill(penalty, inp.entries, inp.tokens, inp.starts, inp.chunk_lens,
                                           inp.penalties)
    next_tokens, logprobs, top = sample_after_chunks(
        params, last_hidden, inp.entries, inp.starts, kv_lens,
        (inp.temperature, inp.top_k, inp.top_p, inp.min_p, inp.seed), penalty,
        count=sampled_rows or R, sampling=sampling, top_logprobs=inp.top_logprobs, allowed=inp.allowed)
    relay = _write_relay(  # a chunk's last segment writes the entry (scatter.last_segments)
        state.relay, last_segments(inp.entries, inp.starts), kv_lens, next_tokens,
        temperature=inp.temperature, top_k=inp.top_k, top_p=inp.top_p, min_p=inp.min_p, seed=inp.seed,
    )
    state = dataclasses.replace(state, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token, relay=relay,
                                penalty=penalty)
    state = keep_layout(state, state_sharding)
    if inp.targets is not None:  # a row asked for its prompt's logprobs (a program of its own)
        return state, PromptLogprobOutput.of(next_tokens, logprobs, *token_logprobs(params, hidden, inp.targets), top)
    return state, StepOutput.of(next_tokens, logprobs, top)
