"""The gRPC server over the real engine and the embedded tiny model, on 127.0.0.1.

One engine (and so one round of compilation) serves the whole module: the plain server, a
token-protected one and a queue-limited one all share its worker. The module runs twice: with
the engine on a thread of this process (EngineWorker) and in a process of its own
(EngineProcess, what `jaxoverlap serve` runs).
"""
from __future__ import annotations

import asyncio
import functools
import json
import math
import operator
import os
import random
import re
import time

import grpc
import pytest

from jaxoverlap.server import jaxoverlap_pb2 as pb
from jaxoverlap.server.client import AsyncGenerationClient, Chunk, Completion, GenerationClient
from jaxoverlap.server.engine_worker import EngineWorker
from jaxoverlap.server.grpc_server import SERVICE_NAME
from jaxoverlap.server.testing import ServerThread

pytestmark = pytest.mark.timeout(300)

ENGINE_OPTIONS = dict(max_running_requests=16, kv_cache_tokens=4096, max_context_len=256, page_size=8)
TOKEN = "test-token-123"


def _model_path():
    # The embedded default model; JAXOVERLAP_TEST_MODEL points elsewhere (e.g. a model being rebuilt).
    path = os.environ.get("JAXOVERLAP_TEST_MODEL")
    if path:
        return path
    from jaxoverlap.models import loader

    if not os.path.exists(os.path.join(loader.default_model_path(), "config.json")):
        pytest.skip("the embedded default model is not built (models/default_model)")
    return None


@pytest.fixture(scope="module", params=["thread", "process"])
def env(request):
    from jaxoverlap.config import EngineConfig
    from jaxoverlap.server.cli_commands import build_engine
    from jaxoverlap.server.engine_process import EngineProcess

    config = EngineConfig.from_options(_model_path(), **ENGINE_OPTIONS)
    factory = functools.partial(build_engine, config)
    if request.param == "thread":
        worker = EngineWorker(engine_factory=factory, warmup=True).start(timeout=240)
    else:
        worker = EngineProcess(factory, warmup=True).start(timeout=240)
    main = ServerThread(worker).start()
    authed = ServerThread(worker, auth_token=TOKEN).start()
    client = GenerationClient(main.target, timeout=60)
    info = client.model_info()
    yield {"worker": worker, "main": main, "authed": authed, "client": client, "info": info}
    client.close()
    for st in (main, authed):
        st.stop(grace=2)
    worker.stop()


def _wait_idle(env, timeout=20.0):
    """Poll until nothing runs or waits; then the engine must hold no leaked slot."""
    client = env["client"]
    deadline = time.monotonic() + timeout
    info = None
    while time.monotonic() < deadline:
        info = client.server_info()
        if not (info["running_requests"] or info["queued_requests"] or info["active_streams"]):
            break
        time.sleep(0.02)
    else:
        raise AssertionError(f"server not idle after {timeout}s: {info}")
    # has_work() stays true for one more step after an abort; let the worker finish it.
    worker = env["worker"]
    while worker.call_sync(operator.methodcaller("has_work"), timeout=10) and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.call_sync(operator.methodcaller("check_integrity"), timeout=10)
    return info


def _split(items):
    chunks = [i for i in items if isinstance(i, Chunk)]
    dones = [i for i in items if isinstance(i, Completion)]
    assert len(dones) == 1 and isinstance(items[-1], Completion)
    return chunks, dones[0]


