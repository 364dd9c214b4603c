"""The mixture-of-experts MLP of Qwen3-MoE, Mixtral and Qwen2-MoE, in XLA ops with static shapes.

Routing, as the HF reference computes it: router logits in the model's dtype, a float32
softmax over all experts, the top k experts of each token, their probabilities renormalized
to sum to 1 where the config says so (`norm_topk_prob`; always for Mixtral), cast back to the
model's dtype. A token's MLP output is the sum of its k experts' SwiGLU outputs, each times
its weight. Qwen2-MoE adds a shared expert: a dense SwiGLU MLP that every token runs, its
output times sigmoid(x @ w_shared_gate) (a [D, 1] gate), added to the routed experts' sum.

How the experts are computed depends on the static shape of the program (`plan`), since XLA
needs static shapes and the cheapest way differs between a decode step and a prefill chunk:

- "dense": every expert on every token, weighted by a [T, E] matrix that is zero outside
  each token's top k. Reads each expert's weights once and spends E/k times the needed
  matmul work: right for decode batches, whose T*k assignments reach most experts anyway,
  and for models with few experts per token chosen (Mixtral: E/k = 4).
- "grouped" with block size b: the T*k (token, expert) assignments sorted by expert; each
  expert's rows padded to a multiple of b and cut into blocks of b rows of one expert; each
  block gathers its expert's weights and the blocks run as one batched matmul. The matmul
  work is about the needed one; the weight traffic grows with the number of blocks (each
  block reads a copy of its expert's weights). b = 1 (a block per assignment, no padding)
  for a few tokens, where it reads only the chosen experts; b of one to two times T*k/E
  for long prefill chunks, which copies the experts' weights two or three times at most.

- "pallas": a row per assignment through the expert-matmul kernel
  (pallas_kernels/expert_matmul.py), which reads each chosen expert's block of weights in
  place instead of gathering a copy. Where the attention backend has the kernel (the Pallas
  backend on one device) and the T*k assignments are at most E: it then reads at most as
  many expert matrices as "dense" and no copies (measured 4.6x / 2.0x / 1.26x faster than
  the XLA plans at 1 / 8 / 16 tokens of Qwen3-30B-A3B on an H100; at 32 tokens, past E
  assignments, 6% slower than "dense": benchmarks/RESULTS.md).

`plan` picks by a cost model (bytes moved and matmul work); "sliced" is an alternative for a
few tokens that benchmarks/moe_plan_bench.py times, not chosen by `plan`.

jax.lax.ragged_dot would express the grouped matmul directly, but XLA:GPU lowers it to a
dense matmul over every group (as of JAX 0.10/0.11 on NVIDIA GPUs), so it would be the
"dense" plan at a higher cost.

Under tensor parallelism the experts' MLP width F is split like a dense MLP's (parallel.py):
`w_gate_up [E, D, 2F]` keeps per-shard [gate | up] blocks on its last axis. So is a shared
expert's width; its [D, 1] gate is replicated (every device computes the same gate).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxoverlap.models.quant import Fp8Weight, batched_linear, index, linear, take

# The plan is the cheapest by a cost model of a layer: bytes moved over the bandwidth plus
# matmul work over the matmul rate, in units where only their ratio matters. An H200 does
# about 600 TFLOP/s of bf16 matmul against 4.2 TB/s of memory bandwidth: 150 FLOP per byte.
# (Both plans' bytes and FLOPs scale with an expert's D x F, so the choice depends only on
# T, E, k and this ratio.) A model until measured per shape: benchmarks/moe_plan_bench.py.
MATMUL_FLOPS_PER_BYTE = 150.0
BYTES_PER_WEIGHT = 2  # bf16
MAX_BLOCK = 4096


def _cost(tokens: int, experts: int, top_k: int, kind: str, block: int) -> float:
    """A plan's time for one layer, in units of (one expert's D x 3F weights) x 1 byte / bandwidth."""
    if kind == "dense":
        moved, rows = experts, tokens * experts  # every expert read once; every token on every expert
    else:
        # Each block gathers a copy of its expert (read, written, read by the matmul).
        n_blocks = _blocks(tokens * top_k, experts, block)
        moved, rows = 3 * n_blocks, n_blocks * block
    return BYTES_PER_WEIGHT * moved + 2 * rows / MATMUL_FLOPS_PER_BYTE


def _blocks(assignments: int, experts: int, block: int) -> int:
    """Static bound on the grouped plan's blocks: each used expert (at most min(E, T*k))
    pads fewer than b rows; none with b = 1."""
    return assignments if block == 1 else -(-assignments // block) + min(experts, assignments)


def plan(tokens: int, experts: int, top_k: int, kernel: bool = False) -> tuple[str, int]:
    """("pallas", 0), ("dense", 0) or ("grouped", b) for a program of `tokens` tokens.
    With the expert-matmul `kernel` at hand, "pallas" for at most `experts` assignments (it
    reads one expert matrix per assignment, "dense" all E once). Otherwise the cheapest by
    `_cost` (module docstring), over b in 1, 2, 4, .. MAX_BLOCK."""
    if kernel and tokens * top_k <= experts:
        return ("pallas", 0)
    options = [("dense", 0)]
    block = 1
    while block <= min(MAX_BLOCK, 2 * tokens * top_k):
        options.append(("grouped", block))
        block *= 2
    return min(options, key=lambda o: _cost(tokens, experts, top_k, *o))


def activation_bytes(tokens: int, experts: int, top_k: int, hidden: int, width: int, itemsize: int) -> int:
    """About the bytes of the MoE MLP's temporaries in one layer of a `tokens`-token program
    under its plan: the [E, T, ..] intermediates of "dense", the gathered expert weights and
    rows of "grouped". For memory sizing (the engine keeps this free of the KV cache): for
    prefill chunks it is several GB on Qwen3-30B-A3B, more than the dense models' headroom.
    A shared expert's temporaries ([T, 2Fs], [T, Fs]) are those of a dense MLP of its width,
    which the headroom kept for dense models covers (as it does their MLP's): not counted."""
    # Without the kernel's plan, whose temporaries (a few [T*k, D] rows) are the smallest:
    # the estimate then holds whichever backend runs the program.
    kind, block = plan(tokens, experts, top_k)
    if kind == "dense":
        # gate_up [E, T, 2F] and act [E, T, F] in the model dtype; x broadcast [E, T, D]; out [E, T, D] f32.
        return experts * tokens * (3 * width * itemsize + hidden * (itemsize + 4))
    n_blocks = _blocks(tokens * top_k, experts, block)
    rows = n_blocks * block
    weights = n_blocks * 3 * hidden * width * itemsize  # the gathered [D, 2F] and [F, D] copies
    return weights + rows * (hidden + 3 * width) * itemsize + rows * hidden * 4


def route(x: jax.Array, w_router: jax.Array, top_k: int, normalize: bool):
    """x [T, D] -> (weights [T, k] in x's dtype, experts [T, k] int32), as the HF router."""
    logits = jnp.dot(x, w_router)  # [T, E], in the model's dtype as the reference's Linear
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    # [T, k]. Ties (equal probabilities, not rare in bf16) go to the lower expert id; torch's
    # topk leaves their order unspecified, so a tied token may take another expert than HF does.
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), experts.astype(jnp.int32)


