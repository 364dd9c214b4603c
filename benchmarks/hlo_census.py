"""What a compiled decode program is made of: its library calls (cuBLAS, cuDNN), Triton
GEMM fusions, Pallas kernels and other fusions, counted in XLA's optimized HLO.

Why it matters for the launch: XLA records a decode program as one CUDA graph and records
it again when a buffer moves. A kernel node is re-recorded by setting its parameters;
a library call (a cuBLAS GEMM) is a traced command, which XLA records by capturing the
library call into a graph of its own, which costs much more.

    python benchmarks/hlo_census.py --algo ngram_device --batches 1 32
    XLA_FLAGS=--xla_gpu_cublas_fallback=false python benchmarks/hlo_census.py --algo plain --batches 32
    python benchmarks/hlo_census.py --tiny --algo plain --batches 4     # CPU smoke run
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, model_dir, print_table  # noqa: E402

CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
FUSION_KIND = re.compile(r'"kind":"([A-Za-z_]+)"')


def census(hlo: str) -> dict:
    """Counts of the entry computation's operations by what runs them."""
    calls = collections.Counter(CUSTOM_CALL.findall(hlo))
    kinds = collections.Counter(FUSION_KIND.findall(hlo))  # fusion backend kinds: __triton_gemm, ...
    out = {"cublas": sum(n for t, n in calls.items() if t.startswith("__cublas")),
           "cudnn": sum(n for t, n in calls.items() if t.startswith("__cudnn")),
           "triton_gemm_fusions": kinds.get("__triton_gemm", 0) + kinds.get("__triton_nested_gemm_fusion", 0),
           "pallas_or_triton_calls": sum(n for t, n in calls.items() if "triton" in t or "mosaic" in t),
           "fusions": len(re.findall(r"^\s*\S+ = \S+ fusion\(", hlo, re.M)),
           "custom_call_targets": dict(calls), "fusion_kinds": dict(kinds)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--algo", default="plain", choices=("plain", "eagle", "ngram", "ngram_device"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--ctx-len", type=int, default=256, help="the decode context bucket (XLA attention path)")
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--max-context-len", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.dtype = "float32"
    args.disable_by_batch_size, args.enable_prefix_cache, args.compilation_cache_dir = None, False, None
    ensure_importable()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxoverlap import steps
    from jaxoverlap.buckets import pick
    from jaxoverlap.models.config import ModelConfig
    from jaxoverlap.models.loader import dummy_params
    from spec_bench import make_engine

    hf = TINY if args.tiny else QWEN3_8B
    cfg = ModelConfig.from_hf_dict(hf)
    params = dummy_params(cfg, jnp.dtype(args.dtype), seed=0)
    rows = []
    for B in args.batches:
        args.batches = [B]  # make_engine sizes the engine from args.batches
        engine = make_engine(args, args.algo, "auto", model_dir(hf), cfg, params)
        r = engine.runner
        ctx = pick(r.decode_ctx_buckets, args.ctx_len)  # the Pallas kernels: one program for every length
        host = None
        if r.spec is not None and r.spec.host_drafts:
            from jaxoverlap.speculative.step import HostDrafts

            host = HostDrafts(np.zeros((B, r.spec.num_draft), np.int32), np.zeros((B,), np.int32))
        inputs = jax.device_put(steps.DecodeInputs.empty(B, r._decode_res_capacity(B)))
        step, a, static = r._decode_program(inputs, host, ctx, False, True)
        t = time.perf_counter()
        hlo = step.lower(*a, **static).compile().as_text()
        c = census(hlo)
        rows.append({"algo": args.algo, "batch": B, "ctx_len": ctx, "compile_s": time.perf_counter() - t,
                     **{k: v for k, v in c.items() if not isinstance(v, dict)}, "detail": c})
        print_table(rows[-1:], [k for k in rows[-1] if k != "detail"])
        print("custom calls:", c["custom_call_targets"], "\nfusion kinds:", c["fusion_kinds"], flush=True)
        del engine
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"xla_flags": os.environ.get("XLA_FLAGS", ""), "device": jax.devices()[0].device_kind,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
