"""models/loader.py: safetensors -> ModelParams mapping, dummy weights, orbax cache, errors."""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxoverlap.models import loader
from jaxoverlap.models.config import ModelConfig
from jaxoverlap.models.loader import CheckpointError, default_model_path, load_params
from jaxoverlap.models.params import ModelParams

FAMILIES = ["qwen3", "llama", "qwen2", "mistral", "qwen3_moe", "mixtral", "qwen2_moe"]


def _state_dict(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint as float32 numpy, read through torch (independent of the loader)."""
    import safetensors.torch

    out = {}
    for f in loader.safetensors_files(path):
        for name, t in safetensors.torch.load_file(f).items():
            out[name] = t.float().numpy()
    return out


def _expected(sd: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """What each ModelParams leaf must equal, written out field by field from the HF names."""
    L = cfg.num_layers
    lay = lambda i, n: sd[f"model.layers.{i}.{n}"]  # noqa: E731
    exp = {
        "embed": sd["model.embed_tokens.weight"],
        "final_norm": sd["model.norm.weight"],
        "attn_norm": np.stack([lay(i, "input_layernorm.weight") for i in range(L)]),
        "mlp_norm": np.stack([lay(i, "post_attention_layernorm.weight") for i in range(L)]),
    }
    for i in range(L):
        exp[f"layers.{i}.wqkv"] = np.concatenate([lay(i, f"self_attn.{x}_proj.weight").T for x in "qkv"], axis=1)
        exp[f"layers.{i}.wo"] = lay(i, "self_attn.o_proj.weight").T
        if cfg.model_type == "mixtral":
            expert = lambda i, e, n: lay(i, f"block_sparse_moe.experts.{e}.{n}.weight")  # noqa: E731
            gate, up, down, router = "w1", "w3", "w2", "block_sparse_moe.gate.weight"
        else:
            expert = lambda i, e, n: lay(i, f"mlp.experts.{e}.{n}.weight")  # noqa: E731
            gate, up, down, router = "gate_proj", "up_proj", "down_proj", "mlp.gate.weight"
        if cfg.is_moe:  # [E, D, 2F], [E, F, D], [D, E]
            E = cfg.num_experts
            exp[f"layers.{i}.w_gate_up"] = np.stack([
                np.concatenate([expert(i, e, gate).T, expert(i, e, up).T], axis=1) for e in range(E)])
            exp[f"layers.{i}.w_down"] = np.stack([expert(i, e, down).T for e in range(E)])
            exp[f"layers.{i}.w_router"] = lay(i, router).T
        else:
            exp[f"layers.{i}.w_gate_up"] = np.concatenate(
                [lay(i, "mlp.gate_proj.weight").T, lay(i, "mlp.up_proj.weight").T], axis=1)
            exp[f"layers.{i}.w_down"] = lay(i, "mlp.down_proj.weight").T
        if cfg.shared_expert_intermediate_size:  # [D, 2Fs], [Fs, D], [D, 1]
            shared = lambda i, n: lay(i, f"mlp.shared_expert.{n}.weight")  # noqa: E731
            exp[f"layers.{i}.w_shared_gate_up"] = np.concatenate(
                [shared(i, "gate_proj").T, shared(i, "up_proj").T], axis=1)
            exp[f"layers.{i}.w_shared_down"] = shared(i, "down_proj").T
            exp[f"layers.{i}.w_shared_gate"] = lay(i, "mlp.shared_expert_gate.weight").T
    if not cfg.tie_word_embeddings:
        exp["lm_head"] = sd["lm_head.weight"].T
    if cfg.qk_norm:
        exp["q_norm"] = np.stack([lay(i, "self_attn.q_norm.weight") for i in range(L)])
        exp["k_norm"] = np.stack([lay(i, "self_attn.k_norm.weight") for i in range(L)])
    if cfg.qkv_bias:
        exp["bqkv"] = np.stack([np.concatenate([lay(i, f"self_attn.{x}_proj.bias") for x in "qkv"])
                                for i in range(L)])
    return exp


def _flat(params: ModelParams) -> dict[str, np.ndarray]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        key = jax.tree_util.keystr(path, simple=True, separator=".")
        out[key] = np.asarray(leaf.astype(jnp.float32))
    return out


def _assert_params_match(params: ModelParams, path: str, cfg: ModelConfig, *, exact: bool = True):
    got, exp = _flat(params), _expected(_state_dict(path), cfg)
    assert sorted(got) == sorted(exp)
    for k in exp:
        assert got[k].shape == exp[k].shape, k
        if exact:
            np.testing.assert_array_equal(got[k], exp[k], err_msg=k)
        else:
            np.testing.assert_allclose(got[k], exp[k], rtol=1e-2, atol=1e-2, err_msg=k)


@pytest.mark.parametrize("family", FAMILIES)
def test_single_file_float32(hf_checkpoint, family):
    path = hf_checkpoint(family)
    assert os.path.exists(os.path.join(path, "model.safetensors"))
    cfg = ModelConfig.from_path(path)
    params = load_params(path, cfg, jnp.float32)
    _assert_params_match(params, path, cfg)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
    # Family flags select the optional leaves.
    assert (params.q_norm is not None) == (family in ("qwen3", "qwen3_moe"))
    assert (params.bqkv is not None) == (family in ("qwen2", "qwen2_moe"))
    assert (params.layers[0].w_shared_gate is not None) == (family == "qwen2_moe")
    assert (params.lm_head is None) == (family == "qwen2")  # the qwen2 fixture is tied


def test_sharded_checkpoint(hf_checkpoint):
    path = hf_checkpoint("qwen3", max_shard_size="40KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    assert len(loader.safetensors_files(path)) > 2
    cfg = ModelConfig.from_path(path)
    params = load_params(path, cfg, "float32")
    _assert_params_match(params, path, cfg)
    single = load_params(hf_checkpoint("qwen3"), cfg, "float32")  # same seed, so same weights
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(single)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_bfloat16_checkpoint(hf_checkpoint, family):
    import safetensors.torch
    import torch

    path = hf_checkpoint(family, dtype="bfloat16", max_shard_size="40KB")
    cfg = ModelConfig.from_path(path)
    bf = load_params(path, cfg, jnp.bfloat16)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(bf))
    # Bit-exact: compare the raw 16-bit patterns of the embedding with torch's.
    emb = None
    for f in loader.safetensors_files(path):
        tensors = safetensors.torch.load_file(f)
        if "model.embed_tokens.weight" in tensors:
            emb = tensors["model.embed_tokens.weight"]
    assert emb.dtype == torch.bfloat16
    np.testing.assert_array_equal(np.asarray(bf.embed).view(np.uint16), emb.view(torch.int16).numpy().view(np.uint16))
    # Upcasting to float32 is exact too.
    f32 = load_params(path, cfg, jnp.float32)
    _assert_params_match(f32, path, cfg)


def test_tied_checkpoint_has_no_lm_head(hf_checkpoint):
    path = hf_checkpoint("qwen2")
    assert "lm_head.weight" not in _state_dict(path)
    cfg = ModelConfig.from_path(path)
    assert cfg.tie_word_embeddings and cfg.qkv_bias
    assert load_params(path, cfg, jnp.float32).lm_head is None


def test_untied_config_without_lm_head_is_an_error(hf_checkpoint, tmp_path):
    path = str(tmp_path / "m")
    shutil.copytree(hf_checkpoint("qwen2"), path)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["tie_word_embeddings"] = False
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    with pytest.raises(CheckpointError, match="lm_head"):
        load_params(path, ModelConfig.from_path(path), jnp.float32)


@pytest.mark.parametrize("family,name", [("qwen3", "model.layers.1.mlp.up_proj.weight"),
                                         ("qwen3_moe", "model.layers.0.mlp.experts.7.down_proj.weight"),
                                         ("qwen2_moe", "model.layers.1.mlp.shared_expert.up_proj.weight"),
                                         ("qwen2_moe", "model.layers.0.mlp.shared_expert_gate.weight")])
def test_missing_tensor_is_an_error(hf_checkpoint, tmp_path, family, name):
    from safetensors.numpy import save_file

    src = hf_checkpoint(family)
    path = str(tmp_path / "m")
    os.makedirs(path)
    shutil.copy(os.path.join(src, "config.json"), path)
    sd = _state_dict(src)
    del sd[name]
    save_file(sd, os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load_params(path, ModelConfig.from_path(path), jnp.float32)


def test_shape_mismatch_is_an_error(hf_checkpoint):
    path = hf_checkpoint("llama")
    cfg = ModelConfig.from_path(path)
    wrong = dataclasses.replace(cfg, intermediate_size=cfg.intermediate_size + 8)
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight.*shape"):
        load_params(path, wrong, jnp.float32)


def test_base_model_names_without_prefix(hf_checkpoint, tmp_path):
    """A bare decoder save (no "model." prefix) loads the same, given a tied config."""
    from safetensors.numpy import save_file

    src = hf_checkpoint("qwen2")
    path = str(tmp_path / "m")
    os.makedirs(path)
    shutil.copy(os.path.join(src, "config.json"), path)
    sd = {k.removeprefix("model."): v for k, v in _state_dict(src).items()}
    save_file(sd, os.path.join(path, "model.safetensors"))
    cfg = ModelConfig.from_path(path)
    a, b = load_params(path, cfg, jnp.float32), load_params(src, cfg, jnp.float32)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_no_weights_and_bad_format(tmp_path, hf_checkpoint):
    path = str(tmp_path / "m")
    os.makedirs(path)
    shutil.copy(os.path.join(hf_checkpoint("qwen3"), "config.json"), path)
    cfg = ModelConfig.from_path(path)
    with pytest.raises(FileNotFoundError, match="dummy"):
        load_params(path, cfg, jnp.float32)
    with pytest.raises(ValueError, match="load_format"):
        load_params(path, cfg, jnp.float32, load_format="pt")


def test_malformed_checkpoint_files_are_named(tmp_path):
    """A config that is not JSON or lacks a key, an index without its weight map, a tokenizer
    config that is not JSON: a CheckpointError that names the file and what is wrong."""
    from jaxoverlap.models.tokenizer import Tokenizer

    def copy(name):
        path = tmp_path / name
        shutil.copytree(default_model_path(), path)
        return path

    bad = copy("bad_json")
    (bad / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        ModelConfig.from_path(str(bad))
    lacking = copy("lacking")
    config = json.loads((lacking / "config.json").read_text())
    del config["intermediate_size"]
    (lacking / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json: the model config lacks 'intermediate_size'"):
        ModelConfig.from_path(str(lacking))
    index = copy("index")
    (index / "model.safetensors").rename(index / "model-00001-of-00001.safetensors")
    (index / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="index.json has no weight_map"):
        loader.safetensors_files(str(index))
    tok = copy("tok")
    (tok / "tokenizer_config.json").write_text("")
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json is not valid JSON"):
        Tokenizer.from_path(str(tok))
    # Files the libraries cannot read, or JSON of the wrong kind: named, as CheckpointErrors
    # (ValueErrors, which the CLI prints in one line), not the libraries' own exceptions.
    (tok / "tokenizer_config.json").write_text("[]")
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json must hold a JSON object, got list"):
        Tokenizer.from_path(str(tok))
    gen = copy("gen")
    (gen / "generation_config.json").write_text("[1]")
    for read in (ModelConfig.from_path, Tokenizer.from_path):
        with pytest.raises(CheckpointError, match=r"generation_config\.json must hold a JSON object"):
            read(str(gen))
    tok_json = copy("tok_json")
    (tok_json / "tokenizer.json").write_text('{"version": 1}')
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is not a tokenizer"):
        Tokenizer.from_path(str(tok_json))
    truncated = copy("truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable safetensors file"):
        loader.SafetensorsReader(loader.safetensors_files(str(truncated)))
    from jaxoverlap.cli import main
    with pytest.raises(SystemExit, match=r"error: .*model\.safetensors is not a readable") as e:
        main(["generate", "hi", "--model", str(truncated)])
    assert "\n" not in str(e.value.code)


def test_configs_that_change_the_math_are_refused_at_load():
    """What the engine does not implement is refused when the config is read, rather than
    loaded and served with other math (or refused only at the first forward)."""
    base = json.loads(open(os.path.join(default_model_path(), "config.json")).read())
    assert ModelConfig.from_hf_dict(base).rope_scaling is None
    refused = {
        "quantized": ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "only with FP8 .*gptq"),
        "gelu": ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
        "sliding": ({"use_sliding_window": True, "sliding_window": 8}, "sliding-window"),
        "layer types": ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window"),
        "yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling type 'yarn'"),
        "linear": ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}, "'linear'"),
    }
    refused["heads"] = ({"num_attention_heads": 6, "num_key_value_heads": 4}, "multiple of num_kv_heads")
    for name, (change, match) in refused.items():
        with pytest.raises(CheckpointError, match=match):
            ModelConfig.from_hf_dict({**base, **change})
    # What transformers saves for these models loads: explicit silu, full attention everywhere,
    # a window that is off, and a null KV head count (as many as the query heads).
    fine = ModelConfig.from_hf_dict({**base, "hidden_act": "silu", "use_sliding_window": False, "sliding_window": 8,
                                     "layer_types": ["full_attention"] * base["num_hidden_layers"],
                                     "num_key_value_heads": None})
    assert fine.num_kv_heads == fine.num_heads


def test_a_sliding_window_bounds_the_served_context(hf_checkpoint):
    """Mistral's sliding window: within it full attention is the window's, so the engine
    serves contexts up to it (by default) and refuses a longer max_context_len."""
    from engine_fixtures import make_engine

    cfg = ModelConfig.from_path(hf_checkpoint("mistral"))
    assert cfg.model_type == "mistral" and cfg.attention_window == 96 and cfg.head_dim == 24
    base = json.loads(open(os.path.join(default_model_path(), "config.json")).read())
    assert ModelConfig.from_hf_dict({**base, "model_type": "mistral", "sliding_window": None}).attention_window is None
    # Qwen2's sliding_window is off unless use_sliding_window (refused above).
    assert ModelConfig.from_hf_dict({**base, "model_type": "qwen2", "sliding_window": 8}).attention_window is None
    for bad in (1, 4.5, True, "4096"):
        with pytest.raises(CheckpointError, match="sliding_window"):
            ModelConfig.from_hf_dict({**base, "model_type": "mistral", "sliding_window": bad})
    tiny = ModelConfig.from_hf_dict({**base, "model_type": "mistral", "sliding_window": 40})
    assert make_engine(cfg=tiny, max_context_len=None).max_context_len == 40
    assert make_engine(cfg=tiny, max_context_len=40).max_context_len == 40
    with pytest.raises(ValueError, match="sliding window"):
        make_engine(cfg=tiny, max_context_len=41)
    # Without a window, a context past max_position_embeddings is served, with a warning.
    long = dataclasses.replace(tiny, model_type="qwen3", attention_window=None, max_position_embeddings=40)
    assert make_engine(cfg=long, max_context_len=48).max_context_len == 48


def test_eos_ids_of_generation_config_without_a_tokenizer(tmp_path):
    """A checkpoint without tokenizer.json stops on generation_config.json's EOS ids too, as
    transformers' generate() does."""
    path = tmp_path / "no_tokenizer"
    shutil.copytree(default_model_path(), path)
    (path / "tokenizer.json").unlink()
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = 2
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert ModelConfig.from_path(str(path)).eos_token_ids == (7, 2)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "7"}))
    with pytest.raises(CheckpointError, match="generation_config.json: eos_token_id"):
        ModelConfig.from_path(str(path))


