"""Server, worker, client, bench and CLI glue against FakeEngine (no JAX; fast and deterministic).

The same behaviours are checked against the real engine in test_server_grpc.py; here we cover
what needs control over the engine: timing (graceful drain), thread ownership, and the
benchmark's bookkeeping.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import subprocess
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

from jaxoverlap.config import EngineConfig
from jaxoverlap.errors import InvalidRequestError
from jaxoverlap.server import bench, cli_commands
from jaxoverlap.server import jaxoverlap_pb2 as pb
from jaxoverlap.server.client import AsyncGenerationClient, Chunk, Completion, GenerationClient, build_request
from jaxoverlap.server.engine_worker import EngineWorker
from jaxoverlap.server.grpc_server import _top_level_field_numbers, sampling_params_from_proto
from jaxoverlap.server.testing import FakeEngine, ServerThread

pytestmark = pytest.mark.timeout(120)


def _fake(**kw):
    cfg = EngineConfig(max_running_requests=kw.pop("max_running_requests", 8), max_context_len=64,
                       kv_cache_tokens=1024)
    return FakeEngine(cfg, **kw)


@pytest.fixture(scope="module")
def served():
    engine = _fake(step_delay=0.002)
    worker = EngineWorker(engine).start()
    st = ServerThread(worker, metrics_port=-1).start()
    client = GenerationClient(st.target, timeout=30)
    yield engine, worker, st, client
    client.close()
    st.stop()
    worker.stop()


def _wait_idle(client, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = client.server_info()
        if info["running_requests"] == 0 and info["queued_requests"] == 0 and info["active_streams"] == 0:
            return info
        time.sleep(0.02)
    raise AssertionError(f"server not idle: {info}")


# ---- pure functions -----------------------------------------------------------------------------


def test_wire_scan_sees_both_oneof_members():
    both = (pb.GenerateRequest(text="hi").SerializeToString()
            + pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2])).SerializeToString())
    assert {2, 3} <= _top_level_field_numbers(both)
    msg = pb.GenerateRequest.FromString(both)
    assert msg.WhichOneof("input") == "token_ids"  # what protobuf alone would have accepted
    one = build_request("x", max_new_tokens=3, temperature=0.5, stop=["a"]).SerializeToString()
    assert _top_level_field_numbers(one) == {1, 2, 4}


def test_sampling_params_defaults_and_overrides():
    from jaxoverlap.sampling_params import SamplingParams

    assert sampling_params_from_proto(pb.SamplingParams()) == SamplingParams()
    sp = build_request("x", max_new_tokens=5, temperature=0.0, top_k=-1, seed=7, stop="END",
                       stop_token_ids=[3], ignore_eos=True, logprobs=True).sampling_params
    p = sampling_params_from_proto(sp)
    assert (p.max_new_tokens, p.temperature, p.top_k, p.seed, p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == \
        (5, 0.0, 0, 7, ("END",), (3,), True, True)
    with pytest.raises(InvalidRequestError):
        sampling_params_from_proto(build_request("x", top_p=0.0).sampling_params)
    with pytest.raises(TypeError):
        build_request("x", nonsense=1)
    p = sampling_params_from_proto(build_request("x", include_stop_str_in_output=True,
                                                 skip_special_tokens=False).sampling_params)
    assert (p.include_stop_str_in_output, p.skip_special_tokens) == (True, False)


def test_length_dist_and_arrivals():
    import random

    assert bench.LengthDist.parse("128") == bench.LengthDist(128, 128)
    assert bench.LengthDist.parse("16:32") == bench.LengthDist(16, 32)
    assert bench.LengthDist.parse("uniform:1:4") == bench.LengthDist(1, 4)
    for bad in ("0", "5:3", "a", "1:2:3"):
        with pytest.raises(ValueError):
            bench.LengthDist.parse(bad)
    rng = random.Random(0)
    d = bench.LengthDist.parse("3:5")
    assert {d.sample(rng) for _ in range(200)} == {3, 4, 5}
    assert bench.arrival_offsets(5, float("inf"), rng) == [0.0] * 5
    offs = bench.arrival_offsets(4000, 100.0, random.Random(1))
    assert offs == sorted(offs) and abs(offs[-1] / 4000 - 0.01) < 0.001  # mean gap 1/rate


def test_bench_refuses_a_config_that_cannot_run_before_connecting(tmp_path, capsys):
    """Each mistake is a one-line error (exit 2) before anything connects, and the results'
    file is made before the run (it used to fail after the whole benchmark, losing it)."""
    import argparse

    parser = bench.add_bench_args(argparse.ArgumentParser())
    nowhere = ["--target", "127.0.0.1:1"]  # nothing listens: a connect would fail differently
    for extra, message in ((["--num-prompts", "0"], "num_prompts must be >= 1"),
                           (["--max-concurrency", "-1"], "max_concurrency must be >= 1"),
                           (["--dataset", str(tmp_path / "none.json")], "no dataset file"),
                           (["--label", "a", "--label", "b"], "one label per target"),
                           (["--target", "127.0.0.1:2", "--target", "127.0.0.1:3"], "one target, or two"),
                           (["--output-file", str(tmp_path)], "is a folder"),
                           (["--output-file", "/proc/nowhere/bench.json"], "error: ")):
        assert bench.run_bench(parser.parse_args(nowhere + extra)) == 2, extra
        assert message in capsys.readouterr().err, extra
    # A server that is not there: one line, exit 1, no traceback.
    out = tmp_path / "bench.json"
    code = bench.run_bench(parser.parse_args(nowhere + ["--output-file", str(out), "--request-timeout", "2"]))
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: UNAVAILABLE") and "Traceback" not in err
    assert not out.exists()


def test_burstiness_keeps_the_rate_and_changes_the_spread():
    """Gamma gaps of shape b: the mean stays 1/rate, the coefficient of variation is 1/sqrt(b)
    (1 for Poisson)."""
    def gaps(b):
        offs = bench.arrival_offsets(20000, 50.0, random.Random(2), burstiness=b)
        return np.diff(offs)

    for b in (0.25, 1.0, 4.0):
        g = gaps(b)
        assert abs(g.mean() - 0.02) < 0.002, b
        assert abs(g.std() / g.mean() - b ** -0.5) < 0.08, b
    assert bench.arrival_offsets(3, float("inf"), random.Random(0), burstiness=0.5) == [0.0] * 3
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="burstiness"):
            bench.arrival_offsets(3, 10.0, random.Random(0), burstiness=bad)


def test_goodput_counts_requests_within_every_slo():
    assert bench.parse_goodput(["ttft:200", "TPOT:50.5"]) == {"ttft": 200.0, "tpot": 50.5}
    for bad in ("ttft", "itl:10", "ttft:abc", "ttft:0", "e2el:-3", "tpot:inf"):
        with pytest.raises(ValueError, match="goodput SLO"):
            bench.parse_goodput([bad])
    # ttft 0.1 s, tpot 0.1 s; ttft 0.3 s, tpot 0.1 s; ttft 0.1 s, tpot 0.3 s (e2e 3.1 s).
    rs = [bench.RequestResult(success=True, ttft=0.1, latency=1.1, output_tokens=11),
          bench.RequestResult(success=True, ttft=0.3, latency=1.3, output_tokens=11),
          bench.RequestResult(success=True, ttft=0.1, latency=3.1, output_tokens=11),
          bench.RequestResult(success=False, ttft=0.01, latency=0.02, error="aborted")]
    assert bench.summarize(rs, 2.0)["goodput"] is None
    assert bench.summarize(rs, 2.0, {"ttft": 200})["goodput"] == pytest.approx(1.0)  # 2 of 3, per 2 s
    assert bench.summarize(rs, 2.0, {"ttft": 200, "tpot": 150})["goodput"] == pytest.approx(0.5)
    assert bench.summarize(rs, 2.0, {"e2el": 2000})["goodput"] == pytest.approx(1.0)
    table = bench.format_table({"A": bench.summarize(rs, 2.0, {"ttft": 200})})
    assert "Request goodput" in table
    assert "goodput" not in bench.format_table({"A": bench.summarize(rs, 2.0)})


def test_sharegpt_loader(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "tell me a story about a cat please"},
                           {"from": "gpt", "value": "once upon a time there was a cat " * 3}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"conversations": [{"from": "human", "value": "short reply wanted here"},
                           {"from": "gpt", "value": "ok"}]},
        {"conversations": [{"from": "human", "value": "what is the capital of france, briefly?"},
                           {"from": "gpt", "value": "Paris is the capital of France."}]},
        # Real dumps hold these too: a null reply, a turn that is no object, an entry that is none.
        {"conversations": [{"from": "human", "value": "a question whose reply was lost"},
                           {"from": "gpt", "value": None}]},
        {"conversations": ["not a turn", {"from": "human", "value": "x"}]},
        "not an entry",
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    import random

    reqs = bench.sharegpt_requests(str(path), 5, random.Random(0))
    assert len(reqs) == 5
    assert all(isinstance(r.prompt, str) and r.output_len >= 4 for r in reqs)  # "ok" was too short
    assert {r.prompt for r in reqs} == {data[0]["conversations"][0]["value"], data[3]["conversations"][0]["value"]}
    # Two usable prompts padded to five: reused in turn, not the first one over and over.
    assert [r.prompt for r in reqs[2:]] == [reqs[0].prompt, reqs[1].prompt, reqs[0].prompt]
    fixed = bench.sharegpt_requests(str(path), 3, random.Random(0), output_len=7, max_input_len=9)
    assert all(r.output_len == 7 and r.input_len <= 9 for r in fixed)


def test_summary_and_table():
    rs = [bench.RequestResult(success=True, ttft=0.1, latency=1.1, itl=[0.1] * 9, prompt_tokens=10,
                              output_tokens=11, accept_length=1.0),
          bench.RequestResult(success=True, ttft=0.3, latency=1.3, itl=[0.1] * 9, prompt_tokens=10,
                              output_tokens=11, accept_length=2.0),
          bench.RequestResult(success=False, error="UNAVAILABLE: x")]
    s = bench.summarize(rs, duration=2.0)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == {"UNAVAILABLE: x": 1}
    # Many distinct messages: the ten most frequent, and the rest together, still sum to `failed`.
    many = [bench.RequestResult(success=False, error=f"DEADLINE_EXCEEDED: after {i} s") for i in range(14)]
    errors = bench.summarize(many + many[:1], duration=1.0)["errors"]
    assert len(errors) == 11 and errors["DEADLINE_EXCEEDED: after 0 s"] == 2 and errors["(other errors)"] == 4
    assert sum(errors.values()) == 15
    assert s["output_throughput"] == pytest.approx(11.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert s["itl_ms"]["median"] == pytest.approx(100.0)
    assert s["accept_length"]["mean"] == pytest.approx(1.5)
    # Over all tokens: 20 decode tokens in 10 + 5 steps.
    assert s["accept_length_overall"] == pytest.approx(20 / 15)
    table = bench.format_table({"A": s, "B": s})
    assert "Output token throughput" in table and "vs A" in table and "+0.0%" in table and "Mean TTFT (ms)" in table


# ---- the server over FakeEngine -----------------------------------------------------------------


def test_stream_and_engine_thread_ownership(served):
    engine, worker, st, client = served
    items = list(client.generate("ab", max_new_tokens=6, logprobs=True))
    chunks, done = items[:-1], items[-1]
    assert all(isinstance(c, Chunk) for c in chunks) and isinstance(done, Completion)
    assert [t for c in chunks for t in c.token_ids] == done.token_ids and len(done.token_ids) == 6
    assert "".join(c.text for c in chunks) == engine.tokenizer.decode(done.token_ids)
    assert sum(len(c.logprobs) for c in chunks) == 6
    assert done.finish_reason == "length" and done.prompt_tokens == 2 and done.completion_tokens == 6
    # Every engine call, stats included, ran on the worker thread.
    client.server_info()
    assert engine.thread_ids == {worker._thread.ident}


def test_text_prompts_are_tokenized_off_the_engine_thread(served):
    """The handler tokenizes: the engine gets token ids, and a long text goes through the
    tokenizer's batch call on a thread that is neither the engine's nor the event loop's."""
    engine, worker, st, client = served
    engine.tokenizer.calls.clear()
    kinds_before = len(engine.prompt_kinds)
    assert client.generate_text("ab", max_new_tokens=2).token_ids
    with pytest.raises(grpc.RpcError) as e:  # tokenized, then too long for the fake's context
        client.generate_text("y" * 5000)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "5000 tokens" in e.value.details()
    calls = engine.tokenizer.calls
    assert [m for m, _ in calls] == ["encode", "encode_batch"]
    short_thread, long_thread = calls[0][1], calls[1][1]
    assert worker._thread.ident not in (short_thread, long_thread)
    assert long_thread != short_thread  # the short one ran on the event loop itself
    assert engine.prompt_kinds[kinds_before:] == ["list", "list"]


