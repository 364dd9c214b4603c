"""The engine: requests in, token deltas out, with the overlap loop and the normal loop side by side.

    overlap (default)                         normal (disable_overlap=True)
    batch = schedule()   # results <= N-1     batch = schedule()     # results <= N
    launch(batch)        # returns at once    launch(batch)
    process(step N)      # waits for N only   process(this step)     # waits for it

In the overlap loop the host prepares and launches step N+1 before it waits for step N, so
the device always has the next step queued behind the running one. A request that ends in
step N is found when step N is processed; it is already in step N+1, whose tokens for it
are dropped.

Speculative decoding (speculative/) changes neither loop: a decode step becomes one
speculative step. The one exception is the host n-gram drafter, whose drafts need step N's
accepted tokens: for such a batch the overlap loop processes step N before the launch
(the article's section 8.3), and the wait is recorded as `fresh_wait_s`.

Structured output keeps overlap: a decode batch with a constrained row launches its forward
pass behind step N, processes step N while that runs (the tokens advance the grammars), and
then launches its sampling with the rows' allowed tokens (ModelRunner.launch_forward /
launch_sample). With a drafter, the forward part is the draft program and the verify pass,
and the sampling part the acceptance, with a mask per window position built from the drafts.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import gc
import logging
import os
import random
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jaxoverlap import interrupts, penalties
from jaxoverlap.buckets import PrefillShapes
from jaxoverlap.compile_watch import CompileWatch
from jaxoverlap.config import KV_CACHE_DTYPES, EngineConfig
from jaxoverlap.device_state import init_device_state, kv_cache_bytes_per_token
from jaxoverlap.errors import EngineClosedError, InvalidRequestError, PromptTooLongError, QueueFullError
from jaxoverlap.models import moe
from jaxoverlap.models.config import ModelConfig
from jaxoverlap.models.params import ModelParams, stack_layers
from jaxoverlap.models.quant import quantize_params
from jaxoverlap.outputs import RequestOutput
from jaxoverlap.page_allocator import EntryAllocator, PageAllocator
from jaxoverlap.pallas_kernels.reference import is_8bit
from jaxoverlap.prefix_cache import PrefixCache
from jaxoverlap.request import Request
from jaxoverlap.runner import LaunchedStep, ModelRunner
from jaxoverlap.sampling_params import SamplingParams
from jaxoverlap.scheduler import Scheduler, SchedulerConfig
from jaxoverlap.structured import advance as advance_grammar

logger = logging.getLogger(__name__)


# Layers per weight stack on one GPU (EngineConfig.layers_per_weight_stack). H200, Qwen3-8B
# (benchmarks/RESULTS.md, 2026-12-04, second session): groups of 4 cut the decode launch by
# 0.12-0.23 ms at batch 1-64 with the same device step (one process), and the cold compile
# of the seven batch buckets goes from 21 to 43 s (one call), under the 60 s target.
GPU_LAYERS_PER_WEIGHT_STACK = 4
# How long an engine with nothing to run but requests whose grammar compiles waits for one
# compile at a time, instead of spinning through empty steps; its loop takes commands between.
HELD_POLL_S = 0.005
# The live engines that froze the collector (freeze_gc) and are not closed. gc.freeze() is
# process-wide: an engine's close() unfreezes to give its objects back, then freezes again
# while any of these is left, so that closing one LLM does not unfreeze the others'.
_FROZEN_ENGINES: weakref.WeakSet = weakref.WeakSet()


@dataclasses.dataclass
class StepTiming:
    """Host time of one loop iteration, split as in the article's Figure 3."""

    kind: str  # the launched step: "prefill" | "decode" | "" (nothing launched, drain only)
    batch_size: int
    prepare_s: float  # schedule + reservations
    launch_s: float  # build arrays + dispatch the jitted step
    wait_s: float  # blocked on the device for the processed step's outputs
    process_s: float  # bookkeeping of the processed step (stops, outputs, frees)
    # Host n-gram only: blocked on (and processing) the in-flight step before the launch,
    # because the drafts need its tokens; and the trie lookup inside launch_s.
    fresh_wait_s: float = 0.0
    draft_s: float = 0.0
    accepted_tokens: int = 0  # tokens the processed speculative step gained (all rows)
    verify_rows: int = 0  # live rows of the processed speculative step
    start_s: float = 0.0  # time.perf_counter() at the iteration's start (where a run's edges lie)
    reservations: int = 0  # pages the launched step reserved (sent to the device with it)
    # The step processed in this iteration was already done when the host came to wait for
    # it (LaunchedStep.done). Under overlap the device may then have run dry before the
    # step launched in this iteration.
    found_done: bool = False
    # Programs the launch compiled or loaded from the persistent cache (compile_watch):
    # launch_s then includes that time, which every request waited.
    compiled: int = 0
    fresh_process_s: float = 0.0  # the processing part of fresh_wait_s (the rest is the wait)

    @property
    def all_wait_s(self) -> float:
        """Blocked on the device in this iteration: for the host n-gram drafter's batches,
        the wait for step N before the launch too."""
        return self.wait_s + self.fresh_wait_s - self.fresh_process_s

    @property
    def all_process_s(self) -> float:
        """Bookkeeping of processed steps in this iteration, before the launch too."""
        return self.process_s + self.fresh_process_s


@dataclasses.dataclass
class LoopTotals:
    """Running sums over every loop iteration since the engine was built (Engine.stats, and the
    server's Prometheus counters): cheap enough to keep always, unlike `timings`' window.
    rate(host seconds) / rate(iterations) is the host's time per step."""

    prefill_iterations: int = 0  # iterations that launched a prefill
    decode_iterations: int = 0  # iterations that launched a decode (or speculative) step
    prepare_s: float = 0.0
    launch_s: float = 0.0
    process_s: float = 0.0
    wait_s: float = 0.0  # blocked on the device for a step's outputs
    # Overlap iterations that launched a step and found the previous one already done when
    # they came to wait for it, or that processed it before the launch (the host n-gram
    # drafter): at most this many times the device waited for the host.
    host_bound_iterations: int = 0
    # Launches that compiled a program (or loaded one from the persistent cache), and their
    # launch seconds: what the warm-up left for requests to wait for.
    compiling_launches: int = 0
    compiling_launch_s: float = 0.0
    # Over the iterations that launched a decode step only (per decode step figures, as
    # `jaxoverlap bench` reports them): host seconds (prepare + launch + process), seconds
    # blocked on the device, and host-bound iterations.
    decode_host_s: float = 0.0
    decode_wait_s: float = 0.0
    decode_host_bound_iterations: int = 0

    def add(self, t: "StepTiming", overlap: bool) -> None:
        if t.kind == "prefill":
            self.prefill_iterations += 1
        elif t.kind == "decode":
            self.decode_iterations += 1
        # The host n-gram drafter's wait and processing before its launch count too.
        self.prepare_s += t.prepare_s
        self.launch_s += t.launch_s
        self.process_s += t.all_process_s
        self.wait_s += t.all_wait_s
        host_bound = overlap and bool(t.kind) and (t.fresh_wait_s > 0 or t.found_done)
        self.host_bound_iterations += host_bound
        if t.kind == "decode":
            self.decode_host_s += t.prepare_s + t.launch_s + t.all_process_s
            self.decode_wait_s += t.all_wait_s
            self.decode_host_bound_iterations += host_bound
        if t.compiled:
            self.compiling_launches += 1
            self.compiling_launch_s += t.launch_s


