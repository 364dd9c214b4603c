"""The jitted speculative programs: one decode step = draft, verify, accept, extend, relay.

Each is one program over (target params, drafter params, donated device state, small int
arrays), like steps.py: nothing inside waits for the host, with or without overlap. The
host hands a decode step entry ids and new reservations (and, for the host n-gram drafter
only, the drafts; for a batch with structured output, the accept program's masks);
padded rows use entry 0 and write nothing, so its relay length stays 0
(jaxoverlap/scatter.py).

Relay writes follow the article's order (section 4.1): the new lengths right after the
verify pass ("publish"), then the bonus token and the drafter's state after draft extend
("stash"). Inside one XLA program that order is the program's data flow, not a timeline:
nothing outside the program can see the relay before the program ends.

A batch with structured output runs the same step as three programs (draft, verify,
accept: `spec_draft_step` etc. below), so that the host can build each window position's
allowed tokens from the drafts while the verify pass runs (jaxoverlap/structured.py).

`sampling` is static (see verify.py): all-greedy batches run a program without the
vocabulary sorts and the rejection sampler, and no program holds a `lax.cond`, whose
predicate XLA would read back to the host on GPU.
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
from jaxoverlap.sampling import keep_allowed, keep_allowed_after_rules
from jaxoverlap.scatter import last_segments, set_rows
from jaxoverlap.speculative import draft_model, eagle, ngram_device
from jaxoverlap.speculative.spec_config import SpecConfig
from jaxoverlap.speculative.verify import SamplingRows, accept
from jaxoverlap.steps import (
    TOP_LOGPROBS,
    DecodeInputs,
    PromptLogprobOutput,
    Reservations,
    StepOutput,
    apply_reservations,
    float_bits,
    keep_layout,
    pack_for_host,
    sample_after_chunks,
    token_logprobs,
    top_logprobs_of,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecStepOutput:
    """The small per-row results of a speculative step. Those for the host are packed into
    one array (steps.pack_for_host): W tokens, the W logprobs' bits, the accept length, and
    in programs for top logprobs (`has_top`, static) each window position's TOP_LOGPROBS
    token ids and their logprobs' bits."""

    packed: jax.Array  # [B, 2W + 1] int32, or [B, 2W + 1 + 2WK] with the top logprobs
    drafts: jax.Array  # [B, k] int32: what the drafter proposed (kept on the device; for tests)
    has_top: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def of(cls, tokens, logprobs, accept_lens, drafts, top=None) -> "SpecStepOutput":
        """top: None, or ([B, W, K] ids, [B, W, K] logprobs) of every window position."""
        B = tokens.shape[0]
        flat = () if top is None else tuple(t.reshape(B, -1) for t in top)  # [B, W, K] -> [B, W * K]
        return cls(pack_for_host(tokens, logprobs, accept_lens, *flat), drafts, has_top=top is not None)

    @property
    def window(self) -> int:
        return self.drafts.shape[1] + 1

    @property
    def tokens(self):  # [B, W] int32: accepted drafts, then the bonus token, then -1
        return self.packed[:, : self.window]

    @property
    def logprobs(self):  # [B, W] float32 of those tokens under the target
        return float_bits(self.packed[:, self.window : 2 * self.window])

    @property
    def accept_lens(self):  # [B] int32: tokens the row gained (accepted drafts + 1)
        return self.packed[:, 2 * self.window]

    def unpack(self, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens [B, W], logprobs [B, W], accept_lens [B]) from the host copy of `packed`."""
        W = self.window
        return packed[:, :W], float_bits(np.ascontiguousarray(packed[:, W : 2 * W])), packed[:, 2 * W]

    def top_part(self, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """([B, W, K] ids, [B, W, K] float32 logprobs) from the host copy of `packed`, or None."""
        if not self.has_top:
            return None
        B, W, K = packed.shape[0], self.window, TOP_LOGPROBS
        first = 2 * W + 1
        ids = packed[:, first : first + W * K].reshape(B, W, K)  # [B, W * K] -> [B, W, K]
        values = float_bits(np.ascontiguousarray(packed[:, first + W * K : first + 2 * W * K])).reshape(B, W, K)
        return ids, values


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HostDrafts:
    """Drafts built on the host (n-gram trie); absent (None) for every other drafter."""

    tokens: jax.Array  # [B, k] int32
    counts: jax.Array  # [B] int32 real drafts per row


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecPrefillInputs:
    """A prefill chunk with one leading column: the token before the chunk (position s - 1),
    which the target reads but does not write, so that the EAGLE head can pair the hidden
    state of position s - 1 with the chunk's first token (see eagle.prefill)."""

    tokens: jax.Array  # [R, T] int32: column 0 the token at s - 1 (0 when s == 0), then the chunk
    starts: jax.Array  # [R] int32 s, the position of the chunk's first token
    chunk_lens: jax.Array  # [R] int32 c (0 for padded rows); c + 1 <= T
    entries: jax.Array  # [R] int32
    is_last: jax.Array  # [R] bool: the chunk ends the prompt (its sampled token is the request's)
    # [R] int32 / bool: a resumed (retracted) request's next token, used instead of sampling
    # one, so that it continues as if it had never been retracted (Request.resume_token).
    given_tokens: jax.Array
    has_given: jax.Array
    temperature: jax.Array  # [R] float32
    top_k: jax.Array  # [R] int32
    top_p: jax.Array  # [R] float32
    min_p: jax.Array  # [R] float32
    seed: jax.Array  # [R] uint32
    # Only for prefills with prompt_logprobs, as steps.PrefillInputs: [R, T - 1] int32, the
    # prompt token after each of the chunk's positions (column 0 of `tokens` has none).
    targets: jax.Array | None = None
    # Where the engine serves penalties (DeviceState.penalty), as steps.PrefillInputs.
    penalties: PrefillPenaltyInputs | None = None
    # Some row asked for top logprobs (static: a program of its own), as steps.PrefillInputs.
    top_logprobs: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # Where a row has structured output, as steps.PrefillInputs: [R, ceil(V / 32)] int32.
    allowed: jax.Array | None = None


