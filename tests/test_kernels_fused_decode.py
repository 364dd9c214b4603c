"""The fused decode-attention kernel (norm + RoPE + cache write + attention), interpreted,
against the unfused XLA path the engine runs on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp

from jaxoverlap.models.transformer import apply_rope, rms_norm, split_qkv
from jaxoverlap.pallas_kernels.fused_decode import fused_decode_attention, rope_frequencies
from jaxoverlap.pallas_kernels.reference import paged_attention_ref
from jaxoverlap.pallas_kernels.testing import make_paged_batch

EPS = 1e-6


def unfused(qkv, k_cache, v_cache, layer, req, entries, pos, kv_lens, slots, q_norm, k_norm, inv_freq, *,
            H, KVH, scale, ctx_len):
    """What models/transformer.forward does for a decode layer without the kernel."""
    R = qkv.shape[0]
    HD = k_cache.shape[3]
    q, k, v = split_qkv(qkv[:, None], H, KVH, HD, 1)  # [R, 1, H | KVH, HD]
    if q_norm is not None:
        q = rms_norm(q, q_norm[layer], EPS)
        k = rms_norm(k, k_norm[layer], EPS)
    q = apply_rope(q, pos[:, None], inv_freq)
    k = apply_rope(k, pos[:, None], inv_freq)
    k_cache = k_cache.at[layer, slots].set(k.reshape(R, KVH, HD).astype(k_cache.dtype))
    v_cache = v_cache.at[layer, slots].set(v.reshape(R, KVH, HD).astype(v_cache.dtype))
    o = paged_attention_ref(q, k_cache, v_cache, layer, req, entries, pos[:, None], kv_lens, scale=scale,
                            ctx_len=ctx_len)
    return o[:, 0], k_cache, v_cache


def case(*, kv_lens, H, KVH, HD, page_size, padded_rows=0, dtype=jnp.float32, norm=True, seed=0, ctx_len=None):
    b = make_paged_batch(kv_lens=kv_lens, num_q=1, num_heads=H, num_kv_heads=KVH, head_dim=HD,
                         page_size=page_size, ctx_len=ctx_len, dtype=dtype, seed=seed, padded_rows=padded_rows)
    rng = np.random.default_rng(seed + 1)
    R = len(kv_lens) + padded_rows
    qkv = jnp.asarray(rng.normal(size=(R, (H + 2 * KVH) * HD)), jnp.float32).astype(dtype)
    pos = np.asarray(b.q_positions)[:, 0]
    ent = np.asarray(b.entries)
    slots = np.where(np.asarray(b.kv_lens) > 0, np.asarray(b.req_to_token)[ent, pos], 0).astype(np.int32)
    L = b.k_cache.shape[0]
    q_norm = jnp.asarray(1 + 0.3 * rng.normal(size=(L, HD)), jnp.float32).astype(dtype) if norm else None
    k_norm = jnp.asarray(1 + 0.3 * rng.normal(size=(L, HD)), jnp.float32).astype(dtype) if norm else None
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, HD, 2, dtype=np.float32) / HD))
    return b, qkv, jnp.asarray(pos), jnp.asarray(slots), q_norm, k_norm, inv_freq


@pytest.mark.parametrize("kv_lens,H,KVH,HD,page_size,padded_rows,norm,num_splits", [
    ([5, 17, 33], 8, 2, 64, 4, 1, True, None),  # GQA 4, lengths off the page size, a padded row
    ([1, 40], 4, 4, 64, 16, 0, False, None),  # GQA 1, Llama (no q/k norm), a row with no cache yet
    ([70, 9, 128], 8, 1, 128, 8, 2, True, 3),  # GQA 8, head dim 128, split-K with empty splits
    ([200], 16, 2, 128, 16, 0, True, 4),  # one long row spread over 4 splits
])
def test_fused_matches_unfused(kv_lens, H, KVH, HD, page_size, padded_rows, norm, num_splits):
    b, qkv, pos, slots, qn, kn, inv_freq = case(kv_lens=kv_lens, H=H, KVH=KVH, HD=HD, page_size=page_size,
                                                 padded_rows=padded_rows, norm=norm)
    scale = 1.0 / np.sqrt(HD)
    want_o, want_k, want_v = unfused(qkv, b.k_cache, b.v_cache, b.layer, b.req_to_token, b.entries, pos,
                                     b.kv_lens, slots, qn, kn, inv_freq, H=H, KVH=KVH, scale=scale,
                                     ctx_len=b.ctx_len)
    got_o, got_k, got_v = fused_decode_attention(
        qkv, jnp.array(b.k_cache), jnp.array(b.v_cache), b.layer, b.req_to_token, b.entries, pos, b.kv_lens, slots,
        qn, kn, rope_frequencies(inv_freq), num_heads=H, num_kv_heads=KVH, eps=EPS, scale=scale,
        ctx_len=b.ctx_len, interpret=True, num_splits=num_splits)
    np.testing.assert_allclose(np.asarray(got_o), np.asarray(want_o), atol=2e-5, rtol=2e-5)
    real = np.asarray(b.kv_lens) > 0
    assert np.abs(np.asarray(got_o)[~real]).max(initial=0.0) == 0.0  # padded rows see nothing
    # Every slot but the dummy one (padded rows all write slot 0) matches the scatters,
    # the rest of the cache untouched.
    np.testing.assert_allclose(np.asarray(got_k)[:, 1:], np.asarray(want_k)[:, 1:], atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_v)[:, 1:], np.asarray(want_v)[:, 1:])
    written = np.asarray(slots)[real]
    assert not np.allclose(np.asarray(got_k)[b.layer, written], np.asarray(b.k_cache)[b.layer, written])


def test_fused_bf16_close_to_unfused():
    b, qkv, pos, slots, qn, kn, inv_freq = case(kv_lens=[30, 77], H=8, KVH=2, HD=64, page_size=16,
                                                 padded_rows=1, dtype=jnp.bfloat16, seed=3)
    scale = 0.125
    want_o, want_k, _ = unfused(qkv, b.k_cache, b.v_cache, b.layer, b.req_to_token, b.entries, pos, b.kv_lens,
                                slots, qn, kn, inv_freq, H=8, KVH=2, scale=scale, ctx_len=b.ctx_len)
    got_o, got_k, _ = fused_decode_attention(
        qkv, jnp.array(b.k_cache), jnp.array(b.v_cache), b.layer, b.req_to_token, b.entries, pos, b.kv_lens, slots,
        qn, kn, rope_frequencies(inv_freq), num_heads=8, num_kv_heads=2, eps=EPS, scale=scale, ctx_len=b.ctx_len,
        interpret=True)
    np.testing.assert_allclose(np.asarray(got_o, np.float32), np.asarray(want_o, np.float32), atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(np.asarray(got_k, np.float32)[:, 1:], np.asarray(want_k, np.float32)[:, 1:],
                               atol=3e-2, rtol=3e-2)


def test_wrong_rope_would_fail():
    """The comparison can fail: a kernel fed the wrong RoPE frequencies disagrees."""
    b, qkv, pos, slots, qn, kn, inv_freq = case(kv_lens=[12, 20], H=4, KVH=2, HD=64, page_size=4)
    want_o, _, _ = unfused(qkv, b.k_cache, b.v_cache, b.layer, b.req_to_token, b.entries, pos, b.kv_lens, slots,
                           qn, kn, inv_freq, H=4, KVH=2, scale=0.125, ctx_len=b.ctx_len)
    got_o, _, _ = fused_decode_attention(
        qkv, jnp.array(b.k_cache), jnp.array(b.v_cache), b.layer, b.req_to_token, b.entries, pos, b.kv_lens, slots,
        qn, kn, rope_frequencies(inv_freq * 1.5), num_heads=4, num_kv_heads=2, eps=EPS, scale=0.125,
        ctx_len=b.ctx_len, interpret=True)
    assert not np.allclose(np.asarray(got_o), np.asarray(want_o), atol=1e-3)


@pytest.mark.parametrize("dtype,rows,hidden", [(jnp.float32, 3, 64), (jnp.bfloat16, 2, 256)])
def test_add_rms_norm_matches_xla(dtype, rows, hidden):
    from jaxoverlap.pallas_kernels.add_norm import add_rms_norm

    rng = np.random.default_rng(5)
    x, d = (jnp.asarray(rng.normal(size=(rows, hidden)), jnp.float32).astype(dtype) for _ in range(2))
    w = jnp.asarray(1 + 0.2 * rng.normal(size=(4, hidden)), jnp.float32).astype(dtype)
    got_x, got_h = add_rms_norm(x, d, w, row=2, eps=EPS, interpret=True)
    want_x = x + d
    want_h = rms_norm(want_x, w[2], EPS)
    np.testing.assert_array_equal(np.asarray(got_x, np.float32), np.asarray(want_x, np.float32))
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got_h, np.float32), np.asarray(want_h, np.float32), atol=tol, rtol=tol)
    # Another layer's weights give another result: the row index is honoured.
    _, other = add_rms_norm(x, d, w, row=1, eps=EPS, interpret=True)
    assert not np.allclose(np.asarray(other, np.float32), np.asarray(want_h, np.float32), atol=1e-3)
