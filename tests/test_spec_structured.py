"""Structured output with speculative decoding: each window position's allowed tokens
follow from the drafts before it (structured.Grammars.window_bitmask), and a constrained
batch runs its speculative step as draft, verify and accept programs, the accept program
launched once step N is processed and the drafts are on the host (speculative/step.py).

On the embedded default model (random weights: every valid output is the constraint's
doing) with each drafter kind: device n-gram, host n-gram, and EAGLE with a random head
(sampled drafts with their own distribution)."""
import re

import numpy as np
import pytest

from jaxoverlap import LLM, SamplingParams
from test_structured_output import (COLORS, REGEX, SCHEMA, _check_schema, check_min_new_tokens, log_split_launches,
                                    min_new_tokens_params)

DRAFTERS = ["ngram_device", "ngram", "eagle"]


def _params(temperature: float, seed: int = 0) -> list[SamplingParams]:
    def sp(constraint, n):
        return SamplingParams(max_new_tokens=n, temperature=temperature, seed=seed, structured_output=constraint)

    return [sp({"json_schema": SCHEMA}, 64), sp({"regex": REGEX}, 32), sp({"choice": COLORS}, 16),
            sp({"regex": "(ab ){3,12}end"}, 48)]


def _check(results) -> None:
    """Each output is what its constraint allows, and ended by its grammar."""
    schema, regex, choice, repeat = results
    _check_schema(schema.text)
    assert re.fullmatch(REGEX, regex.text), regex.text
    assert choice.text in COLORS, choice.text
    assert re.fullmatch("(ab ){3,12}end", repeat.text), repeat.text
    for r in results:
        assert r.finish_reason == "stop", (r.text, r.finish_reason)


def _engine(algorithm=None) -> LLM:
    spec = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": 4} if algorithm else {}
    return LLM(None, max_running_requests=8, max_context_len=256, kv_cache_tokens=2048, page_size=8, **spec)


@pytest.fixture(scope="module")
def plain_greedy():
    """The constrained greedy outputs of an engine without a drafter (speculative decoding
    is lossless for greedy rows: each drafter must give exactly these)."""
    with _engine() as llm:
        return [r.token_ids for r in llm.generate(["Once upon a time"] * 4, _params(0.0))]


@pytest.mark.parametrize("algorithm", DRAFTERS)
def test_constrained_outputs_with_each_drafter(algorithm, plain_greedy):
    with _engine(algorithm) as llm:
        for overlap in (True, False):
            llm.engine.set_overlap(overlap)
            greedy = llm.generate(["Once upon a time"] * 4, _params(0.0))
            _check(greedy)
            assert [r.token_ids for r in greedy] == plain_greedy
            sampled = [llm.generate(["Once upon a time"] * 4, _params(0.8, seed)) for seed in (1, 2)]
            for results in sampled:
                _check(results)
            if overlap:
                first = [[r.token_ids for r in results] for results in sampled]
            elif algorithm != "ngram":
                # Seeded sampling gives the same tokens with and without overlap. (Not with the
                # host n-gram drafter: its drafts come from a trie of every request's tokens,
                # whose content depends on the loop, and the drafts decide a sampled row's tokens.)
                assert [[r.token_ids for r in results] for results in sampled] == first
            llm.engine.drain()
        # Drafts are accepted under a constraint: an n-gram drafter finds the pattern the
        # grammar repeats (a random EAGLE head's drafts are rejected).
        count = SamplingParams(max_new_tokens=60, temperature=0.0, structured_output={"regex": "(one two three ){2,8}"})
        [out] = llm.generate(["Count: one two three one two three"], count)
        assert re.fullmatch("(one two three ){2,8}", out.text), out.text
        if algorithm != "eagle":
            assert out.metrics.accept_length > 1.5, out.metrics.accept_length
        assert llm.engine.runner.grammars is None and llm.engine._constrained == 0


@pytest.mark.parametrize("algorithm", ["ngram_device", "eagle"])
def test_unconstrained_neighbours_get_the_tokens_they_get_alone(algorithm):
    """A speculative step split in three programs (all tokens allowed for unconstrained rows)
    gives those rows what the fused step gives them: greedy and sampled, with penalties and
    top logprobs."""
    plain = [SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, top_logprobs=2),
             SamplingParams(max_new_tokens=24, temperature=0.9, seed=4, ignore_eos=True, logprobs=True),
             SamplingParams(max_new_tokens=24, temperature=0.7, seed=8, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.4)]
    prompts = ["The cat", "A river", "Once"]
    with _engine(algorithm) as llm:
        alone = llm.generate(prompts, plain)
        mixed = llm.generate(["Once upon a time"] * 4 + prompts, _params(0.5, 3) + plain)
        _check(mixed[:4])
        for a, b in zip(alone, mixed[4:]):
            assert a.token_ids == b.token_ids
            if a.logprobs is not None:
                np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
            if a.top_logprobs is not None:
                assert [[t for t, _ in pos] for pos in a.top_logprobs] == [[t for t, _ in pos] for pos in b.top_logprobs]


