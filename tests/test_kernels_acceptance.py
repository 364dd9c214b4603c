"""Speculative acceptance: greedy and rejection sampling, jnp reference vs the
Pallas kernels (interpret mode), plus a statistical test that rejection
sampling reproduces the target distribution -- tight enough to fail for the
classic mistakes (residual = p instead of max(0, p - q), inverted ratio)."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from jaxoverlap.pallas_kernels import acceptance as acc

# ---------------------------------------------------------------------- greedy


def test_greedy_reference_cases():
    draft = jnp.array([[5, 6, 7], [5, 6, 7], [1, 2, 3], [5, 6, 7]])
    target = jnp.array([[5, 6, 7, 8],  # all accepted -> bonus 8
                        [5, 9, 7, 8],  # mismatch at 1 -> correction 9
                        [0, 2, 3, 4],  # mismatch at 0
                        [5, 6, 7, 8]])  # only 1 real draft -> target[1]
    tokens, emitted = acc.greedy_accept_ref(draft, target, jnp.array([3, 3, 3, 1]))
    np.testing.assert_array_equal(tokens, [[5, 6, 7, 8], [5, 9, -1, -1],
                                           [0, -1, -1, -1], [5, 6, -1, -1]])
    np.testing.assert_array_equal(emitted, [4, 2, 1, 2])


@pytest.mark.parametrize("k", [1, 5])
def test_greedy_kernel_matches_reference(k):
    b = 16
    kd, km, kn = jax.random.split(jax.random.key(k), 3)
    draft = jax.random.randint(kd, (b, k), 0, 50)
    # Targets equal the drafts except at random spots, so prefixes of every length occur.
    flip = jax.random.bernoulli(km, 0.25, (b, k + 1))
    target = jnp.where(flip, 99, jnp.pad(draft, ((0, 0), (0, 1)), constant_values=7))
    num_draft = jax.random.randint(kn, (b,), 0, k + 1)
    for nd in (None, num_draft) if k > 1 else (num_draft,):
        ref = acc.greedy_accept_ref(draft, target, nd)
        out = acc.greedy_accept_pallas(draft, target, nd, interpret=True)
        np.testing.assert_array_equal(out[0], ref[0])
        np.testing.assert_array_equal(out[1], ref[1])


# ------------------------------------------------------- rejection: kernel == ref


def _random_problem(seed, b, k, v, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 6)
    tp = jax.nn.softmax(2 * jax.random.normal(ks[0], (b, k + 1, v)), -1)
    dp = jax.nn.softmax(2 * jax.random.normal(ks[1], (b, k, v)), -1)
    # Make some targets sparse so zero-probability tokens and clamping occur.
    tp = jnp.where(jax.random.bernoulli(ks[5], 0.3, tp.shape), 0.0, tp)
    tp = tp / jnp.sum(tp, -1, keepdims=True)
    dt = jax.random.categorical(ks[2], jnp.log(dp))
    u = jax.random.uniform(ks[3], (b, k))
    su = jax.random.uniform(ks[4], (b,))
    nd = jnp.arange(b, dtype=jnp.int32) % (k + 1)
    return tp.astype(dtype), dp.astype(dtype), dt, u, su, nd


@pytest.mark.parametrize("k,v,chunk", [(4, 37, 8), (3, 64, 2048), (1, 50, 16)])
def test_rejection_kernel_matches_reference(k, v, chunk):
    """Multi-chunk with a ragged last chunk, one whole-vocab chunk, K = 1."""
    tp, dp, dt, u, su, nd = _random_problem(k * v, 12, k, v)
    for n in (None, nd) if chunk == 8 else (nd,):
        ref = acc.rejection_sample_ref(tp, dp, dt, u, su, n)
        out = acc.rejection_sample_pallas(tp, dp, dt, u, su, n, interpret=True, chunk=chunk)
        np.testing.assert_array_equal(out[0], ref[0])
        np.testing.assert_array_equal(out[1], ref[1])


def test_rejection_kernel_bf16_probs():
    tp, dp, dt, u, su, nd = _random_problem(3, 8, 2, 40, jnp.bfloat16)
    ref = acc.rejection_sample_ref(tp, dp, dt, u, su, nd)
    out = acc.rejection_sample(tp, dp, dt, u, su, nd, backend="pallas", interpret=True)
    np.testing.assert_array_equal(out[0], ref[0])
    np.testing.assert_array_equal(out[1], ref[1])


def test_rejection_output_structure():
    tp, dp, dt, u, su, nd = _random_problem(0, 64, 4, 20)
    tokens, emitted = map(np.asarray, acc.rejection_sample_ref(tp, dp, dt, u, su, nd))
    for row in range(64):
        a = emitted[row] - 1
        assert 0 <= a <= nd[row]
        np.testing.assert_array_equal(tokens[row, :a], np.asarray(dt)[row, :a])
        assert tokens[row, a] >= 0 and (tokens[row, a + 1:] == -1).all()
        # The final token never has zero target probability.
        assert np.asarray(tp)[row, a, tokens[row, a]] > 0


# --------------------------------------------- rejection: distribution is exact

V, K, N = 8, 3, 200_000
# Fixed per-position target p_j and draft q_j, chosen far apart (TV(p, q) ~ 0.4)
# so that a wrong residual or ratio visibly moves the output distribution.
P = np.array([[0.30, 0.05, 0.20, 0.02, 0.13, 0.10, 0.15, 0.05],
              [0.02, 0.40, 0.08, 0.10, 0.05, 0.25, 0.05, 0.05],
              [0.10, 0.10, 0.35, 0.05, 0.05, 0.05, 0.20, 0.10],
              [0.05, 0.05, 0.05, 0.40, 0.15, 0.10, 0.10, 0.10]])
Q = np.array([[0.05, 0.30, 0.05, 0.25, 0.05, 0.10, 0.05, 0.15],
              [0.20, 0.05, 0.30, 0.05, 0.20, 0.05, 0.10, 0.05],
              [0.30, 0.05, 0.05, 0.20, 0.10, 0.20, 0.05, 0.05]])
CHI2_CRIT = 40.52  # chi-square, 7 dof, p = 1e-6


def _tv_bound(p, n):
    """5 standard deviations per cell of the empirical TV distance of n
    samples from p (about 6x its expected value: ~0.013 at n = 2e5); every
    wrong variant below lands at TV > 0.1."""
    return 0.5 * float(np.sum(5 * np.sqrt(p * (1 - p) / n)))


def _sample(sampler, seed=0):
    """N i.i.d. speculative steps with fixed p/q; returns (tokens, emitted)."""
    kd, ks = jax.random.split(jax.random.key(seed))
    tp = jnp.broadcast_to(jnp.asarray(P, jnp.float32), (N, K + 1, V))
    dp = jnp.broadcast_to(jnp.asarray(Q, jnp.float32), (N, K, V))
    drafts = jax.random.categorical(kd, jnp.log(dp))  # x_j ~ q_j
    keys = jax.random.split(ks, N)  # one key per row, drawn through vmap
    return map(np.asarray, sampler(keys, tp, dp, drafts))


def _correct(keys, tp, dp, drafts):
    return acc.rejection_sample_with_key(keys, tp, dp, drafts)


def _wrong(mode):
    """The reference algorithm with one deliberate bug."""
    def sampler(keys, tp, dp, drafts):
        pair = jax.vmap(jax.random.split)(keys)
        u = jax.vmap(lambda kk: jax.random.uniform(kk, (K,)))(pair[:, 0])
        su = jax.vmap(lambda kk: jax.random.uniform(kk, ()))(pair[:, 1])
        px = jnp.take_along_axis(tp[:, :K], drafts[..., None], -1)[..., 0]
        qx = jnp.take_along_axis(dp, drafts[..., None], -1)[..., 0]
        ok = u * px < qx if mode == "inverted_ratio" else u * qx < px
        a = acc._leading_true(ok)
        rows = jnp.arange(N)
        p_a, q_a = tp[rows, a], dp[rows, jnp.minimum(a, K - 1)]
        if mode == "residual_is_p":
            w = p_a
        else:
            w = acc._residual_weights(p_a, q_a, a >= K)
        return acc._emit(drafts, a, acc.inverse_cdf(w, su)), a + 1
    return sampler


def _stats(tokens, emitted, pos):
    """(TV, TV bound, chi-square) of the token at `pos`, over the samples that
    reached it, against P[pos]."""
    x = tokens[emitted > pos, pos]
    counts = np.bincount(x, minlength=V)
    expected = P[pos] * x.size
    tv = 0.5 * np.abs(counts / x.size - P[pos]).sum()
    return tv, _tv_bound(P[pos], x.size), float(((counts - expected) ** 2 / expected).sum())


def _failures(tokens, emitted):
    """Positions whose token distribution fails the TV or the chi-square bound."""
    out = []
    for pos in range(K + 1):
        tv, bound, chi2 = _stats(tokens, emitted, pos)
        if tv >= bound or chi2 >= CHI2_CRIT:
            out.append((pos, tv, bound, chi2))
    return out


def test_rejection_sampling_preserves_target_distribution():
    tokens, emitted = _sample(_correct)
    assert _failures(tokens, emitted) == []
    # Acceptance length matches theory: P(accept j | reached j) = sum min(p_j, q_j).
    beta = np.minimum(P[:K], Q).sum(-1)
    expected_emitted = 1 + np.cumprod(beta).sum()
    assert abs(emitted.mean() - expected_emitted) < 0.01, (emitted.mean(), expected_emitted)


@pytest.mark.parametrize("mode", ["residual_is_p", "inverted_ratio"])
def test_statistical_bound_catches_wrong_variant(mode):
    tokens, emitted = _sample(_wrong(mode))
    failures = _failures(tokens, emitted)
    assert failures, "the bound did not catch a wrong sampler"
    # Not a marginal catch: TV lands several times over its bound.
    assert max(tv / bound for _, tv, bound, _ in failures) > 5, failures
