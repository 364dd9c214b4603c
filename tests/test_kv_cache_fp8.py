"""EngineConfig.kv_cache_dtype: the KV cache in 8 bits (e4m3 or e5m2), with per-layer scales
where the checkpoint has them.

What must hold: every write rounds K/V to the cache's dtype (saturating), every attention
path (the XLA reference, the Pallas decode, prefill and fused decode kernels) computes over
exactly those rounded values in the queries' dtype, and the engine's machinery (paging,
overlap, speculative verification, tensor parallelism) serves the same greedy tokens as a
dense forward over an 8-bit cache.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from engine_fixtures import make_engine, run_workload, tiny_config, tiny_params
from jaxoverlap.config import EngineConfig
from jaxoverlap.device_state import kv_cache_bytes_per_token
from jaxoverlap.models.transformer import dense_logits
from jaxoverlap.pallas_kernels.decode import paged_decode_attention
from jaxoverlap.pallas_kernels.fused_decode import fused_decode_attention, rope_frequencies
from jaxoverlap.pallas_kernels.prefill import paged_prefill_attention
from jaxoverlap.pallas_kernels.reference import paged_attention_ref, to_cache_dtype
from jaxoverlap.pallas_kernels.testing import make_paged_batch
from jaxoverlap.sampling_params import SamplingParams

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


@pytest.mark.parametrize("dtype,largest", [(E4M3, 448.0), (E5M2, 57344.0)])
def test_writes_round_to_nearest_and_saturate(dtype, largest):
    """In range: numpy's (ml_dtypes') round-to-nearest. Past the largest finite value:
    that value with its sign, where a plain convert gives NaN (e4m3fn) or inf (e5m2)."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(200) * 3, [largest * 2, -largest * 10, 1e-4, 0.0]]).astype(np.float32)
    got = np.asarray(to_cache_dtype(jnp.asarray(x), dtype))
    assert got.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(got[:200].astype(np.float32), x[:200].astype(dtype).astype(np.float32))
    assert got[200].astype(np.float32) == largest and got[201].astype(np.float32) == -largest
    plain = np.asarray(jnp.asarray(x[200:201]).astype(dtype)).astype(np.float32)
    assert not np.isfinite(plain).all()  # what the saturation prevents
    # A 16-bit cache is a plain cast (no clipping of its far larger range).
    assert float(to_cache_dtype(jnp.asarray([1000.0]), jnp.bfloat16)[0]) == 1000.0


def _fp8_batch(**kw):
    """A paged batch whose caches hold e4m3 values, plus the same values in float32."""
    b = make_paged_batch(**kw)
    k8, v8 = to_cache_dtype(b.k_cache, E4M3), to_cache_dtype(b.v_cache, E4M3)
    return b, (k8, v8), (k8.astype(jnp.float32), v8.astype(jnp.float32))


def test_reference_reads_an_8bit_cache_as_its_values():
    b, (k8, v8), (k32, v32) = _fp8_batch(kv_lens=[9, 30, 3], num_q=2, num_heads=8, num_kv_heads=2, head_dim=16,
                                         page_size=4, padded_rows=1)
    rest = (b.layer, b.req_to_token, b.entries, b.q_positions, b.kv_lens)
    got = paged_attention_ref(b.q, k8, v8, *rest, scale=0.25, ctx_len=b.ctx_len)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(paged_attention_ref(b.q, k32, v32, *rest, scale=0.25, ctx_len=b.ctx_len)))
    # The rounding is there: the full-precision cache's attention differs, by little.
    full = np.asarray(paged_attention_ref(*b.args(), scale=0.25, ctx_len=b.ctx_len))
    diff = np.abs(np.asarray(got) - full).max()
    assert 1e-3 < diff < 0.2


