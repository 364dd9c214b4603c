"""Bad input, stop conditions and padded rows on the tiny engine."""
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_fixtures import VOCAB, make_engine, run_workload, tiny_config, tiny_params
from jaxoverlap import steps
from jaxoverlap.device_state import init_device_state
from jaxoverlap.errors import InvalidRequestError, PromptTooLongError
from jaxoverlap.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(min_p=2.0), "min_p"),
        (dict(top_k=-3), "top_k"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(seed=-1), "seed"),
        (dict(seed=True), "seed"),
        (dict(top_k=True), "top_k"),
        # int() would have made these tokens 2 and 3: a different token than asked.
        (dict(stop_token_ids=[2.7]), "stop_token_ids must hold integer token ids"),
        # A string would have iterated as its digits ("12" -> tokens 1 and 2).
        (dict(stop_token_ids="12"), "stop_token_ids must be a list of token ids"),
        (dict(stop_token_ids=12), "stop_token_ids must be a list of token ids"),
        (dict(logit_bias={3.9: 1.0}), "logit_bias must hold integer token ids"),
        (dict(logit_bias={"x": 1.0}), "logit_bias must hold integer token ids"),
    ],
)
def test_impossible_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "64"])
def test_impossible_max_context_len_is_refused(bad):
    from jaxoverlap.config import EngineConfig

    with pytest.raises(ValueError, match="max_context_len must be an integer"):
        EngineConfig(max_context_len=bad)


@pytest.mark.parametrize("options, match", [
    (dict(page_size="16"), "page_size must be an integer"),
    (dict(page_size=16.0), "page_size must be an integer"),
    (dict(max_running_requests=2.5), "max_running_requests must be an integer"),
    (dict(kv_cache_tokens=100.5), "kv_cache_tokens must be an integer or None"),
    (dict(kv_cache_tokens=0), "kv_cache_tokens must be >= 1"),
    (dict(kv_cache_tokens=-8), "kv_cache_tokens must be >= 1"),
    (dict(tensor_parallel_size="2"), "tensor_parallel_size must be an integer"),
    (dict(kv_cache_memory_fraction="0.5"), "kv_cache_memory_fraction must be a number"),
    (dict(disable_overlap="False"), "disable_overlap must be True or False"),
    (dict(speculative_algorithm=5), "speculative_algorithm must be a string or None"),
    (dict(compilation_cache_dir=123), "compilation_cache_dir must be a string or None"),
    (dict(batch_buckets=(-2, 4)), "batch_buckets must be batch sizes >= 1"),
    (dict(batch_buckets=(2.5, 4)), "batch_buckets must be batch sizes >= 1"),
    (dict(batch_buckets=()), "batch_buckets must be batch sizes >= 1"),
    (dict(batch_buckets="24"), "batch_buckets must be a list"),
    (dict(speculative_num_steps=3), "speculative_num_steps needs a speculative_algorithm"),
    (dict(speculative_disable_by_batch_size=4), "needs a speculative_algorithm"),
    (dict(speculative_ngram_min_match_window_size=9, speculative_ngram_max_match_window_size=2), "min_match"),
])
def test_options_of_the_wrong_kind_are_refused_by_name(options, match):
    """A string or float where an integer belongs, "False" for a flag, an impossible bucket
    list, speculative options without a drafter: a ValueError naming the option, before
    anything is built (they failed deep in JAX, or were silently taken otherwise)."""
    from jaxoverlap.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig(**options)


def test_options_are_normalized():
    import numpy as np

    from jaxoverlap.config import EngineConfig

    cfg = EngineConfig(page_size=np.int64(8), batch_buckets=[4, 2, 2])
    assert type(cfg.page_size) is int and cfg.page_size == 8
    assert cfg.batch_buckets == (2, 4)  # sorted, each once