def _ids(n, vocab, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


# ---- generate -----------------------------------------------------------------------------------


def test_generate_text_streams(env):
    client = env["client"]
    items = list(client.generate("Once upon a time", max_new_tokens=12, temperature=0.0))
    chunks, done = _split(items)
    assert [t for c in chunks for t in c.token_ids] == done.token_ids
    assert 1 <= len(done.token_ids) <= 12 and done.completion_tokens == len(done.token_ids)
    assert done.finish_reason in ("stop", "length") and done.prompt_tokens > 0
    assert done.time_to_first_token > 0 and done.accept_length >= 1.0
    text = "".join(c.text for c in chunks)
    assert text == client.generate_text("Once upon a time", max_new_tokens=12, temperature=0.0).text  # greedy
    # The handler made this text from the ids (no stop strings): it is what the engine's
    # own decoding gives, here all of the output decoded.
    full = client.generate_text("Once upon a time", max_new_tokens=12, temperature=0.0, ignore_eos=True)
    tokenizer = env["worker"].call_sync(operator.attrgetter("tokenizer"))
    assert full.finish_reason == "length" and full.text == tokenizer.decode(full.token_ids)


def test_generate_token_ids(env):
    client, vocab = env["client"], env["info"]["vocab_size"]
    prompt = _ids(10, vocab, 1)
    a = client.generate_text(prompt, max_new_tokens=9, temperature=0.0, ignore_eos=True, logprobs=True)
    b = client.generate_text(prompt, max_new_tokens=9, temperature=0.0, ignore_eos=True)
    assert a.finish_reason == "length" and len(a.token_ids) == 9 and a.token_ids == b.token_ids
    assert a.prompt_tokens == 10 and len(a.logprobs) == 9 and all(lp <= 0 for lp in a.logprobs)
    seeded = [client.generate_text(prompt, max_new_tokens=6, temperature=1.0, seed=5).token_ids for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_prompt_logprobs(env):
    """Loglikelihood scoring through the server (and, in the process variant, across the
    engine process's pipe): one logprob and argmax flag per prompt token after the first,
    the whole prompt computed even when the prefix cache holds it."""
    client, vocab = env["client"], env["info"]["vocab_size"]
    prompt = _ids(40, vocab, 2)
    plain = client.generate_text(prompt, max_new_tokens=2, temperature=0.0)
    assert plain.prompt_logprobs is None
    scored = [client.generate_text(prompt, max_new_tokens=2, temperature=0.0, prompt_logprobs=True) for _ in range(2)]
    for r in scored:
        assert r.cached_tokens == 0 and len(r.prompt_logprobs) == len(r.prompt_top1) == 39
        assert all(lp <= 0 for lp in r.prompt_logprobs)
    assert scored[0].prompt_logprobs == scored[1].prompt_logprobs and scored[0].token_ids == plain.token_ids
    # Scored from position 20 on: the prefix cache serves the pages before position 19.
    tail = client.generate_text(prompt, max_new_tokens=1, temperature=0.0, prompt_logprobs=True,
                                prompt_logprobs_start=20)
    assert tail.cached_tokens > 0 and all(math.isnan(lp) for lp in tail.prompt_logprobs[:19])
    assert tail.prompt_logprobs[19:] == pytest.approx(scored[0].prompt_logprobs[19:], abs=1e-2)
    _wait_idle(env)


def test_penalties(env):
    """Penalties and logit_bias reach the engine (across the engine process's pipe too): the
    server's tokens equal the engine's own for the same request, and differ from the plain
    ones."""
    client = env["client"]
    tokenizer = env["worker"].call_sync(operator.attrgetter("tokenizer"))
    prompt = tokenizer.encode("The cat sat on the mat. The cat sat on the mat. The cat")  # continues " sat on"
    kw = dict(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    plain = client.generate_text(prompt, **kw)
    got = client.generate_text(prompt, repetition_penalty=1.5, frequency_penalty=1.0, **kw)

    def engine_run(engine):
        from engine_fixtures import run_workload
        from jaxoverlap.sampling_params import SamplingParams

        return run_workload(engine, {0: [("direct", prompt, SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0,
                                                                           detokenize=False, **kw))]})["direct"].token_ids

    if isinstance(env["worker"], EngineWorker):  # a local function does not cross to the engine process
        assert got.token_ids == env["worker"].call_sync(engine_run, timeout=60)
    assert got.token_ids != plain.token_ids and got.cached_tokens == 0
    # logit_bias (a proto map): the plain run's first token banned, then favoured.
    banned = client.generate_text(prompt, logit_bias={plain.token_ids[0]: -100.0}, **kw)
    forced = client.generate_text(prompt, logit_bias={str(plain.token_ids[1]): 100.0}, **kw)
    assert plain.token_ids[0] not in banned.token_ids[:1] and set(forced.token_ids) == {plain.token_ids[1]}
    _wait_idle(env)


def test_top_logprobs(env):
    """Per output token, the k most likely tokens through the server (and across the engine
    process's pipe): greedy tokens are each list's first, with the chosen token's logprob."""
    client, vocab = env["client"], env["info"]["vocab_size"]
    r = client.generate_text(_ids(9, vocab, 4), max_new_tokens=7, temperature=0.0, ignore_eos=True, logprobs=True,
                             top_logprobs=3)
    assert len(r.top_logprobs) == len(r.token_ids) == 7
    for tok, lp, alts in zip(r.token_ids, r.logprobs, r.top_logprobs):
        assert len(alts) == 3 and alts[0][0] == tok and alts[0][1] == pytest.approx(lp, abs=1e-5)
        assert alts[0][1] >= alts[1][1] >= alts[2][1]
    assert client.generate_text([5, 6, 7], max_new_tokens=2).top_logprobs is None
    _wait_idle(env)


def test_n_samples(env):
    """SamplingParams.n through the server: one stream carries every sample's chunks, told
    apart by index, and one complete per sample; sample k equals a request of its own with
    seed + k; the samples share the prompt's prefill."""
    client, vocab = env["client"], env["info"]["vocab_size"]
    prompt = _ids(21, vocab, 6)
    kw = dict(max_new_tokens=6, temperature=1.0, ignore_eos=True, logprobs=True)
    items = list(client.generate(prompt, n=3, seed=9, **kw))
    assert isinstance(items[-1], Completion)
    dones = {c.index: c for c in items if isinstance(c, Completion)}
    assert sorted(dones) == [0, 1, 2] and len([c for c in items if isinstance(c, Completion)]) == 3
    tokenizer = env["worker"].call_sync(operator.attrgetter("tokenizer"))
    for k in range(3):
        tokens = [t for c in items if isinstance(c, Chunk) and c.index == k for t in c.token_ids]
        alone = client.generate_text(prompt, seed=9 + k, **kw)
        assert tokens == dones[k].token_ids == alone.token_ids, k
        assert "".join(c.text for c in items if isinstance(c, Chunk) and c.index == k) == tokenizer.decode(tokens)
    assert len({tuple(d.token_ids) for d in dones.values()}) > 1
    samples = client.generate_samples(prompt, 3, seed=9, **kw)
    assert [r.index for r in samples] == [0, 1, 2] and [r.token_ids for r in samples] == [
        dones[k].token_ids for k in range(3)]
    assert [len(r.logprobs) for r in samples] == [6, 6, 6]
    fresh = client.generate_samples(_ids(21, vocab, 7), 4, **kw)  # a prompt never sent: one prefill, three cached
    assert sorted(r.cached_tokens for r in fresh) == [0, 16, 16, 16]
    with pytest.raises(TypeError, match="generate_samples"):
        client.generate_text(prompt, n=2)
    with pytest.raises(grpc.RpcError) as e:
        client.generate_samples(prompt, 129)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be" in e.value.details()
    _wait_idle(env)


def test_model_and_server_info(env):
    client = env["client"]
    m = env["info"]
    assert m["vocab_size"] > 0 and m["max_context_len"] == 256 and m["model_name"]
    assert m["speculative_algorithm"] == ""
    s = client.server_info()
    assert s["engine_config"]["page_size"] == 8 and s["engine_config"]["max_running_requests"] == 16
    assert s["kv_total_tokens"] >= 4096 - 8 and 0.0 <= s["kv_usage"] <= 1.0
    assert s["stats"]["tokens_generated"] >= 0


def test_health_and_reflection(env):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    client = env["client"]
    assert client.health() == "SERVING"
    assert client.health(SERVICE_NAME) == "SERVING"
    with pytest.raises(grpc.RpcError) as e:
        client.health("no.such.Service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    db = ProtoReflectionDescriptorDatabase(client.channel)
    services = set(db.get_services())
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= services
    fd = db.FindFileContainingSymbol(SERVICE_NAME)
    assert fd.name == "jaxoverlap/v1/jaxoverlap.proto"
    assert [m.name for m in fd.service[0].method] == ["Generate", "Abort", "GetModelInfo", "GetServerInfo"]


# ---- errors -------------------------------------------------------------------------------------


def _raw_generate(channel, raw: bytes, timeout=30):
    call = channel.unary_stream("/jaxoverlap.v1.Generation/Generate", request_serializer=lambda b: b,
                                response_deserializer=pb.GenerateResponse.FromString)
    return list(call(raw, timeout=timeout))


BAD = [
    ("empty text", "", {}, grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    ("empty ids", [], {}, grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    ("id outside vocab", [1, 10**6], {}, grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    ("negative temperature", "hi", {"temperature": -0.5}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("zero max_new_tokens", "hi", {"max_new_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
    ("top_p zero", "hi", {"top_p": 0.0}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("min_p above one", "hi", {"min_p": 1.5}, grpc.StatusCode.INVALID_ARGUMENT, "min_p"),
    ("negative top_k", "hi", {"top_k": -3}, grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    ("seed out of range", "hi", {"seed": 2**40}, grpc.StatusCode.INVALID_ARGUMENT, "seed"),
    ("empty stop string", "hi", {"stop": [""]}, grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    ("frequency penalty out of range", "hi", {"frequency_penalty": 3.0}, grpc.StatusCode.INVALID_ARGUMENT,
     "frequency_penalty"),
    ("zero samples", "hi", {"n": 0}, grpc.StatusCode.INVALID_ARGUMENT, "n must be"),
    ("top_logprobs above 20", "hi", {"top_logprobs": 21}, grpc.StatusCode.INVALID_ARGUMENT, "top_logprobs"),
    ("logit_bias out of range", "hi", {"logit_bias": {5: 101.0}}, grpc.StatusCode.INVALID_ARGUMENT, "logit_bias"),
    ("logit_bias outside vocab", "hi", {"logit_bias": {10**6: 1.0}}, grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    ("prompt ids too long", list(range(3, 303)), {}, grpc.StatusCode.RESOURCE_EXHAUSTED, "context"),
    ("prompt text too long", "word " * 600, {}, grpc.StatusCode.RESOURCE_EXHAUSTED, "context"),
]


@pytest.mark.parametrize("name,prompt,kw,code,word", BAD, ids=[b[0] for b in BAD])
def test_bad_request_is_rejected_and_server_keeps_serving(env, name, prompt, kw, code, word):
    client = env["client"]
    with pytest.raises(grpc.RpcError) as e:
        client.generate_text(prompt, **kw)
    assert e.value.code() == code and word in e.value.details(), e.value.details()
    assert client.generate_text([5, 6, 7], max_new_tokens=2, ignore_eos=True).finish_reason == "length"


def test_no_input_and_both_inputs(env):
    channel = env["client"].channel
    with pytest.raises(grpc.RpcError) as e:
        _raw_generate(channel, pb.GenerateRequest(request_id="none").SerializeToString())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no input" in e.value.details()
    # Protobuf would keep only the last oneof member; a client that sets both must hear about it.
    both = (pb.GenerateRequest(request_id="both", text="hi").SerializeToString()
            + pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6])).SerializeToString())
    chat = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])).SerializeToString()
    for two in (both, pb.GenerateRequest(request_id="two", text="hi").SerializeToString() + chat):
        with pytest.raises(grpc.RpcError) as e:
            _raw_generate(channel, two)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exactly one of" in e.value.details()
    ok = pb.GenerateRequest(request_id="ok", token_ids=pb.TokenIds(ids=[5, 6]),
                            sampling_params=pb.SamplingParams(max_new_tokens=2))
    assert _raw_generate(channel, ok.SerializeToString())[-1].complete.finish_reason in ("stop", "length")
    _wait_idle(env)


# ---- abort, cancel, deadline --------------------------------------------------------------------


def test_abort(env):
    client = env["client"]
    stream = client.generate([5, 6, 7, 8], request_id="to-abort", max_new_tokens=240, ignore_eos=True)
    it = iter(stream)
    first = next(it)
    assert isinstance(first, Chunk)
    with pytest.raises(grpc.RpcError) as e:  # the id is live: a second request may not reuse it
        client.generate_text([5], request_id="to-abort", max_new_tokens=2)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    client.abort("to-abort")
    rest = list(it)
    done = rest[-1]
    assert isinstance(done, Completion) and done.finish_reason == "abort"
    assert len(done.token_ids) < 240
    assert [t for c in [first, *rest[:-1]] for t in c.token_ids] == done.token_ids
    for rid in ("to-abort", "never-existed"):
        with pytest.raises(grpc.RpcError) as e:
            client.abort(rid)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and rid in e.value.details()
    _wait_idle(env)
    # The id is free again once the request ended.
    assert client.generate_text([5], request_id="to-abort", max_new_tokens=2).finish_reason in ("stop", "length")


def test_abort_ends_every_sample(env):
    client = env["client"]
    it = iter(client.generate([5, 6, 7, 8], request_id="to-abort-n", n=3, temperature=1.0, max_new_tokens=240,
                              ignore_eos=True))
    assert isinstance(next(it), Chunk)
    client.abort("to-abort-n")
    dones = [item for item in it if isinstance(item, Completion)]
    assert sorted(d.index for d in dones) == [0, 1, 2] and {d.finish_reason for d in dones} == {"abort"}
    _wait_idle(env)


def test_client_cancel_mid_stream_leaks_nothing(env):
    client = env["client"]
    streams = [client.generate([5, 6, 7, i + 10], max_new_tokens=240, ignore_eos=True, n=1 + i % 3) for i in range(6)]
    for s in streams:
        it = iter(s)
        next(it)
        next(it)
        s.cancel()
        with pytest.raises(grpc.RpcError) as e:
            list(it)
        assert e.value.code() == grpc.StatusCode.CANCELLED
    info = _wait_idle(env)
    assert info["running_requests"] == 0 and info["queued_requests"] == 0


def test_deadline_aborts_request(env):
    client = env["client"]
    with pytest.raises(grpc.RpcError) as e:
        client.generate_text([5, 6, 7, 9], max_new_tokens=240, ignore_eos=True, timeout=0.15)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_idle(env)


def test_disconnect_aborts_request(env):
    """Closing the channel (the client process going away) frees the request's slots."""
    target = env["main"].target
    c = GenerationClient(target, timeout=60)
    it = iter(c.generate([5, 6, 7, 11], max_new_tokens=240, ignore_eos=True))
    next(it)
    c.close()
    _wait_idle(env)


# ---- admission ----------------------------------------------------------------------------------


def test_too_many_queued_requests(env):
    limited = ServerThread(env["worker"], max_queued_requests=0).start()
    try:
        with GenerationClient(limited.target, timeout=60) as c:
            # max_running_requests=16 + max_queued_requests=0: the 17th concurrent call is refused.
            streams = [c.generate([5, 6, i + 3], max_new_tokens=240, ignore_eos=True) for i in range(16)]
            its = [iter(s) for s in streams]
            for it in its:
                next(it)
            with pytest.raises(grpc.RpcError) as e:
                c.generate_text([5, 6], max_new_tokens=2)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queued" in e.value.details()
            for s in streams:
                s.cancel()
            _wait_idle(env)
            # Samples count one each: n=17 alone is over the 16 the server admits, and never will
            # be (a bad request, not one to retry).
            with pytest.raises(grpc.RpcError) as e:
                c.generate_samples([5, 6], 17, max_new_tokens=2)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n=17" in e.value.details()
            streams = [c.generate([5, 6, 4], n=16, max_new_tokens=240, ignore_eos=True)]
            next(iter(streams[0]))
            with pytest.raises(grpc.RpcError) as e:
                c.generate_text([5, 6], max_new_tokens=2)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for s in streams:
                s.cancel()
            _wait_idle(env)
            assert c.generate_text([5, 6], max_new_tokens=2).finish_reason in ("stop", "length")
    finally:
        limited.stop(grace=2)


# ---- auth ---------------------------------------------------------------------------------------


def test_token_auth(env):
    target = env["authed"].target
    for token in (None, "wrong-token"):
        with GenerationClient(target, token=token, timeout=30) as c:
            for call in (lambda: c.generate_text("hi", max_new_tokens=2), c.model_info, c.server_info,
                         lambda: c.abort("x")):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert c.health() == "SERVING"  # health stays open
    with GenerationClient(target, token=TOKEN, timeout=30) as c:
        assert c.generate_text("hi", max_new_tokens=2).finish_reason in ("stop", "length")
        assert c.model_info()["vocab_size"] == env["info"]["vocab_size"]


# ---- load ---------------------------------------------------------------------------------------


def test_load_200_concurrent_streams(env):
    vocab = env["info"]["vocab_size"]
    rng = random.Random(0)
    plans = []
    for i in range(200):
        kind = "bad" if i % 20 == 7 else ("cancel" if i % 10 == 3 else "ok")
        prompt = _ids(rng.randint(2, 24), vocab, 1000 + i)
        if kind == "bad":
            prompt = prompt + [vocab + 5]
        plans.append(dict(rid=f"load-{i}", kind=kind, prompt=prompt, max_new=rng.randint(1, 12),
                          ignore_eos=rng.random() < 0.5, temperature=rng.choice([0.0, 0.8])))

    async def one(client, p):
        chunks, completes, error = [], [], None
        stream = client.generate(p["prompt"], request_id=p["rid"], max_new_tokens=p["max_new"],
                                 ignore_eos=p["ignore_eos"], temperature=p["temperature"])
        try:
            async for item in stream:
                (chunks if isinstance(item, Chunk) else completes).append(item)
                if p["kind"] == "cancel" and chunks:
                    stream.cancel()
        except grpc.RpcError as e:
            error = e.code()
        except asyncio.CancelledError:
            error = "cancelled"
        return chunks, completes, error

    async def main():
        # Spread the streams over a few connections, as separate clients would.
        clients = [AsyncGenerationClient(env["main"].target, timeout=120) for _ in range(4)]
        try:
            return await asyncio.gather(*(one(clients[i % 4], p) for i, p in enumerate(plans)))
        finally:
            for c in clients:
                await c.close()

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    complete_ids = []
    for p, (chunks, completes, error) in zip(plans, results):
        if p["kind"] == "bad":
            assert error == grpc.StatusCode.INVALID_ARGUMENT and not chunks and not completes
            continue
        if p["kind"] == "cancel" and error is not None:
            assert error == "cancelled" and not completes
            continue
        assert error is None, (p["rid"], error)
        assert len(completes) == 1, p["rid"]
        done = completes[0]
        complete_ids.append(done.request_id)
        assert done.request_id == p["rid"]
        streamed = [t for c in chunks for t in c.token_ids]
        assert streamed == done.token_ids and done.completion_tokens == len(streamed)  # no loss, no duplicates
        assert 1 <= len(streamed) <= p["max_new"] and done.prompt_tokens == len(p["prompt"])
        if p["ignore_eos"]:
            assert done.finish_reason == "length" and len(streamed) == p["max_new"]
        else:
            assert done.finish_reason in ("stop", "length")
    assert len(complete_ids) == len(set(complete_ids)) >= 150
    info = _wait_idle(env)
    assert info["running_requests"] == 0
    print(f"200 streams in {elapsed:.1f}s")


def test_generated_tokens_accounting(env):
    """stats_json exposes the engine's counters; they only grow."""
    client = env["client"]
    before = client.server_info()["stats"]["tokens_generated"]
    client.generate_text([5, 6, 7], max_new_tokens=4, ignore_eos=True)
    after = client.server_info()["stats"]["tokens_generated"]
    assert after - before >= 4
    json.dumps(client.server_info())  # plain data


def test_metrics_export_the_engine_loop(env):
    """/metrics carries the engine loop's counters (Engine.stats()["loop"]): iterations by kind,
    host seconds by phase, device wait, host-bound iterations; they grow with the traffic."""
    import re
    import urllib.request

    st = ServerThread(env["worker"], metrics_port=-1).start()
    try:
        def scrape() -> dict:
            text = urllib.request.urlopen(f"http://127.0.0.1:{st.server.metrics_port}/metrics", timeout=10).read()
            return {m[0]: float(m[1]) for m in re.findall(r"^(jaxoverlap_engine_\S+) (\S+)$", text.decode(), re.M)}

        before = scrape()
        with GenerationClient(st.target, timeout=60) as c:
            c.generate_text([5, 6, 7], max_new_tokens=8, ignore_eos=True)
        after = scrape()
    finally:
        st.stop(grace=2)
    decode = 'jaxoverlap_engine_iterations_total{kind="decode"}'
    assert after[decode] - before[decode] >= 7  # 8 tokens: one from the prefill, 7+ decode steps
    assert after['jaxoverlap_engine_iterations_total{kind="prefill"}'] > before['jaxoverlap_engine_iterations_total{kind="prefill"}']
    for phase in ("prepare", "launch", "process"):
        key = f'jaxoverlap_engine_host_seconds_total{{phase="{phase}"}}'
        assert after[key] > before[key]
    assert after["jaxoverlap_engine_device_wait_seconds_total"] > before["jaxoverlap_engine_device_wait_seconds_total"]
    assert "jaxoverlap_engine_host_bound_iterations_total" in after
    # Launches that compiled (this fixture's engine is not warmed up) and their seconds grow together.
    launches = "jaxoverlap_engine_compiling_launches_total"
    seconds = "jaxoverlap_engine_compiling_launch_seconds_total"
    assert after[launches] >= before[launches] and after[seconds] >= before[seconds]
    assert (after[launches] > before[launches]) == (after[seconds] > before[seconds])


def test_bench_reports_the_servers_engine_loop(env):
    """`jaxoverlap bench` reads the engine's loop totals before and after its timed runs: host
    time and device wait per decode step, and the host-bound share, in the report and table."""
    from jaxoverlap.server import bench

    cfg = bench.BenchConfig(targets=[env["main"].target], num_prompts=6, input_len="8", output_len="6",
                            max_concurrency=3, progress=False, warmup_requests=0)
    report = asyncio.run(bench.benchmark(cfg))
    engine = report["results"]["result"]["engine"]
    assert engine["decode_iterations"] >= 5  # 6 tokens per request: 5+ decode steps each, batched
    assert engine["host_ms_per_decode"] > 0 and engine["wait_ms_per_decode"] > 0
    assert 0 <= engine["host_bound_share"] <= 1
    assert engine["compiling_launches"] >= 0
    assert "Engine host time per decode step (ms)" in bench.format_table(report["results"])


def test_bench_with_structured_output(env):
    """`jaxoverlap bench --choice ...`: every request is constrained and ends where its
    grammar does ("stop", one choice's tokens), long before its planned output length."""
    from jaxoverlap.server import bench

    cfg = bench.BenchConfig(targets=[env["main"].target], num_prompts=4, input_len="8", output_len="40",
                            max_concurrency=2, progress=False, warmup_requests=0, save_requests=True,
                            structured_output={"choice": ["red", "green"]})
    report = asyncio.run(bench.benchmark(cfg))
    result = report["results"]["result"]
    assert result["completed"] == 4 and result["failed"] == 0
    assert 4 <= result["total_output_tokens"] < 4 * 40
    assert report["config"]["structured_output"] == {"choice": ["red", "green"]}


# ---- the `jaxoverlap serve` command -------------------------------------------------------------


@pytest.mark.parametrize("where", ["process", "thread"])
def test_serve_command_says_in_one_line_why_no_engine_can_be_built(tmp_path, where):
    """Options no engine can take, or a model folder that is not there: `serve` ends with the
    reason (exit status 1, as the CLI's other refusals), not a traceback."""
    from jaxoverlap.cli import main

    thread = ["--engine-thread"] if where == "thread" else []
    with pytest.raises(SystemExit, match="error: page_size must be >= 1, got 0"):
        main(["serve", "--port", "0", "--no-warmup", "--page-size", "0", *thread])
    with pytest.raises(SystemExit, match=r"error: .*No such file .*no-model"):
        main(["serve", "--port", "0", "--no-warmup", "--model", str(tmp_path / "no-model"), *thread])


def test_client_command_refuses_token_ids_that_are_not_integers(capsys):
    from jaxoverlap.cli import main

    for flag in ("--token-ids", "--stop-token-ids"):
        assert main(["client", "--target", "127.0.0.1:1", "--token-ids", "1,2", flag, "1,x"]) == 2
        assert f"{flag}: expected comma-separated integers, got '1,x'" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["process", "thread"])
def test_serve_command_drains_on_sigterm(tmp_path, where):
    """`jaxoverlap serve` end to end: it serves, and a signal lets a running stream finish.
    With the engine in a process of its own (the default) the signal is a terminal's Ctrl-C,
    SIGINT to the whole process group, engine included; with the engine on a thread, SIGTERM."""
    import signal
    import subprocess
    import sys

    model = _model_path()
    cmd = [sys.executable, "-m", "jaxoverlap.cli", "serve", "--port", "0", "--no-warmup", "--metrics-port", "0",
           "--max-running-requests", "4", "--kv-cache-tokens", "1024", "--max-context-len", "128",
           "--page-size", "8", "--shutdown-grace", "60"] + (["--model", model] if model else [])
    cmd += ["--engine-thread"] if where == "thread" else []
    err_path = tmp_path / "serve.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        target = None
        while target is None and time.monotonic() < deadline and proc.poll() is None:
            for line in err_path.read_text().splitlines():
                if line.startswith("serving on "):
                    target = line.split()[2]
            time.sleep(0.1)
        assert target, err_path.read_text()
        with GenerationClient(target, timeout=120) as c:
            assert c.health() == "SERVING"
            it = iter(c.generate([5, 6, 7], max_new_tokens=40, ignore_eos=True))
            first = next(it)
            if where == "process":
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGTERM)
            rest = list(it)
            assert isinstance(rest[-1], Completion) and rest[-1].finish_reason == "length"
            assert len(first.token_ids) + sum(len(x.token_ids) for x in rest[:-1]) == 40
        assert proc.wait(60) == 0, err_path.read_text()
        assert "draining" in err_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_structured_output_over_grpc(env):
    """A JSON schema, a regex and a choice through the proto: whole outputs that follow them
    (the streamed text is the final one, the grammar's last token included), n samples
    too; a grammar llguidance refuses is INVALID_ARGUMENT and harms nothing else."""
    client = env["client"]
    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    for constraint, check in (({"json_schema": schema}, lambda t: set(json.loads(t)) == {"n"}),
                              ({"regex": "[a-c]{2}-[0-9]"}, lambda t: re.fullmatch("[a-c]{2}-[0-9]", t)),
                              ({"choice": ["north", "south"]}, lambda t: t in ("north", "south"))):
        items = list(client.generate("Once upon a time", max_new_tokens=32, temperature=0.8, seed=2, n=2,
                                     structured_output=constraint))
        for k in range(2):
            text = "".join(i.text for i in items if isinstance(i, Chunk) and i.index == k)
            [done] = [i for i in items if isinstance(i, Completion) and i.index == k]
            assert done.finish_reason == "stop" and check(text), (constraint, text)
    with pytest.raises(grpc.RpcError) as e:
        client.generate_text("Once", max_new_tokens=4, structured_output={"regex": "[a-"})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in e.value.details()
    # llguidance's message quotes the regex: cut to what gRPC's metadata holds, same status.
    with pytest.raises(grpc.RpcError) as e:
        client.generate_text("Once", max_new_tokens=4, structured_output={"regex": "(" + "a" * 20000})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "more characters cut" in e.value.details()
    _wait_idle(env)
