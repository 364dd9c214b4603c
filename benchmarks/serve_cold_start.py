#!/usr/bin/env python3
"""How long `jaxoverlap serve` takes to start, cold and from its persistent compilation
cache, and whether any request then still compiles (issue 4: cold compile; the server's
promise that `--precompile all` leaves nothing for a request to compile).

Each start runs the real command in a process group of its own, with one compilation cache
folder for all starts (the first start fills it, the next ones load from it). Once the
server says it is serving, a mixed workload goes through it: greedy and sampled requests,
prompts of several lengths, `--concurrency` in flight, so that it meets decode buckets of
both kinds and several prefill shapes. The server's Prometheus counters before and after
say how many launches compiled (or loaded) a program meanwhile. Then a SIGINT stops it.
Prints a table per start, writes JSON.

    python benchmarks/serve_cold_start.py --starts 2 --out serve_cold_start.json   # Qwen3-8B shapes, dummy weights (GPU)
    python benchmarks/serve_cold_start.py --tiny --starts 1 --out /tmp/c.json      # CPU smoke run
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, model_dir, print_table, write_results  # noqa: E402

COMPILING = "jaxoverlap_engine_compiling_launches_total"
COMPILING_S = "jaxoverlap_engine_compiling_launch_seconds_total"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r"^(jaxoverlap_\S+) (\S+)$", text, re.M)}


def start_server(cmd: list[str], log_path: str, timeout_s: float):
    """(process, gRPC target, seconds until it served) of one `jaxoverlap serve`."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with open(log_path) as log:
            for line in log:
                if line.startswith("serving on "):
                    return proc, line.split()[2], time.perf_counter() - t0
        time.sleep(0.2)
    code = proc.poll()
    stop_server(proc)
    why = f"exited with code {code}" if code is not None else f"did not start within {timeout_s:.0f} s"
    with open(log_path) as log:
        raise RuntimeError(f"the server {why}:\n{log.read()[-4000:]}")


