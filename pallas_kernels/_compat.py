"""Version shims for the Pallas Triton API (JAX 0.10.x on CPU, 0.11.x on GPU)."""

from __future__ import annotations

import warnings

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# JAX 0.11 warns at every lowering that the Triton backend is deprecated; the
# warning is about the future and would otherwise fire once per compiled layer.
warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")


def triton_params(num_warps: int, num_stages: int):
    """Triton compiler params under whichever name this JAX version uses."""
    cls = getattr(plgpu, "CompilerParams", None)
    if cls is None:  # JAX <= 0.6 spelling
        cls = getattr(plgpu, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def masked_store(ref_view, value, mask) -> None:
    """Store where mask is true (GPU: predicated store; interpret: scatter)."""
    store = getattr(plgpu, "store", None) or pl.store
    store(ref_view, value, mask=mask)
