"""The model runner: turns a ScheduledBatch into padded host arrays and launches a jitted step.

`launch` must never wait for the device: it only builds small numpy arrays, calls the
jitted step (which returns at once under JAX's async dispatch) and starts the copy of the
step's small outputs to the host. Tests run it under
`jax.transfer_guard_device_to_host("disallow")`.

With a drafter, decode batches launch the speculative step and prefill batches the
prefill that also fills the drafter (speculative/step.py). The host n-gram drafter builds
its drafts here from host data only; the wait for the previous step that it needs happens
before `launch`, in the engine loop, where it is explicit and timed. So does the wait for
a constrained speculative step's drafts (ForwardedStep.wait_drafts), between its two launches.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time

import numpy as np

from jaxoverlap import interrupts, steps
from jaxoverlap.buckets import PrefillShapes, pick, powers_of_two_up_to
from jaxoverlap.device_state import DeviceState
from jaxoverlap.models.config import ModelConfig
from jaxoverlap.models.params import LayerParams, ModelParams, layers_per_stack
from jaxoverlap.penalties import MAX_STOP_IDS, NEUTRAL, PrefillPenaltyInputs
from jaxoverlap.sampling_params import MAX_LOGIT_BIAS
from jaxoverlap.scheduler import ScheduledBatch


# XLA:CPU keeps each compiled kernel's code and data in memory mappings of their own: about
# 140 per decode program of the tiny test model, 300 per prefill program. Past Linux's
# vm.max_map_count (65530 by default) mmap fails and LLVM aborts the whole process, so
# precompiling on a CPU stops while this many mappings are still free (8 threads compiling
# large programs at once fit in it).
CPU_MAP_RESERVE = 8000
CPU_MAX_COMPILE_THREADS = 8

# Programs that compile at once by default: one per core, at most this many. On the H100's
# 16-core host, 16 threads compiled the 47 programs of `serve --precompile all` in 195 s and
# 8 threads in 237 s (benchmarks/RESULTS.md, 2026-12-06, second session); more threads than
# 16 were not measured.
MAX_COMPILE_THREADS = 16

_INT32_MAX = 2**31 - 1


def default_compile_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))  # the cores this process may use
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_COMPILE_THREADS, cores))


class PrecompileLimitError(RuntimeError):
    """Precompiling stopped before the process would run out of memory mappings (XLA:CPU)."""


def memory_map_headroom() -> int | None:
    """How many more memory mappings this process may make (vm.max_map_count minus the
    ones it holds), or None where the system does not say (not Linux)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            return limit - sum(1 for _ in f)
    except (OSError, ValueError):
        return None


@dataclasses.dataclass
class LaunchedStep:
    batch: ScheduledBatch
    out: object  # steps.StepOutput | SpecStepOutput, device arrays; their copy to the host has been started

    def done(self) -> bool:
        """Whether the device has finished this step (never waits)."""
        return self.out.packed.is_ready()

    def fetch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Wait for this step's small outputs (the only place the host waits for the device).
        Returns (tokens, logprobs, accept_lens or None for plain steps)."""
        return self.out.unpack(np.asarray(self.out.packed))

    def prompt_logprobs(self) -> tuple[np.ndarray, np.ndarray] | None:
        """After fetch: a prefill's [R, Q] prompt-token logprobs and argmax flags, if a row
        asked for them (steps.PromptLogprobOutput), else None."""
        if not isinstance(self.out, steps.PromptLogprobOutput):
            return None
        return self.out.prompt_part(np.asarray(self.out.packed))

    def top_logprobs(self) -> tuple[np.ndarray, np.ndarray] | None:
        """After fetch: each row's most likely token ids and their logprobs, if a row asked
        for them (`has_top`), else None: [R, K] each for plain and prefill steps, [R, W, K]
        (every window position) for speculative decode steps."""
        return self.out.top_part(np.asarray(self.out.packed))


@dataclasses.dataclass
class ForwardedStep:
    """A decode step whose forward pass is launched and whose sampling is not yet
    (ModelRunner.launch_forward): what `launch_sample` needs."""

    batch: ScheduledBatch
    B: int  # the batch bucket
    inputs: steps.DecodeInputs
    logits: object  # [B, V] float32 device array; [B, W, V] for speculative steps
    sampling: bool  # whether any row samples (batch_samples)
    top: bool  # whether any row wants top logprobs
    grammars: object  # structured.Grammars (the runner's at the forward launch)
    # Speculative steps only: the step's context bucket, its drafts (speculative.step.Drafted,
    # their copy to the host started), the verify pass's hidden states, and the drafts' copy
    # on the host, (tokens [B, k], counts [B]) (`wait_drafts`; at once for the host n-gram
    # drafter's, which the host made).
    ctx_len: int = 0
    drafted: object = None
    hidden: object = None
    drafts_on_host: tuple[np.ndarray, np.ndarray] | None = None

    def wait_drafts(self) -> None:
        """Wait for a speculative step's drafts (its draft program only, not its verify pass)."""
        if self.drafted is not None and self.drafts_on_host is None:
            from jaxoverlap.speculative.step import Drafted

            self.drafts_on_host = Drafted.unpack(np.asarray(self.drafted.packed))


def batch_samples(batch: ScheduledBatch) -> bool:
    """Whether any row of a decode batch samples (temperature > 0) or uses the penalties'
    history (penalties or min_new_tokens): a static flag of the decode step, so all-greedy
    batches compile without the vocabulary sort and the history (prefill programs always
    sample, `_prefill_program`)."""
    return any(row.req.params.temperature > 0 or row.req.params.uses_history for row in batch.rows)


def batch_top_logprobs(rows) -> bool:
    """Whether any row asked for top logprobs: a static flag of decode and prefill programs
    (steps.TOP_LOGPROBS alternatives per row), so other batches do without the top-k."""
    return any(row.req.params.top_logprobs for row in rows)


def _sampling_arrays(rows, num_rows: int):
    """Per-row sampling params of a prefill batch's rows, padded to num_rows: (temperature,
    top_k, top_p, min_p, seed), which the prefill stores into each admitted request's relay
    entry."""
    temperature = np.zeros((num_rows,), np.float32)
    top_k = np.zeros((num_rows,), np.int32)
    top_p = np.ones((num_rows,), np.float32)
    min_p = np.zeros((num_rows,), np.float32)
    seed = np.zeros((num_rows,), np.uint32)
    for i, row in enumerate(rows):
        p = row.req.params
        # top_k has no upper bound (past the vocabulary it keeps everything): clamped to int32.
        k = min(p.top_k, _INT32_MAX)
        temperature[i], top_k[i], top_p[i], min_p[i], seed[i] = p.temperature, k, p.top_p, p.min_p, row.req.seed
    return temperature, top_k, top_p, min_p, seed


