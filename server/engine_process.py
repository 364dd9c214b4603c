"""EngineProcess: the engine in a process of its own, behind EngineWorker's interface.

Why a process. One interpreter has one GIL. With `EngineWorker` the engine's loop shares it
with the gRPC event loop, which runs Python for every stream on every step (the handler's
chunk, its text, the write). When the device finishes step N while the event loop holds the
GIL, the engine's thread cannot launch step N+2 until the event loop lets go, and the device
idles meanwhile; the more streams, the longer those turns. vLLM's engine core and SGLang's
scheduler run in processes of their own for this reason. Here the engine's loop is the main
thread of a spawned child (CUDA and fork do not mix), which runs nothing else but a sender
thread; this process keeps the event loop, the tokenizer and every per-stream object.

The wire: two pipes of pickled messages.

* parent -> child, one command per message: (kind, cid, pickled args) with ("add", cid,
  (request_id, prompt, params)), ("abort", cid | None, (request_id,)), ("call", cid, (fn,))
  for a picklable fn(engine), and ("stop", None, ()).
* child -> parent, a list of events per message, packed, pickled and written by the child's
  sender thread, so that this work overlaps the engine's wait for the device: ("reply", cid,
  ok, value), ("out", [packed outputs of one step]), ("died", error), ("stopped",).

The child replies to the commands it drained before it runs the next step, then sends that
step's outputs, so a request's acceptance always arrives before its first output. A packed
output carries only what is new (token ids, text, logprobs) and the metrics as a tuple; the
reader thread here rebuilds `RequestOutput`s, with `token_ids` from the ids it has collected,
and hands each event loop its outputs with one `call_soon_threadsafe` per step, as
EngineWorker does.

The child ignores SIGINT and SIGTERM (a terminal's Ctrl-C, and systemd, `timeout` or
`kill -TERM -PGID`, signal the whole process group): the parent drains the server and then
stops the engine. If the parent dies, the child sees its command pipe close and shuts down.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
import traceback
from typing import Any, Callable

from jaxoverlap.outputs import RequestMetrics, RequestOutput
from jaxoverlap.server.engine_worker import (DuplicateRequestError, EngineCalls, Sink, WorkerUnavailableError,
                                            abort_and_drain, check_precompile_options, hand_over, prepare_engine)

logger = logging.getLogger(__name__)

_METRIC_FIELDS = tuple(f.name for f in dataclasses.fields(RequestMetrics))
# How often, at least, the child tells the parent its step count while its steps make no
# outputs (a long prompt's prefill chunks): what the server's stall watchdog reads.
STEP_TICK_S = 0.25


class EngineProcessError(RuntimeError):
    """An exception of the engine process that could not be sent over as itself."""


class EngineProcess(EngineCalls):
    """Runs `engine_factory()` (picklable: a class, or a functools.partial of a module-level
    function) in a spawned process and serves it with EngineWorker's methods.

    `warmup`, `precompile` ("auto": on a GPU only), `precompile_prefill`,
    `precompile_sampling`, `precompile_top_logprobs`, `precompile_structured` and
    `precompile_prompt_logprobs` as in EngineWorker; they run in the
    child before `start()` returns.
    `call(fn)` runs a picklable fn(engine) in the child between two steps and returns its
    (picklable) result.
    """

    def __init__(self, engine_factory: Callable[[], Any], *, warmup: bool | int = False,
                 precompile: bool | str = False, precompile_prefill: bool = False,
                 precompile_sampling: tuple[bool, ...] = (False, True), precompile_top_logprobs: bool = False,
                 precompile_structured: bool = False, precompile_prompt_logprobs: bool = False,
                 name: str = "jaxoverlap-engine"):
        check_precompile_options(precompile_prefill, precompile_prompt_logprobs)
        self._factory = engine_factory
        self._options = (warmup, precompile, precompile_prefill, precompile_sampling, precompile_top_logprobs,
                         precompile_structured, precompile_prompt_logprobs)
        self._name = name
        self._process: multiprocessing.process.BaseProcess | None = None
        self._commands = None  # parent's end of the command pipe
        self._events = None  # parent's end of the event pipe
        # Commands are pickled by their caller and written by a sender thread: a write blocks
        # while the pipe is full (a large prompt, the child inside a long step), and the
        # caller is usually the server's event loop, which must never block.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._lock = threading.Lock()  # guards _sinks, _ids, _pending
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, Sink]] = {}
        self._ids: dict[str, list[int]] = {}  # request_id -> every token id received so far
        self._pending: dict[int, concurrent.futures.Future] = {}  # command id -> its reply's future
        self._cids = itertools.count(1)
        self._reader: threading.Thread | None = None
        self._reader_done = False  # set under _lock when the reader thread ends
        self._stopping = False
        self._stopped = threading.Event()
        self.dead_error: BaseException | None = None
        self.steps = 0  # the child's steps, as it last reported them (with outputs, or a tick: STEP_TICK_S)

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def engine(self):
        return None  # it lives in the other process; use call()

    @property
    def alive(self) -> bool:
        return (self._process is not None and self._process.is_alive() and not self._stopping
                and self.dead_error is None)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self, timeout: float | None = None) -> "EngineProcess":
        ctx = multiprocessing.get_context("spawn")
        cmd_recv, self._commands = ctx.Pipe(duplex=False)
        self._events, ev_send = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_child_main, name=self._name, daemon=True,
                                    args=(self._factory, self._options, cmd_recv, ev_send))
        self._process.start()
        # Our copies of the child's ends: closed, so that EOF means the child is gone.
        cmd_recv.close()
        ev_send.close()
        self._sender = threading.Thread(target=self._write, name=f"{self._name}-sender", daemon=True)
        self._sender.start()
        try:
            ready = self._events.poll(timeout)
        except BaseException:  # e.g. Ctrl-C while the model loads
            self._process.kill()
            raise
        if not ready:
            self._process.kill()
            raise TimeoutError("engine process did not become ready in time")
        try:
            kind, payload = self._events.recv()
        except (EOFError, OSError) as e:
            self._process.join(10)
            raise RuntimeError(f"engine process exited during start-up (exit code "
                               f"{self._process.exitcode})") from e
        if kind != "ready":
            self._process.join(10)
            raise RuntimeError("engine failed to start") from _unwrap(payload)
        self._reader = threading.Thread(target=self._read, name=f"{self._name}-reader", daemon=True)
        self._reader.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort whatever is still running, let the engine finish those aborts, end the process."""
        if self._process is None or self._stopped.is_set():
            return
        self._stopping = True
        self._send("stop", None, ())  # (if the child is gone already, the sender drops it)
        if not self._stopped.wait(timeout):
            logger.warning("engine process did not stop in %s s; killing it", timeout)
            self._process.kill()
        self._process.join(10)
        if self._reader is not None:
            self._reader.join(10)
        self._outbox.put(None)
        self._sender.join(10)
        self._fail_everything(WorkerUnavailableError("engine worker stopped"))

    # ---- commands (any thread) -------------------------------------------------------------

    async def add(self, request_id: str, prompt, params, sink: Sink) -> None:
        fut = self.submit_add(request_id, prompt, params, asyncio.get_running_loop(), sink)
        await asyncio.wrap_future(fut)

    def submit_add(self, request_id, prompt, params, loop, sink) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            fut.set_exception(WorkerUnavailableError(self._unavailable_reason()))
            return fut
        with self._lock:
            duplicate = request_id in self._sinks
            if not duplicate:
                self._sinks[request_id] = (loop, sink)
                self._ids[request_id] = []
        if duplicate:
            fut.set_exception(DuplicateRequestError(f"request_id {request_id!r} is already running"))
            return fut

        def forget_if_refused(f):
            if f.exception() is not None:
                with self._lock:
                    self._sinks.pop(request_id, None)
                    self._ids.pop(request_id, None)

        fut.add_done_callback(forget_if_refused)
        self._command(fut, "add", request_id, prompt, params)
        return fut

    def abort_nowait(self, request_id: str) -> None:
        self._send("abort", None, (request_id,))

    async def abort(self, request_id: str) -> bool:
        if not self.alive:
            raise WorkerUnavailableError(self._unavailable_reason())
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._command(fut, "abort", request_id)
        return await asyncio.wrap_future(fut)

    def submit_call(self, fn) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._process is None or not self._process.is_alive() or self.dead_error is not None:
            fut.set_exception(WorkerUnavailableError(self._unavailable_reason()))
            return fut
        self._command(fut, "call", fn)
        return fut

    def _command(self, fut: concurrent.futures.Future, kind: str, *args) -> None:
        cid = next(self._cids)
        with self._lock:
            refused = self._reader_done  # nobody would read the reply
            if not refused:
                self._pending[cid] = fut
        if refused:  # (outside the lock: fut's callbacks take it)
            fut.set_exception(WorkerUnavailableError(self._unavailable_reason()))
            return
        try:
            self._send(kind, cid, args)
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # e.g. a lambda for call()
            with self._lock:
                self._pending.pop(cid, None)
            fut.set_exception(TypeError(f"cannot send this {kind} to the engine process: {e}"))

    def _send(self, kind: str, cid: int | None, args: tuple) -> None:
        # The arguments are pickled apart from the header, so that the child can answer a
        # command whose arguments it cannot unpickle (a function of a module it cannot import)
        # instead of dying of it. Pickling first also means that an unpicklable argument never
        # leaves half a message in the pipe.
        data = pickle.dumps((kind, cid, pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)),
                            protocol=pickle.HIGHEST_PROTOCOL)
        self._outbox.put(data)

    def _write(self) -> None:
        """The sender thread: writes the commands in the order they were sent."""
        while (data := self._outbox.get()) is not None:
            try:
                self._commands.send_bytes(data)
            except (OSError, ValueError):
                # The child is gone: the reader meets EOF and fails every command that
                # waits for a reply; later commands are refused (not alive).
                return

    def _unavailable_reason(self) -> str:
        if self.dead_error is not None:
            return f"engine process died: {self.dead_error!r}"
        return "engine worker is not running"

    # ---- the reader thread ------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                try:
                    events = self._events.recv()
                except (EOFError, OSError):
                    break
                for event in events:
                    kind = event[0]
                    if kind == "out":
                        self.steps = event[2]
                        self._deliver(event[1])
                    elif kind == "tick":
                        self.steps = event[1]
                    elif kind == "reply":
                        self._reply(*event[1:])
                    elif kind == "died":
                        self.dead_error = _unwrap(event[1])
                        logger.error("engine process died: %r", self.dead_error)
                        self._fail_everything(self.dead_error)
                    elif kind == "stopped":
                        self._stopped.set()
        except BaseException as e:  # noqa: BLE001 - a broken reader must not leave callers waiting
            logger.exception("engine process reader failed")
            self.dead_error = e
        finally:
            if not self._stopped.is_set() and self.dead_error is None:
                self._process.join(5)  # EOF comes first; wait for the exit code
                code = self._process.exitcode
                self.dead_error = WorkerUnavailableError(f"engine process exited (exit code {code})")
                logger.error("%s", self.dead_error)
            with self._lock:
                self._reader_done = True
            self._stopped.set()
            self._fail_everything(self.dead_error or WorkerUnavailableError("engine worker stopped"))

    def _reply(self, cid: int, ok: bool, value) -> None:
        with self._lock:
            fut = self._pending.pop(cid, None)
        if fut is None or not fut.set_running_or_notify_cancel():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(_unwrap(value))

    def _deliver(self, packed) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = collections.defaultdict(list)
        with self._lock:
            for rid, new_ids, new_text, finished, reason, new_logprobs, metrics, prompt, top, error in packed:
                entry = self._sinks.get(rid)
                if entry is None:
                    continue
                ids = self._ids[rid]
                ids.extend(new_ids)
                if finished:
                    del self._sinks[rid], self._ids[rid]
                out = RequestOutput(rid, new_ids, new_text, finished, reason, RequestMetrics(*metrics),
                                    new_logprobs, ids, len(ids), new_top_logprobs=top, error=error)
                if prompt is not None:
                    out.prompt_logprobs, out.prompt_top1 = prompt
                by_loop[entry[0]].append((entry[1], out))
        hand_over(by_loop)

    def _fail_everything(self, error: BaseException) -> None:
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            self._ids.clear()
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(WorkerUnavailableError(f"engine process: {error!r}"))
        by_loop: dict[asyncio.AbstractEventLoop, list] = collections.defaultdict(list)
        for loop, sink in sinks.values():
            by_loop[loop].append((sink, error))
        hand_over(by_loop)


