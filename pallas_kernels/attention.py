"""Backend switch for paged attention: the engine calls only `paged_attention`.

Every entry point here has the signature of `reference.paged_attention_ref`
plus keyword-only options, so the engine can pick the backend by a flag.
"""

from __future__ import annotations

from . import add_norm, expert_matmul, fp8_matmul
from .decode import MAX_ROWS, paged_decode_attention
from .fused_decode import fused_decode_attention
from .prefill import paged_prefill_attention
from .reference import paged_attention_ref

BACKENDS = ("xla", "pallas")


def paged_window_attention(q, k_cache, v_cache, layer, req_to_token, entries,
                           q_positions, kv_lens, *, scale, ctx_len, interpret=False, **tuning):
    """Speculative-verify window (Q = 1 + k, causal inside the window).

    The window's Q * G rows fit one program, so this is the split-K decode
    kernel: the per-row causal mask already handles query j seeing the
    cached prefix plus window tokens 0..j.
    """
    return paged_decode_attention(q, k_cache, v_cache, layer, req_to_token, entries,
                                  q_positions, kv_lens, scale=scale, ctx_len=ctx_len,
                                  interpret=interpret, **tuning)


def paged_attention(q, k_cache, v_cache, layer, req_to_token, entries, q_positions,
                    kv_lens, *, scale: float, ctx_len: int, backend: str = "xla",
                    interpret: bool = False):
    """Paged attention for decode, speculative window or chunked prefill.

    Args: as `reference.paged_attention_ref`; backend "xla" runs that
    reference, "pallas" the Triton kernels (interpret=True runs them in the
    Pallas interpreter, e.g. on CPU). Decode and windows whose Q * G rows fit
    one tile (<= MAX_ROWS) use the split-K kernel, longer Q the prefill one.
    """
    if backend == "xla":
        return paged_attention_ref(q, k_cache, v_cache, layer, req_to_token, entries,
                                   q_positions, kv_lens, scale=scale, ctx_len=ctx_len)
    if backend != "pallas":
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    num_q, num_heads = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2]
    kernel = paged_decode_attention if num_q * group <= MAX_ROWS else paged_prefill_attention
    return kernel(q, k_cache, v_cache, layer, req_to_token, entries, q_positions, kv_lens,
                  scale=scale, ctx_len=ctx_len, interpret=interpret)


class PallasAttention:
    """The Pallas backend as models/transformer.forward sees it: `paged_attention` when
    called, plus two kernels that forward uses for one-token rows (decode) where the
    attributes exist (fuse_decode=True):
    - `fused_decode`: q/k norm, RoPE, cache write and attention of a layer (fused_decode.py);
    - `add_rms_norm`: each residual add with the RMS norm after it (add_norm.py);
    and, for mixture-of-experts layers of a few tokens (models/moe.py, the "pallas" plan):
    - `expert_matmul`: rows times their own expert's matrix, read in place (expert_matmul.py);
    and, with fp8_matmul=True, for 8-bit weight matrices (models/quant.linear) of a few rows:
    - `fp8_matmul`: the matrix converted in registers (fp8_matmul.py). Off by default: it
      has run only interpreted so far (benchmarks/decode_bench.py's fp8_kernel variant and
      quant_matmul_probe.py's fp8_kernel format are its first GPU measurements).

    Steps take the backend as a static argument, so create one object per configuration
    and reuse it (the engine caches them); equal objects would not share compilations."""

    def __init__(self, interpret: bool = False, fuse_decode: bool = True, fp8_matmul: bool = False):
        self.interpret = interpret
        if not fuse_decode:  # instance attributes hide the methods: forward sees None
            self.fused_decode = None
            self.add_rms_norm = None
        if not fp8_matmul:
            self.fp8_matmul = None

    def __call__(self, q, k_cache, v_cache, layer, req_to_token, entries, q_positions, kv_lens, *, scale, ctx_len):
        return paged_attention(q, k_cache, v_cache, layer, req_to_token, entries, q_positions, kv_lens,
                               scale=scale, ctx_len=ctx_len, backend="pallas", interpret=self.interpret)

    def fused_decode(self, qkv, k_cache, v_cache, layer, req_to_token, entries, positions, kv_lens, slots,
                     q_norm, k_norm, rope_freq, **static):
        return fused_decode_attention(qkv, k_cache, v_cache, layer, req_to_token, entries, positions, kv_lens,
                                      slots, q_norm, k_norm, rope_freq, interpret=self.interpret, **static)

    def add_rms_norm(self, x, delta, weights, *, row: int, eps: float):
        """(x + delta, rms_norm(x + delta) * weights[row]) for x, delta [N, D]; callers check
        `add_norm.supported(D)` first."""
        return add_norm.add_rms_norm(x, delta, weights, row=row, eps=eps, interpret=self.interpret)

    def expert_matmul(self, x, w, experts, out_dtype=None, scale=None):
        """x [A, K], w [E, K, N], experts [A] -> [A, N] (in x's dtype unless `out_dtype`;
        8-bit w with its column `scale` [E, N]); models/moe.py checks `supported` first."""
        return expert_matmul.expert_matmul(x, w, experts, interpret=self.interpret, out_dtype=out_dtype, scale=scale)

    def fp8_matmul(self, x, q):
        """x [M, K] @ q [K, N] (8-bit) -> float32 [M, N]; quant.linear checks
        `fp8_matmul.supported` first."""
        return fp8_matmul.fp8_matmul(x, q, interpret=self.interpret)

    def __repr__(self):
        return (f"PallasAttention(interpret={self.interpret}, fuse_decode={self.fused_decode is not None}, "
                f"fp8_matmul={self.fp8_matmul is not None})")