def _penalty_inputs(rows, R: int) -> PrefillPenaltyInputs:
    """The rows' penalty params, prompt lengths, stop tokens, min_new_tokens ends and logit
    biases, padded to R rows (penalties.py)."""
    params = np.tile(np.asarray(NEUTRAL, np.float32), (R, 1))  # [3] -> [R, 3]
    prompt_lens = np.zeros((R,), np.int32)
    first = np.zeros((R,), bool)
    stop_ids = np.full((R, MAX_STOP_IDS), -1, np.int32)
    min_end = np.zeros((R,), np.int32)
    bias_ids = np.full((R, MAX_LOGIT_BIAS), -1, np.int32)
    bias_values = np.zeros((R, MAX_LOGIT_BIAS), np.float32)
    for i, row in enumerate(rows):
        req, p = row.req, row.req.params
        params[i] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
        prompt_lens[i] = len(req.prompt_ids)
        first[i] = row.start == req.admitted_at
        if p.min_new_tokens:  # Engine.check_request saw that the stop ids fit
            ids = sorted(req.stop_ids)
            stop_ids[i, : len(ids)] = ids
            # No bound on min_new_tokens either; no position reaches int32's limit.
            min_end[i] = min(len(req.prompt_ids) + p.min_new_tokens, _INT32_MAX)
        if p.logit_bias:  # distinct ids, at most MAX_LOGIT_BIAS (SamplingParams), inside the vocabulary (Engine)
            ids, values = zip(*p.logit_bias)
            bias_ids[i, : len(ids)], bias_values[i, : len(ids)] = ids, values
    return PrefillPenaltyInputs(params, prompt_lens, first, stop_ids, min_end, bias_ids, bias_values)


def _prompt_targets(rows, R: int, T: int) -> np.ndarray | None:
    """For a prefill in which some row asked for its prompt's logprobs: [R, T], the prompt
    token after each position of each row's chunk (0 past the prompt). None otherwise, which
    keeps the ordinary program."""
    if not any(row.req.params.prompt_logprobs for row in rows):
        return None
    targets = np.zeros((R, T), np.int32)
    for i, row in enumerate(rows):
        prompt = row.req.prompt_ids
        nxt = prompt[row.start + 1 : min(row.start + row.length + 1, len(prompt))]
        targets[i, : len(nxt)] = nxt
    return targets


class DeviceInputs:
    """The decode step's input array (steps.DecodeInputs) as a device array, sent again
    only when its content changed since the last step of the same shape: decode_inputs
    "on_change", and always under tensor parallelism, where the array is placed replicated
    over the mesh. In steady decoding the entries do not change and most steps reserve no
    page, so most steps send nothing. Reusing an input is safe because inputs are never
    donated, and a reused array holds exactly the content the host built for this step.
    """

    def __init__(self, sharding=None):
        self.sharding = sharding  # replicated over the mesh under tensor parallelism
        self._last: dict[tuple, tuple[np.ndarray, object]] = {}
        self.sent = self.reused = 0

    def put(self, name: str, arr: np.ndarray):
        import jax

        key = (name, arr.shape)
        hit = self._last.get(key)
        if hit is not None and np.array_equal(hit[0], arr):
            self.reused += 1
            return hit[1]
        # A private copy: on CPU device_put may alias host memory, and the caller owns `arr`.
        own = arr.copy()
        dev = jax.device_put(own, self.sharding)
        self._last[key] = (own, dev)
        self.sent += 1
        return dev


def _buckets_of(sizes, buckets: tuple[int, ...], what: str, cap: int | None = None) -> tuple[int, ...]:
    """The buckets that serve `sizes` (every bucket for None), each once; a size is capped at
    `cap` first (a context longer than the table runs at the table's width)."""
    if sizes is None:
        return tuple(buckets)
    out = []
    for n in sizes:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{what} must hold positive integers, got {n!r}")
        out.append(pick(buckets, min(int(n), cap) if cap else int(n)))  # ValueError past the largest bucket
    return tuple(dict.fromkeys(out))


