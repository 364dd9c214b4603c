"""The on-device n-gram lookup against a plain Python reference."""
import numpy as np
import jax
import jax.numpy as jnp

from jaxoverlap.speculative import ngram_device


def reference(hist, L, k, lo, hi):
    """Most recent earlier occurrence of the longest trailing n-gram (n = hi .. lo) of
    hist[:L+1]; the drafts are the k tokens after it, the period L - j going on past L."""
    for n in range(hi, lo - 1, -1):
        if n > L + 1:
            continue
        tail = hist[L - n + 1 : L + 1]
        for j in range(L - 1, n - 2, -1):
            if hist[j - n + 1 : j + 1] == tail:
                return [hist[j + 1 + i % (L - j)] for i in range(k)]
    return []


def test_device_lookup_matches_reference():
    rng = np.random.default_rng(0)
    B, C, k, lo, hi = 16, 48, 3, 1, 3
    E, S = B + 1, (B + 1) * C
    req_to_token = np.zeros((E, C), np.int32)
    slot_tokens = np.zeros((S,), np.int32)
    entries = np.arange(1, B + 1, dtype=np.int32)
    lens = rng.integers(0, C - 1, B).astype(np.int32)
    hists = []
    for b, e in enumerate(entries):
        # Small alphabets and a periodic stretch, so matches of every length occur.
        h = [int(x) for x in rng.integers(0, 2 + b % 5, C)]
        if b % 3 == 0:
            h[5:25] = ([7, 8, 9] * 8)[:20]
        slots = rng.permutation(np.arange(e * C, (e + 1) * C)).astype(np.int32)  # scattered slots
        req_to_token[e] = slots
        slot_tokens[slots] = h
        hists.append(h)
    bonus = np.array([h[L] for h, L in zip(hists, lens)], np.int32)
    # Slot tokens past L are stale garbage on the device; the bonus comes from the relay.
    for e, L in zip(entries, lens):
        slot_tokens[req_to_token[e, L:]] = 99
    lookup = jax.jit(ngram_device.propose, static_argnames=("num_draft", "min_match", "max_match", "ctx_len"))
    drafts, counts = lookup(jnp.asarray(slot_tokens), jnp.asarray(req_to_token), entries=jnp.asarray(entries),
                            lens=jnp.asarray(lens), bonus=jnp.asarray(bonus), num_draft=k, min_match=lo,
                            max_match=hi, ctx_len=C)
    drafts, counts = np.asarray(drafts), np.asarray(counts)
    found = 0
    for b in range(B):
        want = reference(hists[b], int(lens[b]), k, lo, hi)
        assert counts[b] == len(want) and drafts[b, : counts[b]].tolist() == want, (b, want, drafts[b], counts[b])
        found += bool(want)
    assert found >= B // 2
    # Padded rows (entry 0) never draft.
    d0, c0 = lookup(jnp.asarray(slot_tokens), jnp.asarray(req_to_token), entries=jnp.zeros(2, jnp.int32),
                    lens=jnp.zeros(2, jnp.int32), bonus=jnp.zeros(2, jnp.int32), num_draft=k, min_match=lo,
                    max_match=hi, ctx_len=C)
    assert np.asarray(c0).tolist() == [0, 0]
    # A run of one token drafts k of it, a run of a pair continues the pair.
    for run, want in (([4, 5, 6] + [9] * 6, [9, 9, 9]), ([1] + [2, 3] * 4, [2, 3, 2])):
        slots = req_to_token[1]
        slot_tokens[slots[: len(run)]] = run
        L = len(run) - 1
        d, c = lookup(jnp.asarray(slot_tokens), jnp.asarray(req_to_token), entries=jnp.array([1], jnp.int32),
                      lens=jnp.array([L], jnp.int32), bonus=jnp.array([run[L]], jnp.int32), num_draft=k,
                      min_match=lo, max_match=hi, ctx_len=C)
        assert np.asarray(c).tolist() == [k] and np.asarray(d)[0].tolist() == want
