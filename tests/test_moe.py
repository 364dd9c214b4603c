"""The mixture-of-experts MLP (models/moe.py): every plan against a token-by-token oracle,
the plan chosen per shape, and MoE models through the engine (overlap, speculative
decoding, tensor parallelism). Qwen3-MoE and Mixtral against transformers are in
test_models_reference.py, their checkpoints' loading in test_loader.py."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_fixtures import assert_drained, make_engine, run_workload, tiny_config, tiny_params
from jaxoverlap.models import moe
from jaxoverlap.models.params import LayerParams, layers_per_stack, to_shard_blocks
from jaxoverlap.models.transformer import dense_logits
from jaxoverlap.sampling_params import SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _float32_matmuls():
    """float32 matmuls in float32 on a GPU too (TF32 by default there, about 1e-3 off: the
    oracle checks allow 2e-4)."""
    with jax.default_matmul_precision("highest"):
        yield


def moe_config(**overrides):
    base = dict(model_type="qwen3_moe", intermediate_size=32, num_experts=8, experts_per_token=2,
                norm_topk_prob=True, qk_norm=True)
    return tiny_config(**{**base, **overrides})


def qwen2_moe_config(**overrides):
    """Qwen2-MoE: qkv biases, no qk-norm, unnormalized top-k weights, a shared expert of width 48."""
    base = dict(model_type="qwen2_moe", qk_norm=False, qkv_bias=True, norm_topk_prob=False,
                shared_expert_intermediate_size=48)
    return moe_config(**{**base, **overrides})


def _oracle(x, w_router, w_gate, w_up, w_down, top_k, normalize, shared=None):
    """TEST ORACLE: float64, token by token. w_gate, w_up [E, D, F]; w_down [E, F, D];
    shared: None, or a shared expert's (gate [D, Fs], up [D, Fs], down [Fs, D], its output
    gate [D, 1]), whose output times the sigmoid of that gate every token adds."""
    logits = x @ w_router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t], kind="stable")[:top_k]
        weights = probs[t, top] / (probs[t, top].sum() if normalize else 1.0)
        for e, w in zip(top, weights):
            gate, up = x[t] @ w_gate[e], x[t] @ w_up[e]
            out[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ w_down[e])
    if shared is not None:
        s_gate, s_up, s_down, s_out_gate = shared
        for t in range(x.shape[0]):
            gate, up = x[t] @ s_gate, x[t] @ s_up
            out[t] += ((gate / (1 + np.exp(-gate)) * up) @ s_down) / (1 + np.exp(-(x[t] @ s_out_gate)))
    return out


def _random_layer(rng, D, F, E, shards, skew: float = 0.0, shared: int = 0):
    """LayerParams of one random MoE layer (gate_up in `shards` per-shard blocks) and the
    float64 matrices the oracle takes. `skew` > 0 makes expert 0 every token's favourite
    (a few experts get all the rows, others none). `shared` > 0: with a shared expert of
    that width (its gate_up in the same per-shard layout), passed as the oracle's `shared`."""
    w_router = rng.normal(size=(D, E)) / np.sqrt(D)
    w_router[:, 0] += skew
    w_gate, w_up = rng.normal(size=(E, D, F)) / np.sqrt(D), rng.normal(size=(E, D, F)) / np.sqrt(D)
    w_down = rng.normal(size=(E, F, D)) / np.sqrt(F)
    gate_up = to_shard_blocks(jnp.asarray(np.concatenate([w_gate, w_up], axis=-1), jnp.float32), (F, F), shards)
    lw = LayerParams(wqkv=None, wo=None, w_gate_up=gate_up, w_down=jnp.asarray(w_down, jnp.float32),
                     w_router=jnp.asarray(w_router, jnp.float32), gate_up_shards=shards)
    if not shared:
        return lw, (w_router, w_gate, w_up, w_down)
    s_gate, s_up = rng.normal(size=(D, shared)) / np.sqrt(D), rng.normal(size=(D, shared)) / np.sqrt(D)
    s_down = rng.normal(size=(shared, D)) / np.sqrt(shared)
    s_out_gate = rng.normal(size=(D, 1)) / np.sqrt(D)  # gate logits of std ~1: sigmoids spread over (0, 1)
    s_gate_up = to_shard_blocks(jnp.asarray(np.concatenate([s_gate, s_up], axis=-1), jnp.float32),
                                (shared, shared), shards)
    lw = dataclasses.replace(lw, w_shared_gate_up=s_gate_up, w_shared_down=jnp.asarray(s_down, jnp.float32),
                             w_shared_gate=jnp.asarray(s_out_gate, jnp.float32))
    return lw, (w_router, w_gate, w_up, w_down, (s_gate, s_up, s_down, s_out_gate))