def test_llama3_rope_scaling_config(hf_checkpoint):
    """config.json written by transformers (rope_parameters) parses to llama3 scaling whose
    inverse frequencies equal the ones transformers computes."""
    import torch
    import transformers

    path = hf_checkpoint("llama")
    cfg = ModelConfig.from_path(path)
    scaling = dict(cfg.rope_scaling)
    assert scaling["rope_type"] == "llama3"
    assert scaling["factor"] == 8.0 and scaling["original_max_position_embeddings"] == 64
    assert cfg.rope_theta == 500000.0
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (8, 2, 8)
    hf_cfg = transformers.AutoConfig.from_pretrained(path)
    rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_cfg)
    ref = rope.inv_freq.to(torch.float64).numpy()
    np.testing.assert_allclose(cfg.rope_inv_freq(), ref, rtol=1e-6)
    # The scaling really does something at this theta and original length.
    plain = dataclasses.replace(cfg, rope_scaling=None).rope_inv_freq()
    assert not np.allclose(plain, ref)


# ---------------------------------------------------------------------------- dummy


@pytest.mark.parametrize("family", FAMILIES)
def test_dummy_matches_checkpoint_layout(hf_checkpoint, family):
    path = hf_checkpoint(family)
    cfg = ModelConfig.from_path(path)
    real = load_params(path, cfg, jnp.float32)
    dummy = load_params(path, cfg, jnp.float32, load_format="dummy", seed=3)
    assert jax.tree.structure(real) == jax.tree.structure(dummy)
    for a, b in zip(jax.tree.leaves(real), jax.tree.leaves(dummy)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
    abstract = loader.abstract_params(cfg, jnp.float32)
    assert jax.tree.structure(abstract) == jax.tree.structure(real)


def test_dummy_is_deterministic_and_peaked(tmp_path, hf_checkpoint):
    from jaxoverlap.models.transformer import dense_logits

    # Dummy needs no weight files at all: only config.json.
    path = str(tmp_path / "cfg-only")
    os.makedirs(path)
    shutil.copy(os.path.join(hf_checkpoint("qwen3"), "config.json"), path)
    cfg = ModelConfig.from_path(path)
    a = load_params(path, cfg, jnp.float32, load_format="dummy", seed=7)
    b = load_params(path, cfg, jnp.float32, load_format="dummy", seed=7)
    c = load_params(path, cfg, jnp.float32, load_format="dummy", seed=8)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(a.layers[0].wqkv), np.asarray(c.layers[0].wqkv))
    assert not np.array_equal(np.asarray(a.layers[0].wqkv), np.asarray(a.layers[1].wqkv))
    # bf16 dummies are the rounding of the f32 ones.
    bf = load_params(path, cfg, jnp.bfloat16, load_format="dummy", seed=7)
    np.testing.assert_array_equal(np.asarray(bf.layers[1].w_down), np.asarray(a.layers[1].w_down.astype(jnp.bfloat16)))
    # Scales: unit embedding, 1/sqrt(fan_in) matrices, unit norms.
    assert 0.9 < float(jnp.std(a.embed)) < 1.1
    assert abs(float(jnp.std(a.layers[0].w_down)) * cfg.intermediate_size ** 0.5 - 1) < 0.1
    np.testing.assert_array_equal(np.asarray(a.attn_norm), 1.0)
    # Peaked logits: the best token clearly beats the runner-up at every position.
    logits = np.asarray(dense_logits(a, cfg, jnp.arange(16, dtype=jnp.int32) * 5 % cfg.vocab_size))
    top2 = np.sort(logits, axis=-1)[:, -2:]
    assert np.all(np.isfinite(logits))
    assert np.median(top2[:, 1] - top2[:, 0]) > 0.5


