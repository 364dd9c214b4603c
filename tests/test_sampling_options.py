"""Repetition, frequency and presence penalties and min_new_tokens (penalties.py), and
top_logprobs: the engine's tokens equal a dense forward's with the rules applied on the
host, greedy and seeded, over chunked prompts, with overlap on and off, after a retraction,
and next to a prefix cache that holds the same prompt; the top logprobs equal the dense
forward's."""
from __future__ import annotations

import collections

import jax.numpy as jnp
import numpy as np
import pytest

from engine_fixtures import VOCAB, assert_drained, make_engine, run_workload, tiny_config, tiny_params
from jaxoverlap import penalties
from jaxoverlap.errors import InvalidRequestError
from jaxoverlap.models.transformer import dense_logits
from jaxoverlap.sampling import sample
from jaxoverlap.sampling_params import SamplingParams


def penalized(logits: np.ndarray, prompt, output, rep: float, freq: float, pres: float) -> np.ndarray:
    """The rule as vLLM states it, one token at a time (on logits that logit_bias has
    already moved: vLLM adds the bias first)."""
    out = np.array(logits, np.float32)
    for t in set(prompt) | set(output):
        out[t] = out[t] / np.float32(rep) if out[t] > 0 else out[t] * np.float32(rep)
    for t, n in collections.Counter(output).items():
        out[t] -= np.float32(freq) * np.float32(n) + np.float32(pres)
    return out


def next_logits(seq) -> np.ndarray:
    """The dense forward's logits after `seq`, computed over `seq` padded to 128 tokens: the
    causal mask keeps the padding out, and one shape compiles once for every length."""
    cfg = tiny_config()
    padded = jnp.asarray(list(seq) + [0] * (128 - len(seq)), jnp.int32)
    return np.asarray(dense_logits(tiny_params(cfg), cfg, padded)[len(seq) - 1])


def reference(prompt, params: SamplingParams, seed: int = 0) -> list[int]:
    """Greedy or seeded tokens of a dense forward with the rules applied on the host (the
    tiny model has no EOS: stop_token_ids are the stop tokens)."""
    seq, out = list(prompt), []
    while len(out) < params.max_new_tokens and not (out and out[-1] in params.stop_token_ids):
        logits = np.array(next_logits(seq), np.float32)  # a writable copy
        for tok, bias in params.logit_bias:
            logits[tok] += np.float32(bias)
        logits = penalized(logits, prompt, out, params.repetition_penalty, params.frequency_penalty,
                           params.presence_penalty)
        if len(out) < params.min_new_tokens:
            logits[list(params.stop_token_ids)] = -np.inf
        if params.temperature == 0:
            tok = int(np.argmax(logits))
        else:
            f32, i32 = (lambda x: jnp.asarray([x], jnp.float32)), (lambda x: jnp.asarray([x], jnp.int32))
            tok = int(sample(jnp.asarray(logits)[None], f32(params.temperature), i32(params.top_k),
                             f32(params.top_p), f32(params.min_p), jnp.asarray([seed], jnp.uint32),
                             i32(len(seq)))[0][0])
        seq.append(tok)
        out.append(tok)
    return out


def _prompt(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    few = rng.integers(0, VOCAB, size=6)  # repeated tokens, so the prompt's own tokens matter
    return [int(t) for t in rng.choice(few, size=n)]


CASES = {
    "plain": SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True),
    "rep": SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.8),
    "freq": SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, frequency_penalty=1.5),
    "pres": SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, presence_penalty=2.0),
    "all": SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=0.7,
                          frequency_penalty=-0.5, presence_penalty=0.8),
    "sampled": SamplingParams(max_new_tokens=16, temperature=0.9, top_k=20, seed=7, ignore_eos=True,
                              repetition_penalty=1.3, frequency_penalty=0.6),
}