def _check_against_oracle(got, x, mats, k, normalize):
    """`got` [R, Q, D] is the oracle's output for x [R, Q, D]; and where the layer has a shared
    expert, the routed experts alone are not (so the check sees the shared expert)."""
    R, Q, D = x.shape
    want = _oracle(x.reshape(R * Q, D), *mats[:4], k, normalize, *mats[4:]).reshape(R, Q, D)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    if len(mats) > 4:
        routed = _oracle(x.reshape(R * Q, D), *mats[:4], k, normalize).reshape(R, Q, D)
        assert np.abs(got - routed).max() > 0.1


PLANS = [("dense", 0), ("grouped", 1), ("grouped", 4), ("grouped", 8), ("sliced", 0)]


@pytest.mark.parametrize("force_plan", PLANS, ids=lambda p: f"{p[0]}{p[1] or ''}")
# (gate_up shards, normalize, skew, shared expert width): the last with Qwen2-MoE's shared expert.
@pytest.mark.parametrize("shards,normalize,skew,shared", [(1, True, 0.0, 0), (2, False, 0.0, 0), (1, True, 3.0, 0),
                                                          (2, False, 0.0, 10)])
def test_every_plan_matches_the_oracle(force_plan, shards, normalize, skew, shared):
    rng = np.random.default_rng(1)
    D, F, E, k = 16, 12, 6, 2
    lw, mats = _random_layer(rng, D, F, E, shards, skew, shared)
    x = rng.normal(size=(3, 5, D))  # R=3 rows of Q=5 tokens
    fn = jax.jit(lambda h, lw: moe.moe_mlp(h, lw, top_k=k, normalize=normalize, force_plan=force_plan))
    got = np.asarray(fn(jnp.asarray(x, jnp.float32), lw), np.float64)
    _check_against_oracle(got, x, mats, k, normalize)


@pytest.mark.parametrize("shards,shared", [(1, 0), (2, 0), (2, 48)])
def test_pallas_expert_matmul_plan_matches_the_oracle(shards, shared):
    """The Pallas expert-matmul kernel (interpret mode here) in the MLP: shapes it takes
    (contraction a multiple of 64, columns of 64); a shared expert (any width: XLA's) beside it."""
    from jaxoverlap.pallas_kernels.expert_matmul import supported

    rng = np.random.default_rng(2)
    D, F, E, k = 64, 64, 4, 2
    assert supported(D, 2 * F) and supported(F, D)
    lw, mats = _random_layer(rng, D, F, E, shards, skew=0.5, shared=shared)
    x = rng.normal(size=(3, 1, D))
    fn = jax.jit(lambda h, lw: moe.moe_mlp(h, lw, top_k=k, normalize=False, force_plan=("pallas", 0)))
    got = np.asarray(fn(jnp.asarray(x, jnp.float32), lw), np.float64)
    _check_against_oracle(got, x, mats, k, False)