@pytest.mark.parametrize("kernel,num_q,q_dtype,splits", [
    ("decode", 1, jnp.float32, None),
    ("decode", 1, jnp.float32, 3),  # split-K partials
    ("decode", 4, jnp.float32, None),  # a speculative window
    ("decode", 1, jnp.bfloat16, None),
    ("prefill", 7, jnp.float32, None),
])
def test_kernels_on_an_8bit_cache_match_the_reference(kernel, num_q, q_dtype, splits):
    """The interpreted Pallas kernels cast each 8-bit K/V block up to the queries' dtype:
    the reference's result over the same cache."""
    b, (k8, v8), _ = _fp8_batch(kv_lens=[21, 40, 6], num_q=num_q, num_heads=8, num_kv_heads=2, head_dim=16,
                                page_size=4, padded_rows=1, dtype=q_dtype)
    rest = (b.layer, b.req_to_token, b.entries, b.q_positions, b.kv_lens)
    want = paged_attention_ref(b.q, k8, v8, *rest, scale=0.25, ctx_len=b.ctx_len)
    if kernel == "decode":
        got = paged_decode_attention(b.q, k8, v8, *rest, scale=0.25, ctx_len=b.ctx_len, interpret=True,
                                     block_k=16, num_splits=splits)
    else:
        got = paged_prefill_attention(b.q, k8, v8, *rest, scale=0.25, ctx_len=b.ctx_len, interpret=True,
                                      block_rows=16, block_k=16)
    assert got.dtype == q_dtype
    tol = 2e-5 if q_dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


def test_fused_decode_writes_rounded_kv_and_attends_over_it():
    """The fused kernel stores the new token's k/v rounded (saturated) into the 8-bit cache,
    bit for bit as models/transformer.write_cache stores them, and its output is the
    unfused path's over that cache, the new token's own term included."""
    from jaxoverlap.models.transformer import apply_rope, rms_norm, split_qkv, write_cache

    H, KVH, HD, eps = 8, 2, 32, 1e-6
    b = make_paged_batch(kv_lens=[5, 26, 1], num_q=1, num_heads=H, num_kv_heads=KVH, head_dim=HD, page_size=4,
                         padded_rows=1)
    k8, v8 = to_cache_dtype(b.k_cache, E4M3), to_cache_dtype(b.v_cache, E4M3)
    rng = np.random.default_rng(3)
    R = 4
    qkv = rng.standard_normal((R, (H + 2 * KVH) * HD)).astype(np.float32)
    qkv[1, (H + KVH) * HD:] *= 1000.0  # row 1's v is past e4m3's range: it saturates
    qkv = jnp.asarray(qkv)
    pos = np.asarray(b.q_positions)[:, 0]
    real = np.asarray(b.kv_lens) > 0
    slots = jnp.asarray(np.where(real, np.asarray(b.req_to_token)[np.asarray(b.entries), pos], 0), jnp.int32)
    L = k8.shape[0]
    qn = jnp.asarray(1 + 0.3 * rng.standard_normal((L, HD)), jnp.float32)
    kn = jnp.asarray(1 + 0.3 * rng.standard_normal((L, HD)), jnp.float32)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, HD, 2, dtype=np.float32) / HD))
    pos = jnp.asarray(pos)

    # The unfused path, as models/transformer.forward runs it.
    q, k, v = split_qkv(qkv[:, None], H, KVH, HD, 1)  # [R, 1, H | KVH, HD]
    q = apply_rope(rms_norm(q, qn[b.layer], eps), pos[:, None], inv_freq)
    k = apply_rope(rms_norm(k, kn[b.layer], eps), pos[:, None], inv_freq)
    valid = jnp.asarray(real)
    want_k = write_cache(k8, b.layer, slots, valid, k.reshape(R, KVH, HD))
    want_v = write_cache(v8, b.layer, slots, valid, v.reshape(R, KVH, HD))
    want_o = paged_attention_ref(q, want_k, want_v, b.layer, b.req_to_token, b.entries, pos[:, None], b.kv_lens,
                                 scale=HD ** -0.5, ctx_len=b.ctx_len)[:, 0]

    got_o, got_k, got_v = fused_decode_attention(
        qkv, jnp.array(k8), jnp.array(v8), b.layer, b.req_to_token, b.entries, pos, b.kv_lens, slots, qn, kn,
        rope_frequencies(inv_freq), num_heads=H, num_kv_heads=KVH, eps=eps, scale=HD ** -0.5, ctx_len=b.ctx_len,
        interpret=True)
    assert got_k.dtype == E4M3 and got_v.dtype == E4M3
    # Every slot but the dummy one (padded rows write slot 0 there), compared as bytes.
    as_bytes = lambda a: np.asarray(a).view(np.uint8)[:, 4:]  # noqa: E731  (page 0 = slots 0..3)
    np.testing.assert_array_equal(as_bytes(got_k), as_bytes(want_k))
    np.testing.assert_array_equal(as_bytes(got_v), as_bytes(want_v))
    row1 = np.asarray(got_v)[b.layer, int(slots[1])].astype(np.float32)
    assert np.isfinite(row1).all() and np.abs(row1).max() == 448.0
    np.testing.assert_allclose(np.asarray(got_o), np.asarray(want_o), atol=1e-4, rtol=1e-4)


G = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
ARRIVALS = {0: [("a", [1, 2, 3, 4, 5], G), ("b", [7, 8, 9], G)], 3: [("c", list(range(10, 40)), G)]}


def _tokens(engine, arrivals=ARRIVALS, finals=None):
    out = run_workload(engine, arrivals)
    if finals is not None:
        finals.update(out)
    return {k: v.token_ids for k, v in out.items()}


def test_engine_serves_the_dense_forward_of_an_8bit_cache():
    """Greedy tokens of the fp8 engine are the argmax of a dense forward whose cache is
    e4m3 (teacher-forced on the generated sequence), and the same through the XLA path,
    both Pallas decode paths and speculative decoding (EAGLE). The drafter's own
    cache stays in the model's dtype."""
    cfg = tiny_config()
    fp8 = make_engine(cfg, kv_cache_dtype="fp8")
    assert fp8.runner.state.k_cache.dtype == E4M3 and fp8.runner.state.v_cache.dtype == E4M3
    got = _tokens(fp8)
    params = tiny_params(cfg)
    for rid, prompt, _ in ARRIVALS[0] + ARRIVALS[3]:
        seq = jnp.asarray(prompt + got[rid], jnp.int32)
        logits = np.asarray(dense_logits(params, cfg, seq, cache_dtype=E4M3))
        # The token after position p is the argmax of p's logits, for every generated token.
        np.testing.assert_array_equal(np.argmax(logits[len(prompt) - 1:-1], axis=-1), got[rid])
    # The rounding changes the logits (so the comparison above could fail on a bf16 cache).
    seq = jnp.asarray(ARRIVALS[3][0][1], jnp.int32)
    eight, full = dense_logits(params, cfg, seq, cache_dtype=E4M3), dense_logits(params, cfg, seq)
    diff = np.abs(np.asarray(eight) - np.asarray(full))
    assert diff.max() > 1e-4

    for options in (dict(attention_backend="pallas"), dict(attention_backend="pallas", disable_fused_decode=True)):
        assert _tokens(make_engine(cfg, kv_cache_dtype="fp8", **options)) == got, options
    eagle = make_engine(cfg, kv_cache_dtype="fp8", speculative_algorithm="eagle")
    assert eagle.runner.state.draft_k_cache.dtype == jnp.float32  # the model's dtype
    assert _tokens(eagle) == got


