"""Penalties, logit_bias, min_new_tokens and top_logprobs under speculative decoding
(penalties.apply_window, record_drafts): each column of a verified window sees the drafts
before it; accepted drafts are counted; with every drafter the greedy tokens equal the plain
engine's, with overlap on and off, under retraction; seeded sampling is the same with and
without overlap; every output token's top logprobs equal the plain engine's.

Compile budget: one batch bucket, one context bucket and one prefill length per engine, as
in test_spec_engine.py; the penalized workload is all on sampling programs.
"""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

from engine_fixtures import VOCAB, assert_drained, make_engine, run_workload, tiny_config, tiny_params
from jaxoverlap import penalties
from jaxoverlap.sampling_params import SamplingParams

OPTS = dict(max_running_requests=4, batch_buckets=(4,), max_prefill_requests=2, chunked_prefill_size=16,
            max_context_len=64, kv_cache_tokens=120)  # 120 tokens: the workload below retracts


def _history_with(history: np.ndarray, tokens) -> np.ndarray:
    """One row's history after `tokens` were generated (the host's version of record_generated)."""
    row = history.copy()
    for t in tokens:
        row[t] = (row[t] + 1) | penalties.SEEN
    return row


def test_apply_window_equals_apply_after_each_draft():
    rng = np.random.default_rng(0)
    B, k, V = 3, 4, 11
    W = k + 1
    history = rng.integers(0, 3, size=(B, V)).astype(np.int32)
    history |= np.where(rng.random((B, V)) < 0.3, penalties.SEEN, 0).astype(np.int32)
    history[:, 2] |= penalties.STOP
    params = np.asarray([[1.5, 0.4, 0.3], [0.8, -0.5, 1.0], list(penalties.NEUTRAL)], np.float32)
    lens = np.asarray([5, 9, 3], np.int32)
    min_end = np.asarray([8, 0, 7], np.int32)  # row 0: stop banned at positions 6, 7 (columns 0, 1)
    bias_ids = np.full((B, penalties.MAX_LOGIT_BIAS), -1, np.int32)
    bias_values = np.zeros((B, penalties.MAX_LOGIT_BIAS), np.float32)
    bias_ids[1, :2], bias_values[1, :2] = [4, 7], [3.0, -2.0]
    drafts = np.asarray([[4, 4, 1, 4], [7, 3, 7, 0], [1, 2, 3, 5]], np.int32)  # repeated tokens within a row
    logits = rng.normal(size=(B, W, V)).astype(np.float32)
    got = np.asarray(penalties.apply_window(jnp.asarray(logits), jnp.asarray(lens), jnp.asarray(drafts),
                                            *map(jnp.asarray, (history, params, min_end, bias_ids, bias_values))))
    for j in range(W):
        hist_j = np.stack([_history_with(history[b], drafts[b, :j]) for b in range(B)])
        want = np.asarray(penalties.apply(jnp.asarray(logits[:, j]), jnp.asarray(lens + 1 + j), jnp.asarray(hist_j),
                                          *map(jnp.asarray, (params, min_end, bias_ids, bias_values))))
        np.testing.assert_allclose(got[:, j], want, rtol=1e-6, err_msg=f"column {j}")
    assert np.isneginf(got[0, :2, 2]).all() and np.isfinite(got[0, 2:, 2]).all()
    # A draft counted in its own column would show here: column 0 is the history alone.
    assert not np.allclose(got[0, 1], got[0, 0])


def test_record_drafts_counts_the_accepted_ones():
    pen = penalties.init_penalty_state(4, 8)
    drafts = jnp.asarray([[3, 3, 5], [1, 2, 6], [4, 4, 4]], jnp.int32)
    pen = penalties.record_drafts(pen, jnp.asarray([1, 2, 0]), drafts, jnp.asarray([3, 1, 4]))
    history = np.asarray(pen.history)
    assert (history[1] & penalties.COUNT).tolist() == [0, 0, 0, 2, 0, 0, 0, 0]  # two accepted, one token
    assert ((history[1] & penalties.SEEN) != 0).nonzero()[0].tolist() == [3]
    assert not history[2].any() and not history[3].any()  # none accepted; entry 3 untouched


def spec_engine(name: str, **options):
    if name == "draft_is_target":  # drafts equal the target's own unpenalized tokens
        cfg = tiny_config()
        options.update(speculative_algorithm="draft_model", draft_model_config=cfg, draft_params=tiny_params(cfg))
    else:
        options.update(speculative_algorithm=name)
    extra = {k: options.pop(k) for k in ("draft_model_config", "draft_params") if k in options}
    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine

    cfg = tiny_config()
    opts = dict(dtype="float32", page_size=4, **OPTS)
    opts.update(options)
    return Engine(EngineConfig.from_options("/nonexistent-model", **opts), model_config=cfg,
                  params=tiny_params(cfg), **extra)


