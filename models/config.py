"""ModelConfig: the shape and flags of one decoder-only transformer, read from HF `config.json`."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

# HF `model_type` values we serve; Qwen2 is Qwen3 without qk-norm but with a qkv bias;
# Mistral is Llama's layer, with a sliding window in some versions (`attention_window`).
# The mixture-of-experts families: Qwen3-MoE is Qwen3's attention with a routed MLP in every
# layer, Mixtral is Mistral's, Qwen2-MoE is Qwen2's with routed experts plus a gated shared
# expert (models/moe.py).
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "mixtral", "qwen2_moe")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe")


class CheckpointError(ValueError):
    """A checkpoint's files do not hold what their format says: a file that is not JSON, a
    config without a key the model needs, a tensor missing or of the wrong shape."""


def read_json(path: str):
    """A checkpoint's JSON file; CheckpointError naming it if it is not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def read_json_if_present(path: str) -> dict:
    """A checkpoint's JSON object (config-like files: generation_config.json,
    tokenizer_config.json), or {} where the checkpoint has no such file; CheckpointError
    naming it if it holds anything but an object."""
    if not os.path.exists(path):
        return {}
    value = read_json(path)
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def read_tokenizer_config(model_path: str) -> dict:
    """tokenizer_config.json, with the special tokens (bos_token, eos_token, ...) of
    special_tokens_map.json where older checkpoints keep them, as transformers reads the two:
    the map's tokens win, but not over a token the config sets to null, and a config in the
    newer layout (with `added_tokens_decoder`) is read alone."""
    config = read_json_if_present(os.path.join(model_path, "tokenizer_config.json"))
    if "added_tokens_decoder" in config:
        return config
    specials = read_json_if_present(os.path.join(model_path, "special_tokens_map.json"))
    return {**config, **{k: v for k, v in specials.items()
                         if k.endswith("_token") and not (k in config and config[k] is None)}}


