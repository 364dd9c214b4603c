"""Tensor parallelism on 4 fake CPU devices: TP=2 and TP=4 give the greedy outputs of TP=1,
with the XLA attention path and (TP=2) with the Pallas kernels under shard_map; the
per-shard qkv / gate_up layout leaves only the row-parallel all-reduces in a compiled
forward.

The devices must be requested before JAX starts, so those checks run in a subprocess; the
layout itself needs no devices and is checked here."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from engine_fixtures import tiny_config, tiny_params
from jaxoverlap.models import eagle as eagle_models, loader
from jaxoverlap.models.config import ModelConfig
from jaxoverlap.models.loader import dummy_params
from jaxoverlap.models.params import relayout
from jaxoverlap.models.transformer import dense_logits, xla_paged_attention
from jaxoverlap.speculative.eagle_head import head_forward

HERE = os.path.dirname(os.path.abspath(__file__))
DATA_MOVING = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def test_tp_greedy_matches_single_device():
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "tp_worker.py")], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for algo in ("None", "ngram_device"):
        ref = out[f"{algo}-1"]
        assert ref["kv_devices"] == 1 and ref["qkv_shards"] == 1
        for tp in (2, 4) if algo == "None" else (2,):
            got = out[f"{algo}-{tp}"]
            assert got["kv_devices"] == tp, "the KV cache is not sharded"
            assert "tp" in got["wqkv_spec"], "the weights are not sharded"
            assert got["qkv_shards"] == tp, "wqkv is not in the per-shard layout"
            assert got["tokens"] == ref["tokens"], f"{algo} TP={tp} differs from TP=1"
    assert out["None-1"]["retractions"] > 0, "the workload should force retraction"
    warm = out["warm-2"]  # after warmup(prefill=True): the compiled executables under the mesh
    assert warm["tokens"] == out["None-1"]["tokens"]
    assert warm["prefill_executables"] > 0 and warm["decode_executables"] > 0
    assert warm["programs"] == warm["prefill_executables"] + warm["decode_executables"]
    # Asked to stack the layer matrices, one device does; a mesh keeps them per layer.
    assert out["None-1"]["stacked"] and not out["None-2"]["stacked"]
    # Greedy speculative decoding gives plain decoding's tokens, so both compare to TP=1 plain.
    for algo in ("None", "eagle"):
        got = out[f"pallas-{algo}-2"]
        assert got["attention"] == "sharded", "the Pallas kernels did not run under shard_map"
        assert got["fused_decode_shards"] == 2, "the fused decode kernel is not set up for the mesh"
        assert got["kv_devices"] == 2
        assert got["tokens"] == out["None-1"]["tokens"], f"Pallas {algo} TP=2 differs from TP=1"
    assert out["pallas-None-2"]["fused_decode_traced"] > 0, "plain decoding under TP=2 did not use the fused kernel"
    assert out["fallback_attention_error"] < 1e-4, "replicated Pallas attention (KVH < TP) is wrong"
    # After a warm-up, with the penalty history split like the logits and the drafter's cache
    # like shard_map's heads: the compiled programs take every step's state, same tokens.
    assert "tp" in out["vocab-split-2"]["history_spec"] and "tp" not in out["vocab-split-1"]["history_spec"]
    assert out["vocab-split-2"]["tokens"] == out["vocab-split-1"]["tokens"]
    assert "tp" in out["pallas-eagle-warm-2"]["draft_spec"]
    assert out["pallas-eagle-warm-2"]["tokens"] == out["None-1"]["tokens"]
    # The KV cache sized per device: twice the tokens with half the heads on each device, each
    # device's K and V within the memory fraction of the (fake) 48 MiB limit.
    one, two = out["sizing"]["1"], out["sizing"]["2"]
    assert 1.9 < two["kv_tokens"] / one["kv_tokens"] < 2.3, out["sizing"]
    assert abs(two["k_shard_mib"] - one["k_shard_mib"]) < 0.1 * one["k_shard_mib"]
    assert 2 * two["k_shard_mib"] <= 0.85 * 48
    one, two = out["prompt-logprobs-1"], out["prompt-logprobs-2"]
    assert len(one["logprobs"]) == 36 and one["top1"] == two["top1"]
    assert len(one["penalized"]) == 16 and one["penalized"] == two["penalized"]
    assert len(one["top"]) == 16 and [[t for t, _ in a] for a in one["top"]] == [[t for t, _ in a] for a in two["top"]]
    np.testing.assert_allclose([[lp for _, lp in a] for a in two["top"]], [[lp for _, lp in a] for a in one["top"]],
                               atol=1e-4)
    np.testing.assert_allclose(two["logprobs"], one["logprobs"], atol=1e-4)
    # FP8 weights quantized on the mesh: TP=1's tokens; column-parallel matrices split their
    # scales with their columns, row-parallel ones keep them whole.
    assert out["fp8-2"]["tokens"] == out["fp8-1"]["tokens"]
    assert out["fp8-given-2"]["tokens"] == out["fp8-1"]["tokens"]  # quantized by the caller, relaid out
    assert out["fp8-1"]["tokens"] != out["None-1"]["tokens"]  # the 8-bit weights are another model
    kv = {k: v for k, v in out.items() if k.startswith("kv-fp8-")}  # 8-bit KV cache, split like a 16-bit one
    assert {k: v["kv_devices"] for k, v in kv.items()} == {"kv-fp8-xla-1": 1, "kv-fp8-xla-2": 2, "kv-fp8-pallas-2": 2}
    assert all(v["tokens"] == kv["kv-fp8-xla-1"]["tokens"] and v["dtype"] == "float8_e4m3fn" for v in kv.values())
    specs = out["fp8-2"]["specs"]
    for name in ("wqkv", "w_gate_up"):
        assert specs[name] == [[None, "tp"], ["tp"]], (name, specs)
    for name in ("wo", "w_down"):
        assert specs[name][0] == ["tp", None] and "tp" not in specs[name][1], (name, specs)
    # TP=2 ran after warmup(prefill=True, prompt_logprobs=True): every prefill launch, the
    # scoring ones included, found its executable compiled under the mesh.
    assert any(scoring for scoring, _ in two["lookups"]) and all(found for _, found in two["lookups"]), two["lookups"]
    for backend in ("xla", "pallas"):
        hlo = out[f"hlo-{backend}"]
        # One all-reduce after wo and one after w_down per layer, and nothing else: the
        # q/k/v and gate/up splits stay on each device.
        assert hlo["per_shard"] == {"all-reduce": 2 * hlo["num_layers"]}, (backend, hlo)
        # The plain [q | k | v] order on the same mesh does move data: the check can fail.
        assert any(hlo["plain"].get(op) for op in DATA_MOVING), (backend, hlo)
        for form in ("stacked", "grouped"):  # one stack of all layers, groups of 2
            stacked = out[f"{form}-{backend}"]
            assert stacked["max_logit_diff"] < 1e-4 and stacked["wqkv_spec"] == [None, None, "tp"], stacked


def test_loader_places_each_weight_on_its_devices(hf_checkpoint, tmp_path):
    """With `shardings` the loader makes every weight in place on the mesh, for safetensors
    (Qwen3: untied LM head split on the vocabulary; Qwen2: the qkv bias; Qwen3 as an FP8
    checkpoint whose block scales are multiplied out on the devices), dummy weights and
    the orbax cache: the values of loading on one device and sharding after, and no tensor
    the mesh splits ever sent whole to a device (so a model larger than one device loads)."""
    from hf_fixtures import quantize_fp8_checkpoint

    fp8 = str(tmp_path / "qwen3-fp8")
    quantize_fp8_checkpoint(hf_checkpoint("qwen3"), fp8, "block")
    paths = [hf_checkpoint("qwen3"), hf_checkpoint("qwen2"), fp8]
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "tp_load_worker.py"), *paths], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out) == len(paths) * 2 * 4, sorted(out)
    for name, row in out.items():
        assert row["misplaced"] == 0, (name, row)
        assert row["max_diff"] == 0.0, (name, row)
        # Every matrix but the embedding (and the norms) is split: column and row parallel.
        assert row["split"] >= 4 * 2 + 1, (name, row)
        assert row["split_target_sent_whole"] == 0, (name, row)
        # Safetensors send every file tensor; dummy weights and the cache send none.
        assert (row["sent"] > 0) == name.endswith(("safetensors", "cache-write")), (name, row)


def test_per_shard_layout_is_the_same_model():
    """The per-shard layout only permutes columns: same logits on one device, inverse back
    to the plain order, and dummy weights drawn for tp=N are the plain ones permuted.
    Qwen2, for the qkv bias (the worker's Qwen3 model covers qk-norm end to end)."""
    cfg = tiny_config("qwen2", num_heads=8, num_kv_heads=4, head_dim=16)
    params = tiny_params(cfg)
    # Dummy biases are zeros, which any permutation keeps: draw some.
    params = dataclasses.replace(params, bqkv=jax.random.normal(jax.random.key(1), params.bqkv.shape))
    ids = jnp.arange(1, 12, dtype=jnp.int32)
    ref = np.asarray(dense_logits(params, cfg, ids))
    sharded = relayout(params, cfg, 2)  # TP=4 runs end to end in the worker
    lw = sharded.layers[0]
    assert (lw.qkv_shards, lw.gate_up_shards) == (2, 2)
    assert not np.array_equal(lw.wqkv, params.layers[0].wqkv)
    assert not np.array_equal(lw.w_gate_up, params.layers[0].w_gate_up)
    np.testing.assert_allclose(np.asarray(dense_logits(sharded, cfg, ids)), ref, rtol=1e-5, atol=1e-5)
    back = relayout(sharded, cfg, 1)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    drawn, plain = dummy_params(cfg, jnp.float32, 0, 2).layers[1], relayout(tiny_params(cfg), cfg, 2).layers[1]
    np.testing.assert_array_equal(drawn.wqkv, plain.wqkv)
    np.testing.assert_array_equal(drawn.w_gate_up, plain.w_gate_up)
    # Heads that do not divide (KVH = 4 over 8 devices) keep the plain q/k/v order, while
    # F = 128 still gets 8 per-shard gate/up blocks.
    eight = relayout(params, cfg, 8)
    assert (eight.layers[0].qkv_shards, eight.layers[0].gate_up_shards) == (1, 8)
    assert eight.layers[0].wqkv is params.layers[0].wqkv and eight.bqkv is params.bqkv
    np.testing.assert_allclose(np.asarray(dense_logits(eight, cfg, ids)), ref, rtol=1e-5, atol=1e-5)


def test_eagle_head_reads_the_per_shard_layout():
    """The EAGLE head's layer splits q/k/v and gate/up through the same helpers."""
    cfg = eagle_models.head_config(tiny_config(num_heads=8, num_kv_heads=4, head_dim=16))
    target = tiny_params(tiny_config(num_heads=8, num_kv_heads=4, head_dim=16))
    hp = eagle_models.dummy_eagle_params(cfg, jnp.float32)
    B, Q, D = 2, 3, cfg.hidden_size
    cache = jnp.zeros((1, 16, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    table = jnp.arange(1, 1 + B * 8, dtype=jnp.int32).reshape(B, 8)
    args = dict(tokens=jnp.ones((B, Q), jnp.int32), feats=jax.random.normal(jax.random.key(2), (B, Q, D)),
                cols=jnp.broadcast_to(jnp.arange(Q), (B, Q)), q_valid=jnp.ones((B, Q), bool),
                kv_lens=jnp.full((B,), Q, jnp.int32), ctx_len=8, attention=xla_paged_attention)
    run = jax.jit(lambda hp, **a: head_forward(hp, cfg, target, cache, cache, table, **a)[0],
                  static_argnames=("ctx_len", "attention"))
    ref, got = run(hp, **args), run(relayout(hp, cfg, 2), **args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_loader_writes_the_per_shard_layout(tmp_path):
    """Safetensors conversion and the orbax cache at tensor_parallel_size=2 give the plain
    weights permuted; the cache keeps one entry per layout."""
    path = loader.default_model_path()
    cfg = ModelConfig.from_path(path)
    want = relayout(loader.load_params(path, cfg, jnp.float32), cfg, 2)
    converted = loader.load_params(path, cfg, jnp.float32, cache_dir=str(tmp_path), tensor_parallel_size=2)
    restored = loader.load_params(path, cfg, jnp.float32, cache_dir=str(tmp_path), tensor_parallel_size=2)
    assert len(os.listdir(tmp_path)) == 1
    assert loader.cache_path(str(tmp_path), path, jnp.float32) not in [str(p) for p in tmp_path.iterdir()]
    for got in (converted, restored):
        assert jax.tree.structure(got) == jax.tree.structure(want)  # qkv_shards / gate_up_shards == 2
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(a, b)