def test_the_handler_makes_the_text_unless_the_engine_needs_it(served):
    """Without stop strings the engine is asked for no text (detokenize=False) and the handler
    decodes the ids; with stop strings the engine makes it, since it must find them."""
    engine, worker, st, client = served
    before = len(engine.detokenize_flags)
    items = list(client.generate("héllo", max_new_tokens=9))
    text = "".join(c.text for c in items[:-1])
    assert text and text == engine.tokenizer.decode(items[-1].token_ids)
    stopped = client.generate_text("ab", max_new_tokens=9, stop=["zz"])
    assert stopped.text == engine.tokenizer.decode(stopped.token_ids)
    assert engine.detokenize_flags[before:] == [False, True]


def test_errors_keep_serving(served):
    _, _, st, client = served
    cases = [("", {}, grpc.StatusCode.INVALID_ARGUMENT), ([], {}, grpc.StatusCode.INVALID_ARGUMENT),
             ([500], {}, grpc.StatusCode.INVALID_ARGUMENT), ("x" * 80, {}, grpc.StatusCode.RESOURCE_EXHAUSTED),
             ("x", {"min_p": 2.0}, grpc.StatusCode.INVALID_ARGUMENT),
             ("x", {"seed": -1}, grpc.StatusCode.INVALID_ARGUMENT)]
    for rid in ("r" * 300, "héllo", "a\nb", "tab\there"):  # too long; not a metadata value
        with pytest.raises(grpc.RpcError) as e:
            client.generate_text("x", request_id=rid)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details(), rid
    for prompt, kw, code in cases:
        with pytest.raises(grpc.RpcError) as e:
            client.generate_text(prompt, **kw)
        assert e.value.code() == code, (prompt, kw, e.value.details())
        assert client.generate_text("ok", max_new_tokens=2).finish_reason == "length"
    with pytest.raises(grpc.RpcError) as e:
        client.abort("nope")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_engine_queue_full_maps_to_resource_exhausted():
    engine = FakeEngine(EngineConfig(max_running_requests=1, max_context_len=64, max_queued_requests=1),
                        step_delay=0.01)
    worker = EngineWorker(engine).start()
    st = ServerThread(worker).start()
    try:
        with GenerationClient(st.target, timeout=30) as c:
            streams = [c.generate("a", max_new_tokens=40) for _ in range(6)]
            codes = []
            for s in streams:
                try:
                    list(s)
                    codes.append("ok")
                except grpc.RpcError as e:
                    codes.append(e.code())
            assert "ok" in codes and grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    finally:
        st.stop()
        worker.stop()
    engine.check_integrity()


