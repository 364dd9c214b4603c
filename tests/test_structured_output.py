"""Structured output (jaxoverlap/structured.py) on the embedded default model: its random
weights would never write JSON alone, so every valid output below is the constraint's
doing. Greedy and sampled, overlap on and off, in batches with unconstrained requests and
under retraction."""
import json
import re

import numpy as np
import pytest

from jaxoverlap import LLM, SamplingParams
from jaxoverlap.errors import InvalidRequestError
from jaxoverlap.structured import StructuredOutput

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
COLORS = ["red", "green", "blue"]


@pytest.fixture(scope="module")
def llm():
    return LLM(None, max_running_requests=8, max_context_len=256, kv_cache_tokens=2048, page_size=8)


def _check_schema(text: str) -> None:
    value = json.loads(text)
    assert list(value) == ["name", "age", "ok"], value  # in the schema's order
    assert isinstance(value["name"], str) and len(value["name"]) <= 8
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert isinstance(value["ok"], bool)


def _constrained(temperature: float, seed: int = 0) -> list[SamplingParams]:
    def sp(constraint, n=64):
        return SamplingParams(max_new_tokens=n, temperature=temperature, seed=seed, structured_output=constraint)

    return [sp({"json_schema": SCHEMA}), sp({"regex": REGEX}, 32), sp({"choice": COLORS}, 16),
            sp({"json_object": True}, 96)]


def _check_outputs(results) -> None:
    schema, regex, choice, obj = results
    _check_schema(schema.text)
    assert re.fullmatch(REGEX, regex.text), regex.text
    assert choice.text in COLORS
    assert isinstance(json.loads(obj.text), dict), obj.text
    for r in results:
        assert r.finish_reason == "stop", (r.text, r.finish_reason)  # the grammar ended it, not the length


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_follow_their_constraints(llm, temperature):
    for seed in range(2 if temperature else 1):
        params = _constrained(temperature, seed)
        _check_outputs(llm.generate(["Once upon a time"] * len(params), params))


def test_overlap_on_and_off_agree_and_unconstrained_neighbours_are_unchanged(llm):
    """Steps with a constrained row give up overlap; the tokens may not depend on it, and an
    unconstrained request in the same batches gets the tokens it gets alone."""
    plain = [SamplingParams(max_new_tokens=24, temperature=t, seed=5, ignore_eos=True) for t in (0.0, 0.8)]
    prompts = ["Once upon a time", "The cat"]
    alone = [r.token_ids for r in llm.generate(prompts, plain)]
    runs = []
    for overlap in (True, False):
        llm.engine.drain()  # the overlap loop may still hold a step of nobody's
        llm.engine.set_overlap(overlap)
        try:
            params = _constrained(0.7, seed=11) + plain
            results = llm.generate(["Once upon a time"] * 4 + prompts, params)
        finally:
            llm.engine.drain()
            llm.engine.set_overlap(True)
        _check_outputs(results[:4])
        assert [r.token_ids for r in results[4:]] == alone
        runs.append([r.token_ids for r in results])
    assert runs[0] == runs[1]
    # Nothing constrained is left: the steps look for constrained rows no more.
    assert llm.engine.runner.allowed_tokens is None and llm.engine._constrained == 0


def test_constrained_requests_survive_retraction():
    """A cache too small for every request at once retracts some: a retracted constrained
    request resumes where its grammar stood, with the tokens of a run without retraction."""
    params = [SamplingParams(max_new_tokens=64, temperature=0.0, structured_output={"json_schema": SCHEMA})] * 6
    prompts = [f"Record {i}:" for i in range(6)]
    with LLM(None, max_running_requests=6, max_context_len=128, kv_cache_tokens=2048, page_size=4) as roomy:
        want = [r.token_ids for r in roomy.generate(prompts, params)]
    with LLM(None, max_running_requests=6, max_context_len=128, kv_cache_tokens=160, page_size=4) as tight:
        got = tight.generate(prompts, params)
        assert tight.engine.stats()["num_retractions"] > 0
    assert [r.token_ids for r in got] == want
    for r in got:
        _check_schema(r.text)


