"""The mixture-of-experts MLP's ways of computing the experts (models/moe.py), timed on
Qwen3-30B-A3B's layer shapes for decode and prefill token counts: which plan is fastest at
which T, and how close each gets to the bytes of the experts the tokens reach.

    python benchmarks/moe_plan_bench.py --tokens 1 4 8 32 64 2048 --out moe_plans.json

Each timed call chains the MLP over `--layers` layers of distinct weights (more than the GPU's
cache holds), so every call reads its weights from memory. `floor_ms` is the bytes of the
experts the tokens reach in each layer (counted from the router's choice), the router and
nothing else, over the copy bandwidth. "auto" is the engine's choice with the Pallas attention
backend on one device (the expert-matmul kernel where it fits), "auto-xla" with the XLA
backend (no kernel). `--xla-flags` passes XLA flags (e.g. XLA:GPU's
dynamic-slice fusion for the "sliced" plan). "pallas" is the expert-matmul kernel
(pallas_kernels/expert_matmul.py). Prints a table and writes JSON; `--tiny` runs
small shapes on CPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256, 2048])
    ap.add_argument("--plans", nargs="+", default=["auto", "auto-xla", "dense", "grouped1", "grouped8", "grouped64",
                                                   "grouped128", "sliced", "pallas"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--max-sliced-assignments", type=int, default=64, help="skip 'sliced' above this T*k")
    ap.add_argument("--xla-flags", default="")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="moe_plan_bench.json")
    args = ap.parse_args()
    if args.xla_flags:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + args.xla_flags).strip()
    from common import QWEN3_30B_A3B, TINY_MOE, copy_bandwidth_gbs, ensure_importable, median, print_table, write_results

    ensure_importable()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxoverlap.models import moe
    from jaxoverlap.models.config import ModelConfig
    from jaxoverlap.models.loader import _dummy_layer

    cfg = ModelConfig.from_hf_dict(TINY_MOE if args.tiny else QWEN3_30B_A3B)
    D, F, E, k = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.experts_per_token
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    bw = copy_bandwidth_gbs(1 << 26 if args.tiny else 4 << 30)
    layers = [_dummy_layer(jax.random.key(i), cfg, dtype) for i in range(args.layers)]
    expert_bytes = 3 * D * F * jnp.dtype(dtype).itemsize
    print(f"device {jax.devices()[0].device_kind}; copy bandwidth {bw:.0f} GB/s; {args.layers} layers of "
          f"{E} experts x {expert_bytes / 1e6:.2f} MB; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)

    from jaxoverlap.pallas_kernels.attention import PallasAttention

    kernel_fn = PallasAttention(interpret=jax.default_backend() != "gpu").expert_matmul

    def parse(name: str):
        if name in ("auto", "auto-xla"):
            return None
        if name in ("dense", "sliced", "pallas"):
            return (name, 0)
        return ("grouped", int(name[len("grouped"):]))

    rows = []
    for T in args.tokens:
        h = jax.random.normal(jax.random.key(100 + T), (T, 1, D), jnp.float32).astype(dtype)
        # Experts reached per layer, from the router on this input (the chained h changes
        # little layer to layer for the count; each layer's own router decides).
        reached = [len(np.unique(np.asarray(moe.route(h[:, 0], lw.w_router, k, True)[1]))) for lw in layers]
        router_bytes = D * E * jnp.dtype(dtype).itemsize
        floor_ms = sum(r * expert_bytes + router_bytes for r in reached) / (bw * 1e9) * 1e3 / args.layers
        reference = None
        for name in args.plans:
            plan = parse(name)
            if plan and plan[0] == "sliced" and T * k > args.max_sliced_assignments:
                continue  # one matrix-vector product per assignment, unrolled: for a few tokens
            if plan and plan[0] == "pallas" and T * k > 2 * E:
                continue  # one expert matrix read per assignment: past 2E, twice "dense"'s bytes
            if plan and plan[0] == "grouped" and plan[1] > 1 and plan[1] > T * k:
                continue  # a block larger than all the rows
            if plan and plan[0] == "grouped" and (T * k) // plan[1] + min(E, T * k) > 2 * E:
                continue  # more than 2E blocks: copies of the experts' weights beyond any use

            kernel = None if name == "auto-xla" else kernel_fn

            def chain(h, layers, plan=plan, kernel=kernel):
                outs = []
                for lw in layers:
                    outs.append(moe.moe_mlp(h, lw, top_k=k, normalize=True, expert_matmul=kernel, force_plan=plan))
                return sum(outs)  # every layer's MLP on the same input: independent reads

            fn = jax.jit(chain)
            tc = time.perf_counter()
            out = jax.block_until_ready(fn(h, layers))
            compile_s = time.perf_counter() - tc
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(h, layers))
                times.append(time.perf_counter() - t0)
            ms = median(times) * 1e3 / args.layers
            out = np.asarray(out.astype(jnp.float32))
            if reference is None:
                reference = out
            err = float(np.abs(out - reference).max() / (np.abs(reference).max() + 1e-9))
            fits = moe.kernel_fits(kernel, layers[0].w_gate_up, layers[0].w_down)
            chosen = moe.plan(T, E, k, fits) if plan is None else plan
            rows.append({"tokens": T, "plan": name, "resolved": f"{chosen[0]}{chosen[1] or ''}",
                         "experts_reached": float(np.mean(reached)), "ms_per_layer": ms, "floor_ms": floor_ms,
                         "over_floor": ms / floor_ms, "compile_s": compile_s, "rel_err_vs_first": err})
            print_table(rows[-1:], ["tokens", "plan", "resolved", "experts_reached", "ms_per_layer", "floor_ms",
                                    "over_floor", "compile_s", "rel_err_vs_first"])
            write_results(args.out, args, rows, copy_bandwidth_gbs=bw, xla_flags=os.environ.get("XLA_FLAGS", ""))
    print("\nsummary")
    print_table(rows, ["tokens", "plan", "resolved", "experts_reached", "ms_per_layer", "floor_ms", "over_floor",
                       "compile_s", "rel_err_vs_first"])


if __name__ == "__main__":
    main()