def test_metrics_endpoint(served):
    _, _, st, client = served
    client.generate_text("abc", max_new_tokens=3)
    text = urllib.request.urlopen(f"http://127.0.0.1:{st.server.metrics_port}/metrics", timeout=10).read().decode()
    for name in ("jaxoverlap_generated_tokens_total", "jaxoverlap_time_to_first_token_seconds_bucket",
                 "jaxoverlap_accept_length_bucket", "jaxoverlap_queue_depth", "jaxoverlap_running_requests",
                 "jaxoverlap_kv_cache_usage_ratio", 'jaxoverlap_requests_total{finish_reason="length"}',
                 "jaxoverlap_engine_up 1.0"):
        assert name in text, name
    tokens = [line for line in text.splitlines() if line.startswith("jaxoverlap_generated_tokens_total")]
    assert float(tokens[0].split()[-1]) >= 3


def test_async_client_and_cancel(served):
    engine, worker, st, client = served

    async def main():
        async with AsyncGenerationClient(st.target) as ac:
            assert await ac.health() == "SERVING"
            r = await ac.generate_text([10, 11], max_new_tokens=4)
            assert len(r.token_ids) == 4
            stream = ac.generate("abc", max_new_tokens=60)
            n = 0
            with pytest.raises(asyncio.CancelledError):
                async for item in stream:
                    n += 1
                    if n == 2:
                        stream.cancel()
    asyncio.run(main())
    _wait_idle(client)
    worker.call_sync(lambda e: e.check_integrity())


def test_abort_before_the_engine_has_the_request():
    """A client may abort as soon as the initial metadata names its request, while a long
    text is still being tokenized: the abort holds, and the stream ends "abort"."""
    engine = FakeEngine(EngineConfig(max_running_requests=4, max_context_len=4096, kv_cache_tokens=8192),
                        step_delay=0.002)
    worker = EngineWorker(engine).start()
    st = ServerThread(worker).start()
    client = GenerationClient(st.target, timeout=30)
    release = threading.Event()
    real = engine.tokenizer.encode_batch

    def held_encode_batch(texts, add_special_tokens=True):
        release.wait(10)
        return real(texts, add_special_tokens)

    engine.tokenizer.encode_batch = held_encode_batch
    try:
        call = client._stub.Generate(build_request("a" * 3000, "early", max_new_tokens=50))
        assert dict(call.initial_metadata())["jaxoverlap-request-id"] == "early"
        client.abort("early")  # the adds have not been sent yet
    finally:
        release.set()
        engine.tokenizer.encode_batch = real
    try:
        last = list(call)[-1].complete
        assert last.finish_reason == "abort" and len(last.token_ids) < 50
        _wait_idle(client)
    finally:
        client.close()
        st.stop()
        worker.stop()
    engine.check_integrity()


