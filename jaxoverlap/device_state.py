"""Everything that lives on the device between steps, as one pytree that every step donates.

| array | shape | written by | read by |
|---|---|---|---|
| k_cache, v_cache | [L, S, KVH, HD] | every step, before attention | every step |
| req_to_token | [E, W] | the prologue of the step after the host reserved pages | every step |
| relay.seq_lens | [E] | each step, right after its forward | the next step (positions, slots) |
| relay.tokens | [E] | each step (the sampled / bonus token) | the next step's input |
| relay.temperature ... seed | [E] | the prefill that admits a request | every step's sampler |

E = max_running_requests + 1: entry 0 belongs to no request, so padded rows read and write
it harmlessly. S = num_pages * page_size slots; page 0 is the dummy page that entry 0 and
padded tokens write to. Nothing here ever has to reach the host before the next step.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeviceState:
    k_cache: jax.Array
    v_cache: jax.Array
    req_to_token: jax.Array  # [E, W] int32 slot numbers; row 0 is all zeros (dummy page)
    relay: Relay


def init_device_state(*, num_layers, num_slots, num_kv_heads, head_dim, dtype, num_entries, table_width) -> DeviceState:
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
    )
    return DeviceState(
        k_cache=jnp.zeros(cache_shape, dtype),
        v_cache=jnp.zeros(cache_shape, dtype),
        req_to_token=jnp.zeros((E, table_width), jnp.int32),
        relay=relay,
    )


def kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