@pytest.mark.parametrize("constraint, match", [
    ({"regex": "[a-"}, "regex"),
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "nosuchtype"}}}}, "structured output"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({"json_schema": {}, "format": "x"}, "unknown field"),
    ({"choice": []}, "at least one"),
    ({"choice": "red"}, "list of strings"),
    ({"json": {}, "json_schema": {}}, "not both"),
    ({"json_schema": "{not json"}, "not JSON"),
    ({"json_schema": "[1]"}, "must be a JSON object"),
    ({"json_schema": True}, "must be a JSON object"),
    ({"json_object": "yes"}, "true or false"),
    ("json", "expected an object"),
])
def test_bad_constraints_are_refused_and_others_keep_running(llm, constraint, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(["Once"], SamplingParams(max_new_tokens=4, structured_output=constraint))
    [ok] = llm.generate(["Once"], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(ok.token_ids) == 4


def test_what_cannot_be_combined_is_refused():
    with pytest.raises(InvalidRequestError, match="min_new_tokens"):
        SamplingParams(min_new_tokens=2, structured_output={"regex": "a+"})
    with LLM(None, speculative_algorithm="ngram_device", max_running_requests=2, max_context_len=64,
             kv_cache_tokens=256, page_size=8) as spec:
        with pytest.raises(InvalidRequestError, match="speculative"):
            spec.generate(["Once"], SamplingParams(structured_output={"choice": COLORS}))
    # Dicts and "json" (vLLM's name) become the same constraint, hashable for the grammar cache;
    # the schema's keys keep their order (its properties are written in that order).
    a = StructuredOutput.of({"json": {"b": 1, "a": 2}})
    assert a == StructuredOutput(json_schema='{"b": 1, "a": 2}') and hash(a) == hash(StructuredOutput.of(a))


def test_the_device_mask_reads_llguidance_bitmasks():
    """sampling.allowed_mask against llguidance's own numpy reading of the same bitmask."""
    from llguidance.numpy import apply_token_bitmask_inplace

    from jaxoverlap.sampling import allowed_mask

    rng = np.random.default_rng(0)
    vocab = 100  # not a multiple of 32: the last word is partly padding
    bitmask = rng.integers(-2**31, 2**31, size=(3, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    logits = np.zeros((3, vocab), np.float32)
    apply_token_bitmask_inplace(logits, bitmask)
    np.testing.assert_array_equal(np.asarray(allowed_mask(bitmask, vocab)), np.isfinite(logits))


def test_masks_with_a_model_vocabulary_other_than_the_tokenizers():
    """A model whose logits outnumber the tokenizer's ids (padded embeddings), with EOS ids
    the tokenizer lacks (a stand-in tokenizer): the grammar still compiles, the mask covers
    the model's vocabulary, and no id past the tokenizer's is allowed; the masks of several
    rows at once (llguidance's threads) equal one-by-one masks."""
    from types import SimpleNamespace

    from llguidance.numpy import fill_next_token_bitmask

    from jaxoverlap.models.loader import default_model_path
    from jaxoverlap.models.tokenizer import Tokenizer
    from jaxoverlap.sampling import allowed_mask
    from jaxoverlap.structured import Grammars

    tok = Tokenizer.from_path(default_model_path())
    grammars = Grammars(tok, 4096, [4000, 4001])
    spec = StructuredOutput(json_schema=SCHEMA)
    rows = [SimpleNamespace(req=SimpleNamespace(matcher=grammars.matcher(spec))) for _ in range(3)]
    for t in tok.encode('{"name": "a'):
        rows[1].req.matcher.consume_token(t)
    rows.append(SimpleNamespace(req=SimpleNamespace(matcher=None)))  # an unconstrained row
    mask = grammars.bitmask(rows, 5)
    assert mask.shape == (5, 4096 // 32)
    one = np.full_like(mask, -1)
    for i in range(3):
        fill_next_token_bitmask(rows[i].req.matcher, one, i)
    np.testing.assert_array_equal(mask, one)
    allowed = np.asarray(allowed_mask(mask, 4096))
    assert allowed[3:].all() and not allowed[:3, tok.vocab_size:].any()
    assert allowed[0].sum() == 1 and not np.array_equal(allowed[0], allowed[1])  # '{' first, then string text


def test_a_grammar_that_fails_while_a_mask_is_made_ends_with_abort(llm, monkeypatch):
    """A parser limit hit while a row's mask is computed leaves llguidance's matcher in error
    with a mask of EOS only: the request ends "abort", never "stop" with broken output."""
    from llguidance import LLParserLimits

    grammars = llm.engine.grammars
    monkeypatch.setattr(grammars, "limits", LLParserLimits(step_lexer_fuel=10, verbose_errors=False))
    grammars._grammars.clear()  # checked again under the tight limits
    try:
        for ignore_eos in (False, True):
            [res] = llm.generate(["Once"], SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=ignore_eos,
                                                          structured_output={"json_schema": SCHEMA}))
            assert res.finish_reason == "abort", (ignore_eos, res.text, res.finish_reason)
    finally:
        grammars._grammars.clear()
    assert llm.engine._constrained == 0 and llm.engine.runner.allowed_tokens is None
    llm.engine.check_integrity()