def test_malformed_bytes_and_reserved_ids_are_invalid_arguments(served):
    """Bytes that are no request (bad UTF-8 in a string, a cut message) are INVALID_ARGUMENT,
    not UNKNOWN; a group field cannot hide a second input from the one-input check; a
    client's id may not contain the '#' of the server's sample ids (a plain "x#0" would meet
    sample 0 of another call's "x")."""
    _, _, _, client = served
    gen = client.channel.unary_stream("/jaxoverlap.v1.Generation/Generate", request_serializer=lambda b: b,
                                      response_deserializer=pb.GenerateResponse.FromString)
    abort = client.channel.unary_unary("/jaxoverlap.v1.Generation/Abort", request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
    group = bytes([(15 << 3) | 3, (15 << 3) | 4])  # an empty group, field 15 (no proto3 writer makes one)
    both = (group + pb.GenerateRequest(text="hello").SerializeToString()
            + pb.GenerateRequest(token_ids=pb.TokenIds(ids=[40, 41])).SerializeToString())
    for call, raw, message in ((gen, b"\x12\x02\xff\xfe", "malformed GenerateRequest"),
                               (gen, b"\x12\x10abc", "malformed GenerateRequest"),
                               (abort, b"\x0a\x10abc", "malformed AbortRequest"),
                               (gen, both, "exactly one of text, token_ids and chat")):
        with pytest.raises(grpc.RpcError) as e:
            result = call(raw, timeout=10)
            list(result) if call is gen else result
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details(), e.value
    with pytest.raises(grpc.RpcError) as e:
        client.generate_text("abc", request_id="x#0", max_new_tokens=2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'#'" in e.value.details()
    # The walk still counts the fields after a group: one input behind it is served.
    one = group + pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(max_new_tokens=2)).SerializeToString()
    assert list(gen(one, timeout=10))[-1].complete.finish_reason in ("length", "stop")


def test_an_abort_past_its_deadline_still_aborts_and_harms_nothing():
    """An Abort call whose deadline passes while the engine is inside a step (seconds while a
    program compiles) cancels its future; the engine thread must still abort the request,
    drop the answer, and keep serving everyone else."""
    engine = FakeEngine(EngineConfig(max_running_requests=8, max_context_len=64, kv_cache_tokens=1024),
                        step_delay=0.5)
    worker = EngineWorker(engine).start()
    st = ServerThread(worker).start()
    client = GenerationClient(st.target, timeout=30)
    try:
        victim = iter(client.generate("abc", request_id="victim", max_new_tokens=40, ignore_eos=True))
        next(victim)
        with pytest.raises(grpc.RpcError) as err:
            client.abort("victim", timeout=0.05)  # the engine is inside a 0.5 s step
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert list(victim)[-1].finish_reason == "abort"
        assert worker.dead_error is None and worker.alive
        assert client.generate_text("xyz", max_new_tokens=2, ignore_eos=True).finish_reason == "length"
        assert client.health() == "SERVING"
    finally:
        client.close()
        st.stop()
        worker.stop()
    engine.check_integrity()


def test_a_retry_may_reuse_the_id_of_a_call_that_ended_early():
    """The call's end only queues its abort; the engine holds the id until its next step. A
    retry with that id waits for it instead of meeting ALREADY_EXISTS."""
    engine = _fake(step_delay=0.05)
    worker = EngineWorker(engine).start()
    st = ServerThread(worker).start()
    try:
        with GenerationClient(st.target, timeout=30) as c:
            for attempt in range(3):
                with pytest.raises(grpc.RpcError) as e:
                    list(c._stub.Generate(build_request("abc", "job", max_new_tokens=60), timeout=0.2))
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                done = c.generate_text("abc", request_id="job", max_new_tokens=2)
                assert done.finish_reason == "length", attempt
                stream = c._stub.Generate(build_request("abc", "job", max_new_tokens=60))
                next(stream)
                stream.cancel()
                assert c.generate_text("abc", request_id="job", max_new_tokens=2).finish_reason == "length"
            assert st.server.servicer.retiring == {}
    finally:
        st.stop()
        worker.stop()
    engine.check_integrity()


def test_a_stalled_engine_turns_health_not_serving_until_it_steps_again():
    engine = _fake(step_delay=0.001)
    gate = threading.Event()
    gate.set()
    real_step = engine.step

    def step():
        gate.wait(30)  # cleared: a hung device
        return real_step()

    engine.step = step
    worker = EngineWorker(engine).start()
    st = ServerThread(worker, stall_timeout=0.3).start()
    done = []
    try:
        with GenerationClient(st.target, timeout=30) as c:
            assert c.generate_text("ab", max_new_tokens=2).finish_reason == "length"
            time.sleep(0.8)  # an idle engine finishes no step either: that is no stall
            assert c.health() == "SERVING"
            gate.clear()
            waiting = threading.Thread(target=lambda: done.append(c.generate_text("abc", max_new_tokens=5)))
            waiting.start()
            assert _health_turns(c, "NOT_SERVING") == "NOT_SERVING"
            parser = argparse.ArgumentParser()
            cli_commands.add_client_args(parser)
            assert cli_commands.run_client(parser.parse_args(["--target", st.target, "--health"])) == 1
            gate.set()
            assert _health_turns(c, "SERVING") == "SERVING"
            waiting.join(10)
            assert done and done[0].finish_reason == "length"
    finally:
        gate.set()
        st.stop()
        worker.stop()


def _health_turns(client, want, timeout=10.0):
    deadline = time.monotonic() + timeout
    while client.health() != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return client.health()


def test_a_stream_given_up_ends_its_call_and_metrics_count_calls_that_end_early():
    """A stream used as a context manager ends its call on the way out, and an async stream
    dropped unread ends it too (a grpc.aio call would outlive it), so the server aborts the
    request; calls that end by a deadline or a cancel are counted."""
    engine = _fake(step_delay=0.01)
    worker = EngineWorker(engine).start()
    st = ServerThread(worker, metrics_port=-1).start()
    try:
        with GenerationClient(st.target, timeout=30) as c:

            async def leave_early():
                async with AsyncGenerationClient(st.target) as ac:

                    async def idle():
                        for _ in range(200):
                            if (await ac.server_info())["running_requests"] == 0:
                                return True
                            await asyncio.sleep(0.02)
                        return False

                    async with ac.generate("abc", max_new_tokens=3000, ignore_eos=True) as stream:
                        async for _ in stream:
                            break
                    first = await idle()
                    stream = ac.generate("abc", max_new_tokens=3000, ignore_eos=True)
                    async for _ in stream:
                        break
                    del stream
                    gc.collect()
                    return first, await idle()

            assert asyncio.run(leave_early()) == (True, True)
            with c.generate("abc", max_new_tokens=3000, ignore_eos=True) as stream:
                next(iter(stream))
            _wait_idle(c)
            with pytest.raises(grpc.RpcError) as e:
                c.generate_text("slow", max_new_tokens=3000, ignore_eos=True, timeout=0.3)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            _wait_idle(c)
            text = urllib.request.urlopen(f"http://127.0.0.1:{st.server.metrics_port}/metrics", timeout=10).read().decode()
            assert 'jaxoverlap_request_errors_total{code="DEADLINE_EXCEEDED"} 1.0' in text
            cancelled = [line for line in text.splitlines() if line.startswith('jaxoverlap_request_errors_total{code="CANCELLED"}')]
            assert cancelled and float(cancelled[0].split()[-1]) == 3.0  # the three streams given up
    finally:
        st.stop()
        worker.stop()
    engine.check_integrity()


def test_graceful_shutdown_drains():
    engine = _fake(step_delay=0.01)
    worker = EngineWorker(engine).start()
    st = ServerThread(worker).start()
    client = GenerationClient(st.target, timeout=30)
    results = {}

    def run(i):
        try:
            results[i] = client.generate_text("a", max_new_tokens=30).finish_reason
        except grpc.RpcError as e:
            results[i] = e.code()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while st.server.active_streams < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    stopper = threading.Thread(target=st.stop, kwargs={"grace": 10.0})
    stopper.start()
    while st.server.servicer.accepting and time.monotonic() < deadline:
        time.sleep(0.005)
    with pytest.raises(grpc.RpcError) as e:  # refused while draining
        client.generate_text("b", max_new_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    for t in threads:
        t.join(30)
    stopper.join(30)
    assert results == {i: "length" for i in range(4)}  # all in-flight requests completed
    client.close()
    worker.stop()
    engine.check_integrity()


def test_shutdown_grace_expiry_aborts_the_rest():
    engine = _fake(step_delay=0.01)
    worker = EngineWorker(engine).start()
    st = ServerThread(worker).start()
    client = GenerationClient(st.target, timeout=30)
    errors = []

    def run():
        try:
            client.generate_text("a", max_new_tokens=60)
            errors.append(None)
        except grpc.RpcError as e:
            errors.append(e.code())

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 10
    while st.server.active_streams < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    st.stop(grace=0.05)
    t.join(30)
    assert errors and errors[0] is not None  # cut off, not completed
    worker.call_sync(lambda e: None)  # the abort has been handled once this returns ...
    deadline = time.monotonic() + 5
    while worker.call_sync(lambda e: e.has_work()) and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.call_sync(lambda e: e.check_integrity())
    client.close()
    worker.stop()


def test_worker_stop_releases_waiters():
    engine = _fake(step_delay=0.005)
    worker = EngineWorker(engine).start()
    st = ServerThread(worker).start()
    client = GenerationClient(st.target, timeout=30)
    out = []

    def run():
        try:
            out.append(client.generate_text("a", max_new_tokens=50).finish_reason)
        except grpc.RpcError as e:
            out.append(e.code())

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 10
    # Wait until the request is in the engine: a stop before that is answered UNAVAILABLE.
    while not (st.server.active_streams >= 1 and engine.has_work()) and time.monotonic() < deadline:
        time.sleep(0.005)
    worker.stop()  # the engine goes away under a live stream: it ends with "abort"
    t.join(30)
    assert out == ["abort"]
    engine.check_integrity()
    st.stop()
    client.close()


def _self_signed_cert(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not available")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return str(cert), str(key)


def test_tls_and_token(tmp_path):
    cert, key = _self_signed_cert(tmp_path)
    engine = _fake()
    worker = EngineWorker(engine).start()
    st = ServerThread(worker, tls_cert=cert, tls_key=key, auth_token="t0ken").start()
    try:
        with GenerationClient(st.target, token="t0ken", tls_ca=cert, timeout=30) as c:
            assert c.generate_text("hi", max_new_tokens=3).finish_reason == "length"
        with GenerationClient(st.target, tls_ca=cert, timeout=30) as c:
            assert c.health() == "SERVING"  # open without the token
            with pytest.raises(grpc.RpcError) as e:
                c.model_info()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with GenerationClient(st.target, token="t0ken", timeout=5) as c:  # plaintext to a TLS port
            with pytest.raises(grpc.RpcError) as e:
                c.model_info()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        st.stop()
        worker.stop()


# ---- bench and CLI glue -------------------------------------------------------------------------


def test_bench_refuses_bad_options_before_connecting(capsys):
    parser = argparse.ArgumentParser()
    cli_commands.add_bench_args(parser)
    for argv, message in ((["--goodput", "bad"], "goodput SLO 'bad'"), (["--json-schema", "{bad"], "not JSON"),
                          (["--regex", "a", "--choice", "b"], "give one of"), (["--input-len", "x"], "")):
        # No server listens there: a refusal comes before any connection.
        assert cli_commands.run_bench(parser.parse_args(["--target", "127.0.0.1:1", *argv])) == 2, argv
        assert message in capsys.readouterr().err


def test_bench_compare_two_targets(served, tmp_path, capsys):
    _, _, st, client = served
    parser = argparse.ArgumentParser()
    cli_commands.add_bench_args(parser)
    out = tmp_path / "res.json"
    args = parser.parse_args(["--target", st.target, "--target", st.target, "--label", "left", "--label", "right",
                              "--num-prompts", "12", "--input-len", "4:8", "--output-len", "3:6",
                              "--max-concurrency", "4", "--request-rate", "200", "--rounds", "3",
                              "--output-file", str(out), "--no-progress", "--save-requests"])
    assert cli_commands.run_bench(args) == 0
    report = json.loads(out.read_text())
    for label in ("left", "right"):
        r = report["results"][label]
        assert r["completed"] == 12 and r["failed"] == 0
        assert 12 * 3 <= r["total_output_tokens"] <= 12 * 6
        assert r["ttft_ms"]["mean"] > 0 and r["output_throughput"] > 0
        assert len(report["requests"][label]) == 12
    # Same prompts and lengths on both sides.
    assert [q["planned_output_len"] for q in report["requests"]["left"]] == \
        [q["planned_output_len"] for q in report["requests"]["right"]]
    printed = capsys.readouterr().out
    assert "left" in printed and "right" in printed and "vs left" in printed
    # The fake engine reports no loop totals: no engine rows, and no error.
    assert report["results"]["left"]["engine"] is None and "Engine host time" not in printed
    _wait_idle(client)


def test_bench_sharegpt_single_target(served, tmp_path):
    _, _, st, _ = served
    data = [{"conversations": [{"from": "human", "value": f"question number {i} about things"},
                               {"from": "gpt", "value": "an answer " * (2 + i)}]} for i in range(6)]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    cfg = bench.BenchConfig(targets=[st.target], dataset=str(path), num_prompts=6, max_output_len=8,
                            max_input_len=60, progress=False, warmup_requests=1)
    report = asyncio.run(bench.benchmark(cfg))
    assert report["results"]["result"]["completed"] == 6


def test_client_cli(served, capsys):
    _, _, st, _ = served
    parser = argparse.ArgumentParser()
    cli_commands.add_client_args(parser)
    assert cli_commands.run_client(parser.parse_args(["--target", st.target, "hello", "--max-new-tokens", "4"])) == 0
    captured = capsys.readouterr()
    assert "[length]" in captured.err and len(captured.out.strip()) == 4
    assert cli_commands.run_client(parser.parse_args(["--target", st.target, "--token-ids", "5,6", "--json",
                                                      "--max-new-tokens", "2"])) == 0
    assert json.loads(capsys.readouterr().out)["finish_reason"] == "length"
    assert cli_commands.run_client(parser.parse_args(["--target", st.target, "--token-ids", "5,6", "--json", "-n", "3",
                                                      "--max-new-tokens", "2"])) == 0
    assert [r["index"] for r in json.loads(capsys.readouterr().out)] == [0, 1, 2]
    assert cli_commands.run_client(parser.parse_args(["--target", st.target, "hi", "--n", "2",
                                                      "--max-new-tokens", "2"])) == 0
    assert capsys.readouterr().out.count("--- sample ") == 2
    assert cli_commands.run_client(parser.parse_args(["--target", st.target, "--health"])) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert cli_commands.run_client(parser.parse_args(["--target", st.target, "--info"])) == 0
    assert json.loads(capsys.readouterr().out)["model"]["model_name"] == "fake-model"
    assert cli_commands.run_client(parser.parse_args(["--target", st.target, "--abort", "nope"])) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert cli_commands.run_client(parser.parse_args(["--target", st.target, "hi", "--regex", "a+",
                                                      "--choice", "x"])) == 2
    assert "one of --json-schema, --regex and --choice" in capsys.readouterr().err


def test_structured_output_through_the_proto():
    """The client's dict form, to the message and back to SamplingParams on the server."""
    from jaxoverlap.server.grpc_server import sampling_params_from_proto
    from jaxoverlap.structured import StructuredOutput

    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    for given, want in (({"json_schema": schema}, StructuredOutput(json_schema=json.dumps(schema))),
                        ({"json": json.dumps(schema)}, StructuredOutput(json_schema=json.dumps(schema))),
                        ({"choice": ["x", "y"]}, StructuredOutput(choice=("x", "y"))),
                        ({"regex": "a+"}, StructuredOutput(regex="a+")),
                        ({"json_object": True}, StructuredOutput(json_object=True)),
                        ({"grammar": "start: \"a\""}, StructuredOutput(grammar='start: "a"'))):
        req = build_request("hi", structured_output=given)
        assert sampling_params_from_proto(req.sampling_params).structured_output == want, given
    assert sampling_params_from_proto(build_request("hi").sampling_params).structured_output is None
    with pytest.raises(TypeError, match="structured_output"):
        build_request("hi", structured_output={"regex": "a", "choice": ["b"]})
    empty = pb.SamplingParams()
    empty.structured_output.SetInParent()  # the message sent with none of its kinds
    with pytest.raises(InvalidRequestError, match="none of its kinds"):
        sampling_params_from_proto(empty)


def test_lead_cli_parses_server_subcommands():
    cli = pytest.importorskip("jaxoverlap.cli")
    for sub in ("serve", "client", "bench"):
        with pytest.raises(SystemExit) as e:
            cli.main([sub, "--help"])
        assert e.value.code == 0


def test_serve_args_with_shared_engine_args():
    parser = argparse.ArgumentParser()
    cli_commands.add_serve_args(parser)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args(["--port", "0", "--metrics-port", "9100", "--max-queued-requests", "5"])
    assert (args.host, args.port, args.metrics_port, args.max_queued_requests) == ("127.0.0.1", 0, 9100, 5)
    # A parser that already has the flag keeps its own definition.
    p2 = argparse.ArgumentParser()
    p2.add_argument("--max-queued-requests", type=int, default=77)
    cli_commands.add_serve_args(p2)
    assert p2.parse_args([]).max_queued_requests == 77


def test_auth_token_file(tmp_path):
    path = tmp_path / "tok"
    path.write_text("abc\n")
    ns = argparse.Namespace(auth_token=None, auth_token_file=str(path))
    assert cli_commands._read_token(ns) == "abc"
    assert os.path.exists(path)


def test_precompile_runs_before_start_returns_and_on_the_engine_thread():
    engine = _fake()
    seen = []
    def warmup(sampling, prefill, top_logprobs, structured, prompt_logprobs):
        flags = (("structured",) if structured else ()) + (("prompt_logprobs",) if prompt_logprobs else ())
        seen.append((threading.current_thread().name, prefill, sampling, top_logprobs) + flags)
        return [{"batch": 1}]

    engine.warmup = warmup
    worker = EngineWorker(engine, precompile=True, name="engine-thread-under-test").start()
    try:  # by default the sampling decode programs too: a server cannot know if clients sample
        assert seen == [("engine-thread-under-test", False, (False, True), False)]
    finally:
        worker.stop()
    # --precompile all: the prefill programs too; greedy only where the caller says so.
    EngineWorker(engine, precompile=True, precompile_prefill=True, precompile_sampling=[False], name="t2").start().stop()
    assert seen[-1] == ("t2", True, (False,), False)
    # --precompile-top-logprobs: each program's top-logprobs variant too.
    EngineWorker(engine, precompile=True, precompile_top_logprobs=True, name="t3").start().stop()
    assert seen[-1] == ("t3", False, (False, True), True)
    # --precompile-structured: the programs of batches with structured output too.
    EngineWorker(engine, precompile=True, precompile_structured=True, name="t4").start().stop()
    assert seen[-1] == ("t4", False, (False, True), False, "structured")
    # --precompile all --precompile-prompt-logprobs: each prefill program's scoring variant too.
    EngineWorker(engine, precompile=True, precompile_prefill=True, precompile_prompt_logprobs=True,
                 name="t5").start().stop()
    assert seen[-1] == ("t5", True, (False, True), False, "prompt_logprobs")
    with pytest.raises(ValueError, match="needs precompile_prefill"):  # refused when made, on any backend
        EngineWorker(engine, precompile="auto", precompile_prompt_logprobs=True)
    from jaxoverlap.server.engine_process import EngineProcess

    with pytest.raises(ValueError, match="needs precompile_prefill"):
        EngineProcess(_fake, precompile=True, precompile_prompt_logprobs=True)
    plain = _fake()
    plain.warmup = lambda **_: seen.append("unexpected") or []
    EngineWorker(plain).start().stop()
    assert seen[-1] == ("t5", True, (False, True), False, "prompt_logprobs")


def test_stop_closes_an_engine_the_worker_built_and_only_that():
    closed = []

    def fake_with_close():
        engine = _fake()
        engine.close = lambda: closed.append(engine)
        return engine

    worker = EngineWorker(engine_factory=fake_with_close).start()
    built = worker.engine
    worker.stop()
    assert closed == [built]
    passed_in = fake_with_close()
    EngineWorker(passed_in).start().stop()
    assert closed == [built]  # the caller's engine is the caller's to close


def test_chat_input_is_rendered_by_the_models_template(capsys, monkeypatch):
    """`chat` input: the server renders the messages with the model's template and encodes
    the text without special tokens; the engine gets what the same text as token ids gives.
    A model without a template, and conversations the template refuses, get INVALID_ARGUMENT."""
    from jaxoverlap.models.chat_template import ChatTemplate

    engine = _fake()
    worker = EngineWorker(engine).start()
    plain = ServerThread(worker).start()  # started before the model had a template
    engine.tokenizer.chat_template = ChatTemplate(
        "{% if messages | length > 2 %}{{ raise_exception('at most two messages') }}{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% if short %}!{% endif %}{% endif %}")
    chat = ServerThread(worker).start()
    client = GenerationClient(chat.target, timeout=30)
    try:
        assert client.model_info()["has_chat_template"]
        messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Héllo"}]
        for kw, text in (({}, "[system]Be kind.[user]Héllo[assistant]"),
                         ({"chat_template_kwargs": {"short": True}}, "[system]Be kind.[user]Héllo[assistant]!"),
                         ({"add_generation_prompt": False}, "[system]Be kind.[user]Héllo")):
            engine.tokenizer.special_flags.clear()
            got = client.generate_text(messages, max_new_tokens=4, **kw)
            assert engine.tokenizer.special_flags == [False]  # the template wrote the prompt's specials
            want = client.generate_text(engine.tokenizer.encode(text), max_new_tokens=4)
            assert (got.token_ids, got.prompt_tokens) == (want.token_ids, want.prompt_tokens), kw
        refused = [
            (messages * 2, "at most two messages"),
            ([], "empty input"),
        ]
        for bad, word in refused:
            req = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in bad]))
            with pytest.raises(grpc.RpcError) as e:
                list(client._stub.Generate(req))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and word in e.value.details()
        for kwargs_json, word in (("{", "not JSON"), ("[1]", "JSON object"), ("[" * 100000, "not JSON"),
                                  ('{"add_generation_prompt": false}', "may not set add_generation_prompt"),
                                  ('{"messages": []}', "may not set messages")):
            req = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x")],
                                                  chat_template_kwargs_json=kwargs_json))
            with pytest.raises(grpc.RpcError) as e:
                list(client._stub.Generate(req))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and word in e.value.details()
        # A long conversation renders on a worker thread (not on the server's event loop), alike.
        from jaxoverlap.server import grpc_server

        monkeypatch.setattr(grpc_server, "INLINE_TOKENIZE_MAX_CHARS", 8)
        rendered = []
        real_render = grpc_server._chat_text
        monkeypatch.setattr(grpc_server, "_chat_text",
                            lambda *a: rendered.append(threading.current_thread().name) or real_render(*a))
        got = client.generate_text([{"role": "user", "content": "Héllo Héllo"}], max_new_tokens=4)
        want = client.generate_text(engine.tokenizer.encode("[user]Héllo Héllo[assistant]"), max_new_tokens=4)
        assert rendered and rendered[0] != "jaxoverlap-grpc"  # not the server's loop thread
        assert (got.token_ids, got.prompt_tokens) == (want.token_ids, want.prompt_tokens)
        with pytest.raises(TypeError, match="chat messages only"):
            build_request("text", chat_template_kwargs={"short": True})
        parser = argparse.ArgumentParser()
        cli_commands.add_client_args(parser)
        args = ["--target", chat.target, "Héllo", "--chat", "--system", "Be kind.", "--json", "--max-new-tokens", "4"]
        assert cli_commands.run_client(parser.parse_args(args)) == 0
        want = client.generate_text(messages, max_new_tokens=4).token_ids
        assert json.loads(capsys.readouterr().out)["token_ids"] == want
        assert cli_commands.run_client(parser.parse_args(["--target", chat.target, "hi", "--system", "x"])) == 2
        # The first server read the model's info before the template was set.
        old = GenerationClient(plain.target, timeout=30)
        assert not old.model_info()["has_chat_template"]
        old.close()
        engine.tokenizer.chat_template = None
        with pytest.raises(grpc.RpcError) as e:
            client.generate_text(messages, max_new_tokens=2)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in e.value.details()
        assert client.generate_text("still serving", max_new_tokens=2).finish_reason == "length"
    finally:
        client.close()
        chat.stop()
        plain.stop()
        worker.stop()


