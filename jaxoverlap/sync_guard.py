"""`no_host_sync()`: make any device-to-host read on the launch path an error.

`jax.transfer_guard_device_to_host("disallow")` catches hidden `.item()`, `np.asarray(x)`,
`int(x)` on GPU and TPU, but on the CPU backend arrays already live in host memory and the
guard never fires. To test the launch path in CI (CPU only), the guard here also makes the
array methods that read a value on the host raise while it is active, and `np.asarray` /
`np.array` of a jax.Array (which on CPU go through the buffer protocol, below any method).
Only the thread that entered the guard is affected.
"""
from __future__ import annotations

import contextlib
import threading

import jax
import numpy as np
from jax._src.array import ArrayImpl

_READERS = ("__array__", "__int__", "__float__", "__bool__", "__index__", "__complex__", "item", "tolist",
            "block_until_ready")
_state = threading.local()


class HostSyncError(RuntimeError):
    pass


def _forbidden(name, original):
    def wrapper(self, *args, **kwargs):
        if getattr(_state, "depth", 0) > 0:
            raise HostSyncError(f"device-to-host read ({name}) on the launch path: disallowed")
        return original(self, *args, **kwargs)

    return wrapper


_originals = {name: getattr(ArrayImpl, name) for name in _READERS if hasattr(ArrayImpl, name)}
_installed = False
_install_lock = threading.Lock()


def _numpy_reader(name, original):
    def wrapper(obj, *args, **kwargs):
        if getattr(_state, "depth", 0) > 0 and isinstance(obj, jax.Array):
            raise HostSyncError(f"device-to-host read (np.{name}) on the launch path: disallowed")
        return original(obj, *args, **kwargs)

    return wrapper


def _install() -> None:
    global _installed
    with _install_lock:
        if not _installed:
            for name, fn in _originals.items():
                setattr(ArrayImpl, name, _forbidden(name, fn))
            for name in ("asarray", "array", "asanyarray"):
                setattr(np, name, _numpy_reader(name, getattr(np, name)))
            _installed = True


@contextlib.contextmanager
def no_host_sync():
    _install()
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with jax.transfer_guard_device_to_host("disallow"):
            yield
    finally:
        _state.depth -= 1
