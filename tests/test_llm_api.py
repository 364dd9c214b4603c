"""The public Python API on the embedded default model: generate, streaming, stop strings."""
import dataclasses
import itertools

import numpy as np
import pytest

from jaxoverlap import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(None, max_running_requests=4, max_context_len=256, kv_cache_tokens=2048, page_size=8)


def test_generate_text_and_token_ids(llm):
    [res] = llm.generate(["Once upon a time"], SamplingParams(max_new_tokens=16, temperature=0.0))
    assert len(res.token_ids) == 16 and res.finish_reason == "length"
    assert res.text == llm.tokenizer.decode(res.token_ids)
    assert res.metrics.time_to_first_token > 0 and res.metrics.tokens_per_second > 0
    # Token-id prompts give the same result as the text they encode.
    [again] = llm.generate([llm.tokenizer.encode("Once upon a time")], SamplingParams(max_new_tokens=16, temperature=0.0))
    assert again.token_ids == res.token_ids
    # One prompt as numpy ids (an array, or a list of numpy integers), and a 2-D array as prompts.
    ids = np.array(llm.tokenizer.encode("Once upon a time"))
    for prompt in (ids, list(ids)):
        [one] = llm.generate(prompt, SamplingParams(max_new_tokens=16, temperature=0.0))
        assert one.token_ids == res.token_ids
    assert [r.token_ids for r in llm.generate(np.stack([ids, ids]), SamplingParams(max_new_tokens=16, temperature=0.0))] \
        == [res.token_ids] * 2


def test_stream_concatenates_to_the_final_text(llm):
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    [full] = llm.generate(["Once upon a time"], params)
    deltas = list(llm.generate_stream(["Once upon a time"], params))
    assert deltas[-1].finished and sum(len(d.new_token_ids) for d in deltas) == 20
    assert "".join(d.new_text for d in deltas) == full.text


def test_stop_string_truncates_text(llm):
    [full] = llm.generate(["Once upon a time"], SamplingParams(max_new_tokens=24, temperature=0.0))
    words = full.text.split()
    stop = words[3]  # a word that the greedy continuation reaches
    [res] = llm.generate(["Once upon a time"], SamplingParams(max_new_tokens=24, temperature=0.0, stop=[stop]))
    assert res.finish_reason == "stop"
    assert stop not in res.text and full.text.startswith(res.text)
    assert len(res.token_ids) < len(full.token_ids)
    llm.engine.check_integrity()