def test_e5m2_cache_and_the_prefix_cache():
    """e5m2 is served too; a second request that hits the prefix cache reads the rounded
    K/V the first one left there and continues as a fresh engine would."""
    cfg = tiny_config()
    prompt = list(range(3, 27))
    first = {0: [("x", prompt, G)]}
    again = {0: [("x", prompt, G)], 30: [("y", prompt + [5, 6], G)]}
    eng = make_engine(cfg, kv_cache_dtype="fp8_e5m2")
    assert eng.runner.state.k_cache.dtype == E5M2
    finals = {}
    out = _tokens(eng, again, finals)
    assert finals["y"].metrics.cached_prompt_tokens >= 16
    cold = make_engine(cfg, kv_cache_dtype="fp8_e5m2", disable_prefix_cache=True)
    assert _tokens(cold, again) == out
    assert _tokens(make_engine(cfg, kv_cache_dtype="fp8_e5m2"), first)["x"] == out["x"]


def test_an_8bit_cache_holds_twice_the_tokens(monkeypatch):
    """Sized from device memory, the same free bytes hold twice the tokens in 8 bits as in
    16 (and four times as in float32)."""
    from jaxoverlap import engine as engine_module

    assert kv_cache_bytes_per_token(4, 8, 128, E4M3) * 2 == kv_cache_bytes_per_token(4, 8, 128, jnp.bfloat16)
    monkeypatch.setattr(engine_module, "_memory_stats", lambda device: {"bytes_limit": 64 << 20, "bytes_in_use": 0})
    cfg = tiny_config()
    sized = {name: make_engine(cfg, kv_cache_tokens=None, kv_cache_dtype=name, enable_penalties=False)
             for name in ("auto", "fp8")}
    full, eight = sized["auto"].kv_cache_tokens, sized["fp8"].kv_cache_tokens
    assert abs(eight / full - 4.0) < 0.01, (full, eight)  # a float32 engine: 4 bytes -> 1
    state = sized["fp8"].runner.state
    assert state.k_cache.nbytes == state.k_cache.size


