"""EngineWorker: runs the single-threaded Engine on its own thread, fed by a command queue.

The engine is not thread-safe, so every call into it happens on the worker thread. Callers (the
asyncio gRPC handlers) talk to it only through `_commands`, a thread-safe FIFO:

* add / abort / stats are commands; each carries a concurrent.futures.Future the worker resolves,
  so validation errors raised by `engine.add_request` reach the caller that sent the request.
* outputs go the other way: after each `engine.step()` the worker groups the RequestOutputs by
  the event loop that owns each request and hands every group over with ONE
  `loop.call_soon_threadsafe` call. The step path therefore never waits on a consumer and never
  touches the device beyond what `step()` itself does.

The loop runs `step()` while the engine has work, draining commands without blocking between
steps, and blocks on the queue when idle. Because commands are handled in FIFO order, an abort
sent after an add always finds the request.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable

from jaxoverlap.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# A sink receives the outputs of one request, on the request's event loop. It gets either a
# RequestOutput or, if the engine thread dies, the exception that killed it.
Sink = Callable[[Any], None]


class DuplicateRequestError(InvalidRequestError):
    """The request id is still live in the engine (maps to gRPC ALREADY_EXISTS)."""


class WorkerUnavailableError(RuntimeError):
    """The worker is stopping or its engine thread died (maps to gRPC UNAVAILABLE)."""


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt: Any
    params: Any
    loop: asyncio.AbstractEventLoop
    sink: Sink
    future: concurrent.futures.Future


@dataclasses.dataclass
class _Abort:
    request_id: str
    future: concurrent.futures.Future | None


@dataclasses.dataclass
class _Call:
    """Run fn(engine) on the worker thread between steps (stats, integrity checks, tests)."""

    fn: Callable[[Any], Any]
    future: concurrent.futures.Future


_STOP = object()


class EngineCalls:
    """`call_sync`, `call` and `stats` on top of a worker's `submit_call(fn)`, which runs
    fn(engine) between two steps: the same for EngineWorker and EngineProcess."""

    def submit_call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        raise NotImplementedError

    def call_sync(self, fn: Callable[[Any], Any], timeout: float | None = None):
        """Run fn(engine) between two steps and return its result (blocking)."""
        return self.submit_call(fn).result(timeout)

    async def call(self, fn: Callable[[Any], Any]):
        return await asyncio.wrap_future(self.submit_call(fn))

    async def stats(self) -> dict:
        return await self.call(engine_stats)


class EngineWorker(EngineCalls):
    """Owns an engine on a dedicated thread. Pass an engine, or a factory to build it on the thread.

    `warmup` (True or a SamplingParams-like max_new_tokens count) runs one short request through
    the engine before `start()` returns, so that the first client does not pay for compilation.
    `precompile` (True, or "auto" for a GPU only) also compiles every decode batch bucket
    (Engine.warmup) before then, for each static sampling flag in `precompile_sampling`
    (default greedy and sampling), and `precompile_prefill` every prefill bucket with them;
    `precompile_top_logprobs` also each program's variant that returns top logprobs, and
    `precompile_structured` the programs of batches with structured output, and
    `precompile_prompt_logprobs` (with `precompile_prefill`) each prefill program's variant
    that returns prompt logprobs.
    `jaxoverlap serve` runs the engine in a process of its own instead (EngineProcess, same
    methods): on a thread here, the engine's loop shares the GIL with the server.
    """

    def __init__(self, engine=None, *, engine_factory: Callable[[], Any] | None = None, warmup: bool = False,
                 precompile: bool = False, precompile_prefill: bool = False,
                 precompile_sampling: tuple[bool, ...] = (False, True), precompile_top_logprobs: bool = False,
                 precompile_structured: bool = False, precompile_prompt_logprobs: bool = False,
                 name: str = "jaxoverlap-engine"):
        if (engine is None) == (engine_factory is None):
            raise ValueError("pass exactly one of engine and engine_factory")
        check_precompile_options(precompile_prefill, precompile_prompt_logprobs)
        self._engine = engine
        self._factory = engine_factory
        self._warmup = warmup
        self._precompile = precompile  # Engine.warmup(): every decode batch bucket, before serving
        self._precompile_prefill = precompile_prefill  # Engine.warmup(prefill=True)
        self._precompile_sampling = precompile_sampling  # Engine.warmup(sampling=...)
        self._precompile_top = precompile_top_logprobs  # Engine.warmup(top_logprobs=True)
        self._precompile_structured = precompile_structured  # Engine.warmup(structured=True)
        self._precompile_prompt = precompile_prompt_logprobs  # Engine.warmup(prompt_logprobs=True)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # request_id -> (loop, sink); touched only on the worker thread.
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, Sink]] = {}
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._stopping = False
        self.dead_error: BaseException | None = None  # set if the engine thread crashed
        self.steps = 0

    # ---- lifecycle (any thread) -------------------------------------------------------------

    @property
    def engine(self):
        """The engine object. Only touch it from the worker thread, e.g. through `call()`."""
        return self._engine

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self.dead_error is None

    def start(self, timeout: float | None = None) -> "EngineWorker":
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("engine worker did not become ready in time")
        if self._start_error is not None:
            raise RuntimeError("engine failed to start") from self._start_error
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort whatever is still running, let the engine finish those aborts, and end the thread."""
        if not self._thread.is_alive():
            return
        self._stopping = True
        self._commands.put(_STOP)
        self._thread.join(timeout)

    # ---- commands (any thread) --------------------------------------------------------------

    async def add(self, request_id: str, prompt, params, sink: Sink) -> None:
        """Queue a request; returns once the engine accepted it, raises what add_request raised.

        `sink` is called on the running event loop with each RequestOutput of the request.
        """
        fut = self.submit_add(request_id, prompt, params, asyncio.get_running_loop(), sink)
        await asyncio.wrap_future(fut)

    def submit_add(self, request_id, prompt, params, loop, sink) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            fut.set_exception(WorkerUnavailableError(self._unavailable_reason()))
            return fut
        self._commands.put(_Add(request_id, prompt, params, loop, sink, fut))
        return fut

    def abort_nowait(self, request_id: str) -> None:
        """Fire-and-forget abort (used when a client goes away; the result does not matter)."""
        self._commands.put(_Abort(request_id, None))

    async def abort(self, request_id: str) -> bool:
        """Abort a request; True if the engine had it live. Its final output has finish_reason 'abort'."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            raise WorkerUnavailableError(self._unavailable_reason())
        self._commands.put(_Abort(request_id, fut))
        return await asyncio.wrap_future(fut)

    def submit_call(self, fn) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self._thread.is_alive() or self.dead_error is not None:
            fut.set_exception(WorkerUnavailableError(self._unavailable_reason()))
            return fut
        self._commands.put(_Call(fn, fut))
        return fut

    def _unavailable_reason(self) -> str:
        if self.dead_error is not None:
            return f"engine thread died: {self.dead_error!r}"
        return "engine worker is not running"

    # ---- the engine thread ------------------------------------------------------------------

    def _main(self) -> None:
        try:
            if self._engine is None:
                self._engine = self._factory()
            prepare_engine(self._engine, self._warmup, self._precompile, self._precompile_prefill,
                           self._precompile_sampling, self._precompile_top, self._precompile_structured,
                           self._precompile_prompt)
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - must reach every waiting consumer
            logger.exception("engine thread died")
            self.dead_error = e
            self._fail_everything(e)
            # Keep refusing commands that raced with the crash, so no caller waits forever.
            while (cmd := self._commands.get()) is not _STOP:
                _refuse(cmd, WorkerUnavailableError(f"engine thread died: {e!r}"))

    def _loop(self) -> None:
        engine = self._engine
        commands = self._commands
        while True:
            busy = engine.has_work()
            try:
                # Never block while the engine has work: the next step must start right away.
                cmd = commands.get_nowait() if busy else commands.get()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd is _STOP:
                    self._shutdown()
                    return
                self._handle(cmd)
                try:
                    cmd = commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if engine.has_work():
                outputs = engine.step()
                self.steps += 1
                if outputs:
                    self._deliver(outputs)

    def _handle(self, cmd) -> None:
        engine = self._engine
        if isinstance(cmd, _Add):
            if not cmd.future.set_running_or_notify_cancel():
                return
            if cmd.request_id in self._sinks:
                cmd.future.set_exception(DuplicateRequestError(f"request_id {cmd.request_id!r} is already running"))
                return
            try:
                engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
            except Exception as e:  # noqa: BLE001 - validation errors go back to the caller
                cmd.future.set_exception(e)
                return
            self._sinks[cmd.request_id] = (cmd.loop, cmd.sink)
            cmd.future.set_result(None)
        elif isinstance(cmd, _Abort):
            # The abort happens even when its caller has gone (an Abort RPC past its deadline
            # cancels the future): only the answer is dropped. Resolving a cancelled future
            # would raise here and end this thread.
            fut = cmd.future
            if fut is not None and not fut.set_running_or_notify_cancel():
                fut = None
            try:
                ok = bool(engine.abort(cmd.request_id))
            except Exception as e:  # noqa: BLE001
                if fut is not None:
                    fut.set_exception(e)
                return
            if fut is not None:
                fut.set_result(ok)
        elif isinstance(cmd, _Call):
            if not cmd.future.set_running_or_notify_cancel():
                return
            try:
                cmd.future.set_result(cmd.fn(engine))
            except Exception as e:  # noqa: BLE001
                cmd.future.set_exception(e)
        else:  # pragma: no cover
            raise TypeError(f"unknown command {cmd!r}")

    def _deliver(self, outputs) -> None:
        # One call_soon_threadsafe per loop per step, whatever the batch size.
        by_loop: dict[asyncio.AbstractEventLoop, list] = collections.defaultdict(list)
        sinks = self._sinks
        for out in outputs:
            rid = out.request_id
            entry = sinks.get(rid)
            if entry is None:
                continue  # e.g. the warmup request, or a request added behind our back
            if out.finished:
                del sinks[rid]
            by_loop[entry[0]].append((entry[1], out))
        hand_over(by_loop)

    def _shutdown(self) -> None:
        """Abort everything left and step until the engine has released it (bounded)."""
        engine = self._engine
        # Commands that raced with stop: refuse them so no caller waits forever.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            _refuse(cmd, WorkerUnavailableError("engine worker is stopping"))
        abort_and_drain(engine, list(self._sinks), self._deliver)
        if self._sinks:
            self._fail_everything(WorkerUnavailableError("engine worker stopped"))
        if self._factory is not None and hasattr(engine, "close"):
            # The worker built this engine, so nobody else holds it: free its device memory
            # now (Engine.close), not when the process ends.
            try:
                engine.close()
            except Exception:  # noqa: BLE001 - best effort on the way out
                logger.exception("engine close failed during shutdown")

    def _fail_everything(self, error: BaseException) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = collections.defaultdict(list)
        for loop, sink in self._sinks.values():
            by_loop[loop].append((sink, error))
        self._sinks.clear()
        hand_over(by_loop)


def hand_over(by_loop: dict) -> None:
    """Give each event loop its (sink, output) items with one call_soon_threadsafe."""
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_dispatch, items)
        except RuntimeError:
            pass  # that loop is closed: its consumers are gone


def abort_and_drain(engine, request_ids, deliver, timeout_s: float = 30.0) -> None:
    """A worker's way out: abort these requests and step the engine until it has released
    them (bounded), handing each step's outputs to `deliver`."""
    for rid in request_ids:
        try:
            engine.abort(rid)
        except Exception:  # noqa: BLE001 - best effort on the way out
            logger.exception("abort of %s during shutdown failed", rid)
    deadline = time.monotonic() + timeout_s
    try:
        while engine.has_work() and time.monotonic() < deadline:
            outputs = engine.step()
            if outputs:
                deliver(outputs)
    except Exception:  # noqa: BLE001
        logger.exception("engine step failed during shutdown")