def token_ids(value, where: str) -> tuple[int, ...]:
    """An id field of a checkpoint's JSON (null, one id, or a list of ids) as a tuple of ids;
    CheckpointError naming `where` if it holds anything else."""
    ids = () if value is None else tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
        raise CheckpointError(f"{where} must be an integer or a list of integers, got {value!r}")
    return ids


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # llama3-style scaling as a frozen tuple of items (hashable, so the config can be static).
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Mistral's `sliding_window`: each token attends to this many tokens at most. Within a
    # context of that many tokens this is full attention, which is what the engine computes,
    # so the engine serves contexts of at most this many tokens (Engine's max_context_len).
    attention_window: int | None = None
    # Mixture of experts (0: a dense MLP). Each token's MLP is the weighted sum of the
    # `experts_per_token` experts its router scores highest, each a SwiGLU MLP of width
    # `intermediate_size`; `norm_topk_prob` renormalizes those experts' router probabilities
    # to sum to 1 (Mixtral always does; Qwen3-MoE and Qwen2-MoE as their config says).
    num_experts: int = 0
    experts_per_token: int = 0
    norm_topk_prob: bool = False
    # Qwen2-MoE's shared expert (0: none): a SwiGLU MLP of this width that every token runs
    # besides its routed experts, its output scaled by sigmoid(x @ w_shared_gate).
    shared_expert_intermediate_size: int = 0

    def __post_init__(self):
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} "
                             f"(each KV head serves a group of query heads)")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.experts_per_token} must be between 1 and "
                             f"num_experts={self.num_experts}")
        if self.shared_expert_intermediate_size < 0 or (self.shared_expert_intermediate_size and not self.num_experts):
            raise ValueError(f"shared_expert_intermediate_size={self.shared_expert_intermediate_size}: a shared "
                             f"expert needs a mixture-of-experts layer (num_experts > 0) and a width >= 1")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse RoPE frequencies [head_dim // 2], with llama3 scaling applied when configured."""
        half = self.head_dim // 2
        inv = 1.0 / (self.rope_theta ** (np.arange(0, half, dtype=np.float64) * 2.0 / self.head_dim))
        scaling = dict(self.rope_scaling or ())
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            factor = float(scaling["factor"])
            low = float(scaling.get("low_freq_factor", 1.0))
            high = float(scaling.get("high_freq_factor", 4.0))
            orig = float(scaling.get("original_max_position_embeddings", 8192))
            low_wavelen, high_wavelen = orig / low, orig / high
            wavelen = 2 * math.pi / inv
            smooth = (orig / wavelen - low) / (high - low)
            scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
            mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
            inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        elif kind not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling type {kind!r}")
        return inv.astype(np.float32)

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        try:
            return cls._from_hf_dict(cfg)
        except KeyError as e:
            raise CheckpointError(f"the model config lacks {e.args[0]!r}") from None

    @classmethod
    def _from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            hint = ""
            if model_type in ("deepseek_v2", "deepseek_v3"):
                hint = " (DeepSeek's multi-head latent attention and grouped expert routing are not implemented)"
            raise ValueError(f"unsupported model_type {model_type!r}{hint}; supported: {SUPPORTED_MODEL_TYPES}")
        _refuse_unsupported(cfg)
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos_ids = token_ids(cfg.get("eos_token_id"), "eos_token_id")
        scaling = cfg.get("rope_scaling")
        # transformers >= 5 may fold rope_theta into `rope_parameters`.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        if scaling is None and rope_params.get("rope_type") not in (None, "default"):
            scaling = rope_params
        if scaling is not None:
            scaling = tuple(sorted((k, v) for k, v in scaling.items() if not isinstance(v, (list, dict))))
        fields = dict(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            # A MoE model's MLP width is its experts' (the Qwen MoE families' `intermediate_size`
            # is that of dense layers they do not have here; Mixtral's is its experts').
            intermediate_size=cfg["moe_intermediate_size"] if model_type in _QWEN_MOE else cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,  # null means as many as queries
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=_qkv_bias(cfg, model_type),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            attention_window=_attention_window(cfg, model_type),
            **_moe_fields(cfg, model_type),
        )
        try:
            config = cls(**fields)
        except ValueError as e:  # a config whose shapes do not fit together
            raise CheckpointError(str(e)) from None
        try:  # an unsupported RoPE scaling is refused at load, not at the first forward
            config.rope_inv_freq()
        except ValueError as e:
            raise CheckpointError(f"{e}; supported: none, 'default' and 'llama3'") from None
        return config

    @classmethod
    def from_path(cls, model_path: str) -> "ModelConfig":
        """config.json's model; its EOS ids also take generation_config.json's (where
        transformers' generate() looks first), so that a checkpoint without a tokenizer stops
        on them too."""
        path = os.path.join(model_path, "config.json")
        cfg = read_json(path)
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{path} must hold a JSON object")
        try:
            config = cls.from_hf_dict(cfg)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        gen_path = os.path.join(model_path, "generation_config.json")
        gen = read_json_if_present(gen_path)
        gen_eos = token_ids(gen.get("eos_token_id"), f"{gen_path}: eos_token_id")
        return dataclasses.replace(config, eos_token_ids=tuple(dict.fromkeys((*gen_eos, *config.eos_token_ids))))


def _attention_window(cfg: dict, model_type: str) -> int | None:
    """Mistral's sliding window (null in Mistral 7B v0.2 and later, 4096 in v0.1). Qwen2's
    `sliding_window` applies only with `use_sliding_window`, which is refused."""
    window = cfg.get("sliding_window") if model_type in ("mistral", "mixtral") else None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 2):
        raise CheckpointError(f"sliding_window must be an integer >= 2 or null, got {window!r}")
    return window


def _qkv_bias(cfg: dict, model_type: str) -> bool:
    """Whether q, k and v have biases: always in Qwen2; in Qwen2-MoE unless its `qkv_bias`
    says not (transformers' default is true, and checkpoints written before that field
    existed have the biases); where `attention_bias` says so in the others."""
    if model_type == "qwen2":
        return True
    if model_type == "qwen2_moe":
        value = cfg.get("qkv_bias", True)
        if not isinstance(value, bool):
            raise CheckpointError(f"qkv_bias must be true or false, got {value!r}")
        return value
    return bool(cfg.get("attention_bias", False))


# The Qwen MoE families: experts of width `moe_intermediate_size`, the count in `num_experts`,
# and `intermediate_size` the width of dense MLP layers (refused: `_moe_fields`).
_QWEN_MOE = ("qwen3_moe", "qwen2_moe")