def _set(relay: Relay, entries, **fields) -> Relay:
    """Per-entry relay writes; padded rows (entry 0) write nothing (jaxoverlap/scatter.py)."""
    return dataclasses.replace(relay, **{k: set_rows(getattr(relay, k), entries, v) for k, v in fields.items()})


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Drafted:
    """A speculative step's drafts, between its draft pass and its verification.

    In the fused step (`spec_decode_step`) they never leave the program. A batch with
    structured output runs the step as three programs (`spec_draft_step`, `spec_verify_step`,
    `spec_accept_step`), and these arrays pass between them; `packed` is the host's copy,
    from which it builds each window position's allowed tokens (structured.Grammars)."""

    tokens: jax.Array  # [B, k] int32
    counts: jax.Array  # [B] int32 real drafts per row (the rest are never accepted)
    # [B, k, V] float32: the drafter's filtered distributions of sampled drafts (EAGLE and the
    # draft model in sampling programs), None where the drafts are deterministic.
    probs: jax.Array | None = None
    # [B, k + 1] int32: the drafts, then their count, in one array for the host (set by
    # `spec_draft_step` only).
    packed: jax.Array | None = None

    @staticmethod
    def unpack(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [B, k], counts [B]) from the host copy of `packed`."""
        return packed[:, :-1], packed[:, -1]


def _draft(params, dparams, state: DeviceState, inputs: DecodeInputs, host_drafts: HostDrafts | None, *,
           cfg: ModelConfig, spec: SpecConfig, page_size: int, sampling: bool, **common):
    """Part 1 of a speculative step: the step's reservations, then the draft passes.
    Returns (state, Drafted without `packed`)."""
    entries = inputs.entries  # [B] int32, padded rows on entry 0
    req_to_token = apply_reservations(state.req_to_token, inputs.reservations, page_size)
    relay = state.relay
    B, k = entries.shape[0], spec.num_draft
    real = entries != 0
    lens = relay.seq_lens[entries]  # [B] L: the window covers positions L .. L + k
    bonus = relay.tokens[entries]  # [B] the previous step's bonus token, at position L
    sp = SamplingRows.from_relay(relay, entries)
    dk, dv = state.draft_k_cache, state.draft_v_cache
    drafting = dict(sp=sp, sampling=sampling, **common)
    # With speculation paused (k = 0: a large batch, where verifying drafts costs more than
    # it gains) nothing is drafted, and the drafter only keeps its state up to date (here and
    # in part 3), so that drafting can resume at any later step.
    draft_probs = None
    if k == 0:
        drafts, counts = jnp.zeros((B, 0), jnp.int32), jnp.zeros((B,), jnp.int32)
        if spec.algorithm == "draft_model":  # the K/V of L - 1 that the first draft pass would write
            dk, dv = draft_model.write_last(dparams, spec.draft_cfg, dk, dv, req_to_token, relay, entries=entries,
                                            lens=lens, **common)
    elif spec.algorithm == "eagle":
        drafts, draft_probs, dk, dv = eagle.propose(dparams, spec.draft_cfg, params, dk, dv, req_to_token, relay,
                                                    entries=entries, lens=lens, num_draft=k, **drafting)
        counts = jnp.where(real, k, 0)
    elif spec.algorithm == "draft_model":
        drafts, draft_probs, dk, dv = draft_model.propose(dparams, spec.draft_cfg, dk, dv, req_to_token, relay,
                                                          entries=entries, lens=lens, bonus=bonus, num_draft=k,
                                                          vocab=cfg.vocab_size, **drafting)
        counts = jnp.where(real, k, 0)
    elif spec.algorithm == "ngram_device":
        drafts, counts = ngram_device.propose(state.slot_tokens, req_to_token, entries=entries, lens=lens,
                                              bonus=bonus, num_draft=k, min_match=spec.ngram_min,
                                              max_match=spec.ngram_max, ctx_len=common["ctx_len"])
    else:  # host n-gram
        drafts, counts = host_drafts.tokens, jnp.where(real, host_drafts.counts, 0)
    state = dataclasses.replace(state, req_to_token=req_to_token, draft_k_cache=dk, draft_v_cache=dv)
    probs = draft_probs() if sampling and draft_probs is not None else None  # only sampling programs use q
    return state, Drafted(drafts, counts, probs)


def _verify(params, state: DeviceState, inputs: DecodeInputs, drafts: jax.Array, *, cfg: ModelConfig, **common):
    """Part 2: the target's pass over each row's window (the bonus token, then the drafts).
    Returns (state, logits [B, W, V], hidden [B, W, D])."""
    entries = inputs.entries
    B, W = entries.shape[0], drafts.shape[1] + 1
    lens = state.relay.seq_lens[entries]
    window = jnp.concatenate([state.relay.tokens[entries][:, None], drafts], axis=1)  # [B, W]
    positions = lens[:, None] + jnp.arange(W)[None, :]  # [B, W]
    hidden, k_cache, v_cache = forward(
        params, cfg, state.k_cache, state.v_cache, state.req_to_token,
        tokens=window, positions=positions, entries=entries,
        q_valid=jnp.broadcast_to((entries != 0)[:, None], (B, W)), kv_lens=lens + W, **common,
    )
    state = dataclasses.replace(state, k_cache=k_cache, v_cache=v_cache)
    return state, lm_logits(params, hidden), hidden  # logits [B, W, V]


def _accept_extend(params, dparams, state: DeviceState, inputs: DecodeInputs, drafted: Drafted, logits, hidden,
                   allowed, *, spec: SpecConfig, sampling: bool, top_logprobs: bool, **common):
    """Part 3: acceptance and the new lengths ("publish"), then draft extend and the rest of
    the relay ("stash"). `allowed`: None, or [B, W, ceil(V / 32)] int32, the tokens each
    window position may take (structured output, given the drafts before it)."""
    entries = inputs.entries
    relay = state.relay
    B, W = entries.shape[0], drafted.tokens.shape[1] + 1
    real = entries != 0
    lens = relay.seq_lens[entries]
    bonus = relay.tokens[entries]
    drafts = drafted.tokens
    sp = SamplingRows.from_relay(relay, entries)
    penalty, rule_rows = state.penalty, None
    if sampling and penalty is not None:  # the host sends every batch with a penalized row here
        penalty = penalties.record_generated(penalty, entries, bonus)  # the input token, as a decode step does
        rule_rows = penalties.rows(penalty, entries)

    # Penalties and allowed tokens choose the tokens (each column after the drafts before
    # it); the drafters draft without them, and what they propose against the rules is
    # rejected like any other miss.
    rule_logits = None if rule_rows is None else penalties.apply_window(logits, lens, drafts, *rule_rows)
    if allowed is not None:
        rule_logits = (keep_allowed(logits, allowed) if rule_logits is None
                       else keep_allowed_after_rules(logits, rule_logits, allowed))
    out_tokens, accept_len, logprobs = accept(logits, drafts, drafted.counts, drafted.probs, sp, lens,
                                              sampling=sampling, backend=spec.accept_backend, rule_logits=rule_logits)
    if rule_rows is not None:
        penalty = penalties.record_drafts(penalty, entries, drafts, accept_len)
    new_lens = lens + accept_len  # padded rows write nothing: entry 0 stays at length 0
    relay = _set(relay, entries, seq_lens=new_lens)
    next_token = jnp.take_along_axis(out_tokens, (accept_len - 1)[:, None], axis=1)[:, 0]  # [B] the bonus

    stash = dict(tokens=next_token)
    dk, dv, slot_tokens = state.draft_k_cache, state.draft_v_cache, state.slot_tokens
    window = jnp.concatenate([bonus[:, None], drafts], axis=1)  # [B, W]
    if spec.algorithm == "eagle":
        d1, g, dk, dv = eagle.extend(dparams, spec.draft_cfg, params, dk, dv, state.req_to_token, entries=entries,
                                     lens=lens, out_tokens=out_tokens, accept_len=accept_len, hidden=hidden, sp=sp,
                                     sampling=sampling, **common)
        stash.update(draft_token=d1, draft_hidden=g.astype(relay.draft_hidden.dtype))
    elif spec.algorithm == "draft_model":
        stash.update(last_token=draft_model.last_token(window, accept_len))
    elif spec.algorithm == "ngram_device":
        positions = lens[:, None] + jnp.arange(W)[None, :]  # [B, W]
        kept = (jnp.arange(W)[None, :] < accept_len[:, None]) & real[:, None]  # positions L .. L + a
        slot_tokens = ngram_device.write_tokens(slot_tokens, state.req_to_token, entries, positions, window, kept)
    relay = _set(relay, entries, **stash)
    state = dataclasses.replace(state, relay=relay, draft_k_cache=dk, draft_v_cache=dv, slot_tokens=slot_tokens,
                                penalty=penalty)
    top = None
    if top_logprobs:
        ids, values = top_logprobs_of(logits.reshape(B * W, -1))  # [B, W, V] -> [B * W, V]
        top = (ids.reshape(B, W, -1), values.reshape(B, W, -1))  # [B * W, K] -> [B, W, K]
    return state, SpecStepOutput.of(out_tokens, logprobs, accept_len, drafts, top)


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "spec", "ctx_len", "page_size", "attention", "sampling", "top_logprobs",
                     "state_sharding"),
    donate_argnames=("state",),
)
def spec_decode_step(
    params: ModelParams,
    dparams,
    state: DeviceState,
    inputs: DecodeInputs,
    host_drafts: HostDrafts | None,
    *,
    cfg: ModelConfig,
    spec: SpecConfig,
    ctx_len: int,
    page_size: int,
    attention=xla_paged_attention,
    sampling: bool = True,
    top_logprobs: bool = False,
    state_sharding=None,
):
    """One speculative step for B rows, everything but the host n-gram drafts read from
    the relay. Returns (state, SpecStepOutput). `spec.num_draft == 0` is the paused step:
    a window of one (a plain decode step) that still updates the drafter's state.
    `top_logprobs` (static): also return every window position's TOP_LOGPROBS most likely
    tokens under the raw target distribution."""
    common = dict(ctx_len=ctx_len, attention=attention)
    state, drafted = _draft(params, dparams, state, inputs, host_drafts, cfg=cfg, spec=spec, page_size=page_size,
                            sampling=sampling, **common)
    state, logits, hidden = _verify(params, state, inputs, drafted.tokens, cfg=cfg, **common)
    state, out = _accept_extend(params, dparams, state, inputs, drafted, logits, hidden, None, spec=spec,
                                sampling=sampling, top_logprobs=top_logprobs, **common)
    return keep_layout(state, state_sharding), out


# A speculative step of a batch with structured output runs as the three parts above, one
# program each. The allowed tokens of each window position follow from the tokens of the step
# in flight and from this step's drafts: the host reads the drafts when the draft program
# ends, and builds the masks while the verify pass (most of the step) runs; the accept program
# then takes them (engine.Engine._step_overlap; the decode step splits the same way, steps.py).
@functools.partial(
    jax.jit, static_argnames=("cfg", "spec", "ctx_len", "page_size", "attention", "sampling", "state_sharding"),
    donate_argnames=("state",),
)
def spec_draft_step(params: ModelParams, dparams, state: DeviceState, inputs: DecodeInputs,
                    host_drafts: HostDrafts | None, *, cfg: ModelConfig, spec: SpecConfig, ctx_len: int,
                    page_size: int, attention=xla_paged_attention, sampling: bool = True, state_sharding=None):
    """A speculative step's draft passes: (state, Drafted) for `spec_verify_step`."""
    state, drafted = _draft(params, dparams, state, inputs, host_drafts, cfg=cfg, spec=spec, page_size=page_size,
                            sampling=sampling, ctx_len=ctx_len, attention=attention)
    packed = jnp.concatenate([drafted.tokens, drafted.counts[:, None]], axis=1)  # [B, k + 1]
    return keep_layout(state, state_sharding), dataclasses.replace(drafted, packed=packed)


