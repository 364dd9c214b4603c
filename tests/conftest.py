"""Shared pytest fixtures.

pytest runs with --import-mode=importlib, which does not put this folder on sys.path;
add it so that test modules can `import hf_fixtures`.
"""
from __future__ import annotations

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

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