@pytest.mark.parametrize("overlap", [True, False])
def test_penalties_match_a_dense_reference(overlap):
    prompt = _prompt(0, 40)  # three prefill chunks of 16
    plain = reference(prompt, CASES["plain"])
    # A bias that bans the plain run's first token (JSON-style key) and favours its fourth,
    # with a penalty on top.
    cases = dict(CASES, bias=SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, presence_penalty=0.5,
                                            logit_bias={str(plain[0]): -100, plain[3]: 6.0}))
    eng = make_engine(disable_overlap=not overlap, chunked_prefill_size=16)
    # The same prompt finishes first, so that the prefix cache holds its pages: the
    # penalized requests must still prefill (and see) every prompt token.
    first = run_workload(eng, {0: [("cached", prompt, CASES["plain"])]})
    arrivals = {0: [(name, prompt, p) for name, p in cases.items() if name in ("plain", "rep", "freq")],
                2: [(name, prompt, p) for name, p in cases.items() if name in ("pres", "all", "sampled", "bias")]}
    finals = run_workload(eng, arrivals)
    assert finals["plain"].token_ids == first["cached"].token_ids == plain
    assert finals["plain"].metrics.cached_prompt_tokens > 0
    for name in ("rep", "freq", "pres", "all", "sampled", "bias"):
        want = reference(prompt, cases[name], seed=7)
        assert finals[name].token_ids == want, name
        assert finals[name].metrics.cached_prompt_tokens == 0, name
        if name != "sampled":
            assert want != finals["plain"].token_ids, f"{name}: the case should change the greedy output"
    assert_drained(eng)


def test_penalized_requests_survive_retraction():
    """A cache of 96 tokens for four requests that grow to 36 each forces retractions; a
    retracted request prefills its output again, which must count as generated."""
    prompts = [_prompt(i, 12) for i in range(4)]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=0.7,
                            presence_penalty=0.3, repetition_penalty=1.2)
    outs, retractions = [], []
    for kv in (96, 512):
        eng = make_engine(kv_cache_tokens=kv)
        finals = run_workload(eng, {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
        outs.append({k: v.token_ids for k, v in finals.items()})
        retractions.append(eng.stats()["num_retractions"])
        assert_drained(eng)
    assert retractions[0] > 0 and retractions[1] == 0
    assert outs[0] == outs[1]
    assert outs[1]["r0"] == reference(prompts[0], params)


def _prefill_inputs(params, prompt_lens, first, stop_ids, min_end):
    K = penalties.MAX_STOP_IDS
    stops = np.full((len(first), K), -1, np.int32)
    for i, ids in enumerate(stop_ids):
        stops[i, : len(ids)] = ids
    R, K = len(first), penalties.MAX_LOGIT_BIAS
    return penalties.PrefillPenaltyInputs(jnp.asarray(params, jnp.float32), jnp.asarray(prompt_lens, jnp.int32),
                                          jnp.asarray(first), jnp.asarray(stops), jnp.asarray(min_end, jnp.int32),
                                          jnp.full((R, K), -1, jnp.int32), jnp.zeros((R, K), jnp.float32))


def test_record_prefill_counts_a_resumed_output():
    """A resumed request's chunk: prompt positions are seen, positions past the prompt are
    generated (counted); the row's first chunk clears what the entry's previous owner left
    and marks the stop tokens; stop tokens are banned before min_end only."""
    pen = penalties.init_penalty_state(3, 10)
    pen = penalties.record_generated(pen, jnp.asarray([1]), jnp.asarray([9]))  # a previous owner's token
    inp = _prefill_inputs([[1.0, 0.5, 0.0], penalties.NEUTRAL], [3, 0], [True, False], [[8, 5], []], [7, 0])
    tokens = jnp.asarray([[4, 4, 2, 7, 7, 0], [0, 0, 0, 0, 0, 0]], jnp.int32)  # prompt 4 4 2, then 7 7
    pen = penalties.record_prefill(pen, jnp.asarray([1, 0]), tokens, jnp.asarray([0, 0]), jnp.asarray([5, 0]), inp)
    row = np.asarray(pen.history[1])
    assert (row & penalties.COUNT).tolist() == [0, 0, 0, 0, 0, 0, 0, 2, 0, 0]
    assert ((row & penalties.SEEN) != 0).nonzero()[0].tolist() == [2, 4, 7]
    assert ((row & penalties.STOP) != 0).nonzero()[0].tolist() == [5, 8]
    np.testing.assert_array_equal(np.asarray(pen.params[1]), [1.0, 0.5, 0.0])
    assert int(pen.min_end[1]) == 7
    # A later chunk of the same request adds to the row instead of clearing it.
    inp2 = _prefill_inputs([[1.0, 0.5, 0.0]], [3], [False], [[8, 5]], [7])
    pen = penalties.record_prefill(pen, jnp.asarray([1]), jnp.asarray([[7, 3]]), jnp.asarray([5]),
                                   jnp.asarray([2]), inp2)
    row = np.asarray(pen.history[1])
    assert (row & penalties.COUNT).tolist() == [0, 0, 0, 1, 0, 0, 0, 3, 0, 0]
    assert ((row & penalties.STOP) != 0).nonzero()[0].tolist() == [5, 8]
    logits = jnp.zeros((2, 10), jnp.float32)
    out = np.asarray(penalties.apply(logits, jnp.asarray([6, 7]), *penalties.rows(pen, jnp.asarray([1, 1]))))
    assert np.isneginf(out[0]).nonzero()[0].tolist() == [5, 8] and not np.isneginf(out[1]).any()


@pytest.mark.parametrize("overlap", [True, False])
def test_min_new_tokens_masks_stop_tokens(overlap):
    """A stop token the plain run ends on at output 2 is masked until output 6; the same
    prompt cached before may serve min_new_tokens (unlike penalties)."""
    prompt = _prompt(1, 21)
    eng = make_engine(disable_overlap=not overlap, chunked_prefill_size=8)
    plain = run_workload(eng, {0: [("plain", prompt, CASES["plain"])]})["plain"].token_ids
    stop = plain[2]
    early = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[stop, 1])
    late = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[stop, 1], min_new_tokens=6)
    finals = run_workload(eng, {0: [("early", prompt, early), ("late", prompt, late)]})
    assert finals["early"].token_ids == plain[:3] and finals["early"].finish_reason == "stop"
    want = reference(prompt, late)
    assert finals["late"].token_ids == want and len(want) > 6 and stop not in want[:6]
    assert finals["late"].metrics.cached_prompt_tokens > 0
    assert_drained(eng)


