"""The engine on the Pallas kernels (interpreted on CPU): the fused decode layer, the
unfused kernels and the XLA path give the same greedy tokens, for Qwen3 (q/k norm),
Qwen2 (qkv bias) and Llama."""
import numpy as np
import pytest

from engine_fixtures import VOCAB, assert_drained, make_engine, run_workload, tiny_config
from jaxoverlap.pallas_kernels.attention import PallasAttention
from jaxoverlap.sampling_params import SamplingParams


def workload():
    rng = np.random.default_rng(7)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    return {0: [(f"r{i}", [int(t) for t in rng.integers(0, VOCAB, size=n)], params) for i, n in enumerate((3, 9, 21))],
            4: [("late", [int(t) for t in rng.integers(0, VOCAB, size=6)], params)]}


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "llama"])
def test_fused_decode_matches_unfused_and_xla(model_type, monkeypatch):
    traced = []  # the fused kernels' calls while the decode programs are traced

    def counting(name):
        original = getattr(PallasAttention, name)

        def wrapper(self, *args, **kwargs):
            traced.append(name)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(PallasAttention, name, wrapper)

    counting("fused_decode")
    counting("add_rms_norm")
    cfg = tiny_config(model_type)
    opts = dict(max_context_len=64, batch_buckets=(4,), chunked_prefill_size=16)
    outs = {}
    for name, extra in (("xla", dict(attention_backend="xla")),
                        ("fused", dict(attention_backend="pallas")),
                        ("unfused", dict(attention_backend="pallas", disable_fused_decode=True))):
        eng = make_engine(cfg, **opts, **extra)
        att = eng.runner.attention
        if name != "xla":
            assert isinstance(att, PallasAttention) and (att.fused_decode is None) == (name == "unfused")
        before = len(traced)
        finals = run_workload(eng, workload())
        kernels = set(traced[before:])
        assert kernels == ({"fused_decode", "add_rms_norm"} if name == "fused" else set()), kernels
        assert_drained(eng)
        outs[name] = {k: v.token_ids for k, v in finals.items()}
    assert all(len(t) == 10 for t in outs["fused"].values())
    assert outs["fused"] == outs["unfused"] == outs["xla"]


def test_shapes_the_kernels_do_not_take(monkeypatch, caplog):
    """More than 64 query heads per KV head: the fused decode kernel (one tile per KV head)
    gives way to the unfused kernels, with the XLA path's tokens. A head_dim the kernels'
    tiles do not take: refused when the Pallas backend is asked for, the XLA path under
    "auto" (on a GPU, with a warning). It used to fail at the first step in both cases."""
    import logging

    import jax

    from jaxoverlap import engine as engine_module

    cfg = tiny_config("llama", num_heads=128, num_kv_heads=1, head_dim=16)
    rng = np.random.default_rng(3)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    work = {0: [("a", [int(t) for t in rng.integers(0, VOCAB, size=5)], params)]}
    outs = {}
    for backend in ("xla", "pallas"):
        eng = make_engine(cfg, attention_backend=backend, max_context_len=32, batch_buckets=(1,),
                          chunked_prefill_size=16, kv_cache_tokens=64)
        if backend == "pallas":
            assert eng.runner.attention.fused_decode is None
        outs[backend] = run_workload(eng, work)["a"].token_ids
    assert outs["pallas"] == outs["xla"] and len(outs["xla"]) == 4

    odd = tiny_config("qwen3", head_dim=24)
    with pytest.raises(ValueError, match="head_dim 24"):
        make_engine(odd, attention_backend="pallas")
    eng = make_engine(odd)  # "auto" on CPU: the XLA path
    assert not isinstance(eng.runner.attention, PallasAttention)
    backend = jax.default_backend()
    monkeypatch.setattr(engine_module.jax, "default_backend", lambda: "gpu")
    with caplog.at_level(logging.WARNING, logger="jaxoverlap"):
        assert eng._attention_fn() is None
    assert "head_dim 24" in caplog.text
    monkeypatch.undo()
    assert jax.default_backend() == backend
