"""Mosaic GPU paged decode kernel (GPU interpret mode on CPU) vs the jnp reference.

The interpreter simulates SMEM, TMA copies and barriers, and poisons fresh
buffers with NaN, so a page that is never copied or a barrier waited on too
early shows up as a wrong or non-finite output. It runs the two matmuls as
plain dots (it cannot run wgmma with a register or transposed operand); the
wgmma path itself is checked on the GPU by `mosaic_decode.gpu_self_check`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from jaxoverlap.pallas_kernels import mosaic_decode as md
from jaxoverlap.pallas_kernels.reference import paged_attention_ref
from jaxoverlap.pallas_kernels.testing import make_paged_batch

pytestmark = pytest.mark.skipif(
    not md.available() or md.InterpretGPUParams is None,
    reason="this JAX has no Mosaic GPU Pallas interpret mode")

SCALE = 0.125
# Both sides round to the output dtype; the kernel also rounds p to it for PV.
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def run_both(b, page_size, interpret=None, **kw):
    out = md.paged_decode_attention_mgpu(
        *b.args(), scale=SCALE, ctx_len=b.ctx_len, page_size=page_size,
        interpret=interpret or md.interpret_params(), **kw)
    ref = paged_attention_ref(*b.args(), scale=SCALE, ctx_len=b.ctx_len)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    return np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))


# Lengths straddle page and block (64 keys) boundaries and include rows shorter
# than a page; each case adds an empty padded row (entry 0, kv_len 0).
@pytest.mark.parametrize("head_dim,heads,kv_heads,page,lens,dtype,kw", [
    # GQA 4, one block per split, small pages
    (64, 8, 2, 8, [37, 130], jnp.bfloat16, dict(num_splits=1)),
    # GQA 8, 3 splits over 3 blocks (one split of the short row is empty)
    (128, 8, 1, 16, [150, 9], jnp.float16, dict(num_splits=3)),
    # MHA (G = 1), 2 splits, f16 for a tight tolerance
    (64, 2, 2, 16, [141], jnp.float16, dict(num_splits=2)),
    # 5 blocks through 3 buffers: every buffer is refilled at least once
    (128, 4, 1, 8, [300, 63], jnp.bfloat16, dict(num_splits=1, block_k=64, num_stages=3)),
])
def test_matches_reference(head_dim, heads, kv_heads, page, lens, dtype, kw):
    b = make_paged_batch(kv_lens=lens, num_q=1, num_heads=heads, num_kv_heads=kv_heads,
                         head_dim=head_dim, page_size=page, padded_rows=1, dtype=dtype)
    out, ref = run_both(b, page, **kw)
    assert np.isfinite(out).all()
    assert (out[-1] == 0).all()  # the padded row sees nothing
    np.testing.assert_allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_query_position_limits_visibility():
    """c <= q_positions[r] and c < kv_lens[r]: the smaller bound wins either way."""
    b = make_paged_batch(kv_lens=[90, 40], num_q=1, num_heads=4, num_kv_heads=1,
                         head_dim=64, page_size=16, ctx_len=96, dtype=jnp.float16)
    # Row 0 sees 21 of its 90 keys (bound inside a page); row 1's position lies
    # past its kv_len, so kv_len bounds it.
    b = dataclasses.replace(b, q_positions=jnp.array([[20], [70]], jnp.int32))
    out, ref = run_both(b, 16, num_splits=2)
    np.testing.assert_allclose(out, ref, atol=TOL[jnp.float16], rtol=TOL[jnp.float16])


def test_no_races_in_pipeline():
    """The interpreter's race detector sees every SMEM read ordered after its copy."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mgpu_interpret

    b = make_paged_batch(kv_lens=[230], num_q=1, num_heads=4, num_kv_heads=1,
                         head_dim=64, page_size=16, dtype=jnp.bfloat16)
    params = md.InterpretGPUParams(detect_races=True)
    out, ref = run_both(b, 16, interpret=params, num_splits=1, block_k=64, num_stages=2)
    assert not mgpu_interpret.get_races().races_found
    np.testing.assert_allclose(out, ref, atol=TOL[jnp.bfloat16], rtol=TOL[jnp.bfloat16])


def test_rejects_unsupported():
    b = make_paged_batch(kv_lens=[5], num_q=1, num_heads=4, num_kv_heads=1,
                         head_dim=64, page_size=8, dtype=jnp.float32)
    with pytest.raises(NotImplementedError):  # tf32 wgmma cannot read V transposed
        md.paged_decode_attention_mgpu(*b.args(), scale=SCALE, ctx_len=b.ctx_len, page_size=8)
    b = make_paged_batch(kv_lens=[5, 3], num_q=2, num_heads=4, num_kv_heads=1,
                         head_dim=64, page_size=8, dtype=jnp.bfloat16)
    with pytest.raises(NotImplementedError):  # decode only
        md.paged_decode_attention_mgpu(*b.args(), scale=SCALE, ctx_len=b.ctx_len, page_size=8)


def test_lowers_for_cuda():
    """The Pallas -> Mosaic GPU lowering (layouts, wgmma shapes, TMA boxes) runs
    on a CPU-only machine; compiling the result to a cubin needs the GPU."""
    import functools

    b = make_paged_batch(kv_lens=[300, 17], num_q=1, num_heads=32, num_kv_heads=8,
                         head_dim=128, page_size=16, padded_rows=1, dtype=jnp.bfloat16)
    for splits in (1, 2):
        f = functools.partial(md.paged_decode_attention_mgpu, scale=SCALE,
                              ctx_len=b.ctx_len, page_size=16, num_splits=splits)
        text = jax.jit(f).trace(*b.args()).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
