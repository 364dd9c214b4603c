"""The EAGLE head: loading EAGLE-format checkpoints (checked against a NumPy version of
EAGLE's layer), and the engine's incremental head state (prefill with chunks and a cached
prefix, draft passes, draft extend) against a dense recomputation over the final text."""
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from engine_fixtures import VOCAB, run_workload, tiny_config, tiny_params
from jaxoverlap.models import eagle as eagle_models
from jaxoverlap.models.loader import CheckpointError
from jaxoverlap.models.transformer import forward
from jaxoverlap.sampling_params import SamplingParams
from jaxoverlap.speculative.eagle_head import head_forward, head_logits
from test_spec_engine import spec_engine

# -- a NumPy reference of EAGLE's head (HF names, [out, in] matrices) -----------------------


def _rms(x, w, eps=1e-6):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x, pos, theta):  # x [n, heads, hd], rotate-half as in HF Llama/Qwen
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = pos[:, None] * inv[None, :]  # [n, hd/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def eagle_reference(w, p, embed, tokens_next, hidden, heads, kv_heads, hd, theta):
    """EAGLE-1/2 head over n pairs (t_{i+1}, h_i): returns the layer output [n, D]."""
    n = len(tokens_next)
    x = np.concatenate([embed[tokens_next], hidden], axis=-1) @ w["fc.weight"].T + w["fc.bias"]
    q = (x @ w[p + "self_attn.q_proj.weight"].T).reshape(n, heads, hd)  # [n, H*HD] -> [n, H, HD]
    k = (x @ w[p + "self_attn.k_proj.weight"].T).reshape(n, kv_heads, hd)  # [n, KVH*HD] -> [n, KVH, HD]
    v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(n, kv_heads, hd)
    q, k = _rms(q, w[p + "self_attn.q_norm.weight"]), _rms(k, w[p + "self_attn.k_norm.weight"])
    pos = np.arange(n, dtype=np.float64)
    q, k = _rope(q, pos, theta), _rope(k, pos, theta)
    k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)  # [heads, n, n]
    s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("hqk,khd->qhd", a, v).reshape(n, heads * hd)  # [n, H*HD]
    x = x + o @ w[p + "self_attn.o_proj.weight"].T
    h = _rms(x, w[p + "post_attention_layernorm.weight"])
    g, u = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
    return x + ((g / (1 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T


def write_head(path, cfg, layer_prefix, seed=0, fc_in=2):
    rng = np.random.default_rng(seed)
    D, F, H, KVH, HD = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def m(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    p = layer_prefix
    w = {"fc.weight": m(D, fc_in * D), "fc.bias": m(D),
         p + "self_attn.q_proj.weight": m(H * HD, D), p + "self_attn.k_proj.weight": m(KVH * HD, D),
         p + "self_attn.v_proj.weight": m(KVH * HD, D), p + "self_attn.o_proj.weight": m(D, H * HD),
         p + "self_attn.q_norm.weight": 1 + m(HD), p + "self_attn.k_norm.weight": 1 + m(HD),
         p + "mlp.gate_proj.weight": m(F, D), p + "mlp.up_proj.weight": m(F, D), p + "mlp.down_proj.weight": m(D, F),
         p + "post_attention_layernorm.weight": 1 + m(D),
         p + "input_layernorm.weight": 1 + m(D)}  # present in EAGLE checkpoints, unused on layer 0
    save_file(w, str(path / "model.safetensors"))
    with open(path / "config.json", "w") as f:
        json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": 1,
                   "hidden_size": D, "num_attention_heads": H, "num_key_value_heads": KVH, "head_dim": HD,
                   "intermediate_size": F, "rope_theta": cfg.rope_theta, "rms_norm_eps": 1e-6}, f)
    return w


@functools.partial(jax.jit, static_argnames=("hcfg", "n"))
def dense_head(hp, hcfg, target, tokens_next, feats, n):
    """The head over columns 0 .. n-1 with a throwaway cache (column c in slot c + 1).
    tokens_next [N], feats [N, D] padded to a fixed N so this compiles once."""
    N = tokens_next.shape[0]
    cache = jnp.zeros((1, N + 1, hcfg.num_kv_heads, hcfg.head_dim), feats.dtype)
    cols = jnp.arange(N)[None, :]
    table = jnp.arange(1, N + 1, dtype=jnp.int32)[None, :]  # [1, N]
    out, _, _ = head_forward(hp, hcfg, target, cache, cache, table, tokens_next[None], feats[None], cols, cols < n,
                             jnp.array([n]), ctx_len=N, attention=_attention())
    return out[0]


def _attention():
    from jaxoverlap.models.transformer import xla_paged_attention

    return xla_paged_attention


@pytest.mark.parametrize("layer_prefix", ["layers.0.", "midlayer."])
def test_load_eagle_checkpoint_matches_numpy_reference(tmp_path, layer_prefix):
    cfg = tiny_config()
    w = write_head(tmp_path, cfg, layer_prefix)
    hcfg, hp = eagle_models.load_eagle_head(str(tmp_path), cfg, jnp.float32)
    assert hcfg.num_layers == 1 and hcfg.qk_norm and not hcfg.qkv_bias
    target = tiny_params(cfg)
    rng = np.random.default_rng(1)
    n, N = 9, 16
    toks = rng.integers(0, VOCAB, N).astype(np.int32)
    feats = rng.standard_normal((N, cfg.hidden_size)).astype(np.float32)
    got = np.asarray(dense_head(hp, hcfg, target, jnp.asarray(toks), jnp.asarray(feats), n))[:n]
    want = eagle_reference(w, layer_prefix, np.asarray(target.embed), toks[:n], feats[:n], cfg.num_heads,
                           cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_fp8_eagle_head_loads_as_its_dequantized_weights(tmp_path):
    """An EAGLE head saved in FP8 (block scales beside its projections) loads as the head
    holding the weights those scales multiply out to; its scale tensors are not taken for
    tensors the head would drop."""
    from hf_fixtures import quantize_fp8_checkpoint

    cfg = tiny_config()
    (tmp_path / "src").mkdir()
    w = write_head(tmp_path / "src", cfg, "layers.0.")
    dequantized = quantize_fp8_checkpoint(str(tmp_path / "src"), str(tmp_path / "fp8"), "block", block=(16, 16))
    assert len(dequantized) == 7  # q, k, v, o, gate, up, down
    (tmp_path / "plain").mkdir()
    write_head(tmp_path / "plain", cfg, "layers.0.")
    save_file({**w, **dequantized}, str(tmp_path / "plain" / "model.safetensors"))
    _, fp8 = eagle_models.load_eagle_head(str(tmp_path / "fp8"), cfg, jnp.float32)
    _, plain = eagle_models.load_eagle_head(str(tmp_path / "plain"), cfg, jnp.float32)
    _, original = eagle_models.load_eagle_head(str(tmp_path / "src"), cfg, jnp.float32)
    for a, b in zip(jax.tree.leaves(fp8), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(fp8.layer.wqkv), np.asarray(original.layer.wqkv))


def test_eagle3_heads_are_rejected_clearly(tmp_path):
    cfg = tiny_config()
    write_head(tmp_path, cfg, "midlayer.", fc_in=3)
    with pytest.raises(CheckpointError, match="EAGLE-3"):
        eagle_models.load_eagle_head(str(tmp_path), cfg, jnp.float32)


def test_malformed_eagle_heads_are_refused_at_load(tmp_path):
    """A head for another width, a tensor of the wrong shape, one missing, or one the head
    would drop (a second layer, an o_proj bias): a CheckpointError naming it, at load."""
    from safetensors.numpy import load_file

    cfg = tiny_config()
    D = cfg.hidden_size
    (tmp_path / "wide").mkdir()
    write_head(tmp_path / "wide", dataclasses.replace(cfg, hidden_size=2 * D), "midlayer.")
    with pytest.raises(CheckpointError, match=f"hidden size {2 * D}, and this target's is {D}"):
        eagle_models.load_eagle_head(str(tmp_path / "wide"), cfg, jnp.float32)
    cases = {
        "o_proj": lambda w: w.update({"midlayer.self_attn.o_proj.weight": w["midlayer.self_attn.o_proj.weight"][:, :8]}),
        "missing": lambda w: w.pop("midlayer.mlp.gate_proj.weight"),
        "embed": lambda w: w.update({"embed_tokens.weight": np.zeros((50, D), np.float32)}),
        "layer 1": lambda w: w.update({"layers.1.mlp.down_proj.weight": w["midlayer.mlp.down_proj.weight"]}),
        "bias": lambda w: w.update({"midlayer.self_attn.o_proj.bias": np.zeros((D,), np.float32)}),
    }
    matches = {"o_proj": r"o_proj.weight .* has shape", "missing": "has no midlayer.mlp.gate_proj.weight",
               "embed": r"embed_tokens.weight .* has shape \[50", "layer 1": "does not use",
               "bias": "does not use"}
    for name, change in cases.items():
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        write_head(folder, cfg, "midlayer.")
        weights = load_file(str(folder / "model.safetensors"))
        change(weights)
        save_file(weights, str(folder / "model.safetensors"))
        with pytest.raises(CheckpointError, match=matches[name]):
            eagle_models.load_eagle_head(str(folder), cfg, jnp.float32)


def test_speculative_paths_must_match_the_algorithm(tmp_path):
    """SGLang names an EAGLE head with --speculative-draft-model-path: taken as the head. A
    path another algorithm would ignore is refused."""
    from jaxoverlap.config import EngineConfig

    cfg = EngineConfig(speculative_algorithm="eagle", speculative_draft_model_path="/heads/h")
    assert cfg.speculative_eagle_head_path == "/heads/h" and cfg.speculative_draft_model_path is None
    for bad in (dict(speculative_draft_model_path="/m"), dict(speculative_eagle_head_path="/h"),
                dict(speculative_algorithm="draft_model", speculative_draft_model_path="/m",
                     speculative_eagle_head_path="/h"),
                dict(speculative_algorithm="ngram", speculative_draft_model_path="/m"),
                dict(speculative_algorithm="ngram", speculative_ngram_max_match_window_size=1000)):
        with pytest.raises(ValueError):
            EngineConfig(**bad)


# -- the engine's head state against a dense recomputation ----------------------------------


@functools.partial(jax.jit, static_argnames=("cfg",))
def dense_hidden(params, cfg, tokens, n):
    """Target hidden states [N, D] of tokens[:n] (padded to N), with a throwaway cache."""
    N = tokens.shape[0]
    cache = jnp.zeros((cfg.num_layers, N + 1, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    table = jnp.stack([jnp.zeros((N,), jnp.int32), jnp.arange(1, N + 1, dtype=jnp.int32)])
    pos = jnp.arange(N, dtype=jnp.int32)[None]
    h, _, _ = forward(params, cfg, cache, cache, table, tokens=tokens[None], positions=pos,
                      entries=jnp.array([1], jnp.int32), q_valid=pos < n, kv_lens=jnp.array([n]), ctx_len=N)
    return h[0]


def test_engine_head_state_matches_dense_recomputation():
    """Chunked prefill, a prompt whose first pages come from the prefix cache, retraction-free
    greedy decoding: before every speculative step, the relay's draft token and head state
    equal the dense head's at column L-1, and the step's k drafts equal the dense chain."""
    eng = spec_engine("eagle", disable_overlap=True)
    cfg, hcfg, hp, target = eng.model_config, eng.drafter.spec.draft_cfg, eng.drafter.params, eng.runner.params
    k = eng.drafter.spec.num_draft
    rng = np.random.default_rng(3)
    prompt_a = [int(t) for t in rng.integers(0, VOCAB, 30)]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    run_workload(eng, {0: [("a", prompt_a, greedy)]})
    prompt_b = prompt_a[:26] + [int(t) for t in rng.integers(0, VOCAB, 5)]

    seen = []
    real_launch = eng.runner.launch

    def spy(batch):
        rows = [r for r in batch.rows if r.req.request_id == "b"]
        before = None
        if batch.kind == "decode" and rows:
            e, relay = rows[0].req.entry, eng.runner.state.relay
            before = (int(relay.seq_lens[e]), int(relay.draft_token[e]), np.asarray(relay.draft_hidden[e]))
        launched = real_launch(batch)
        if before is not None:
            seen.append(before + (np.asarray(launched.out.drafts[batch.rows.index(rows[0])]),))
        return launched

    eng.runner.launch = spy
    out = run_workload(eng, {0: [("b", prompt_b, greedy)]})["b"]
    assert out.metrics.cached_prompt_tokens >= 24  # the first chunk started after cached pages
    seq = prompt_b + out.token_ids
    N = 64
    toks = jnp.asarray(seq + [0] * (N - len(seq)), jnp.int32)
    H = dense_hidden(target, cfg, toks, len(seq))  # [N, D]
    nxt = jnp.concatenate([toks[1:], jnp.zeros((1,), jnp.int32)])  # column i pairs h_i with t_{i+1}
    assert len(seen) >= 3
    for L, d1, g, drafts in seen:
        ref = dense_head(hp, hcfg, target, nxt, H, L)
        np.testing.assert_allclose(g, np.asarray(ref[L - 1]), rtol=1e-4, atol=1e-4)
        assert d1 == int(jnp.argmax(head_logits(hp, target, ref[L - 1])))
        # The draft passes: column L-1+j pairs the previous column's output with d_j.
        chain_tok, chain_feat, d, g_prev = nxt, H, d1, ref[L - 1]
        for j in range(1, k):
            chain_tok = chain_tok.at[L - 1 + j].set(d)
            chain_feat = chain_feat.at[L - 1 + j].set(g_prev)
            g_prev = dense_head(hp, hcfg, target, chain_tok, chain_feat, L + j)[L - 1 + j]
            d = int(jnp.argmax(head_logits(hp, target, g_prev)))
            assert drafts[j] == d, (L, j)
        assert drafts[0] == d1