def test_expert_matmul_reads_each_rows_own_expert():
    from jaxoverlap.pallas_kernels.expert_matmul import expert_matmul, supported, tuning

    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(5, 128)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 128, 192)), jnp.float32)
    experts = jnp.asarray([2, 0, 2, 1, 0], jnp.int32)
    got = expert_matmul(x, w, experts, interpret=True)
    want = np.einsum("ak,akn->an", np.asarray(x), np.asarray(w)[np.asarray(experts)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    # Qwen3-30B-A3B's gate_up [2048, 1536] splits its contraction; down [768, 2048] does not.
    assert tuning(2048, 1536) == dict(bk=64, bn=128, splits=4, num_warps=4, num_stages=2)
    assert tuning(768, 2048) == dict(bk=256, bn=128, splits=1, num_warps=4, num_stages=3)
    assert tuning(128, 192)["bn"] == 64 and not supported(128, 96) and not supported(96, 128)


def test_plan_per_shape():
    # Qwen3-30B-A3B: 128 experts, 8 per token.
    assert moe.plan(1, 128, 8) == ("grouped", 1)  # batch-1 decode: only the 8 chosen experts
    assert moe.plan(5, 128, 8) == ("grouped", 1)
    assert moe.plan(6, 128, 8) == ("dense", 0)  # 48 assignments: cheaper to read every expert once
    assert moe.plan(256, 128, 8) == ("dense", 0)  # a big decode or verify batch still reads each expert once
    assert moe.plan(2048, 128, 8) == ("grouped", 256)  # a prefill chunk: blocks of about 2 T*k/E rows
    # Mixtral: 8 experts, 2 per token.
    assert moe.plan(1, 8, 2) == ("grouped", 1)
    assert moe.plan(2, 8, 2) == ("dense", 0)
    assert moe.plan(2048, 8, 2) == ("grouped", 512)  # 4x the needed matmul work costs more than copies
    # With the expert-matmul kernel: up to E assignments (no more expert matrices than "dense" reads).
    assert moe.plan(1, 128, 8, kernel=True) == moe.plan(16, 128, 8, kernel=True) == ("pallas", 0)
    assert moe.plan(17, 128, 8, kernel=True) == ("dense", 0)
    assert moe.plan(2048, 128, 8, kernel=True) == ("grouped", 256)
    assert moe.plan(4, 8, 2, kernel=True) == ("pallas", 0) and moe.plan(5, 8, 2, kernel=True) == ("dense", 0)
    # A few copies of the experts at most, whatever the chunk.
    for T in (1024, 2048, 8192, 32768):
        kind, block = moe.plan(T, 128, 8)
        assert kind == "grouped" and moe._blocks(T * 8, 128, block) <= 3 * 128


def test_engine_serves_a_moe_model_with_and_without_overlap_and_speculation():
    """Greedy tokens of a MoE model equal the dense reference's argmax chain, with overlap
    on and off (off: with both layers' weights in one [2, E, D, 2F] stack) and with
    on-device n-gram speculation (verify steps of 1 + k tokens per row)."""
    cfg = moe_config()
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, size=n)] for n in (5, 17, 40)]
    # Repeats, so the n-gram drafter proposes tokens and some get accepted.
    prompts.append(prompts[0] * 6)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    arrivals = {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]}
    runs = {}
    for name, opts in {"overlap": {}, "normal": dict(disable_overlap=True, layers_per_weight_stack=2),
                       "ngram": dict(speculative_algorithm="ngram_device", speculative_num_steps=3)}.items():
        eng = make_engine(cfg, **opts)
        assert layers_per_stack(eng.runner.params) == (2 if name == "normal" else 1)
        runs[name] = {k: list(v.token_ids) for k, v in run_workload(eng, arrivals).items()}
        assert_drained(eng)
    assert runs["overlap"] == runs["normal"] == runs["ngram"]
    # The reference: each greedy token is the argmax of the full-sequence logits before it.
    # Sequences padded to one length (the forward is causal): one compile for all.
    model = tiny_params(cfg)
    longest = max(len(p) + 12 for p in prompts)
    for i, prompt in enumerate(prompts):
        out = runs["overlap"][f"r{i}"]
        ids = jnp.asarray(prompt + out + [0] * (longest - len(prompt) - len(out)), jnp.int32)
        argmax = np.argmax(np.asarray(dense_logits(model, cfg, ids)), axis=-1)
        assert list(argmax[len(prompt) - 1:len(prompt) - 1 + len(out)]) == out


