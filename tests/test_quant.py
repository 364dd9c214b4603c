"""models/quant.py and EngineConfig.quantization='fp8': 8-bit weights with per-column scales."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_fixtures import make_engine, run_workload, tiny_config, tiny_params
from jaxoverlap.config import EngineConfig
from jaxoverlap.models.params import layer_at, stack_layers
from jaxoverlap.models.quant import FP8, Fp8Weight, dequantize_params, linear, quantize_fp8, quantize_params
from jaxoverlap.models.transformer import dense_logits
from jaxoverlap.sampling_params import SamplingParams


def test_quantize_fp8_keeps_each_column_within_e4m3_rounding():
    """Each column is scaled to e4m3's range by its own largest magnitude: its values come
    back within e4m3's relative rounding (3 mantissa bits: 2^-4) of that magnitude, even for
    columns of very different sizes; an all-zero column stays zero."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 6)).astype(np.float32) * np.array([1e-3, 1.0, 50.0, 1e4, 1.0, 0.0])
    w[3, 1] = 30.0  # one outlier: costs precision in its column only
    qw = quantize_fp8(jnp.asarray(w))
    assert qw.q.dtype == FP8 and qw.q.shape == (64, 6) and qw.scale.shape == (6,) and qw.scale.dtype == jnp.float32
    back = np.asarray(qw.dequantized())
    col_max = np.abs(w).max(axis=0)
    err = np.abs(back - w)
    assert np.all(err <= col_max * 2.0 ** -4 + 1e-30), (err / np.maximum(col_max, 1e-30)).max(axis=0)
    assert np.all(back[:, 5] == 0) and float(qw.scale[5]) == 1.0
    # The outlier's column lost more than its neighbours of the same size (the check can fail).
    assert err[:, 1].max() > err[:, 4].max()
    np.testing.assert_allclose(np.abs(back).max(axis=0), col_max, rtol=1e-6)  # each column's largest is exact


def test_linear_is_the_dequantized_matmul():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, 5, 32)), jnp.float32)
    qw = quantize_fp8(jnp.asarray(rng.standard_normal((32, 48)), jnp.float32))
    got = linear(x, qw)
    assert got.shape == (3, 5, 48) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ qw.dequantized()), rtol=1e-5, atol=1e-5)
    # bf16 activations stay bf16.
    assert linear(x.astype(jnp.bfloat16), qw).dtype == jnp.bfloat16


