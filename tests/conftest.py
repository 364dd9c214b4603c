"""Shared pytest fixtures. (pyproject's `pythonpath = ["tests"]` makes the helper modules
in this folder, such as hf_fixtures, importable.)"""
from __future__ import annotations

import os

# Most of the suite's time is XLA:CPU compiling tiny programs that then run for
# milliseconds: ask XLA for its cheapest compile (no LLVM optimization, least HLO effort),
# which took a quarter off the time of the engine tests. Through the environment, before
# JAX is imported, so that the tests' subprocesses (the TP worker, the benchmark scripts,
# `serve`) inherit it. Set both to 0 to run the suite on optimized programs.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
os.environ.setdefault("JAX_EXEC_TIME_OPTIMIZATION_EFFORT", "-1.0")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several workers on one GPU: none may claim most of its memory up front (JAX's default).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import pytest  # noqa: E402

import hf_fixtures  # noqa: E402


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: `hf_checkpoint(family, dtype="float32", max_shard_size=None, seed=0, **config)`
    -> folder of a tiny transformers-written checkpoint, made once per session per argument set.
    Treat the folder as read-only (copy it to change it)."""
    made: dict = {}

    def make(family: str, **kwargs) -> str:
        key = (family, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in made:
            path = str(tmp_path_factory.mktemp(f"hf-{family}"))
            made[key] = hf_fixtures.make_hf_checkpoint(path, family, **kwargs)
        return made[key]

    return make


@pytest.fixture(autouse=True)
def _unfreeze_gc():
    """Engines gc.freeze() the process once built (EngineConfig.freeze_gc). Between tests
    the frozen objects go back to the collector, so that the engines of finished tests can
    be collected."""
    yield
    import gc

    gc.unfreeze()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """XLA:CPU maps about three memory regions per compiled program and keeps them while
    JAX's caches hold the program. The whole suite compiles thousands of programs in one
    process, and a Linux process may hold at most vm.max_map_count (65530 by default) maps:
    past it, the next compile crashed (SIGSEGV in backend_compile_and_load, late in a full
    run). So each module's programs are dropped once the module is done, after its own
    fixtures (their engines) are gone."""
    yield
    import gc

    import jax

    gc.unfreeze()
    gc.collect()
    jax.clear_caches()


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per core, at most 4. Most of the suite is
    XLA compiling tiny programs on one thread, so workers divide the wall time (2 on CI's 2
    cores); past 4, each worker's own JAX start and module fixtures eat into the gain, and
    memory (a worker holds a few GiB) grows. The cores this process may use (a container's
    share, not the host's count); PYTEST_XDIST_AUTO_NUM_WORKERS, where set, decides instead."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, 4))
