"""Cold compile time of every decode program for Qwen3-8B shapes (issue 4: <= 60 s), and
the restart time with JAX's persistent compilation cache. `--model qwen3-30b-a3b` compiles
the mixture-of-experts model's programs instead.

    python benchmarks/compile_bench.py --threads 16 --out compile.json
    python benchmarks/compile_bench.py --server-set --threads 8 --phases cold   # what `serve --precompile all` compiles
    python benchmarks/compile_bench.py --tiny --max-context-len 256     # CPU smoke run

Two subprocesses share one fresh cache folder: "cold" builds the engine and times
`Engine.warmup()` (every batch bucket x every context bucket, greedy) with an empty cache;
"restart" does the same in a new process, which finds every program in the cache. A third
line, "serial", compiles one program alone, for the per-program cost. `--server-set` compiles
what `jaxoverlap serve --precompile all` does instead: the decode programs greedy and
sampled, and every prefill shape (with `--top-logprobs`, each program's top-logprobs variant;
with `--prompt-logprobs`, each prefill program's prompt-logprobs variant
too), so that `--threads` settles how many compile at once. The warm-up compiles
the programs and then runs each once: `warmup_s` holds those runs too, the per-program
`seconds` do not.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MODELS, git_commit, ensure_importable, model_dir, print_table  # noqa: E402



def child(args) -> dict:
    ensure_importable()
    import jax

    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine

    t = time.perf_counter()
    spec = {} if args.algo == "plain" else dict(speculative_algorithm=args.algo)
    engine = Engine(EngineConfig(
        model=model_dir(MODELS[args.model][1 if args.tiny else 0]), load_format="dummy",
        dtype="float32" if args.tiny else "bfloat16", max_running_requests=args.max_running_requests,
        max_context_len=args.max_context_len, kv_cache_tokens=args.max_running_requests * 512,
        chunked_prefill_size=args.chunked_prefill_size,
        compilation_cache_dir=args.cache_dir, layers_per_weight_stack=args.layers_per_weight_stack, **spec,
    ))
    build_s = time.perf_counter() - t
    r = engine.runner
    out = {"phase": args.phase, "jax": jax.__version__, "build_s": build_s, "threads": args.threads,
           "batch_buckets": list(r.batch_buckets), "ctx_buckets": list(r.ctx_buckets), "cpus": os.cpu_count()}
    if args.phase == "serial":
        t = time.perf_counter()
        rep = engine.warmup([r.batch_buckets[-1]], [r.ctx_buckets[-1]], threads=1)
        out.update(programs=1, warmup_s=time.perf_counter() - t, per_program=rep)
        return out
    t = time.perf_counter()
    server_set = dict(sampling=(False, True), prefill=True, top_logprobs=args.top_logprobs,
                      prompt_logprobs=args.prompt_logprobs) if args.server_set else {}
    rep = engine.warmup(threads=args.threads, **server_set)
    out.update(programs=len(rep), warmup_s=time.perf_counter() - t,
               max_program_s=max(x["seconds"] for x in rep), per_program=rep)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--algo", default="plain", choices=("plain", "eagle", "ngram", "ngram_device"))
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-8b",
                    help="qwen3-30b-a3b: the mixture-of-experts model (its prefill and decode plans differ)")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--max-context-len", type=int, default=4096)
    ap.add_argument("--chunked-prefill-size", type=int, default=2048)
    ap.add_argument("--server-set", action="store_true",
                    help="the programs of `serve --precompile all`: decode greedy and sampled, every prefill shape")
    ap.add_argument("--top-logprobs", action="store_true", help="with --server-set: the top-logprobs variants too")
    ap.add_argument("--prompt-logprobs", action="store_true",
                    help="with --server-set: each prefill program's prompt-logprobs variant too "
                         "(serve --precompile-prompt-logprobs)")
    ap.add_argument("--layers-per-weight-stack", type=int, default=None, help="default: the engine's")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--timeout-s", type=int, default=300, help="per phase")
    ap.add_argument("--out", default="compile.json")
    ap.add_argument("--phase", choices=("cold", "restart", "serial"))
    ap.add_argument("--cache-dir")
    ap.add_argument("--phases", nargs="+", default=["cold", "restart", "serial"], choices=("cold", "restart", "serial"))
    args = ap.parse_args()
    if (args.top_logprobs or args.prompt_logprobs) and not args.server_set:
        ap.error("--top-logprobs and --prompt-logprobs add to --server-set's programs: pass it too")
    if args.phase:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    cache = tempfile.mkdtemp(prefix="jaxoverlap-compile-cache-")
    rows, errors = [], {}
    for phase in args.phases:
        # "serial" gets its own empty cache: it measures one real compilation.
        d = cache if phase != "serial" else tempfile.mkdtemp(prefix="jaxoverlap-compile-cache-")
        cmd = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--cache-dir", d] + sys.argv[1:]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
            got = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
            if got:
                rows.append(json.loads(got[-1][7:]))
            else:
                errors[phase] = p.stderr[-3000:]
                print(p.stderr[-3000:], flush=True)
        except subprocess.TimeoutExpired:
            errors[phase] = f"timeout after {args.timeout_s} s"
        if phase == "cold":
            size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(cache) for f in fs)
            if rows:
                rows[-1]["cache_mb"] = size / 1e6
    shutil.rmtree(cache, ignore_errors=True)
    commit = git_commit()
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "commit": commit, "python": platform.python_version(), "rows": rows,
                   "errors": errors}, f, indent=1)
    print_table(rows, ["phase", "programs", "threads", "warmup_s", "max_program_s", "build_s", "cache_mb"])
    print(f"wrote {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