def test_deep_json_and_long_errors_are_invalid_arguments(served):
    """JSON nested past what Python's json reads is a bad request, not a server error; a
    message longer than gRPC's metadata allows is cut, so the client gets its status."""
    from jaxoverlap.server.grpc_server import MAX_DETAILS_CHARS, _details

    _, _, _, client = served
    for schema in ("[" * 100000, '{"a":' * 100000):
        req = pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(
            structured_output=pb.StructuredOutput(json_schema=schema)))
        with pytest.raises(grpc.RpcError) as e:
            list(client._stub.Generate(req))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not JSON" in e.value.details()
    assert _details("x" * 10) == "x" * 10
    cut = _details("y" * 50000)
    assert cut.startswith("y" * MAX_DETAILS_CHARS) and "47952 more characters cut" in cut and len(cut) < 2200
    assert client.generate_text("ok", max_new_tokens=2).finish_reason == "length"


def test_outputs_that_piled_up_merge_into_chunks_of_bounded_size(monkeypatch):
    """A slow reader's outputs merge, each sample's in order, into chunks of at most
    MAX_CHUNK_TOKENS tokens (or one output past it), so that no message outgrows gRPC's limit."""
    from jaxoverlap.outputs import RequestMetrics, RequestOutput
    from jaxoverlap.server import grpc_server

    monkeypatch.setattr(grpc_server, "MAX_CHUNK_TOKENS", 4)
    outs, ids = [], {"a": [], "b": []}
    for step in range(7):
        for rid, n in (("a", 1), ("b", 3)):
            new = [10 * step + j for j in range(n)]
            ids[rid] += new
            outs.append(RequestOutput(rid, new, "t" * n, step == 6, "length" if step == 6 else None, RequestMetrics(),
                                      new_logprobs=[-1.0] * n, new_top_logprobs=[[(1, -0.5)]] * n))
    chunks, finals = grpc_server._merge(outs, {"a": 0, "b": 1}, None)
    for k, rid in enumerate("ab"):
        mine = [part for j, part in chunks if j == k]
        assert [t for part in mine for t in part.tokens] == ids[rid]
        assert all(len(part.tokens) <= 4 + (3 if rid == "b" else 1) - 1 for part in mine)
        assert all(len(part.logprobs) == len(part.top) == len(part.tokens) == len("".join(part.texts))
                   for part in mine)
    assert [len(p.tokens) for j, p in chunks if j == 0] == [4, 3] and [k for k, _ in finals] == [0, 1]