def test_engine_uses_the_expert_matmul_kernel_for_small_steps(monkeypatch):
    """With the Pallas backend (interpret mode here) the engine's decode steps of up to E/k
    tokens run the experts through the expert-matmul kernel, and give the XLA backend's
    greedy tokens; the prefill chunks (more assignments) do not use it."""
    from jaxoverlap.pallas_kernels.attention import PallasAttention

    cfg = moe_config(intermediate_size=64, num_experts=8, experts_per_token=2)  # kernel shapes: 64 | D, F
    traced = []
    kernel = PallasAttention.expert_matmul

    def spy(self, x, w, experts, out_dtype=None):
        traced.append(x.shape[0])  # assignments
        return kernel(self, x, w, experts, out_dtype)

    monkeypatch.setattr(PallasAttention, "expert_matmul", spy)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, size=n)] for n in (3, 9, 20)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    arrivals = {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]}
    runs = {}
    for backend in ("xla", "pallas"):
        eng = make_engine(cfg, attention_backend=backend, batch_buckets=(1, 2, 4))
        runs[backend] = {k: list(v.token_ids) for k, v in run_workload(eng, arrivals).items()}
        assert_drained(eng)
    assert runs["pallas"] == runs["xla"]
    assert traced and max(traced) <= cfg.num_experts  # decode batches of 1-4 rows: 2-8 assignments


def test_moe_under_tensor_parallelism():
    """On 4 fake CPU devices: TP=2 gives TP=1's greedy tokens and logits, each expert's MLP
    width (and a shared expert's) split over the devices, with no collective but
    all-reduces (tests/moe_tp_worker.py): for Qwen3-MoE and for Qwen2-MoE."""
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "moe_tp_worker.py")], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(runs) == ["qwen2_moe", "qwen3_moe"]
    for name, out in runs.items():
        assert out["w_gate_up_spec"] == [None, None, "tp"] and out["w_down_spec"] == [None, "tp", None], name
        assert out["w_router_spec"] == [] or all(s is None for s in out["w_router_spec"]), name
        assert out["logits_err"] < 1e-4, name
        assert out["tokens"]["2"] == out["tokens"]["1"], name
        plans = {k: out["collectives"].pop(k) for k in ("dense0", "grouped1", "grouped4")}
        assert set(out["collectives"]) == {"all-reduce"}, (name, out["collectives"])  # the engine's forward
        for plan, found in plans.items():
            assert found == ["all-reduce"], f"{name} {plan}: {found}"
    # The shared expert's width split as a dense MLP's, its [D, 1] gate replicated.
    shared = runs["qwen2_moe"]
    assert shared["w_shared_gate_up_spec"] == [None, "tp"] and shared["w_shared_down_spec"] == ["tp", None]
    assert shared["w_shared_gate_spec"] == [] or all(s is None for s in shared["w_shared_gate_spec"])
    assert "w_shared_gate_up_spec" not in runs["qwen3_moe"]