def test_quantized_params_in_every_layer_form():
    """quantize_params turns the dense layers' four matrices into Fp8Weight and nothing
    else; stacking and layer_at read them; the forward equals the dequantized weights'."""
    cfg = tiny_config()
    params = tiny_params(cfg)
    q = quantize_params(params)
    for i in range(cfg.num_layers):
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            w, orig = getattr(q.layers[i], name), getattr(params.layers[i], name)
            assert isinstance(w, Fp8Weight) and w.shape == orig.shape
            assert w.nbytes < orig.nbytes // 3  # float32 -> 1 byte per weight plus a scale per column
    assert q.embed is params.embed and q.attn_norm is params.attn_norm
    ids = jnp.arange(1, 20, dtype=jnp.int32)
    want = dense_logits(dequantize_params(q), cfg, ids)
    got = dense_logits(q, cfg, ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
    # Quantization does change the model (so the comparisons above can fail).
    assert float(jnp.max(jnp.abs(dense_logits(params, cfg, ids) - got))) > 1e-2
    for group in (None, 2):  # one stack, groups of two layers: [G, in, out] 8-bit, [G, out] scales
        stacked = stack_layers(q, group_size=group)
        first = stacked.layers if group is None else stacked.layers[0]
        assert isinstance(first.wqkv, Fp8Weight) and first.wqkv.scale.ndim == 2
        np.testing.assert_array_equal(np.asarray(layer_at(stacked, 1).wo.q.astype(jnp.float32)),
                                      np.asarray(q.layers[1].wo.q.astype(jnp.float32)))
        np.testing.assert_allclose(np.asarray(dense_logits(stacked, cfg, ids)), np.asarray(got), atol=1e-5)
    # An index picks a layer of stacked weights; on one matrix it would mix rows and columns.
    with pytest.raises(TypeError, match="leading"):
        q.layers[0].wqkv[0]
    # Quantizing twice changes nothing.
    again = quantize_params(q)
    assert again.layers[0].wqkv is q.layers[0].wqkv


def test_engine_fp8_generates_as_its_dequantized_weights():
    """EngineConfig.quantization='fp8': the engine serves the 8-bit weights (per layer,
    stacked in groups with a warm-up, and as the target of an EAGLE drafter), with the greedy
    tokens of the same weights dequantized into float32 matrices."""
    cfg = tiny_config()
    g = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    arrivals = {0: [("a", [1, 2, 3, 4, 5], g), ("b", [7, 8, 9], g)], 3: [("c", list(range(10, 40)), g)]}
    fp8 = make_engine(cfg, quantization="fp8")
    assert isinstance(fp8.runner.params.layers[0].wqkv, Fp8Weight)
    got = run_workload(fp8, arrivals)
    reference = make_engine(cfg, params=dequantize_params(fp8.runner.params))
    want = run_workload(reference, arrivals)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
    plain = run_workload(make_engine(cfg), arrivals)
    assert {k: v.token_ids for k, v in plain.items()} != {k: v.token_ids for k, v in got.items()}
    grouped = make_engine(cfg, quantization="fp8", layers_per_weight_stack=2, batch_buckets=(4,), max_context_len=64)
    first = grouped.runner.params.layers[0].wqkv
    assert isinstance(first, Fp8Weight) and first.ndim == 3
    grouped.warmup()
    assert {k: v.token_ids for k, v in run_workload(grouped, arrivals).items()} == {
        k: v.token_ids for k, v in got.items()}
    # Speculative decoding verifies with the 8-bit target: greedy tokens unchanged.
    eagle = make_engine(cfg, quantization="fp8", speculative_algorithm="eagle")
    assert {k: v.token_ids for k, v in run_workload(eagle, arrivals).items()} == {
        k: v.token_ids for k, v in got.items()}


def test_quantization_option_and_its_refusals():
    assert EngineConfig(quantization="none").quantization is None
    assert EngineConfig(quantization="FP8").quantization == "fp8"
    with pytest.raises(ValueError, match="quantization must be None or 'fp8'"):
        EngineConfig(quantization="int4")


def _moe_layer(rng, D=16, F=12, E=6, shards=2, shared=10):
    """One random MoE layer with a shared expert (Qwen2-MoE's form), float32."""
    from jaxoverlap.models.params import LayerParams

    def m(*shape):
        return jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-2]), jnp.float32)

    return LayerParams(wqkv=None, wo=None, w_gate_up=m(E, D, 2 * F), w_down=m(E, F, D), w_router=m(D, E),
                       w_shared_gate_up=m(D, 2 * shared), w_shared_down=m(shared, D), w_shared_gate=m(D, 1),
                       gate_up_shards=shards)


@pytest.mark.parametrize("plan", [("dense", 0), ("grouped", 1), ("grouped", 4), ("sliced", 0)])
def test_moe_plans_with_8bit_experts(plan):
    """Every XLA plan of the MoE MLP takes 8-bit experts (one scale per expert and column)
    and a quantized shared expert: the output of the same experts dequantized. The router
    stays as it was."""
    from jaxoverlap.models import moe
    from jaxoverlap.models.quant import quantize_layer

    rng = np.random.default_rng(3)
    lw = _moe_layer(rng)
    q = quantize_layer(lw)
    assert isinstance(q.w_gate_up, Fp8Weight) and q.w_gate_up.scale.shape == (6, 24)
    assert isinstance(q.w_shared_down, Fp8Weight) and q.w_router is lw.w_router and q.w_shared_gate is lw.w_shared_gate
    dq = dequantize_params(q)
    h = jnp.asarray(rng.normal(size=(3, 5, 16)), jnp.float32)
    run = jax.jit(lambda h, lw: moe.moe_mlp(h, lw, top_k=2, normalize=False, force_plan=plan))
    got, want = np.asarray(run(h, q)), np.asarray(run(h, dq))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(got - np.asarray(run(h, lw))).max() > 1e-3  # the 8-bit experts are another layer


