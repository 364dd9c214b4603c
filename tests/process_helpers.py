"""Functions that tests send to an engine process (EngineProcess.call). They live in a module
of their own, imported by its top-level name: the child process finds it on the sys.path it
inherits (pytest's `pythonpath`), while a test module's own name depends on how pytest was
started."""
import threading


def a_lock(engine):
    return threading.Lock()  # a result that cannot be pickled back
