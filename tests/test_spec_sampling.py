"""Rejection sampling end to end: through the engine's speculative steps, sampled tokens
follow the target's filtered distribution.

pallas_kernels' own test checks the acceptance rule on fixed p and q (and that its bound
catches a wrong residual or ratio). This one checks everything around it inside the step:
the drafter's q (a draft model whose distribution is flatter than the target's, so drafts
are often but not always accepted), temperature and top-k filtering of p and q, the keys,
the bonus and residual tokens, and the relay hand-over between steps. 512 requests share
a prompt and differ in their seed; the joint distribution of their first three tokens
(one from prefill, two from speculative steps) must match the target's.

Sensitivity, measured once by swapping in a broken acceptance rule: the correct rule gives
chi-square 8.4 here, a residual of p instead of max(0, p - q) gives 68, and the inverted
ratio q/p gives 1526, against the bound of 40.5.
"""
import dataclasses

import jax.numpy as jnp
import numpy as np

from engine_fixtures import run_workload, tiny_config, tiny_params
from jaxoverlap.config import EngineConfig
from jaxoverlap.engine import Engine
from jaxoverlap.models.transformer import dense_logits
from jaxoverlap.sampling_params import SamplingParams

PROMPT = [11, 42, 7, 3, 58, 20]
TEMPERATURE, TOP_K = 3.0, 2
ROWS, ROUNDS = 512, 8
CHI2_CRIT = 40.52  # chi-square, 7 dof (8 cells), p = 1e-6; the draws are seeded, so no flakes


def filtered(logits):
    """NumPy version of the target distribution: temperature, then top-k."""
    z = np.asarray(logits, np.float64) / TEMPERATURE
    keep = np.argsort(-z)[:TOP_K]
    p = np.zeros_like(z)
    p[keep] = np.exp(z[keep] - z[keep].max())
    return p / p.sum()


def expected_joint(params, cfg):
    """{(t0, t1, t2): probability} over the 8 top-2 paths."""
    out = {}
    p0 = filtered(dense_logits(params, cfg, jnp.asarray(PROMPT))[-1])
    for t0 in np.nonzero(p0)[0]:
        p1 = filtered(dense_logits(params, cfg, jnp.asarray(PROMPT + [int(t0)]))[-1])
        for t1 in np.nonzero(p1)[0]:
            p2 = filtered(dense_logits(params, cfg, jnp.asarray(PROMPT + [int(t0), int(t1)]))[-1])
            for t2 in np.nonzero(p2)[0]:
                out[(int(t0), int(t1), int(t2))] = p0[t0] * p1[t1] * p2[t2]
    return out


def test_speculative_sampling_preserves_target_distribution():
    cfg = tiny_config()
    target = tiny_params(cfg)
    # The draft: the target with a softened LM head, so q ranks tokens like p but is flatter.
    draft = dataclasses.replace(target, lm_head=target.lm_head * 0.1)  # q close to uniform on the top 2
    opts = dict(dtype="float32", page_size=16, max_running_requests=ROWS, batch_buckets=(ROWS,),
                max_prefill_requests=ROWS, chunked_prefill_size=4096, max_context_len=64,
                kv_cache_tokens=ROWS * 16 + 64, speculative_algorithm="draft_model", speculative_num_steps=3)
    eng = Engine(EngineConfig.from_options("/nonexistent-model", **opts), model_config=cfg, params=target,
                 draft_model_config=cfg, draft_params=draft)
    counts, total = {}, 0
    for r in range(ROUNDS):
        arrivals = {0: [(f"q{r}-{i}", PROMPT, SamplingParams(max_new_tokens=3, temperature=TEMPERATURE, top_k=TOP_K,
                                                             seed=r * ROWS + i, ignore_eos=True))
                        for i in range(ROWS)]}
        for out in run_workload(eng, arrivals).values():
            key = tuple(out.token_ids)
            counts[key] = counts.get(key, 0) + 1
            total += 1
    accept = eng.stats()["accept_length"]
    # Both outcomes of the accept test occur often: drafts are accepted and rejected.
    assert 1.3 < accept < 3.6, accept
    want = expected_joint(target, cfg)
    assert set(counts) <= set(want), f"tokens outside the top-{TOP_K} support: {set(counts) - set(want)}"
    chi2 = sum((counts.get(c, 0) - total * p) ** 2 / (total * p) for c, p in want.items())
    tv = 0.5 * sum(abs(counts.get(c, 0) / total - p) for c, p in want.items())
    assert chi2 < CHI2_CRIT, (chi2, tv, counts, want)