def test_expert_matmul_kernel_reads_8bit_experts():
    """The Pallas expert-matmul plan (interpreted, forced: it is not chosen for 8-bit experts
    until it has run on a GPU) with 8-bit experts: each chosen expert's matrix converted in
    the kernel, its column scales applied after, the dequantized experts' output; with and
    without a split contraction."""
    from jaxoverlap.models import moe
    from jaxoverlap.models.quant import quantize_layer
    from jaxoverlap.pallas_kernels.expert_matmul import expert_matmul

    rng = np.random.default_rng(11)
    lw = _moe_layer(rng, D=64, F=64, E=6, shards=1, shared=64)
    q = quantize_layer(lw)
    assert moe.kernel_fits(lambda *a, **k: None, lw.w_gate_up, lw.w_down)
    assert not moe.kernel_fits(lambda *a, **k: None, q.w_gate_up, q.w_down)
    h = jnp.asarray(rng.normal(size=(2, 3, 64)), jnp.float32)
    got = moe.moe_mlp(h, q, top_k=2, normalize=True, force_plan=("pallas", 0))
    want = moe.moe_mlp(h, dequantize_params(q), top_k=2, normalize=True, force_plan=("dense", 0))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    x = jnp.asarray(rng.normal(size=(5, 64)), jnp.float32)
    experts = jnp.asarray([0, 5, 5, 2, 1], jnp.int32)
    w = q.w_gate_up
    ref = jnp.einsum("ak,akn->an", x, w.dequantized()[experts])
    for splits in (1, 2):
        out = expert_matmul(x, w.q, experts, scale=w.scale, interpret=True, bk=32, splits=splits)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-4)


def test_engine_fp8_moe_generates_as_its_dequantized_weights():
    cfg = tiny_config(model_type="qwen3_moe", intermediate_size=32, num_experts=8, experts_per_token=2,
                      norm_topk_prob=True)
    g = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    arrivals = {0: [("a", [1, 2, 3, 4, 5], g), ("b", [7, 8, 9], g)], 2: [("c", list(range(10, 30)), g)]}
    fp8 = make_engine(cfg, quantization="fp8")
    assert isinstance(fp8.runner.params.layers[0].w_gate_up, Fp8Weight)
    got = {k: v.token_ids for k, v in run_workload(fp8, arrivals).items()}
    want = run_workload(make_engine(cfg, params=dequantize_params(fp8.runner.params)), arrivals)
    assert got == {k: v.token_ids for k, v in want.items()}


def test_cli_quantization_flag():
    import argparse

    from jaxoverlap.cli import add_engine_args, engine_options

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_options(p.parse_args(["--quantization", "fp8"]))["quantization"] == "fp8"
    assert engine_options(p.parse_args([]))["quantization"] is None
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "int8"])


def test_runner_programs_are_keyed_by_the_weights_form():
    """Swapping a runner's weights for their 8-bit copy (as decode_bench's fp8 variant does)
    takes other programs, not the plain weights' executables."""
    eng = make_engine(tiny_config(), batch_buckets=(2,), max_context_len=64)
    plain_key = eng.runner._layout_key()
    eng.runner.params = quantize_params(eng.runner.params)
    assert eng.runner._layout_key() != plain_key


@pytest.mark.parametrize("how", ["safetensors", "dummy", "cache-write", "cache-read"])
def test_loader_quantizes_each_layer_as_it_loads(hf_checkpoint, tmp_path, monkeypatch, how):
    """load_params(quantization='fp8') gives the weights quantize_params gives the loaded
    model, and (loading from the file or drawing dummies) deletes each layer's full-precision
    matrices as soon as their 8-bit copies exist, so the model never sits on the device in
    its dtype. With a weights cache, the cache keeps the full-precision weights."""
    from jaxoverlap.models import loader, quant
    from jaxoverlap.models.config import ModelConfig

    path = hf_checkpoint("llama")
    cfg = ModelConfig.from_path(path)
    opts = {"load_format": "dummy"} if how == "dummy" else {}
    if how.startswith("cache"):
        opts["cache_dir"] = str(tmp_path / "cache")
        if how == "cache-read":
            loader.load_params(path, cfg, jnp.float32, **opts)  # writes the cache
    want = quantize_params(loader.load_params(path, cfg, jnp.float32, **({"load_format": "dummy"} if how == "dummy"
                                                                           else {})))
    sources = []
    real = quant.quantize_fp8
    monkeypatch.setattr(quant, "quantize_fp8", lambda w: sources.append(w) or real(w))
    got = loader.load_params(path, cfg, jnp.float32, quantization="fp8", **opts)
    assert len(sources) == 4 * cfg.num_layers and all(w.is_deleted() for w in sources)
    flat_got, flat_want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(flat_got) == len(flat_want)
    for a, b in zip(flat_got, flat_want):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    if how.startswith("cache"):  # the cache restores full precision
        restored = loader.load_params(path, cfg, jnp.float32, cache_dir=opts["cache_dir"])
        assert not isinstance(restored.layers[0].wqkv, Fp8Weight)