def test_constrained_speculative_steps_keep_overlap(monkeypatch):
    """Under overlap, a constrained speculative batch launches its draft program and verify
    pass before the step in flight is processed, and its accept program after; no iteration
    waits for the step in flight before it launches."""
    with _engine("ngram_device") as llm:
        engine = llm.engine
        events = log_split_launches(engine, monkeypatch)
        engine.guard_launch = True  # no launch reads anything back from the device
        results = llm.generate(["Once upon a time"] * 4, _params(0.0))
        _check(results)
        assert all(t.fresh_wait_s == 0 for t in engine.timings)
        split = [i for i, e in enumerate(events) if e == "forward"]
        assert len(split) > 5
        assert sum(events[i + 1 : i + 3] == ["process", "sample"] for i in split) >= len(split) - 1


def _row(matcher):
    from types import SimpleNamespace

    return SimpleNamespace(req=SimpleNamespace(matcher=matcher))


def _bits(mask_row: np.ndarray) -> set[int]:
    """The token ids a [words] int32 bitmask allows."""
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_window_masks_follow_the_drafts():
    """Position j's mask is the grammar's after the row's first j drafts, up to the first
    draft it refuses (or the row's draft count); later positions, rows without a constraint
    and padding allow everything; the requests' matchers do not move."""
    from jaxoverlap.models.loader import default_model_path
    from jaxoverlap.models.tokenizer import Tokenizer
    from jaxoverlap.structured import Grammars, StructuredOutput

    tokenizer = Tokenizer.from_path(default_model_path())
    grammars = Grammars(tokenizer, tokenizer.vocab_size, [])
    spec = StructuredOutput(regex="[0-9]{3}-[a-z]{2,4}")
    good = tokenizer.encode("123-abcd")
    k = len(good) + 1
    bad = tokenizer.encode("x")[0]
    drafts = np.zeros((4, k), np.int32)
    drafts[0, : len(good)] = good  # every draft valid (the last column is padding: count says so)
    drafts[1, :2], drafts[1, 2] = good[:2], bad  # the third draft is refused
    drafts[2, :] = good[0]  # no constraint
    counts = np.array([len(good), k, k, 0])
    matchers = [grammars.matcher(spec), grammars.matcher(spec), None]
    before = [grammars.bitmask([_row(m)], 1)[0] for m in matchers[:2]]
    mask, failed = grammars.window_bitmask([_row(m) for m in matchers], 4, drafts, counts)
    assert mask.shape == (4, k + 1, grammars.words) and failed == {}

    def expected(tokens):
        m = grammars.matcher(spec)
        assert m.consume_tokens(list(tokens))
        return grammars.bitmask([_row(m)], 1)[0]

    for j in range(len(good) + 1):
        np.testing.assert_array_equal(mask[0, j], expected(good[:j]))
    for j in range(3):
        np.testing.assert_array_equal(mask[1, j], expected(good[:j]))
    assert bad not in _bits(mask[1, 2])
    assert (mask[1, 3:] == -1).all() and (mask[2:] == -1).all() and (mask[0, len(good) + 1:] == -1).all()
    # The grammar's own restriction shows: a digit first, never a letter.
    assert tokenizer.encode("1")[0] in _bits(mask[0, 0]) and tokenizer.encode("a")[0] not in _bits(mask[0, 0])
    for m, b in zip(matchers, before):  # the requests' own matchers never moved
        np.testing.assert_array_equal(grammars.bitmask([_row(m)], 1)[0], b)
        assert not m.is_stopped() and not m.is_error()
    # A draft that completes the grammar: the request ends with it (engine._check_token), so
    # the positions after it are never read; the request's matcher has not moved.
    yes = tokenizer.encode("yes")
    choice = grammars.matcher(StructuredOutput(choice=("yes", "no")))
    window = np.array([yes + [bad, bad]], np.int32)
    mask, _ = grammars.window_bitmask([_row(choice)], 1, window, np.array([window.shape[1]]))
    for j in range(len(yes)):
        assert yes[j] in _bits(mask[0, j]) and bad not in _bits(mask[0, j])
    assert (mask[0, len(yes):] == -1).all()
    assert not choice.is_stopped() and choice.consume_tokens(yes) and choice.is_stopped()


