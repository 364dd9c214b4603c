"""Speculative decoding on the tiny engine: every drafter gives plain greedy output token
for token, with and without overlap, under cache pressure and prefix sharing, with no
device-to-host read on the launch path.

Compile budget: every engine here has one batch bucket, one context bucket and one prefill
length, and every draft model shares the target's config, so each drafter compiles one
speculative step and two prefill programs for the whole file.
"""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from engine_fixtures import VOCAB, assert_drained, make_engine, run_workload, tiny_config, tiny_params
from jaxoverlap.models import eagle as eagle_models
from jaxoverlap.sampling_params import SamplingParams

# Few cache sizes for the engines here: the cache's shape is part of each compiled program.
# 120 tokens (30 pages of 4) lets four requests run at once, and forces retraction for the
# workloads below in most drafters; RETRACTING (20 pages) in every drafter and both loops
# (admission keeps room for two decode steps of growth of each row, so the larger may not).
OPTS = dict(max_running_requests=4, batch_buckets=(4,), max_prefill_requests=2, chunked_prefill_size=16,
            max_context_len=64, kv_cache_tokens=120)
RETRACTING = 80
DRAFTERS = ["eagle", "draft_model", "draft_is_target", "ngram", "ngram_device"]


def drafter_kwargs(name: str) -> dict:
    cfg = tiny_config()
    if name == "draft_model":  # an unrelated model of the same shape: low acceptance
        return dict(speculative_algorithm="draft_model", draft_model_config=cfg, draft_params=tiny_params(cfg, 1))
    if name == "draft_is_target":  # drafts equal the target's tokens: every window is accepted
        return dict(speculative_algorithm="draft_model", draft_model_config=cfg, draft_params=tiny_params(cfg))
    return dict(speculative_algorithm=name)


def spec_engine(name: str, cfg=None, params=None, **options):
    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine

    kw = drafter_kwargs(name)
    engine_kw = {k: kw.pop(k) for k in ("draft_model_config", "draft_params") if k in kw}
    cfg = cfg or tiny_config()
    opts = dict(dtype="float32", page_size=4, **OPTS)
    opts.update(kw)
    opts.update(options)
    return Engine(EngineConfig.from_options("/nonexistent-model", **opts), model_config=cfg,
                  params=params if params is not None else tiny_params(cfg), **engine_kw)


def workload(seed: int, n: int = 9, greedy: bool = True):
    """Staggered arrivals, shared prefixes (page-aligned and not), repetitive prompts (so
    that n-gram drafts get accepted), and for greedy=False a mix of greedy and seeded rows."""
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(0, VOCAB, size=13)]
    arrivals = {}
    for i in range(n):
        own = [int(t) for t in rng.integers(0, VOCAB, size=int(rng.integers(1, 20)))]
        if i % 4 == 1:
            own = (own[:3] * 6)[: len(own) + 6]
        prompt = (shared + own) if i % 3 == 0 else own
        params = SamplingParams(
            max_new_tokens=int(rng.integers(1, 30)), ignore_eos=True,
            temperature=0.0 if greedy or i % 2 else 0.9, top_k=0 if i % 4 else 8, top_p=1.0 if i % 3 else 0.9,
            seed=1000 + i,
        )
        arrivals.setdefault(int(rng.integers(0, 20)), []).append((f"r{i}", prompt, params))
    return arrivals


_plain_cache = {}


def plain_outputs(arrivals_seed: int, greedy: bool):
    key = (arrivals_seed, greedy)
    if key not in _plain_cache:
        eng = make_engine(**OPTS)
        finals = run_workload(eng, workload(arrivals_seed, greedy=greedy))
        _plain_cache[key] = {k: v.token_ids for k, v in finals.items()}
    return _plain_cache[key]


@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_speculative_equals_plain_with_and_without_overlap(name):
    """A cache small enough to force retraction, shared prefixes, staggered arrivals; every
    launch runs under the transfer guard (the host n-gram wait is outside the launch)."""
    want = plain_outputs(0, True)
    stats = {}
    for overlap in (True, False):
        eng = spec_engine(name, disable_overlap=not overlap, kv_cache_tokens=RETRACTING)
        eng.guard_launch = True
        finals = run_workload(eng, workload(0))
        assert {k: v.token_ids for k, v in finals.items()} == want, (name, overlap)
        assert_drained(eng)
        stats[overlap] = eng.stats()
        timings = list(eng.timings)
        waited = sum(t.fresh_wait_s > 0 for t in timings)
        if name == "ngram" and overlap:
            assert waited > 0, "the host n-gram drafter must wait for the previous step"
        else:
            assert waited == 0
        if name == "draft_is_target":
            # Long accepts: nearly every verified window is accepted whole.
            assert stats[overlap]["accept_length"] > 3.5
            assert max(f.metrics.accept_length for f in finals.values()) > 3.0
    assert min(s["num_retractions"] for s in stats.values()) > 0, "the small cache should force retraction"
    assert stats[True]["accept_length"] == pytest.approx(stats[False]["accept_length"], rel=0.05)
    assert stats[True]["accept_length"] >= 1.0