def test_parameters_past_int32_run_as_their_largest_meaning():
    """top_k and min_new_tokens have no upper bound: a top_k past the vocabulary keeps every
    token, and a min_new_tokens past the context bans the stop tokens to its end. Past int32
    they once made the prefill's launch fail, and with it the requests batched alongside."""
    prompt = _prompt(2, 9)
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    huge = 2**31 - 1
    cases = {"plain": SamplingParams(max_new_tokens=5, temperature=0.7, seed=3),
             "top_k": SamplingParams(max_new_tokens=5, temperature=0.7, seed=3, top_k=huge + 1),
             "min_new": SamplingParams(max_new_tokens=huge, min_new_tokens=huge, temperature=0.0,
                                       stop_token_ids=[7]),
             "greedy": greedy}
    eng = make_engine(max_context_len=48)
    finals = run_workload(eng, {0: [(rid, prompt, p) for rid, p in cases.items()]})
    assert finals["top_k"].token_ids == finals["plain"].token_ids
    assert finals["min_new"].finish_reason == "length" and 7 not in finals["min_new"].token_ids
    assert len(prompt) + len(finals["min_new"].token_ids) == 48
    assert finals["greedy"].token_ids == reference(prompt, greedy)
    assert_drained(eng)


def test_penalty_params_are_checked_and_refused_where_not_served():
    for bad in (dict(repetition_penalty=0.0), dict(repetition_penalty=float("nan")), dict(frequency_penalty=2.5),
                dict(presence_penalty=-3.0), dict(presence_penalty="1"), dict(min_new_tokens=-1),
                dict(max_new_tokens=4, min_new_tokens=5), dict(logit_bias={1: 101.0}), dict(logit_bias={-2: 1.0}),
                dict(logit_bias={"x": 1.0}), dict(logit_bias={i: 1.0 for i in range(65)})):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)
    assert not SamplingParams().has_penalties and SamplingParams(presence_penalty=0.1).has_penalties
    eng = make_engine(enable_penalties=False)
    assert eng.runner.state.penalty is None
    for params in (SamplingParams(frequency_penalty=0.5), SamplingParams(min_new_tokens=2),
                   SamplingParams(logit_bias={5: 1.0})):
        with pytest.raises(InvalidRequestError, match="enable_penalties=False"):
            eng.add_request("a", [1, 2, 3], params)
    eng.add_request("b", [1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0.0))  # the rest still runs
    assert len(run_workload(eng, {})["b"].token_ids) == 3
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        make_engine().add_request("a", [1, 2, 3], SamplingParams(logit_bias={VOCAB: 1.0}))
    with pytest.raises(InvalidRequestError, match="at most 16 stop token ids"):
        make_engine().add_request("a", [1, 2, 3], SamplingParams(min_new_tokens=2, stop_token_ids=list(range(17))))
    spec = make_engine(speculative_algorithm="ngram")  # served there too (test_spec_penalties.py)
    spec.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=3, repetition_penalty=1.2))
    assert len(run_workload(spec, {})["a"].token_ids) == 3


