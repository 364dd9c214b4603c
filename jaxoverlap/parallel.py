"""Tensor parallelism over a `jax.sharding.Mesh` with one axis, "tp".

Weights and the KV cache get `NamedSharding`s and XLA's SPMD partitioner inserts the
collectives; the jitted steps, the relay, `req_to_token` and both loops are unchanged (the
relay and the table are small and replicated, so every device reads its own copy).

| array | sharding |
|---|---|
| wqkv, w_gate_up (`[in, out]`, per-shard column blocks) | output axis over "tp" (column parallel) |
| lm_head `[D, V]` | output axis over "tp" (column parallel) |
| wo, w_down | input axis over "tp" (row parallel; XLA all-reduces the output) |
| MoE experts' w_gate_up `[E, D, 2F]`, w_down `[E, F, D]` | as a dense MLP's: F over "tp" in every expert |
| shared expert's w_shared_gate_up `[D, 2Fs]`, w_shared_down `[Fs, D]` (Qwen2-MoE) | as a dense MLP's: Fs over "tp" |
| k_cache, v_cache `[L, S, KVH, HD]` | KV heads over "tp" |
| draft_k_cache, draft_v_cache `[Ld, S, KVHd, HDd]` | with the Pallas kernels (under shard_map, split on heads): KV heads over "tp"; else replicated |
| penalty history `[E, V]` | with lm_head split: the vocabulary over "tp", as the logits it meets; else replicated |
| everything else (drafter weights too) | replicated |

Every step returns the state in the layout it came in (`StateSharding`, steps.keep_layout):
left alone, XLA may hand an array back split as the computation that wrote it (the history
as the logits, a drafter cache as shard_map's heads), and then a program compiled ahead for
the first layout refuses the next call's state. The layouts above are chosen to be the ones
those computations give, so that keeping them need not move data.

wqkv (and bqkv) and w_gate_up store their fused output axis as one contiguous block per
device, [q | k | v heads of that device] and [gate | up columns of that device]
(models/params.py), so splitting q/k/v and gate/up is local: per layer, the only
collectives are the all-reduces after wo and w_down (and a shared expert's down
projection, whose partial sums join the experts'; its [D, 1] output gate is replicated, so
every device computes the whole gate). The loader writes that layout when
given `tensor_parallel_size`, and given `param_shardings` it makes each weight in place on
its devices (no device ever holds a whole split weight); `shard_params` places and converts
weights that arrive otherwise.

An axis that does not divide by the mesh size stays replicated. When H or KVH does not
divide by it, wqkv keeps the plain [q | k | v] order (its axis is still sharded where it
divides, at the price of the data movement above), and so does w_gate_up when F does not.

Attention: the XLA gather path is partitioned by XLA like the rest. The Pallas kernels are
custom calls that XLA cannot partition, so `shard_attention` runs them per device under
`shard_map`, each on its own q heads and KV heads (heads whose counts do not divide by the
mesh size run replicated: every device computes all of them).

One process drives every local device. For several hosts, start each process with
`jax.distributed.initialize()` (JAX's own runtime) before building the engine;
`jax.devices()` then lists every host's devices, and `make_mesh` takes the first
`tensor_parallel_size` of them.
"""
from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxoverlap.models.config import ModelConfig
from jaxoverlap.models.params import LayerParams, ModelParams, relayout
from jaxoverlap.models.quant import Fp8Weight

AXIS = "tp"


def make_mesh(tp: int) -> Mesh:
    devices = jax.devices()
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} but only {len(devices)} devices are visible")
    return Mesh(np.array(devices[:tp]), (AXIS,))


def _sharding(x, mesh: Mesh, axis: int | None) -> NamedSharding:
    """`axis` of x (an array or its shape struct) over "tp" where the mesh divides it, else whole."""
    spec = [None] * len(x.shape)
    if axis is not None and x.shape[axis] % mesh.size == 0:
        spec[axis] = AXIS
    return NamedSharding(mesh, P(*spec))


def _put(x, mesh: Mesh, axis: int | None):
    return None if x is None else jax.device_put(x, _sharding(x, mesh, axis))