@pytest.mark.parametrize("name", DRAFTERS)
def test_seeded_sampling_identical_with_and_without_overlap(name):
    """Mixed greedy and sampled rows: sampled rows depend only on (seed, position) and the
    drafts, and the greedy rows still equal plain greedy decoding. The host trie is shared
    by all requests, so its drafts, and with them a sampled row's tokens (not their
    distribution), depend on what the other requests had produced when the row looked up:
    for it only the greedy rows are compared across loops."""
    plain = plain_outputs(1, False)
    outs = []
    for overlap in (True, False):
        eng = spec_engine(name, disable_overlap=not overlap)
        finals = run_workload(eng, workload(1, greedy=False))
        outs.append({k: v.token_ids for k, v in finals.items()})
        assert_drained(eng)
    params = {rid: p for reqs in workload(1, greedy=False).values() for rid, _, p in reqs}
    for rid, p in params.items():
        assert len(outs[0][rid]) == len(outs[1][rid]) == p.max_new_tokens
        if p.temperature == 0:
            assert outs[0][rid] == outs[1][rid] == plain[rid], rid
        elif name != "ngram":
            assert outs[0][rid] == outs[1][rid], rid


def bigram_models():
    """A target whose layers add nothing (zero output projections), so it predicts the next
    token from the current one alone, and an EAGLE head that does the same from its token
    input: the head's drafts are exactly the target's tokens, every window is accepted.
    Same shapes (and so the same compiled programs) as the random models."""
    cfg = tiny_config()
    target = tiny_params(cfg)
    target = dataclasses.replace(target, layers=tuple(
        dataclasses.replace(lw, wo=jnp.zeros_like(lw.wo), w_down=jnp.zeros_like(lw.w_down)) for lw in target.layers))
    hcfg = eagle_models.head_config(cfg)
    head = eagle_models.dummy_eagle_params(hcfg, jnp.float32)
    D = cfg.hidden_size
    fc = jnp.concatenate([jnp.eye(D), jnp.zeros((D, D))], axis=0)  # [2D, D]: take the token embedding
    layer = dataclasses.replace(head.layer, wo=jnp.zeros_like(head.layer.wo), w_down=jnp.zeros_like(head.layer.w_down))
    return cfg, target, hcfg, dataclasses.replace(head, fc=fc, layer=layer)


def test_eagle_long_accepts_on_a_predictable_target():
    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine

    cfg, target, hcfg, head = bigram_models()
    arrivals = workload(2, n=5)
    plain = make_engine(**OPTS)
    plain.runner.params = target
    want = {k: v.token_ids for k, v in run_workload(plain, arrivals).items()}
    for overlap in (True, False):
        opts = dict(dtype="float32", page_size=4, speculative_algorithm="eagle", disable_overlap=not overlap, **OPTS)
        eng = Engine(EngineConfig.from_options("/nonexistent-model", **opts), model_config=cfg, params=target,
                     eagle_config=hcfg, eagle_params=head)
        finals = run_workload(eng, arrivals)
        assert {k: v.token_ids for k, v in finals.items()} == want
        assert eng.stats()["accept_length"] > 3.5
        assert_drained(eng)


