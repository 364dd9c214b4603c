"""An LLM's life in a notebook: Ctrl-C anywhere in a call leaves an idle engine, and an
engine is freed when dropped (`del llm`, a cell that builds a new one) or closed, without
undoing the frozen collector (freeze_gc) of the engines that live on."""
import _thread
import gc
import os
import signal
import weakref

import pytest

from jaxoverlap import LLM, SamplingParams

OPTS = dict(max_running_requests=2, max_context_len=64, kv_cache_tokens=256, page_size=8)
LONG = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [f"Tale {i}" for i in range(5)]  # more than the engine runs at once: some wait


@pytest.fixture(scope="module")
def llm():
    with LLM(None, **OPTS) as llm:
        yield llm


def _sigint_on_call(monkeypatch, obj, name, nth):
    """Make obj.name send this process a SIGINT as its nth call begins, as a user's Ctrl-C
    landing there would."""
    original, calls = getattr(obj, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapped)
    return calls


def _assert_idle(llm):
    engine = llm.engine
    assert not engine.has_work() and not engine.requests and not llm._routes
    engine.set_overlap(engine.overlap)  # raises while the engine has work
    engine.check_integrity()


@pytest.mark.parametrize("call", ["generate", "generate_stream", "generate_unordered"])
def test_ctrl_c_in_a_call_leaves_the_engine_idle(llm, monkeypatch, call):
    """README: a call given up by Ctrl-C aborts its unfinished requests, and with no call
    open the engine is idle. The interrupt used to skip that: 2 requests ran on, 3 waited."""
    want = llm.generate(["Hello"], SHORT)[0].token_ids
    calls = _sigint_on_call(monkeypatch, llm.engine.runner, "_call_decode", 2)
    with pytest.raises(KeyboardInterrupt):
        if call == "generate":
            llm.generate(PROMPTS, LONG)
        else:
            for _ in getattr(llm, call)(PROMPTS, LONG):
                pass
    monkeypatch.undo()
    assert len(calls) >= 2
    _assert_idle(llm)
    assert llm.generate(["Hello"], SHORT)[0].token_ids == want


def test_ctrl_c_while_a_request_is_queued(llm, monkeypatch):
    """A Ctrl-C between the engine's filing of a request and the scheduler's queueing of it
    left one that no abort could end (the scheduler's raised ValueError over the
    KeyboardInterrupt): the engine never went idle again. Queueing is one step now."""
    want = llm.generate(["Hello"], SHORT)[0].token_ids
    original, calls = SamplingParams.ending_token_ids, []

    def ending_token_ids(self, *args, **kwargs):  # called by Scheduler.add
        calls.append(1)
        if len(calls) == 3:
            _thread.interrupt_main()  # SIGINT, as if it arrived here
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SamplingParams, "ending_token_ids", ending_token_ids)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, LONG)
    monkeypatch.undo()
    assert len(calls) >= 3
    _assert_idle(llm)
    assert llm.generate(["Hello"], SHORT)[0].token_ids == want


def test_a_second_ctrl_c_while_the_call_aborts_its_requests(llm, monkeypatch):
    """A second Ctrl-C used to cut the abort loop of the interrupted call short: the rest of
    its requests ran on, holding their batch slots. It now waits for the loop's end."""
    want = llm.generate(["Hello"], SHORT)[0].token_ids
    _sigint_on_call(monkeypatch, llm.engine.runner, "_call_decode", 2)
    aborts = _sigint_on_call(monkeypatch, llm.engine, "abort", 2)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, LONG)
    monkeypatch.undo()
    assert len(aborts) == len(PROMPTS)
    _assert_idle(llm)
    assert llm.generate(["Hello"], SHORT)[0].token_ids == want


def test_a_dropped_llm_is_freed_at_once():
    """`del llm`, or a notebook cell run again (`llm = LLM(...)` rebinds the name), frees the
    engine by refcounting: it used to sit in a reference cycle (the scheduler held a bound
    method of it) that the frozen collector never looked at."""
    llm = LLM(None, **OPTS)
    llm.generate(PROMPTS, SHORT)
    for _ in zip(range(2), llm.generate_stream(PROMPTS, LONG)):  # a stream given up
        pass
    engine = weakref.ref(llm.engine)
    llm = LLM(None, **OPTS)  # the cell run again
    assert engine() is None
    engine = weakref.ref(llm.engine)
    del llm
    assert engine() is None


def test_closing_one_engine_keeps_the_others_frozen():
    """close() gives its engine's objects back to the collector; gc.freeze() is process-wide,
    and it used to leave every other live engine's objects unfrozen too."""
    from jaxoverlap import engine as engine_module

    a, b = LLM(None, **OPTS), LLM(None, **OPTS)
    assert gc.get_freeze_count() > 0
    a.close()
    assert gc.get_freeze_count() > 0  # b's objects (and JAX's) stay out of the collector's view
    assert b.engine in engine_module._FROZEN_ENGINES and a.engine not in engine_module._FROZEN_ENGINES
    unfrozen = LLM(None, freeze_gc=False, **OPTS)
    unfrozen.close()
    assert gc.get_freeze_count() > 0
    b.close()
    assert b.engine not in engine_module._FROZEN_ENGINES


def test_ctrl_c_comes_back_after_sigint_was_ignored_for_a_while():
    """A program that ignores SIGINT for a while (around a step) and then puts back the
    handler it found (ours) gets Ctrl-C back: ours used to hand every later SIGINT to the
    SIG_IGN it had been put in front of."""
    from jaxoverlap import interrupts

    with interrupts.deferred():
        pass
    found = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupts.deferred():
            os.kill(os.getpid(), signal.SIGINT)  # ignored
    finally:
        signal.signal(signal.SIGINT, found)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # (the handler runs at one of the next bytecodes)
            pass