def test_min_new_tokens_in_verification():
    """min_new_tokens bans EOS in each window position that the grammar lets continue; the
    tokens equal the plain engine's (greedy)."""
    with _engine() as llm:
        plain = [r.token_ids for r in llm.generate(["Once upon a time"] * 3, min_new_tokens_params(llm, 6))]
    for algorithm in ("ngram_device", "eagle"):
        with _engine(algorithm) as llm:
            results = llm.generate(["Once upon a time"] * 3, min_new_tokens_params(llm, 6))
            check_min_new_tokens(results, 6)
            assert [r.token_ids for r in results] == plain


def test_a_grammar_that_ends_inside_the_window():
    """A choice completed by a draft: the request stops at that token with its text whole,
    whatever the window held after it."""
    with _engine("ngram") as llm:
        params = SamplingParams(max_new_tokens=16, temperature=0.0, structured_output={"choice": ["yes", "no"]})
        for _ in range(3):  # the host trie learns the answer: later runs draft it (and past it)
            [out] = llm.generate(["Answer: yes or no? The answer is"], params)
            assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_grammars_that_cannot_roll_back():
    """llguidance cannot roll back a matcher past `stop=` or `max_tokens=` lexemes, and its
    errors are final: the walk along each window's drafts runs on a copy of the request's
    matcher, so such requests end as they do without a drafter (they ended with "abort"
    when the walk rolled the request's own matcher back)."""
    with _engine() as llm:
        ab = llm.engine.tokenizer.encode("ab")[0]
        requests = [  # (prompt, params): drafts that the grammar takes, then drafts past max_tokens
            ("say: the cat sat on the mat end. say: the cat sat on the mat end. say: the cat",
             SamplingParams(max_new_tokens=40, temperature=0.0,
                            structured_output={"grammar": 'start: "say:" w "."\nw[stop=" end"]: /[a-z ]+/'})),
            ([ab] * 12, SamplingParams(max_new_tokens=16, temperature=0.0, logit_bias=((ab, 50.0),),
                                       structured_output={"grammar": 'start: w " end"\nw[max_tokens=3]: /[a-z]+/'})),
        ]
        want = [llm.generate([p], [sp])[0] for p, sp in requests]
    assert want[1].text == "ababab end"
    for algorithm in ("ngram_device", "ngram"):
        with _engine(algorithm) as llm:
            for overlap in (True, False):
                llm.engine.drain()  # the overlap loop may still hold a step of nobody's
                llm.engine.set_overlap(overlap)
                got = [llm.generate([p], [sp])[0] for p, sp in requests]
                assert [(r.token_ids, r.finish_reason) for r in got] == [(r.token_ids, r.finish_reason) for r in want]
            assert llm.engine.stats()["accept_length"] > 1.05  # drafts were walked and taken


def test_a_grammar_that_fails_inside_the_window_ends_with_abort(monkeypatch):
    """A parser limit hit while a later position's mask is made (on the walk's copy of the
    matcher, whose own state is fine) leaves that position EOS only: the request records
    where, and the token made there ends it with "abort", not "stop" with broken output."""
    from types import SimpleNamespace

    from llguidance import LLParserLimits

    from jaxoverlap.models.loader import default_model_path
    from jaxoverlap.models.tokenizer import Tokenizer
    from jaxoverlap.structured import Grammars, StructuredOutput, mark_failures

    tokenizer = Tokenizer.from_path(default_model_path())
    eos = 1
    grammars = Grammars(tokenizer, tokenizer.vocab_size, [eos])
    monkeypatch.setattr(grammars, "limits", LLParserLimits(step_lexer_fuel=2, verbose_errors=False))
    spec = StructuredOutput(regex="(one two three ){2,8}")
    ids = tokenizer.encode("one two three " * 4)
    for start in range(len(ids) - 3):  # the first window whose walk fails past its first position
        matcher = grammars.matcher(spec)
        if start:
            assert matcher.consume_tokens(ids[:start])
        req = SimpleNamespace(matcher=matcher, output_ids=list(ids[:start]), grammar_failed_at=None, stop_ids={eos})
        rows = [SimpleNamespace(req=req)]
        mask, failed = grammars.window_bitmask(rows, 1, np.array([ids[start : start + 3]], np.int32), np.array([3]))
        if failed:
            break
    else:
        pytest.fail("no window's walk hit the parser limit: the checks below cannot fail")
    j = failed[0]  # the window position whose mask failed
    assert j > 0 and not matcher.is_error()  # the request's own matcher is fine
    assert _bits(mask[0, j]) == {eos}
    mark_failures(rows, failed)
    req.output_ids += ids[start : start + j] + [eos]  # the window's tokens up to the failed position
    with _engine() as llm:
        check = llm.engine.scheduler._check_stop
        assert check(req) == "abort"
        mark_failures(rows, {})  # (the next step's walk found no failure)
        assert req.grammar_failed_at is None and check(req) == "stop"  # what the EOS reads as otherwise