def test_boolean_params_take_only_bools():
    """A JSON batch line's "false" (a string) is true to Python: the flags take real bools."""
    for name in ("ignore_eos", "logprobs", "prompt_logprobs", "detokenize"):
        for value in ("false", 0, 1, None):
            with pytest.raises(InvalidRequestError, match=f"{name} must be true or false"):
                SamplingParams(**{name: value})
        assert getattr(SamplingParams(**{name: True}), name) is True
        assert getattr(SamplingParams(**{name: False}), name) is False


def _apply(logits, history, params, min_end=0, position=10, bias=None):
    """penalties.apply on one row."""
    K = penalties.MAX_LOGIT_BIAS
    ids, values = np.full((1, K), -1, np.int32), np.zeros((1, K), np.float32)
    for i, (tok, b) in enumerate((bias or {}).items()):
        ids[0, i], values[0, i] = tok, b
    return np.asarray(penalties.apply(jnp.asarray([logits], jnp.float32), jnp.asarray([position]),
                                      jnp.asarray([history], jnp.int32), jnp.asarray([params], jnp.float32),
                                      jnp.asarray([min_end], jnp.int32), jnp.asarray(ids), jnp.asarray(values)))[0]


def test_logit_bias_applies_before_the_penalties():
    """vLLM's order: logit_bias, then the penalties on the biased logits, then the
    min_new_tokens ban. Token 0 (seen) with bias +4 and repetition_penalty 2: (4 + 4) / 2 = 4,
    so token 1 (5) wins; bias after the penalty would give 4 / 2 + 4 = 6 and token 0."""
    seen = penalties.SEEN
    out = _apply([4.0, 5.0], [seen, 0], [2.0, 0.0, 0.0], bias={0: 4.0})
    np.testing.assert_array_equal(out, [4.0, 5.0])
    # A bias that turns a negative logit positive: divided, not multiplied, by the penalty;
    # then the frequency (2 generated) and presence penalties subtracted.
    out = _apply([-1.0, 0.0, 0.5], [seen | 2, 0, seen], [2.0, 0.25, 0.5], bias={0: 3.0, 2: -1.5})
    np.testing.assert_allclose(out, [(-1.0 + 3.0) / 2.0 - 0.25 * 2 - 0.5, 0.0, (0.5 - 1.5) * 2.0], rtol=1e-6)
    # The min_new_tokens ban comes last: +100 does not lift a banned stop token.
    out = _apply([1.0, 2.0], [penalties.STOP | seen, 0], [0.5, 0.0, 0.0], min_end=11, bias={0: 100.0})
    assert np.isneginf(out[0]) and out[1] == 2.0


def test_numpy_scalars_are_taken_as_python_numbers():
    """numpy scalars (np.float32 from a model's config, np.int64 from an array) pass for the
    numeric fields and are stored as Python's int / float; bools and non-numbers stay refused."""
    sp = SamplingParams(max_new_tokens=np.int64(16), temperature=np.float32(0.5), top_k=np.int32(5),
                        top_p=np.float32(0.875), min_p=np.float64(0.25), seed=np.uint32(2**32 - 1), n=np.int8(2),
                        top_logprobs=np.int16(3), repetition_penalty=np.float16(1.5),
                        frequency_penalty=np.float32(-0.5), presence_penalty=np.int64(1),
                        min_new_tokens=np.int64(2), prompt_logprobs_start=np.int32(2),
                        logit_bias={np.int64(7): np.float32(2.5), 3: np.int32(-4)})
    assert (sp.max_new_tokens, sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.seed, sp.n, sp.top_logprobs,
            sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty, sp.min_new_tokens,
            sp.prompt_logprobs_start) == (16, 0.5, 5, 0.875, 0.25, 2**32 - 1, 2, 3, 1.5, -0.5, 1, 2, 2)
    for name in ("max_new_tokens", "top_k", "seed", "n", "top_logprobs", "min_new_tokens", "prompt_logprobs_start",
                 "presence_penalty"):
        assert type(getattr(sp, name)) is int, name
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty"):
        assert type(getattr(sp, name)) is float, name
    assert sp.logit_bias == ((3, -4), (7, 2.5)) and [type(b) for _, b in sp.logit_bias] == [int, float]
    assert SamplingParams(top_k=np.int64(-1)).top_k == 0
    assert [p.seed for p in sp.samples()] == [2**32 - 1, 0]
    for bad in (dict(temperature=np.bool_(True)), dict(top_k=np.bool_(True)), dict(max_new_tokens=np.float32(4.0)),
                dict(top_k=np.float64(2.0)), dict(top_p=np.float32("nan")), dict(seed=np.int64(-1)),
                dict(temperature=np.str_("0.5")), dict(logit_bias={1: np.bool_(True)})):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)