def test_bad_prompts_are_rejected_and_others_keep_running():
    eng = make_engine(max_context_len=64)
    baseline = run_workload(make_engine(max_context_len=64), {0: [("ok", [1, 2, 3], GREEDY)]})["ok"].token_ids
    eng.add_request("ok", [1, 2, 3], GREEDY)
    eng.step()
    cases = [
        ([], InvalidRequestError, "empty prompt"),
        ([1, VOCAB], InvalidRequestError, "outside the vocabulary"),
        ([1, -2], InvalidRequestError, "outside the vocabulary"),
        ([1, 2.5], InvalidRequestError, "integers"),
        ([1, True], InvalidRequestError, "integers"),
        (np.array([1.0, 2.0]), InvalidRequestError, "integers"),
        (np.array([[1, 2]]), InvalidRequestError, "one dimension"),
        (np.array([1, VOCAB]), InvalidRequestError, "outside the vocabulary"),
        (list(range(1, 65)), PromptTooLongError, "context"),
        ("text without a tokenizer", InvalidRequestError, "tokenizer"),
        (None, InvalidRequestError, "string or a list"),
    ]
    for prompt, exc, match in cases:
        with pytest.raises(exc, match=match):
            eng.add_request("bad", prompt, GREEDY)
    with pytest.raises(InvalidRequestError, match="already running"):
        eng.add_request("ok", [4], GREEDY)
    assert "bad" not in eng.requests
    # Integers of other types are token ids too.
    eng.add_request("np", np.array([1, 2, 3], np.int32), GREEDY)
    eng.add_request("mixed", [np.int64(1), 2, 3], GREEDY)
    assert eng.requests["np"].prompt_ids == eng.requests["mixed"].prompt_ids == [1, 2, 3]
    assert all(type(t) is int for t in eng.requests["np"].prompt_ids + eng.requests["mixed"].prompt_ids)
    eng.abort("np"), eng.abort("mixed")
    finals = {o.request_id: o for o in eng.drain() if o.finished}
    assert sorted(finals) == ["mixed", "np", "ok"] and finals["ok"].token_ids == baseline
    assert finals["np"].finish_reason == finals["mixed"].finish_reason == "abort"
    eng.check_integrity()


def test_token_ids_of_any_integer_type_and_json_keys_are_accepted():
    sp = SamplingParams(stop_token_ids=[np.int64(5)], logit_bias={"7": 1.0, np.int32(3): 2.0})
    assert sp.stop_token_ids == (5,) and sp.logit_bias == ((3, 2.0), (7, 1.0))
    assert all(type(t) is int for t in sp.stop_token_ids + tuple(t for t, _ in sp.logit_bias))


def test_what_this_engine_cannot_serve_is_refused():
    eng = make_engine(max_context_len=64)  # no tokenizer
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
        eng.add_request("s", [1, 2, 3], SamplingParams(stop=["a"]))
    scored = SamplingParams(max_new_tokens=1, prompt_logprobs=True, prompt_logprobs_start=5)
    with pytest.raises(InvalidRequestError, match="scores nothing"):
        eng.add_request("p", [1, 2, 3, 4, 5], scored)
    eng.add_request("p", [1, 2, 3, 4, 5, 6], scored)  # position 5 exists
    [final] = [o for o in eng.drain() if o.finished]
    assert final.prompt_logprobs[:5] == [None] * 5 and final.prompt_logprobs[5] is not None
    with pytest.raises(ValueError, match="max_queued_requests must be >= 1"):
        make_engine(max_queued_requests=0)  # LLM.generate would have waited forever


def test_the_id_of_an_aborted_waiting_request_may_be_reused():
    """An aborted waiting request finishes at once; its final output comes with the next
    step. A new request under its id meanwhile must stay the engine's: abortable, and its
    id taken until it finishes."""
    eng = make_engine()
    eng.add_request("a", [1, 2, 3], GREEDY)
    assert eng.abort("a")
    eng.add_request("a", [1, 2, 3], dataclasses.replace(GREEDY, max_new_tokens=30))
    outs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [("a", "abort")]
    assert "a" in eng.requests
    with pytest.raises(InvalidRequestError, match="already running"):
        eng.add_request("a", [4, 5], GREEDY)
    assert eng.abort("a")
    [final] = [o for o in eng.drain() if o.finished]
    assert final.finish_reason == "abort" and len(final.token_ids) < 30
    eng.check_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_reused_id_that_finishes_in_its_first_step_keeps_the_old_final(overlap):
    """The aborted request's final and its successor's, due in the same step (the normal loop
    finishes a one-token request in its prefill step), both go out."""
    eng = make_engine(disable_overlap=not overlap)
    eng.add_request("a", [1, 2, 3], GREEDY)
    assert eng.abort("a")
    eng.add_request("a", [4, 5, 6], dataclasses.replace(GREEDY, max_new_tokens=1))
    finals = [(o.request_id, o.finish_reason, len(o.token_ids)) for o in eng.drain() if o.finished]
    assert finals == [("a", "abort", 0), ("a", "length", 1)]
    eng.check_integrity()


def test_accept_length_of_plain_decoding_is_one_after_retractions():
    """A retracted request's re-prefill samples a token that no decode step gave it."""
    reqs = [(f"r{i}", [(7 * i + j) % 90 + 1 for j in range(30)], dataclasses.replace(GREEDY, max_new_tokens=40))
            for i in range(6)]
    finals = run_workload(make_engine(kv_cache_tokens=128), {0: reqs})
    assert any(f.metrics.num_retractions for f in finals.values())
    assert all(f.metrics.accept_length == 1.0 for f in finals.values())