def engine_stats(engine) -> dict:
    """fn(engine) for `call`: module-level, so an EngineProcess can send it too."""
    return engine.stats()


def check_precompile_options(precompile_prefill: bool, precompile_prompt_logprobs: bool) -> None:
    """A worker's options refused when it is made, on any backend (Engine.warmup would refuse
    them only at start, and only where the precompile runs: on a GPU for "auto")."""
    if precompile_prompt_logprobs and not precompile_prefill:
        raise ValueError("precompile_prompt_logprobs compiles prefill programs: it needs precompile_prefill")


def prepare_engine(engine, warmup=False, precompile=False, precompile_prefill=False,
                   precompile_sampling=(False, True), precompile_top_logprobs=False,
                   precompile_structured=False, precompile_prompt_logprobs=False) -> None:
    """What a worker does with its engine before it serves: `precompile` compiles every decode
    batch bucket (Engine.warmup; "auto": on a GPU only), by default greedy and sampling
    (`precompile_sampling`), since a server cannot know whether its clients sample and a
    program compiled on first use stalls every stream for its compile (about 10 s for
    Qwen3-8B on the H200); `precompile_prefill` every
    prefill bucket too (one program per shape serves greedy and sampled rows), and with
    `precompile_prompt_logprobs` each prefill's variant for scoring requests. `warmup` (True,
    or a number of new tokens) runs one short request through the engine, so that the first
    client does not pay for what is left."""
    if precompile == "auto":
        import jax

        precompile = jax.default_backend() == "gpu"
    # The warm-up request runs before the precompile, compiling its two programs alone. Run
    # after it (on precompiled programs), the cold start spent 22 s less outside the compile,
    # but the next start from the persistent cache took 171 s instead of 60 s, for a reason
    # not found (benchmarks/RESULTS.md, 2026-12-06 third session).
    if warmup:
        from jaxoverlap.sampling_params import SamplingParams

        n = warmup if isinstance(warmup, int) and not isinstance(warmup, bool) else 4
        engine.add_request("__warmup__", [0, 1, 2, 3], SamplingParams(max_new_tokens=n, temperature=0.0,
                                                                        ignore_eos=True))
        deadline = time.monotonic() + 600
        while engine.has_work() and time.monotonic() < deadline:
            engine.step()
    if precompile:
        t = time.perf_counter()
        n = len(engine.warmup(sampling=tuple(precompile_sampling), prefill=bool(precompile_prefill),
                              top_logprobs=bool(precompile_top_logprobs), structured=bool(precompile_structured),
                              prompt_logprobs=bool(precompile_prompt_logprobs)))
        logger.info("compiled %d programs in %.1f s", n, time.perf_counter() - t)


def _refuse(cmd, error: BaseException) -> None:
    if isinstance(cmd, (_Add, _Call)):
        if cmd.future.set_running_or_notify_cancel():
            cmd.future.set_exception(error)
    elif isinstance(cmd, _Abort) and cmd.future is not None:
        if cmd.future.set_running_or_notify_cancel():
            cmd.future.set_result(False)


def _dispatch(items) -> None:
    """Runs on the consumer's event loop: hand each output to its request's sink."""
    for sink, out in items:
        try:
            sink(out)
        except Exception:  # noqa: BLE001 - one broken consumer must not starve the others
            logger.exception("output sink failed")
