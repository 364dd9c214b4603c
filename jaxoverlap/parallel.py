"""Tensor parallelism over a `jax.sharding.Mesh` with one axis, "tp".

Weights and the KV cache get `NamedSharding`s and XLA's SPMD partitioner inserts the
collectives; the jitted steps, the relay, `req_to_token` and both loops are unchanged (the
relay and the table are small and replicated, so every device reads its own copy).

| array | sharding |
|---|---|
| wqkv, w_gate_up, lm_head (`[in, out]`) | output axis over "tp" (column parallel) |
| wo, w_down | input axis over "tp" (row parallel; XLA all-reduces the output) |
| k_cache, v_cache `[L, S, KVH, HD]` | KV heads over "tp" |
| everything else | replicated |

An axis that does not divide by the mesh size stays replicated. One process drives every
local device. For several hosts, start each process with `jax.distributed.initialize()`
(JAX's own runtime) before building the engine; `jax.devices()` then lists every host's
devices, and `make_mesh` takes the first `tensor_parallel_size` of them.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxoverlap.models.params import LayerParams, ModelParams

AXIS = "tp"


def make_mesh(tp: int) -> Mesh:
    devices = jax.devices()
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} but only {len(devices)} devices are visible")
    return Mesh(np.array(devices[:tp]), (AXIS,))


def _put(x, mesh: Mesh, axis: int | None):
    if x is None:
        return None
    spec = [None] * x.ndim
    if axis is not None and x.shape[axis] % mesh.size == 0:
        spec[axis] = AXIS
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def shard_params(params: ModelParams, mesh: Mesh) -> ModelParams:
    layers = tuple(
        LayerParams(wqkv=_put(l.wqkv, mesh, 1), wo=_put(l.wo, mesh, 0),
                    w_gate_up=_put(l.w_gate_up, mesh, 1), w_down=_put(l.w_down, mesh, 0))
        for l in params.layers
    )
    return dataclasses.replace(
        params, layers=layers, lm_head=_put(params.lm_head, mesh, 1), bqkv=_put(params.bqkv, mesh, 1),
        embed=_put(params.embed, mesh, None), final_norm=_put(params.final_norm, mesh, None),
        attn_norm=_put(params.attn_norm, mesh, None), mlp_norm=_put(params.mlp_norm, mesh, None),
        q_norm=_put(params.q_norm, mesh, None), k_norm=_put(params.k_norm, mesh, None),
    )


def replicate(tree, mesh: Mesh):
    return jax.tree.map(lambda x: _put(x, mesh, None), tree)


def shard_state(state, mesh: Mesh):
    """KV heads of the target's cache over "tp"; the relay, table and drafter state replicated."""
    state = replicate(state, mesh)
    return dataclasses.replace(state, k_cache=_put(state.k_cache, mesh, 2), v_cache=_put(state.v_cache, mesh, 2))