def swiglu(gate_up: jax.Array, shards: int) -> jax.Array:
    """[..., 2F] in `shards` per-shard [gate | up] blocks -> silu(gate) * up [..., F]."""
    lead, two_f = gate_up.shape[:-1], gate_up.shape[-1]
    F = two_f // 2
    blocks = gate_up.reshape(*lead, shards, two_f // shards)  # [..., 2F] -> [..., N, 2F/N]
    gate = blocks[..., : F // shards].reshape(*lead, F)  # [..., N, F/N] -> [..., F], column s*F/N + j
    up = blocks[..., F // shards :].reshape(*lead, F)
    return jax.nn.silu(gate) * up


def swiglu_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, shards: int, fp8_matmul=None) -> jax.Array:
    """A dense SwiGLU MLP: x [..., D] -> [..., D] in x's dtype, with `w_gate_up [D, 2F]` in
    `shards` per-shard [gate | up] blocks and `w_down [F, D]`. A dense layer's MLP
    (transformer.gated_mlp) and a MoE layer's shared expert. Either matrix may be an FP8
    weight (models/quant.py), multiplied by the backend's `fp8_matmul` kernel where given."""
    return linear(swiglu(linear(x, w_gate_up, kernel=fp8_matmul), shards), w_down, kernel=fp8_matmul)


def _dense(x, weights, experts, w_gate_up, w_down, shards):
    T, D = x.shape
    E = w_gate_up.shape[0]
    # [T, E]: each token's weight for each expert, zero outside its top k.
    combine = jnp.zeros((T, E), x.dtype).at[jnp.arange(T)[:, None], experts].set(weights)
    # Matmuls batched over the experts, so that each reads its weights in their stored
    # layout: contracting x [T, D] with w [E, D, 2F] as one GEMM would first transpose every
    # expert's weights to [D, E, 2F], a copy of all of them per step.
    xe = jnp.broadcast_to(x, (E, T, D))  # [T, D] -> [E, T, D]
    act = swiglu(batched_linear("etd,edf->etf", xe, w_gate_up), shards)  # [E, T, F]
    act = act * combine.T[:, :, None]  # the weight before the down projection (it is linear)
    y = batched_linear("etf,efd->etd", act, w_down, preferred_element_type=jnp.float32)  # [E, T, D]
    return jnp.sum(y, axis=0)  # [T, D]


def _grouped(x, weights, experts, w_gate_up, w_down, shards, block: int):
    T, D = x.shape
    E = w_gate_up.shape[0]
    k = experts.shape[1]
    A = T * k  # assignments
    n_blocks = _blocks(A, E, block)
    flat_expert = experts.reshape(A)  # [T, k] -> [A]
    flat_token = jnp.arange(A, dtype=jnp.int32) // k
    flat_weight = weights.reshape(A)  # [T, k] -> [A]
    order = jnp.argsort(flat_expert, stable=True)
    sorted_expert = flat_expert[order]
    counts = jnp.zeros((E,), jnp.int32).at[flat_expert].add(1)  # rows per expert
    padded = -(-counts // block) * block  # each expert's rows rounded up to whole blocks
    start = jnp.cumsum(counts) - counts  # where each expert's rows start, sorted
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    # Row of each sorted assignment in the padded layout: its expert's first padded row plus
    # its rank among that expert's rows.
    row = padded_start[sorted_expert] + (jnp.arange(A, dtype=jnp.int32) - start[sorted_expert])
    rows = n_blocks * block
    # Padding rows read token T (a zero row) with weight 0.
    row_token = jnp.full((rows,), T, jnp.int32).at[row].set(flat_token[order])
    row_weight = jnp.zeros((rows,), x.dtype).at[row].set(flat_weight[order])
    # Each block's expert: the one whose padded rows hold the block's first row. Blocks past
    # the last used row take the last expert id (their rows are all padding).
    block_expert = jnp.searchsorted(padded_end, jnp.arange(n_blocks, dtype=jnp.int32) * block, side="right")
    block_expert = jnp.minimum(block_expert, E - 1)
    x_rows = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])[row_token]  # [rows, D]
    x_blocks = x_rows.reshape(n_blocks, block, D)  # [rows, D] -> [n_blocks, b, D]
    gate_up = batched_linear("nbd,ndf->nbf", x_blocks, take(w_gate_up, block_expert))  # [n_blocks, b, 2F]
    act = swiglu(gate_up, shards) * row_weight.reshape(n_blocks, block)[:, :, None]  # [rows] -> [n_blocks, b]
    y = batched_linear("nbf,nfd->nbd", act, take(w_down, block_expert), preferred_element_type=jnp.float32)
    y = y.reshape(rows, D)  # [n_blocks, b, D] -> [rows, D]
    # Padding rows land on the extra row T, dropped.
    return jnp.zeros((T + 1, D), jnp.float32).at[row_token].add(y)[:T]


def _sliced(x, weights, experts, w_gate_up, w_down, shards):
    """One matmul pair per assignment on its expert's weights, read through dynamic slices
    (which XLA:GPU can hand to the GEMM as an address, without a copy, where its
    dynamic-slice fusion applies). Unrolled over the T*k assignments: for a few tokens only."""
    T, D = x.shape
    k = experts.shape[1]
    out = []
    for t in range(T):
        y = jnp.zeros((D,), jnp.float32)
        for j in range(k):
            e = experts[t, j]
            w1 = index(w_gate_up, e)  # [D, 2F]
            w2 = index(w_down, e)  # [F, D]
            act = swiglu(linear(x[t], w1), shards) * weights[t, j]  # [F]
            y = y + linear(act, w2, preferred_element_type=jnp.float32)
        out.append(y)
    return jnp.stack(out)  # T x [D] -> [T, D]


def _default_expert_matmul(x, w, experts, out_dtype=None, scale=None):
    from jaxoverlap.pallas_kernels.expert_matmul import expert_matmul

    return expert_matmul(x, w, experts, interpret=jax.default_backend() != "gpu", out_dtype=out_dtype, scale=scale)


def kernel_fits(expert_matmul, w_gate_up: jax.Array, w_down: jax.Array) -> bool:
    """Whether the "pallas" plan can run: a kernel given (the Pallas attention backend on one
    device has it; a Pallas call is not partitioned by XLA, so none under a mesh) and the
    layer's shapes ones it takes. Not for 8-bit experts (models/quant.py): the kernel reads
    them (a forced "pallas" plan), but only interpreted so far, so the XLA plans serve them
    until a GPU run is recorded."""
    if expert_matmul is None or isinstance(w_gate_up, Fp8Weight):
        return False
    from jaxoverlap.pallas_kernels.expert_matmul import supported

    F, D = w_down.shape[1:]  # [E, F, D]
    return supported(D, w_gate_up.shape[-1]) and supported(F, D)


def _pallas(x, weights, experts, w_gate_up, w_down, shards, expert_matmul):
    """A row per assignment through `expert_matmul` (pallas_kernels/expert_matmul.py: row a
    times expert experts[a]'s matrix, read in place)."""
    T, D = x.shape
    k = experts.shape[1]
    A = T * k
    flat = experts.reshape(A)  # [T, k] -> [A]
    rows = jnp.repeat(x, k, axis=0)  # [A, D]: row a is token a // k

    def matmul(inputs, w, **kw):  # an 8-bit expert stack as its matrices and column scales
        if isinstance(w, Fp8Weight):
            return expert_matmul(inputs, w.q, flat, scale=w.scale, **kw)
        return expert_matmul(inputs, w, flat, **kw)

    act = swiglu(matmul(rows, w_gate_up), shards)  # [A, F]
    act = act * weights.reshape(A)[:, None]  # [T, k] -> [A]
    # float32 out, summed over the k experts before one rounding, as the XLA plans do.
    y = matmul(act, w_down, out_dtype=jnp.float32)  # [A, D]
    return y.reshape(T, k, D).sum(axis=1)  # [A, D] -> [T, k, D] -> [T, D]


def moe_mlp(h: jax.Array, lw, *, top_k: int, normalize: bool, expert_matmul=None,
            force_plan: tuple[str, int] | None = None, fp8_matmul=None) -> jax.Array:
    """The MoE MLP over h [R, Q, D] with layer weights `lw` (w_router [D, E], w_gate_up
    [E, D, 2F], w_down [E, F, D], and a shared expert's w_shared_gate_up [D, 2Fs],
    w_shared_down [Fs, D], w_shared_gate [D, 1] where it has one). `expert_matmul(x, w,
    experts)` is the attention backend's expert-matmul kernel, or None; `force_plan`
    overrides `plan` (tests, benchmarks; a forced "pallas" without a kernel runs
    pallas_kernels/expert_matmul.py); the shared expert runs the same under every plan
    (an 8-bit one through the backend's `fp8_matmul` where given).
    Returns [R, Q, D]."""
    R, Q, D = h.shape
    x = h.reshape(R * Q, D)  # [R, Q, D] -> [T, D]
    weights, experts = route(x, lw.w_router, top_k, normalize)
    kernel = kernel_fits(expert_matmul, lw.w_gate_up, lw.w_down)
    kind, block = force_plan or plan(R * Q, lw.w_gate_up.shape[0], top_k, kernel)
    if kind == "dense":
        out = _dense(x, weights, experts, lw.w_gate_up, lw.w_down, lw.gate_up_shards)
    elif kind == "pallas":
        out = _pallas(x, weights, experts, lw.w_gate_up, lw.w_down, lw.gate_up_shards,
                      expert_matmul or _default_expert_matmul)
    elif kind == "sliced":
        out = _sliced(x, weights, experts, lw.w_gate_up, lw.w_down, lw.gate_up_shards)
    else:
        out = _grouped(x, weights, experts, lw.w_gate_up, lw.w_down, lw.gate_up_shards, block)
    if lw.w_shared_gate_up is not None:
        # The shared expert and its gate in the model's dtype, as the reference computes them;
        # added to the routed sum in float32 (the reference adds the two after rounding each
        # to the model's dtype: one rounding less here, within bf16's noise of it).
        shared = swiglu_mlp(x, lw.w_shared_gate_up, lw.w_shared_down, lw.gate_up_shards, fp8_matmul)  # [T, D]
        gate = jax.nn.sigmoid(jnp.dot(x, lw.w_shared_gate))  # [T, 1]
        out = out + (gate * shared).astype(jnp.float32)
    return out.astype(h.dtype).reshape(R, Q, D)  # [T, D] -> [R, Q, D]