def stop_server(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the server drains, the engine stops
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def workload(target: str, args, vocab: int, seed: int) -> dict:
    """The mixed requests, `--concurrency` at a time. Returns counts and the wall time."""
    import numpy as np

    from jaxoverlap.server.client import GenerationClient

    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(8, args.max_prompt_len + 1, args.num_prompts)]

    def one(i: int):
        prompt = [int(t) for t in rng.integers(100, vocab, lengths[i])]
        sampling = dict(temperature=0.8, top_p=0.95, seed=i) if i % 2 else dict(temperature=0.0)
        if args.top_logprobs and i % 4 < 2:  # a greedy and a sampled request in every four
            sampling.update(logprobs=True, top_logprobs=5)
        with GenerationClient(target, timeout=args.timeout_s) as client:
            res = client.generate_text(prompt, max_new_tokens=args.output_len, ignore_eos=True, **sampling)
        return res.completion_tokens

    t = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        tokens = list(pool.map(one, range(args.num_prompts)))
    return {"requests": len(tokens), "output_tokens": sum(tokens), "workload_s": time.perf_counter() - t}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--starts", type=int, default=2, help="server starts in turn, one cache folder for all")
    ap.add_argument("--precompile", default="all", choices=("auto", "on", "all", "off"))
    ap.add_argument("--max-running-requests", type=int, default=None, help="default 32 (--tiny: smaller)")
    ap.add_argument("--max-prefill-requests", type=int, default=8)
    ap.add_argument("--max-prefill-rows", type=int, default=None,
                    help="default: one per 32 tokens of the chunk budget (EngineConfig.prefill_rows)")
    ap.add_argument("--chunked-prefill-size", type=int, default=None, help="default 2048 (--tiny: smaller)")
    ap.add_argument("--max-context-len", type=int, default=None, help="default 4096 (--tiny: smaller)")
    ap.add_argument("--num-prompts", type=int, default=None, help="default 64 (--tiny: smaller)")
    ap.add_argument("--max-prompt-len", type=int, default=None, help="default 1024 (--tiny: smaller)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--cache-dir", default=None, help="compilation cache folder (default: a new temporary one)")
    ap.add_argument("--timeout-s", type=float, default=900, help="per start, and per request")
    ap.add_argument("--top-logprobs", action="store_true",
                    help="the server precompiles the top-logprobs programs and half the requests ask for them")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and small buckets (CPU smoke run)")
    ap.add_argument("--keep-logs", default=None, help="copy each start's server log into this folder")
    ap.add_argument("--out", default="serve_cold_start.json")
    args = ap.parse_args()
    # Options not given take these defaults; --tiny's buckets are small because XLA:CPU runs
    # out of memory mappings for every program of the large ones (runner.PrecompileLimitError).
    defaults = dict(max_running_requests=32, chunked_prefill_size=2048, max_context_len=4096, num_prompts=64,
                    max_prompt_len=1024)
    if args.tiny:
        defaults.update(max_running_requests=8, chunked_prefill_size=128, max_context_len=512, num_prompts=16,
                        max_prompt_len=300)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    ensure_importable()

    config = TINY if args.tiny else QWEN3_8B
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="jaxoverlap_cold_start_cache_")
    log_dir = tempfile.mkdtemp(prefix="jaxoverlap_cold_start_logs_")
    rows = []
    try:
        for start in range(args.starts):
            entries_before = len(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else 0
            metrics_port = free_port()
            cmd = [sys.executable, "-m", "jaxoverlap.cli", "serve", "--port", "0", "--metrics-port", str(metrics_port),
                   "--model", model_dir(config), "--load-format", "dummy", "--dtype", "bfloat16",
                   "--precompile", args.precompile, "--compilation-cache-dir", cache_dir,
                   "--max-running-requests", str(args.max_running_requests),
                   "--max-prefill-requests", str(args.max_prefill_requests),
                   "--chunked-prefill-size", str(args.chunked_prefill_size),
                   "--max-context-len", str(args.max_context_len),
                   "--kv-cache-tokens", str(args.max_running_requests * (args.max_prompt_len + args.output_len + 64))]
            if args.max_prefill_rows is not None:
                cmd += ["--max-prefill-rows", str(args.max_prefill_rows)]
            if args.top_logprobs:
                cmd.append("--precompile-top-logprobs")
            log_path = os.path.join(log_dir, f"serve_{start}.log")
            proc, target, ready_s = start_server(cmd, log_path, args.timeout_s)
            try:
                before = scrape(metrics_port)
                res = workload(target, args, config["vocab_size"], seed=start)
                after = scrape(metrics_port)
            finally:
                stop_server(proc)
            with open(log_path) as log:
                text = log.read()
            compiled = re.search(r"compiled (\d+) programs in ([\d.]+) s", text)
            if args.keep_logs:
                os.makedirs(args.keep_logs, exist_ok=True)
                shutil.copy(log_path, args.keep_logs)
            row = {"start": start, "cache_entries_before": entries_before, "ready_s": ready_s,
                   "precompiled_programs": int(compiled[1]) if compiled else None,
                   "precompile_s": float(compiled[2]) if compiled else None, **res,
                   "compiling_launches_at_start": before.get(COMPILING),
                   "compiling_launches_in_workload": after.get(COMPILING, 0) - before.get(COMPILING, 0),
                   "compiling_launch_s_in_workload": after.get(COMPILING_S, 0) - before.get(COMPILING_S, 0),
                   # JAX's own lines, where JAX_DEBUG_LOG_MODULES=jax._src.compiler turns them on
                   "persistent_cache_hits": text.count("Persistent compilation cache hit"),
                   "persistent_cache_misses": text.count("PERSISTENT COMPILATION CACHE MISS")}
            rows.append(row)
            print_table([row], list(row))
            write_results(args.out, args, rows)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
        if args.cache_dir is None:
            shutil.rmtree(cache_dir, ignore_errors=True)
    print("\nsummary")
    print_table(rows, ["start", "cache_entries_before", "ready_s", "precompiled_programs", "precompile_s", "requests",
                       "output_tokens", "compiling_launches_in_workload", "compiling_launch_s_in_workload"])


if __name__ == "__main__":
    main()