@functools.partial(
    jax.jit, static_argnames=("cfg", "ctx_len", "attention", "state_sharding"), donate_argnames=("state",),
)
def spec_verify_step(params: ModelParams, state: DeviceState, inputs: DecodeInputs, drafts: jax.Array, *,
                     cfg: ModelConfig, ctx_len: int, attention=xla_paged_attention, state_sharding=None):
    """A speculative step's verify pass, after `spec_draft_step` (drafts: its Drafted.tokens
    [B, k]): (state, logits [B, W, V], hidden [B, W, D]) for `spec_accept_step`."""
    state, logits, hidden = _verify(params, state, inputs, drafts, cfg=cfg, ctx_len=ctx_len, attention=attention)
    return keep_layout(state, state_sharding), logits, hidden


@functools.partial(
    jax.jit, static_argnames=("spec", "ctx_len", "attention", "sampling", "top_logprobs", "state_sharding"),
    donate_argnames=("state",),
)
def spec_accept_step(params: ModelParams, dparams, state: DeviceState, inputs: DecodeInputs, drafted: Drafted,
                     logits: jax.Array, hidden: jax.Array, allowed: jax.Array, *, spec: SpecConfig, ctx_len: int,
                     attention=xla_paged_attention, sampling: bool = True, top_logprobs: bool = False,
                     state_sharding=None):
    """A speculative step's acceptance and draft extend, after `spec_verify_step` on the same
    inputs. `allowed` [B, W, ceil(V / 32)] int32: the tokens each window position may take
    (all bits set for rows without a constraint). Returns (state, SpecStepOutput)."""
    state, out = _accept_extend(params, dparams, state, inputs, drafted, logits, hidden, allowed, spec=spec,
                                sampling=sampling, top_logprobs=top_logprobs, ctx_len=ctx_len, attention=attention)
    return keep_layout(state, state_sharding), out


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "spec", "ctx_len", "page_size", "attention", "sampling", "sampled_rows",
                     "state_sharding"),
    donate_argnames=("state",),
)
def spec_prefill_step(
    params: ModelParams,
    dparams,
    state: DeviceState,
    inp: SpecPrefillInputs,
    res: Reservations,
    *,
    cfg: ModelConfig,
    spec: SpecConfig,
    ctx_len: int,
    page_size: int,
    attention=xla_paged_attention,
    sampling: bool = True,
    sampled_rows: int | None = None,
    state_sharding=None,
):
    """A prompt chunk per row through the target, then through the drafter so that the
    first speculative step finds the drafter's state for the whole prompt. `sampled_rows`
    as in steps.prefill_step."""
    req_to_token = apply_reservations(state.req_to_token, res, page_size)
    R, T = inp.tokens.shape
    idx = jnp.arange(T)[None, :]  # [1, T]
    positions = inp.starts[:, None] - 1 + idx  # [R, T]: the leading column sits at s - 1
    writes = (idx >= 1) & (idx <= inp.chunk_lens[:, None])  # the chunk's own tokens
    kv_lens = inp.starts + inp.chunk_lens
    common = dict(ctx_len=ctx_len, attention=attention)
    hidden, k_cache, v_cache = forward(
        params, cfg, state.k_cache, state.v_cache, req_to_token,
        tokens=inp.tokens, positions=positions, entries=inp.entries, q_valid=writes, kv_lens=kv_lens, **common,
    )
    last_hidden = jnp.take_along_axis(hidden, inp.chunk_lens[:, None, None], axis=1)[:, 0]  # [R, D] column c
    sp = SamplingRows(inp.temperature, inp.top_k, inp.top_p, inp.min_p, inp.seed)
    penalty = state.penalty
    if penalty is not None:  # the chunk's own tokens (not the leading column) into the rows' histories
        penalty = penalties.record_prefill(penalty, inp.entries, inp.tokens[:, 1:], inp.starts, inp.chunk_lens,
                                           inp.penalties)
    next_tokens, logprobs, top = sample_after_chunks(
        params, last_hidden, inp.entries, inp.starts, kv_lens, (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.seed),
        penalty, count=sampled_rows or R, sampling=sampling, top_logprobs=inp.top_logprobs, allowed=inp.allowed)
    next_tokens = jnp.where(inp.has_given, inp.given_tokens, next_tokens)
    stash = dict(tokens=next_tokens, temperature=inp.temperature, top_k=inp.top_k, top_p=inp.top_p, min_p=inp.min_p,
                 seed=inp.seed)
    dk, dv, slot_tokens = state.draft_k_cache, state.draft_v_cache, state.slot_tokens
    if spec.algorithm == "eagle":
        d1, g, dk, dv = eagle.prefill(dparams, spec.draft_cfg, params, dk, dv, req_to_token, tokens=inp.tokens,
                                      positions=positions, entries=inp.entries, chunk_lens=inp.chunk_lens,
                                      is_last=inp.is_last, hidden=hidden, sampled=next_tokens, sp=sp,
                                      sampling=sampling, **common)
        stash.update(draft_token=d1, draft_hidden=g.astype(state.relay.draft_hidden.dtype))
    elif spec.algorithm == "draft_model":
        dk, dv = draft_model.prefill(dparams, spec.draft_cfg, dk, dv, req_to_token, tokens=inp.tokens,
                                     positions=positions, entries=inp.entries, q_valid=writes, kv_lens=kv_lens,
                                     **common)
        stash.update(last_token=jnp.take_along_axis(inp.tokens, inp.chunk_lens[:, None], axis=1)[:, 0])
    elif spec.algorithm == "ngram_device":
        slot_tokens = ngram_device.write_tokens(slot_tokens, req_to_token, inp.entries, positions, inp.tokens, writes)
    # A chunk's last segment writes the entry (scatter.last_segments).
    relay = _set(state.relay, last_segments(inp.entries, inp.starts), seq_lens=kv_lens, **stash)
    state = dataclasses.replace(state, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token, relay=relay,
                                draft_k_cache=dk, draft_v_cache=dv, slot_tokens=slot_tokens, penalty=penalty)
    state = keep_layout(state, state_sharding)
    if inp.targets is not None:  # a row asked for its prompt's logprobs (a program of its own)
        return state, PromptLogprobOutput.of(next_tokens, logprobs, *token_logprobs(params, hidden[:, 1:], inp.targets),
                                             top)
    return state, StepOutput.of(next_tokens, logprobs, top)
