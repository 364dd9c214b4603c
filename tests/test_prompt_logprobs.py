"""SamplingParams(prompt_logprobs=True): the logprob of every prompt token given the ones
before it, and whether it was the argmax, as a dense forward gives them, whether the prompt
is prefilled in one chunk or several, batched with other requests, with overlap on or off,
and never read from the prefix cache."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_fixtures import VOCAB, assert_drained, make_engine, run_workload, tiny_config, tiny_params
from jaxoverlap.errors import InvalidRequestError
from jaxoverlap.models.transformer import dense_logits
from jaxoverlap.sampling_params import SamplingParams

SCORE = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=True)


def reference(prompt):
    cfg = tiny_config()
    logits = dense_logits(tiny_params(cfg), cfg, jnp.asarray(prompt, jnp.int32))  # [T, V]
    logsm = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    ids = np.asarray(prompt)
    lp = [None] + logsm[np.arange(len(prompt) - 1), ids[1:]].tolist()
    top1 = [None] + (np.asarray(logits).argmax(-1)[:-1] == ids[1:]).tolist()
    return lp, top1


@pytest.mark.parametrize("overlap", [True, False])
def test_prompt_logprobs_match_a_dense_forward(overlap):
    rng = np.random.default_rng(3)
    prompts = {f"p{i}": [int(t) for t in rng.integers(0, VOCAB, size=n)] for i, n in enumerate((5, 40, 71))}
    # Every prompt's own greedy continuation, so that some prompt tokens are the argmax.
    eng = make_engine(disable_overlap=not overlap, chunked_prefill_size=32, max_context_len=128)
    greedy = run_workload(eng, {0: [("g", prompts["p1"][:20], SamplingParams(max_new_tokens=20, temperature=0.0,
                                                                          ignore_eos=True))]})
    prompts["cont"] = prompts["p1"][:20] + greedy["g"].token_ids
    # A plain request in the same batches, and one with the same prompt as a scored one
    # first, so that the prefix cache holds pages the scored one must not read.
    arrivals = {0: [("plain", prompts["p2"], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)),
                    ("p0", prompts["p0"], SCORE), ("p1", prompts["p1"], SCORE)],
                3: [("p2", prompts["p2"], SCORE), ("cont", prompts["cont"], SCORE)]}
    finals = run_workload(eng, arrivals)
    for rid in ("p0", "p1", "p2", "cont"):
        want_lp, want_top1 = reference(prompts[rid])
        got = finals[rid]
        assert got.metrics.cached_prompt_tokens == 0
        assert got.prompt_top1 == want_top1, rid
        assert got.prompt_logprobs[0] is None
        np.testing.assert_allclose(got.prompt_logprobs[1:], want_lp[1:], rtol=1e-4, atol=1e-4)
    assert all(finals["cont"].prompt_top1[21:])  # the greedy continuation is the argmax throughout
    assert finals["plain"].prompt_logprobs is None
    assert finals["p2"].token_ids == finals["plain"].token_ids[:2]
    assert_drained(eng)


def test_llm_and_batch_surface_prompt_logprobs(tmp_path):
    import json

    from jaxoverlap import LLM
    from jaxoverlap.batch import run_batch

    llm = LLM(None, max_running_requests=2, max_context_len=64, kv_cache_tokens=512, page_size=8)
    [res] = llm.generate(["Once upon a time there was"], SCORE)
    n = len(res.prompt_token_ids)
    assert len(res.prompt_logprobs) == len(res.prompt_top1) == n and res.prompt_logprobs[0] is None
    assert all(lp <= 0 for lp in res.prompt_logprobs[1:])
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt": "Once upon a time there was",
                               "sampling_params": {"prompt_logprobs": True, "max_new_tokens": 2}}) + "\n")
    run_batch(llm, str(inp), str(tmp_path / "out.jsonl"), progress=False)
    [record] = [json.loads(line) for line in open(tmp_path / "out.jsonl")]
    assert record["prompt_logprobs"] == res.prompt_logprobs and record["prompt_top1"] == res.prompt_top1
    llm.close()


@pytest.mark.parametrize("drafter", ["ngram_device", "eagle"])
def test_speculative_engines_score_prompts(drafter):
    """The speculative prefill (a leading column before each chunk) scores the chunk's own
    positions: chunked prompts, one scored from a later position with its context read from
    the prefix cache, and the decode after it unchanged."""
    rng = np.random.default_rng(4)
    prompts = {f"p{i}": [int(t) for t in rng.integers(0, VOCAB, size=n)] for i, n in enumerate((6, 45))}
    eng = make_engine(speculative_algorithm=drafter, max_running_requests=4, batch_buckets=(4,),
                      chunked_prefill_size=16)
    plain = run_workload(eng, {0: [("plain", prompts["p1"], SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                          ignore_eos=True))]})["plain"]
    tail = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=True,
                          prompt_logprobs_start=30)
    finals = run_workload(eng, {0: [("p0", prompts["p0"], SCORE), ("p1", prompts["p1"], SCORE)],
                                1: [("tail", prompts["p1"], tail)]})
    for rid in ("p0", "p1"):
        want_lp, want_top1 = reference(prompts[rid])
        assert finals[rid].prompt_top1 == want_top1, rid
        np.testing.assert_allclose(finals[rid].prompt_logprobs[1:], want_lp[1:], rtol=1e-4, atol=1e-4)
    got = finals["tail"]
    assert got.metrics.cached_prompt_tokens > 0 and got.prompt_logprobs[:30] == [None] * 30
    np.testing.assert_allclose(got.prompt_logprobs[30:], reference(prompts["p1"])[0][30:], rtol=1e-4, atol=1e-4)
    assert got.token_ids == plain.token_ids
    assert_drained(eng)


def test_loglikelihood_of_continuations():
    """LLM.loglikelihood: the sum of the continuation's prompt logprobs and whether greedy
    decoding gives it, for text and token-id pairs."""
    from jaxoverlap import LLM

    llm = LLM(None, max_running_requests=4, max_context_len=64, kv_cache_tokens=512, page_size=8)
    context = llm.tokenizer.encode("Once upon a time")
    [greedy] = llm.generate([context], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    other = [(t + 1) % llm.engine.model_config.vocab_size for t in greedy.token_ids]
    scores = llm.loglikelihood([(context, greedy.token_ids), (context, other), ("Once upon a time", " there")])
    [full] = llm.generate([context + greedy.token_ids], SCORE)
    # The two runs batch the prompt differently: float32 rounding apart (a few 1e-6 on CPU).
    assert scores[0] == (pytest.approx(sum(full.prompt_logprobs[len(context):]), abs=2e-5), True)
    assert scores[1][0] < scores[0][0] and scores[1][1] is False
    assert scores[2][0] < 0
    with pytest.raises(InvalidRequestError, match="non-empty"):
        llm.loglikelihood([("context", "")])
    llm.close()


def test_scoring_from_a_position_shares_the_context():
    """prompt_logprobs_start = k: positions from k on are scored exactly as with a whole
    prefill, earlier ones are None, and the pages before k - 1 may come from the prefix
    cache, so the choices of one question submitted together prefill their context once."""
    rng = np.random.default_rng(11)
    context = [int(t) for t in rng.integers(0, VOCAB, size=32)]
    choices = [[int(t) for t in rng.integers(0, VOCAB, size=n)] for n in (3, 5, 4)]
    eng = make_engine(chunked_prefill_size=64)
    arrivals = {0: [(f"c{i}", context + c, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True,
                                                           prompt_logprobs=True, prompt_logprobs_start=32))
                    for i, c in enumerate(choices)]}
    finals = run_workload(eng, arrivals)
    # Pages of 4: position 31's state scores position 32, so it is computed, and the cache
    # serves the 7 pages before its page (a page-aligned context: the edge case).
    assert [finals[f"c{i}"].metrics.cached_prompt_tokens for i in range(3)] == [0, 28, 28]
    for i, c in enumerate(choices):
        want_lp, want_top1 = reference(context + c)
        got = finals[f"c{i}"]
        assert got.prompt_logprobs[:32] == [None] * 32 and got.prompt_top1[:32] == [None] * 32
        assert got.prompt_top1[32:] == want_top1[32:]
        np.testing.assert_allclose(got.prompt_logprobs[32:], want_lp[32:], rtol=1e-4, atol=1e-4)
    assert_drained(eng)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs_start"):
        SamplingParams(prompt_logprobs=True, prompt_logprobs_start=0)


def test_loglikelihood_rolling_scores_every_token_in_lm_evals_windows():
    """LLM.loglikelihood_rolling: a text inside one window is the loglikelihood of the whole
    text after the prefix token; a longer one is scored in disjoint windows, each token
    with the context lm-eval's rolling windows give it (checked token by token against one
    scoring request per token)."""
    from jaxoverlap import LLM

    llm = LLM(None, max_running_requests=4, max_context_len=40, kv_cache_tokens=1024, page_size=8)
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(7)
    short = [int(t) for t in rng.integers(3, vocab, size=20)]
    long = [int(t) for t in rng.integers(3, vocab, size=47)]
    prefix = llm.tokenizer.bos_token_id if llm.tokenizer.bos_token_id is not None else llm.tokenizer.eos_token_id
    assert prefix is not None and llm.prefix_token_id == prefix  # as lm-eval picks it
    got = llm.loglikelihood_rolling([short, long, "Once upon a time"], max_length=10)
    whole = llm.loglikelihood_rolling([short])  # one window (default max_length: the context less two)
    assert whole[0] == pytest.approx(llm.loglikelihood([([prefix], short)])[0][0], abs=1e-4)

    # Token j of the long text lies in window j // 10 (the last one ends at the text's end);
    # its context starts max_length tokens before that window's end, or at the prefix.
    seq, L = [prefix] + long, 10
    prompts, params = [], []
    for j in range(len(long)):
        window_end = min(len(long), (j // L + 1) * L)
        context = seq[max(0, window_end - L): j + 1]
        prompts.append(context + [long[j]])
        params.append(SamplingParams(max_new_tokens=1, ignore_eos=True, prompt_logprobs=True,
                                     prompt_logprobs_start=len(context), detokenize=False))
    per_token = [r.prompt_logprobs[-1] for r in llm.generate(prompts, params)]
    assert got[1] == pytest.approx(sum(per_token), abs=1e-3)
    assert got[0] == pytest.approx(llm.loglikelihood([([prefix], short[:10])])[0][0]
                                   + llm.loglikelihood_rolling([short[10:]], max_length=10, prefix_token_id=short[9])[0]
                                   , abs=1e-3)
    assert got[2] < 0
    for bad, match in (({"max_length": 0}, "max_length"), ({"max_length": 39}, "max_length")):
        with pytest.raises(InvalidRequestError, match=match):
            llm.loglikelihood_rolling([short], **bad)
    with pytest.raises(InvalidRequestError, match="non-empty"):
        llm.loglikelihood_rolling([[]])
    llm.close()
