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
    """Steps with a constrained row sample apart from their forward pass, behind the step
    before; the tokens may not depend on the loop, and an unconstrained request in the same
    batches gets the tokens it gets alone."""
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
    assert llm.engine.runner.grammars is None and llm.engine._constrained == 0


def log_split_launches(engine, monkeypatch) -> list[str]:
    """The engine's launches and step processing from now on, in order: "forward" and
    "sample" (a split step's two launches), "launch" (a whole step), "process"."""
    runner, events = engine.runner, []

    def logged(name, fn):
        def call(*a, **k):
            events.append(name)
            return fn(*a, **k)
        return call

    monkeypatch.setattr(runner, "launch_forward", logged("forward", runner.launch_forward))
    monkeypatch.setattr(runner, "launch_sample", logged("sample", runner.launch_sample))
    monkeypatch.setattr(runner, "launch", logged("launch", runner.launch))
    monkeypatch.setattr(engine.scheduler, "process", logged("process", engine.scheduler.process))
    return events


def test_constrained_decode_steps_keep_overlap(llm, monkeypatch):
    """Under overlap, a constrained decode batch launches its forward pass before the step in
    flight is processed and its sampling after, with masks that the processed tokens have
    advanced; no iteration waits for the step in flight before its launch. A constrained
    request that ends while others run leaves them the tokens they get alone."""
    engine = llm.engine
    events = log_split_launches(engine, monkeypatch)
    plain = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    [alone] = llm.generate(["The cat"], plain)
    start, events[:] = len(engine.timings), []
    results = llm.generate(["Once upon a time"] * 4 + ["The cat"], _constrained(0.0) + [plain])
    _check_outputs(results[:4])
    assert results[4].token_ids == alone.token_ids
    timings = list(engine.timings)[start:]
    assert all(t.fresh_wait_s == 0 for t in timings)
    # forward N+1, process N, sample N+1, in every iteration that launched a forward pass
    # behind a step in flight; and some did.
    split = [i for i, e in enumerate(events) if e == "forward"]
    assert len(split) > 10
    assert sum(events[i + 1 : i + 3] == ["process", "sample"] for i in split) >= len(split) - 1


def test_a_split_step_is_the_fused_step():
    """decode_forward_step then decode_sample_step with every token allowed leaves the state
    and results of decode_step, greedy and sampled with penalties; with a mask, only allowed
    tokens come out."""
    import jax
    import jax.numpy as jnp

    from jaxoverlap import penalties, steps
    from jaxoverlap.device_state import init_device_state
    from jaxoverlap.models.config import ModelConfig
    from jaxoverlap.models.loader import default_model_path, load_params
    from jaxoverlap.sampling_params import MAX_LOGIT_BIAS

    cfg = ModelConfig.from_path(default_model_path())
    params = load_params(default_model_path(), cfg, jnp.float32)
    ps, width, V = 4, 32, cfg.vocab_size
    state = init_device_state(num_layers=cfg.num_layers, num_slots=16 * ps, num_kv_heads=cfg.num_kv_heads,
                              head_dim=cfg.head_dim, dtype=jnp.float32, num_entries=5, table_width=width,
                              penalty_vocab_size=V)
    res = steps.Reservations.of([1, 1, 2, 2], [0, 1, 0, 1], [1, 2, 3, 4])
    R = 2
    inp = steps.PrefillInputs(
        tokens=np.array([[3, 4, 5, 0], [7, 8, 9, 10]], np.int32), starts=np.zeros(R, np.int32),
        chunk_lens=np.array([3, 4], np.int32), entries=np.array([1, 2], np.int32),
        temperature=np.array([0.0, 0.9], np.float32), top_k=np.zeros(R, np.int32), top_p=np.ones(R, np.float32),
        min_p=np.zeros(R, np.float32), seed=np.array([1, 2], np.uint32),
        penalties=penalties.PrefillPenaltyInputs(
            np.tile(np.asarray([1.3, 0.2, 0.1], np.float32), (R, 1)), np.array([3, 4], np.int32), np.ones(R, bool),
            np.full((R, penalties.MAX_STOP_IDS), -1, np.int32), np.zeros(R, np.int32),
            np.full((R, MAX_LOGIT_BIAS), -1, np.int32), np.zeros((R, MAX_LOGIT_BIAS), np.float32)))
    kw = dict(cfg=cfg, ctx_len=width, page_size=ps)
    state, _ = steps.prefill_step(params, state, inp, res, **kw)
    inputs = steps.DecodeInputs.of([1, 2, 0, 0], steps.Reservations.empty(4))

    def copy(s):
        return jax.tree.map(lambda x: jnp.array(x, copy=True), s)

    words = (V + 31) // 32
    for sampling in (False, True):
        fused, out = steps.decode_step(params, copy(state), inputs, sampling=sampling, **kw)
        half, logits = steps.decode_forward_step(params, copy(state), inputs, **kw)
        split, out2 = steps.decode_sample_step(half, inputs, logits, np.full((4, words), -1, np.int32),
                                               sampling=sampling)
        np.testing.assert_array_equal(out.tokens, out2.tokens)
        np.testing.assert_allclose(out.logprobs, out2.logprobs, rtol=1e-5, atol=1e-5)
        for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(split)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # Rows 0 and 1 may take tokens 5 and 6 only.
    mask = np.full((4, words), -1, np.int32)
    mask[:2] = 0
    mask[:2, 0] = (1 << 5) | (1 << 6)
    half, logits = steps.decode_forward_step(params, copy(state), inputs, **kw)
    _, out3 = steps.decode_sample_step(half, inputs, logits, mask, sampling=True)
    assert set(np.asarray(out3.tokens)[:2].tolist()) <= {5, 6}


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