def param_shardings(params: ModelParams, mesh: Mesh) -> ModelParams:
    """The `NamedSharding` of each weight of `params` (arrays, or shape structs such as
    loader.abstract_params gives) on `mesh`: the module's table, as a ModelParams of
    shardings (None where a weight is None)."""
    def split(x, axis):
        if isinstance(x, Fp8Weight):  # the 8-bit matrix as the weight; its scales [.., out] as its output axis
            out_split = axis == len(x.shape) - 1
            return Fp8Weight(_sharding(x.q, mesh, axis),
                             _sharding(x.scale, mesh, x.scale.ndim - 1 if out_split else None))
        return None if x is None else _sharding(x, mesh, axis)

    def layer(l: LayerParams) -> LayerParams:
        # Counted from the end: stacked layers ([L or G, ...]) and experts ([E, ...]) lead.
        def last(x):
            return None if x is None else len(x.shape) - 1

        def first(x):  # the input axis of a [.., in, out] matrix
            return None if x is None else len(x.shape) - 2

        return dataclasses.replace(l, wqkv=split(l.wqkv, last(l.wqkv)), wo=split(l.wo, first(l.wo)),
                                   w_gate_up=split(l.w_gate_up, last(l.w_gate_up)),
                                   w_down=split(l.w_down, first(l.w_down)), w_router=split(l.w_router, None),
                                   w_shared_gate_up=split(l.w_shared_gate_up, last(l.w_shared_gate_up)),
                                   w_shared_down=split(l.w_shared_down, first(l.w_shared_down)),
                                   w_shared_gate=split(l.w_shared_gate, None))

    stacked = isinstance(params.layers, LayerParams)
    return dataclasses.replace(
        params, layers=layer(params.layers) if stacked else tuple(layer(l) for l in params.layers),
        lm_head=split(params.lm_head, 1), bqkv=split(params.bqkv, 1),
        embed=split(params.embed, None), final_norm=split(params.final_norm, None),
        attn_norm=split(params.attn_norm, None), mlp_norm=split(params.mlp_norm, None),
        q_norm=split(params.q_norm, None), k_norm=split(params.k_norm, None),
        kv_scales=split(params.kv_scales, None),
    )


