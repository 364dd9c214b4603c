"""EngineConfig: every engine option, as one frozen dataclass (argparse lives only at the CLI edge)."""
from __future__ import annotations

import dataclasses
import numbers

SPECULATIVE_ALGORITHMS = (None, "eagle", "draft_model", "ngram", "ngram_device")
DECODE_INPUTS = ("every_step", "on_change")
# EngineConfig.kv_cache_dtype -> the cache's numpy dtype name (None: the model's dtype).
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# The longest n-gram the n-gram drafters may match (speculative_ngram_max_match_window_size).
MAX_NGRAM_MATCH = 32
# Default rows of a prefill step: one per this many tokens of the chunk budget (2048 -> 64),
# the prefill attention kernel's query tile, so that a finer row adds no attention work.
# On an H100 (2026-12-06), 64 rows against 8 prefilled 8-16 prompts arriving together
# 1.06-1.14x sooner (less padding in as many steps or fewer; benchmarks/RESULTS.md).
PREFILL_ROW_TOKENS = 32


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # checkpoint folder; None means the embedded default model
    load_format: str = "auto"  # "auto" (safetensors) | "dummy" (random weights from config.json)
    dtype: str = "auto"  # "auto" (bfloat16 on GPU, float32 on CPU) | "bfloat16" | "float32"
    # None | "fp8": the layers' weight matrices (experts too) in 8 bits with a scale per output column
    # (models/quant.py): half their memory and bytes per step; activations stay in `dtype`.
    quantization: str | None = None
    # The KV cache's dtype: "auto" (the model's) | "fp8" (= "fp8_e4m3") | "fp8_e5m2". An 8-bit
    # cache holds K/V over the checkpoint's per-layer k_scale / v_scale where it has them (else
    # 1, as vLLM), rounded and saturated: twice the tokens in the same memory, and half the
    # bytes attention reads per token. The attention math stays in `dtype`.
    kv_cache_dtype: str = "auto"
    seed: int = 0  # for dummy weights and for requests without a seed
    page_size: int = 16
    max_running_requests: int = 64
    max_context_len: int | None = None  # default: min(model's max positions, 4096)
    chunked_prefill_size: int = 2048  # max prompt tokens per prefill step, and max padded rows x tokens
    max_prefill_requests: int = 8  # max requests of one prefill step
    # Max rows of one prefill step: the scheduler cuts prompts into rows of one token bucket
    # (buckets.PrefillShapes.plan), so a long prompt may take several. None: one row per
    # PREFILL_ROW_TOKENS of the chunk budget, at least max_prefill_requests (`prefill_rows`).
    max_prefill_rows: int | None = None
    kv_cache_tokens: int | None = None  # KV cache capacity in tokens; overrides the fraction
    kv_cache_memory_fraction: float = 0.85  # of device memory left after weights (GPU only)
    disable_overlap: bool = False
    disable_prefix_cache: bool = False
    tensor_parallel_size: int = 1  # devices of one mesh axis over which weights and KV heads are sharded
    attention_backend: str = "auto"  # "auto" (pallas on GPU, xla elsewhere) | "xla" | "pallas"
    disable_fused_decode: bool = False  # pallas: keep norm/RoPE/cache write/attention of decode as separate kernels
    batch_buckets: tuple[int, ...] | None = None  # padded decode batch sizes; default powers of 2
    weights_cache_dir: str | None = None  # orbax cache of converted weights for fast restarts
    # JAX persistent compilation cache: a folder, or "auto" (what `jaxoverlap serve` uses):
    # on a GPU $XDG_CACHE_HOME/jaxoverlap/jax_compilation_cache (~/.cache/...) unless
    # JAX_COMPILATION_CACHE_DIR names one already, elsewhere none (a CPU program compiles in
    # about a second). None or "none": only what JAX_COMPILATION_CACHE_DIR sets.
    compilation_cache_dir: str | None = None
    # Run each decode program as two loaded copies in turn, so that XLA need not update the
    # step's CUDA graph for its moved output on every call (runner._call_decode). One GPU only.
    alternate_decode_executables: bool = True
    # One device: the weight matrices of this many consecutive layers as one [G, in, out]
    # array per kind (models/params.stack_layers), so a step call has fewer argument leaves
    # (Qwen3-8B: 151 per layer, 43 with G = 4) and the host's launch less per-buffer work.
    # 1 keeps one array per layer; under tensor parallelism the weights stay per layer.
    # None: 4 on one GPU (engine.GPU_LAYERS_PER_WEIGHT_STACK; 1 with FP8 weights, which XLA
    # reads far slower stacked), 1 elsewhere (XLA:CPU copies the slices out, and there the
    # launch is not what limits the host).
    layers_per_weight_stack: int | None = None
    # Positions each running row gets beyond its need whenever a decode step reserves pages
    # anyway, while free pages allow (SchedulerConfig.reserve_slack): rows then take their
    # next pages together, and far fewer steps send reservations with their launch.
    # None: 2 pages. 0: only what each step needs.
    reserve_slack_tokens: int | None = None
    # When a decode step's one input array (the rows' entries and the page reservations,
    # steps.DecodeInputs) goes to the device. "every_step": with every call, as a numpy
    # argument: each step then allocates the same device buffers, so the step's temp buffer
    # keeps its address and XLA need not re-record the step's CUDA graph (2-3 ms of host
    # time each, measured) when the running set changes or pages are reserved.
    # "on_change": only when its content changed; launches are shorter while nothing
    # changes, and after a change up to four launches re-record the graph. One device
    # only: under tensor parallelism it is sent on change.
    decode_inputs: str = "every_step"
    # gc.collect() and gc.freeze() once the engine is built and after warmup(): the many
    # long-lived objects of JAX and of the compiled programs leave the collector's view, so
    # a full collection no longer stalls a step (117 ms measured inside one launch).
    freeze_gc: bool = True
    max_queued_requests: int = 4096
    # Serve SamplingParams.repetition_penalty / frequency_penalty / presence_penalty,
    # logit_bias and min_new_tokens: keeps a [max_running_requests + 1, vocab] int32 history on the device
    # (Qwen3-8B, 64 running: 40 MB), read and written by sampling programs only
    # (penalties.py; with a drafter, verification applies them per draft position). Off:
    # such requests are refused.
    enable_penalties: bool = True
    # Speculative decoding (names follow SGLang's flags). One step verifies a window of
    # speculative_num_draft_tokens = 1 + speculative_num_steps positions per request.
    speculative_algorithm: str | None = None  # None | "eagle" | "draft_model" | "ngram" | "ngram_device"
    speculative_num_steps: int | None = None  # draft tokens per step (default 3)
    speculative_num_draft_tokens: int | None = None  # window = 1 + num_steps (chain drafting)
    speculative_eagle_topk: int = 1  # only chain drafting (1) is implemented
    speculative_draft_model_path: str | None = None  # draft_model: checkpoint folder of the drafter
    speculative_eagle_head_path: str | None = None  # eagle: EAGLE-format head folder; None = random head
    speculative_ngram_min_match_window_size: int = 1  # ngram: shortest trailing n-gram to look up
    speculative_ngram_max_match_window_size: int = 4  # ngram: longest trailing n-gram to look up
    # Decode batches of more rows than this draft nothing (speculation paused; vLLM's
    # option of the same name): at large batches the step is compute-bound and verifying
    # drafts costs more than the accepted ones save. None: always draft.
    speculative_disable_by_batch_size: int | None = None

    # Option kinds, checked first: a string or float where an integer belongs fails with a
    # TypeError in the comparisons below or deep inside JAX, and "False" is truthy.
    _INTS = ("seed", "page_size", "max_running_requests", "chunked_prefill_size", "max_prefill_requests",
             "tensor_parallel_size", "max_queued_requests", "speculative_eagle_topk",
             "speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size")
    _OPTIONAL_INTS = ("max_context_len", "max_prefill_rows", "kv_cache_tokens", "layers_per_weight_stack",
                      "reserve_slack_tokens", "speculative_num_steps", "speculative_num_draft_tokens",
                      "speculative_disable_by_batch_size")
    _BOOLS = ("disable_overlap", "disable_prefix_cache", "disable_fused_decode", "alternate_decode_executables",
              "freeze_gc", "enable_penalties")
    _STRINGS = ("load_format", "dtype", "kv_cache_dtype", "attention_backend", "decode_inputs")
    _OPTIONAL_STRINGS = ("model", "quantization", "weights_cache_dir", "compilation_cache_dir", "speculative_algorithm",
                         "speculative_draft_model_path", "speculative_eagle_head_path")

    def _check_kinds(self) -> None:
        def integer(value) -> bool:
            return isinstance(value, numbers.Integral) and not isinstance(value, bool)

        for name in self._INTS + self._OPTIONAL_INTS:
            value = getattr(self, name)
            if value is None and name in self._OPTIONAL_INTS:
                continue
            if not integer(value):
                raise ValueError(f"{name} must be an integer{' or None' if name in self._OPTIONAL_INTS else ''}, "
                                 f"got {value!r}")
            object.__setattr__(self, name, int(value))  # numpy integers as Python ints (hashable, JSON)
        for name in self._BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in self._STRINGS + self._OPTIONAL_STRINGS:
            value = getattr(self, name)
            if not (isinstance(value, str) or (value is None and name in self._OPTIONAL_STRINGS)):
                raise ValueError(f"{name} must be a string{' or None' if name in self._OPTIONAL_STRINGS else ''}, "
                                 f"got {value!r}")
        fraction = self.kv_cache_memory_fraction
        if not isinstance(fraction, numbers.Real) or isinstance(fraction, bool):
            raise ValueError(f"kv_cache_memory_fraction must be a number, got {fraction!r}")
        buckets = self.batch_buckets
        if buckets is not None:
            if isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):
                raise ValueError(f"batch_buckets must be a list of batch sizes or None, got {buckets!r}")
            buckets = list(buckets)
            if not buckets or not all(integer(b) and b >= 1 for b in buckets):
                raise ValueError(f"batch_buckets must be batch sizes >= 1 (None: powers of two), got {buckets!r}")
            object.__setattr__(self, "batch_buckets", tuple(sorted({int(b) for b in buckets})))

    def __post_init__(self):
        self._check_kinds()
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_context_len is not None and self.max_context_len < 2:  # 0 would quietly mean the default
            raise ValueError(f"max_context_len must be an integer >= 2 (prompt + output tokens) or None, "
                             f"got {self.max_context_len!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            # 0 would quietly mean "sized from kv_cache_memory_fraction".
            raise ValueError(f"kv_cache_tokens must be >= 1, or None to size the cache from "
                             f"kv_cache_memory_fraction, got {self.kv_cache_tokens}")
        if self.reserve_slack_tokens is not None and self.reserve_slack_tokens < 0:
            raise ValueError(f"reserve_slack_tokens must be >= 0, got {self.reserve_slack_tokens}")
        if self.layers_per_weight_stack is not None and self.layers_per_weight_stack < 1:
            raise ValueError(f"layers_per_weight_stack must be >= 1, got {self.layers_per_weight_stack}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.max_prefill_requests < 1:
            raise ValueError(f"max_prefill_requests must be >= 1, got {self.max_prefill_requests}")
        if self.max_prefill_rows is not None and self.max_prefill_rows < self.max_prefill_requests:
            raise ValueError(f"max_prefill_rows ({self.max_prefill_rows}) must be >= max_prefill_requests "
                             f"({self.max_prefill_requests}): each request of a prefill step takes a row")
        if self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")
        if self.load_format not in ("auto", "dummy", "safetensors"):
            raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}")
        if self.dtype not in ("auto", "bfloat16", "float32", "float16"):
            raise ValueError(f"dtype must be 'auto', 'bfloat16', 'float16' or 'float32', got {self.dtype!r}")
        if self.quantization is not None:
            quantization = self.quantization.lower()
            object.__setattr__(self, "quantization", None if quantization in ("none", "") else quantization)
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8' (8-bit weights), got {self.quantization!r}")
        object.__setattr__(self, "kv_cache_dtype", self.kv_cache_dtype.lower())
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ("auto", "xla", "pallas"):
            raise ValueError(f"attention_backend must be 'auto', 'xla' or 'pallas', got {self.attention_backend!r}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
        if self.decode_inputs not in DECODE_INPUTS:
            raise ValueError(f"decode_inputs must be one of {DECODE_INPUTS}, got {self.decode_inputs!r}")
        self._check_speculative()

    @property
    def prefill_rows(self) -> int:
        """Rows of one prefill step at most: max_prefill_rows, or by default one per
        PREFILL_ROW_TOKENS of the chunk budget and at least one per request."""
        if self.max_prefill_rows is not None:
            return self.max_prefill_rows
        return max(self.max_prefill_requests, self.chunked_prefill_size // PREFILL_ROW_TOKENS)

    def _check_speculative(self) -> None:
        algo = self.speculative_algorithm
        if algo is not None:
            algo = algo.lower()
            object.__setattr__(self, "speculative_algorithm", algo)
        if algo not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, got {algo!r}")
        limit = self.speculative_disable_by_batch_size
        if limit is not None and limit < 1:
            raise ValueError(f"speculative_disable_by_batch_size must be >= 1 or None, got {limit}")
        draft_path, head_path = self.speculative_draft_model_path, self.speculative_eagle_head_path
        if algo == "eagle" and draft_path and not head_path:
            # SGLang names an EAGLE head with --speculative-draft-model-path: the same here.
            object.__setattr__(self, "speculative_eagle_head_path", draft_path)
            object.__setattr__(self, "speculative_draft_model_path", None)
            draft_path, head_path = None, draft_path
        if draft_path and algo != "draft_model":
            raise ValueError(f"speculative_draft_model_path is for speculative_algorithm='draft_model' (or an EAGLE "
                             f"head with 'eagle'), not {algo!r}")
        if head_path and algo != "eagle":
            raise ValueError(f"speculative_eagle_head_path is for speculative_algorithm='eagle', not {algo!r}")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi <= MAX_NGRAM_MATCH:
            # The device drafter unrolls one comparison per n-gram length, and the host trie
            # grows with the longest: bounded (SGLang's default longest is 12).
            raise ValueError(
                "need 1 <= speculative_ngram_min_match_window_size <= speculative_ngram_max_match_window_size <= "
                f"{MAX_NGRAM_MATCH}, got {lo} and {hi}"
            )
        if algo is None:
            unused = [name for name in ("speculative_num_steps", "speculative_num_draft_tokens",
                                        "speculative_disable_by_batch_size") if getattr(self, name) is not None]
            if unused:  # silently ignored, they would hide a missing speculative_algorithm
                raise ValueError(f"{', '.join(unused)} {'needs' if len(unused) == 1 else 'need'} a "
                                 "speculative_algorithm")
            return
        if self.speculative_eagle_topk != 1:
            raise ValueError(
                f"speculative_eagle_topk={self.speculative_eagle_topk} is not supported: only chain drafting "
                "(topk=1, one draft token per step of the drafter) is implemented"
            )
        steps, window = self.speculative_num_steps, self.speculative_num_draft_tokens
        if steps is None and window is None:
            steps = 3
        if steps is None:
            steps = window - 1
        if window is None:
            window = steps + 1
        if steps < 1:
            raise ValueError(f"speculative_num_steps must be >= 1, got {steps}")
        if window != steps + 1:
            raise ValueError(
                f"speculative_num_draft_tokens ({window}) must be speculative_num_steps + 1 ({steps + 1}) "
                "with chain drafting (speculative_eagle_topk=1)"
            )
        object.__setattr__(self, "speculative_num_steps", steps)
        object.__setattr__(self, "speculative_num_draft_tokens", window)
        if self.chunked_prefill_size < 2:
            raise ValueError("speculative decoding needs chunked_prefill_size >= 2")

    @classmethod
    def from_options(cls, model: str | None = None, **options) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine options: {unknown}; known: {sorted(known)}")
        if "batch_buckets" in options and options["batch_buckets"] is not None:
            options["batch_buckets"] = tuple(options["batch_buckets"])
        return cls(model=model, **options)