# ---------------------------------------------------------------------------- orbax cache


def _cached_checkpoint(hf_checkpoint, tmp_path):
    """A copy of the qwen2 test checkpoint loaded once through an orbax cache: (its path, the
    cache folder, its config, the weights, the cache entry)."""
    path = str(tmp_path / "m")
    shutil.copytree(hf_checkpoint("qwen2"), path)
    cache = str(tmp_path / "cache")
    cfg = ModelConfig.from_path(path)
    first = load_params(path, cfg, jnp.float32, cache_dir=cache)
    return path, cache, cfg, first, loader.cache_path(cache, path, jnp.float32)


def test_orbax_cache_round_trip(hf_checkpoint, tmp_path, monkeypatch):
    path, cache, cfg, first, entry = _cached_checkpoint(hf_checkpoint, tmp_path)
    assert os.path.isdir(entry)

    # A second load must restore from orbax, not convert.
    def no_convert(*a, **k):
        raise AssertionError("converted again instead of restoring the cache")

    monkeypatch.setattr(loader, "_load_safetensors", no_convert)
    second = load_params(path, cfg, jnp.float32, cache_dir=cache)
    assert jax.tree.structure(first) == jax.tree.structure(second)
    assert second.lm_head is None and second.bqkv is not None
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # Another dtype, or touched weights, is a different cache entry.
    assert loader.cache_path(cache, path, jnp.bfloat16) != entry
    st = os.stat(os.path.join(path, "model.safetensors"))
    os.utime(os.path.join(path, "model.safetensors"), ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert loader.cache_path(cache, path, jnp.float32) != entry
    monkeypatch.undo()
    third = load_params(path, cfg, jnp.float32, cache_dir=cache)
    np.testing.assert_array_equal(np.asarray(third.embed), np.asarray(first.embed))
    assert os.path.isdir(loader.cache_path(cache, path, jnp.float32))


def test_weights_replaced_with_their_size_and_mtime_miss_the_cache(hf_checkpoint, tmp_path):
    """Other weights of the same shapes copied in with the old file's mtime (cp -p, rsync -a,
    tar): the cache key samples the file's content, so the new weights are loaded."""
    path, cache, cfg, first, entry = _cached_checkpoint(hf_checkpoint, tmp_path)
    weights = os.path.join(path, "model.safetensors")
    st = os.stat(weights)
    shutil.copy(os.path.join(hf_checkpoint("qwen2", seed=1), "model.safetensors"), weights)
    assert os.path.getsize(weights) == st.st_size
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert loader.cache_path(cache, path, jnp.float32) != entry
    again = load_params(path, cfg, jnp.float32, cache_dir=cache)
    fresh = load_params(path, cfg, jnp.float32)
    assert not np.array_equal(np.asarray(again.embed), np.asarray(first.embed))
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_cache_folder_that_takes_no_file_is_skipped(hf_checkpoint, tmp_path, monkeypatch, caplog):
    """A weights_cache_dir that cannot be written (a read-only mount) costs a warning, not
    orbax's background save waiting 300 s for its folder at exit."""
    path = str(tmp_path / "m")
    shutil.copytree(hf_checkpoint("qwen2"), path)
    cfg = ModelConfig.from_path(path)

    def refuse(*a, **k):
        raise OSError(30, "Read-only file system")

    def no_save(*a, **k):
        raise AssertionError("orbax asked to save into a folder that takes no file")

    monkeypatch.setattr(loader.tempfile, "TemporaryFile", refuse)
    monkeypatch.setattr(loader, "_save_cached", no_save)
    with caplog.at_level("WARNING", logger=loader.__name__):
        params = load_params(path, cfg, jnp.float32, cache_dir=str(tmp_path / "cache"))
    assert "could not write weights cache" in caplog.text and "Read-only" in caplog.text
    np.testing.assert_array_equal(np.asarray(params.embed), np.asarray(load_params(path, cfg, jnp.float32).embed))


# orbax leaves the coroutines of the failed restore to the collector, which reports their
# error as unraisable: collected below, and where some outlive that, ignored in any later
# test by their name (pyproject.toml's filterwarnings).
def test_a_broken_cache_entry_is_replaced(hf_checkpoint, tmp_path, monkeypatch):
    """An entry whose data was cut short (disk full, a killed copy) is converted again once
    and saved afresh, not converted again on every later load."""
    path, cache, cfg, first, entry = _cached_checkpoint(hf_checkpoint, tmp_path)
    data = [os.path.join(d, n) for d, _, names in os.walk(entry) for n in names if os.path.basename(d) == "d"]
    biggest = max(data, key=os.path.getsize)
    with open(biggest, "r+b") as f:
        f.truncate(os.path.getsize(biggest) // 2)

    converted = []
    convert = loader._load_safetensors
    monkeypatch.setattr(loader, "_load_safetensors", lambda *a, **k: converted.append(1) or convert(*a, **k))
    for _ in range(2):
        params = load_params(path, cfg, jnp.float32, cache_dir=cache)
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert converted == [1]  # the second load restored the rewritten entry
    gc.collect()


# ---------------------------------------------------------------------------- default model


def test_default_model_loads():
    from jaxoverlap.models.tokenizer import Tokenizer

    path = default_model_path()
    cfg = ModelConfig.from_path(path)
    assert cfg.model_type == "qwen3" and cfg.tie_word_embeddings
    params = load_params(path, cfg, jnp.float32)
    assert params.embed.shape == (cfg.vocab_size, cfg.hidden_size)
    tok = Tokenizer.from_path(path)
    assert tok.vocab_size == cfg.vocab_size
    assert cfg.eos_token_ids and set(cfg.eos_token_ids) <= set(tok.eos_token_ids)
    total = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    assert total < 5_000_000


# --------------------------------------------------------------------------------------
# FP8 checkpoints: weights in e4m3 with scales, multiplied out at load
# --------------------------------------------------------------------------------------

def test_fp8_quantization_configs():
    """Which quantization_config loads (FP8 weights with float scales) and the scale tile it
    gives the loader; every other scheme is refused when the config is read."""
    from jaxoverlap.models.config import fp8_weight_block

    fine_grained = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}
    assert fp8_weight_block(fine_grained) == (128, 128)
    assert fp8_weight_block({"quant_method": "fp8", "activation_scheme": "static"}) is None

    def compressed(**weights):
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", **weights}}}}

    assert fp8_weight_block(compressed(strategy="channel")) is None
    assert fp8_weight_block(compressed(strategy="tensor")) is None
    assert fp8_weight_block(compressed(strategy="block", block_structure=[64, 32])) == (64, 32)
    refused = {
        "e5m2 weights": {"quant_method": "fp8", "fmt": "e5m2"},
        "a block that is not two sizes": {"quant_method": "fp8", "weight_block_size": [128]},
        "a zero block": {"quant_method": "fp8", "weight_block_size": [0, 128]},
        "4-bit float weights": compressed(strategy="channel", num_bits=4),
        "int weights": {**compressed(strategy="channel"), "config_groups": {"g": {"weights": {"num_bits": 8,
                                                                                           "type": "int"}}}},
        "group strategy": compressed(strategy="group", group_size=128),
        "packed format": {**compressed(strategy="channel"), "format": "pack-quantized"},
        "awq": {"quant_method": "awq", "bits": 4},
        "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
        "not an object": "fp8",
    }
    for why, quant in refused.items():
        with pytest.raises(CheckpointError, match="only with FP8"):
            fp8_weight_block(quant)
            raise AssertionError(why)
    base = json.loads(open(os.path.join(default_model_path(), "config.json")).read())
    assert ModelConfig.from_hf_dict({**base, "quantization_config": fine_grained}) == ModelConfig.from_hf_dict(base)


@pytest.mark.parametrize("family,scheme", [("qwen3", "block"), ("qwen3_moe", "block"), ("llama", "channel"),
                                           ("mixtral", "tensor"), ("qwen2_moe", "channel")])
def test_fp8_checkpoint_loads_dequantized(hf_checkpoint, tmp_path, caplog, family, scheme):
    """An FP8 checkpoint (e4m3 weights beside their scales) loads as the weights its scales
    multiply out to, exactly as torch computes them: per block of a tile that does not
    divide the shapes (so the last tiles overhang), per tensor and per output row; dense
    and expert weights. Tensors kept unquantized (embedding, norms, biases, router, LM head)
    load as they are, and the scale tensors draw no 'unexpected tensors' warning."""
    from hf_fixtures import quantize_fp8_checkpoint

    src = hf_checkpoint(family)
    dst = str(tmp_path / "fp8")
    dequantized = quantize_fp8_checkpoint(src, dst, scheme)
    assert dequantized and all(np.abs(w).max() > 0 for w in dequantized.values())
    sd = {**_state_dict(src), **dequantized}
    cfg = ModelConfig.from_path(dst)
    assert cfg == ModelConfig.from_path(src)
    with caplog.at_level("WARNING", logger=loader.logger.name):
        params = load_params(dst, cfg, jnp.float32)
    assert "unexpected" not in caplog.text
    got, exp = _flat(params), _expected(sd, cfg)
    assert sorted(got) == sorted(exp)
    for k in exp:
        np.testing.assert_array_equal(got[k], exp[k], err_msg=k)
    # The 8-bit weights are not the originals: the loader did multiply the scales out.
    original = _expected(_state_dict(src), cfg)
    assert not np.array_equal(got["layers.0.wo"], original["layers.0.wo"])
    np.testing.assert_allclose(got["layers.0.wo"], original["layers.0.wo"], rtol=0.07, atol=1e-3)


def test_fp8_checkpoint_errors(hf_checkpoint, tmp_path):
    """An FP8 weight without its scale, or with a scale of a shape that covers it in none of
    the known ways, is a CheckpointError naming the tensor."""
    import safetensors.torch
    import torch
    from hf_fixtures import quantize_fp8_checkpoint

    dst = str(tmp_path / "fp8")
    quantize_fp8_checkpoint(hf_checkpoint("qwen3"), dst, "block")
    cfg = ModelConfig.from_path(dst)
    file = os.path.join(dst, "model.safetensors")
    tensors = safetensors.torch.load_file(file)
    name = "model.layers.1.self_attn.o_proj.weight"
    scale = tensors.pop(name + "_scale_inv")
    safetensors.torch.save_file(tensors, file)
    with pytest.raises(CheckpointError, match=re.escape(f"FP8 tensor {name!r} has no scale")):
        load_params(dst, cfg, jnp.float32)
    tensors[name + "_scale_inv"] = torch.ones(scale.shape[0] + 1, scale.shape[1])
    safetensors.torch.save_file(tensors, file)
    with pytest.raises(CheckpointError, match=re.escape(f"the scale of FP8 weight {name!r}")):
        load_params(dst, cfg, jnp.float32)


def test_fp8_checkpoint_generates_as_its_dequantized_weights(tmp_path):
    """End to end through the LLM API: the default model saved as a fine-grained FP8
    checkpoint generates the tokens of a float32 checkpoint holding the weights its scales
    multiply out to."""
    import safetensors.torch
    import torch
    from hf_fixtures import quantize_fp8_checkpoint

    from jaxoverlap import LLM, SamplingParams

    fp8 = str(tmp_path / "fp8")
    dequantized = quantize_fp8_checkpoint(default_model_path(), fp8, "block", block=(32, 32))
    plain = str(tmp_path / "plain")
    shutil.copytree(default_model_path(), plain)
    file = os.path.join(plain, "model.safetensors")
    tensors = {k: v.float() for k, v in safetensors.torch.load_file(file).items()}
    tensors.update({k: torch.from_numpy(v) for k, v in dequantized.items()})
    safetensors.torch.save_file(tensors, file)
    prompts = ["Once upon a time", "The capital of", "1, 2, 3,"]
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outs = {}
    for name, path in (("fp8", fp8), ("plain", plain)):
        with LLM(path, dtype="float32", max_running_requests=4, max_context_len=64, kv_cache_tokens=512,
                 page_size=8) as llm:
            outs[name] = [r.token_ids for r in llm.generate(prompts, greedy)]
    assert outs["fp8"] == outs["plain"]
