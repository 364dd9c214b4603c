"""Synthetic paged-cache batches for the kernel tests and the GPU benchmark.

Builds caches, req_to_token and batch arrays exactly as the engine lays them
out: page 0 is the dummy page, each request owns whole pages drawn at random
(non-contiguous), and req_to_token[e, p*ps:(p+1)*ps] = page*ps + arange(ps).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp


@dataclasses.dataclass
class PagedBatch:
    q: jax.Array  # [R, Q, H, HD]
    k_cache: jax.Array  # [L, num_slots, KVH, HD]
    v_cache: jax.Array  # [L, num_slots, KVH, HD]
    layer: int
    req_to_token: jax.Array  # [max_running + 1, max_context] int32
    entries: jax.Array  # [R] int32
    q_positions: jax.Array  # [R, Q] int32
    kv_lens: jax.Array  # [R] int32
    ctx_len: int

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.layer, self.req_to_token,
                self.entries, self.q_positions, self.kv_lens)


def make_paged_batch(*, kv_lens, num_q: int, num_heads: int, num_kv_heads: int,
                     head_dim: int, page_size: int, ctx_len: int | None = None,
                     num_layers: int = 2, layer: int = 1, dtype=jnp.float32,
                     seed: int = 0, extra_pages: int = 3, pad_positions: str = "zero",
                     padded_rows: int = 0, nan_dummy_page: bool = False) -> PagedBatch:
    """A batch of len(kv_lens) real rows plus `padded_rows` empty rows.

    Real row r has kv_lens[r] cached positions; its num_q queries sit at the
    last num_q positions (a chunk / window / decode token); if kv_lens[r] <
    num_q, the trailing queries are padding with positions per pad_positions
    ("zero" or "garbage": large random values the kernels must tolerate).
    Padded rows use entry 0 and kv_len 0. nan_dummy_page fills page 0 with NaN,
    so a kernel that reads it for padding positions produces NaN.
    """
    rng = np.random.default_rng(seed)
    kv_lens = [int(x) for x in kv_lens]
    max_len = max(kv_lens + [1])
    ctx_len = ctx_len or max_len
    max_context = -(-ctx_len // page_size) * page_size  # table width in whole pages
    pages_per_req = [-(-n // page_size) for n in kv_lens]
    num_pages = 1 + sum(pages_per_req) + extra_pages  # + dummy page 0 + unused
    perm = rng.permutation(np.arange(1, num_pages))  # random, non-contiguous pages

    n_real = len(kv_lens)
    req_to_token = np.zeros((n_real + 2, max_context), np.int32)  # row 0 = dummy
    used = 0
    entries = []
    for r, n_pages in enumerate(pages_per_req):
        e = r + 2  # leave entry 1 unused so entries != batch index
        pages = perm[used:used + n_pages]
        used += n_pages
        slots = (pages[:, None] * page_size + np.arange(page_size)[None, :]).reshape(-1)
        req_to_token[e, :slots.size] = slots
        entries.append(e)

    # numpy, not jax.random: that compiles once per shape (~1 s each on CPU), which would
    # dominate the interpreted kernel tests.
    num_slots = num_pages * page_size
    cache_shape = (num_layers, num_slots, num_kv_heads, head_dim)
    k_cache = rng.standard_normal(cache_shape, np.float32)
    v_cache = rng.standard_normal(cache_shape, np.float32)
    if nan_dummy_page:
        k_cache[:, :page_size] = np.nan
        v_cache[:, :page_size] = np.nan
    k_cache, v_cache = jnp.asarray(k_cache, dtype), jnp.asarray(v_cache, dtype)

    R = n_real + padded_rows
    q = jnp.asarray(rng.standard_normal((R, num_q, num_heads, head_dim), np.float32), dtype)
    qpos = np.zeros((R, num_q), np.int32)
    for r, n in enumerate(kv_lens):
        n_real_q = min(num_q, n)  # real queries first, padding after
        qpos[r, :n_real_q] = np.arange(n - n_real_q, n)
        if pad_positions == "garbage":
            qpos[r, n_real_q:] = rng.integers(0, 10 * max_context + 7, size=num_q - n_real_q)
    lens = np.array(kv_lens + [0] * padded_rows, np.int32)
    ent = np.array(entries + [0] * padded_rows, np.int32)
    return PagedBatch(q, k_cache, v_cache, layer, jnp.asarray(req_to_token),
                      jnp.asarray(ent), jnp.asarray(qpos), jnp.asarray(lens), ctx_len)
