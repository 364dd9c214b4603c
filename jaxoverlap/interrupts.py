"""Ctrl-C that waits for the end of an engine step.

Python raises KeyboardInterrupt between any two bytecodes of the main thread. Raised inside
a step, after a jitted program took the device state by donation and before the runner
kept the new one, it leaves the engine holding deleted buffers: every later step fails
("Buffer has been deleted or donated"). In a notebook, Ctrl-C during a long warm-up or a
generate() is the common case, so the engine's step (and its warm-up, and the LLM's filing
of a step's outputs) runs inside `deferred()`: a SIGINT that arrives there is handed on
when the outermost such block ends.

The handler is installed once, in the main thread, at the first `deferred()` block, and
stays: outside a block it hands the signal straight to the handler it replaced, so the
process behaves as before (KeyboardInterrupt by default; nothing where SIGINT is ignored,
as in the server's engine process). A handler installed later by the program is kept, and
ours is put in front of it at the next block. Each of ours keeps the handler it replaced:
a program that ignores SIGINT for a while, then puts back the handler it found (ours),
gets Ctrl-C back (with one shared "replaced handler", it stayed ignored for good). Off the
main thread a block does nothing: signals reach only the main thread, and a
KeyboardInterrupt there does not cut a step that another thread runs.
"""
from __future__ import annotations

import signal
import threading

_main = threading.main_thread()
_state = {"depth": 0, "pending": None}


def _deliver(previous, frame) -> None:
    """What the replaced handler would have done with the signal."""
    if previous == signal.SIG_IGN:
        return
    if callable(previous):
        previous(signal.SIGINT, frame)
    else:  # SIG_DFL, or None (a handler not installed from Python): the interpreter's default
        raise KeyboardInterrupt


class _Handler:
    """Our SIGINT handler, in front of the one it replaced."""

    __slots__ = ("previous",)

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, signum, frame) -> None:
        if _state["depth"]:
            _state["pending"] = (self.previous, frame)
        else:
            _deliver(self.previous, frame)


class _Deferred:
    """The context manager of `deferred()` (a class: a step enters it, and a generator-based
    one costs a few microseconds more)."""

    __slots__ = ("active",)

    def __enter__(self):
        self.active = threading.current_thread() is _main
        if self.active:
            current = signal.getsignal(signal.SIGINT)
            if not isinstance(current, _Handler):
                signal.signal(signal.SIGINT, _Handler(current))
            _state["depth"] += 1
        return self

    def __exit__(self, *exc):
        if self.active:
            _state["depth"] -= 1
            pending = _state["pending"]
            if pending is not None and not _state["depth"]:
                _state["pending"] = None
                _deliver(*pending)
        return False


def deferred() -> _Deferred:
    """A block that a SIGINT does not cut: the signal is handed on when the block ends."""
    return _Deferred()
