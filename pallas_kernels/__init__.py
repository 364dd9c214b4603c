"""Paged attention and speculative-acceptance kernels (jnp reference + Pallas).

Engine entry points (each submodule can also be imported directly):
  attention.paged_attention(..., backend="xla" | "pallas")
  acceptance.greedy_accept / acceptance.rejection_sample(..., backend=...)
"""

from .acceptance import (
    greedy_accept,
    greedy_accept_ref,
    rejection_sample,
    rejection_sample_ref,
    rejection_sample_with_key,
)
from .attention import paged_attention, paged_window_attention
from .decode import paged_decode_attention
from .prefill import paged_prefill_attention
from .reference import paged_attention_ref

__all__ = [
    "paged_attention",
    "paged_attention_ref",
    "paged_decode_attention",
    "paged_window_attention",
    "paged_prefill_attention",
    "greedy_accept",
    "greedy_accept_ref",
    "rejection_sample",
    "rejection_sample_ref",
    "rejection_sample_with_key",
]
