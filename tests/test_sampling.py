"""The device sampler: filters and the distribution it draws from."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxoverlap.sampling import sample

LOGITS = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32))
N = 20000


def draw(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, logits=LOGITS, n=N):
    b = jnp.broadcast_to(jnp.asarray(logits), (n, logits.shape[0]))
    full = lambda v, dt: jnp.full((n,), v, dt)  # noqa: E731
    toks, lps = jax.jit(sample)(b, full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
                                full(min_p, jnp.float32), jnp.arange(n, dtype=jnp.uint32), jnp.full((n,), 7, jnp.int32))
    return np.bincount(np.asarray(toks), minlength=logits.shape[0]) / n, np.asarray(lps), np.asarray(toks)


def test_greedy_rows_take_the_argmax_and_report_logprobs():
    freq, lps, toks = draw(temperature=0.0, n=8)
    assert (toks == 0).all()
    np.testing.assert_allclose(lps, np.log(0.4), rtol=1e-5)


def test_temperature_one_matches_the_distribution():
    freq, _, _ = draw()
    p = np.exp(LOGITS) / np.exp(LOGITS).sum()
    assert np.abs(freq - p).max() < 0.015


def test_temperature_sharpens():
    freq, _, _ = draw(temperature=0.5)
    p = np.exp(LOGITS / 0.5)
    p /= p.sum()
    assert np.abs(freq - p).max() < 0.015


def test_top_k_top_p_min_p_restrict_the_support_and_renormalize():
    freq, _, _ = draw(top_k=2)
    assert freq[2:].sum() == 0
    np.testing.assert_allclose(freq[:2], np.array([0.4, 0.25]) / 0.65, atol=0.015)
    # top_p=0.6: 0.4 + 0.25 reaches it, so the nucleus is the first two tokens.
    freq, _, _ = draw(top_p=0.6)
    assert freq[2:].sum() == 0 and freq[1] > 0.3
    freq, _, _ = draw(top_p=0.3)
    assert freq[0] == 1.0
    # min_p=0.3 keeps p >= 0.12: tokens 0, 1, 2.
    freq, _, _ = draw(min_p=0.3)
    assert freq[3:].sum() == 0 and freq[2] > 0.1


def test_same_seed_and_position_same_token():
    _, _, a = draw(n=64)
    _, _, b = draw(n=64)
    assert (a == b).all() and len(set(a.tolist())) > 1