def _wrap(e: BaseException):
    """An exception as something that survives pickling: itself if it can, else its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return ("".join(traceback.format_exception_only(type(e), e)).strip(),
                "".join(traceback.format_exception(e)))


def _unwrap(payload) -> BaseException:
    if isinstance(payload, BaseException):
        return payload
    text, tb = payload
    err = EngineProcessError(text)
    err.remote_traceback = tb
    return err


def _pack(out: RequestOutput) -> tuple:
    # The engine hands out its live metrics object; read later on the sender thread, a running
    # request's metrics may already count the next step. A finished request's are final.
    m = out.metrics
    prompt = (out.prompt_logprobs, out.prompt_top1) if out.prompt_logprobs is not None else None
    return (out.request_id, out.new_token_ids, out.new_text, out.finished, out.finish_reason, out.new_logprobs,
            tuple(getattr(m, f) for f in _METRIC_FIELDS), prompt, out.new_top_logprobs, out.error)


# ---- the child process ----------------------------------------------------------------------

class _Sender:
    """The child's sender thread: packs, pickles and writes event lists while the loop waits
    for the device (the wait releases the GIL).

    Its queue holds at most `max_queued` lists: should the parent stop reading, the engine's
    loop then blocks on `put` instead of piling up outputs without bound. Once the parent is
    gone the thread keeps taking lists and drops them, so `put` never blocks for good."""

    def __init__(self, conn, max_queued: int = 1024):
        self._conn = conn
        self._queue: queue.Queue = queue.Queue(max_queued)
        self._thread = threading.Thread(target=self._run, name="jaxoverlap-sender", daemon=True)
        self._thread.start()

    def put(self, events: list) -> None:
        self._queue.put(events)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(30)

    def _run(self) -> None:
        parent_gone = False
        while (events := self._queue.get()) is not None:
            if parent_gone:
                continue
            # A step's outputs are packed here, not on the loop's thread.
            events = [("out", [_pack(o) for o in e[1]], e[2]) if e[0] == "out" else e for e in events]
            try:
                self._conn.send(events)
            except (OSError, ValueError):
                parent_gone = True
            except Exception:  # noqa: BLE001 - never stop sending for one bad message
                logger.exception("could not send %d events to the parent", len(events))


def _child_main(factory, options, commands, events) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = factory()
        prepare_engine(engine, *options)
    except BaseException as e:  # noqa: BLE001 - reported to start()
        logger.exception("engine failed to start")
        events.send(("error", _wrap(e)))
        return
    events.send(("ready", None))
    sender = _Sender(events)
    try:
        _ChildLoop(engine, commands, sender).run()
    finally:
        sender.close()


class _ChildLoop:
    def __init__(self, engine, commands, sender: _Sender):
        self.engine = engine
        self.commands = commands
        self.sender = sender
        self.live: set[str] = set()  # request ids the parent added and that have not finished
        self.steps = 0
        self._reported = 0.0  # when the parent last heard of the step count

    def run(self) -> None:
        engine, commands = self.engine, self.commands
        try:
            stop = False
            while not stop:
                replies: list = []
                try:
                    # Block for a command only when idle: with work, the next step must start
                    # right away, so only the commands already there are taken.
                    if not engine.has_work():
                        stop = self._handle(commands.recv_bytes(), replies)
                    while not stop and commands.poll():
                        stop = self._handle(commands.recv_bytes(), replies)
                except EOFError:
                    logger.warning("the parent process went away; shutting the engine down")
                    stop = True
                if replies:
                    self.sender.put(replies)
                if not stop and engine.has_work():
                    outputs = engine.step()
                    self.steps += 1
                    if outputs:
                        self._send_outputs(outputs)
                    elif time.monotonic() - self._reported >= STEP_TICK_S:
                        # Steps without outputs (prefill chunks, held requests) still show the
                        # parent's stall watchdog that the engine moves.
                        self._reported = time.monotonic()
                        self.sender.put([("tick", self.steps)])
        except BaseException as e:  # noqa: BLE001 - the parent must learn of it
            logger.exception("engine process died")
            self.sender.put([("died", _wrap(e))])
            return
        self._shutdown()

    def _handle(self, message: bytes, replies: list) -> bool:
        """Apply one command; True for stop."""
        kind, cid, payload = pickle.loads(message)
        if kind == "stop":
            return True
        engine = self.engine
        try:
            args = pickle.loads(payload)
            if kind == "add":
                rid, prompt, params = args
                if rid in self.live:
                    raise DuplicateRequestError(f"request_id {rid!r} is already running")
                engine.add_request(rid, prompt, params)
                self.live.add(rid)
                value = None
            elif kind == "abort":
                value = bool(engine.abort(args[0]))
            elif kind == "call":
                value = args[0](engine)
                try:
                    pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as e:  # noqa: BLE001 - the caller learns why, not the sender thread
                    raise TypeError(f"the result of {args[0]!r} cannot be sent back: {e}") from None
            else:
                raise TypeError(f"unknown command {kind!r}")
        except Exception as e:  # noqa: BLE001 - validation errors go back to the caller
            if cid is not None:
                replies.append(("reply", cid, False, _wrap(e)))
            return False
        if cid is not None:
            replies.append(("reply", cid, True, value))
        return False

    def _send_outputs(self, outputs) -> None:
        live = self.live
        for out in outputs:
            if out.finished:
                live.discard(out.request_id)
        self._reported = time.monotonic()
        self.sender.put([("out", outputs, self.steps)])

    def _shutdown(self) -> None:
        """Abort everything left and step until the engine has released it (bounded)."""
        engine = self.engine
        abort_and_drain(engine, list(self.live), self._send_outputs)
        if hasattr(engine, "close"):
            try:
                engine.close()
            except Exception:  # noqa: BLE001
                logger.exception("engine close failed during shutdown")
        self.sender.put([("stopped",)])