def _memory_stats(device) -> dict:
    """The device's allocator figures (bytes_limit, bytes_in_use); {} where it has none (CPU)."""
    return device.memory_stats() or {}


def _resolve_dtype(name: str):
    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    return {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}[name]


@functools.lru_cache(maxsize=None)
def _pallas_attention(interpret: bool, mesh=None, fuse_decode: bool = True):
    """One function object per (mode, mesh): the steps take it as a static argument, so a
    new object per engine would compile every step again. With a mesh, the kernels run per
    device on its own heads (parallel.shard_attention, shard_fused_decode)."""
    from jaxoverlap.pallas_kernels.attention import PallasAttention, paged_attention

    if mesh is None:
        return PallasAttention(interpret=interpret, fuse_decode=fuse_decode)
    from jaxoverlap import parallel
    from jaxoverlap.pallas_kernels.fused_decode import fused_decode_attention

    sharded = parallel.shard_attention(functools.partial(paged_attention, backend="pallas", interpret=interpret), mesh)
    if fuse_decode:  # forward uses it on layers in the N-shard qkv layout (the residual norms stay XLA's)
        sharded.fused_decode = parallel.shard_fused_decode(
            functools.partial(fused_decode_attention, interpret=interpret), mesh)
        sharded.fused_qkv_shards = mesh.size
    return sharded


def _holds_fp8(params: ModelParams) -> bool:
    """Whether the weights hold 8-bit matrices (the caller's, quantized before)."""
    from jaxoverlap.models.quant import Fp8Weight

    return any(isinstance(w, Fp8Weight)
               for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Fp8Weight)))


def _gpu_converts_fp8() -> bool:
    """Whether Pallas kernels may convert 8-bit floats here: anywhere but a GPU of compute
    capability below 8.9 (JAX's Triton lowering refuses e4m3 there)."""
    if jax.default_backend() != "gpu":
        return True
    capability = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return tuple(int(p) for p in str(capability).split(".")[:2]) >= (8, 9)
    except ValueError:
        return True  # unknown: let the kernels decide


def compilation_cache_dir(option: str | None) -> str | None:
    """The folder EngineConfig.compilation_cache_dir names ("auto" resolved), or None ("none")."""
    if not option or option.lower() == "none":
        return None
    if option != "auto":
        return option
    if jax.default_backend() != "gpu" or jax.config.jax_compilation_cache_dir:
        return None  # nothing worth keeping, or JAX_COMPILATION_CACHE_DIR already set one
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "jaxoverlap", "jax_compilation_cache")


def _ended_by_token(req: Request) -> bool:
    """Whether a stop token (EOS or one of stop_token_ids) ended this request: Scheduler._check_stop
    tests them before stop strings and grammars, so a "stop" on one is always that."""
    return req.finish_reason == "stop" and bool(req.output_ids) and req.output_ids[-1] in req.stop_ids


def _cut_at_stop_string(req: Request, fresh_from: int = 0) -> bool:
    """Cut the request's unsent text before the first of its stop strings in it (after it,
    with include_stop_str_in_output); whether one was there. Only a stop string that ends
    after `fresh_from` counts (the text before it was searched already), and none within
    the first min_new_tokens tokens (vLLM's rule: nor one ending in their text). Of stop
    strings found at one place, the longest is the one included."""
    if len(req.output_ids) <= req.params.min_new_tokens:
        return False
    text = req.pending_text
    hits = [(i, len(s)) for s in req.params.stop if (i := text.find(s, max(0, fresh_from - len(s) + 1))) >= 0]
    if hits:
        at = min(i for i, _ in hits)
        if req.params.include_stop_str_in_output:
            at += max(n for i, n in hits if i == at)
        req.pending_text = req.pending_text[:at]
    return bool(hits)


def _int_list(prompt) -> list[int]:
    """Token ids as a list of Python ints; anything but integers (bools included) raises.

    It runs on the engine's thread for every request, so the common case (a list of ints,
    as the gRPC server and the tokenizer hand over) is checked with C-level passes only:
    about 0.1 ms for 8k ids, where a Python loop over them takes over a millisecond."""
    if isinstance(prompt, np.ndarray):
        if prompt.dtype.kind not in "iu" or prompt.ndim != 1:
            raise InvalidRequestError(f"token ids must be integers in one dimension, got an array of "
                                      f"{prompt.dtype} with shape {prompt.shape}")
        return prompt.tolist()
    ids = list(prompt)
    kinds = set(map(type, ids))
    if kinds <= {int}:
        return ids
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise InvalidRequestError(f"token ids must be integers, got {t!r}")
    return [int(t) for t in ids]