def test_malformed_digit_strings_are_invalid_requests():
    """"--5" and "²" pass str.isdigit() (after the minus is stripped) but not int(): a token id
    string is an optional minus and ASCII digits, anything else an InvalidRequestError."""
    for bad in ("--5", "\u00b2", "-", "", "1_0", "5.0", "0x5", "\u0665"):
        for kw in (dict(stop_token_ids=[bad]), dict(logit_bias={bad: 1.0})):
            with pytest.raises(InvalidRequestError, match="must hold integer token ids"):
                SamplingParams(**kw)
    assert SamplingParams(stop_token_ids=[" 12 "], logit_bias={"007": 1.0}).stop_token_ids == (12,)
    assert SamplingParams(logit_bias={"007": 1.0}).logit_bias == ((7, 1.0),)
    with pytest.raises(InvalidRequestError, match="must be >= 0"):
        SamplingParams(stop_token_ids=["-5"])


@pytest.mark.parametrize("overlap", [True, False])
def test_top_logprobs_match_a_dense_forward(overlap):
    """top_logprobs: per output token (the prefill's first), the k most likely tokens of the
    raw distribution and their logprobs, as a dense forward gives them; next to a request
    that asks for none, for a penalized request (the list stays the raw model's), and for
    one that also scores its prompt (both in one prefill program's output)."""
    import jax

    prompt = _prompt(2, 19)
    top = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, top_logprobs=5)
    pen = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, top_logprobs=3, repetition_penalty=2.0)
    both = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, top_logprobs=2, prompt_logprobs=True)
    eng = make_engine(disable_overlap=not overlap, chunked_prefill_size=8)
    arrivals = {0: [("top", prompt, top), ("plain", prompt, CASES["plain"])],
                3: [("pen", prompt, pen), ("both", prompt, both)]}
    lists, finals, it = {"top": [], "pen": [], "plain": [], "both": []}, {}, 0
    while it <= max(arrivals) or eng.has_work():
        for rid, p, params in arrivals.get(it, []):
            eng.add_request(rid, p, params)
        for o in eng.step():
            if o.new_top_logprobs is not None:
                lists[o.request_id].extend(o.new_top_logprobs)
            if o.finished:
                finals[o.request_id] = o
        it += 1
    assert lists["plain"] == []
    assert finals["pen"].token_ids != finals["top"].token_ids  # the penalty chose other tokens
    assert finals["both"].token_ids == finals["top"].token_ids
    full = np.asarray(jax.nn.log_softmax(dense_logits(tiny_params(tiny_config()), tiny_config(),
                                                      jnp.asarray(prompt, jnp.int32)), axis=-1))
    np.testing.assert_allclose(finals["both"].prompt_logprobs[1:], full[np.arange(18), prompt[1:]], atol=1e-4)
    for rid, k in (("top", 5), ("pen", 3), ("both", 2)):
        seq = list(prompt)
        assert len(lists[rid]) == 6
        for tok, alts in zip(finals[rid].token_ids, lists[rid]):
            logsm = np.asarray(jax.nn.log_softmax(next_logits(seq)))
            want = np.argsort(-logsm)[:k]
            assert [t for t, _ in alts] == want.tolist(), rid
            np.testing.assert_allclose([lp for _, lp in alts], logsm[want], atol=1e-5)
            seq.append(tok)
    assert_drained(eng)