def workload(greedy: bool = True):
    rng = np.random.default_rng(3)
    few = rng.integers(0, VOCAB, size=5)
    rules = [dict(repetition_penalty=1.8), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
             dict(repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=0.8),
             dict(logit_bias={int(few[0]): -100.0, int(few[1]): 4.0}, presence_penalty=0.5),
             dict(min_new_tokens=12, stop_token_ids=[int(few[2]), int(few[3])]), {}]
    arrivals = {}
    for i, rule in enumerate(rules):
        prompt = [int(t) for t in rng.choice(few, size=int(rng.integers(6, 22)))]  # repetitive: n-grams get accepted
        params = SamplingParams(max_new_tokens=int(rng.integers(14, 26)), ignore_eos=True, seed=50 + i,
                                temperature=0.0 if greedy or i % 2 else 0.9, **rule)
        arrivals.setdefault(i // 2, []).append((f"r{i}", prompt, params))
    return arrivals


@pytest.fixture(scope="module")
def plain_greedy():
    """The plain engine's greedy tokens of the workload, which the rules change (checked)."""
    eng = make_engine(**OPTS)
    finals = run_workload(eng, workload())
    assert_drained(eng)
    bare = {rid: (prompt, SamplingParams(max_new_tokens=p.max_new_tokens, ignore_eos=True, temperature=0.0))
            for items in workload().values() for rid, prompt, p in items}
    unpenalized = run_workload(eng, {0: [(rid, prompt, p) for rid, (prompt, p) in bare.items()]})
    changed = [rid for rid, out in finals.items() if unpenalized[rid].token_ids != out.token_ids]
    assert len(changed) >= 4, changed
    return {k: v.token_ids for k, v in finals.items()}


@pytest.mark.parametrize("name", ["eagle", "draft_is_target", "ngram", "ngram_device"])
def test_greedy_penalized_speculative_equals_plain(name, plain_greedy):
    for overlap in (True, False):
        eng = spec_engine(name, disable_overlap=not overlap)
        finals = run_workload(eng, workload())
        assert {k: v.token_ids for k, v in finals.items()} == plain_greedy, (name, overlap)
        stats = eng.stats()
        assert stats["num_retractions"] > 0 and stats["accept_length"] > 1.0
        assert_drained(eng)


def test_seeded_penalized_sampling_is_the_same_with_and_without_overlap():
    outs = []
    for overlap in (True, False):
        eng = spec_engine("eagle", disable_overlap=not overlap)
        outs.append({k: v.token_ids for k, v in run_workload(eng, workload(greedy=False)).items()})
        assert_drained(eng)
    assert outs[0] == outs[1]
    stops = workload(greedy=False)[2][1][2]  # the min_new_tokens request
    assert not set(outs[0]["r5"][:12]) & set(stops.stop_token_ids)



def _tokens_and_tops(engine, requests) -> dict:
    """{request id: (output tokens, per-token top logprobs or None)} of requests queued at once."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    tops = {rid: [] for rid, _, _ in requests}
    done = {}
    while engine.has_work():
        for out in engine.step():
            if out.new_top_logprobs is not None:
                tops[out.request_id].extend(out.new_top_logprobs)
            if out.finished:
                done[out.request_id] = (out.token_ids, tops[out.request_id] or None)
    return done


def test_top_logprobs_equal_the_plain_engines():
    """Per output token (the prefill's first, then each accepted window position), the top
    logprobs of a speculative engine equal the plain engine's for the same greedy tokens."""
    rng = np.random.default_rng(5)
    few = rng.integers(0, VOCAB, size=5)
    requests = [(f"t{i}", [int(t) for t in rng.choice(few, size=9 + 3 * i)],
                 SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, top_logprobs=3 if i else 0,
                                presence_penalty=0.5 if i == 2 else 0.0)) for i in range(3)]
    want = _tokens_and_tops(make_engine(**OPTS), requests)
    assert want["t0"][1] is None
    for name in ("draft_is_target", "ngram_device"):
        eng = spec_engine(name)
        got = _tokens_and_tops(eng, requests)
        # Windows of several tokens were accepted (nearly whole ones with the target as drafter).
        assert eng.stats()["accept_length"] > (3.0 if name == "draft_is_target" else 1.0), name
        assert got["t0"] == want["t0"]
        for rid in ("t1", "t2"):
            tokens, tops = got[rid]
            assert tokens == want[rid][0] and len(tops) == len(tokens) == 12, (name, rid)
            for mine, theirs in zip(tops, want[rid][1]):
                assert [t for t, _ in mine] == [t for t, _ in theirs], (name, rid)
                np.testing.assert_allclose([lp for _, lp in mine], [lp for _, lp in theirs], atol=1e-4)
        assert_drained(eng)