class ModelRunner:
    def __init__(
        self,
        params: ModelParams,
        model_cfg: ModelConfig,
        state: DeviceState,
        *,
        page_size: int,
        max_running: int,
        prefill_shapes: PrefillShapes,
        table_width: int,
        batch_buckets: tuple[int, ...] | None = None,
        attention=None,
        drafter=None,
        attention_is_length_adaptive: bool = False,
        draft_max_rows: int | None = None,
        alternate_executables: bool = True,
        reserve_slack: int = 0,
        decode_inputs: str = "every_step",
        state_sharding=None,
    ):
        self.params = params
        self.drafter = drafter  # speculative.setup.Drafter or None
        self.spec = drafter.spec if drafter is not None else None
        # The step of a batch that does not draft (ScheduledBatch.draft): no draft slots,
        # drafter state kept up to date (speculative/step.py).
        self.paused_spec = dataclasses.replace(self.spec, num_draft=0) if self.spec is not None else None
        self.draft_max_rows = draft_max_rows if self.spec is not None else None
        self.last_draft_s = 0.0  # host drafting time of the last launch (host n-gram)
        # Structured output: the engine's structured.Grammars while some request has one (its
        # masks give each row's allowed tokens), else None.
        self.grammars = None
        self.inputs = DeviceInputs()  # the engine sets its sharding under tensor parallelism
        self.model_cfg = model_cfg
        self.state = state
        self.penalties = state.penalty is not None  # the engine serves penalties (penalties.py)
        self.page_size = page_size
        self.table_width = table_width
        self.attention = attention or steps.xla_paged_attention
        # Under tensor parallelism every step returns the state in the layout it came in
        # (steps.keep_layout); a static argument, left out otherwise.
        self._layout_static = {} if state_sharding is None else {"state_sharding": state_sharding}
        self.batch_buckets = tuple(sorted(batch_buckets)) if batch_buckets else powers_of_two_up_to(max_running)
        if self.batch_buckets[-1] < max_running:
            self.batch_buckets += (max_running,)
        self.prefill_shapes = prefill_shapes  # the scheduler's (SchedulerConfig.prefill_shapes)
        self.prefill_row_buckets = self.prefill_shapes.row_buckets
        self.prefill_len_buckets = self.prefill_shapes.len_buckets
        self.ctx_buckets = powers_of_two_up_to(table_width, start=min(table_width, max(64, page_size)))
        # Decode programs need a context bucket only where attention's cost follows the
        # static ctx_len (the XLA gather path reads ctx_len slots per row). The Pallas
        # kernels walk each row's visible pages only, so one program per batch bucket
        # serves every length: 7x fewer programs to compile for a 4k table (cold compile
        # 119 s -> 27 s on the H200). Measured cost: batch 1 steps at short contexts +5%
        # (empty splits), batch 32 none (benchmarks/RESULTS.md).
        self.decode_ctx_buckets = (table_width,) if attention_is_length_adaptive else self.ctx_buckets
        # The same holds for prefill: ctx_len reaches only attention, and the Pallas prefill
        # kernel streams each row's visible blocks (its block size is the same for every
        # bucket >= 64), so one program per (rows, tokens) bucket serves every context:
        # 7x fewer prefill programs to compile for a 4k table.
        self.prefill_ctx_buckets = (table_width,) if attention_is_length_adaptive else self.ctx_buckets
        # A prefill reserves at most every page of each of its rows (admission rewrites the
        # whole row), so a fixed table of that size per row bucket keeps the reservations'
        # count out of the program's shape: the warm-up can then compile every prefill
        # program the engine will launch.
        self.pages_per_row = table_width // page_size
        # A decode step reserves at most this many pages per row (two windows plus the
        # drafter's lookahead and the scheduler's slack, plus rounding), so its reservation
        # arrays have a fixed size per batch bucket.
        window, lookahead = (self.spec.window, self.spec.lookahead) if self.spec else (1, 0)
        self.decode_pages_per_row = -(-(2 * window + lookahead + reserve_slack) // page_size) + 1
        # Decode programs run as two loaded executables in turn (`_call_decode`).
        self.alternate_executables = alternate_executables
        # decode program key -> (compiled executable, its second copy: None with one
        # executable or where it cannot be copied)
        self._executables: dict[tuple, tuple] = {}
        # prefill program key -> executable compiled by `precompile(prefill=True)`
        self._prefill_executables: dict[tuple, object] = {}
        self._turn: dict[tuple, bool] = {}  # program key -> whether its next launch takes the twin
        self.twin_launches = 0  # decode launches that ran the second executable
        # Start each step's copy to the host at launch (below). False leaves the copy to
        # `fetch`, which then copies synchronously once the step is done (benchmarks compare).
        self.start_host_copy = True
        # False sends the first executable's turns through jit's call path instead of the
        # compiled executable (`_call_decode`; benchmarks compare the two).
        self.launch_compiled = True
        # How a decode launch sends its one input array (EngineConfig.decode_inputs):
        # "every_step" or "on_change".
        self.decode_inputs = decode_inputs
        self._rows_cache = None  # (rows list, bucket, packed inputs without reservations, flags): _decode_rows
        self._layout_of = None  # (params, its layout key): _program_key

    def release(self) -> None:
        """Engine.close: delete the device state (the KV cache and relay, which the engine
        made) and drop every reference to the weights (which may be the caller's) and to
        cached inputs and executables. The runner cannot launch afterwards."""
        import jax

        for x in jax.tree.leaves(self.state):
            x.delete()
        self.state = self.params = None
        if self.drafter is not None:
            self.drafter.params = None
        self.inputs = self._rows_cache = self._layout_of = None
        self._executables.clear()
        self._prefill_executables.clear()

    # -- array building ---------------------------------------------------------------------
    def _reservations(self, batch: ScheduledBatch, capacity: int) -> steps.Reservations:
        n = len(batch.reservations)
        assert n <= capacity, f"{n} reservations exceed the capacity {capacity}"
        arr = np.zeros((3, capacity), np.int32)  # padded with (entry 0, block 0, page 0)
        if n:
            arr[:, :n] = np.asarray(batch.reservations, np.int32).T
        return steps.Reservations(arr)

    def _ctx_len(self, batch: ScheduledBatch) -> int:
        buckets = self.decode_ctx_buckets if batch.kind == "decode" else self.prefill_ctx_buckets
        return pick(buckets, min(batch.ctx_len, self.table_width))

    # -- launch -----------------------------------------------------------------------------
    def needs_host_results(self, batch: ScheduledBatch) -> bool:
        """Whether this batch can only launch once the previous step's tokens are on the host."""
        return self.spec is not None and self.spec.host_drafts and batch.kind == "decode" and batch.draft

    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        if self.samples_apart(batch):  # nothing to overlap with the forward pass here: both at once
            return self.launch_sample(self.launch_forward(batch))
        if batch.kind == "prefill":
            out = self._launch_prefill(batch)
        else:
            out = self._launch_decode(batch)
        return self._launched(batch, out)

    def _launched(self, batch: ScheduledBatch, out) -> LaunchedStep:
        # Start the copy now so that the host's later wait is for the step, not the copy. One
        # array holds all of the step's results for the host (steps.pack_for_host).
        if self.start_host_copy:
            out.packed.copy_to_host_async()
        return LaunchedStep(batch, out)

    # -- decode steps with structured output: forward pass and sampling apart ----------------
    def samples_apart(self, batch: ScheduledBatch) -> bool:
        """Whether `batch` is a decode batch with a constrained row (structured output): it
        launches as `launch_forward`, then `launch_sample` once the rows' grammars have taken
        the tokens of the step before (steps.decode_forward_step, and for speculative steps
        speculative.step.spec_draft_step)."""
        return (batch.kind == "decode" and self.grammars is not None
                and any(row.req.matcher is not None for row in batch.rows))

    def launch_forward(self, batch: ScheduledBatch) -> "ForwardedStep":
        B = pick(self.batch_buckets, batch.size)
        base, (sampling, top) = self._decode_rows(batch, B)
        inputs = self._decode_inputs(batch, B, base)
        ctx_len = self._ctx_len(batch)
        if self.spec is not None:
            return self._launch_spec_forward(batch, B, inputs, ctx_len, sampling, top)
        key, step, args, static = self._forward_program(inputs, ctx_len)
        self.state, logits = self._call_decode(key, step, args, static)
        return ForwardedStep(batch, B, inputs, logits, sampling, top, self.grammars)

    def _launch_spec_forward(self, batch, B: int, inputs, ctx_len: int, sampling: bool, top: bool):
        """A speculative step's draft program, then its verify pass; the drafts' copy to the
        host starts between them."""
        host_drafts = self._host_drafts(batch, B) if self.needs_host_results(batch) else None
        self.state, drafted = self._call_decode(*self._spec_draft_program(inputs, host_drafts, ctx_len, sampling,
                                                                          batch.draft))
        ngram_drafts = None
        if host_drafts is not None:  # the host made them: nothing to wait for
            ngram_drafts = (host_drafts.tokens, host_drafts.counts)
        elif self.start_host_copy:
            drafted.packed.copy_to_host_async()
        self.state, logits, hidden = self._call_decode(*self._spec_verify_program(inputs, drafted, ctx_len))
        return ForwardedStep(batch, B, inputs, logits, sampling, top, self.grammars, ctx_len=ctx_len,
                             drafted=drafted, hidden=hidden, drafts_on_host=ngram_drafts)

    def launch_sample(self, fwd: "ForwardedStep") -> LaunchedStep:
        """The sampling of a step `launch_forward` launched, with each row's allowed tokens as
        its grammar stands now. A row whose request has ended meanwhile may take any token
        (it is dropped); so may every row once no request is constrained any more. For a
        speculative step, its acceptance, with an allowed-tokens mask per window position
        (after `fwd.wait_drafts()`, which this calls if the caller has not)."""
        rows = fwd.batch.rows
        if fwd.drafted is None:
            allowed = fwd.grammars.bitmask(rows, fwd.B, always=True)
            program = self._sample_program(fwd.inputs, fwd.logits, allowed, fwd.sampling, fwd.top)
        else:
            fwd.wait_drafts()
            from jaxoverlap.structured import mark_failures

            allowed, failed = fwd.grammars.window_bitmask(rows, fwd.B, *fwd.drafts_on_host)
            mark_failures(rows, failed)
            program = self._spec_accept_program(fwd, allowed)
        self.state, out = self._call_decode(*program)
        return self._launched(fwd.batch, out)

    def _forward_program(self, inputs: steps.DecodeInputs, ctx_len: int):
        """(program key, jitted step, arguments, static arguments) of a decode step's forward
        pass; `launch_forward` and `precompile` both build their call here."""
        static = dict(cfg=self.model_cfg, ctx_len=ctx_len, page_size=self.page_size, attention=self.attention,
                      **self._layout_static)
        key = ("forward", inputs.batch, ctx_len, self.attention, self._layout_key())
        return key, steps.decode_forward_step, (self.params, self.state, inputs), static

    def _sample_program(self, inputs: steps.DecodeInputs, logits, allowed, sampling: bool, top: bool):
        """(program key, jitted step, arguments, static arguments) of a decode step's sampling."""
        static = dict(sampling=sampling, **({"top_logprobs": True} if top else {}), **self._layout_static)
        key = ("sample", inputs.batch, sampling, top)
        return key, steps.decode_sample_step, (self.state, inputs, logits, allowed), static

    def _spec_draft_program(self, inputs: steps.DecodeInputs, host_drafts, ctx_len: int, sampling: bool,
                            draft: bool):
        """The (key, step, arguments, static arguments) of a speculative step's draft program
        (structured output; speculative.step.spec_draft_step), as `_forward_program`."""
        from jaxoverlap.speculative.step import spec_draft_step

        spec = self.spec if draft else self.paused_spec
        static = dict(cfg=self.model_cfg, spec=spec, ctx_len=ctx_len, page_size=self.page_size,
                      attention=self.attention, sampling=sampling, **self._layout_static)
        key = ("spec_draft", inputs.batch, host_drafts is not None, ctx_len, sampling, draft, self.attention,
               self._layout_key())
        return key, spec_draft_step, (self.params, self.drafter.params, self.state, inputs, host_drafts), static

    def _spec_verify_program(self, inputs: steps.DecodeInputs, drafted, ctx_len: int):
        """... of its verify pass (speculative.step.spec_verify_step)."""
        from jaxoverlap.speculative.step import spec_verify_step

        static = dict(cfg=self.model_cfg, ctx_len=ctx_len, attention=self.attention, **self._layout_static)
        key = ("spec_verify", inputs.batch, drafted.tokens.shape[1], ctx_len, self.attention, self._layout_key())
        return key, spec_verify_step, (self.params, self.state, inputs, drafted.tokens), static

    def _spec_accept_program(self, fwd: "ForwardedStep", allowed):
        """... of its acceptance and draft extend (speculative.step.spec_accept_step)."""
        from jaxoverlap.speculative.step import spec_accept_step

        draft = fwd.drafted.tokens.shape[1] > 0  # (no draft slots: the paused step, ScheduledBatch.draft)
        static = dict(spec=self.spec if draft else self.paused_spec, ctx_len=fwd.ctx_len, attention=self.attention,
                      sampling=fwd.sampling, **({"top_logprobs": True} if fwd.top else {}), **self._layout_static)
        key = ("spec_accept", fwd.B, fwd.drafted.probs is not None, fwd.ctx_len, fwd.sampling, draft, fwd.top,
               self.attention, self._layout_key())
        args = (self.params, self.drafter.params, self.state, fwd.inputs, fwd.drafted, fwd.logits, fwd.hidden, allowed)
        return key, spec_accept_step, args, static

    def _decode_rows(self, batch: ScheduledBatch, B: int):
        """(packed inputs without reservations, (whether any row samples, whether any wants
        top logprobs)) of a decode batch: the entries [B] followed by an empty reservations
        table (steps.DecodeInputs). The
        scheduler hands out the same rows list while its running set is unchanged, and a
        row's entry and sampling params do not change while it runs, so both are built once
        per set. The array is never written after it is built."""
        cached = self._rows_cache
        if cached is not None and cached[0] is batch.rows and cached[1] == B:
            return cached[2], cached[3]
        packed = np.zeros((B + 3 * self._decode_res_capacity(B),), np.int32)  # padded rows on entry 0
        packed[: batch.size] = [row.req.entry for row in batch.rows]
        sampling = (batch_samples(batch), batch_top_logprobs(batch.rows))
        # The list is held here, so its id cannot be reused by another list meanwhile.
        self._rows_cache = (batch.rows, B, packed, sampling)
        return packed, sampling

    def _decode_inputs(self, batch: ScheduledBatch, B: int, base: np.ndarray) -> steps.DecodeInputs:
        """The step's one input array: the rows' entries and this step's reservations. As
        numpy, which the call sends itself, with decode_inputs "every_step" on one device:
        the call then waits for that copy (one sleep per launch on the H200), yet costs less
        than a device_put before it (+0.12 against +0.28 ms; benchmarks/RESULTS.md,
        2026-12-04, third and fifth sessions). Otherwise a device array, sent again only
        when its content changed (DeviceInputs; placed replicated under tensor parallelism)."""
        packed = base
        if batch.reservations:
            assert len(batch.reservations) <= self._decode_res_capacity(B), "more reservations than the step's table"
            packed = base.copy()
            table = packed[B:].reshape(3, -1)  # [3 * N] -> [3, N], a view
            table[:, : len(batch.reservations)] = np.asarray(batch.reservations, np.int32).T
        return steps.DecodeInputs(self._as_sent(packed), batch=B)

    def _as_sent(self, packed: np.ndarray):
        """A decode input array as the launch passes it: numpy, or a device array sent when
        its content changed (DeviceInputs)."""
        if self.decode_inputs == "on_change" or self.inputs.sharding is not None:
            return self.inputs.put("decode_inputs", packed)
        return packed

    def _launch_decode(self, batch: ScheduledBatch):
        """A plain or speculative decode step (the drafter decides which)."""
        B = pick(self.batch_buckets, batch.size)
        base, (sampling, top) = self._decode_rows(batch, B)
        inputs = self._decode_inputs(batch, B, base)
        host_drafts = self._host_drafts(batch, B) if self.needs_host_results(batch) else None
        ctx_len = self._ctx_len(batch)
        step, args, static = self._decode_program(inputs, host_drafts, ctx_len, sampling, batch.draft, top)
        key = self._program_key(B, host_drafts is not None, ctx_len, sampling, batch.draft, top)
        self.state, out = self._call_decode(key, step, args, static)
        return out

    def _host_drafts(self, batch: ScheduledBatch, B: int):
        """The host n-gram drafter's drafts for a batch (speculative.step.HostDrafts)."""
        from jaxoverlap.speculative.step import HostDrafts

        t = time.perf_counter()
        tokens, counts = self.drafter.host.drafts([row.req for row in batch.rows], B)
        self.last_draft_s = time.perf_counter() - t
        return HostDrafts(tokens, counts)

    # -- two executables per decode program -------------------------------------------------
    # XLA records an executable's kernels as one CUDA graph and updates the graph whenever a
    # buffer it uses has moved since that executable's last run. A step's output buffer is
    # new every step, and the previous step's output is still alive when the next step is
    # launched, so one executable sees its output alternate between two addresses and updates
    # its graph on every call. Two copies of the executable used in turn each find their
    # output where they left it two steps before (measured: benchmarks/RESULTS.md).
    def _layout_key(self) -> tuple:
        # The weights' layout: a benchmark may swap `params` for another layout.
        if self._layout_of is None or self._layout_of[0] is not self.params:
            layers = self.params.layers
            first = layers if isinstance(layers, LayerParams) else layers[0]
            self._layout_of = (self.params, (layers_per_stack(self.params), type(layers),
                                             type(first.wqkv)))  # plain or FP8 (models/quant.py)
        return self._layout_of[1]

    def _program_key(self, B: int, host_drafts: bool, ctx_len: int, sampling: bool, draft: bool,
                     top: bool = False) -> tuple:
        return (B, host_drafts, ctx_len, sampling, draft, top, self.attention, self._layout_key())

    def _compile_decode_program(self, key: tuple, step, args, static):
        """Compile a decode program (and its twin) for `_call_decode`; returns the executable.
        Lowering reads shapes only: nothing runs or is donated."""
        compiled = step.lower(*args, **static).compile()
        self._executables[key] = (compiled, self._copy_executable(compiled) if self.alternate_executables else None)
        return compiled

    def _call_decode(self, key: tuple, step, args, static):
        pair = self._executables.get(key)
        if pair is None:
            if not self.alternate_executables:
                return step(*args, **static)  # jit compiles it at its first launch
            self._compile_decode_program(key, step, args, static)
            pair = self._executables[key]
        compiled, twin = pair
        use_twin = self.alternate_executables and twin is not None and self._turn.get(key, False)
        self._turn[key] = not use_twin
        if use_twin:
            self.twin_launches += 1
            return twin(*args)  # static arguments are part of the compiled program
        # The compiled executable, not jit's call path: on the H200, the first jit call after
        # an ahead-of-time compile of its program sometimes traced and compiled it once more
        # (benchmarks/RESULTS.md, 2026-12-04, sixth session). A compiled executable never does.
        return compiled(*args) if self.launch_compiled else step(*args, **static)

    def _copy_executable(self, compiled):
        """A second loaded copy of a compiled program: serialized and loaded again, so it
        costs no second compilation. None where this backend cannot serialize it (the launch
        then uses the one executable)."""
        import jax
        from jax.experimental import serialize_executable

        try:
            blob, in_tree, out_tree = serialize_executable.serialize(compiled)
            device = next(iter(jax.tree.leaves(self.params)[0].devices()))
            return serialize_executable.deserialize_and_load(blob, in_tree, out_tree, execution_devices=[device])
        except (ValueError, NotImplementedError, RuntimeError) as e:
            import logging

            logging.getLogger(__name__).warning("decode program not copied, one executable only: %s", e)
            return None

    def decode_variants(self, B: int) -> tuple[bool, ...]:
        """The `draft` values (ScheduledBatch.draft) that decode batches of bucket B can
        have: a bucket holds the sizes above the next smaller bucket, up to B."""
        if self.spec is None:
            return (False,)
        if self.draft_max_rows is None:
            return (True,)
        smallest = 1 + max((b for b in self.batch_buckets if b < B), default=0)
        return tuple(v for v, ok in ((True, smallest <= self.draft_max_rows), (False, B > self.draft_max_rows)) if ok)

    def _decode_res_capacity(self, B: int) -> int:
        return max(8, B * self.decode_pages_per_row)

    def _decode_program(self, inputs: steps.DecodeInputs, host_drafts, ctx_len: int, sampling: bool, draft: bool,
                        top: bool = False):
        """(jitted step, arguments, static arguments) of one decode launch. `launch` and
        `precompile` both build their call here, so that they meet in one jit cache entry.
        `top`: the variant that returns top logprobs."""
        static = dict(cfg=self.model_cfg, ctx_len=ctx_len, page_size=self.page_size, attention=self.attention,
                      sampling=sampling, **({"top_logprobs": True} if top else {}), **self._layout_static)
        if self.spec is None:
            return steps.decode_step, (self.params, self.state, inputs), static
        from jaxoverlap.speculative.step import spec_decode_step

        return (spec_decode_step, (self.params, self.drafter.params, self.state, inputs, host_drafts),
                dict(static, spec=self.spec if draft else self.paused_spec))

    # -- ahead-of-time compilation -----------------------------------------------------------
    def precompile(self, batch_sizes=None, ctx_lens=None, sampling=(False,), threads: int | None = None,
                   execute: bool = False, prefill: bool = False, top_logprobs=(False,),
                   mask_words: int | None = None, prompt_logprobs: bool = False) -> list[dict]:
        """Compile the decode programs (plain or speculative) of these buckets before they
        are needed: by default every batch bucket at every decode context bucket, greedy.
        With `prefill`, also every prefill program: each (rows, tokens) bucket at each
        prefill context bucket (prefill programs always sample, see `_prefill_program`).

        `threads` programs compile at once (default: one per core, at most 16; at most 8 on
        a CPU backend): XLA compiles outside the GIL, so on a machine with many cores this
        divides the wall time. The runner keeps each compiled executable and launches it
        (not through jit, see `_call_decode`), so the first launch of those shapes compiles
        nothing; with `compilation_cache_dir` set, a restarted process loads them from disk
        instead of compiling. With `execute`, each
        decode program then runs once on padding rows (`_run_padding_step`), after every
        compilation: loading a new executable makes XLA drop the CUDA graphs recorded for
        all others (its command buffer eviction), so a program compiled after the runs
        would undo them. `top_logprobs` (False, True) also compiles the variant of each
        program that returns top logprobs (`batch_top_logprobs`), which a batch runs while
        any of its rows asks for them. `mask_words` (structured.Grammars.words; None: none of
        these) also compiles the programs of batches with structured output: each decode
        bucket's forward pass (per context bucket) and sampling (per sampling flag and top
        logprobs; with a drafter, its draft, verify and accept programs instead), and with
        `prefill` each prefill program's variant with allowed tokens. `prompt_logprobs` (with
        `prefill`) also compiles each prefill program's variant that returns the prompt's
        logprobs (per top-logprobs variant; not with allowed tokens too), which a prefill runs
        while any of its rows asks for them (SamplingParams.prompt_logprobs).

        Returns one {program, ..., seconds} per program: decode rows name batch, ctx_len,
        sampling, draft, top_logprobs (and run_seconds when executed); prefill rows name
        rows, tokens, ctx_len, top_logprobs, constrained, prompt_logprobs; forward rows batch, ctx_len; sample
        rows batch, sampling, top_logprobs; spec_split rows (the three programs of a
        speculative step with structured output, for every sampling flag and top-logprobs
        variant) batch, ctx_len, draft."""
        from concurrent.futures import ThreadPoolExecutor

        import jax

        tops = tuple(dict.fromkeys(bool(t) for t in top_logprobs))
        # Sizes between buckets run in the bucket above them: that is the program to compile.
        batches = _buckets_of(batch_sizes, self.batch_buckets, "batch_sizes")
        ctxs = _buckets_of(ctx_lens, self.decode_ctx_buckets, "ctx_lens", self.table_width)
        jobs = [("decode", B, ctx, bool(s), d, t) for B in batches
                for ctx in ctxs for s in sampling for d in self.decode_variants(B) for t in tops]
        structured = bool(mask_words)
        if prompt_logprobs and not prefill:
            raise ValueError("prompt_logprobs compiles prefill programs: pass prefill=True too")
        if prefill:
            variants = [(False, False)] + [(True, False)] * structured + [(False, True)] * bool(prompt_logprobs)
            jobs += [("prefill", R, T, ctx, t, c, scoring) for R in self.prefill_row_buckets
                     for T in self.prefill_len_buckets for ctx in self.prefill_ctx_buckets
                     if self.prefill_shapes.runs(R, T) for t in tops for c, scoring in variants]
        later = []  # the sampling programs compile after the forward passes: they take their logits
        if structured and self.spec is not None:  # each job compiles its draft, verify and accept programs
            jobs += [("spec_split", B, ctx, d) for B in batches for ctx in ctxs for d in self.decode_variants(B)]
        elif structured:
            jobs += [("forward", B, ctx) for B in batches for ctx in ctxs]
            later = [("sample", B, bool(s), t) for B in batches for s in sampling for t in tops]
        put = functools.partial(jax.device_put, device=self.inputs.sharding)
        logits_sharding = {}  # batch bucket -> the sharding of a forward pass's logits

        def empty_inputs(B):
            # Placed as launch places them (DeviceInputs), so that both meet in one cache entry.
            return steps.DecodeInputs(put(steps.DecodeInputs.empty(B, self._decode_res_capacity(B)).packed), batch=B)

        def compile_decode(B, ctx, s, draft, top):
            host = self._no_host_drafts(B) if draft else None
            inputs = empty_inputs(B)
            step, args, static = self._decode_program(inputs, host, ctx, s, draft, top)
            self._compile_decode_program(self._program_key(B, host is not None, ctx, s, draft, top), step, args, static)
            return {"program": "decode", "batch": B, "ctx_len": ctx, "sampling": s, "draft": draft,
                    "top_logprobs": top}

        def compile_prefill(R, T, ctx, top, constrained, scoring):
            # Numpy, as a prefill launch passes its inputs.
            variant = {"allowed": np.full((R, mask_words), -1, np.int32)} if constrained else {}
            if scoring:  # the prompt's next tokens, one per chunk column (_prompt_targets)
                columns = T - 1 if self.spec is not None else T  # a drafter's column 0 is the token before
                variant["targets"] = np.zeros((R, columns), np.int32)
            inp = dataclasses.replace(self._prefill_inputs([], R, T), top_logprobs=top, **variant)
            res = steps.Reservations.empty(self._prefill_res_capacity(R))
            step, args, static = self._prefill_program(inp, res, ctx)
            key = self._prefill_key(R, T, ctx, scoring, top, constrained)
            self._prefill_executables[key] = step.lower(*args, **static).compile()
            return {"program": "prefill", "rows": R, "tokens": T, "ctx_len": ctx, "top_logprobs": top,
                    "constrained": constrained, "prompt_logprobs": scoring}

        def compile_forward(B, ctx):
            key, step, args, static = self._forward_program(empty_inputs(B), ctx)
            compiled = self._compile_decode_program(key, step, args, static)
            logits_sharding[B] = compiled.output_shardings[1]
            return {"program": "forward", "batch": B, "ctx_len": ctx}

        def compile_sample(B, s, top):
            logits = jax.ShapeDtypeStruct((B, self.model_cfg.vocab_size), np.float32, sharding=logits_sharding[B])
            allowed = np.zeros((B, mask_words), np.int32)
            self._compile_decode_program(*self._sample_program(empty_inputs(B), logits, allowed, s, top))
            return {"program": "sample", "batch": B, "sampling": s, "top_logprobs": top}

        def compile_spec_split(B, ctx, draft):
            # Each program takes what the one before returns: their shapes and placement (out_info).
            inputs, host = empty_inputs(B), (self._no_host_drafts(B) if draft else None)
            drafted = {s: self._compile_decode_program(*self._spec_draft_program(inputs, host, ctx, s, draft)).out_info[1]
                       for s in dict.fromkeys(bool(s) for s in sampling)}
            verify = self._spec_verify_program(inputs, next(iter(drafted.values())), ctx)
            _, logits, hidden = self._compile_decode_program(*verify).out_info
            for s, d in drafted.items():
                for top in tops:
                    fwd = ForwardedStep(None, B, inputs, logits, s, top, None, ctx_len=ctx, drafted=d, hidden=hidden)
                    allowed = np.zeros((B, d.tokens.shape[1] + 1, mask_words), np.int32)
                    self._compile_decode_program(*self._spec_accept_program(fwd, allowed))
            return {"program": "spec_split", "batch": B, "ctx_len": ctx, "draft": draft}

        check_maps = jax.default_backend() == "cpu"
        threads = default_compile_threads() if threads is None else threads
        if check_maps:  # (CPU_MAP_RESERVE holds this many large programs compiling at once)
            threads = min(threads, CPU_MAX_COMPILE_THREADS)
        stop = threading.Event()  # set by the job that found the mappings short: the rest skip

        def compile_one(job):
            if stop.is_set():
                return None
            t = time.perf_counter()
            compile_job = {"decode": compile_decode, "prefill": compile_prefill, "forward": compile_forward,
                           "sample": compile_sample, "spec_split": compile_spec_split}[job[0]]
            row = compile_job(*job[1:])
            headroom = memory_map_headroom() if check_maps else None
            if headroom is not None and headroom < CPU_MAP_RESERVE:
                stop.set()
                raise PrecompileLimitError(
                    f"precompiling {len(jobs)} programs stopped early: XLA:CPU holds memory mappings for each "
                    f"compiled program, and this process may make only {headroom} more (vm.max_map_count); "
                    f"past it the process would abort. Precompile fewer programs (decode only, fewer batch or "
                    f"prefill buckets) or raise the limit (sysctl vm.max_map_count)")
            return dict(row, seconds=time.perf_counter() - t)

        with ThreadPoolExecutor(max(1, threads)) as pool:
            report = list(pool.map(compile_one, jobs))
            if not stop.is_set():
                report += list(pool.map(compile_one, later))
        if execute:  # in order, on this thread: each run takes the state the one before returned
            for row in report:
                with interrupts.deferred():  # Ctrl-C waits for the run: it donates the state
                    self._run_padding(row, sampling, tops, mask_words, logits_sharding)
            jax.block_until_ready(self.state)
        return report

    def _run_padding(self, row: dict, sampling, tops, mask_words, logits_sharding) -> None:
        """Run the program of one precompile report row once on padding rows (none for a
        prefill program), adding its run_seconds to the row."""
        t = time.perf_counter()
        if row["program"] == "decode":
            self._run_padding_step(row["batch"], row["ctx_len"], row["sampling"], row["draft"], row["top_logprobs"])
        elif row["program"] == "forward":
            self._run_padding_forward(row["batch"], row["ctx_len"])
        elif row["program"] == "sample":
            self._run_padding_sample(row["batch"], row["sampling"], row["top_logprobs"], mask_words,
                                     logits_sharding[row["batch"]])
        elif row["program"] == "spec_split":
            self._run_padding_spec_split(row["batch"], row["ctx_len"], row["draft"], sampling, tops, mask_words)
        else:
            return
        row["run_seconds"] = time.perf_counter() - t

    def _no_host_drafts(self, B: int):
        """Empty host n-gram drafts for B rows (None for drafters that draft on the device)."""
        if self.spec is None or not self.spec.host_drafts:
            return None
        from jaxoverlap.speculative.step import HostDrafts

        return HostDrafts(np.zeros((B, self.spec.num_draft), np.int32), np.zeros((B,), np.int32))

    def _run_padding_step(self, B: int, ctx_len: int, sampling: bool, draft: bool, top: bool = False) -> None:
        """Launch one decode program with padding rows only, once on each of its executables,
        with its input array passed as a launch passes it. A program's first execution does
        work that compiling does not: XLA records its CUDA graph (6-8 ms for a decode step on
        the H200, once per executable) and JAX sets up the call's fast path. Done here, none
        of it falls on a served step. Padding rows read and write only the dummy entry 0 and
        the dummy page 0, as in every decode step, so real rows are untouched; the step's
        output is dropped."""
        inputs = self._padding_inputs(B)
        host = self._no_host_drafts(B) if draft else None
        key = self._program_key(B, host is not None, ctx_len, sampling, draft, top)
        for _ in range(2 if self.alternate_executables else 1):
            step, args, static = self._decode_program(inputs, host, ctx_len, sampling, draft, top)  # today's state
            self.state, _ = self._call_decode(key, step, args, static)

    def _padding_inputs(self, B: int) -> steps.DecodeInputs:
        """A decode step's input array for B padding rows, passed as a launch passes it."""
        return steps.DecodeInputs(self._as_sent(steps.DecodeInputs.empty(B, self._decode_res_capacity(B)).packed),
                                  batch=B)

    def _run_padding_forward(self, B: int, ctx_len: int) -> None:
        """`_run_padding_step` for a forward pass (structured output), its logits dropped."""
        inputs = self._padding_inputs(B)
        for _ in range(2 if self.alternate_executables else 1):
            self.state, _ = self._call_decode(*self._forward_program(inputs, ctx_len))

    def _run_padding_sample(self, B: int, sampling: bool, top: bool, mask_words: int, logits_sharding) -> None:
        """`_run_padding_step` for a sampling program (structured output), on zero logits."""
        import jax

        inputs = self._padding_inputs(B)
        logits = jax.device_put(np.zeros((B, self.model_cfg.vocab_size), np.float32), logits_sharding)
        allowed = np.full((B, mask_words), -1, np.int32)
        for _ in range(2 if self.alternate_executables else 1):
            self.state, _ = self._call_decode(*self._sample_program(inputs, logits, allowed, sampling, top))

    def _run_padding_spec_split(self, B: int, ctx_len: int, draft: bool, sampling, tops, mask_words: int) -> None:
        """`_run_padding_step` for the three programs of a speculative step with structured
        output, for each sampling flag and top-logprobs variant."""
        inputs = self._padding_inputs(B)
        host = self._no_host_drafts(B) if draft else None
        for s in dict.fromkeys(bool(s) for s in sampling):
            for top in tops:
                for _ in range(2 if self.alternate_executables else 1):
                    self.state, drafted = self._call_decode(*self._spec_draft_program(inputs, host, ctx_len, s, draft))
                    self.state, logits, hidden = self._call_decode(*self._spec_verify_program(inputs, drafted, ctx_len))
                    fwd = ForwardedStep(None, B, inputs, logits, s, top, None, ctx_len=ctx_len, drafted=drafted,
                                        hidden=hidden)
                    allowed = np.full((B, drafted.tokens.shape[1] + 1, mask_words), -1, np.int32)
                    self.state, _ = self._call_decode(*self._spec_accept_program(fwd, allowed))

    # -- prefill ------------------------------------------------------------------------------
    def _prefill_shape(self, batch: ScheduledBatch) -> tuple[int, int]:
        """(rows, tokens) bucket of a prefill batch."""
        return self.prefill_shapes.shape(batch.size, max(row.length for row in batch.rows))

    def _prefill_res_capacity(self, R: int) -> int:
        return R * self.pages_per_row

    def _prefill_key(self, R: int, T: int, ctx_len: int, prompt_logprobs: bool = False, top: bool = False,
                     constrained: bool = False) -> tuple:
        return (R, T, ctx_len, self.attention, self._layout_key(), prompt_logprobs, top, constrained)

    def _launch_prefill(self, batch: ScheduledBatch) -> steps.StepOutput:
        R, T = self._prefill_shape(batch)
        # The program samples after this many rows at most, one per request (steps.sample_after_chunks).
        requests = len({row.req.entry for row in batch.rows})
        if requests > self.prefill_shapes.sampled_rows(R):
            raise AssertionError(f"a prefill of {requests} requests in {R} rows samples after "
                                 f"{self.prefill_shapes.sampled_rows(R)} rows only")
        ctx_len = self._ctx_len(batch)
        inp = self._prefill_inputs(batch.rows, R, T)
        res = self._reservations(batch, self._prefill_res_capacity(R))
        step, args, static = self._prefill_program(inp, res, ctx_len)
        # A program the warm-up compiled runs as that executable (see `_call_decode` for why
        # not through jit); any other compiles on its first launch, as do the variants that
        # return prompt logprobs or top logprobs unless the warm-up was asked for them.
        scoring, top = inp.targets is not None, inp.top_logprobs
        # A prefill with allowed tokens (structured output) is a program of its own, compiled on first use.
        constrained = inp.allowed is not None
        compiled = self._prefill_executables.get(self._prefill_key(R, T, ctx_len, scoring, top, constrained))
        self.state, out = compiled(*args) if compiled is not None else step(*args, **static)
        return out

    def _prefill_inputs(self, rows, R: int, T: int):
        """The host arrays of a prefill of these rows, padded to R rows of T tokens (rows=[]
        gives the padding of a warm-up compile)."""
        tokens = np.zeros((R, T), np.int32)
        starts = np.zeros((R,), np.int32)
        lens = np.zeros((R,), np.int32)
        entries = np.zeros((R,), np.int32)
        allowed = None
        if self.grammars is not None and rows:  # only a prompt's last chunk samples its token
            allowed = self.grammars.bitmask(rows, R, sampled=lambda i: rows[i].is_last)
        if self.spec is None:
            for i, row in enumerate(rows):
                req = row.req
                tokens[i, : row.length] = req.fill_ids[row.start : row.start + row.length]
                starts[i], lens[i], entries[i] = row.start, row.length, req.entry
            return steps.PrefillInputs(tokens, starts, lens, entries, *_sampling_arrays(rows, R),
                                       targets=_prompt_targets(rows, R, T),
                                       penalties=_penalty_inputs(rows, R) if self.penalties else None,
                                       top_logprobs=batch_top_logprobs(rows), allowed=allowed)
        from jaxoverlap.speculative.step import SpecPrefillInputs

        is_last = np.zeros((R,), bool)
        given = np.zeros((R,), np.int32)
        has_given = np.zeros((R,), bool)
        for i, row in enumerate(rows):
            req = row.req
            # Column 0 of each row is the token before the chunk (read, not written, by the target).
            tokens[i, 1 : 1 + row.length] = req.fill_ids[row.start : row.start + row.length]
            if row.start > 0:
                tokens[i, 0] = req.fill_ids[row.start - 1]
            if row.is_last and req.resume_token is not None:
                given[i], has_given[i] = req.resume_token, True
            starts[i], lens[i], entries[i], is_last[i] = row.start, row.length, req.entry, row.is_last
        return SpecPrefillInputs(tokens, starts, lens, entries, is_last, given, has_given, *_sampling_arrays(rows, R),
                                 targets=_prompt_targets(rows, R, T - 1),  # the chunk's columns only
                                 penalties=_penalty_inputs(rows, R) if self.penalties else None,
                                 top_logprobs=batch_top_logprobs(rows), allowed=allowed)

    def _prefill_program(self, inp, res: steps.Reservations, ctx_len: int):
        """(jitted step, arguments, static arguments) of one prefill launch; `launch` and
        `precompile` both build their call here, so that they meet in one jit cache entry.

        Every prefill program can sample (static sampling=True), unlike decode programs, which
        come greedy and sampling. Its greedy rows take the argmax as a greedy program does
        (`sampling.sample`), and the sort over the vocabulary runs once per request of the
        batch at most (`sampled_rows`), not per prompt token, so against the prefill it is
        small. One program per shape then serves every request, and a warm-up of the prefill
        programs leaves nothing for a sampled request to compile (a greedy twin per shape
        would double the prefill programs, about 10 s each cold for Qwen3-8B)."""
        static = dict(cfg=self.model_cfg, ctx_len=ctx_len, page_size=self.page_size, attention=self.attention,
                      sampling=True, sampled_rows=self.prefill_shapes.sampled_rows(inp.tokens.shape[0]),
                      **self._layout_static)
        if self.spec is None:
            return steps.prefill_step, (self.params, self.state, inp, res), static
        from jaxoverlap.speculative.step import spec_prefill_step

        return spec_prefill_step, (self.params, self.drafter.params, self.state, inp, res), dict(static, spec=self.spec)