@pytest.mark.parametrize("name", ["eagle", "ngram_device"])
def test_padded_rows_never_touch_real_rows(name):
    """The same speculative step with the padded rows (entry 0) first or last leaves the real
    rows' outputs and every part of the device state outside entry 0 and the dummy page
    identical: padded rows write only there, drafter state included."""
    import jax

    from jaxoverlap import steps
    from jaxoverlap.speculative.step import spec_decode_step

    eng = spec_engine(name, disable_overlap=True)
    for i, prompt in enumerate(([5, 9, 2, 7, 5, 9, 2], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3])):
        eng.add_request(f"p{i}", prompt, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
    while any(r.status.value != "running" or not r.output_ids for r in eng.requests.values()):
        eng.step()
    r = eng.runner
    e1, e2 = (req.entry for req in eng.requests.values())
    empty = steps.Reservations.empty(8 * r.decode_pages_per_row)

    def run(entries):
        state = jax.tree.map(lambda x: jnp.array(x, copy=True), r.state)
        return spec_decode_step(r.params, r.drafter.params, state, steps.DecodeInputs.of(entries, empty), None,
                                cfg=r.model_cfg, spec=r.spec, ctx_len=r.ctx_buckets[0], page_size=r.page_size,
                                attention=r.attention, sampling=False)

    a, out_a = run([e1, e2, 0, 0])
    b, out_b = run([0, e1, 0, e2])
    for field in ("tokens", "accept_lens", "logprobs", "drafts"):
        x, y = np.asarray(getattr(out_a, field)), np.asarray(getattr(out_b, field))
        np.testing.assert_array_equal(x[:2], y[[1, 3]], err_msg=field)
    ps = r.page_size
    for path, x in jax.tree_util.tree_leaves_with_path(a):
        y = dict(jax.tree_util.tree_leaves_with_path(b))[path]
        x, y = np.asarray(x), np.asarray(y)
        name_ = jax.tree_util.keystr(path)
        if "relay" in name_ or "req_to_token" in name_:
            np.testing.assert_array_equal(x[1:], y[1:], err_msg=name_)  # entry 0 may differ
        elif "cache" in name_:
            np.testing.assert_array_equal(x[:, ps:], y[:, ps:], err_msg=name_)  # the dummy page may differ
        else:
            np.testing.assert_array_equal(x[ps:], y[ps:], err_msg=name_)
    assert int(np.asarray(a.relay.seq_lens)[0]) == int(np.asarray(b.relay.seq_lens)[0]) == 0


@pytest.mark.parametrize("name", DRAFTERS)
def test_speculation_paused_above_a_batch_size_gives_plain_greedy_output(name):
    """Batches of more than two rows draft nothing, smaller ones draft: the workload's
    staggered arrivals switch between the two many times, and the output is still plain
    greedy decoding token for token. A drafter whose state the paused steps did not keep
    would draft from a stale state after each switch: with the target as its own draft
    model every drafting window must still be accepted whole."""
    eng = spec_engine(name, speculative_disable_by_batch_size=2)
    finals = run_workload(eng, workload(0))
    assert {k: v.token_ids for k, v in finals.items()} == plain_outputs(0, True)
    assert_drained(eng)
    stats = eng.stats()
    decode = [t for t in eng.timings if t.kind == "decode"]
    assert stats["spec_paused_steps"] == sum(t.batch_size > 2 for t in decode) > 0
    assert any(t.batch_size <= 2 for t in decode)
    if name == "draft_is_target":
        assert stats["accept_length"] > 3.5
    if name == "ngram":  # a paused batch needs no host drafts, so it keeps the overlap
        assert all(t.fresh_wait_s == 0 for t in decode if t.batch_size > 2)
        assert any(t.fresh_wait_s > 0 for t in decode if t.batch_size <= 2)


def test_sampled_rows_with_speculation_paused_are_identical_with_and_without_overlap():
    """The paused program's sampler: sampled rows still depend only on (seed, position), so
    both loops give the same tokens, and the greedy rows still equal plain decoding."""
    plain = plain_outputs(1, False)
    outs = []
    for overlap in (True, False):
        eng = spec_engine("ngram_device", disable_overlap=not overlap, speculative_disable_by_batch_size=2)
        outs.append({k: v.token_ids for k, v in run_workload(eng, workload(1, greedy=False)).items()})
        assert_drained(eng)
        assert eng.stats()["spec_paused_steps"] > 0
    params = {rid: p for reqs in workload(1, greedy=False).values() for rid, _, p in reqs}
    assert any(p.temperature > 0 for p in params.values())
    for rid, p in params.items():
        assert outs[0][rid] == outs[1][rid], rid
        if p.temperature == 0:
            assert outs[0][rid] == plain[rid], rid


@pytest.mark.parametrize("name", ["eagle", "draft_model", "ngram_device"])
def test_paused_step_leaves_the_state_of_a_step_whose_drafts_all_missed(name):
    """The paused step (no draft slots) against the full step from the same state: for rows
    whose drafts were all rejected, the new token, the relay and the drafter's state for
    the next step are the same."""
    import jax

    from jaxoverlap import steps
    from jaxoverlap.speculative.step import spec_decode_step

    eng = spec_engine(name, disable_overlap=True)
    prompts = ([5, 9, 2, 7, 5, 9, 2], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [8, 8, 1, 2], [7, 6, 5, 4, 3, 2])
    for i, prompt in enumerate(prompts):
        eng.add_request(f"p{i}", prompt, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
    while any(r.status.value != "running" or not r.output_ids for r in eng.requests.values()):
        eng.step()
    r = eng.runner
    entries = np.array([req.entry for req in eng.requests.values()], np.int32)
    empty = steps.Reservations.empty(4 * r.decode_pages_per_row)

    def run(spec):
        state = jax.tree.map(lambda x: jnp.array(x, copy=True), r.state)
        return spec_decode_step(r.params, r.drafter.params, state, steps.DecodeInputs.of(entries, empty), None,
                                cfg=r.model_cfg, spec=spec, ctx_len=r.ctx_buckets[0], page_size=r.page_size,
                                attention=r.attention, sampling=False)

    before = r.state
    full, out_full = run(r.spec)
    paused, out_paused = run(r.paused_spec)
    assert np.asarray(out_paused.tokens).shape == (4, 1)
    np.testing.assert_array_equal(np.asarray(out_paused.accept_lens), 1)
    missed = np.asarray(out_full.accept_lens) == 1
    assert missed.any(), "the test needs a row whose drafts all missed"
    rows, e = np.nonzero(missed)[0], entries[missed]
    np.testing.assert_array_equal(np.asarray(out_paused.tokens)[rows, 0], np.asarray(out_full.tokens)[rows, 0])
    np.testing.assert_allclose(np.asarray(out_paused.logprobs)[rows, 0], np.asarray(out_full.logprobs)[rows, 0],
                               rtol=1e-5, atol=1e-6)
    for field in ("seq_lens", "tokens", "draft_token", "last_token"):
        np.testing.assert_array_equal(np.asarray(getattr(paused.relay, field))[e],
                                      np.asarray(getattr(full.relay, field))[e], err_msg=field)
    np.testing.assert_allclose(np.asarray(paused.relay.draft_hidden)[e], np.asarray(full.relay.draft_hidden)[e],
                               rtol=1e-5, atol=1e-5)
    L = np.asarray(before.relay.seq_lens)[e]
    table = np.asarray(before.req_to_token)
    if name == "ngram_device":  # the history now holds the input token at L
        slots = table[e, L]
        np.testing.assert_array_equal(np.asarray(paused.slot_tokens)[slots], np.asarray(full.slot_tokens)[slots])
        np.testing.assert_array_equal(np.asarray(paused.slot_tokens)[slots], np.asarray(before.relay.tokens)[e])
    if name == "draft_model":  # the K/V of L - 1 that the next step's drafts read
        slots = table[e, L - 1]
        for cache in ("draft_k_cache", "draft_v_cache"):
            np.testing.assert_allclose(np.asarray(getattr(paused, cache))[:, slots],
                                       np.asarray(getattr(full, cache))[:, slots], rtol=1e-5, atol=1e-5)
    if name == "eagle":  # the head's state for position L sits in the slot of L + 1
        slots = table[e, L + 1]
        for cache in ("draft_k_cache", "draft_v_cache"):
            np.testing.assert_allclose(np.asarray(getattr(paused, cache))[:, slots],
                                       np.asarray(getattr(full, cache))[:, slots], rtol=1e-5, atol=1e-5)


def test_a_draft_model_with_another_tokenizer_is_refused(tmp_path):
    """Its drafts would be other tokens than the target's: refused when both folders hold a
    tokenizer.json whose vocabularies differ; a draft model of the same tokenizer loads."""
    import json
    import shutil

    from jaxoverlap import LLM
    from jaxoverlap.models.loader import default_model_path

    same, other = tmp_path / "same", tmp_path / "other"
    for folder in (same, other):
        shutil.copytree(default_model_path(), folder)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = (next(w for w, i in vocab.items() if i == k) for k in (500, 501))
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens' ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tok))
    options = dict(speculative_algorithm="draft_model", load_format="dummy", max_running_requests=2,
                   max_context_len=64, kv_cache_tokens=256, page_size=8)
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(None, speculative_draft_model_path=str(other), **options)
    with LLM(None, speculative_draft_model_path=str(same), **options) as llm:
        [res] = llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
        assert len(res.token_ids) == 3


def test_a_prompt_refused_for_the_cache_names_the_speculative_room():
    """With a KV cache smaller than the context, a speculative row's reserved windows count
    against what a prompt may hold: the refusal says so and gives the longest prompt that
    fits, which is then admitted and served."""
    from jaxoverlap.errors import PromptTooLongError

    eng = make_engine(speculative_algorithm="ngram_device", speculative_num_steps=3, page_size=4,
                      max_context_len=128, kv_cache_tokens=40)
    room = eng.scheduler.row_headroom
    assert room >= 2 * 4  # two windows of 1 + 3 tokens
    longest = eng.kv_cache_tokens - room
    with pytest.raises(PromptTooLongError, match=rf"room for {room} more \(two speculative windows.*at most "
                                                 rf"{longest} prompt tokens fit"):
        eng.add_request("long", list(range(1, longest + 2)), SamplingParams(max_new_tokens=4))
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    finals = run_workload(eng, {0: [("fits", [(7 * i) % 90 + 1 for i in range(longest)], params)]})
    assert len(finals["fits"].token_ids) >= 1
    assert_drained(eng)
