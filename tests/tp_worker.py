"""Run in a subprocess with 4 fake CPU devices (see test_tensor_parallel.py): greedy outputs
of the same workload at TP=1, 2 and 4 plain (and 1, 2 with one drafter), with the XLA attention
path and (TP=2) the Pallas kernels in interpret mode under shard_map, plus the collectives
of a compiled TP=2 forward; printed as JSON."""
import collections
import dataclasses
import functools
import json
import os
import re
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from engine_fixtures import make_engine, run_workload, tiny_config, tiny_params  # noqa: E402
from jaxoverlap import engine as engine_module  # noqa: E402
from jaxoverlap import parallel  # noqa: E402
from jaxoverlap.models.params import layer_at, layers_per_stack, relayout, stack_layers  # noqa: E402
from jaxoverlap.models.quant import quantize_params  # noqa: E402
from jaxoverlap.models.transformer import dense_logits, forward  # noqa: E402
from jaxoverlap.sampling_params import SamplingParams  # noqa: E402

# Every cross-device op XLA can insert; "-start" is the async form some backends emit.
COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


def forward_collectives(eng, params) -> dict:
    """{collective: count} in the compiled HLO of one decode-shaped forward (all layers,
    no LM head) over `params` and the engine's sharded caches."""
    st, B = eng.runner.state, 4
    entries = jnp.arange(B, dtype=jnp.int32)
    pos = jnp.zeros((B, 1), jnp.int32)

    def fwd(p, k_cache, v_cache, req_to_token):
        return forward(p, eng.model_config, k_cache, v_cache, req_to_token, tokens=pos + 1, positions=pos,
                       entries=entries, q_valid=pos == 0, kv_lens=pos[:, 0] + 1, ctx_len=64,
                       attention=eng.runner.attention)

    hlo = jax.jit(fwd).lower(params, st.k_cache, st.v_cache, st.req_to_token).compile().as_text()
    return dict(collections.Counter(m.group(1) for m in COLLECTIVE.finditer(hlo)))


_FUSED_TRACED: list = []


def count_fused_decode(attention) -> list:
    """Wrap the backend's fused decode kernel (if any) so that each use while a program is
    traced is recorded; returns the record."""
    inner = getattr(attention, "fused_decode", None)
    if inner is not None and not getattr(inner, "counting", False):
        def counted(*args, **kwargs):
            _FUSED_TRACED.append(1)
            return inner(*args, **kwargs)

        counted.counting = True
        attention.fused_decode = counted
    return _FUSED_TRACED


