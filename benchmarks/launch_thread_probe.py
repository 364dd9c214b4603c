"""Would a thread of its own for the launch shorten the host's step? (issue 4)

The launch of a decode step is JAX's, PjRt's and XLA's work on the calling thread
(benchmarks/RESULTS.md), and the rest of the host's step (the scheduler's prepare and
process) is Python. If the launch releases the GIL for much of its time, a launcher thread
could run it while the loop thread processes the previous step, and a host-bound loop
would then step at max(launch, the rest) instead of their sum. This probe measures that on
the real decode step (two executables in turn, input array sent as numpy, as the engine's
default), against a stand-in for the rest of the host's step: `--host-work-ms` of pure
Python that holds the GIL, as the scheduler does.

Each loop runs, per step:
- inline (the engine's overlap loop today): host work, launch N+1 and start its output's
  copy, wait for N;
- thread: host work, hand N+1 to the launcher thread, take N's launched output from it,
  wait for N. `thread_si` does the same with a 0.2 ms GIL switch interval (default 5 ms).

`--layers` shortens the model (same shapes per layer) so that the device step is shorter
than the host's work and the loop's period shows the host's speed. Reports medians in ms:
the period, the host work as timed in the loop (GIL contention shows here), the launch as
timed on its thread, and the back-to-back device step. Prints a table, writes JSON.

    python benchmarks/launch_thread_probe.py --layers 2 36 --batches 1 32 --out launch_thread.json
    python benchmarks/launch_thread_probe.py --tiny      # CPU smoke run
"""
from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, median, model_dir, print_table, write_results  # noqa: E402

MODES = ("inline", "thread", "thread_si")


def python_work(units: int) -> int:
    """GIL-holding Python work of the scheduler's kind (small lists and dicts)."""
    acc = 0
    d = {}
    for i in range(units):
        d[i & 63] = i
        acc += len(d) + (i & 7)
    return acc


def calibrate(ms: float) -> int:
    units = 1000
    while True:
        t = time.perf_counter()
        python_work(units)
        dt = time.perf_counter() - t
        if dt > 2e-3:
            return max(1, int(units * ms * 1e-3 / dt))
        units *= 2


def run_inline(call, work_units: int, steps: int) -> dict:
    import numpy as np

    rec = {"period": [], "work": [], "launch": [], "wait": []}
    prev = call()
    prev.copy_to_host_async()
    last = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        python_work(work_units)
        t1 = time.perf_counter()
        out = call()
        out.copy_to_host_async()
        t2 = time.perf_counter()
        np.asarray(prev)
        t3 = time.perf_counter()
        prev = out
        rec["period"].append(t3 - last)
        last = t3
        rec["work"].append(t1 - t0)
        rec["launch"].append(t2 - t1)
        rec["wait"].append(t3 - t2)
    np.asarray(prev)
    return rec


def run_thread(call, work_units: int, steps: int, switch_interval: float | None) -> dict:
    import numpy as np

    todo, done = queue.SimpleQueue(), queue.SimpleQueue()
    launch_s = []

    def launcher():
        while todo.get() is not None:
            t = time.perf_counter()
            out = call()
            out.copy_to_host_async()
            launch_s.append(time.perf_counter() - t)
            done.put(out)

    old_si = sys.getswitchinterval()
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    th = threading.Thread(target=launcher, daemon=True)
    th.start()
    rec = {"period": [], "work": [], "handoff": [], "wait": []}
    try:
        todo.put(True)
        last = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            python_work(work_units)
            t1 = time.perf_counter()
            todo.put(True)  # launch N+1 on the launcher thread
            prev = done.get()  # N's launched output (launched one iteration ago)
            t2 = time.perf_counter()
            np.asarray(prev)
            t3 = time.perf_counter()
            rec["period"].append(t3 - last)
            last = t3
            rec["work"].append(t1 - t0)
            rec["handoff"].append(t2 - t1)
            rec["wait"].append(t3 - t2)
        np.asarray(done.get())
    finally:
        todo.put(None)
        th.join()
        sys.setswitchinterval(old_si)
    rec["launch"] = launch_s
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 36])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--host-work-ms", type=float, nargs="+", default=[0.3])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    ap.add_argument("--out", default="launch_thread.json")
    args = ap.parse_args()
    ensure_importable()
    import jax
    import numpy as np

    from jaxoverlap import steps
    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine

    rows = []
    for layers in args.layers:
        max_b = max(args.batches)
        shapes = dict(TINY if args.tiny else QWEN3_8B, num_hidden_layers=layers)
        engine = Engine(EngineConfig(
            model=model_dir(shapes), load_format="dummy", dtype="float32" if args.tiny else "bfloat16",
            max_running_requests=max_b, max_context_len=1024, kv_cache_tokens=max_b * 512, page_size=16,
            batch_buckets=tuple(sorted(args.batches)), disable_prefix_cache=True,
        ))
        r = engine.runner
        for B in args.batches:
            base = steps.DecodeInputs.of(np.arange(1, B + 1, dtype=np.int32),
                                         steps.Reservations.empty(r._decode_res_capacity(B))).packed
            ctx = r.decode_ctx_buckets[0]
            key = r._program_key(B, False, ctx, False, False)

            def call(r=r, base=base, B=B, ctx=ctx, key=key):  # this iteration's values, bound now
                inputs = steps.DecodeInputs(base.copy(), batch=B)  # numpy, as decode_inputs="every_step"
                step, a, static = r._decode_program(inputs, None, ctx, False, False)
                r.state, out = r._call_decode(key, step, a, static)
                return out.packed

            for _ in range(4):  # compile, and the first run of each executable
                jax.block_until_ready(call())
            t = time.perf_counter()
            for _ in range(20):
                out = call()
            jax.block_until_ready(out)
            device_ms = (time.perf_counter() - t) / 20 * 1e3
            for work_ms in args.host_work_ms:
                units = calibrate(work_ms)
                for mode in args.modes:
                    if mode == "inline":
                        rec = run_inline(call, units, args.steps)
                    else:
                        rec = run_thread(call, units, args.steps, 2e-4 if mode == "thread_si" else None)
                    skip = 10
                    row = {"layers": layers, "batch": B, "host_work_ms": work_ms, "mode": mode,
                           "device_step_ms": device_ms}
                    for k, v in rec.items():
                        row[f"{k}_ms"] = median(v[skip:]) * 1e3
                    row["period_p90_ms"] = float(np.percentile(rec["period"][skip:], 90)) * 1e3
                    rows.append(row)
                    print_table([row], list(row))
        engine.close()
        del engine, r  # (close() above has freed the engine's device arrays)
    cols = ["layers", "batch", "host_work_ms", "mode", "device_step_ms", "period_ms", "period_p90_ms", "work_ms",
            "launch_ms", "handoff_ms", "wait_ms"]
    print_table(rows, cols)
    write_results(args.out, args, rows)


if __name__ == "__main__":
    main()
