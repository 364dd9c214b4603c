"""Everything that lives on the device between steps, as one pytree that every step donates.

| array | shape | written by | read by |
|---|---|---|---|
| k_cache, v_cache | [L, S, KVH, HD] (model dtype or 8-bit) | every step, before attention | every step |
| req_to_token | [E, W] | the prologue of the step after the host reserved pages | every step |
| relay.seq_lens | [E] | each step, right after its forward | the next step (positions, slots) |
| relay.tokens | [E] | each step (the sampled / bonus token) | the next step's input |
| relay.temperature ... seed | [E] | the prefill that admits a request | every step's sampler |
| relay.draft_token, draft_hidden | [E], [E, D] | EAGLE: prefill and each step's draft extend | the next step's draft passes |
| relay.last_token | [E] | draft model: prefill and each step | the next step's first draft pass |
| draft_k_cache, draft_v_cache | [Ld, S, KVHd, HDd] | the drafter (EAGLE head or draft model) | the drafter |
| slot_tokens | [S] | ngram_device: prefill and each step | the next step's n-gram lookup |
| penalty.history, params, min_end, bias_* | [E, V], [E, 3], [E], [E, 64] | sampling programs (penalties.py) | sampling programs |

The speculative relay fields exist in every engine (zero-width when unused) so the relay
has one layout; the drafter's caches and `slot_tokens` are None without a drafter that
needs them, and `penalty` is None where the engine serves no penalties
(EngineConfig.enable_penalties off). The drafter's caches use the target's slot numbers
(`req_to_token`), so one page reservation covers both models.

E = max_running_requests + 1: entry 0 belongs to no request, so padded rows read and write
it harmlessly. S = num_pages * page_size slots; page 0 is the dummy page that entry 0 and
padded tokens write to. Nothing here ever has to reach the host before the next step.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxoverlap.penalties import PenaltyState, init_penalty_state


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Relay:
    seq_lens: jax.Array  # [E] int32: tokens with K/V in the cache
    tokens: jax.Array  # [E] int32: the next input token
    temperature: jax.Array  # [E] float32 (0 = greedy)
    top_k: jax.Array  # [E] int32 (0 = off)
    top_p: jax.Array  # [E] float32
    min_p: jax.Array  # [E] float32
    seed: jax.Array  # [E] uint32: the sampling key is fold_in(key(seed), position)
    draft_token: jax.Array  # [E] int32 EAGLE: first draft token of the next step (from draft extend)
    draft_hidden: jax.Array  # [E, D] EAGLE: the head's hidden state that produced draft_token ([E, 0] unused)
    last_token: jax.Array  # [E] int32 draft model: the token at seq_len - 1 (re-read by the first draft pass)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeviceState:
    k_cache: jax.Array
    v_cache: jax.Array
    req_to_token: jax.Array  # [E, W] int32 slot numbers; row 0 is all zeros (dummy page)
    relay: Relay
    draft_k_cache: jax.Array | None = None  # [Ld, S, KVHd, HDd] drafter's own KV under the same slots
    draft_v_cache: jax.Array | None = None
    # [S] int32 the token whose K/V each slot holds (ngram_device). Kept per slot, not per
    # entry, so a cached prefix brings its tokens along with its pages.
    slot_tokens: jax.Array | None = None
    # Penalties, logit_bias and min_new_tokens: per entry, the tokens seen, generated and
    # stopping, and the bias.
    penalty: PenaltyState | None = None


@dataclasses.dataclass(frozen=True)
class DrafterLayout:
    """Shapes of the drafter's device state (see speculative/setup.py)."""

    hidden_size: int = 0  # relay.draft_hidden width (EAGLE)
    cache_layers: int = 0  # draft_k_cache layers (EAGLE head: 1; draft model: its layers)
    cache_kv_heads: int = 0
    cache_head_dim: int = 0
    slot_tokens: bool = False


def init_device_state(
    *, num_layers, num_slots, num_kv_heads, head_dim, dtype, num_entries, table_width,
    drafter: DrafterLayout = DrafterLayout(), penalty_vocab_size: int = 0, cache_dtype=None,
) -> DeviceState:
    """dtype: the model's; cache_dtype: the target's KV cache's, by default the model's (an
    8-bit one: EngineConfig.kv_cache_dtype; the drafter's cache stays in the model's dtype).
    penalty_vocab_size: the vocabulary of the penalties' history rows; 0 for none."""
    E = num_entries
    cache_shape = (num_layers, num_slots, num_kv_heads, head_dim)
    relay = Relay(
        seq_lens=jnp.zeros((E,), jnp.int32),
        tokens=jnp.zeros((E,), jnp.int32),
        temperature=jnp.zeros((E,), jnp.float32),
        top_k=jnp.zeros((E,), jnp.int32),
        top_p=jnp.ones((E,), jnp.float32),
        min_p=jnp.zeros((E,), jnp.float32),
        seed=jnp.zeros((E,), jnp.uint32),
        draft_token=jnp.zeros((E,), jnp.int32),
        draft_hidden=jnp.zeros((E, drafter.hidden_size), dtype),
        last_token=jnp.zeros((E,), jnp.int32),
    )
    draft_cache = None
    if drafter.cache_layers:
        draft_cache = (drafter.cache_layers, num_slots, drafter.cache_kv_heads, drafter.cache_head_dim)
    return DeviceState(
        k_cache=jnp.zeros(cache_shape, cache_dtype or dtype),
        v_cache=jnp.zeros(cache_shape, cache_dtype or dtype),
        req_to_token=jnp.zeros((E, table_width), jnp.int32),
        relay=relay,
        draft_k_cache=jnp.zeros(draft_cache, dtype) if draft_cache else None,
        draft_v_cache=jnp.zeros(draft_cache, dtype) if draft_cache else None,
        slot_tokens=jnp.zeros((num_slots,), jnp.int32) if drafter.slot_tokens else None,
        penalty=init_penalty_state(E, penalty_vocab_size) if penalty_vocab_size else None,
    )


def kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