def test_config_fields_from_hf():
    from jaxoverlap.models.config import CheckpointError, ModelConfig

    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    qwen = ModelConfig.from_hf_dict(dict(base, model_type="qwen3_moe", intermediate_size=96, moe_intermediate_size=16,
                                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True))
    assert (qwen.intermediate_size, qwen.num_experts, qwen.experts_per_token, qwen.norm_topk_prob) == (16, 4, 2, True)
    assert qwen.qk_norm and qwen.is_moe
    mixtral = ModelConfig.from_hf_dict(dict(base, model_type="mixtral", intermediate_size=24, num_local_experts=4,
                                            num_experts_per_tok=2))
    assert (mixtral.intermediate_size, mixtral.num_experts, mixtral.norm_topk_prob) == (24, 4, True)
    assert not mixtral.qk_norm
    with pytest.raises(CheckpointError, match="mlp_only_layers"):
        ModelConfig.from_hf_dict(dict(base, model_type="qwen3_moe", intermediate_size=96, moe_intermediate_size=16,
                                      num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0]))
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict(dict(base, model_type="mixtral", intermediate_size=24, num_local_experts=4,
                                      num_experts_per_tok=6))
    with pytest.raises(CheckpointError, match="num_experts"):
        ModelConfig.from_hf_dict(dict(base, model_type="qwen3_moe", intermediate_size=96, moe_intermediate_size=16,
                                      num_experts_per_tok=2))
    # transformers 5 saves Qwen3-MoE's count as num_local_experts (with num_experts null).
    saved = ModelConfig.from_hf_dict(dict(base, model_type="qwen3_moe", intermediate_size=96, moe_intermediate_size=16,
                                          num_experts=None, num_local_experts=4, num_experts_per_tok=2))
    assert saved.num_experts == 4
    with pytest.raises(CheckpointError, match="moe_intermediate_size"):
        ModelConfig.from_hf_dict(dict(base, model_type="qwen3_moe", intermediate_size=96, moe_intermediate_size=None,
                                      num_experts=4, num_experts_per_tok=2))
    with pytest.raises(CheckpointError, match="norm_topk_prob"):
        ModelConfig.from_hf_dict(dict(base, model_type="qwen3_moe", intermediate_size=96, moe_intermediate_size=16,
                                      num_experts=4, num_experts_per_tok=2, norm_topk_prob="false"))
    for deepseek in ("deepseek_v2", "deepseek_v3"):
        with pytest.raises(ValueError, match="unsupported model_type"):
            ModelConfig.from_hf_dict(dict(base, model_type=deepseek, intermediate_size=96))


