"""Why do stacked layer weights compile slowly? (issue 4; `stack_layer_weights`.)

On the H200 the first run of the Qwen3-8B programs took 6-7x longer with the layer
matrices stacked `[L, in, out]` (benchmarks/RESULTS.md, 2026-12-04). This compiles one
program, the dense forward (`dense_logits`) or a decode step, for both layouts, one
subprocess each, with XLA's pass-pipeline log on, and reports the compile's wall time
against the time XLA's HLO passes report. What the passes do not account for is code
generation (LLVM, and on GPU the kernel and command-buffer emitters).

    python benchmarks/stack_compile_probe.py --out stack_compile.json            # Qwen3-8B shapes (GPU)
    python benchmarks/stack_compile_probe.py --tiny --layers 36 --out x.json     # CPU
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
    params = jax.eval_shape(lambda: dummy_params(cfg, dtype, 0))
    if args.layout == "stacked":
        params = jax.eval_shape(stack_layers, params)
    ids = jax.ShapeDtypeStruct((args.tokens,), jnp.int32)
    lowered = dense_logits.lower(params, cfg, ids)
    print("COMPILE-START", flush=True, file=sys.stderr)
    t = time.perf_counter()
    lowered.compile()
    print("RESULT " + json.dumps({"layout": args.layout, "compile_s": time.perf_counter() - t,
                                  "weight_leaves": len(jax.tree.leaves(params)), "backend": jax.default_backend()}),
          flush=True)


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="small widths (CPU)")
    ap.add_argument("--layers", type=int, default=None, help="default: the model's 36")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--timeout-s", type=int, default=400, help="per layout")
    ap.add_argument("--out", default="stack_compile.json")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--layout", default="per_layer")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    for layout in ("per_layer", "stacked"):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--layout", layout, "--tokens", str(args.tokens)]
        if args.tiny:
            cmd.append("--tiny")
        if args.layers:
            cmd += ["--layers", str(args.layers)]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="hlo_pass_pipeline=1")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout_s)
        result = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if not result:
            print(f"{layout}: no result (rc {proc.returncode})\n{proc.stderr[-2000:]}", flush=True)
            continue
        passes = pass_times(proc.stderr)
        row = dict(result[0], hlo_passes_s=sum(passes.values()),
                   top_passes={k: round(v, 3) for k, v in passes.most_common(8)})
        row["outside_passes_s"] = row["compile_s"] - row["hlo_passes_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    if rows:
        print_table(rows, ["layout", "backend", "weight_leaves", "compile_s", "hlo_passes_s", "outside_passes_s"])


if __name__ == "__main__":
    main()