def fallback_attention_error() -> float:
    """KVH = 2 over 4 devices does not split: shard_attention runs every head on every
    device. Max |error| against the reference, decode (Q=1) and prefill-kernel (Q=40)."""
    from jaxoverlap.pallas_kernels.attention import paged_attention
    from jaxoverlap.pallas_kernels.reference import paged_attention_ref
    from jaxoverlap.pallas_kernels.testing import make_paged_batch

    fn = parallel.shard_attention(functools.partial(paged_attention, backend="pallas", interpret=True),
                                  parallel.make_mesh(4))
    err = 0.0
    for num_q in (1, 40):
        b = make_paged_batch(kv_lens=[45, 9], num_q=num_q, num_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
        got = jax.jit(lambda *a: fn(*a, scale=0.25, ctx_len=b.ctx_len))(*b.args())
        want = paged_attention_ref(*b.args(), scale=0.25, ctx_len=b.ctx_len)
        err = max(err, float(jnp.max(jnp.abs(got - want))))
    return err


def main():
    assert len(jax.devices()) == 4, jax.devices()
    cfg = tiny_config(num_heads=8, num_kv_heads=4, head_dim=16)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    arrivals = {0: [(f"r{i}", [(7 * i + j) % 90 + 1 for j in range(5 + 3 * i)], params) for i in range(4)],
                3: [("late", [3, 1, 4, 1, 5, 9, 2, 6], params)]}
    # Small KV cache: forces retraction.
    xla = dict(attention_backend="xla", kv_cache_tokens=160)
    # Pallas under TP: the kernels run per device under shard_map (interpreted on CPU); with
    # EAGLE the head's replicated cache goes through the same sharded kernel. Interpreted
    # kernels compile slowly, so these runs keep to one prefill and one decode program:
    # every request at once, one batch bucket, one context bucket, no retraction. Greedy
    # tokens do not depend on the schedule, so they must still equal TP=1's.
    pallas = dict(attention_backend="pallas", batch_buckets=(8,), max_context_len=64, chunked_prefill_size=16)
    at_once = {0: [r for rs in arrivals.values() for r in rs]}
    # TP=4 plain only: a drafter's sharding does not change between 2 and 4 devices.
    runs = [("xla", algo, tp, xla, arrivals) for algo in (None, "ngram_device")
            for tp in ((1, 2, 4) if algo is None else (1, 2))]
    runs += [("pallas", algo, 2, pallas, at_once) for algo in (None, "eagle")]
    out, seconds = {}, {}
    for backend, algo, tp, options, workload in runs:
        t0 = time.perf_counter()
        # Stacked layer weights where the engine can (TP=1): TP=2 and 4 keep per-layer
        # arrays, so the token comparison also checks the two layouts against each other.
        opts = dict(tensor_parallel_size=tp, layers_per_weight_stack=2, **options)
        if algo:
            opts["speculative_algorithm"] = algo
        eng = make_engine(cfg, **opts)
        traced = count_fused_decode(eng.runner.attention)
        before = len(traced)
        finals = run_workload(eng, workload)
        eng.check_integrity()
        sharding = eng.runner.state.k_cache.sharding
        name = f"{algo}-{tp}" if backend == "xla" else f"{backend}-{algo}-{tp}"
        out[name] = {
            "tokens": {k: v.token_ids for k, v in sorted(finals.items())},
            "kv_devices": len(sharding.device_set),
            "wqkv_spec": str(getattr(layer_at(eng.runner.params, 0).wqkv.sharding, "spec", "")),
            "qkv_shards": layer_at(eng.runner.params, 0).qkv_shards,
            "stacked": layers_per_stack(eng.runner.params) > 1,
            "retractions": eng.stats()["num_retractions"],
            # parallel.shard_attention's wrapper, or the XLA path's function.
            "attention": getattr(eng.runner.attention, "__name__", ""),
            "fused_decode_shards": getattr(eng.runner.attention, "fused_qkv_shards", 0),
            "fused_decode_traced": len(traced) - before,
        }
        if tp == 2 and algo is None:
            # The per-shard layout against the plain one on the same mesh: the latter makes
            # XLA move q/k/v (gate/up) slices between devices, the former must not.
            plain = parallel.shard_params(relayout(eng.runner.params, cfg, 1), eng.mesh)
            out[f"hlo-{backend}"] = {"per_shard": forward_collectives(eng, eng.runner.params),
                                     "plain": forward_collectives(eng, plain), "num_layers": cfg.num_layers}
            # Stacked layers shard too (the stacked axis stays whole): same logits.
            ids = jnp.arange(1, 12, dtype=jnp.int32)
            want = dense_logits(eng.runner.params, cfg, ids)
            for form, group in (("stacked", None), ("grouped", 2)):
                stacked = parallel.shard_params(stack_layers(eng.runner.params, group_size=group), eng.mesh)
                first = stacked.layers if group is None else stacked.layers[0]
                out[f"{form}-{backend}"] = {
                    "max_logit_diff": float(jnp.max(jnp.abs(dense_logits(stacked, cfg, ids) - want))),
                    "wqkv_spec": list(first.wqkv.sharding.spec)}
        seconds[name] = round(time.perf_counter() - t0, 1)
    # TP=2 after a warm-up of every program (prefill included): the launches then run the
    # compiled executables with their sharded and numpy inputs, not jit.
    t0 = time.perf_counter()
    eng = make_engine(cfg, tensor_parallel_size=2, **xla)
    report = eng.warmup(prefill=True)
    finals = run_workload(eng, arrivals)
    out["warm-2"] = {"tokens": {k: v.token_ids for k, v in sorted(finals.items())},
                     "programs": len(report), "prefill_executables": len(eng.runner._prefill_executables),
                     "decode_executables": len(eng.runner._executables)}
    seconds["warm-2"] = round(time.perf_counter() - t0, 1)
    # Prompt logprobs: the LM head over the sharded vocabulary, a block of positions at a
    # time; penalties, whose history the mesh replicates; top logprobs over the logits.
    t0 = time.perf_counter()
    score = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    penalized = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.5,
                               frequency_penalty=1.0, top_logprobs=3)
    prompt = [(5 * j) % 90 + 1 for j in range(37)]
    lookups = []  # TP=2: (prompt_logprobs, found) of each prefill launch's executable lookup

    class Recording(dict):
        def get(self, key, default=None):
            found = super().get(key, default)
            lookups.append((key[5], found is not None))  # runner._prefill_key: 6th field prompt_logprobs
            return found

    for tp in (1, 2):
        # One batch bucket and a short context: fewer programs for TP=2's warm-up to compile.
        eng = make_engine(cfg, tensor_parallel_size=tp, **xla, batch_buckets=(4,), max_context_len=64)
        if tp == 2:  # the scoring variants compiled ahead under the mesh, and found by the launches
            eng.warmup(prefill=True, top_logprobs=True, prompt_logprobs=True)
            eng.runner._prefill_executables = Recording(eng.runner._prefill_executables)
        eng.add_request("s", prompt, score)
        eng.add_request("p", prompt, penalized)
        finals, top = {}, []
        while eng.has_work():
            for o in eng.step():
                top.extend(o.new_top_logprobs or [])
                if o.finished:
                    finals[o.request_id] = o
        out[f"prompt-logprobs-{tp}"] = {"logprobs": finals["s"].prompt_logprobs[1:], "top1": finals["s"].prompt_top1[1:],
                                        "penalized": finals["p"].token_ids, "top": top}
    out["prompt-logprobs-2"]["lookups"] = lookups
    seconds["prompt-logprobs"] = round(time.perf_counter() - t0, 1)
    # FP8 weights (EngineConfig.quantization) quantized on the mesh: each 8-bit matrix keeps
    # its weight's sharding, its scales that of the weight's output axis.
    t0 = time.perf_counter()
    for tp in (1, 2):
        eng = make_engine(cfg, tensor_parallel_size=tp, quantization="fp8", **xla)
        finals = run_workload(eng, at_once)
        lw = layer_at(eng.runner.params, 0)
        out[f"fp8-{tp}"] = {"tokens": {k: v.token_ids for k, v in sorted(finals.items())},
                            "specs": {name: [list(getattr(getattr(getattr(lw, name), part).sharding, "spec", ()))
                                             for part in ("q", "scale")]
                                      for name in ("wqkv", "wo", "w_gate_up", "w_down")}}
    # Weights quantized by the caller in the one-device layout: converted to the mesh's
    # per-shard columns (models/params.relayout), scales with their columns.
    eng = make_engine(cfg, params=quantize_params(tiny_params(cfg)), tensor_parallel_size=2, **xla)
    out["fp8-given-2"] = {"tokens": {k: v.token_ids for k, v in sorted(run_workload(eng, at_once).items())}}
    seconds["fp8"] = round(time.perf_counter() - t0, 1)
    # An 8-bit KV cache (EngineConfig.kv_cache_dtype) split on its heads like a full one, with
    # per-layer cache scales (small: many K/V saturate, so a model of their own): the XLA path
    # at TP=1 and 2, and the fused Pallas decode kernel per device under shard_map, reading
    # the 8-bit cache and taking the scales replicated. (Scales against none, and the 8-bit
    # cache against the dense forward, are test_kv_cache_fp8's, on one device.)
    t0 = time.perf_counter()
    scaled = dataclasses.replace(tiny_params(cfg), kv_scales=jnp.asarray(
        np.stack([np.linspace(2e-3, 4e-3, cfg.num_layers), np.linspace(1e-3, 2e-3, cfg.num_layers)], 1), jnp.float32))
    for name, tp, options in (("xla", 1, xla), ("xla", 2, xla), ("pallas", 2, pallas)):
        eng = make_engine(cfg, params=scaled, tensor_parallel_size=tp, kv_cache_dtype="fp8", **options)
        out[f"kv-fp8-{name}-{tp}"] = {"tokens": {k: v.token_ids for k, v in sorted(run_workload(eng, at_once).items())},
                                      "dtype": str(eng.runner.state.k_cache.dtype),
                                      "kv_devices": len(eng.runner.state.k_cache.sharding.device_set)}
    seconds["kv-fp8"] = round(time.perf_counter() - t0, 1)
    # Layouts kept across steps (parallel.StateSharding): an untied LM head over a vocabulary
    # the mesh divides splits the logits and with them the penalty history; the Pallas
    # kernels under shard_map split the drafter's cache on heads. Programs compiled by a
    # warm-up must still take the state each step hands back.
    t0 = time.perf_counter()
    vcfg = dataclasses.replace(cfg, vocab_size=128)
    mixed = {0: [("g", prompt[:9], params), ("p", prompt, dataclasses.replace(penalized, top_logprobs=0))],
             2: [("g2", prompt[3:20], params)]}
    for tp in (1, 2):
        # One batch bucket and a short context: fewer programs for the warm-up to compile.
        eng = make_engine(vcfg, tensor_parallel_size=tp, **xla, batch_buckets=(4,), max_context_len=64)
        if tp == 2:
            eng.warmup(sampling=(False, True), prefill=True)
        finals = run_workload(eng, mixed)
        out[f"vocab-split-{tp}"] = {"tokens": {k: v.token_ids for k, v in sorted(finals.items())},
                                    "history_spec": str(getattr(eng.runner.state.penalty.history.sharding, "spec", ""))}
    eng = make_engine(cfg, tensor_parallel_size=2, speculative_algorithm="eagle", **pallas)
    eng.warmup()
    finals = run_workload(eng, at_once)
    out["pallas-eagle-warm-2"] = {"tokens": {k: v.token_ids for k, v in sorted(finals.items())},
                                  "draft_spec": str(eng.runner.state.draft_k_cache.sharding.spec)}
    seconds["layouts"] = round(time.perf_counter() - t0, 1)
    # The KV cache sized from each device's memory (engine._memory_stats, which the CPU lacks:
    # a fake limit, and the bytes the first device's live arrays hold): with TP=2 every device
    # holds half the weights and half the KV heads, so the cache holds about twice the tokens.
    t0 = time.perf_counter()

    def memory_stats(device):
        held = sum(s.data.nbytes for a in jax.live_arrays() for s in a.addressable_shards if s.device == device)
        return {"bytes_limit": 48 << 20, "bytes_in_use": held}

    engine_module._memory_stats = memory_stats
    sizing = {}
    for tp in (1, 2):
        eng = make_engine(cfg, tensor_parallel_size=tp, attention_backend="xla", kv_cache_tokens=None)
        shard = eng.runner.state.k_cache.addressable_shards[0]
        sizing[tp] = {"kv_tokens": eng.kv_cache_tokens, "k_shard_mib": shard.data.nbytes / 2**20}
        eng.close()
        del eng
    out["sizing"] = sizing
    seconds["sizing"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    out["fallback_attention_error"] = fallback_attention_error()
    seconds["fallback"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(seconds), file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