class Engine:
    def __init__(self, config: EngineConfig, *, model_config: ModelConfig | None = None, params=None, tokenizer=None,
                 draft_model_config: ModelConfig | None = None, draft_params=None,
                 eagle_config: ModelConfig | None = None, eagle_params=None):
        from jaxoverlap.models import loader

        self.config = config
        self.closed = False
        if config.freeze_gc:
            # Garbage frozen since the last freeze (an engine is freed by refcounting when
            # dropped, but one caught in a reference cycle, a traceback's or the caller's, is
            # not): collected here, before this engine takes memory.
            gc.unfreeze()
            gc.collect()
        cache_dir = compilation_cache_dir(config.compilation_cache_dir)
        if cache_dir:
            jax.config.update("jax_compilation_cache_dir", cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        model_path = config.model or loader.default_model_path()
        self.model_path = model_path
        self.model_name = os.path.basename(os.path.normpath(model_path)) if config.model else "jaxoverlap-default"
        self.model_config = model_config or ModelConfig.from_path(model_path)
        self.dtype = _resolve_dtype(config.dtype)
        cache_dtype_name = KV_CACHE_DTYPES[config.kv_cache_dtype]
        self.kv_cache_dtype = jnp.dtype(cache_dtype_name) if cache_dtype_name else jnp.dtype(self.dtype)
        owns_params = params is None
        self.mesh = None
        if config.tensor_parallel_size > 1:
            from jaxoverlap import parallel

            self.mesh = parallel.make_mesh(config.tensor_parallel_size)
        if params is None:
            shardings = None
            if self.mesh is not None:  # each weight read straight onto its devices
                shardings = parallel.param_shardings(
                    loader.abstract_params(self.model_config, self.dtype, self.mesh.size), self.mesh)
            params = loader.load_params(
                model_path, self.model_config, self.dtype,
                load_format=config.load_format, seed=config.seed, cache_dir=config.weights_cache_dir,
                tensor_parallel_size=config.tensor_parallel_size,  # per-shard qkv / gate_up columns
                shardings=shardings,
                quantization=config.quantization,  # each layer quantized as it loads
            )
        group = config.layers_per_weight_stack
        eight_bit_weights = bool(config.quantization) or _holds_fp8(params)
        if group is None:
            group = GPU_LAYERS_PER_WEIGHT_STACK if jax.default_backend() == "gpu" else 1
            if eight_bit_weights:
                # Measured on an H100 (Qwen3-8B, batch 1, benchmarks/RESULTS.md 2026-12-07): a
                # decode step took 22.3 ms with 8-bit weights in groups of 4 layers, 5.2 ms with
                # them per layer (bf16 per layer: 5.7 ms).
                group = 1
        elif eight_bit_weights and group > 1:
            logger.warning("layers_per_weight_stack=%d with 8-bit weights: a decode step with them stacked was "
                           "about 4x slower than with them per layer on an H100 (benchmarks/RESULTS.md)", group)
        if config.tensor_parallel_size > 1:
            group = 1
        if group > 1:
            # Fewer argument leaves per step call (models/params.py). Before the KV cache is
            # sized, so that a caller's own copy of the weights is counted.
            params = stack_layers(params, group_size=group, delete_source=owns_params)
        if tokenizer is None and os.path.exists(os.path.join(model_path, "tokenizer.json")):
            from jaxoverlap.models.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_path(model_path)
        self.tokenizer = tokenizer
        eos = set(self.model_config.eos_token_ids)
        if tokenizer is not None:
            eos |= set(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.eos_token_ids = frozenset(eos)
        from jaxoverlap.speculative.setup import build_drafter

        self.drafter = build_drafter(config, self.model_config, self.dtype, draft_model_config=draft_model_config,
                                     draft_params=draft_params, eagle_config=eagle_config, eagle_params=eagle_params)
        if group > 1 and self.drafter is not None and isinstance(self.drafter.params, ModelParams):
            # A draft model's layers too: its leaves are arguments of every speculative step.
            self.drafter.params = stack_layers(self.drafter.params, group_size=group,
                                               delete_source=draft_params is None)
        spec = self.drafter.spec if self.drafter is not None else None

        mc, ps = self.model_config, config.page_size
        self.serves_penalties = config.enable_penalties
        window = mc.attention_window
        if window is not None and config.max_context_len is not None and config.max_context_len > window:
            raise ValueError(f"max_context_len={config.max_context_len} is longer than the model's sliding window "
                             f"({window} tokens): the engine computes full attention, which equals the window's "
                             f"only within it; set max_context_len <= {window}")
        self.max_context_len = config.max_context_len or min(mc.max_position_embeddings, 4096, window or 4096)
        if self.max_context_len > mc.max_position_embeddings:
            logger.warning("max_context_len=%d is past the model's max_position_embeddings=%d: positions beyond "
                           "it are outside what the model was trained on", self.max_context_len,
                           mc.max_position_embeddings)
        table_width = -(-self.max_context_len // ps) * ps
        layout = {}
        if self.mesh is not None:
            # Weights passed in by the caller may be in the one-device layout: converted here.
            # Before the KV cache is sized: each device then holds only its share of them.
            params = parallel.shard_params(params, self.mesh, mc)
            if self.drafter is not None:
                self.drafter.params = parallel.replicate(self.drafter.params, self.mesh)
        if config.quantization == "fp8":
            # Weights the caller passed (the loader quantized its own, layer by layer): after
            # stacking and sharding, each 8-bit matrix keeps its weight's form and layout.
            # Before the KV cache is sized, so that the memory freed goes to the cache.
            params = quantize_params(params, delete_source=owns_params)
            if self.mesh is not None:  # each 8-bit matrix and its scales where parallel.py's table puts them
                params = jax.device_put(params, parallel.param_shardings(params, self.mesh))
        params = self._with_kv_scales(params, owns_params)
        attention = self._attention_fn()  # None: the XLA gather path
        if self.mesh is not None:
            # The layouts the steps' computations give these arrays (parallel.py's table).
            layout = dict(vocab_split=params.lm_head is not None and mc.vocab_size % self.mesh.size == 0,
                          draft_heads_split=attention is not None)
        # The most tokens one program takes: a prefill chunk (+1 under speculation), or every
        # running request's verify window.
        largest_step = max(config.chunked_prefill_size + 1, config.max_running_requests * (spec.window if spec else 1))
        kv_tokens = config.kv_cache_tokens or self._kv_tokens_from_memory(table_width, layout, largest_step)
        num_pages = -(-kv_tokens // ps) + 1  # + the dummy page
        self.kv_cache_tokens = (num_pages - 1) * ps

        def init_state():
            return init_device_state(
                num_layers=mc.num_layers, num_slots=num_pages * ps, num_kv_heads=mc.num_kv_heads,
                head_dim=mc.head_dim, dtype=self.dtype, cache_dtype=self.kv_cache_dtype,
                num_entries=config.max_running_requests + 1,
                table_width=table_width, **({"drafter": self.drafter.layout} if self.drafter else {}),
                penalty_vocab_size=mc.vocab_size if self.serves_penalties else 0,
            )

        state_sharding = None
        if self.mesh is None:
            state = init_state()
        else:  # made in place on the mesh: the cache is sized for each device's share of it
            state = parallel.init_state_sharded(init_state, self.mesh, **layout)
            state_sharding = parallel.StateSharding(state)
        self.scheduler = Scheduler(
            SchedulerConfig(
                page_size=ps, max_running=config.max_running_requests,
                # A speculative prefill row carries one more token (the one before the chunk).
                chunked_prefill_size=config.chunked_prefill_size - (1 if spec else 0),
                max_prefill_requests=config.max_prefill_requests,
                max_context_len=self.max_context_len, table_width=table_width,
                window=spec.window if spec else 1,
                lookahead=spec.lookahead if spec else 0,
                cache_lag=spec.cache_lag if spec else 0,
                resume_with_last_token=spec is not None,
                draft_max_rows=config.speculative_disable_by_batch_size if spec else None,
                reserve_slack=(2 * ps if config.reserve_slack_tokens is None else config.reserve_slack_tokens),
                # The prefill programs' shapes, for the runner too. A speculative prefill row
                # holds one more token (the one before the chunk).
                prefill_shapes=PrefillShapes(config.prefill_rows,
                                             config.chunked_prefill_size,
                                             lead=1 if spec else 0,
                                             max_requests=config.max_prefill_requests),
            ),
            PageAllocator(num_pages, ps),
            EntryAllocator(config.max_running_requests),
            PrefixCache(ps, enabled=not config.disable_prefix_cache),
            stop_checker=self._check_token,
            eos_token_ids=self.eos_token_ids,
        )
        if not self.scheduler.fits(self.max_context_len):
            # vLLM refuses to start here; small caches are useful for tests and notebooks, so warn.
            longest = self.kv_cache_tokens - self.scheduler.row_headroom
            logger.warning("the KV cache (%d tokens) cannot hold one request of max_context_len=%d: a running request "
                           "keeps room for %d more tokens, so one that grows past about %d tokens ends with 'length'",
                           self.kv_cache_tokens, self.max_context_len, self.scheduler.row_headroom, longest)
        self.runner = ModelRunner(
            params, mc, state, page_size=ps, max_running=config.max_running_requests,
            prefill_shapes=self.scheduler.cfg.prefill_shapes,
            table_width=table_width, batch_buckets=config.batch_buckets, attention=attention,
            drafter=self.drafter, attention_is_length_adaptive=attention is not None,  # the Pallas kernels
            draft_max_rows=config.speculative_disable_by_batch_size,
            reserve_slack=self.scheduler.cfg.reserve_slack,
            decode_inputs=config.decode_inputs,
            state_sharding=state_sharding,
            # Only where XLA records CUDA graphs (GPU). The copy is loaded on one device: a
            # sharded program keeps its one executable.
            alternate_executables=(config.alternate_decode_executables and self.mesh is None
                                   and jax.default_backend() == "gpu"),
        )
        if self.mesh is not None:
            from jaxoverlap import parallel

            self.runner.inputs.sharding = parallel.replicated(self.mesh)
        self.requests: dict[str, Request] = {}
        self._constrained = 0  # live requests with a structured_output (their decode steps sample apart)
        self._inflight: LaunchedStep | None = None
        self._seed_rng = random.Random(config.seed)
        self.timings: collections.deque[StepTiming] = collections.deque(maxlen=100_000)
        self.loop_totals = LoopTotals()
        self.tokens_generated = 0
        self.overlap = not config.disable_overlap
        self.guard_launch = False  # tests set this: launches run under sync_guard.no_host_sync()
        self._accepted = (0, 0)  # (tokens, rows) of the speculative step processed last
        self._compiles = CompileWatch()  # programs compiled inside the last launch
        self._freeze_gc()

    # -- set-up helpers -------------------------------------------------------------------------
    def _with_kv_scales(self, params: ModelParams, owns_params: bool) -> ModelParams:
        """The weights with the 8-bit KV cache's per-layer scales (ModelParams.kv_scales):
        the checkpoint's calibrated k_scale / v_scale where it has them (as vLLM uses them),
        else none (scale 1). Scales the caller's weights carry are kept; a 16-bit cache holds
        K/V as they are and takes none."""
        if not is_8bit(self.kv_cache_dtype):
            return dataclasses.replace(params, kv_scales=None)
        if params.kv_scales is None and owns_params and self.config.load_format != "dummy":
            from jaxoverlap.models import loader

            scales = loader.kv_cache_scales(self.model_path, self.model_config)
            if scales is not None:
                logger.info("8-bit KV cache with the checkpoint's scales (K %.3g..%.3g, V %.3g..%.3g)",
                            scales[:, 0].min(), scales[:, 0].max(), scales[:, 1].min(), scales[:, 1].max())
                params = dataclasses.replace(params, kv_scales=jnp.asarray(scales))
        if params.kv_scales is not None:
            L = self.model_config.num_layers
            if tuple(params.kv_scales.shape) != (L, 2):
                raise ValueError(f"kv_scales must be [num_layers, 2] = [{L}, 2], got {list(params.kv_scales.shape)}")
            scales = jnp.asarray(params.kv_scales, jnp.float32)
            if self.mesh is not None:
                from jaxoverlap import parallel

                scales = jax.device_put(scales, parallel.replicated(self.mesh))
            params = dataclasses.replace(params, kv_scales=scales)
        return params

    def _attention_fn(self):
        from jaxoverlap.pallas_kernels._tile import head_dim_fits
        from jaxoverlap.pallas_kernels.decode import MAX_ROWS

        backend = self.config.attention_backend
        # The models whose attention the kernels would run (the target's, a drafter's).
        cfgs = [self.model_config]
        if self.drafter is not None and self.drafter.spec.draft_cfg is not None:
            cfgs.append(self.drafter.spec.draft_cfg)
        unfit = next((f"head_dim {c.head_dim}" for c in cfgs if not head_dim_fits(c.head_dim)), None)
        if backend == "auto":
            # Measured on the H200 (benchmarks/RESULTS.md): the Pallas kernels read the cache
            # at 3-4x the XLA gather path's speed. On CPU they would only run interpreted.
            # With tensor parallelism they run per device under shard_map (self.mesh).
            backend = "pallas" if jax.default_backend() == "gpu" else "xla"
            if backend == "pallas" and unfit:
                logger.warning("attention runs on the XLA path: the Pallas kernels need a power-of-two head_dim "
                               ">= 16, and this model has %s", unfit)
                backend = "xla"
        eight_bit = is_8bit(self.kv_cache_dtype)
        if eight_bit and not _gpu_converts_fp8():
            # Triton converts 8-bit floats from compute capability 8.9 (Ada, Hopper) on.
            if backend == "pallas" and self.config.attention_backend == "pallas":
                raise ValueError(f"kv_cache_dtype={self.config.kv_cache_dtype!r} with attention_backend='pallas' "
                                 f"needs a GPU of compute capability >= 8.9; use attention_backend='xla' (or 'auto')")
            if backend == "pallas":
                logger.warning("attention runs on the XLA path: the Pallas kernels read an 8-bit KV cache on GPUs "
                               "of compute capability >= 8.9 only")
                backend = "xla"
        if backend == "xla":
            return None
        if unfit:
            raise ValueError(f"attention_backend='pallas' needs a power-of-two head_dim >= 16, and this model has "
                             f"{unfit}: use attention_backend='xla' (or 'auto')")
        # The fused decode kernel holds one KV head's query heads in one tile: with more, the
        # decode steps use the unfused kernels, which split them.
        fits_fused = all(c.num_heads // c.num_kv_heads <= MAX_ROWS for c in cfgs)
        on_gpu = jax.default_backend() == "gpu"
        # Its 8-bit cache write has run only interpreted so far (the decode kernel that reads an
        # 8-bit cache was measured on an H100: benchmarks/RESULTS.md, 2026-12-07 fifteenth
        # session), so on a GPU an 8-bit cache keeps the unfused kernels until a recorded run.
        fuse = not self.config.disable_fused_decode and fits_fused and not (eight_bit and on_gpu)
        return _pallas_attention(interpret=not on_gpu, mesh=self.mesh, fuse_decode=fuse)

    def _kv_tokens_from_memory(self, table_width: int, layout: dict, largest_step: int) -> int:
        """The KV-cache tokens that `kv_cache_memory_fraction` of the first device's free
        memory holds, the weights being in place. Under tensor parallelism (`layout`, as
        parallel.state_shardings takes it), of what each device holds: its share of the KV
        heads (all where the mesh does not divide them), of the drafter's (when split), and
        of the penalty history (when its vocabulary is split). A mixture-of-experts model's
        MLP temporaries for a program of `largest_step` tokens are kept free first."""
        mc, n = self.model_config, self.mesh.size if self.mesh is not None else 1
        from jaxoverlap.parallel import local_size

        per_token = kv_cache_bytes_per_token(mc.num_layers, local_size(mc.num_kv_heads, n), mc.head_dim,
                                             self.kv_cache_dtype)
        if self.drafter is not None:
            heads = self.drafter.layout.cache_kv_heads
            split = layout.get("draft_heads_split") and heads and local_size(heads, n) < heads
            per_token += self.drafter.kv_bytes_per_token // (n if split else 1)
        stats = _memory_stats(jax.devices()[0])
        if "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            if self.serves_penalties:
                vocab = local_size(mc.vocab_size, n) if layout.get("vocab_split") else mc.vocab_size
                free -= penalties.state_bytes(self.config.max_running_requests + 1, vocab)
            if mc.is_moe:  # gathered expert weights: GBs that the fraction's headroom may not hold
                free -= moe.activation_bytes(largest_step, mc.num_experts, mc.experts_per_token, mc.hidden_size,
                                             mc.intermediate_size, jnp.dtype(self.dtype).itemsize)
            return max(table_width, int(free * self.config.kv_cache_memory_fraction) // per_token)
        # CPU: no memory statistics; enough for every running request at full context.
        return min(self.config.max_running_requests * table_width, 1 << 16)

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Queue a request. Bad input raises a ValueError subclass and changes nothing."""
        params = params or SamplingParams()
        prompt_ids = self.check_request(prompt, params, compile_grammar=False)
        if params.n != 1:
            raise InvalidRequestError(f"n={params.n}: the engine serves one sequence per request; queue each of "
                                      "params.samples() as a request of its own (as LLM.generate does)")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        old = self.requests.get(request_id)
        if old is not None and not old.finished:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        if self.scheduler.num_queued >= self.config.max_queued_requests:
            raise QueueFullError(f"{self.scheduler.num_queued} requests are queued (max_queued_requests)")
        compiled = None
        if params.structured_output is not None:
            # Compiled on the grammars' threads, not here: a large schema takes llguidance a few
            # hundred milliseconds, which would hold every running request's next step. The
            # request waits in Scheduler.held until its grammar is ready (_admit_compiled).
            compiled = self.grammars.compile(params.structured_output)
            if compiled.done() and compiled.exception() is not None:
                raise InvalidRequestError(str(compiled.exception()))  # a spec already refused
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(32)
        req = Request(request_id, prompt_ids, params, seed)
        if self.tokenizer is not None and params.detokenize:
            req.detok = self.tokenizer.incremental_decoder(prompt_ids,
                                                           skip_special_tokens=params.skip_special_tokens)
        # Ctrl-C waits until the request is in both the engine's table and the scheduler's
        # queue: in one only, no abort could end it (the scheduler's raises, not finding it).
        with interrupts.deferred():
            self.requests[request_id] = req
            if compiled is not None and not compiled.done():
                req.grammar_future = compiled
                self.scheduler.add(req, held=True)
                return
            if compiled is not None:
                self._constrain(req, compiled.result())
            self.scheduler.add(req)

    def _constrain(self, req: Request, compiled) -> None:
        """Give the request its matcher: a copy of its grammar's compiled start."""
        req.matcher, req.grammar_future = compiled.deep_copy(), None
        self._constrained += 1
        self.runner.grammars = self.grammars  # steps now look for constrained rows

    def _admit_compiled(self, wait: bool) -> None:
        """Queue the held requests whose grammar has compiled; end with "abort" (and
        RequestOutput.error) those whose grammar llguidance refused. With `wait` (the engine
        has nothing else to do), first wait a little for a compile to end rather than spin."""
        held = self.scheduler.held
        if wait:
            concurrent.futures.wait([r.grammar_future for r in held], timeout=HELD_POLL_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for req in [r for r in held if r.grammar_future.done()]:
            error = req.grammar_future.exception()
            if error is None:
                self._constrain(req, req.grammar_future.result())
                self.scheduler.release(req)
            else:
                req.error, req.grammar_future = str(error) or type(error).__name__, None
                self.scheduler.abort(req)

    def check_request(self, prompt, params: SamplingParams | None = None, *,
                      compile_grammar: bool = True) -> list[int]:
        """The prompt's token ids if the engine can serve this request; otherwise the
        ValueError subclass that add_request would raise for it (bar n > 1: this checks what
        each of params.samples() needs). Changes nothing, so a caller can check a whole batch
        of requests before it queues any (LLM.generate).

        A structured output's grammar is compiled here, on the caller's thread, unless
        `compile_grammar` is False (add_request, on the engine's thread, starts the compile
        and does not wait for it: a grammar refused then ends its request with "abort")."""
        if self.closed:
            raise EngineClosedError("the engine is closed")
        if params is not None:
            self._check_params(params, compile_grammar)
        prompt_ids = self._prompt_ids(prompt)
        if len(prompt_ids) >= self.max_context_len:
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens; the context holds {self.max_context_len} "
                f"(prompt + output), so at most {self.max_context_len - 1} prompt tokens fit"
            )
        if not self.scheduler.fits(len(prompt_ids)):
            room = self.scheduler.row_headroom
            why = "two speculative windows and the lookahead" if self.drafter else "the next two steps"
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens; the KV cache holds {self.kv_cache_tokens}, and a running "
                f"request keeps room for {room} more ({why}), so at most {self.kv_cache_tokens - room} prompt "
                f"tokens fit")
        if params is not None and params.prompt_logprobs and params.prompt_logprobs_start >= len(prompt_ids):
            raise InvalidRequestError(f"prompt_logprobs_start={params.prompt_logprobs_start} scores nothing: the "
                                      f"prompt's positions are 1..{len(prompt_ids) - 1}")
        return prompt_ids

    def _check_params(self, params, compile_grammar: bool) -> None:
        """What SamplingParams cannot check alone: what this engine serves, and the vocabulary."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.uses_history and not self.serves_penalties:
            raise InvalidRequestError("repetition_penalty, frequency_penalty, presence_penalty, min_new_tokens and "
                                      "logit_bias are not available on an engine started with enable_penalties=False")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer, and this model has none: use stop_token_ids")
        if params.structured_output is not None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured_output needs a tokenizer, and this model has none")
            if compile_grammar:
                self.grammars.check(params.structured_output)  # a grammar llguidance refuses: its message
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias names a token id outside the vocabulary ({vocab})")
        if params.min_new_tokens:
            stops = params.ending_token_ids(self.eos_token_ids)
            if len(stops) > penalties.MAX_STOP_IDS:
                raise InvalidRequestError(f"min_new_tokens works with at most {penalties.MAX_STOP_IDS} stop token ids "
                                          f"(EOS included), this request has {len(stops)}")
            if any(t >= vocab for t in stops):
                raise InvalidRequestError("stop_token_ids must be inside the vocabulary with min_new_tokens")

    @property
    def num_waiting(self) -> int:
        """Requests queued and not yet admitted (those whose grammar compiles too)."""
        return self.scheduler.num_queued

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = _int_list(prompt)
            vocab = self.model_config.vocab_size
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                bad = [t for t in ids if not 0 <= t < vocab]
                raise InvalidRequestError(f"token ids outside the vocabulary [0, {vocab}): {bad[:8]}")
        else:
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequestError("empty prompt")
        return ids

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.finished or req.abort_requested:
            return False
        # Marked even where it ends at once (waiting): LLM._settle tells a request given up
        # from one whose final output its owner still waits for by this.
        req.abort_requested = True
        self.scheduler.abort(req)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None or bool(self.scheduler.finished_since_last_poll)

    # -- the loops --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One loop iteration; returns the output deltas it produced."""
        if self.closed:
            raise EngineClosedError("the engine is closed")
        with interrupts.deferred():  # Ctrl-C waits for the step: its programs donate the state
            if self.scheduler.held:
                self._admit_compiled(wait=self._inflight is None and not self.scheduler.has_schedulable_work())
            if self.overlap:
                return self._step_overlap()
            return self._step_normal()

    def set_overlap(self, enabled: bool) -> None:
        """Switch loops between workloads (benchmarks compare the two in one process)."""
        if self.has_work():
            raise RuntimeError("switch loops only while the engine is idle")
        self.overlap = enabled

    def set_fused_decode(self, enabled: bool) -> None:
        """Switch the Pallas backend's fused decode kernels on or off between workloads (the
        benchmarks compare both in one process; each setting compiles its own programs)."""
        from jaxoverlap.pallas_kernels.attention import PallasAttention

        if self.has_work():
            raise RuntimeError("switch kernels only while the engine is idle")
        if not isinstance(self.runner.attention, PallasAttention):
            raise RuntimeError(f"the fused decode kernel needs attention_backend='pallas' on one device, "
                               f"not {self.runner.attention!r}")
        self.runner.attention = _pallas_attention(interpret=self.runner.attention.interpret, fuse_decode=enabled)

    def _step_overlap(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()  # decided from results up to step N-1
        t1 = time.perf_counter()
        early, fresh_s, fresh_wait_s = [], 0.0, 0.0
        if batch is not None and self._inflight is not None and self.runner.needs_host_results(batch):
            # Host n-gram: the drafts need step N's tokens, so this batch gives up overlap.
            # Its reservations, made from older counts, still cover it.
            prev, self._inflight = self._inflight, None
            fresh_wait_s, early, _ = self._process(prev)
            fresh_s = time.perf_counter() - t1
        t1b = time.perf_counter()
        if batch is not None and self.runner.samples_apart(batch):
            # Structured output in a decode batch: the allowed tokens of step N+1 follow from
            # step N's tokens, but its forward pass does not. So the forward pass is queued
            # behind step N, step N is processed while it runs (its tokens advance the
            # grammars), and then N+1's sampling is queued with the masks.
            # A speculative step's masks also follow from its drafts: its draft program and
            # verify pass are queued, and the accept program waits for the drafts only.
            forwarded = self._launch(batch, self.runner.launch_forward)
            t2 = time.perf_counter()
            prev, self._inflight = self._inflight, None
            wait_s, outputs, found_done = self._process(prev)  # waits for step N only
            t3 = time.perf_counter()
            forwarded.wait_drafts()
            t4 = time.perf_counter()
            self._inflight = self._launch(batch, lambda _: self.runner.launch_sample(forwarded))
            launch_s, process_s = t2 - t1b + time.perf_counter() - t4, t3 - t2 - wait_s
            wait_s += t4 - t3  # (after process_s: the wait for the drafts is no processing)
        else:
            launched = self._launch(batch) if batch is not None else None  # step N+1 queued behind N
            t2 = time.perf_counter()
            prev, self._inflight = self._inflight, launched
            wait_s, outputs, found_done = self._process(prev)  # waits for step N only
            launch_s, process_s = t2 - t1b, time.perf_counter() - t2 - wait_s
        self._record(batch, t1 - t0, launch_s, wait_s, process_s, fresh_s, start_s=t0,
                     found_done=found_done, fresh_process_s=fresh_s - fresh_wait_s)
        return early + outputs

    def _step_normal(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()  # decided from results up to step N
        t1 = time.perf_counter()
        drafts_s = 0.0
        if batch is not None and self.runner.samples_apart(batch):  # structured output (see _step_overlap)
            forwarded = self._launch(batch, self.runner.launch_forward)
            t = time.perf_counter()
            forwarded.wait_drafts()
            drafts_s = time.perf_counter() - t
            launched = self._launch(batch, lambda _: self.runner.launch_sample(forwarded))
        else:
            launched = self._launch(batch) if batch is not None else None
        t2 = time.perf_counter()
        wait_s, outputs, found_done = self._process(launched)  # waits for the step just launched
        self._record(batch, t1 - t0, t2 - t1 - drafts_s, wait_s + drafts_s, time.perf_counter() - t2 - wait_s,
                     start_s=t0, found_done=found_done)
        return outputs

    def _launch(self, batch, launch=None):
        """`launch(batch)` (default: the runner's whole step), inside the span and checks below."""
        # A named host span per launch for `jaxoverlap profile` (jaxoverlap/profiling/): it ties
        # the device ops of a step to the step even where overlap leaves no gap between steps.
        # `iteration` is the index this loop iteration's StepTiming gets in self.timings.
        # Outside a trace the annotation costs about a microsecond (measured on CPU).
        launch = launch or self.runner.launch
        with jax.profiler.TraceAnnotation("jaxoverlap.launch", kind=batch.kind, size=batch.size,
                                          iteration=len(self.timings)), self._compiles:
            if self.guard_launch:
                from jaxoverlap.sync_guard import no_host_sync

                with no_host_sync():
                    return launch(batch)
            return launch(batch)

    def _process(self, launched: LaunchedStep | None) -> tuple[float, list[RequestOutput], bool]:
        """(seconds waited for the device, the outputs, whether the step was done before the wait)."""
        wait_s, found_done = 0.0, False
        updated: list[Request] = []
        if launched is not None:
            found_done = launched.done()
            t = time.perf_counter()
            tokens, logprobs, accept_lens = launched.fetch()
            wait_s = time.perf_counter() - t
            s = self.scheduler
            before = (s.num_accepted_tokens, s.num_verify_rows)
            updated = s.process(launched.batch, tokens, logprobs, accept_lens, launched.prompt_logprobs(),
                                launched.top_logprobs())
            self._accepted = (s.num_accepted_tokens - before[0], s.num_verify_rows - before[1])
        finished = self.scheduler.poll_finished()
        return wait_s, self._make_outputs(updated, finished), found_done

    def _record(self, batch, prepare_s, launch_s, wait_s, process_s, fresh_wait_s=0.0, *, start_s=0.0,
                found_done=False, fresh_process_s=0.0) -> None:
        kind, size = (batch.kind, batch.size) if batch is not None else ("", 0)
        draft_s = self.runner.last_draft_s if batch is not None and self.runner.needs_host_results(batch) else 0.0
        accepted, rows = self._accepted
        self._accepted = (0, 0)
        compiled, self._compiles.programs = self._compiles.programs, 0
        timing = StepTiming(kind, size, prepare_s, launch_s, wait_s, process_s, fresh_wait_s, draft_s, accepted,
                            rows, start_s, len(batch.reservations) if batch is not None else 0, found_done, compiled,
                            fresh_process_s)
        self.timings.append(timing)
        self.loop_totals.add(timing, self.overlap)
        if compiled:
            logger.info("a %s launch of %d rows compiled or loaded %d program(s) and held every request for %.2f s "
                        "(Engine.warmup / `jaxoverlap serve --precompile` compiles them ahead)", kind, size, compiled,
                        launch_s)

    # -- outputs ----------------------------------------------------------------------------------
    @functools.cached_property
    def grammars(self):
        """Structured output's grammars and masks for this engine's tokenizer (structured.py)."""
        from jaxoverlap.structured import Grammars

        return Grammars(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids))

    @staticmethod
    def _check_token(req: Request) -> str | None:
        """Called for every new token that is no stop token: stop strings, then the request's
        grammar. A grammar that this token completed ends the request with its text whole.

        Static, as is what it calls: the scheduler keeps it (stop_checker), and a bound
        method there would tie the engine into a reference cycle, which refcounting never
        frees and a frozen collector (freeze_gc) never sees: `del llm` would free nothing."""
        reason = Engine._check_stop_strings(req)
        if reason is None and req.matcher is not None:
            reason = advance_grammar(req)
            if reason is not None and req.detok is not None:
                req.pending_text += req.detok.flush()  # "stop" outputs are not flushed later
        return reason

    @staticmethod
    def _check_stop_strings(req: Request) -> str | None:
        """Called for every new token: decode it and look for stop strings.

        The request keeps only the text not handed out yet (`_make_outputs` holds back the
        last len(longest stop) - 1 characters of it), so a stop string that this token
        completed lies wholly inside it, and each token costs the same however long the
        output has grown."""
        if req.detok is None:
            return None
        before = len(req.pending_text)
        req.pending_text += req.detok.step(req.output_ids[-1])
        return "stop" if req.params.stop and _cut_at_stop_string(req, before) else None

    def _make_outputs(self, updated: list[Request], finished: list[Request]) -> list[RequestOutput]:
        reqs = updated
        if finished:  # a request that finished in this step is in both lists: once each.
            # By object, not id, and those the step did not update (aborted ones) first: an
            # aborted request's id may already be taken by a new request that finishes in the
            # same step, and both finals go out, the old one's first.
            stepped = {id(r) for r in updated}
            reqs = [r for r in finished if id(r) not in stepped] + updated
        outputs = []
        for req in reqs:
            params, n_ids, finished = req.params, len(req.output_ids), req.finished
            if finished and req.detok is not None and (req.finish_reason != "stop" or _ended_by_token(req)):
                # The text of every output token but a stop token's (with include_stop_str_in_output,
                # its too, as vLLM has it), as decode() gives it: what the decoder held back (a
                # cut character, and complete ones in front of it in the same token) comes out
                # at the end. Not after a stop string: the text ends there. (A completed grammar
                # was flushed in _check_token.)
                checked = len(req.pending_text)
                if params.include_stop_str_in_output and _ended_by_token(req):
                    req.pending_text += req.detok.step(req.output_ids[-1])
                req.pending_text += req.detok.flush()
                # That held-back text never met the stop check: a stop string in it still ends the text.
                if _cut_at_stop_string(req, checked) and req.finish_reason == "length":
                    req.finish_reason = "stop"
            new_ids = req.output_ids[req.num_emitted:]
            new_lp = req.output_logprobs[req.num_emitted:] if params.logprobs else None
            new_top = req.output_top_logprobs[req.num_emitted:] if req.output_top_logprobs is not None else None
            new_text = req.pending_text
            if params.stop and not finished:
                # Hold back text that may still turn out to begin a stop string.
                keep = min(len(new_text), max(len(s) for s in params.stop) - 1)
                new_text, req.pending_text = new_text[: len(new_text) - keep], new_text[len(new_text) - keep :]
            else:
                req.pending_text = ""
            req.num_emitted = n_ids
            self.tokens_generated += len(new_ids)
            out = RequestOutput(req.request_id, new_ids, new_text, finished, req.finish_reason, req.metrics, new_lp,
                                req.output_ids, n_ids, new_top_logprobs=new_top, error=req.error if finished else None)
            if finished and req.prompt_logprobs is not None:
                out.prompt_logprobs, out.prompt_top1 = req.prompt_logprobs, req.prompt_top1
            outputs.append(out)
            if finished and req.matcher is not None:
                req.matcher = None
                self._constrained -= 1
                if not self._constrained:
                    self.runner.grammars = None  # no row is constrained: no step looks
            if finished and self.requests.get(req.request_id) is req:
                # (A finished request's id may be reused before its final output: add_request
                # then holds the new request under it, which this one must not take along.)
                del self.requests[req.request_id]
        return outputs

    # -- introspection ----------------------------------------------------------------------------
    def stats(self) -> dict:
        s = self.scheduler
        free_tokens = s.pages.num_free * self.config.page_size
        cached_tokens = s.prefix.num_pages * self.config.page_size
        # Pages only the prefix cache holds are free to evict whenever a request needs them:
        # not "in use" (as SGLang and vLLM count them), though still cached.
        used_tokens = self.kv_cache_tokens - free_tokens - s.prefix.num_evictable * self.config.page_size
        return {
            "num_running": len(s.running) + (1 if s.prefilling is not None else 0),
            "num_waiting": s.num_queued,
            "kv_total_tokens": self.kv_cache_tokens,
            "kv_used_tokens": used_tokens,  # held by requests
            "kv_cached_tokens": cached_tokens,  # in the prefix cache (some also held by requests)
            "kv_usage": used_tokens / self.kv_cache_tokens,
            "tokens_generated": self.tokens_generated,
            "num_retractions": s.num_retractions,
            "num_steps": len(self.timings),
            "speculative_algorithm": self.config.speculative_algorithm,
            # Tokens per verified row, bonus included (1.0 without speculation).
            "accept_length": s.num_accepted_tokens / s.num_verify_rows if s.num_verify_rows else 1.0,
            "spec_paused_steps": s.num_paused_steps,  # decode steps above speculative_disable_by_batch_size
            # The loop since the engine was built (LoopTotals): iterations, host seconds by
            # phase, seconds blocked on the device, and iterations after which it may have run dry.
            "loop": dataclasses.asdict(self.loop_totals),
        }

    def warmup(self, batch_sizes=None, ctx_lens=None, *, sampling=(False,), threads: int | None = None,
               prefill: bool = False, top_logprobs: bool = False, structured: bool = False,
               prompt_logprobs: bool = False) -> list[dict]:
        """Compile the decode programs before traffic arrives, by default every batch bucket
        at every context bucket, greedy (pass sampling=(False, True) for both programs), and
        run each once on padding rows, so that a program's first execution (XLA records its
        CUDA graph) does not fall on a served step either. Real rows are untouched, so it
        may also run between steps while requests are in flight.

        With `prefill`, every prefill program (each rows x tokens bucket) is compiled too,
        before the runs: then no request compiles anything (but one with prompt_logprobs,
        unless `prompt_logprobs` below), and no compilation after the
        warm-up makes XLA drop the decode programs' recorded graphs (it drops every
        executable's graphs whenever it loads a new one). With `top_logprobs`, each program's
        variant that returns top logprobs too (twice the programs), which runs while any row
        of the batch asks for them (SamplingParams.top_logprobs). With `structured`, the
        programs of batches with structured output too: each decode bucket's forward pass and
        sampling (ModelRunner.launch_forward; with a drafter, each speculative step's draft,
        verify and accept programs), and with `prefill` each prefill program's variant with
        allowed tokens; skipped, with a warning, where the engine cannot serve structured
        output (no tokenizer). With `prefill` and `prompt_logprobs`, each prefill program's
        variant that returns the prompt's logprobs too (SamplingParams.prompt_logprobs:
        scoring requests; a prefill that holds both a scoring row and a constrained one,
        structured output, still compiles its program on first use). Returns the compile
        (and run) time of each program (ModelRunner.precompile)."""
        if self.closed:
            raise EngineClosedError("the engine is closed")
        mask_words = None
        if structured:
            if self.tokenizer is None:
                logger.warning("warmup(structured=True) skipped: this engine serves no structured output "
                               "(it has no tokenizer)")
            else:
                mask_words = self.grammars.words
        compiled = self.runner.precompile(batch_sizes, ctx_lens, sampling, threads, execute=True, prefill=prefill,
                                          top_logprobs=(False, True) if top_logprobs else (False,),
                                          mask_words=mask_words, prompt_logprobs=prompt_logprobs)
        self._freeze_gc()  # the programs' own long-lived objects too
        return compiled

    def close(self) -> None:
        """Free the engine's device memory now: aborts every request, waits for the step in
        flight, deletes the KV cache and relay, drops the engine's references to the weights
        and collects; with freeze_gc it first unfreezes, so that what a reference cycle
        holds of the engine is collected too, and freezes again if other live engines froze
        the collector. The engine cannot run afterwards; closing twice does nothing."""
        if self.closed:
            return
        for rid in list(self.requests):
            self.abort(rid)
        self.drain()
        self.closed = True
        self.runner.release()
        if "grammars" in self.__dict__:  # built (a cached_property): its compile threads
            self.grammars.close()
        if self.config.freeze_gc:
            _FROZEN_ENGINES.discard(self)
            gc.unfreeze()
        gc.collect()
        if self.config.freeze_gc and _FROZEN_ENGINES:  # (checked after the collection: dropped ones are gone)
            gc.freeze()

    def _freeze_gc(self) -> None:
        """EngineConfig.freeze_gc: collect once, then move every object alive now (JAX's,
        the weights', the compiled programs') out of the collector's view, so that the
        collections that land inside later steps only scan what was made since."""
        if self.config.freeze_gc:
            gc.collect()
            gc.freeze()
            _FROZEN_ENGINES.add(self)

    def check_integrity(self) -> None:
        """Every page is free, cached or held by an admitted request; every entry is accounted for."""
        self.scheduler.check_integrity()

    def drain(self) -> list[RequestOutput]:
        outputs = []
        while self.has_work():
            outputs.extend(self.step())
        return outputs
