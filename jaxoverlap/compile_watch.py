"""Counts the XLA programs compiled (or loaded from JAX's persistent compilation cache) while
the engine launches a step.

A launch that compiles holds up every request for the compile: about 10 s per program for
Qwen3-8B on the H200, a second or so to load one from the persistent cache. The engine
counts such launches (Engine.stats()["loop"], the server's Prometheus counters) and logs
each, so that an operator sees what the warm-up left out (`jaxoverlap serve --precompile`).

JAX reports compilations through `jax.monitoring` on the thread that compiles, which for a
launch is the engine's own thread: one process-wide listener hands each event to the
counter that thread has installed, so compilations on other threads (a warm-up's pool, an
unrelated `jit` elsewhere in the process) are not counted.
"""
from __future__ import annotations

import threading

import jax

# A backend compilation, and a program read from the persistent cache instead.
EVENTS = frozenset({"/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec"})

_local = threading.local()
_listener_lock = threading.Lock()
_listening = False


def _on_event(name: str, _secs: float, **_kwargs) -> None:
    if name in EVENTS:
        watch = getattr(_local, "watch", None)
        if watch is not None:
            watch.programs += 1


def _listen() -> None:
    global _listening
    with _listener_lock:
        if not _listening:  # jax.monitoring has no unregister: one listener for the process
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _listening = True


class CompileWatch:
    """`with watch:` counts, in `watch.programs`, the programs compiled or loaded on this
    thread until the block ends. The caller reads and resets `programs` itself. A class
    rather than a generator context manager: it wraps every launch."""

    def __init__(self):
        _listen()
        self.programs = 0
        self._outer = None

    def __enter__(self) -> "CompileWatch":
        self._outer = getattr(_local, "watch", None)
        _local.watch = self
        return self

    def __exit__(self, *exc) -> None:
        _local.watch, self._outer = self._outer, None
