"""EngineProcess (the engine in a process of its own) behind the gRPC server, against FakeEngine.

test_server_grpc.py runs the real engine through both workers; here we cover what needs
control over the engine process: the same outputs as the in-thread worker, errors crossing
the pipe with their types, a crashing engine (with either worker), a killed engine process, a stop under a live
stream, a parent that dies without stopping its engine, the child's bounded sender queue,
and a server process that never starts a JAX backend.
"""
from __future__ import annotations

import functools
import operator
import os
import signal
import subprocess
import sys
import threading
import time
import types

import grpc
import process_helpers
import pytest

from jaxoverlap.config import EngineConfig
from jaxoverlap.server.client import GenerationClient
from jaxoverlap.server.engine_process import EngineProcess
from jaxoverlap.server.engine_worker import EngineWorker
from jaxoverlap.server.testing import FakeEngine, ServerThread

pytestmark = pytest.mark.timeout(120)


def _factory(**kw):
    cfg = EngineConfig(max_running_requests=8, max_context_len=64, kv_cache_tokens=1024)
    return functools.partial(FakeEngine, cfg, **kw)


@pytest.fixture(scope="module")
def pair():
    """The same fake engine served from a thread and from a process."""
    thread = EngineWorker(engine_factory=_factory(step_delay=0.001, eos_after=12)).start()
    process = EngineProcess(_factory(step_delay=0.001, eos_after=12)).start(timeout=60)
    servers = {"thread": ServerThread(thread, metrics_port=-1).start(),
               "process": ServerThread(process, metrics_port=-1).start()}
    yield {"thread": thread, "process": process}, servers
    for st in servers.values():
        st.stop()
    thread.stop()
    process.stop()


def _wait_engine_idle(worker, timeout=10.0):
    deadline = time.monotonic() + timeout
    while worker.call_sync(operator.methodcaller("has_work"), timeout=10):
        assert time.monotonic() < deadline, "engine still busy"
        time.sleep(0.01)
    worker.call_sync(operator.methodcaller("check_integrity"), timeout=10)


REQUESTS = [
    dict(prompt="hello", max_new_tokens=6),
    dict(prompt="hello", max_new_tokens=30),  # runs into EOS (eos_after=12)
    dict(prompt="abc", max_new_tokens=20, ignore_eos=True, logprobs=True),
    dict(prompt="abc", max_new_tokens=20, ignore_eos=True, temperature=0.7, seed=3),
    dict(prompt=[40, 41, 42], max_new_tokens=9, stop_token_ids=[3 + (40 + 41 + 42 + 4) % 26 + ord("a")]),
]


def _run(client, req):
    """What a client sees of one request, less its id, its timings and where the server cut
    its chunks (it merges the outputs that arrived while the stream was busy)."""
    req = dict(req)
    prompt = req.pop("prompt")
    items = list(client.generate(prompt, **req))
    final, chunks = items[-1], items[:-1]
    streamed = ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
                [x for c in chunks for x in (c.logprobs or [])])
    return streamed, final.token_ids, final.finish_reason, final.prompt_tokens, final.completion_tokens


def test_same_outputs_as_the_engine_on_a_thread(pair):
    workers, servers = pair
    results = {}
    for name, st in servers.items():
        with GenerationClient(st.target, timeout=30) as c:
            results[name] = [_run(c, r) for r in REQUESTS]
    assert results["process"] == results["thread"]
    assert [r[2] for r in results["process"]] == ["length", "stop", "length", "length", "stop"]
    assert results["process"][0][1] and results["process"][2][0][2]  # tokens, and logprobs when asked
    _wait_engine_idle(workers["process"])


