#!/usr/bin/env python3
"""Does serving cost the overlap loop anything? The engine behind the gRPC server against the
engine alone, on the same workload, in one process.

The process holds the engine on its worker thread and the gRPC server on its event loop
thread, as `jaxoverlap serve` does; the client (`jaxoverlap bench`) runs in a child process.
The workload: `--num-prompts` requests of random token ids, `--input-len` in and
`--output-len` out (greedy, EOS ignored), at most `--concurrency` in flight. Variants, run in
turn A B C C B A so that drifts spread over all of them:

  offline     the engine's own loop on the worker thread, no server: requests added as
              earlier ones finish, `--concurrency` at a time;
  serve       through the server, Python's default GIL switch interval (5 ms);
  serve_si    through the server with `sys.setswitchinterval(--switch-interval)`: how long the
              engine's thread may wait for the GIL when the event loop holds it as the device
              finishes a step.
  serve_process  through a second server whose engine runs in a process of its own
              (EngineProcess, what `jaxoverlap serve` runs): no GIL shared with the server.
              Two engines are then built, one per process; each may take
              XLA_PYTHON_CLIENT_MEM_FRACTION of the GPU (set to 0.45 here unless given).
              The second loads the first one's programs from a shared persistent
              compilation cache (cold, the 38 programs of 32 streams took ~260 s on the H200).

Per run: output tokens/s over the run, and from the engine's loop totals (Engine.stats()
["loop"]) per decode iteration: host ms (prepare + launch + process), device wait ms, and
the share of overlap iterations that found the previous step already done (the device may
have waited for the host). Served runs add the client's TTFT and inter-token latency.

    python benchmarks/serve_overlap_bench.py --concurrency 32 --out serve_overlap.json      # Qwen3-8B, dummy
    python benchmarks/serve_overlap_bench.py --tiny --num-prompts 64 --out /tmp/s.json     # CPU smoke run
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, model_dir, print_table, write_results  # noqa: E402


def engine_loop_totals(engine) -> dict:
    return dataclasses.asdict(engine.loop_totals)


def loop_totals(worker) -> dict:
    return worker.call_sync(engine_loop_totals)


def per_decode(before: dict, after: dict) -> dict:
    """Host ms, device wait ms and host-bound share per decode iteration, as `jaxoverlap bench`
    reports them for a server."""
    from jaxoverlap.server.bench import engine_summary

    return engine_summary({k: after[k] - before[k] for k in after}) or {}


def run_offline(worker, args, seed: int) -> dict:
    """The workload in the engine's own loop, on the worker thread (between its steps)."""

    def work(engine):
        from jaxoverlap.sampling_params import SamplingParams

        rng = np.random.default_rng(seed)
        vocab = engine.model_config.vocab_size
        params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        prompts = [[int(t) for t in rng.integers(100, vocab, args.input_len)] for _ in range(args.num_prompts)]
        tokens, in_flight, next_prompt = 0, 0, 0
        t = time.perf_counter()
        while next_prompt < len(prompts) or engine.has_work():
            while next_prompt < len(prompts) and in_flight < args.concurrency:
                engine.add_request(f"off-{seed}-{next_prompt}", prompts[next_prompt], params)
                next_prompt, in_flight = next_prompt + 1, in_flight + 1
            for out in engine.step():
                tokens += len(out.new_token_ids)
                in_flight -= out.finished
        return tokens, time.perf_counter() - t

    before = loop_totals(worker)
    tokens, wall = worker.call_sync(work)
    return {"output_tok_s": tokens / wall, **per_decode(before, loop_totals(worker))}