def test_prompt_longer_than_the_whole_cache(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxoverlap"):
        eng = make_engine(kv_cache_tokens=32, max_context_len=128)
    assert "cannot hold one request of max_context_len=128" in caplog.text
    with pytest.raises(PromptTooLongError, match="KV cache"):
        eng.add_request("big", list(range(1, 40)), GREEDY)
    # A request that grows past the cache ends with "length" where the warning said.
    out = run_workload(eng, {0: [("grows", list(range(1, 11)), dataclasses.replace(GREEDY, max_new_tokens=100))]})
    assert out["grows"].finish_reason == "length"
    assert 32 - 2 - 1 <= 10 + len(out["grows"].token_ids) <= 32
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxoverlap"):
        make_engine(kv_cache_tokens=32, max_context_len=30)
    assert "cannot hold" not in caplog.text


def test_stop_token_ids_eos_and_max_new_tokens():
    eng = make_engine()
    free = run_workload(eng, {0: [("a", [5, 6, 7], SamplingParams(max_new_tokens=20, temperature=0.0))]})["a"]
    assert len(free.token_ids) == 20 and free.finish_reason == "length"
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    out = run_workload(eng, {0: [("b", [5, 6, 7], SamplingParams(max_new_tokens=20, temperature=0.0,
                                                                 stop_token_ids=(stop_tok,)))]})["b"]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    # EOS from the model config stops unless ignore_eos.
    eos_eng = make_engine(cfg=tiny_config(eos_token_ids=(stop_tok,)))
    out = run_workload(eos_eng, {0: [("c", [5, 6, 7], SamplingParams(max_new_tokens=20, temperature=0.0))]})["c"]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    out = run_workload(eos_eng, {0: [("d", [5, 6, 7], SamplingParams(max_new_tokens=20, temperature=0.0,
                                                                     ignore_eos=True))]})["d"]
    assert out.token_ids == free.token_ids


def test_context_limit_finishes_with_length():
    eng = make_engine(max_context_len=24)
    out = run_workload(eng, {0: [("a", list(range(1, 21)), SamplingParams(max_new_tokens=50, temperature=0.0,
                                                                          ignore_eos=True))]})["a"]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    eng.check_integrity()


def test_padded_rows_never_touch_real_rows():
    """The same decode step with and without padded rows leaves identical K/V in the real
    requests' slots, identical relay entries and table rows; padded rows write only the
    dummy page."""
    cfg = tiny_config()
    params = tiny_params(cfg)
    ps, width = 4, 32
    state = init_device_state(num_layers=cfg.num_layers, num_slots=16 * ps, num_kv_heads=cfg.num_kv_heads,
                              head_dim=cfg.head_dim, dtype=jnp.float32, num_entries=5, table_width=width)
    # Prefill entries 1 and 2 (pages 1-2 and 3-4).
    res = steps.Reservations.of([1, 1, 2, 2], [0, 1, 0, 1], [1, 2, 3, 4])
    inp = steps.PrefillInputs(
        tokens=np.array([[3, 4, 5, 0], [7, 8, 9, 10]], np.int32), starts=np.zeros(2, np.int32),
        chunk_lens=np.array([3, 4], np.int32), entries=np.array([1, 2], np.int32),
        temperature=np.zeros(2, np.float32), top_k=np.zeros(2, np.int32), top_p=np.ones(2, np.float32),
        min_p=np.zeros(2, np.float32), seed=np.zeros(2, np.uint32))
    kw = dict(cfg=cfg, ctx_len=width, page_size=ps)
    state, _ = steps.prefill_step(params, state, inp, res, **kw)
    empty = steps.Reservations.empty(8)

    def copy(s):
        return jax.tree.map(lambda x: jnp.array(x, copy=True), s)

    a, out_a = steps.decode_step(params, copy(state), steps.DecodeInputs.of([1, 2], empty), **kw)
    b, out_b = steps.decode_step(params, copy(state), steps.DecodeInputs.of([1, 2, 0, 0, 0, 0, 0, 0], empty), **kw)
    np.testing.assert_array_equal(out_a.tokens, out_b.tokens[:2])
    real = np.arange(ps, 5 * ps)  # slots of pages 1..4
    np.testing.assert_array_equal(np.asarray(a.k_cache)[:, real], np.asarray(b.k_cache)[:, real])
    np.testing.assert_array_equal(np.asarray(a.v_cache)[:, real], np.asarray(b.v_cache)[:, real])
    np.testing.assert_array_equal(np.asarray(a.k_cache)[:, 5 * ps:], np.asarray(b.k_cache)[:, 5 * ps:])
    for f in dataclasses.fields(a.relay):
        x, y = np.asarray(getattr(a.relay, f.name)), np.asarray(getattr(b.relay, f.name))
        np.testing.assert_array_equal(x[1:], y[1:], err_msg=f.name)
    np.testing.assert_array_equal(np.asarray(a.req_to_token), np.asarray(b.req_to_token))
    assert int(np.asarray(b.relay.seq_lens)[0]) == 0


def test_device_inputs_are_sent_only_when_they_change():
    from jaxoverlap.runner import DeviceInputs

    inputs = DeviceInputs()
    a = np.array([1, 2, 0, 0], np.int32)
    first = inputs.put("entries", a)
    a[1] = 5  # the caller's array changes after the put: the cache kept its own copy
    second = inputs.put("entries", a)
    third = inputs.put("entries", np.array([1, 5, 0, 0], np.int32))
    assert second is not first and third is second
    np.testing.assert_array_equal(np.asarray(second), [1, 5, 0, 0])
    np.testing.assert_array_equal(np.asarray(first), [1, 2, 0, 0])
    other_shape = inputs.put("entries", np.array([1, 5], np.int32))
    assert other_shape is not third
    assert (inputs.sent, inputs.reused) == (3, 1)


def test_close_frees_the_cache_keeps_the_callers_weights_and_refuses_work():
    import gc
    import weakref

    from jaxoverlap.errors import EngineClosedError

    eng = make_engine()
    for i in range(3):
        eng.add_request(f"c{i}", [1, 2, 3, 4 + i], GREEDY)
    eng.step()
    eng.step()  # a step in flight, requests running
    cache = jax.tree.leaves(eng.runner.state)
    eng.close()
    assert all(x.is_deleted() for x in cache)
    assert not any(x.is_deleted() for x in jax.tree.leaves(tiny_params(tiny_config())))  # passed in: the caller's
    assert all(r.finished for r in eng.requests.values())
    with pytest.raises(EngineClosedError):
        eng.add_request("late", [1, 2, 3], GREEDY)
    with pytest.raises(EngineClosedError):
        eng.step()
    eng.close()  # a second close does nothing
    ref = weakref.ref(eng)
    del eng
    gc.collect()
    assert ref() is None  # close gave the frozen objects back to the collector


def test_a_dropped_engine_is_freed_at_once_or_once_the_next_engine_is_built():
    """An engine is in no reference cycle of its own: dropped, refcounting frees it, frozen
    collector (freeze_gc) or not. One caught in a cycle (a caller's, a traceback's) is
    frozen garbage: building the next engine collects it before loading anything."""
    import gc
    import weakref

    ref = weakref.ref(make_engine())
    assert ref() is None
    cycle = [make_engine()]
    cycle.append(cycle)
    ref = weakref.ref(cycle[0])
    gc.freeze()
    del cycle
    gc.collect()
    assert ref() is not None  # frozen garbage
    make_engine()
    assert ref() is None


def test_a_stop_string_in_the_text_flushed_at_the_end_still_ends_it():
    """Byte-level vocabularies hold tokens of whole characters followed by the first byte of
    a cut one (GPT-2's 'Ġâ' = b" \\xe2"): the decoder holds such a token's text back, so a
    stop string in its whole part is only seen when the request ends and the text is
    flushed. It must still end the text there."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from jaxoverlap.models.tokenizer import Tokenizer

    vocab = {"<|endoftext|>": 0}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    vocab["Ġâ"] = len(vocab)
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "â")]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|endoftext|>"])
    tok = Tokenizer(hf, eos_token_ids=[0])
    assert tok.encode("a \u2014")[:2] == [vocab["a"], vocab["Ġâ"]]
    eng = make_engine(tiny_config(vocab_size=320), tokenizer=tok)
    forced = {vocab["Ġâ"]: 100.0}
    for stop, text, reason in (([" "], "", "stop"), (["x"], " \ufffd", "length")):
        params = SamplingParams(max_new_tokens=1, temperature=0.0, logit_bias=forced, stop=stop)
        eng.add_request("s", tok.encode("aaaa"), params)
        outs = []
        while eng.has_work():
            outs.extend(eng.step())
        assert outs[-1].token_ids == [vocab["Ġâ"]]
        assert ("".join(o.new_text for o in outs), outs[-1].finish_reason) == (text, reason), stop