def test_kv_cache_dtype_option_and_flag():
    assert EngineConfig(kv_cache_dtype="FP8").kv_cache_dtype == "fp8"
    assert EngineConfig(kv_cache_dtype="fp8_e5m2").kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be a string"):
        EngineConfig(kv_cache_dtype=None)
    import argparse

    from jaxoverlap.cli import add_engine_args, engine_options

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_options(p.parse_args(["--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "fp4"])



# -- per-layer scales (a checkpoint's calibrated k_scale / v_scale) ---------------------------


def test_scales_hold_what_scale_one_would_saturate():
    """A cache scale divides what is stored and multiplies back what attention reads: keys
    far past e4m3's 448 come back within its rounding (2^-4) where scale 1 saturates them,
    and attention with q * k_scale and output * v_scale over the stored values is attention
    over the dequantized cache."""
    x = jnp.asarray(np.linspace(-3000.0, 3000.0, 101), jnp.float32)
    back = np.asarray(to_cache_dtype(x, E4M3, 8.0)).astype(np.float32) * 8.0
    np.testing.assert_allclose(back, np.asarray(x), rtol=2.0 ** -4, atol=1e-6)
    assert np.abs(np.asarray(to_cache_dtype(x, E4M3)).astype(np.float32)).max() == 448.0

    b = make_paged_batch(kv_lens=[13, 27], num_q=2, num_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
    ks, vs = 0.37, 2.5
    k8, v8 = to_cache_dtype(b.k_cache * 100, E4M3, ks), to_cache_dtype(b.v_cache, E4M3, vs)
    rest = (b.layer, b.req_to_token, b.entries, b.q_positions, b.kv_lens)
    got = paged_attention_ref(b.q * ks, k8, v8, *rest, scale=0.01, ctx_len=b.ctx_len) * vs
    want = paged_attention_ref(b.q, k8.astype(jnp.float32) * ks, v8.astype(jnp.float32) * vs, *rest, scale=0.01,
                               ctx_len=b.ctx_len)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_fused_decode_applies_the_scales_as_the_unfused_path():
    from jaxoverlap.models.transformer import apply_rope, split_qkv, write_cache

    H, KVH, HD, eps = 8, 2, 32, 1e-6
    b = make_paged_batch(kv_lens=[7, 30], num_q=1, num_heads=H, num_kv_heads=KVH, head_dim=HD, page_size=4,
                         padded_rows=1)
    L = b.k_cache.shape[0]
    scales = jnp.asarray(np.stack([np.linspace(0.02, 0.05, L), np.linspace(0.5, 0.7, L)], axis=1), jnp.float32)
    k8 = to_cache_dtype(b.k_cache, E4M3, scales[:, :1, None, None])  # [L, S, KVH, HD] / [L, 1, 1, 1]
    v8 = to_cache_dtype(b.v_cache, E4M3, scales[:, 1:, None, None])
    rng = np.random.default_rng(5)
    R = 3
    qkv = jnp.asarray(rng.standard_normal((R, (H + 2 * KVH) * HD)), jnp.float32)
    pos = jnp.asarray(np.asarray(b.q_positions)[:, 0])
    real = np.asarray(b.kv_lens) > 0
    slots = jnp.asarray(np.where(real, np.asarray(b.req_to_token)[np.asarray(b.entries), np.asarray(pos)], 0),
                        jnp.int32)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, HD, 2, dtype=np.float32) / HD))
    q, k, v = split_qkv(qkv[:, None], H, KVH, HD, 1)  # [R, 1, H | KVH, HD]
    q, k = apply_rope(q, pos[:, None], inv_freq), apply_rope(k, pos[:, None], inv_freq)
    ks, vs = scales[b.layer, 0], scales[b.layer, 1]
    want_k = write_cache(k8, b.layer, slots, jnp.asarray(real), k.reshape(R, KVH, HD), ks)
    want_v = write_cache(v8, b.layer, slots, jnp.asarray(real), v.reshape(R, KVH, HD), vs)
    want_o = paged_attention_ref(q * ks, want_k, want_v, b.layer, b.req_to_token, b.entries, pos[:, None],
                                 b.kv_lens, scale=HD ** -0.5, ctx_len=b.ctx_len)[:, 0] * vs
    got_o, got_k, got_v = fused_decode_attention(
        qkv, jnp.array(k8), jnp.array(v8), b.layer, b.req_to_token, b.entries, pos, b.kv_lens, slots, None, None,
        rope_frequencies(inv_freq), scales, num_heads=H, num_kv_heads=KVH, eps=eps, scale=HD ** -0.5,
        ctx_len=b.ctx_len, interpret=True)
    as_bytes = lambda a: np.asarray(a).view(np.uint8)[:, 4:]  # noqa: E731  (page 0 = slots 0..3)
    np.testing.assert_array_equal(as_bytes(got_k), as_bytes(want_k))
    np.testing.assert_array_equal(as_bytes(got_v), as_bytes(want_v))
    np.testing.assert_allclose(np.asarray(got_o), np.asarray(want_o), atol=1e-4, rtol=1e-4)
    # Without the scales the same kernel gives another output (the check can fail).
    plain, _, _ = fused_decode_attention(
        qkv, jnp.array(k8), jnp.array(v8), b.layer, b.req_to_token, b.entries, pos, b.kv_lens, slots, None, None,
        rope_frequencies(inv_freq), num_heads=H, num_kv_heads=KVH, eps=eps, scale=HD ** -0.5,
        ctx_len=b.ctx_len, interpret=True)
    assert np.abs(np.asarray(plain) - np.asarray(want_o)).max() > 1e-2


def _checkpoint_with_kv_scales(tmp_path, scales: dict) -> str:
    """The embedded default model copied, plus a shard of `scales` ({tensor name: value})
    listed in a shard index."""
    import json
    import shutil

    from safetensors.numpy import save_file

    from jaxoverlap.models.loader import SafetensorsReader, default_model_path

    path = tmp_path / "ckpt"
    shutil.copytree(default_model_path(), path)
    save_file({k: np.asarray(v, np.float32) for k, v in scales.items()}, str(path / "kv_scales.safetensors"))
    names = SafetensorsReader([str(path / "model.safetensors")]).names()
    weight_map = {**{n: "model.safetensors" for n in names}, **{n: "kv_scales.safetensors" for n in scales}}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(path)


def test_engine_takes_the_checkpoint_kv_scales(tmp_path):
    """An FP8 checkpoint's `self_attn.k_scale` / `v_scale` become the 8-bit cache's scales:
    every attention path serves the dense forward with them, which is another model than
    scale 1's; a 16-bit cache ignores them."""
    from jaxoverlap.models.config import ModelConfig
    from jaxoverlap.models.loader import default_model_path, load_params

    cfg = ModelConfig.from_path(default_model_path())
    # Small enough that many K/V over their scale pass 448 and saturate: a model that differs
    # visibly from scale 1's (within e4m3's range a scale barely changes the rounding).
    want = np.stack([np.linspace(2e-3, 4e-3, cfg.num_layers), np.linspace(1e-3, 2e-3, cfg.num_layers)], axis=1)
    path = _checkpoint_with_kv_scales(tmp_path, {
        **{f"model.layers.{i}.self_attn.k_scale": want[i, 0] for i in range(cfg.num_layers)},
        **{f"model.layers.{i}.self_attn.v_scale": np.asarray([want[i, 1]]) for i in range(cfg.num_layers)}})
    opts = dict(model=path, dtype="float32", max_running_requests=4, max_context_len=64, kv_cache_tokens=256,
                batch_buckets=(4,), chunked_prefill_size=32)
    from jaxoverlap.engine import Engine

    g = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    arrivals = {0: [("a", [5, 6, 7, 8, 9, 10], g), ("b", list(range(40, 70)), g)]}
    runs = {}
    for name, extra in (("xla", {}), ("fused", dict(attention_backend="pallas")),
                        ("unfused", dict(attention_backend="pallas", disable_fused_decode=True))):
        eng = Engine(EngineConfig(kv_cache_dtype="fp8", **opts, **extra))
        np.testing.assert_allclose(np.asarray(eng.runner.params.kv_scales), want, rtol=1e-6)
        runs[name] = _tokens(eng, arrivals)
    assert runs["fused"] == runs["xla"] == runs["unfused"]
    import dataclasses

    params = dataclasses.replace(load_params(path, cfg, jnp.float32), kv_scales=jnp.asarray(want, jnp.float32))
    for rid, prompt, _ in arrivals[0]:
        logits = np.asarray(dense_logits(params, cfg, jnp.asarray(prompt + runs["xla"][rid], jnp.int32),
                                         cache_dtype=E4M3))
        np.testing.assert_array_equal(np.argmax(logits[len(prompt) - 1:-1], axis=-1), runs["xla"][rid])
    unscaled = Engine(EngineConfig(kv_cache_dtype="fp8", model=default_model_path(),
                                   **{k: v for k, v in opts.items() if k != "model"}))
    assert unscaled.runner.params.kv_scales is None and _tokens(unscaled, arrivals) != runs["xla"]
    assert Engine(EngineConfig(**opts)).runner.params.kv_scales is None  # 16-bit cache


def test_checkpoint_kv_scale_names_and_refusals(tmp_path):
    from jaxoverlap.models.config import CheckpointError
    from jaxoverlap.models.config import ModelConfig
    from jaxoverlap.models.loader import default_model_path, kv_cache_scales

    cfg = ModelConfig.from_path(default_model_path())
    L = cfg.num_layers
    assert kv_cache_scales(default_model_path(), cfg) is None
    # The older single kv_scale serves K and V; ModelOpt's names under k_proj / v_proj.
    one = _checkpoint_with_kv_scales(tmp_path / "one", {f"model.layers.{i}.self_attn.kv_scale": 0.5 + i
                                                         for i in range(L)})
    np.testing.assert_array_equal(kv_cache_scales(one, cfg), [[0.5 + i, 0.5 + i] for i in range(L)])
    modelopt = _checkpoint_with_kv_scales(tmp_path / "mo", {
        **{f"model.layers.{i}.self_attn.k_proj.k_scale": 2.0 for i in range(L)},
        **{f"model.layers.{i}.self_attn.v_proj.v_scale": 3.0 for i in range(L)}})
    np.testing.assert_array_equal(kv_cache_scales(modelopt, cfg), [[2.0, 3.0]] * L)
    some = _checkpoint_with_kv_scales(tmp_path / "some", {"model.layers.0.self_attn.k_scale": 1.0,
                                                          "model.layers.0.self_attn.v_scale": 1.0})
    with pytest.raises(CheckpointError, match="some layers only"):
        kv_cache_scales(some, cfg)
    bad = _checkpoint_with_kv_scales(tmp_path / "bad", {f"model.layers.{i}.self_attn.kv_scale": -1.0 + 2 * i
                                                         for i in range(L)})
    with pytest.raises(CheckpointError, match="expected one positive number"):
        kv_cache_scales(bad, cfg)


def test_gpus_before_compute_capability_8_9_keep_the_8bit_cache_off_the_kernels(monkeypatch):
    """JAX's Triton lowering converts e4m3 only from compute capability 8.9 on: there the
    Pallas kernels are refused for an 8-bit cache when asked for by name."""
    import types

    from jaxoverlap import engine as engine_module

    monkeypatch.setattr(engine_module.jax, "default_backend", lambda: "gpu")
    for capability, ok in (("8.0", False), ("8.6", False), ("8.9", True), ("9.0", True), ("10.0", True)):
        monkeypatch.setattr(engine_module.jax, "devices", lambda c=capability: [types.SimpleNamespace(
            compute_capability=c)])
        assert engine_module._gpu_converts_fp8() is ok, capability
    monkeypatch.undo()
    monkeypatch.setattr(engine_module, "_gpu_converts_fp8", lambda: False)
    with pytest.raises(ValueError, match="compute capability >= 8.9"):
        make_engine(tiny_config(), kv_cache_dtype="fp8", attention_backend="pallas")
    assert make_engine(tiny_config(), attention_backend="pallas").runner.attention is not None  # a 16-bit cache


def test_bf16_engine_with_an_8bit_cache():
    """The production combination, bf16 activations over an e4m3 cache, through the XLA path
    and the Pallas kernels: prompt log-probabilities near the bf16 cache's (the rounding of
    K/V shows), and the two backends as close to each other as they are over a bf16 cache."""
    import jax

    cfg = tiny_config()
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), tiny_params(cfg))
    prompt = list(range(5, 45))
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    logprobs = {}
    for cache in ("auto", "fp8"):
        for backend in ("xla", "pallas"):
            eng = make_engine(cfg, params=bf16, dtype="bfloat16", kv_cache_dtype=cache, attention_backend=backend)
            assert eng.runner.state.k_cache.dtype == (jnp.bfloat16 if cache == "auto" else E4M3)
            out = run_workload(eng, {0: [("p", prompt, sp)]})["p"]
            logprobs[cache, backend] = np.asarray(out.prompt_logprobs[1:], np.float32)
    assert all(np.isfinite(v).all() and len(v) == len(prompt) - 1 for v in logprobs.values())
    drift = np.abs(logprobs["fp8", "xla"] - logprobs["auto", "xla"]).mean()
    assert 0 < drift < 0.5, drift  # mean over the prompt, in nats
    noise = {c: np.abs(logprobs[c, "pallas"] - logprobs[c, "xla"]).mean() for c in ("auto", "fp8")}
    assert noise["fp8"] <= 2 * noise["auto"] + 0.05, noise