@pytest.mark.parametrize("rows,k,n,splits,dtype", [
    (1, 256, 384, None, jnp.float32),  # one decode row, split contraction
    (5, 384, 128, 3, jnp.float32),  # 3 splits of the 3 contraction blocks
    (16, 128, 256, 1, jnp.float32),
    (40, 256, 128, None, jnp.bfloat16),  # rows padded to 64
])
def test_fp8_matmul_kernel_is_the_converted_matmul(rows, k, n, splits, dtype):
    """pallas_kernels/fp8_matmul.py (interpreted): x times the 8-bit matrix converted to x's
    dtype, in float32, for any split of the contraction and rows padded to a power of two."""
    from jaxoverlap.pallas_kernels.fp8_matmul import fp8_matmul

    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32).astype(dtype)
    qw = quantize_fp8(jnp.asarray(rng.standard_normal((k, n)), jnp.float32))
    got = fp8_matmul(x, qw.q, interpret=True, splits=splits)
    assert got.shape == (rows, n) and got.dtype == jnp.float32
    want = jnp.dot(x, qw.q.astype(dtype), preferred_element_type=jnp.float32)
    # e4m3 values are exact in bf16 and the products exact in float32, so only the order of
    # the float32 sums differs. The 8-bit values run up to 448 and the sums to thousands:
    # that order shows in float32's last places relative to that size.
    tol = 1e-6 * float(jnp.abs(want).max())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=tol)


def test_fp8_matmul_kernel_shapes_and_linear_dispatch():
    """`linear` uses the kernel for 2-D 8-bit matrices of shapes it takes (scaling its
    output as the XLA path does), and the XLA path otherwise."""
    from jaxoverlap.pallas_kernels.fp8_matmul import choose_splits, fp8_matmul, supported

    assert supported(64, 4096, 4096) and not supported(65, 4096, 4096) and not supported(8, 100, 128)
    # Qwen3-8B's decode matrices: about two programs per SM of 132.
    assert choose_splits(4096, 6144) == 4 and choose_splits(4096, 4096) == 8 and choose_splits(12288, 4096) == 8
    assert choose_splits(4096, 24576) == 1
    with pytest.raises(ValueError, match="fp8_matmul takes"):
        fp8_matmul(jnp.ones((2, 100)), jnp.ones((100, 128), FP8), interpret=True)
    calls = []

    def kernel(x2, q):
        calls.append((x2.shape, q.shape))
        return fp8_matmul(x2, q, interpret=True)

    rng = np.random.default_rng(7)
    qw = quantize_fp8(jnp.asarray(rng.standard_normal((128, 256)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((3, 2, 128)), jnp.float32)
    np.testing.assert_allclose(np.asarray(linear(x, qw, kernel=kernel)), np.asarray(linear(x, qw)), rtol=1e-5,
                               atol=1e-5)
    assert calls == [((6, 128), (128, 256))]
    linear(jnp.ones((100, 128)), qw, kernel=kernel)  # 100 rows: XLA's matmul
    assert len(calls) == 1


def test_engine_fp8_through_the_pallas_matmul_kernel():
    """With the Pallas backend's fp8_matmul on (off by default until it has run on a GPU),
    the engine's 8-bit matrices of few rows go through the kernel (interpreted here): the
    XLA path's greedy tokens."""
    from jaxoverlap.pallas_kernels import fp8_matmul as kernel_module
    from jaxoverlap.pallas_kernels.attention import PallasAttention

    cfg = tiny_config(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32)
    g = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    arrivals = {0: [("a", [1, 2, 3, 4, 5], g), ("b", list(range(10, 30)), g)]}
    want = run_workload(make_engine(cfg, quantization="fp8"), arrivals)
    seen = []
    real = kernel_module.fp8_matmul

    def counted(x, q, **kw):
        seen.append(x.shape[0])
        return real(x, q, **kw)

    kernel_module.fp8_matmul = counted
    try:
        default = make_engine(cfg, quantization="fp8", attention_backend="pallas")
        assert default.runner.attention.fp8_matmul is None  # off by default
        run_workload(default, arrivals)
        assert not seen
        eng = make_engine(cfg, quantization="fp8", attention_backend="pallas")
        eng.runner.attention = PallasAttention(interpret=True, fp8_matmul=True)
        got = run_workload(eng, arrivals)
    finally:
        kernel_module.fp8_matmul = real
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
    # Traced for the decode steps (2 rows, then 1) and for prefill chunks of at most 64 rows.
    assert {1, 2} & set(seen) and max(seen) <= 64, seen