def test_qwen2_moe_config_fields_from_hf():
    from jaxoverlap.models.config import CheckpointError, ModelConfig

    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                model_type="qwen2_moe", intermediate_size=96, moe_intermediate_size=16, num_experts=4,
                num_experts_per_tok=2, shared_expert_intermediate_size=40)
    cfg = ModelConfig.from_hf_dict(base)
    # The experts' width, not the dense layers'; the shared expert's own; Qwen2's attention
    # (q/k/v biases by default: checkpoints from before the `qkv_bias` field have them).
    assert (cfg.intermediate_size, cfg.shared_expert_intermediate_size, cfg.num_experts) == (16, 40, 4)
    assert (cfg.experts_per_token, cfg.norm_topk_prob) == (2, False)
    assert cfg.is_moe and cfg.qkv_bias and not cfg.qk_norm
    assert not ModelConfig.from_hf_dict(dict(base, qkv_bias=False)).qkv_bias
    assert ModelConfig.from_hf_dict(dict(base, norm_topk_prob=True)).norm_topk_prob
    # What transformers writes for an all-MoE model loads.
    assert ModelConfig.from_hf_dict(dict(base, mlp_only_layers=[], decoder_sparse_step=1)) == cfg
    # The other families have no shared expert.
    qwen3 = ModelConfig.from_hf_dict(dict(base, model_type="qwen3_moe"))
    assert qwen3.shared_expert_intermediate_size == 0 and not qwen3.qkv_bias
    refused = {
        "dense layers": (dict(mlp_only_layers=[0]), "Qwen2-MoE with dense MLP layers"),
        "sparse step": (dict(decoder_sparse_step=2), "Qwen2-MoE with dense MLP layers"),
        "no width": (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size must be a positive"),
        "null width": (dict(shared_expert_intermediate_size=None), "shared_expert_intermediate_size must be a pos"),
        "bias flag": (dict(qkv_bias="yes"), "qkv_bias must be true or false"),
        "no experts": (dict(num_experts=0), "num_experts must be a positive integer"),
    }
    for name, (change, match) in refused.items():
        with pytest.raises(CheckpointError, match=match):
            ModelConfig.from_hf_dict(dict(base, **change))
    lacking = dict(base)
    del lacking["shared_expert_intermediate_size"]
    with pytest.raises(CheckpointError, match="lacks 'shared_expert_intermediate_size'"):
        ModelConfig.from_hf_dict(lacking)
    with pytest.raises(ValueError, match="shared expert needs a mixture-of-experts layer"):
        dataclasses.replace(cfg, num_experts=0, experts_per_token=0)


def test_shared_expert_weights_stack_and_change_layout():
    """A Qwen2-MoE model's shared-expert weights go through the engine's layout changes:
    stacked per group of layers, and its gate_up converted to another per-shard layout (as
    for tensor parallelism) and back, with the logits unchanged."""
    from jaxoverlap.models.params import matrices, relayout, stack_layers, unstack_layers

    cfg = qwen2_moe_config()
    params = tiny_params(cfg)
    assert matrices(params.layers[0])[-3:] == ("w_shared_gate_up", "w_shared_down", "w_shared_gate")
    ids = jnp.arange(20, dtype=jnp.int32) * 7 % cfg.vocab_size
    ref = np.asarray(dense_logits(params, cfg, ids))
    stacked = stack_layers(params, group_size=2)
    assert stacked.layers[0].w_shared_gate_up.shape == (2, cfg.hidden_size, 2 * cfg.shared_expert_intermediate_size)
    np.testing.assert_allclose(np.asarray(dense_logits(stacked, cfg, ids)), ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(unstack_layers(stacked)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    two = relayout(params, cfg, 2)
    assert two.layers[0].gate_up_shards == 2
    # The shared gate_up is permuted too (else the logits below would differ).
    assert not np.array_equal(np.asarray(two.layers[0].w_shared_gate_up), np.asarray(params.layers[0].w_shared_gate_up))
    np.testing.assert_allclose(np.asarray(dense_logits(two, cfg, ids)), ref, rtol=1e-5, atol=1e-5)
    back = relayout(two, cfg, 1)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A shared width that the tensor-parallel size does not divide keeps the plain layout
    # for both gate_ups (they share one static layout field).
    odd = dataclasses.replace(cfg, shared_expert_intermediate_size=36)
    assert relayout(tiny_params(odd), odd, 8).layers[0].gate_up_shards == 1


def test_the_kv_cache_leaves_room_for_the_moe_temporaries(monkeypatch):
    """Sized from device memory, the KV cache of a MoE model leaves out the MLP's temporaries
    for the largest program (a prefill chunk here), which a dense model does not need."""
    from jaxoverlap import engine as engine_module
    from jaxoverlap.device_state import kv_cache_bytes_per_token

    limit, in_use = 64 << 20, 4 << 20
    monkeypatch.setattr(engine_module, "_memory_stats", lambda device: {"bytes_limit": limit, "bytes_in_use": in_use})
    cfg = moe_config()
    eng = make_engine(cfg, kv_cache_tokens=None, chunked_prefill_size=32, max_running_requests=8)
    reserved = moe.activation_bytes(33, cfg.num_experts, cfg.experts_per_token, cfg.hidden_size,
                                    cfg.intermediate_size, 4)  # float32 engine; 32 + 1 tokens
    assert reserved > 0
    per_token = kv_cache_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    fewer = eng._kv_tokens_from_memory(eng.max_context_len, {}, 33)
    assert eng.kv_cache_tokens >= fewer  # what the engine was built with (rounded up to pages)
    # Without the reservation the same memory holds more tokens, by the reserved bytes.
    monkeypatch.setattr(moe, "activation_bytes", lambda *args: 0)
    more = eng._kv_tokens_from_memory(eng.max_context_len, {}, 33)
    assert more - fewer == pytest.approx(reserved * eng.config.kv_cache_memory_fraction / per_token, abs=1)


def test_activation_bytes_follow_the_plan():
    # Qwen3-30B-A3B in bf16: a batch-32 decode step (dense) against a 2048-token prefill
    # chunk (grouped: copies of about twice the experts' 1.2 GB).
    decode = moe.activation_bytes(32, 128, 8, 2048, 768, 2)
    prefill = moe.activation_bytes(2048, 128, 8, 2048, 768, 2)
    assert decode < 100e6 and 2.4e9 < prefill < 5e9