def _moe_fields(cfg: dict, model_type: str) -> dict:
    """ModelConfig's mixture-of-experts fields from a MoE family's config.json (none for dense ones)."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    qwen = model_type in _QWEN_MOE
    # The Qwen families write `num_experts` (transformers 5 saves Qwen3-MoE's as
    # `num_local_experts`, Mixtral's name).
    experts = cfg.get("num_experts") if qwen else None
    experts = cfg.get("num_local_experts") if experts is None else experts
    if experts is None:
        raise KeyError("num_experts" if qwen else "num_local_experts")
    top_k = cfg["num_experts_per_tok"]
    values = (("num_experts", experts), ("num_experts_per_tok", top_k))
    if qwen:
        values += (("moe_intermediate_size", cfg["moe_intermediate_size"]),)
    shared = cfg["shared_expert_intermediate_size"] if model_type == "qwen2_moe" else 0
    if model_type == "qwen2_moe":
        values += (("shared_expert_intermediate_size", shared),)
    for name, value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{name} must be a positive integer, got {value!r}")
    normalize = cfg.get("norm_topk_prob", False)
    if not isinstance(normalize, bool):
        raise CheckpointError(f"norm_topk_prob must be true or false, got {normalize!r}")
    if qwen:
        # Dense MLP layers between the MoE ones (`mlp_only_layers`, a `decoder_sparse_step`
        # above 1): every layer here has the one MLP form.
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            name = "Qwen3-MoE" if model_type == "qwen3_moe" else "Qwen2-MoE"
            raise CheckpointError(f"{name} with dense MLP layers (mlp_only_layers, decoder_sparse_step > 1) "
                                  "is not supported; every layer must be a MoE layer")
    return dict(num_experts=experts, experts_per_token=top_k,
                norm_topk_prob=True if model_type == "mixtral" else normalize,
                shared_expert_intermediate_size=shared)


def fp8_weight_block(quant) -> tuple[int, int] | None:
    """The block of an FP8 weight checkpoint's scales (one scale per [b_out, b_in] tile of a
    weight), or None where each weight has one scale, or one per output row.

    `quant` is config.json's `quantization_config`. Two schemes write 8-bit float (e4m3)
    weights with float scales beside them: `fp8` (transformers' fine-grained FP8, as in
    Qwen3-8B-FP8: `weight_block_size` and a `weight_scale_inv` per weight; without a block
    size, a `weight_scale` per weight) and `compressed-tensors` in its `float-quantized`
    format (a `weight_scale` per weight, for the `tensor`, `channel` or `block` strategy).
    The loader multiplies them out into the model's dtype (models/loader.py); the activation
    scheme does not matter then, since activations stay in that dtype. Anything else (int4/int8
    GPTQ, AWQ, bitsandbytes, e5m2 weights, ...) is refused with CheckpointError."""
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"

    def refuse(why: str):
        raise CheckpointError(f"quantized checkpoints are supported only with FP8 (e4m3) weights; this one "
                              f"(quantization_config: {method}) {why}; use an FP8 or the unquantized model")

    def block_of(value, key: str):
        if value is None:
            return None
        if (not isinstance(value, (list, tuple)) or len(value) != 2
                or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in value)):
            refuse(f"has {key}={value!r}, not two positive integers")
        return int(value[0]), int(value[1])

    if method == "fp8":
        if quant.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):
            refuse(f"stores its weights as {quant.get('fmt')!r}")
        return block_of(quant.get("weight_block_size"), "weight_block_size")
    if method == "compressed-tensors":
        if quant.get("format") != "float-quantized":
            refuse(f"has the format {quant.get('format')!r}, not 'float-quantized'")
        groups = quant.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            refuse("has no config_groups")
        blocks = set()
        for group in groups.values():
            weights = group.get("weights") if isinstance(group, dict) else None
            if not isinstance(weights, dict) or weights.get("type") != "float" or weights.get("num_bits") != 8:
                refuse(f"quantizes weights as {weights!r}, not 8-bit float")
            strategy = weights.get("strategy")
            if strategy not in ("tensor", "channel", "block"):
                refuse(f"uses the weight strategy {strategy!r}")
            if strategy == "block":
                blocks.add(block_of(weights.get("block_structure"), "block_structure"))
        if len(blocks) > 1:
            refuse(f"uses several weight block shapes {sorted(blocks)}")
        return blocks.pop() if blocks else None
    refuse("uses another scheme")


def _refuse_unsupported(cfg: dict) -> None:
    """config.json fields that change the model's math in ways this engine does not
    implement: refused at load rather than served wrong."""
    quant = cfg.get("quantization_config")
    if quant:
        fp8_weight_block(quant)  # FP8 weights load (dequantized); any other scheme is refused here
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"hidden_act {act!r} is not supported; the MLP is SwiGLU (silu)")
    layer_types = cfg.get("layer_types") or ()
    if cfg.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise CheckpointError("sliding-window attention (use_sliding_window / layer_types) is not supported; "
                              "every layer attends to the whole context")
