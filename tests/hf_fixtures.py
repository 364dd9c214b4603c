"""Tiny HF checkpoints for tests, written by transformers itself (CPU torch).

torch and transformers are imported inside the functions, so test modules that never
make a checkpoint do not pay for importing them.
"""
from __future__ import annotations

import os

import numpy as np

# One tiny config per supported family, each exercising that family's particular paths.
FAMILIES = {
    # qk-norm, explicit head_dim != hidden / heads, untied.
    "qwen3": dict(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    # GQA 4:1, llama3 rope scaling (the original context is short, so every band is hit), untied.
    "llama": dict(
        vocab_size=192, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    # qkv bias, tied embeddings.
    "qwen2": dict(
        vocab_size=144, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    # Llama's layer; an explicit head_dim != hidden / heads (as Mistral Nemo), and a sliding
    # window longer than the tests' contexts (within it, full attention is the window's).
    "mistral": dict(
        vocab_size=176, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=512,
        rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=96,
    ),
    # Mixture of experts: Qwen3's attention, 8 experts of width 48, 2 per token, unnormalized
    # top-k weights (Qwen3-MoE's default; the 30B-A3B checkpoint normalizes: norm_topk_prob).
    "qwen3_moe": dict(
        vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    # Mistral's attention, 4 experts of width 56, 2 per token (renormalized, as Mixtral always).
    "mixtral": dict(
        vocab_size=176, hidden_size=64, intermediate_size=56, num_local_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    # Qwen2's attention (qkv bias, transformers' default), 6 experts of width 40, 2 per token
    # (unnormalized, the default), and a shared expert of width 72 behind its sigmoid gate.
    # `intermediate_size` is that of dense layers, which this model has none of.
    "qwen2_moe": dict(
        vocab_size=152, hidden_size=64, intermediate_size=88, moe_intermediate_size=40,
        shared_expert_intermediate_size=72, num_experts=6, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
}


def tiny_hf_config(family: str, **overrides):
    import transformers

    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig,
           "qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig,
           "qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig,
           "qwen2_moe": transformers.Qwen2MoeConfig}[family]
    kwargs = {**FAMILIES[family], **overrides}
    return cls(**kwargs)


def peaked_init_(model, seed: int = 0) -> None:
    """Re-initialize `model` in place so its logits are far from ties.

    transformers' default init (std 0.02) makes a random model's logits nearly uniform,
    so greedy decoding would hinge on float rounding. Matrices get std 1/sqrt(fan_in),
    embeddings std 1 (logits then have std ~sqrt(hidden)), norm weights 1 + noise and
    biases noise, so that a mixed-up vector would change the output.

    Tied models are different: with a large shared embedding the residual stream stays
    close to the last token's own embedding, and greedy decoding repeats that token
    forever (a weak test). There the embedding is small (std 0.05) and the final norm
    weight large (~20), so the layers decide the next token and logits stay peaked.
    """
    import torch

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name == "model.norm.weight" and tied:
                p.copy_(20.0 * (1.0 + 0.1 * noise))
            elif name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name and tied:
                p.copy_(0.05 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name or name == "lm_head.weight":
                p.copy_(noise)
            else:  # nn.Linear [out, in] (a router's [E, in], a shared expert's gate [1, in]), experts' [E, out, in]
                p.copy_(noise / p.shape[-1] ** 0.5)


def make_hf_checkpoint(
    path: str,
    family: str,
    *,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    seed: int = 0,
    **overrides,
) -> str:
    """Write a random tiny `family` model to `path` with `save_pretrained`; return `path`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = tiny_hf_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    peaked_init_(model, seed)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, **kwargs)
    return path


def load_hf_model(path: str):
    """The checkpoint as a float32 transformers model with eager attention, in eval mode."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hf_logits(model, token_ids) -> np.ndarray:
    """Float32 logits [T, V] of one sequence."""
    import torch

    with torch.no_grad():
        return model(torch.as_tensor([list(token_ids)], dtype=torch.long)).logits[0].float().numpy()


def quantize_fp8_checkpoint(src: str, dst: str, scheme: str, block: tuple[int, int] = (48, 40)) -> dict:
    """Copy checkpoint `src` to `dst` with its linear layers' weights in FP8 (e4m3), as FP8
    checkpoints store them; returns {weight name: float32 dequantized weight} computed here
    with torch, which is what the loader must produce for each.

    scheme: "block" (transformers' fine-grained FP8: a `weight_scale_inv` per `block` tile;
    the default block does not divide the tiny shapes, so the last tiles overhang), "tensor"
    (`fp8` without a block: one `weight_scale`) or "channel" (compressed-tensors: a
    `weight_scale` per output row). Embeddings, norms, biases, routers and the LM head stay
    as they are, as in published FP8 checkpoints."""
    import json
    import re
    import shutil

    import safetensors.torch
    import torch

    shutil.copytree(src, dst)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    dequantized, weight_map = {}, {}
    for f in sorted(os.listdir(dst)):
        if not f.endswith(".safetensors"):
            continue
        path = os.path.join(dst, f)
        tensors = safetensors.torch.load_file(path)
        out = {}
        for name, w in tensors.items():
            # The linear layers: attention and MLP projections, experts (Mixtral's w1/w2/w3),
            # shared experts; not the routers, gates, fc (EAGLE), embedding or LM head.
            if not re.search(r"(_proj|\.w[123])\.weight$", name):
                out[name] = w
                continue
            w = w.float()
            rows, cols = w.shape
            if scheme == "block":
                bo, bi = block
                so, si = -(-rows // bo), -(-cols // bi)
                padded = torch.zeros(so * bo, si * bi)
                padded[:rows, :cols] = w
                amax = padded.reshape(so, bo, si, bi).abs().amax(dim=(1, 3))  # [so, si]
                scale = amax.clamp(min=1e-12) / fp8_max
                full = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:rows, :cols]  # [rows, cols]
                out[name + "_scale_inv"] = scale
            elif scheme == "tensor":
                scale = w.abs().amax().clamp(min=1e-12) / fp8_max  # []
                full = scale
                out[name + "_scale"] = scale
            else:  # channel
                scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / fp8_max  # [rows, 1]
                full = scale
                out[name + "_scale"] = scale
            q = (w / full).to(torch.float8_e4m3fn)
            out[name] = q
            dequantized[name] = (q.float() * full).numpy()
        safetensors.torch.save_file(out, path, metadata={"format": "pt"})
        weight_map.update({name: f for name in out})
    index = os.path.join(dst, "model.safetensors.index.json")
    if os.path.exists(index):  # a sharded checkpoint names the file of every tensor, scales too
        with open(index) as fh:
            meta = json.load(fh)
        meta["weight_map"] = weight_map
        with open(index, "w") as fh:
            json.dump(meta, fh)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    if scheme == "channel":
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}}}
    else:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         **({"weight_block_size": list(block)} if scheme == "block" else {})}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return dequantized