def test_a_call_that_leaves_too_much_unread_ends_and_aborts_its_requests(monkeypatch):
    """The mailbox of a call whose client stopped reading keeps at most MAX_UNREAD tokens and
    top-logprob entries: past it, what waits is dropped, the requests are aborted (once), and
    the call ends; its requests are still tracked until the engine releases them."""
    from jaxoverlap.outputs import RequestMetrics, RequestOutput
    from jaxoverlap.server import grpc_server

    monkeypatch.setattr(grpc_server, "MAX_UNREAD", 50)

    async def run():
        box = grpc_server._OutputQueue(["r#0", "r#1"])
        aborted = []
        box.on_overflow = lambda: aborted.append(True)
        for step in range(10):  # 5 tokens of 1 top logprob each: 10 a step
            box.put(RequestOutput("r#0", [1] * 5, "", False, None, RequestMetrics(),
                                  new_top_logprobs=[[(2, -1.0)]] * 5))
            if step == 1:
                assert len(await box.get_all()) == 2  # taken: the count starts again
        assert box.overflowed and aborted == [True] and await box.get_all() == []
        box.put(RequestOutput("r#0", [1], "", True, "abort", RequestMetrics()))
        assert not box.released.is_set() and await box.get_all() == []
        box.put(RequestOutput("r#1", [], "", True, "abort", RequestMetrics()))
        assert box.released.is_set() and aborted == [True]

    asyncio.run(run())


