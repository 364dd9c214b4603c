"""Tiny models and engines for CPU tests (float32, so greedy outputs are reproducible)."""
import functools

import jax.numpy as jnp

from jaxoverlap.config import EngineConfig
from jaxoverlap.engine import Engine
from jaxoverlap.models.config import ModelConfig
from jaxoverlap.models.loader import dummy_params

VOCAB = 97


def tiny_config(model_type: str = "qwen3", **overrides) -> ModelConfig:
    base = dict(
        model_type=model_type, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=model_type == "qwen3", qkv_bias=model_type == "qwen2",
        max_position_embeddings=512, rope_theta=10000.0, eos_token_ids=(),
    )
    base.update(overrides)
    return ModelConfig(**base)


@functools.lru_cache(maxsize=None)
def tiny_params(cfg: ModelConfig, seed: int = 0):
    return dummy_params(cfg, jnp.float32, seed)


def make_engine(cfg: ModelConfig | None = None, tokenizer=None, params=None, **options) -> Engine:
    """An engine over `params` (default: cfg's tiny dummy weights)."""
    cfg = cfg or tiny_config()
    # Two batch buckets: each one is a decode program (and a speculative step's) to compile,
    # the suite's main cost; a batch of 1 then runs padded, as most steps do. Tests of the
    # bucket choice name their buckets.
    opts = dict(dtype="float32", page_size=4, max_running_requests=8, max_context_len=128,
                chunked_prefill_size=32, kv_cache_tokens=512, batch_buckets=(2, 8))
    opts.update(options)
    drafter = {k: opts.pop(k) for k in ("draft_model_config", "draft_params") if k in opts}  # Engine's, not options
    return Engine(EngineConfig.from_options("/nonexistent-model", **opts), model_config=cfg,
                  params=tiny_params(cfg) if params is None else params, tokenizer=tokenizer, **drafter)


def run_workload(engine: Engine, arrivals: dict, max_steps: int = 20000) -> dict:
    """arrivals: {loop_iteration: [(request_id, prompt_ids, SamplingParams), ...]}.
    Returns {request_id: RequestOutput (final)} after draining."""
    finals, it = {}, 0
    last_arrival = max(arrivals) if arrivals else 0
    while it <= last_arrival or engine.has_work():
        for rid, prompt, params in arrivals.get(it, []):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, "finished twice"
                finals[out.request_id] = out
        it += 1
        assert it < max_steps, "engine did not drain"
    return finals


def assert_drained(engine: Engine) -> None:
    """After a workload: nothing running or queued, every entry free, every page free or cached."""
    engine.check_integrity()
    s = engine.scheduler
    assert not s.running and not s.waiting and s.prefilling is None
    assert s.entries.num_free == engine.config.max_running_requests
    assert s.pages.num_free + s.prefix.num_pages == s.pages.capacity
