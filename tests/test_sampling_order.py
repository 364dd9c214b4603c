"""The order of the sampling filters, as vLLM's sampler (and HF's warpers) apply them:
temperature, then min_p (relative to the most likely token of the full distribution), then
top_k, then top_p on the mass those left, renormalized; the first token always kept. The
plain sampler draws from that distribution, and the speculative verifier's filtered_probs
(its p and q) is exactly it, so speculative sampling stays distribution-preserving."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxoverlap.sampling import sample
from jaxoverlap.speculative.verify import SamplingRows, filtered_probs

N = 20000


def vllm_filtered(logits, temperature, top_k, top_p, min_p) -> np.ndarray:
    """The filtered distribution in float64, one filter at a time on what the one before left."""
    x = np.asarray(logits, np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    if min_p > 0:
        x = np.where(p < min_p * p.max(), -np.inf, x)
    if top_k > 0:
        x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)  # vLLM's rule: below the k-th value
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros(p.shape, bool)
    keep[order[before < top_p]] = True
    keep[order[0]] = True
    p = np.where(keep, p, 0.0)
    return p / p.sum()


# (logits, temperature, top_k, top_p, min_p, the distribution where written out by hand)
DECREASING = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
E = np.exp(0.1)
CASES = {
    # top_k=3 leaves 1.0, 0.9, 0.8 (renormalized 0.367, 0.332, 0.301): top_p=0.6 keeps two.
    "top_k then top_p": (DECREASING, 1.0, 3, 0.6, 0.0, [E / (E + 1), 1 / (E + 1), 0, 0, 0, 0, 0, 0]),
    # top_k=2 leaves two tokens of about half the mass each: top_p=0.5 keeps the first.
    "top_k=2 top_p=0.5": ([2.0, 2.0, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9], 1.0, 2, 0.5, 0.0, [1, 0, 0, 0, 0, 0, 0, 0]),
    # top_k=2 keeps every token tied with the second (vLLM and HF compare against its value).
    "top_k keeps ties": ([3.0, 2.0, 2.0, 2.0, 1.0, 0.0, 0.0, 0.0], 1.0, 2, 1.0, 0.0,
                         [E ** 10 / (E ** 10 + 3), 1 / (E ** 10 + 3), 1 / (E ** 10 + 3), 1 / (E ** 10 + 3), 0, 0, 0, 0]),
    # min_p=0.8 keeps p >= 0.8 p_max (1.0, 0.9, 0.8: e^-0.2 = 0.82), as top_k=3 above: top_p=0.5 keeps two.
    "min_p then top_p": (DECREASING, 1.0, 0, 0.5, 0.8, [E / (E + 1), 1 / (E + 1), 0, 0, 0, 0, 0, 0]),
    "min_p then top_k then top_p": ([3.0, 2.8, 2.6, 2.0, 1.0, 0.5, -1.0, -2.0], 0.8, 3, 0.7, 0.2, None),
    "all three, temperature 2": ([0.3, 2.0, -1.0, 1.7, 1.5, 0.0, 1.6, -0.5], 2.0, 5, 0.75, 0.6, None),
}


def _rows(n, temperature, top_k, top_p, min_p) -> SamplingRows:
    full = lambda v, dt: jnp.full((n,), v, dt)  # noqa: E731
    return SamplingRows(full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
                        full(min_p, jnp.float32), jnp.arange(n, dtype=jnp.uint32))


@pytest.mark.parametrize("name", CASES)
def test_verifier_filtered_probs_is_the_vllm_order_distribution(name):
    logits, temperature, top_k, top_p, min_p, by_hand = CASES[name]
    want = vllm_filtered(logits, temperature, top_k, top_p, min_p)
    if by_hand is not None:
        np.testing.assert_allclose(want, by_hand, atol=1e-12)
    got = np.asarray(filtered_probs(jnp.asarray([logits], jnp.float32), _rows(1, temperature, top_k, top_p, min_p)))[0]
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("name", CASES)
def test_sampler_draws_the_vllm_order_distribution(name):
    """Many seeded draws through sample(): the frequencies are within sampling noise of the
    distribution (the old rule, top_p on the full distribution, is off by 0.2 or more in
    total variation in the first three cases)."""
    logits, temperature, top_k, top_p, min_p, _ = CASES[name]
    want = vllm_filtered(logits, temperature, top_k, top_p, min_p)
    V = len(logits)
    sp = _rows(N, temperature, top_k, top_p, min_p)
    toks, _ = jax.jit(sample)(jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (N, V)), sp.temperature, sp.top_k,
                              sp.top_p, sp.min_p, sp.seed, jnp.full((N,), 7, jnp.int32))
    freq = np.bincount(np.asarray(toks), minlength=V) / N
    assert freq[want == 0].sum() == 0, (freq, want)
    assert 0.5 * np.abs(freq - want).sum() < 0.02, (freq, want)


def test_top_p_one_keeps_the_whole_tail():
    """top_p=1 (off) keeps every token: in float32 the cumulative mass before a tail token
    of a large vocabulary rounds up to 1, which a plain `mass_before < top_p` would drop."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((2, 32000)) * np.array([[3.0], [0.1]])).astype(np.float32)
    p = np.asarray(filtered_probs(jnp.asarray(logits), _rows(2, 1.0, 0, 1.0, 0.0)))
    assert (p > 0).all()
    z = logits.astype(np.float64)
    want = np.exp(z - z.max(axis=1, keepdims=True))
    np.testing.assert_allclose(p, want / want.sum(axis=1, keepdims=True), rtol=1e-3)
