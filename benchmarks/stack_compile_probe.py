"""Why do stacked layer weights compile slowly? (issue 4; `stack_layer_weights`.)

On the H200 the first run of the Qwen3-8B programs took 6-7x longer with the layer
matrices stacked `[L, in, out]` (benchmarks/RESULTS.md, 2026-12-04). This compiles one
program, the dense forward (`dense_logits`), for both layouts and a few XLA options, one
subprocess each, with XLA's pass-pipeline log on, and reports the compile's wall time
against the time XLA's HLO passes report. What the passes do not account for is code
generation (LLVM, and on GPU the kernel and command-buffer emitters).

The lead it follows: XLA autotunes each distinct matmul fusion once. The 36 layers' matmuls
over per-layer weights are the same fusion 4 times over, but a static slice `w[i]` of a
stacked weight fused into the matmul makes 36 x 4 distinct fusions (their slice offsets
differ). So each variant also counts the optimized program's matmul kinds (Triton GEMM
fusions, cuBLAS calls, slice copies) and, with --run, times the forward on zero weights, so
that a compile option that helps the compile can be checked for what it costs the step.
Variants are a layout plus per-program XLA options (`compile(compiler_options=...)`).

    python benchmarks/stack_compile_probe.py --run --out stack_compile.json       # Qwen3-8B shapes (GPU)
    python benchmarks/stack_compile_probe.py --tiny --layers 36 --out x.json      # CPU
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, ensure_importable, print_table  # noqa: E402

PASS_TIME = re.compile(r"HLO pass: (\S+) time: (\d+) us")
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}
DYNAMIC_SLICE_FUSION = {"xla_gpu_enable_dynamic_slice_fusion": True}
# name -> (layout, compiler options); the GPU options are unknown to XLA:CPU.
VARIANTS = {
    "per_layer": ("per_layer", {}),
    "stacked": ("stacked", {}),
    "per_layer_no_triton_gemm": ("per_layer", NO_TRITON_GEMM),
    "stacked_no_triton_gemm": ("stacked", NO_TRITON_GEMM),
    "stacked_dynamic_slice_fusion": ("stacked", DYNAMIC_SLICE_FUSION),
    "stacked_no_triton_gemm_dsf": ("stacked", {**NO_TRITON_GEMM, **DYNAMIC_SLICE_FUSION}),
    "stacked_autotune_off": ("stacked", {"xla_gpu_autotune_level": 0}),
    # Each layer's slice as a dynamic index from a runtime array (`layer_ids`), so the 36
    # layers' matmul fusions are one fusion (same HLO, other operand values) and XLA could
    # autotune it once, if its Triton GEMM takes a dynamic-slice operand in place.
    "stacked_dynamic": ("stacked_dynamic", {}),
    # Groups of G consecutive layers, `[G, in, out]` (stack_layers(group_size=G)): layer i's
    # slice offset is i % G, so there are G x 4 distinct matmul fusions to autotune, not 36 x 4.
    "grouped4": ("grouped4", {}),
    "grouped12": ("grouped12", {}),
    # cuBLAS's classic API instead of cuBLASLt (its own kernels for one-row matmuls).
    "stacked_cublas": ("stacked", {**NO_TRITON_GEMM, "xla_gpu_enable_cublaslt": False}),
    "per_layer_cublas": ("per_layer", {**NO_TRITON_GEMM, "xla_gpu_enable_cublaslt": False}),
}
# Substrings of the optimized HLO that tell how its matmuls run.
HLO_MARKERS = {"triton_gemm": '"kind":"__triton_gemm"', "cublas": '"__cublas$gemm"', "cublaslt": '"__cublas$lt$matmul"',
               "dynamic_address": "dynamic_address_computation", "address": '"kind":"__custom_fusion"',
               "dot_ops": " dot(", "slice_fusions": "slice_fusion",
               "triton_any": "__triton", "dynamic_slices": " dynamic-slice("}


def child(args) -> None:
    ensure_importable()
    import jax
    import jax.numpy as jnp

    from jaxoverlap.models.config import ModelConfig
    from jaxoverlap.models.loader import dummy_params
    from jaxoverlap.models.params import stack_layers
    from jaxoverlap.models.transformer import dense_logits

    hf = dict(QWEN3_8B)
    if args.tiny:
        hf.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  vocab_size=512)
    hf["num_hidden_layers"] = args.layers or hf["num_hidden_layers"]
    cfg = ModelConfig.from_hf_dict(hf)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    # Shapes only: nothing runs, so no weights need to exist.
    layout, options = VARIANTS[args.variant]
    params = jax.eval_shape(lambda: dummy_params(cfg, dtype, 0))
    if layout.startswith("grouped"):
        params = jax.eval_shape(lambda p: stack_layers(p, group_size=int(layout[len("grouped"):])), params)
    elif layout != "per_layer":
        params = jax.eval_shape(stack_layers, params)
    ids = jax.ShapeDtypeStruct((args.tokens,), jnp.int32)
    forward_fn, extra = dense_logits, ()
    if layout == "stacked_dynamic":
        forward_fn = jax.jit(dynamic_index_logits, static_argnames=("cfg",))
        extra = (jnp.arange(cfg.num_layers, dtype=jnp.int32),)
    lowered = forward_fn.lower(params, *extra, cfg=cfg, token_ids=ids)
    print("COMPILE-START", flush=True, file=sys.stderr)
    t = time.perf_counter()
    compiled = lowered.compile(compiler_options=options or None)
    result = {"variant": args.variant, "layout": layout, "options": options, "compile_s": time.perf_counter() - t,
              "weight_leaves": len(jax.tree.leaves(params)), "backend": jax.default_backend()}
    text = compiled.as_text()
    result.update({k: text.count(m) for k, m in HLO_MARKERS.items()})
    if args.run:
        # Zero weights: a matmul's time does not depend on the values.
        weights = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), params)
        x = jnp.zeros((args.tokens,), jnp.int32)
        jax.block_until_ready(compiled(weights, *extra, token_ids=x))
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            jax.block_until_ready(compiled(weights, *extra, token_ids=x))
            times.append(time.perf_counter() - t)
        result["forward_ms"] = sorted(times)[len(times) // 2] * 1e3
    print("RESULT " + json.dumps(result), flush=True)


def dynamic_index_logits(params, layer_ids, cfg, token_ids):
    """dense_logits over stacked weights whose layer i is read as `w[layer_ids[i]]`, a
    dynamic index (layer_ids [L] int32 is a runtime argument, so XLA cannot fold it)."""
    import dataclasses

    from jax import lax

    from jaxoverlap.models.params import MATRICES
    from jaxoverlap.models.transformer import dense_logits

    st = params.layers

    def layer(i):  # [L, in, out] -> [in, out]
        return dataclasses.replace(st, **{n: lax.dynamic_index_in_dim(getattr(st, n), layer_ids[i], keepdims=False)
                                          for n in MATRICES})

    layers = tuple(layer(i) for i in range(cfg.num_layers))
    return dense_logits.__wrapped__(dataclasses.replace(params, layers=layers), cfg, token_ids)


def pass_times(stderr: str) -> collections.Counter:
    """Seconds per HLO pass, summed over the compile (after COMPILE-START)."""
    tot: collections.Counter = collections.Counter()
    started = False
    for line in stderr.splitlines():
        if "COMPILE-START" in line:
            started = True
        m = PASS_TIME.search(line)
        if m and started:
            tot[m.group(1)] += int(m.group(2)) / 1e6
    return tot


def autotune_lines(stderr: str) -> dict:
    """How many of XLA's autotuner log lines the compile wrote (after COMPILE-START), and the
    first few: a count that follows the number of fusions autotuned."""
    lines = stderr.split("COMPILE-START", 1)[-1].splitlines()
    hits = [line for line in lines if "utotun" in line]
    return {"autotune_log_lines": len(hits), "autotune_examples": [h[-200:] for h in hits[:3]]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="small widths (CPU)")
    ap.add_argument("--layers", type=int, default=None, help="default: the model's 36")
    ap.add_argument("--tokens", type=int, default=32, help="the forward's rows (a decode batch's matmul shapes)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--run", action="store_true", help="also time the forward (allocates the weights)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--timeout-s", type=int, default=400, help="per variant")
    ap.add_argument("--out", default="stack_compile.json")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--variant", default="per_layer")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    for variant in args.variants:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--variant", variant, "--tokens", str(args.tokens),
               "--iters", str(args.iters)]
        for flag in ("tiny", "run"):
            if getattr(args, flag):
                cmd.append("--" + flag)
        if args.layers:
            cmd += ["--layers", str(args.layers)]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="hlo_pass_pipeline=1,gemm_fusion_autotuner=1")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            print(f"{variant}: timed out after {args.timeout_s} s", flush=True)
            rows.append({"variant": variant, "timed_out_s": args.timeout_s})
            continue
        result = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if not result:
            print(f"{variant}: no result (rc {proc.returncode})\n{proc.stderr[-2000:]}", flush=True)
            rows.append({"variant": variant, "error": proc.stderr[-600:]})
            continue
        passes = pass_times(proc.stderr)
        row = dict(result[0], **autotune_lines(proc.stderr), hlo_passes_s=sum(passes.values()),
                   top_passes={k: round(v, 3) for k, v in passes.most_common(8)})
        row["outside_passes_s"] = row["compile_s"] - row["hlo_passes_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    done = [r for r in rows if "compile_s" in r]
    if done:
        print_table(done, ["variant", "backend", "weight_leaves", "compile_s", "hlo_passes_s", "outside_passes_s",
                           "forward_ms", "autotune_log_lines", *HLO_MARKERS])


if __name__ == "__main__":
    main()