def test_no_stop_string_ends_the_output_within_min_new_tokens(llm):
    """As vLLM: a stop string counts only where it ends in the text of a token after the first
    min_new_tokens; one that ends earlier is kept, and the next occurrence after them stops."""
    prompt = "Once upon a time"
    greedy = dict(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    [full] = llm.generate([prompt], SamplingParams(**greedy))
    tok = llm.tokenizer
    texts = [tok.decode(full.token_ids[:n]) for n in range(len(full.token_ids) + 1)]
    # A character that occurs in the first tokens' text and again later.
    k, ch = next((k, c) for k in range(2, 12) for c in texts[k][len(texts[k - 1]):]
                 if not c.isspace() and c in texts[-1][len(texts[k]):])
    first = texts[-1].index(ch)
    [plain] = llm.generate([prompt], SamplingParams(**greedy, stop=[ch]))
    assert plain.finish_reason == "stop" and plain.text == texts[-1][:first]
    [held] = llm.generate([prompt], SamplingParams(**greedy, stop=[ch], min_new_tokens=k))
    later = texts[-1].index(ch, len(texts[k]))
    assert held.finish_reason == "stop" and held.text == texts[-1][:later], (held.text, k, ch)
    # The stop string's end decides: one that spans the last banned token and the next counts.
    n = next(n for n in range(k, len(texts) - 1) if len(texts[n]) > len(texts[n - 1]) and len(texts[n + 1]) > len(texts[n]))
    span = texts[n + 1][len(texts[n]) - 1 : len(texts[n]) + 1]
    [spanning] = llm.generate([prompt], SamplingParams(**greedy, stop=[span], min_new_tokens=n))
    assert spanning.finish_reason == "stop" and spanning.text == texts[-1][: texts[-1].index(span, len(texts[n]) - 1)]
    llm.engine.check_integrity()


def test_include_stop_str_in_output(llm):
    """The text ends with the stop string that ended it, streamed or not; of two stops at one
    place the longer; a stop string past the held-back tail (found only at the flush) too."""
    prompt = "Once upon a time"
    [full] = llm.generate([prompt], SamplingParams(max_new_tokens=32, temperature=0.0))
    text = full.text
    mid = len(text) // 2
    for stops in ([text[mid : mid + 5]], [text[mid : mid + 2], text[mid : mid + 4]], [text[-3:]]):
        want = text[: min(text.find(s) for s in stops)]
        cut = dict(max_new_tokens=32, temperature=0.0, stop=stops)
        [without] = llm.generate([prompt], SamplingParams(**cut))
        [with_stop] = llm.generate([prompt], SamplingParams(**cut, include_stop_str_in_output=True))
        longest = max((s for s in stops if text.startswith(s, len(want))), key=len)
        assert without.text == want and with_stop.text == want + longest, stops
        assert with_stop.finish_reason == "stop" and with_stop.token_ids == without.token_ids
        streamed = llm.generate_stream([prompt], SamplingParams(**cut, include_stop_str_in_output=True))
        assert "".join(d.new_text for d in streamed) == with_stop.text
    # A stop token's text too (vLLM's rule): a token of text, and EOS written as a special token.
    tok = llm.tokenizer
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    for include in (False, True):
        [r] = llm.generate([prompt], SamplingParams(max_new_tokens=32, temperature=0.0, stop_token_ids=[stop_id],
                                                    include_stop_str_in_output=include))
        assert r.token_ids == full.token_ids[: first + 1] and r.finish_reason == "stop"
        assert r.text == tok.decode(r.token_ids if include else r.token_ids[:-1])
    eos = min(llm.engine.eos_token_ids)
    forced = dict(max_new_tokens=4, temperature=0.0, logit_bias={eos: 100.0}, skip_special_tokens=False)
    [r] = llm.generate([prompt], SamplingParams(**forced, include_stop_str_in_output=True))
    assert r.token_ids == [eos] and r.text == tok.id_to_token(eos)
    [r] = llm.generate([prompt], SamplingParams(**forced))
    assert r.text == ""


def test_special_tokens_in_the_text_when_asked(llm):
    """skip_special_tokens=False writes special tokens into the text (EOS forced by
    logit_bias and not ending the request): in the engine's text and in OutputText's."""
    from jaxoverlap.outputs import OutputText

    tok = llm.tokenizer
    eos = min(llm.engine.eos_token_ids)
    special = tok.id_to_token(eos)
    prompt = tok.encode("Once upon a time")
    base = dict(max_new_tokens=3, temperature=0.0, ignore_eos=True, logit_bias={eos: 100.0})
    [skipped] = llm.generate([prompt], SamplingParams(**base))
    [kept] = llm.generate([prompt], SamplingParams(**base, skip_special_tokens=False))
    assert kept.token_ids == skipped.token_ids == [eos] * 3
    assert skipped.text == "" and kept.text == special * 3
    for skip, want in ((True, ""), (False, special * 3)):
        text = OutputText(tok, prompt, skip_special_tokens=skip)
        outs = list(llm.generate_stream([prompt], SamplingParams(**base, skip_special_tokens=skip, detokenize=False)))
        assert "".join(text.delta(o) for o in outs) == want


def test_streamed_stop_strings_hold_back_only_a_possible_stop(llm):
    """Streaming with stop strings: the deltas add up to the final text, which is the
    unstopped text cut before the first stop string; the engine holds back at most the
    longest stop string less one character, and no more than that, at every step."""
    prompt = "Once upon a time"
    [full] = llm.generate([prompt], SamplingParams(max_new_tokens=48, temperature=0.0))
    text = full.text
    mid = len(text) // 2
    cases = [
        [text[mid : mid + 7]],  # spans tokens, found in the middle
        ["never-in-this-text-xyz", text[mid + 3 : mid + 5]],  # a long stop and a short one
        ["never-in-this-text-xyz"],  # never found: everything streams, nothing is lost
    ]
    engine = llm.engine
    for stops in cases:
        params = SamplingParams(max_new_tokens=48, temperature=0.0, stop=stops)
        deltas, held = [], []
        for d in llm.generate_stream([prompt], params):
            deltas.append(d)
            req = engine.requests.get(d.request_id)
            if req is not None:  # still running: what the engine keeps back
                held.append(len(req.pending_text))
        streamed = "".join(d.new_text for d in deltas)
        hits = [i for s in stops if (i := text.find(s)) >= 0]
        expected = text[: min(hits)] if hits else text
        assert streamed == expected, stops
        assert deltas[-1].finish_reason == ("stop" if hits else "length")
        assert max(held, default=0) <= max(len(s) for s in stops) - 1
        if not hits:
            assert deltas[-1].token_ids == full.token_ids
    engine.check_integrity()


def test_bad_prompt_in_a_batch_rejects_the_call_and_leaves_nothing(llm):
    assert not llm.engine.has_work()  # calls end with the engine idle (LLM._settle)
    generated = llm.engine.tokens_generated
    with pytest.raises(ValueError, match="^prompt 1: empty prompt$"):  # which prompt of the batch
        llm.generate(["fine", ""], SamplingParams(max_new_tokens=4))
    # The bad prompt comes last, after more prompts than the engine's queue is kept at: all
    # are checked before any is queued, so nothing ran.
    with pytest.raises(ValueError, match="^prompt 200: token ids outside the vocabulary"):
        llm.generate([[5, 6, 7]] * 200 + [[10**9]], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="^empty prompt$"):  # one prompt: nothing to tell apart
        llm.generate("", SamplingParams(max_new_tokens=4))
    assert not llm.engine.has_work() and llm.engine.tokens_generated == generated
    llm.engine.check_integrity()


def test_a_call_takes_more_prompts_than_the_engine_queues():
    """An evaluation set larger than max_queued_requests: the call feeds the engine a few at a
    time and returns every result in order, as generating each prompt alone does."""
    with LLM(None, max_running_requests=2, max_queued_requests=3, max_context_len=128, kv_cache_tokens=512,
             page_size=8) as small:
        prompts = [f"Story number {i}:" for i in range(11)] + [[5, 6, 7 + i] for i in range(4)]
        params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
        results = small.generate(prompts, params)
        alone = [small.generate([p], params)[0] for p in prompts[:3] + prompts[-2:]]
        assert [r.token_ids for r in results[:3] + results[-2:]] == [r.token_ids for r in alone]
        assert all(len(r.token_ids) == 5 for r in results)
        assert results[0].prompt_token_ids == small.tokenizer.encode(prompts[0])
        streamed = {}
        for d in small.generate_stream(prompts, params):
            streamed.setdefault(d.request_id, []).extend(d.new_token_ids)
        assert sorted(map(tuple, streamed.values())) == sorted(tuple(r.token_ids) for r in results)
        small.engine.check_integrity()


def test_llm_as_a_context_manager_closes_its_engine():
    from jaxoverlap.errors import EngineClosedError

    with LLM(None, max_running_requests=2, max_context_len=128, kv_cache_tokens=512, page_size=8) as llm:
        [res] = llm.generate(["Hi"], SamplingParams(max_new_tokens=4, temperature=0.0))
        assert len(res.token_ids) == 4
    assert llm.engine.closed
    with pytest.raises(EngineClosedError):
        llm.generate(["Hi"], SamplingParams(max_new_tokens=4))


def test_consumer_side_text_equals_the_engines(llm):
    """Requests with detokenize=False carry no text; outputs.OutputText makes it from their ids
    and gets the engine's own text: one token at a time, stop tokens left out, the tail
    flushed unless the request stopped. Greedy and sampled, stop tokens, EOS, length, abort."""
    from jaxoverlap.outputs import OutputText

    engine, tok = llm.engine, llm.tokenizer
    prompts = ["Once upon a time", "The quick brown fox", "In a small village", "Café 中文 🙂", "Hello"]
    [probe] = llm.generate([prompts[0]], SamplingParams(max_new_tokens=12, temperature=0.0))

    def params(i, detokenize):
        return SamplingParams(max_new_tokens=10 + 7 * i, temperature=0.0 if i in (0, 3) else 0.9, seed=i,
                              stop_token_ids=(probe.token_ids[6],) if i == 0 else (), ignore_eos=i == 4,
                              detokenize=detokenize)

    def run(detokenize):
        ids = [tok.encode(p) for p in prompts]
        for i, p in enumerate(ids):
            engine.add_request(f"t{i}-{detokenize}", p, params(i, detokenize))
        texts = {f"t{i}-{detokenize}": OutputText(tok, p) for i, p in enumerate(ids)}
        made, finals, steps = {}, {}, 0
        while engine.has_work():
            steps += 1
            if steps == 6:
                engine.abort(f"t2-{detokenize}")
            for out in engine.step():
                rid = out.request_id
                piece = out.new_text if detokenize else texts[rid].delta(out)
                if not detokenize:
                    assert out.new_text == ""
                made[rid] = made.get(rid, "") + piece
                if out.finished:
                    finals[rid] = (out.token_ids, out.finish_reason)
        return {k.split("-")[0]: (made[k], *finals[k]) for k in finals}

    engine_side, consumer_side = run(True), run(False)
    assert engine_side == consumer_side
    reasons = {v[2] for v in engine_side.values()}
    assert {"stop", "length", "abort"} <= reasons, reasons
    engine.check_integrity()

    # Structured output: a grammar completes on a token of text ("stop" with no stop token),
    # which OutputText keeps when told the request's ending ids.
    prompt = tok.encode("Say:")
    for spec in ({"choice": ["héllo wörld"]}, {"regex": "[a-z]{3} [a-z]{4}"}):
        sp = SamplingParams(max_new_tokens=16, temperature=0.0, structured_output=spec)
        [want] = llm.generate([prompt], sp)
        assert want.finish_reason == "stop" and want.token_ids[-1] not in engine.eos_token_ids
        text = OutputText(tok, prompt, sp.ending_token_ids(engine.eos_token_ids))
        made = "".join(text.delta(out) for out in llm.generate_stream([prompt], dataclasses.replace(sp, detokenize=False)))
        assert made == want.text


def test_text_held_back_before_a_stop_token_comes_out(llm):
    """A token that ends inside a multi-byte character holds its text back until the next
    token. When that token is a stop token, the held-back text still comes out at the end:
    the text is decode() of the output without its stop token, in the final result, the
    stream, and OutputText's."""
    from jaxoverlap.outputs import OutputText

    tok = llm.tokenizer
    prompt = tok.encode("Once upon a time")
    found = None
    for seed in range(40):  # near-uniform sampling over the 1024 ids, 256 of them bytes
        [res] = llm.generate([prompt], SamplingParams(max_new_tokens=48, temperature=4.0, seed=seed, ignore_eos=True))
        ids = res.token_ids
        cut = [i for i in range(len(ids) - 1)
               if tok.decode(ids[: i + 1]).endswith("\ufffd") and ids[i + 1] not in ids[: i + 1]]
        if cut:
            found = seed, ids[: cut[0] + 2]
            break
    assert found, "no sampled output ends a token inside a character"
    seed, ids = found
    sp = SamplingParams(max_new_tokens=48, temperature=4.0, seed=seed, ignore_eos=True, stop_token_ids=[ids[-1]])
    [res] = llm.generate([prompt], sp)
    assert res.token_ids == ids and res.finish_reason == "stop"
    assert res.text == tok.decode(ids[:-1]) and res.text.endswith("\ufffd")
    assert "".join(d.new_text for d in llm.generate_stream([prompt], sp)) == res.text
    text = OutputText(tok, prompt)
    assert "".join(text.delta(d) for d in llm.generate_stream([prompt], dataclasses.replace(sp, detokenize=False))) \
        == res.text


def test_stop_strings_need_the_engines_text():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_text_workloads_identical_with_and_without_overlap(llm, seed):
    """Text prompts, stop strings (with and without a leading space), greedy and seeded rows,
    staggered arrivals: the overlap loop gives the normal loop's ids, finish reasons and
    text; no text holds a stop string; text is the decoded ids, cut at the first stop string."""
    import numpy as np

    words = "the a cat dog ran sat on mat and then it was over . , ! once upon time there lived king".split()
    rng = np.random.default_rng(seed)
    engine, tok = llm.engine, llm.tokenizer
    reqs = []
    for i in range(8):
        stop = tuple(str(w) if rng.random() < 0.5 else " " + str(w) for w in rng.choice(words, int(rng.integers(0, 3))))
        params = SamplingParams(max_new_tokens=int(rng.integers(1, 30)), temperature=float(rng.choice([0.0, 0.8])),
                                seed=int(rng.integers(0, 2**31)), stop=stop, ignore_eos=bool(rng.random() < 0.5))
        reqs.append((" ".join(rng.choice(words, int(rng.integers(1, 12)))), params, int(rng.integers(0, 10))))

    def run(overlap):
        engine.drain()
        engine.set_overlap(overlap)
        texts, finals, it = {}, {}, 0
        while it < 10 or engine.has_work():
            for i, (prompt, params, arrive) in enumerate(reqs):
                if arrive == it:
                    engine.add_request(f"w{seed}-{i}-{overlap}", prompt, params)
            for out in engine.step():
                key = int(out.request_id.split("-")[1])
                texts[key] = texts.get(key, "") + out.new_text
                if out.finished:
                    finals[key] = (out.token_ids, out.finish_reason, texts[key])
            it += 1
        return finals

    try:
        with_overlap, normal = run(True), run(False)
    finally:
        engine.set_overlap(True)
    assert with_overlap == normal
    for i, (ids, reason, text) in with_overlap.items():
        stops = reqs[i][1].stop
        assert not any(s in text for s in stops)
        full = tok.decode(ids)
        hits = [j for s in stops if (j := full.find(s)) >= 0]
        if reason == "stop" and hits:
            assert text == full[: min(hits)]
        elif reason == "length":
            assert text == full
    engine.check_integrity()


def test_a_call_given_up_leaves_no_work_behind(llm):
    """Leaving generate_stream early, or Ctrl-C in a notebook inside generate, aborts the
    call's unfinished requests (more than the engine runs at once: some still wait), and
    the engine is idle once the call has ended."""
    engine = llm.engine
    engine.drain()
    params = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    stream = llm.generate_stream([f"Tale {i}" for i in range(6)], params)
    for _, _ in zip(range(3), stream):
        pass
    stream.close()
    assert not engine.requests and not engine.has_work()

    step, calls = engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted_step
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([f"Fable {i}" for i in range(6)], params)
    finally:
        del engine.step
    assert len(calls) >= 4 and not engine.requests and not engine.has_work() and not llm._routes
    engine.check_integrity()
    [res] = llm.generate(["Hello"], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(res.token_ids) == 3  # and the LLM goes on serving


def test_calls_may_interleave(llm):
    """A stream paused (kept in a notebook variable) while another call runs, and two
    streams consumed in turn: whichever call steps the engine files each output for its own
    call, so every call gets all of its outputs, the same as alone."""
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    [alone_a, alone_b] = llm.generate(["Hello", "The cat"], params)
    paused = llm.generate_stream(["Hello"], params)
    first = next(paused)
    [b] = llm.generate(["The cat"], params)  # runs "Hello" to its end too
    rest = list(paused)
    assert first.new_token_ids + [t for d in rest for t in d.new_token_ids] == alone_a.token_ids
    assert rest[-1].finished and b.token_ids == alone_b.token_ids
    one = llm.generate_stream(["Hello"], params)
    two = llm.generate_unordered(["The cat"], params)
    deltas, results = [], []
    for x, y in itertools.zip_longest(one, two):
        deltas += [x] if x is not None else []
        results += [y] if y is not None else []
    assert [t for d in deltas for t in d.new_token_ids] == alone_a.token_ids
    assert [r.token_ids for _, r in results] == [alone_b.token_ids]
    assert not llm._routes and not llm.engine.requests
    llm.engine.check_integrity()


def test_prefix_token_id_is_the_one_lm_eval_picks(llm):
    """BOS, else the tokenizer's own EOS token (not the lowest id that ends generation),
    else the lowest EOS id."""
    from jaxoverlap.models.tokenizer import Tokenizer

    real = llm.engine.tokenizer
    try:
        llm.engine.tokenizer = Tokenizer(real.hf_tokenizer, eos_token_ids=[9, 0], eos_token_id=9)
        assert llm.prefix_token_id == 9
        llm.engine.tokenizer = Tokenizer(real.hf_tokenizer, eos_token_ids=[9, 0], eos_token_id=9, bos_token_id=4)
        assert llm.prefix_token_id == 4
        llm.engine.tokenizer = Tokenizer(real.hf_tokenizer, eos_token_ids=[9, 0])
        assert llm.prefix_token_id == min(llm.engine.eos_token_ids)
    finally:
        llm.engine.tokenizer = real


def test_ctrl_c_inside_a_step_waits_for_the_step(llm, monkeypatch):
    """A SIGINT that arrives while the engine runs a step (here: while its outputs are
    unpacked, after the step's program took the donated state) interrupts the call only once
    the step is over: the engine keeps working, and a stream paused meanwhile loses nothing."""
    import os
    import signal

    from jaxoverlap import steps

    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    want = llm.generate(["Hello"], params)[0].token_ids
    stream = llm.generate_stream("Hello", params)
    got = list(next(stream).new_token_ids)  # the stream pauses after its first delta
    init, calls = steps.StepOutput.__init__, []

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler at its next bytecode
        return init(self, *args, **kwargs)

    monkeypatch.setattr(steps.StepOutput, "__init__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Once upon a time"], params)
    monkeypatch.setattr(steps.StepOutput, "__init__", init)
    assert len(calls) >= 3
    # Between steps a SIGINT is Python's KeyboardInterrupt, at once, as before the engine ran.
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # (the handler runs at one of the next bytecodes)
            pass
    assert llm.generate(["Hello"], params)[0].token_ids == want
    for out in stream:
        got += out.new_token_ids
    assert got == want
    llm.engine.check_integrity()


def test_a_stream_resumed_after_close_says_the_engine_is_closed():
    from jaxoverlap.errors import EngineClosedError

    llm = LLM(None, max_running_requests=2, max_context_len=64, kv_cache_tokens=512, page_size=8)
    stream = llm.generate_stream("Hello", SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    next(stream)
    llm.close()
    with pytest.raises(EngineClosedError):
        next(stream)


def _interrupt_after(monkeypatch, obj, name, nth):
    """Make obj.name send this process a SIGINT as its nth call returns (after a program
    took the donated state, before the runner keeps the new one)."""
    import os
    import signal

    original, calls = getattr(obj, name), []

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(1)
        if len(calls) == nth:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(obj, name, wrapped)
    return calls


def test_ctrl_c_in_a_warmup_or_a_direct_engine_step_leaves_the_engine_working(monkeypatch):
    """Ctrl-C while the warm-up runs its programs on padding rows, or while Engine.drain
    steps, used to leave the runner holding donated (deleted) buffers: every later step
    failed. The interrupt now comes after the run or the step, and the engine goes on."""
    llm = LLM(None, max_running_requests=2, max_context_len=64, kv_cache_tokens=256, page_size=8)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    want = llm.generate(["Hello"], params)[0].token_ids
    runner = llm.engine.runner
    calls = _interrupt_after(monkeypatch, runner, "_call_decode", 1)
    with pytest.raises(KeyboardInterrupt):
        llm.warmup(batch_sizes=[1, 2], ctx_lens=[64])
    assert calls
    monkeypatch.undo()
    assert llm.generate(["Hello"], params)[0].token_ids == want
    # Engine's own API: the interrupt ends drain() after a step; the next drain finishes the request.
    engine = llm.engine
    engine.add_request("direct", engine.tokenizer.encode("Hello"), params)
    _interrupt_after(monkeypatch, runner, "_call_decode", 2)
    with pytest.raises(KeyboardInterrupt):
        engine.drain()
    monkeypatch.undo()
    finals = [o for o in engine.drain() if o.finished]
    assert [o.token_ids for o in finals] == [want]
    engine.check_integrity()
    llm.close()


def test_an_ignored_sigint_stays_ignored_in_a_step(monkeypatch):
    """Where SIGINT is ignored (the server's engine process), a signal during a step does nothing."""
    import signal

    llm = LLM(None, max_running_requests=2, max_context_len=64, kv_cache_tokens=256, page_size=8)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    want = llm.generate(["Hello"], params)[0].token_ids
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _interrupt_after(monkeypatch, llm.engine.runner, "_call_decode", 2)
        assert llm.generate(["Hello"], params)[0].token_ids == want
    finally:
        signal.signal(signal.SIGINT, previous)
    llm.close()


def test_calls_from_two_threads_take_turns(llm):
    """The engine is single-threaded; LLM calls from several threads take turns a step at a
    time, and each gets its own outputs (they used to swap tokens or fail on donated buffers)."""
    import concurrent.futures

    prompts = [["Once upon a time", "Hello"], ["The capital of France is", "A B C D"]]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    want = [[r.token_ids for r in llm.generate(p, params)] for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for _ in range(3):
            futures = [pool.submit(llm.generate, p, params) for p in prompts]
            assert [[r.token_ids for r in f.result()] for f in futures] == want
    llm.engine.check_integrity()


def test_malformed_arguments_are_invalid_requests(llm):
    from jaxoverlap.errors import InvalidRequestError

    for prompts in (None, 5, {"a": 1}):
        with pytest.raises(InvalidRequestError, match="prompts must be"):
            llm.generate(prompts)
    with pytest.raises(InvalidRequestError, match="sampling_params"):
        llm.generate(["a"], "xy")
    # Token ids in loglikelihood are checked as generate checks them (they were truncated).
    for bad in ([5.9, 7.2], [True, 7], ["5", "7"]):
        with pytest.raises(InvalidRequestError, match="integers"):
            llm.loglikelihood([(bad, [8])])
    with pytest.raises(InvalidRequestError, match="integers"):
        llm.loglikelihood_rolling([[5.5, 6.0]])
    with pytest.raises(InvalidRequestError, match="pairs"):
        llm.loglikelihood(["ab"])
    assert llm.loglikelihood([([5, 7], [8])]) == llm.loglikelihood([(np.array([5, 7]), (8,))])


def test_the_engine_is_idle_between_calls():
    """A finished call, a stream given up, or one interrupted leave the engine idle: no step
    in flight, no aborts waiting for a step, so loops may be switched right after."""
    llm = LLM(None, max_running_requests=2, max_context_len=64, kv_cache_tokens=256, page_size=8)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    want = llm.generate(["Hello"], params)[0].token_ids
    assert not llm.engine.has_work()
    llm.engine.set_overlap(False)
    assert llm.generate(["Hello"], params)[0].token_ids == want
    llm.engine.set_overlap(True)
    stream = llm.generate_stream(["Hello", "Once upon a time"], params)
    next(stream)
    other = llm.generate_stream("Hi", params)
    next(other)
    stream.close()  # another call is open: its requests run on
    assert llm.engine.has_work()
    other.close()
    assert not llm.engine.has_work() and not llm.engine.requests
    # Requests added to the engine directly are left to their owner's steps.
    llm.engine.add_request("mine", [5, 6, 7], dataclasses.replace(params, max_new_tokens=50))
    assert llm.generate(["Hello"], params)[0].token_ids == want
    assert "mine" in llm.engine.requests and llm.engine.has_work()
    assert [o.request_id for o in llm.engine.drain() if o.finished] == ["mine"]
    llm.close()
