"""Build the drafter that the engine options ask for: its static SpecConfig, its weights,
the shapes of its device state, and (for the host n-gram drafter) its trie."""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from jaxoverlap.config import EngineConfig
from jaxoverlap.device_state import DrafterLayout, kv_cache_bytes_per_token
from jaxoverlap.models.config import ModelConfig
from jaxoverlap.speculative.ngram_host import HostNgramDrafter
from jaxoverlap.speculative.spec_config import SpecConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Drafter:
    spec: SpecConfig
    params: object  # EagleParams | ModelParams | None: the drafter's weights (a jit argument)
    layout: DrafterLayout
    host: HostNgramDrafter | None = None
    kv_bytes_per_token: int = 0  # the drafter's cache per slot, for sizing the KV cache


def _check_same_tokenizer(target_path: str, draft_path: str) -> None:
    """A draft model must tokenize as the target does: its drafts are the target's token ids.
    Another vocabulary still gives correct output (the target verifies every token) but
    accepts next to nothing, so it is refused where both folders hold a tokenizer.json.
    Their embeddings may be padded to different sizes; the tokens must agree."""
    import os

    import tokenizers

    files = [os.path.join(p, "tokenizer.json") for p in (target_path, draft_path)]
    if not all(os.path.exists(f) for f in files):
        return
    target, draft = (tokenizers.Tokenizer.from_file(f).get_vocab(with_added_tokens=False) for f in files)
    if target != draft:
        raise ValueError(f"the draft model's tokenizer ({files[1]}) differs from the target's ({files[0]}): its drafts "
                         "would be other tokens than the target's; pick a draft model of the same family")


def build_drafter(
    config: EngineConfig,
    target_cfg: ModelConfig,
    dtype,
    *,
    draft_model_config: ModelConfig | None = None,
    draft_params=None,
    eagle_config: ModelConfig | None = None,
    eagle_params=None,
) -> Drafter | None:
    """None without speculative decoding. Weights passed in (tests, benchmarks) win over
    the paths in `config`; with neither, the EAGLE head is random and a draft model is an
    error."""
    algo = config.speculative_algorithm
    if algo is None:
        return None
    k = config.speculative_num_steps
    backend = "pallas" if config.attention_backend == "pallas" and jax.default_backend() == "gpu" else "xla"
    base = dict(algorithm=algo, num_draft=k, accept_backend=backend,
                ngram_min=config.speculative_ngram_min_match_window_size,
                ngram_max=config.speculative_ngram_max_match_window_size)
    if algo == "eagle":
        from jaxoverlap.models import eagle as eagle_models

        if eagle_params is not None:
            hcfg = eagle_config or eagle_models.head_config(target_cfg)
        elif config.speculative_eagle_head_path:
            hcfg, eagle_params = eagle_models.load_eagle_head(config.speculative_eagle_head_path, target_cfg, dtype)
        else:
            logger.warning("EAGLE with a random head (no speculative_eagle_head_path): its drafts are rejected; "
                           "for benchmarks of the step only")
            hcfg = eagle_models.head_config(target_cfg)
            eagle_params = eagle_models.dummy_eagle_params(hcfg, dtype, seed=config.seed)
        layout = DrafterLayout(hidden_size=target_cfg.hidden_size, cache_layers=1, cache_kv_heads=hcfg.num_kv_heads,
                               cache_head_dim=hcfg.head_dim)
        return Drafter(SpecConfig(draft_cfg=hcfg, **base), eagle_params, layout,
                       kv_bytes_per_token=kv_cache_bytes_per_token(1, hcfg.num_kv_heads, hcfg.head_dim, dtype))
    if algo == "draft_model":
        if draft_params is None:
            path = config.speculative_draft_model_path
            if not path:
                raise ValueError("speculative_algorithm='draft_model' needs speculative_draft_model_path")
            from jaxoverlap.models import loader

            draft_model_config = ModelConfig.from_path(path)
            _check_same_tokenizer(config.model or loader.default_model_path(), path)
            draft_params = loader.load_params(path, draft_model_config, dtype, load_format=config.load_format,
                                              seed=config.seed + 1, cache_dir=config.weights_cache_dir)
        elif draft_model_config is None:
            raise ValueError("draft_params need their draft_model_config")
        dcfg = draft_model_config
        if jnp.dtype(draft_params.embed.dtype) != jnp.dtype(dtype):
            raise ValueError(f"draft model weights are {draft_params.embed.dtype}, the engine runs {jnp.dtype(dtype)}")
        layout = DrafterLayout(cache_layers=dcfg.num_layers, cache_kv_heads=dcfg.num_kv_heads,
                               cache_head_dim=dcfg.head_dim)
        return Drafter(SpecConfig(draft_cfg=dcfg, **base), draft_params, layout,
                       kv_bytes_per_token=kv_cache_bytes_per_token(dcfg.num_layers, dcfg.num_kv_heads, dcfg.head_dim,
                                                                   dtype))
    if algo == "ngram_device":
        return Drafter(SpecConfig(**base), None, DrafterLayout(slot_tokens=True), kv_bytes_per_token=4)
    host = HostNgramDrafter(k, base["ngram_min"], base["ngram_max"])
    return Drafter(SpecConfig(**base), None, DrafterLayout(), host=host)