def test_concurrent_streams_each_get_their_own_tokens(pair):
    workers, servers = pair
    out = {}

    def run(i):
        with GenerationClient(servers["process"].target, timeout=60) as c:
            out[i] = c.generate_text("x" * (i % 7 + 1), max_new_tokens=10 + i % 5, ignore_eos=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    with GenerationClient(servers["thread"].target, timeout=60) as c:
        for i in range(24):
            ref = c.generate_text("x" * (i % 7 + 1), max_new_tokens=10 + i % 5, ignore_eos=True)
            assert (out[i].token_ids, out[i].text) == (ref.token_ids, ref.text)
    _wait_engine_idle(workers["process"])


@pytest.mark.parametrize("where", ["thread", "process"])
def test_steps_without_outputs_count_for_the_stall_watchdog(where):
    """The watchdog reads `worker.steps`: steps that make no output (a long prompt's prefill
    chunks) count too, from the engine's process as from its thread."""
    factory = _factory(step_delay=0.02, prefill_steps=40)
    worker = (EngineWorker(engine_factory=factory) if where == "thread" else EngineProcess(factory)).start(timeout=60)
    st = ServerThread(worker, metrics_port=-1).start()
    try:
        with GenerationClient(st.target, timeout=30) as c:
            before = worker.steps
            assert c.generate_text("hello", max_new_tokens=1).finish_reason == "length"
            time.sleep(0.3)  # the process's last tick
            assert worker.steps - before >= 30, worker.steps - before
    finally:
        st.stop()
        worker.stop()


@pytest.mark.parametrize("prompt,kw", [([1000], {}), ("x" * 80, {}), ([5, 6], {"max_new_tokens": 0})])
def test_bad_requests_get_the_same_error(pair, prompt, kw):
    workers, servers = pair
    errors = {}
    for name, st in servers.items():
        with GenerationClient(st.target, timeout=30) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.generate_text(prompt, **{"max_new_tokens": 4, **kw})
            errors[name] = (e.value.code(), e.value.details())
            assert c.generate_text("ok", max_new_tokens=2).finish_reason == "length"  # still serving
    # The engine's exception crossed the pipe as itself: the server maps its type to a code.
    assert errors["process"] == errors["thread"]
    assert errors["process"][0] in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


def test_call_needs_something_picklable(pair):
    workers, _ = pair
    with pytest.raises(TypeError, match="cannot send"):
        workers["process"].call_sync(lambda e: 1, timeout=10)
    assert workers["process"].call_sync(operator.attrgetter("model_name"), timeout=10) == "fake-model"
    assert workers["process"].alive


def _health_turns(client, want, timeout=10.0):
    deadline = time.monotonic() + timeout
    while client.health() != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return client.health()


@pytest.mark.parametrize("where", ["thread", "process"])
def test_engine_crash_fails_requests_cleanly(where):
    factory = _factory(step_delay=0.001, crash_after_tokens=5)
    if where == "thread":
        worker = EngineWorker(engine_factory=factory).start()
    else:
        worker = EngineProcess(factory).start(timeout=60)
    st = ServerThread(worker).start()
    try:
        with GenerationClient(st.target, timeout=30) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.generate_text("a", max_new_tokens=50)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "device on fire" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:  # and later ones are refused, not hung
                c.generate_text("a", max_new_tokens=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert _health_turns(c, "NOT_SERVING") == "NOT_SERVING"
    finally:
        st.stop()
        worker.stop()


def test_killed_engine_process_ends_streams_and_health():
    worker = EngineProcess(_factory(step_delay=0.01)).start(timeout=60)
    st = ServerThread(worker).start()
    try:
        with GenerationClient(st.target, timeout=30) as c:
            it = iter(c.generate("abc", max_new_tokens=500, ignore_eos=True))
            next(it)
            os.kill(worker.pid, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as e:
                list(it)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "exit code -9" in e.value.details()
            assert _health_turns(c, "NOT_SERVING") == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as e:
                c.generate_text("a", max_new_tokens=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        st.stop()
        worker.stop()


def test_engine_process_outlives_a_sigterm_to_its_process_group():
    """systemd, `timeout` and `kill -TERM -PGID` signal the whole group: the server drains on
    SIGTERM, so the engine process must ignore it and keep serving the drain."""
    worker = EngineProcess(_factory(step_delay=0.01)).start(timeout=60)
    st = ServerThread(worker).start()
    try:
        with GenerationClient(st.target, timeout=30) as c:
            it = iter(c.generate("abc", max_new_tokens=60, ignore_eos=True))
            next(it)
            os.kill(worker.pid, signal.SIGTERM)  # what the child gets of a signal to the group
            assert list(it)[-1].finish_reason == "length"
            assert worker.alive
            assert c.generate_text("a", max_new_tokens=3, ignore_eos=True).finish_reason == "length"
    finally:
        st.stop()
        worker.stop()


def test_a_large_add_does_not_block_the_servers_loop():
    """Commands go to the child through a pipe that holds 64 KiB; while the child is inside a
    long step, a larger add waits for it on the sender thread, not on the server's event loop."""
    cfg = EngineConfig(max_running_requests=8, max_context_len=300_000, kv_cache_tokens=1_000_000)
    worker = EngineProcess(functools.partial(FakeEngine, cfg, step_delay=2.0)).start(timeout=60)
    st = ServerThread(worker).start()
    try:
        with GenerationClient(st.target, timeout=30) as c:
            it = iter(c.generate([5, 6, 7], max_new_tokens=3))
            next(it)  # the child is now inside its next 2 s step
            got = []
            big = threading.Thread(target=lambda: got.append(c.generate_text([100] * 100_000, max_new_tokens=1)),
                                   daemon=True)
            big.start()
            time.sleep(0.2)
            t = time.perf_counter()
            assert c.health() == "SERVING" and c.model_info()["max_context_len"] == 300_000
            assert time.perf_counter() - t < 1.0
            list(it)
            big.join(30)
            assert got and got[0].prompt_tokens == 100_000
    finally:
        st.stop()
        worker.stop()


def test_stop_under_a_live_stream_aborts_it():
    worker = EngineProcess(_factory(step_delay=0.005)).start(timeout=60)
    st = ServerThread(worker).start()
    out = []
    with GenerationClient(st.target, timeout=30) as c:
        it = iter(c.generate("abc", max_new_tokens=50, ignore_eos=True))
        next(it)
        worker.stop()  # the engine goes away under a live stream: it ends with "abort"
        out = list(it)
    assert out[-1].finish_reason == "abort"
    assert not worker.alive and worker.dead_error is None
    st.stop()


def test_start_failure_is_reported():
    with pytest.raises(RuntimeError, match="engine failed to start") as e:
        EngineProcess(functools.partial(int, "not a number")).start(timeout=60)
    assert isinstance(e.value.__cause__, ValueError)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def test_engine_process_ends_when_its_parent_dies():
    script = ("import os; from jaxoverlap.server.engine_process import EngineProcess; "
              "from jaxoverlap.server.testing import FakeEngine; "
              "w = EngineProcess(FakeEngine).start(timeout=60); print(w.pid, flush=True); os._exit(0)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    pid = int(proc.stdout.split()[-1])
    deadline = time.monotonic() + 20
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid)


def test_calls_that_the_engine_process_cannot_run(pair, monkeypatch):
    workers, servers = pair
    process = workers["process"]
    with pytest.raises(TypeError, match="cannot be sent back"):
        process.call_sync(process_helpers.a_lock, timeout=10)
    # A function from a module that only this process has: the child cannot unpickle the
    # command, answers with the import error and keeps serving.
    module = types.ModuleType("only_in_the_parent")
    exec("def has_work(engine):\n    return engine.has_work()", module.__dict__)
    monkeypatch.setitem(sys.modules, "only_in_the_parent", module)
    with pytest.raises(ModuleNotFoundError, match="only_in_the_parent"):
        process.call_sync(module.has_work, timeout=10)
    with GenerationClient(servers["process"].target, timeout=30) as c:
        assert c.generate_text("ok", max_new_tokens=2).finish_reason == "length"
    assert process.alive


def test_the_server_process_never_starts_a_jax_backend():
    """On a GPU the engine's process must own the device: a backend started in the server's
    process would take its memory (JAX preallocates). The whole serving path, the real engine
    and its tokenizer included, runs here in a fresh interpreter that then reports whether
    JAX started a backend."""
    script = """
import functools, json, urllib.request
import jax._src.xla_bridge as xb
from jaxoverlap.config import EngineConfig
from jaxoverlap.server.cli_commands import build_engine
from jaxoverlap.server.client import GenerationClient
from jaxoverlap.server.engine_process import EngineProcess
from jaxoverlap.server.testing import ServerThread
config = EngineConfig.from_options(None, max_running_requests=4, kv_cache_tokens=1024, max_context_len=128,
                                   page_size=8)
worker = EngineProcess(functools.partial(build_engine, config)).start(timeout=240)
st = ServerThread(worker, metrics_port=-1).start()
with GenerationClient(st.target, timeout=120) as c:
    text = c.generate_text("Once upon a time", max_new_tokens=4, temperature=0).text
    info = c.server_info()
metrics = urllib.request.urlopen(f"http://127.0.0.1:{st.server.metrics_port}/metrics").read().decode()
st.stop()
worker.stop()
print(json.dumps({"text": text, "running": info["running_requests"], "up": "jaxoverlap_engine_up 1.0" in metrics,
                  "backends": xb.backends_are_initialized()}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["text"] and res["running"] == 0 and res["up"]
    assert res["backends"] is False


class _Pipe:
    """A stand-in for the child's end of the event pipe: blocks until released, or is broken."""

    def __init__(self, broken: bool = False):
        self.broken = broken
        self.release = threading.Event()
        self.sent = []

    def send(self, events):
        if self.broken:
            raise BrokenPipeError("the parent is gone")
        self.release.wait(30)
        self.sent.append(events)


def _put(sender, events, timeout=2.0) -> threading.Thread:
    """sender.put(events) on a thread of its own, waited for up to `timeout`."""
    t = threading.Thread(target=sender.put, args=(events,), daemon=True)
    t.start()
    t.join(timeout)
    return t


def test_the_senders_queue_is_bounded_and_never_blocks_once_the_parent_is_gone():
    from jaxoverlap.server.engine_process import _Sender

    # A parent that does not read: the loop blocks once the queue is full, and goes on when it reads.
    pipe = _Pipe()
    sender = _Sender(pipe, max_queued=3)
    for i in range(4):  # one taken by the thread (blocked in send), three queued
        assert not _put(sender, [("reply", i, True, None)]).is_alive()
    blocked = _put(sender, [("reply", 4, True, None)], timeout=0.3)
    assert blocked.is_alive()
    pipe.release.set()
    blocked.join(5)
    assert not blocked.is_alive()
    sender.close()
    assert [e[0][1] for e in pipe.sent] == [0, 1, 2, 3, 4]
    # A parent that is gone: everything put is dropped, and put never blocks.
    sender = _Sender(_Pipe(broken=True), max_queued=2)
    assert not any(_put(sender, [("reply", i, True, None)]).is_alive() for i in range(50))
    sender.close()