def min_new_tokens_params(llm, min_new_tokens: int) -> list[SamplingParams]:
    """EOS made the model's favourite (logit_bias +100): a free regex ends at its first
    token unless min_new_tokens bans EOS; a choice is complete after its word whatever
    min_new_tokens asks."""
    eos = {t: 100.0 for t in sorted(llm.engine.eos_token_ids)}
    return [SamplingParams(max_new_tokens=24, temperature=0.0, logit_bias=eos, min_new_tokens=m,
                           structured_output={"regex": "[a-z ]{1,400}"}) for m in (0, min_new_tokens)] + [
        SamplingParams(max_new_tokens=24, temperature=0.0, logit_bias=eos, min_new_tokens=min_new_tokens,
                       structured_output={"choice": COLORS})]


def check_min_new_tokens(results, min_new_tokens: int) -> None:
    free, held, choice = results
    for r in results:
        assert r.finish_reason == "stop", (r.text, r.finish_reason)
    assert re.fullmatch("[a-z ]{1,400}", free.text) and len(free.token_ids) <= 2, free.token_ids  # a token (+ EOS)
    # EOS banned for min_new_tokens tokens, chosen at once after them.
    assert re.fullmatch("[a-z ]{1,400}", held.text) and len(held.token_ids) in (min_new_tokens, min_new_tokens + 1)
    # The grammar wins: where it allows only EOS, EOS (or the grammar's end) it is, never a stray token.
    assert choice.text in COLORS and len(choice.token_ids) < min_new_tokens, choice.token_ids


@pytest.mark.parametrize("overlap", [True, False])
def test_min_new_tokens_with_structured_output(llm, overlap):
    llm.engine.drain()
    llm.engine.set_overlap(overlap)
    try:
        check_min_new_tokens(llm.generate(["Once upon a time"] * 3, min_new_tokens_params(llm, 6)), 6)
    finally:
        llm.engine.drain()
        llm.engine.set_overlap(True)


def test_a_grammar_that_allows_only_banned_tokens_wins():
    """sampling.sample where min_new_tokens bans every token the grammar allows (row 0: the
    stop tokens 7 and 9), and where it leaves one (row 1: 3 besides 7): greedy and sampled."""
    import jax.numpy as jnp

    from jaxoverlap import penalties
    from jaxoverlap.sampling import sample

    V = 40
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, V)), jnp.float32).at[0, 9].set(5.0).at[0, 7].set(4.0)
    history = np.zeros((2, V), np.int32)
    history[:, [7, 9]] = penalties.STOP
    allowed = np.zeros((2, 2), np.int32)  # [2 rows, ceil(40 / 32) words]
    allowed[0, 0] = (1 << 7) | (1 << 9)
    allowed[1, 0] = (1 << 3) | (1 << 7)
    rules = (jnp.asarray(history), jnp.tile(jnp.asarray(penalties.NEUTRAL, jnp.float32), (2, 1)),
             jnp.asarray([100, 100], jnp.int32), jnp.full((2, 1), -1, jnp.int32), jnp.zeros((2, 1), jnp.float32))
    positions = jnp.asarray([5, 5], jnp.int32)
    for temperature in (0.0, 1.0):
        for seed in range(4 if temperature else 1):
            t = jnp.full((2,), temperature, jnp.float32)
            tokens, logprobs = sample(logits, t, jnp.zeros((2,), jnp.int32), jnp.ones((2,), jnp.float32),
                                      jnp.zeros((2,), jnp.float32), jnp.full((2,), seed, jnp.int32), positions,
                                      penalties=rules, allowed=jnp.asarray(allowed))
            first, second = np.asarray(tokens).tolist()
            assert (first == 9) if not temperature else first in (7, 9)
            assert second == 3
            assert np.isfinite(np.asarray(logprobs)).all()