def test_admission_counts_a_call_until_the_engine_releases_its_requests():
    """A call cancelled while the engine is inside a step keeps its place in the server's
    admission count until the engine has released its requests: starting and cancelling calls
    fast queues no more than max_running_requests + max_queued_requests; and an n that could
    never be admitted is a bad request, not a retryable one."""
    engine = FakeEngine(EngineConfig(max_running_requests=1, max_context_len=64, kv_cache_tokens=1024),
                        step_delay=0.4)
    worker = EngineWorker(engine).start()
    st = ServerThread(worker, max_queued_requests=0).start()
    try:
        with GenerationClient(st.target, timeout=30) as c:
            stream = c._stub.Generate(build_request("abc", "first", max_new_tokens=60))
            next(stream)
            stream.cancel()  # its abort waits for the step the engine is in
            with pytest.raises(grpc.RpcError) as e:
                c.generate_text("abc", max_new_tokens=2)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
            deadline = time.monotonic() + 10
            while st.server.servicer.engine_requests and time.monotonic() < deadline:
                time.sleep(0.02)
            assert c.generate_text("abc", max_new_tokens=2).finish_reason == "length"
            with pytest.raises(grpc.RpcError) as e:
                list(c.generate("abc", max_new_tokens=2, n=2))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n=2" in e.value.details()
    finally:
        st.stop()
        worker.stop()
    engine.check_integrity()


def test_a_start_that_fails_leaves_no_server_behind():
    """A start that fails after the gRPC port was bound (the metrics port is taken) raises,
    and leaves nothing listening there; stop() afterwards does nothing."""
    import socket

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from jaxoverlap.server.grpc_server import GenerationServer

    worker = EngineWorker(_fake()).start()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()

    async def run():
        server = GenerationServer(worker, metrics_port=busy.getsockname()[1])
        with pytest.raises(OSError):
            await server.start()
        assert server.port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.RpcError) as e:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        await server.stop(0)

    try:
        asyncio.run(run())
    finally:
        busy.close()
        worker.stop()
