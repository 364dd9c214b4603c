"""Would a loop over layers make the host's launch short? (GPU diagnostics, issue 4.)

The host's launch of a decode step is mostly XLA launching the step's CUDA graph, whose
size follows the kernel count (~410 nodes for Qwen3-8B: 36 unrolled layers). A layer loop
(`lax.fori_loop` over weights stacked [L, ...]) would put one layer's kernels in the graph
once, if XLA can (a) keep the loop itself inside the graph (CUDA conditional nodes: the
WHILE command) and (b) read each layer's weight slice in place instead of copying it out
(design.md measured a copying scan at ~3x the bandwidth floor).

This probe times a decode-shaped chain without attention (per layer: RMS norm, the qkv,
o, gate_up and down matmuls of Qwen3-8B, SwiGLU, two residual adds) in both forms, in one
subprocess per XLA flag variant:

- period_ms: wall time per call of a run of async calls (the device-bound step time);
- dispatch_ms: how long a call takes to return while earlier calls still run;
- paced_dispatch_ms: the same call made as the engine makes it (launch N+1, block on N).

    python benchmarks/scan_probe.py --batches 1 32 --out scan.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, print_table, run_variant  # noqa: E402

BASE_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
VARIANTS = {
    "default": "",
    "while_cmd": f"--xla_gpu_enable_command_buffer={BASE_COMMANDS},WHILE,CONDITIONAL",
    "while_cmd_dsf": f"--xla_gpu_enable_command_buffer={BASE_COMMANDS},WHILE,CONDITIONAL,DYNAMIC_SLICE_FUSION "
                     "--xla_gpu_enable_dynamic_slice_fusion=true",
    "dsf": "--xla_gpu_enable_dynamic_slice_fusion=true",
}
QWEN3_8B = dict(layers=36, hidden=4096, qkv=6144, attn=4096, ffn=12288)
TINY = dict(layers=4, hidden=64, qkv=96, attn=64, ffn=128)


def child(args) -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    shape = TINY if args.tiny else QWEN3_8B
    L, D, QKV, A, F = (shape[k] for k in ("layers", "hidden", "qkv", "attn", "ffn"))
    dtype = jnp.float32 if args.tiny else jnp.bfloat16

    @jax.jit
    def make_weights(key):
        ks = jax.random.split(key, 4)
        scale = 0.02
        return {  # stacked [L, in, out]
            "wqkv": (jax.random.normal(ks[0], (L, D, QKV), jnp.float32) * scale).astype(dtype),
            "wo": (jax.random.normal(ks[1], (L, A, D), jnp.float32) * scale).astype(dtype),
            "wgu": (jax.random.normal(ks[2], (L, D, 2 * F), jnp.float32) * scale).astype(dtype),
            "wdown": (jax.random.normal(ks[3], (L, F, D), jnp.float32) * scale).astype(dtype),
        }

    W = make_weights(jax.random.PRNGKey(0))
    jax.block_until_ready(W)

    def rms(x):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)

    def layer(x, w):
        qkv = rms(x) @ w["wqkv"]  # [B, QKV]
        x = x + qkv[:, :A] @ w["wo"]  # the attention output stands in as q's part of qkv
        gu = rms(x) @ w["wgu"]  # [B, 2F]
        return x + (jax.nn.silu(gu[:, :F]) * gu[:, F:]) @ w["wdown"]

    @functools.partial(jax.jit, donate_argnums=(1,))
    def unrolled(W, x):
        for i in range(L):  # static slices of the stacked arrays: views, no copies
            x = layer(x, {k: v[i] for k, v in W.items()})
        return x

    @functools.partial(jax.jit, donate_argnums=(1,))
    def looped(W, x):
        return jax.lax.fori_loop(0, L, lambda i, x: layer(x, {k: v[i] for k, v in W.items()}), x)

    out = {"variant": args.variant, "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__,
           "weights_gb": sum(v.nbytes for v in W.values()) / 1e9, "rows": []}
    for B in args.batches:
        for name, fn in (("unrolled", unrolled), ("loop", looped)):
            x = jnp.ones((B, D), dtype)
            t = time.perf_counter()
            x = fn(W, x)
            jax.block_until_ready(x)
            compile_s = time.perf_counter() - t
            for _ in range(3):
                x = fn(W, x)
            jax.block_until_ready(x)
            ts = []
            t0 = time.perf_counter()
            for _ in range(args.iters):
                t = time.perf_counter()
                x = fn(W, x)
                ts.append(time.perf_counter() - t)
            jax.block_until_ready(x)
            period = (time.perf_counter() - t0) / args.iters
            # Paced as in the engine: launch N+1, then block on N's (small) result.
            prev = jnp.sum(x[:, :8])
            paced = []
            for _ in range(args.iters):
                t = time.perf_counter()
                x = fn(W, x)
                paced.append(time.perf_counter() - t)
                cur = jnp.sum(x[:, :8])
                np.asarray(prev)
                prev = cur
            jax.block_until_ready(x)
            row = {"batch": B, "form": name, "compile_s": compile_s, "period_ms": period * 1e3,
                   "dispatch_ms": median(ts[2:]) * 1e3, "paced_dispatch_ms": median(paced[2:]) * 1e3,
                   "checksum": float(jnp.sum(x.astype(jnp.float32)))}
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--timeout-s", type=int, default=150, help="per variant")
    ap.add_argument("--out", default="scan.json")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--variant", default="default")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    results = []
    for name in args.variants:
        child_args = ["--iters", str(args.iters), "--batches", *map(str, args.batches)] + (["--tiny"] if args.tiny else [])
        results.append(run_variant(__file__, name, VARIANTS[name], child_args, args.timeout_s)[0])
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    table = [dict(variant=r["variant"], **row) for r in results for row in r.get("rows", [])]
    if table:
        print_table(table, ["variant", "batch", "form", "compile_s", "period_ms", "dispatch_ms", "paced_dispatch_ms",
                            "checksum"])


if __name__ == "__main__":
    main()