def shard_params(params: ModelParams, mesh: Mesh, cfg: ModelConfig | None = None) -> ModelParams:
    """The target's weights on the mesh. With `cfg`, fused columns in another layout than
    the mesh's (e.g. weights loaded for one device) are converted first. Weights the loader
    already placed (load_params' `shardings`) are returned as they are."""
    if cfg is not None:
        params = relayout(params, cfg, mesh.size)
    return jax.device_put(params, param_shardings(params, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of an array that every device of `mesh` holds whole."""
    return NamedSharding(mesh, P())


def replicate(tree, mesh: Mesh):
    return jax.tree.map(lambda x: _put(x, mesh, None), tree)


def state_shardings(state, mesh: Mesh, *, vocab_split: bool = False, draft_heads_split: bool = False):
    """The sharding of each array of a device state (or of its shapes, jax.eval_shape): KV
    heads of the target's cache over "tp"; with `draft_heads_split` the drafter's cache too,
    with `vocab_split` the penalty history's vocabulary; the rest replicated (the module's
    table). An axis the mesh does not divide stays whole."""
    out = jax.tree.map(lambda x: _sharding(x, mesh, None), state)
    out = dataclasses.replace(out, k_cache=_sharding(state.k_cache, mesh, 2), v_cache=_sharding(state.v_cache, mesh, 2))
    if draft_heads_split and state.draft_k_cache is not None:
        out = dataclasses.replace(out, draft_k_cache=_sharding(state.draft_k_cache, mesh, 2),
                                  draft_v_cache=_sharding(state.draft_v_cache, mesh, 2))
    if vocab_split and state.penalty is not None:
        out = dataclasses.replace(out, penalty=dataclasses.replace(
            out.penalty, history=_sharding(state.penalty.history, mesh, 1)))
    return out


def init_state_sharded(init, mesh: Mesh, **layout):
    """The state `init()` builds, made in place on the mesh: no device ever holds a whole
    array that is split (a KV cache sized for every device's memory would not fit on one)."""
    shapes = jax.eval_shape(init)
    return jax.jit(init, out_shardings=state_shardings(shapes, mesh, **layout))()


def local_size(n: int, mesh_size: int) -> int:
    """What one device holds of an axis of n: n / mesh_size where that divides, else all."""
    return n // mesh_size if n % mesh_size == 0 else n


class StateSharding:
    """The layout of a device state made by `init_state_sharded`: called inside a step on the
    state it returns, it constrains every array to its layout. The steps take it as a static
    argument, compared by identity: one per engine."""

    def __init__(self, state):
        self.shardings = jax.tree.map(lambda x: x.sharding, state)

    def __call__(self, state):
        return jax.lax.with_sharding_constraint(state, self.shardings)


# ----------------------------------------------------------------------------------------
# Per-device attention kernels
# ----------------------------------------------------------------------------------------


def _shard_map(f, mesh: Mesh, in_specs, out_specs):
    # jax.shard_map (JAX >= 0.6) takes check_vma; the older experimental one, check_rep.
    # The check is off: pallas_call has no replication rule, and the replicated fallback's
    # output is replicated by construction.
    sm = getattr(jax, "shard_map", None)
    if sm is None:
        from jax.experimental.shard_map import shard_map as sm
    names = inspect.signature(sm).parameters
    check = {"check_vma": False} if "check_vma" in names else {"check_rep": False}
    return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **check)


def shard_attention(attention, mesh: Mesh):
    """`attention` (the signature of `reference.paged_attention_ref`) run on each device of
    `mesh` over its own heads: q [R, Q, H, HD] and the caches [L, S, KVH, HD] split on their
    head axes, the table, entries, positions and lengths replicated, the output [R, Q, H, HD]
    split like q. Device s gets q heads s*H/N .. and KV heads s*KVH/N ..: q head h reads KV
    head h // (H/KVH) as on one device, and those stay on the same device.

    When KVH does not divide by N (then state_shardings left the caches replicated), every
    device runs all heads on the replicated inputs. H always divides when KVH does.

    Call it once per (attention, mesh) and reuse the result: the steps take it as a static
    argument, so a new function object compiles every step again."""
    n = mesh.size

    def sharded(q, k_cache, v_cache, layer, req_to_token, entries, q_positions, kv_lens, *, scale, ctx_len):
        split = q.shape[2] % n == 0 and k_cache.shape[2] % n == 0
        heads = P(None, None, AXIS, None) if split else P()
        rep = P()

        def local(q, k_cache, v_cache, layer, req_to_token, entries, q_positions, kv_lens):
            return attention(q, k_cache, v_cache, layer, req_to_token, entries, q_positions, kv_lens,
                             scale=scale, ctx_len=ctx_len)

        fn = _shard_map(local, mesh, in_specs=(heads, heads, heads, rep, rep, rep, rep, rep), out_specs=heads)
        return fn(q, k_cache, v_cache, jnp.asarray(layer, jnp.int32), req_to_token, entries, q_positions, kv_lens)

    return sharded


def shard_fused_decode(fused, mesh: Mesh):
    """`pallas_kernels.fused_decode.fused_decode_attention` run on each device of `mesh` over
    its own heads. Needs the per-shard qkv layout (models/params.py) with N = mesh.size:
    then device s's contiguous block of the fused qkv axis is [its q | its k | its v], the
    one-shard layout of its H/N and KVH/N heads, and the caches are split on their KV heads.
    The output [R, H, HD] comes out split on heads, as `shard_attention`'s does."""
    n = mesh.size
    heads = P(None, None, AXIS, None)
    rep = P()

    def sharded(qkv, k_cache, v_cache, layer, req_to_token, entries, positions, kv_lens, slots, q_norm, k_norm,
                rope_freq, *, num_heads, num_kv_heads, kv_scales=None, **static):
        def local(qkv, k_cache, v_cache, layer, req_to_token, entries, positions, kv_lens, slots, *extra):
            qn, kn = extra[:2] if q_norm is not None else (None, None)  # Llama / Qwen2: no q/k norm
            scales = {} if kv_scales is None else {"kv_scales": extra[-1]}
            return fused(qkv, k_cache, v_cache, layer, req_to_token, entries, positions, kv_lens, slots, qn, kn,
                         rope_freq, num_heads=num_heads // n, num_kv_heads=num_kv_heads // n, **scales, **static)

        # Replicated: the q/k norms where the model has them, the cache scales where it has them.
        extra = (() if q_norm is None else (q_norm, k_norm)) + (() if kv_scales is None else (kv_scales,))
        fn = _shard_map(local, mesh, in_specs=(P(None, AXIS), heads, heads) + (rep,) * (6 + len(extra)),
                        out_specs=(P(None, AXIS, None), heads, heads))
        return fn(qkv, k_cache, v_cache, jnp.asarray(layer, jnp.int32), req_to_token, entries, positions, kv_lens,
                  slots, *extra)

    return sharded
