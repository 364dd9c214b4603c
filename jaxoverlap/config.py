"""EngineConfig: every engine option, as one frozen dataclass (argparse lives only at the CLI edge)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # checkpoint folder; None means the embedded default model
    load_format: str = "auto"  # "auto" (safetensors) | "dummy" (random weights from config.json)
    dtype: str = "auto"  # "auto" (bfloat16 on GPU, float32 on CPU) | "bfloat16" | "float32"
    seed: int = 0  # for dummy weights and for requests without a seed
    page_size: int = 16
    max_running_requests: int = 64
    max_context_len: int | None = None  # default: min(model's max positions, 4096)
    chunked_prefill_size: int = 2048  # max prompt tokens per prefill step
    max_prefill_requests: int = 8  # max prompts batched in one prefill step
    kv_cache_tokens: int | None = None  # KV cache capacity in tokens; overrides the fraction
    kv_cache_memory_fraction: float = 0.85  # of device memory left after weights (GPU only)
    disable_overlap: bool = False
    disable_prefix_cache: bool = False
    attention_backend: str = "auto"  # "auto" | "xla" | "pallas"
    batch_buckets: tuple[int, ...] | None = None  # padded decode batch sizes; default powers of 2
    weights_cache_dir: str | None = None  # orbax cache of converted weights for fast restarts
    compilation_cache_dir: str | None = None  # JAX persistent compilation cache
    max_queued_requests: int = 4096

    def __post_init__(self):
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")
        if self.load_format not in ("auto", "dummy", "safetensors"):
            raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}")
        if self.dtype not in ("auto", "bfloat16", "float32", "float16"):
            raise ValueError(f"dtype must be 'auto', 'bfloat16', 'float16' or 'float32', got {self.dtype!r}")
        if self.attention_backend not in ("auto", "xla", "pallas"):
            raise ValueError(f"attention_backend must be 'auto', 'xla' or 'pallas', got {self.attention_backend!r}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")

    @classmethod
    def from_options(cls, model: str | None = None, **options) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine options: {unknown}; known: {sorted(known)}")
        if "batch_buckets" in options and options["batch_buckets"] is not None:
            options["batch_buckets"] = tuple(options["batch_buckets"])
        return cls(model=model, **options)
