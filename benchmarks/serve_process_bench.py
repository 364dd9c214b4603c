#!/usr/bin/env python3
"""Does the gRPC server's Python slow the engine's loop down when both share one interpreter?
The engine on a thread of the server's process (EngineWorker) against the engine in a process
of its own (EngineProcess), served the same workload.

The engine here is an emulation that needs no device (`PacedEngine`): each step() holds the
GIL for `--host-ms` of Python (the loop's prepare, launch and process), then waits, with the
GIL released as `block_until_ready` does, until the emulated device finishes the step before.
The emulated device runs each launched step for `--device-ms` from the later of its launch and
the previous step's end. That isolates what this question is about: how late the engine's
thread gets the GIL back after its wait, and how long the device idles meanwhile. The real
engine on the GPU is measured by `serve_overlap_bench.py`.

Both servers run at once, in this process; `jaxoverlap bench` (a child process) sends them
the same requests, alternating blocks between them (`--rounds`). Per block and server: output
tokens/s, inter-token latency, and from the engine: the device's idle share (idle time /
elapsed time over the block's steps) and how late the loop woke after the device finished.

    python benchmarks/serve_process_bench.py --concurrency 64 --out serve_process.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_importable, print_table, write_results  # noqa: E402

ensure_importable()

from jaxoverlap.server.testing import FakeEngine  # noqa: E402


class PacedEngine(FakeEngine):
    """FakeEngine with the overlap loop's timing against an emulated device (see the module's
    docstring). stats()["paced"] holds the running totals."""

    def __init__(self, config, *, device_s: float, host_s: float):
        super().__init__(config)
        self.device_s = device_s
        self.host_s = host_s
        self._prev_done = None  # when the emulated device finishes the step launched last
        self.totals = {"steps": 0, "idle_s": 0.0, "busy_s": 0.0, "late_s": 0.0, "late_over_1ms": 0}

    def step(self):
        t = time.perf_counter()
        end = t + self.host_s
        x = 0
        while time.perf_counter() < end:  # prepare + launch + process, as Python holding the GIL
            x += 1
        launched = time.perf_counter()
        prev = self._prev_done
        start = launched if prev is None else max(launched, prev)
        if prev is not None:
            self.totals["idle_s"] += start - prev
            # The wait for the previous step, with the GIL released (time.sleep releases it).
            now = time.perf_counter()
            if prev > now:
                time.sleep(prev - now)
            late = time.perf_counter() - prev
            self.totals["late_s"] += max(0.0, late)
            self.totals["late_over_1ms"] += late > 1e-3
        self._prev_done = start + self.device_s
        self.totals["busy_s"] += self.device_s
        self.totals["steps"] += 1
        outs = super().step()
        if not self.has_work():
            self._prev_done = None  # idle: the next step starts a new run
        return outs

    def stats(self):
        return {**super().stats(), "paced": dict(self.totals)}


def paced_totals(engine) -> dict:
    return dict(engine.totals)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--device-ms", type=float, default=5.0, help="emulated device step (Qwen3-8B at batch 32-64: 4.9-5.5)")
    ap.add_argument("--host-ms", type=float, default=1.0, help="the engine loop's own Python per step")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--out", default="serve_process_bench.json")
    args = ap.parse_args()

    from jaxoverlap.config import EngineConfig
    from jaxoverlap.server.engine_process import EngineProcess
    from jaxoverlap.server.engine_worker import EngineWorker
    from jaxoverlap.server.testing import ServerThread

    ctx = args.input_len + args.output_len + 8
    config = EngineConfig(max_running_requests=args.concurrency, max_context_len=ctx,
                          kv_cache_tokens=args.concurrency * ctx)
    factory = functools.partial(PacedEngine, config, device_s=args.device_ms / 1e3, host_s=args.host_ms / 1e3)
    workers = {"thread": EngineWorker(engine_factory=factory).start(),
               "process": EngineProcess(factory).start(timeout=120)}
    servers = {name: ServerThread(w).start() for name, w in workers.items()}

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "bench.json")
        cmd = [sys.executable, "-m", "jaxoverlap.cli", "bench", "--num-prompts", str(args.num_prompts),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--max-concurrency", str(args.concurrency), "--compare-mode", "alternating",
               "--rounds", str(args.rounds), "--no-progress", "--output-file", out]
        for name, s in servers.items():
            cmd += ["--target", s.target, "--label", name]
        before = {n: w.call_sync(paced_totals) for n, w in workers.items()}
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
        wall = time.perf_counter() - t
        after = {n: w.call_sync(paced_totals) for n, w in workers.items()}
        if proc.returncode != 0:
            raise RuntimeError(f"bench failed: {proc.stderr[-3000:]}")
        print(proc.stdout)
        with open(out) as f:
            report = json.load(f)
    for s in servers.values():
        s.stop()
    for w in workers.values():
        w.stop()

    rows = []
    for name in workers:
        res = report["results"][name]
        d = {k: after[name][k] - before[name][k] for k in after[name]}
        steps = max(d["steps"], 1)
        rows.append({
            "engine": name, "output_tok_s": res["output_throughput"], "itl_median_ms": res["itl_ms"]["median"],
            "itl_p99_ms": res["itl_ms"]["p99"], "steps": d["steps"],
            "device_idle_share": d["idle_s"] / max(d["idle_s"] + d["busy_s"], 1e-9),
            "late_ms_per_step": 1e3 * d["late_s"] / steps, "late_over_1ms_share": d["late_over_1ms"] / steps,
            "failed": res["failed"]})
    print_table(rows, ["engine", "output_tok_s", "itl_median_ms", "itl_p99_ms", "steps", "device_idle_share",
                       "late_ms_per_step", "late_over_1ms_share", "failed"])
    write_results(args.out, args, rows, bench_wall_s=wall, bench_report=report)


if __name__ == "__main__":
    main()
