"""EAGLE-style draft head: weights, config, loading of EAGLE-format checkpoints, random init.

The head is one decoder layer over fc([token embedding ; target hidden state]) that reuses
the target's embedding and LM head (EAGLE-1/2 layout, also used by MTP-style heads):

    x = fc(concat(embed(t_{i+1}), h_i))        # [.., 2D] -> [.., D]
    x = x + attn(x)                            # no input norm: EAGLE skips it on its layer 0
    x = x + mlp(post_attention_norm(x))
    logits = lm_head(final_norm?(x))           # the prediction of t_{i+2}

Checkpoints: a folder with `model.safetensors` (or any `*.safetensors`) holding `fc.weight`
[D, 2D] (optionally `fc.bias`) and one layer named `layers.0.*` or `midlayer.*` (optionally
under `model.`), with HF Llama/Qwen tensor names inside the layer (q/k/v/o_proj, gate/up/
down_proj, post_attention_layernorm, Qwen2 q/k/v biases, Qwen3 q_norm/k_norm). Optional
`norm.weight`, `embed_tokens.weight` and `lm_head.weight` replace the identity / the
target's. EAGLE-3 heads (fc over three hidden states, a reduced draft vocabulary) are
rejected with an error: they need hidden states from three target layers.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxoverlap.models.config import ModelConfig, read_json
from jaxoverlap.models.loader import (
    CheckpointError,
    SafetensorsReader,
    _checkpoint_fp8_block,
    _dummy_layer,
    _dummy_matrix,
    _read_part,
    _to_param,
    safetensors_files,
    scale_owner,
)
from jaxoverlap.models.params import LayerParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EagleParams:
    fc: jax.Array  # [2D, D]: rows [:D] take the token embedding, rows [D:] the target hidden state
    layer: LayerParams
    mlp_norm: jax.Array  # [D] post_attention_layernorm
    fc_bias: jax.Array | None = None  # [D]
    q_norm: jax.Array | None = None  # [HD] (Qwen3-style heads)
    k_norm: jax.Array | None = None  # [HD]
    bqkv: jax.Array | None = None  # [(H + 2 * KVH) * HD] (Qwen2-style heads)
    final_norm: jax.Array | None = None  # [D]; None: the layer output goes straight to the LM head
    embed: jax.Array | None = None  # [V, D]; None: the target's embedding
    lm_head: jax.Array | None = None  # [D, V]; None: the target's LM head


def head_config(target: ModelConfig, overrides: dict | None = None) -> ModelConfig:
    """The head's one-layer ModelConfig: the target's shapes unless `overrides` (HF names,
    from the head's config.json or read off its tensors) say otherwise."""
    o = overrides or {}
    num_heads = o.get("num_attention_heads", target.num_heads)
    head_dim = o.get("head_dim")
    if head_dim is None and "hidden_size" in o and "num_attention_heads" in o:
        head_dim = o["hidden_size"] // num_heads  # HF configs without head_dim
    return dataclasses.replace(
        target,
        num_layers=1,
        num_heads=num_heads,
        num_kv_heads=o.get("num_key_value_heads", target.num_kv_heads),
        head_dim=head_dim or target.head_dim,
        intermediate_size=o.get("intermediate_size", target.intermediate_size),
        rms_norm_eps=o.get("rms_norm_eps", target.rms_norm_eps),
        rope_theta=float(o.get("rope_theta", target.rope_theta)),
        qkv_bias=o.get("qkv_bias", target.qkv_bias),
        qk_norm=o.get("qk_norm", target.qk_norm),
        # The head's layer has a dense MLP, also for a mixture-of-experts target.
        num_experts=0, experts_per_token=0, norm_topk_prob=False,
    )


def dummy_eagle_params(cfg: ModelConfig, dtype, seed: int = 0) -> EagleParams:
    """A random head for `cfg` (from head_config): for tests and benchmarks."""
    dtype = jnp.dtype(dtype)
    D = cfg.hidden_size
    k_fc, k_layer = jax.random.split(jax.random.key(seed + 7919))
    return EagleParams(
        fc=_dummy_matrix(k_fc, shape=(2 * D, D), std=(2 * D) ** -0.5, dtype=dtype),
        layer=_dummy_layer(k_layer, cfg, dtype),
        mlp_norm=jnp.ones((D,), dtype),
        q_norm=jnp.ones((cfg.head_dim,), dtype) if cfg.qk_norm else None,
        k_norm=jnp.ones((cfg.head_dim,), dtype) if cfg.qk_norm else None,
        bqkv=jnp.zeros((cfg.q_size + 2 * cfg.kv_size,), dtype) if cfg.qkv_bias else None,
    )


def _layer_prefix(reader: SafetensorsReader) -> str:
    for name in reader.names():
        if name.endswith("self_attn.q_proj.weight"):
            return name[: -len("self_attn.q_proj.weight")]
    raise CheckpointError("no decoder layer in the EAGLE head (expected layers.0.* or midlayer.* tensors)")


def _top_prefix(reader: SafetensorsReader) -> str:
    return "model." if "model.fc.weight" in reader else ""


def _check_head_tensors(reader: SafetensorsReader, path: str, top: str, lp: str, cfg: ModelConfig,
                        target: ModelConfig) -> None:
    """Every tensor the head's config implies, in its shape, and nothing the head would drop:
    a CheckpointError naming the first that is not, rather than a failing first step."""
    D, H, KVH, HD, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    if not KVH or H % KVH:
        raise CheckpointError(f"EAGLE head {path!r}: {H} query heads do not share {KVH} KV heads evenly")
    want = {lp + "self_attn.q_proj.weight": (H * HD, D), lp + "self_attn.k_proj.weight": (KVH * HD, D),
            lp + "self_attn.v_proj.weight": (KVH * HD, D), lp + "self_attn.o_proj.weight": (D, H * HD),
            lp + "mlp.gate_proj.weight": (F, D), lp + "mlp.up_proj.weight": (F, D), lp + "mlp.down_proj.weight": (D, F),
            lp + "post_attention_layernorm.weight": (D,)}
    optional = {top + "fc.bias": (D,), top + "norm.weight": (D,), top + "embed_tokens.weight": (target.vocab_size, D),
                lp + "self_attn.q_norm.weight": (HD,), lp + "self_attn.k_norm.weight": (HD,),
                lp + "self_attn.q_proj.bias": (H * HD,), lp + "self_attn.k_proj.bias": (KVH * HD,),
                lp + "self_attn.v_proj.bias": (KVH * HD,),
                lp + "input_layernorm.weight": (D,)}  # in EAGLE checkpoints, and unused on layer 0 by design
    for name, shape in {**want, **optional}.items():
        if name in reader and reader.shape(name) != shape:
            raise CheckpointError(f"{name} of EAGLE head {path!r} has shape {list(reader.shape(name))}, "
                                  f"expected {list(shape)}")
    known = set(want) | set(optional) | {top + "fc.weight", top + "lm_head.weight", "lm_head.weight"}
    unknown = sorted(n for n in reader.names() if n not in known and scale_owner(n) not in known)
    if unknown:  # a second layer, o_proj / down_proj biases: the head would run without them
        raise CheckpointError(f"EAGLE head {path!r} holds tensors a one-layer EAGLE-1/2 head does not use: "
                              f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}")


def load_eagle_head(path: str, target: ModelConfig, dtype) -> tuple[ModelConfig, EagleParams]:
    """Read an EAGLE-format head folder; returns (head config, params) on the default device."""
    dtype = jnp.dtype(dtype)
    reader = SafetensorsReader(safetensors_files(path))
    top, lp = _top_prefix(reader), _layer_prefix(reader)
    if top + "fc.weight" not in reader:
        raise CheckpointError(f"EAGLE head {path!r} has no fc.weight")
    D = target.hidden_size
    fc_shape = reader.shape(top + "fc.weight")
    if fc_shape == (D, 3 * D) or (fc_shape[0] == D and reader.shape(lp + "self_attn.q_proj.weight")[1] == 2 * D):
        raise CheckpointError(
            f"EAGLE head {path!r} looks like an EAGLE-3 head (fc {list(fc_shape)}): only EAGLE-1/2-style heads "
            "(fc over [embedding ; last hidden state], one layer of width D) are supported"
        )
    if fc_shape != (D, 2 * D):
        raise CheckpointError(f"fc.weight of {path!r} has shape {list(fc_shape)}: a head of hidden size "
                              f"{fc_shape[0]}, and this target's is {D} (expected {[D, 2 * D]})")
    for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm"):
        if lp + part + ".weight" not in reader:
            raise CheckpointError(f"EAGLE head {path!r} has no {lp + part}.weight")
    overrides = {}
    cfg_file = os.path.join(path, "config.json")
    if os.path.exists(cfg_file):
        hf = read_json(cfg_file)
        if hf.get("hidden_size") and hf["hidden_size"] != D:
            raise CheckpointError(f"{cfg_file}: hidden_size {hf['hidden_size']}, and this target's is {D}")
        overrides.update({k: hf[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                                               "intermediate_size", "rms_norm_eps", "rope_theta") if hf.get(k)})
    overrides["intermediate_size"] = reader.shape(lp + "mlp.gate_proj.weight")[0]
    overrides["qkv_bias"] = lp + "self_attn.q_proj.bias" in reader
    overrides["qk_norm"] = lp + "self_attn.q_norm.weight" in reader
    cfg = head_config(target, overrides)
    q_out, kv_out = reader.shape(lp + "self_attn.q_proj.weight")[0], reader.shape(lp + "self_attn.k_proj.weight")[0]
    if q_out % cfg.head_dim or kv_out % cfg.head_dim:
        raise CheckpointError(f"q/k projections of {path!r} ({q_out}, {kv_out}) do not fit head_dim {cfg.head_dim}")
    cfg = dataclasses.replace(cfg, num_heads=q_out // cfg.head_dim, num_kv_heads=kv_out // cfg.head_dim)
    _check_head_tensors(reader, path, top, lp, cfg, target)

    fp8_block = _checkpoint_fp8_block(path)  # an FP8 head's weights are multiplied out as a model's

    def matrix(*names: str, transpose: bool = True) -> jax.Array:
        parts = tuple(_read_part(reader, n, None, transpose, fp8_block, dtype) for n in names)
        return _to_param(parts, transpose=transpose, dtype=dtype)

    def optional(name: str, transpose: bool = False):
        return matrix(name, transpose=transpose) if name in reader else None

    bqkv = None
    if cfg.qkv_bias:
        bias = np.concatenate([reader.get(lp + f"self_attn.{x}_proj.bias") for x in "qkv"])  # [(H + 2KVH) * HD]
        bqkv = _to_param((jax.device_put(bias),), transpose=False, dtype=dtype)
    lm_name = next((n for n in (top + "lm_head.weight", "lm_head.weight") if n in reader), None)
    lm_head = matrix(lm_name) if lm_name else None  # [D, V]
    if lm_head is not None and lm_head.shape != (D, target.vocab_size):
        raise CheckpointError(f"lm_head of {path!r} has a vocabulary of {lm_head.shape[1]}, the target {target.vocab_size}")
    params = EagleParams(
        fc=matrix(top + "fc.weight"),  # [2D, D]
        fc_bias=optional(top + "fc.bias"),
        layer=LayerParams(
            wqkv=matrix(*(lp + f"self_attn.{x}_proj.weight" for x in "qkv")),  # [D, (H + 2KVH) * HD]
            wo=matrix(lp + "self_attn.o_proj.weight"),  # [H * HD, D]
            w_gate_up=matrix(lp + "mlp.gate_proj.weight", lp + "mlp.up_proj.weight"),  # [D, 2F]
            w_down=matrix(lp + "mlp.down_proj.weight"),  # [F, D]
        ),
        mlp_norm=matrix(lp + "post_attention_layernorm.weight", transpose=False),
        q_norm=optional(lp + "self_attn.q_norm.weight"),
        k_norm=optional(lp + "self_attn.k_norm.weight"),
        bqkv=bqkv,
        final_norm=optional(top + "norm.weight"),
        embed=optional(top + "embed_tokens.weight"),
        lm_head=lm_head,
    )
    return cfg, params
