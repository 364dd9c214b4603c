"""Paged attention: jnp reference vs a naive loop, Pallas kernels (interpret
mode) vs the reference, over decode / window / prefill shapes."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from jaxoverlap.pallas_kernels.attention import paged_attention, paged_window_attention
from jaxoverlap.pallas_kernels.decode import paged_decode_attention
from jaxoverlap.pallas_kernels.prefill import paged_prefill_attention
from jaxoverlap.pallas_kernels.reference import paged_attention_ref
from jaxoverlap.pallas_kernels.testing import make_paged_batch

SCALE = 0.125


def naive_attention(b):
    """Per (row, query, head) loop in float64 over req_to_token, for checking
    the reference itself."""
    q = np.asarray(b.q, np.float64)
    k = np.asarray(b.k_cache[b.layer], np.float64)
    v = np.asarray(b.v_cache[b.layer], np.float64)
    req, ent = np.asarray(b.req_to_token), np.asarray(b.entries)
    qpos, lens = np.asarray(b.q_positions), np.asarray(b.kv_lens)
    R, Q, H, HD = q.shape
    G = H // k.shape[1]
    out = np.zeros_like(q)
    for r in range(R):
        for j in range(Q):
            cs = [c for c in range(min(lens[r], b.ctx_len)) if c <= qpos[r, j]]
            if not cs:
                continue
            slots = req[ent[r], cs]
            for h in range(H):
                s = k[slots, h // G] @ q[r, j, h] * SCALE
                w = np.exp(s - s.max())
                out[r, j, h] = (w / w.sum()) @ v[slots, h // G]
    return out


def batch(**kw):
    kw.setdefault("num_layers", 2)
    return make_paged_batch(**kw)


def run_ref(b):
    return paged_attention_ref(*b.args(), scale=SCALE, ctx_len=b.ctx_len)


def assert_close(out, ref, tol):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)


# ------------------------------------------------------------------ reference

@pytest.mark.parametrize("num_q,heads,kv_heads,page,lens,pad", [
    (1, 4, 2, 4, [5, 13, 1], "zero"),  # decode, GQA 2
    (3, 4, 1, 4, [9, 2], "garbage"),  # window, kv_len < Q (padded queries)
    (6, 2, 2, 4, [6, 11], "zero"),  # prefill chunk over a cached prefix
])
def test_reference_matches_naive_loop(num_q, heads, kv_heads, page, lens, pad):
    b = batch(kv_lens=lens, num_q=num_q, num_heads=heads, num_kv_heads=kv_heads,
              head_dim=16, page_size=page, padded_rows=1, pad_positions=pad, ctx_len=16)
    np.testing.assert_allclose(np.asarray(run_ref(b)), naive_attention(b), atol=1e-5, rtol=1e-5)


def test_reference_empty_rows_are_zero_and_layer_is_used():
    b = batch(kv_lens=[7, 3], num_q=2, num_heads=4, num_kv_heads=2, head_dim=16,
              page_size=4, padded_rows=2)
    out = np.asarray(run_ref(b))
    assert np.isfinite(out).all()
    assert (out[2:] == 0).all()  # entry 0, kv_len 0
    other = paged_attention_ref(b.q, b.k_cache, b.v_cache, 0, *b.args()[4:],
                                scale=SCALE, ctx_len=b.ctx_len)
    assert not np.allclose(out[:2], np.asarray(other)[:2])


def poison_unreadable_slots(b):
    """NaN in every slot no visible position maps to (dummy page, unused pages,
    and the unwritten tail of each row's last page)."""
    req, ent, lens = map(np.asarray, (b.req_to_token, b.entries, b.kv_lens))
    ok = np.zeros(b.k_cache.shape[1], bool)
    for e, n in zip(ent, lens):
        ok[req[e, :n]] = True
    bad = jnp.asarray(~ok)[None, :, None, None]  # [1, slots, 1, 1]
    b.k_cache = jnp.where(bad, jnp.nan, b.k_cache)
    b.v_cache = jnp.where(bad, jnp.nan, b.v_cache)
    return b


@pytest.mark.parametrize("num_q", [1, 5, 40])  # decode, window, prefill kernel
def test_no_reads_outside_visible_cache(num_q):
    b = poison_unreadable_slots(batch(
        kv_lens=[6, 17, 45], num_q=num_q, num_heads=4, num_kv_heads=2, head_dim=16,
        page_size=4, padded_rows=1, ctx_len=48))
    ref = run_ref(b)
    out = paged_attention(*b.args(), scale=SCALE, ctx_len=b.ctx_len, backend="pallas",
                          interpret=True)
    assert np.isfinite(np.asarray(ref)).all()
    assert_close(out, ref, 1e-5)


# ------------------------------------------------------------- Pallas kernels

# (num_q, H, KVH, HD, page, kv_lens, tuning) -- G = H // KVH in {1, 4, 8}.
DECODE_CASES = [
    (1, 2, 2, 64, 4, [5, 33, 17], dict(block_k=16)),  # G=1, auto splits
    (1, 8, 2, 128, 16, [1, 40, 23], dict(block_k=16, num_splits=1)),  # G=4, direct
    (1, 8, 1, 64, 4, [30, 7], dict(block_k=16, num_splits=3)),  # G=8, split-K
    (1, 8, 2, 64, 16, [70, 3], dict(block_k=32, num_splits=2)),  # ragged lengths
    (2, 8, 2, 64, 4, [9, 26], dict(block_k=16, ctx_len=64)),  # ctx_len bound > lengths
]
WINDOW_CASES = [
    (4, 8, 2, 64, 4, [9, 4, 2], dict(block_k=16, num_splits=2)),  # kv_len < Q rows
    (3, 8, 1, 128, 16, [20, 35], dict(block_k=16)),  # G=8, 24 rows
    (8, 2, 2, 64, 16, [19, 8], dict(block_k=16, num_splits=1)),  # G=1
]
PREFILL_CASES = [
    (20, 8, 2, 64, 4, [20, 45, 7], dict(block_rows=32, block_k=16)),  # prefix + chunk
    (33, 4, 4, 128, 16, [40, 33], dict(block_rows=16, block_k=16)),  # G=1, ragged tiles
    (17, 8, 1, 64, 16, [17, 50], dict(block_rows=64, block_k=32)),  # G=8, 136 rows
]


def _case_id(c):
    return f"q{c[0]}-h{c[1]}-kv{c[2]}-d{c[3]}-p{c[4]}"


@pytest.mark.parametrize("case", DECODE_CASES + WINDOW_CASES, ids=_case_id)
def test_decode_window_kernel_matches_reference(case):
    num_q, h, kvh, hd, page, lens, tuning = case
    tuning = dict(tuning)
    b = batch(kv_lens=lens, num_q=num_q, num_heads=h, num_kv_heads=kvh, head_dim=hd,
              page_size=page, padded_rows=1, pad_positions="garbage", seed=len(lens) + hd,
              ctx_len=tuning.pop("ctx_len", None))
    fn = paged_decode_attention if num_q == 1 else paged_window_attention
    out = fn(*b.args(), scale=SCALE, ctx_len=b.ctx_len, interpret=True, **tuning)
    assert_close(out, run_ref(b), 1e-5)
    assert (np.asarray(out)[-1] == 0).all()  # padded row


@pytest.mark.parametrize("case", PREFILL_CASES, ids=_case_id)
def test_prefill_kernel_matches_reference(case):
    num_q, h, kvh, hd, page, lens, tuning = case
    b = batch(kv_lens=lens, num_q=num_q, num_heads=h, num_kv_heads=kvh, head_dim=hd,
              page_size=page, padded_rows=1, pad_positions="garbage", seed=num_q)
    out = paged_prefill_attention(*b.args(), scale=SCALE, ctx_len=b.ctx_len,
                                  interpret=True, **tuning)
    assert_close(out, run_ref(b), 1e-5)


@pytest.mark.parametrize("num_q", [1, 40])  # decode kernel, prefill kernel (160 rows)
def test_bf16(num_q):
    b = batch(kv_lens=[45, 24], num_q=num_q, num_heads=8, num_kv_heads=2, head_dim=128,
              page_size=16, padded_rows=1, dtype=jnp.bfloat16)
    out = paged_attention(*b.args(), scale=SCALE, ctx_len=b.ctx_len, backend="pallas",
                          interpret=True)
    assert out.dtype == jnp.bfloat16
    # The kernel feeds bf16 probabilities to the second matmul; the reference
    # keeps them in f32.
    assert_close(out, run_ref(b), 3e-2)


def test_dispatcher():
    b = batch(kv_lens=[5], num_q=1, num_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
    np.testing.assert_array_equal(
        np.asarray(paged_attention(*b.args(), scale=SCALE, ctx_len=b.ctx_len)),
        np.asarray(run_ref(b)))
    with pytest.raises(ValueError):
        paged_attention(*b.args(), scale=SCALE, ctx_len=b.ctx_len, backend="cuda")
    with pytest.raises(NotImplementedError):  # Triton tensors need 2^k head_dim
        bad = batch(kv_lens=[5], num_q=1, num_heads=4, num_kv_heads=2, head_dim=24,
                    page_size=4)
        paged_attention(*bad.args(), scale=SCALE, ctx_len=bad.ctx_len, backend="pallas",
                        interpret=True)


def test_kernels_trace_under_jit_with_traced_layer():
    """The engine calls the kernels inside jit/scan with a traced layer."""
    b = batch(kv_lens=[12, 5], num_q=2, num_heads=4, num_kv_heads=2, head_dim=16,
              page_size=4, num_layers=3, layer=2)

    @jax.jit
    def over_layers(q, kc, vc, req, ent, qpos, lens):
        def step(carry, layer):
            o = paged_attention(q, kc, vc, layer, req, ent, qpos, lens, scale=SCALE,
                                ctx_len=b.ctx_len, backend="pallas", interpret=True)
            return carry, o
        return jax.lax.scan(step, 0, jnp.arange(3))[1]  # [L, R, Q, H, HD]

    args = b.args()
    outs = over_layers(*args[:3], *args[4:])
    assert_close(outs[2], run_ref(b), 1e-5)
