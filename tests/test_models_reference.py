"""Loaded weights + our forward reproduce transformers, for every supported family.

Two forwards are checked against transformers' full-sequence logits: the engine's
`models.transformer.dense_logits`, and `_oracle_logits` below, a deliberately plain float64
numpy forward over `ModelParams` that validates the loader independently of the engine's
model code. A last test runs the engine end to end (greedy decoding through the paged KV
cache) against `transformers.generate`.
"""
from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

import hf_fixtures
from jaxoverlap.models.config import ModelConfig
from jaxoverlap.models.loader import default_model_path, load_params
from jaxoverlap.models.params import ModelParams

FAMILIES = ["qwen3", "llama", "qwen2", "mistral", "qwen3_moe", "mixtral", "qwen2_moe"]
REL_TOL = 1e-4


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _tokens(cfg: ModelConfig, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, size=n).astype(np.int32)


# ------------------------------------------------------------------ test oracle (not the engine)


def _oracle_logits(params: ModelParams, cfg: ModelConfig, token_ids) -> np.ndarray:
    """TEST ORACLE: a float64 numpy forward over ModelParams, written only to check the loader.

    Causal attention over the whole sequence, no cache, nothing shared with models/transformer.py
    except the config's RoPE frequencies (which test_loader checks against transformers).
    """
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    H, KVH, HD = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ids = np.asarray(token_ids)
    T = len(ids)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps) * w

    ang = np.arange(T)[:, None] * cfg.rope_inv_freq().astype(np.float64)[None, :]  # [T, HD/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]  # [T, 1, HD/2]

    def rope(x):  # x: [T, N, HD], rotating (first half, second half) pairs
        a, b = x[..., : HD // 2], x[..., HD // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    causal = np.tril(np.ones((T, T), bool))
    x = f64(params.embed)[ids]  # [T, D]
    for i, lw in enumerate(params.layers):
        h = norm(x, f64(params.attn_norm)[i])
        qkv = h @ f64(lw.wqkv)  # [T, (H + 2KVH) * HD]
        if params.bqkv is not None:
            qkv = qkv + f64(params.bqkv)[i]
        q = qkv[:, : H * HD].reshape(T, H, HD)
        k = qkv[:, H * HD : (H + KVH) * HD].reshape(T, KVH, HD)
        v = qkv[:, (H + KVH) * HD :].reshape(T, KVH, HD)
        if params.q_norm is not None:
            q, k = norm(q, f64(params.q_norm)[i]), norm(k, f64(params.k_norm)[i])
        q, k = rope(q), rope(k)
        k = np.repeat(k, H // KVH, axis=1)  # [T, H, HD]: query head h reads kv head h // (H / KVH)
        v = np.repeat(v, H // KVH, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(HD)  # [H, T, T]
        s = np.where(causal[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", p, v).reshape(T, H * HD)
        x = x + o @ f64(lw.wo)
        h = norm(x, f64(params.mlp_norm)[i])
        x = x + (_oracle_moe(h, lw, cfg) if lw.w_router is not None else _oracle_swiglu(h, lw.w_gate_up, lw.w_down))
    x = norm(x, f64(params.final_norm))
    head = f64(params.embed).T if params.lm_head is None else f64(params.lm_head)  # [D, V]
    return x @ head


def _oracle_swiglu(h, w_gate_up, w_down):
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    gate, up = np.split(h @ f64(w_gate_up), 2, axis=-1)
    return (gate / (1 + np.exp(-gate)) * up) @ f64(w_down)


def _oracle_moe(h, lw, cfg: ModelConfig):
    """Token by token: softmax over the router's logits, the top k, their SwiGLU outputs
    summed; plus the shared expert's SwiGLU output times the sigmoid of its gate, if any."""
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    logits = h @ f64(lw.w_router)  # [T, E]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        top = np.argsort(-probs[t], kind="stable")[: cfg.experts_per_token]
        weights = probs[t, top] / (probs[t, top].sum() if cfg.norm_topk_prob else 1.0)
        for e, w in zip(top, weights):
            out[t] += w * _oracle_swiglu(h[t], np.asarray(lw.w_gate_up[e]), np.asarray(lw.w_down[e]))
    if lw.w_shared_gate_up is not None:
        gate = 1 / (1 + np.exp(-(h @ f64(lw.w_shared_gate))))  # [T, 1]
        out += gate * _oracle_swiglu(h, lw.w_shared_gate_up, lw.w_shared_down)
    return out


# ------------------------------------------------------------------ forward vs transformers


def _engine_logits(params, cfg, ids):
    from jaxoverlap.models.transformer import dense_logits

    return np.asarray(dense_logits(params, cfg, jnp.asarray(ids)))


FORWARDS = {"oracle": _oracle_logits, "engine": _engine_logits}


@pytest.mark.parametrize("forward", list(FORWARDS))
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(hf_checkpoint, family, forward):
    path = hf_checkpoint(family)
    cfg = ModelConfig.from_path(path)
    params = load_params(path, cfg, jnp.float32)
    # Longer than llama's original_max_position_embeddings (64), so scaled bands matter.
    ids = _tokens(cfg, 80)
    ref = hf_fixtures.hf_logits(hf_fixtures.load_hf_model(path), ids)
    got = FORWARDS[forward](params, cfg, ids)
    assert got.shape == ref.shape == (len(ids), cfg.vocab_size)
    err = _rel_err(np.asarray(got, np.float64), ref.astype(np.float64))
    assert err <= REL_TOL, f"{family}/{forward}: relative error {err:.2e}"


def test_qwen2_moe_shared_expert_and_its_gate_matter(hf_checkpoint):
    """The qwen2_moe check above can fail: without the shared expert, or with its gate
    ignored (a constant 1/2), the logits are far from transformers'."""
    import dataclasses

    path = hf_checkpoint("qwen2_moe")
    cfg = ModelConfig.from_path(path)
    params = load_params(path, cfg, jnp.float32)
    ids = _tokens(cfg, 24)
    ref = hf_fixtures.hf_logits(hf_fixtures.load_hf_model(path), ids).astype(np.float64)
    assert _rel_err(_engine_logits(params, cfg, ids).astype(np.float64), ref) <= REL_TOL
    variants = {
        "no shared expert": lambda lw: dataclasses.replace(lw, w_shared_gate_up=None, w_shared_down=None,
                                                           w_shared_gate=None),
        "gate ignored": lambda lw: dataclasses.replace(lw, w_shared_gate=jnp.zeros_like(lw.w_shared_gate)),
    }
    for name, change in variants.items():
        changed = dataclasses.replace(params, layers=tuple(change(lw) for lw in params.layers))
        for forward in FORWARDS.values():
            err = _rel_err(np.asarray(forward(changed, cfg, ids), np.float64), ref)
            assert err > 100 * REL_TOL, f"{name}: relative error {err:.2e}"


def test_default_model_matches_transformers():
    """The shipped model (bf16 weights, loaded as float32) through the engine's forward."""
    path = default_model_path()
    cfg = ModelConfig.from_path(path)
    params = load_params(path, cfg, jnp.float32)
    ids = _tokens(cfg, 48, seed=1)
    ref = hf_fixtures.hf_logits(hf_fixtures.load_hf_model(path), ids)
    assert _rel_err(_engine_logits(params, cfg, ids).astype(np.float64), ref.astype(np.float64)) <= REL_TOL


# ------------------------------------------------------------------ engine end to end


def _hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    import torch

    model = hf_fixtures.load_hf_model(path)
    # No eos and no forced minimum length: every step is a plain argmax, like ignore_eos.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=0, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_continuation_matches_transformers(hf_checkpoint, family):
    try:
        from jaxoverlap import LLM, SamplingParams
    except ImportError:
        pytest.skip("jaxoverlap.LLM is not available yet")
    path = hf_checkpoint(family)
    cfg = ModelConfig.from_path(path)
    prompt = _tokens(cfg, 11, seed=2).tolist()
    expected = _hf_greedy(path, prompt, 32)
    llm = LLM(path, dtype="float32", max_context_len=min(256, cfg.attention_window or 256), kv_cache_tokens=1024,
              page_size=16)
    got = llm.generate([prompt], SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))[0].token_ids
    assert list(got) == expected


def test_default_model_files_exist():
    names = set(os.listdir(default_model_path()))
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= names