def run_served(worker, target: str, args, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "bench.json")
        cmd = [sys.executable, "-m", "jaxoverlap.cli", "bench", "--target", target, "--num-prompts",
               str(args.num_prompts), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--max-concurrency", str(args.concurrency), "--warmup-requests", "0", "--seed", str(seed),
               "--no-progress", "--output-file", out]
        before = loop_totals(worker)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
        after = loop_totals(worker)
        if proc.returncode != 0:
            raise RuntimeError(f"bench failed: {proc.stderr[-2000:]}")
        with open(out) as f:
            [res] = json.load(f)["results"].values()
    return {"output_tok_s": res["output_throughput"], **per_decode(before, after),
            "ttft_median_ms": res["ttft_ms"]["median"], "itl_median_ms": res["itl_ms"]["median"],
            "itl_p99_ms": res["itl_ms"]["p99"], "failed": res["failed"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--switch-interval", type=float, default=0.0002, help="seconds, for the serve_si variant")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the variants, every other one reversed (2: A B C C B A)")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    ap.add_argument("--out", default="serve_overlap_bench.json")
    ap.add_argument("--no-process", action="store_true", help="leave out the serve_process variant")
    ap.add_argument("--compilation-cache-dir", default=None,
                    help="JAX persistent compilation cache of both engines (default: a temporary folder, so that "
                         "the second engine loads the programs the first compiled instead of compiling them again)")
    args = ap.parse_args()
    # The workers log their compile times (a cold start of every program is minutes on the GPU).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.no_process:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # two engines on one GPU
    ensure_importable()
    import functools

    import jax

    from jaxoverlap.config import EngineConfig
    from jaxoverlap.server.cli_commands import build_engine
    from jaxoverlap.server.engine_process import EngineProcess
    from jaxoverlap.server.engine_worker import EngineWorker
    from jaxoverlap.server.testing import ServerThread

    B = args.concurrency
    cache_dir = args.compilation_cache_dir
    if cache_dir is None:
        cache_dir = tempfile.mkdtemp(prefix="serve_overlap_jax_cache_")
        atexit.register(shutil.rmtree, cache_dir, ignore_errors=True)
    config = EngineConfig(
        model=model_dir(TINY if args.tiny else QWEN3_8B), load_format="dummy", dtype="bfloat16",
        max_running_requests=B, max_context_len=args.input_len + args.output_len + 64,
        kv_cache_tokens=B * (args.input_len + args.output_len + 64), chunked_prefill_size=2048,
        max_prefill_requests=8, page_size=16, disable_prefix_cache=True, compilation_cache_dir=cache_dir)
    t0 = time.perf_counter()
    # On the GPU every program is compiled before the first run (Engine.warmup(prefill=True)):
    # the served runs batch their prefills differently from the offline ones, and a compile in
    # a timed run would also make XLA drop the recorded graphs of the others.
    gpu = jax.default_backend() == "gpu"
    factory = functools.partial(build_engine, config)
    # Greedy programs only: the workload samples nothing (a server compiles both by default).
    warm = dict(precompile=gpu, precompile_prefill=gpu, precompile_sampling=(False,))
    worker = EngineWorker(engine_factory=factory, **warm).start()
    print(f"engine on the worker thread ready in {time.perf_counter() - t0:.1f} s", flush=True)
    server = ServerThread(worker).start()
    workers = {"serve": worker, "serve_si": worker}
    servers = {"serve": server, "serve_si": server}
    if not args.no_process:
        workers["serve_process"] = EngineProcess(factory, **warm).start()
        servers["serve_process"] = ServerThread(workers["serve_process"]).start()
    print(f"device {jax.devices()[0].device_kind}; engine and server ready in {time.perf_counter() - t0:.1f} s",
          flush=True)
    default_si = sys.getswitchinterval()
    run_offline(worker, args, seed=1)  # compiles the prefill programs and the rest
    for name in ("serve", "serve_process"):
        if name in workers:
            run_served(workers[name], servers[name].target, args, seed=1)

    order = ["offline", *workers]
    sequence = [v for r in range(args.rounds) for v in (order if r % 2 == 0 else order[::-1])]
    rows = []
    for i, variant in enumerate(sequence):
        sys.setswitchinterval(args.switch_interval if variant == "serve_si" else default_si)
        try:
            if variant == "offline":
                res = run_offline(worker, args, seed=100 + i)
            else:
                res = run_served(workers[variant], servers[variant].target, args, seed=100 + i)
        finally:
            sys.setswitchinterval(default_si)
        rows.append({"run": i, "variant": variant, "switch_interval_ms":
                     1e3 * (args.switch_interval if variant == "serve_si" else default_si), **res})
        print_table(rows[-1:], ["run", "variant", "switch_interval_ms", "output_tok_s", "host_ms_per_decode",
                                "wait_ms_per_decode", "host_bound_share", "itl_median_ms", "itl_p99_ms"])
        write_results(args.out, args, rows)
    for name in ("serve", "serve_process"):
        if name in workers:
            servers[name].stop()
            workers[name].stop()
    print("\nsummary")
    print_table(rows, ["run", "variant", "switch_interval_ms", "output_tok_s", "decode_iterations",
                       "host_ms_per_decode", "wait_ms_per_decode", "host_bound_share", "ttft_median_ms",
                       "itl_median_ms", "itl_p99_ms"])


if __name__ == "__main__":
    main()