def test_constraint_dicts_are_one_hashable_constraint():
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
    grammars._compiled.clear()  # compiled again under the tight limits
    try:
        for ignore_eos in (False, True):
            [res] = llm.generate(["Once"], SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=ignore_eos,
                                                          structured_output={"json_schema": SCHEMA}))
            assert res.finish_reason == "abort", (ignore_eos, res.text, res.finish_reason)
    finally:
        grammars._compiled.clear()
    assert llm.engine._constrained == 0 and llm.engine.runner.grammars is None
    llm.engine.check_integrity()


@pytest.fixture
def gated_compiles(llm, monkeypatch):
    """The engine's grammar compiles wait for `gate` (on the compile threads); `specs` lists
    the specs compiled. The gate opens at the end in any case."""
    import threading
    from types import SimpleNamespace

    grammars = llm.engine.grammars
    real = grammars._build
    state = SimpleNamespace(gate=threading.Event(), specs=[])

    def gated(spec):
        state.specs.append(spec)
        state.gate.wait(60)
        return real(spec)

    monkeypatch.setattr(grammars, "_build", gated)
    try:
        yield state
    finally:
        state.gate.set()


def _step_until_idle(engine) -> dict:
    finals = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_a_grammar_compiles_while_the_engine_runs(llm, gated_compiles):
    """add_request does not wait for a grammar's compile (a large schema takes llguidance
    hundreds of milliseconds, which would hold every running request): the request waits
    apart while the others step on, its n samples share one compile, and once compiled it
    runs as it would have."""
    engine = llm.engine
    spec = {"regex": r"[0-9]{4}-held"}
    params = SamplingParams(max_new_tokens=16, temperature=0.0, structured_output=spec)
    engine.add_request("free", "Once upon a time", SamplingParams(max_new_tokens=24, temperature=0.0))
    for k in range(4):
        engine.add_request(f"c{k}", "Count:", params)
    assert [r.request_id for r in engine.scheduler.held] == ["c0", "c1", "c2", "c3"]
    assert engine.num_waiting == 5  # "free" waits too
    made = []
    for _ in range(6):
        made += [out.request_id for out in engine.step() if out.new_token_ids]
    assert "free" in made and not any(rid.startswith("c") for rid in made)
    assert len(engine.scheduler.held) == 4
    gated_compiles.gate.set()
    finals = _step_until_idle(engine)
    [text] = {engine.tokenizer.decode(finals[f"c{k}"].token_ids) for k in range(4)}  # greedy: all four alike
    assert re.fullmatch(r"[0-9]{4}-held", text) and finals["c0"].finish_reason == "stop"
    assert len(gated_compiles.specs) == 1  # one compile for the four
    [alone] = llm.generate(["Count:"], params)  # compiled now: no wait
    assert alone.text == text
    assert engine._constrained == 0 and engine.runner.grammars is None
    engine.check_integrity()


def test_a_grammar_refused_on_the_compile_thread_ends_its_request(llm, gated_compiles):
    """A grammar llguidance refuses, found after add_request returned: the request ends
    "abort" with the reason in RequestOutput.error; the same spec is then refused at once."""
    engine = llm.engine
    bad = {"regex": "((("}
    engine.add_request("bad", "Count:", SamplingParams(max_new_tokens=8, structured_output=bad))
    engine.add_request("held", "Count:", SamplingParams(max_new_tokens=8, structured_output={"regex": "[a-c]{3}"}))
    engine.add_request("ok", "Hello", SamplingParams(max_new_tokens=8, temperature=0.0))
    assert engine.abort("held")  # a held request ends at once, with no error
    gated_compiles.gate.set()
    finals = _step_until_idle(engine)
    assert finals["bad"].finish_reason == "abort" and "invalid structured output" in finals["bad"].error
    assert finals["held"].finish_reason == "abort" and finals["held"].error is None
    assert finals["ok"].finish_reason == "length" and finals["ok"].error is None
    with pytest.raises(InvalidRequestError, match="invalid structured output"):
        engine.add_request("bad2", "Count:", SamplingParams(max_new_tokens=8, structured_output=bad))
    with pytest.raises(InvalidRequestError, match="invalid structured output"):
        llm.generate(["Count:"], SamplingParams(max_new_tokens=8, structured_output=bad))
    assert engine._constrained == 0 and not engine.has_work()
    engine.check_integrity()
