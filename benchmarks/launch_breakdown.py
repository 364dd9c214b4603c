"""Where does the engine's launch time go? (GPU diagnostics, issue 4.)

Runs a greedy decode workload through the real engine loop (overlap on) on Qwen3-8B
shapes with dummy weights and times, per decode launch: the whole `runner.launch`, the
jitted step call inside it, and each `copy_to_host_async`. It then times the same jitted
call with its small arguments already on the device (`jax.device_put` first, timed
apart), which separates JAX's host-to-device transfer of the numpy arguments from the
dispatch of the program itself.

    python benchmarks/launch_breakdown.py --batches 1 32 --out breakdown.json
    python benchmarks/launch_breakdown.py --tiny                # CPU smoke run
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, median, model_dir, print_table  # noqa: E402


class Timer:
    """Wraps a callable and records the wall time of every call into `times[name]`."""

    def __init__(self):
        self.times: dict[str, list[float]] = {}

    def wrap(self, name, fn):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.times.setdefault(name, []).append(time.perf_counter() - t)

        return timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--no-ctx-compare", action="store_true", help="skip the two extra compilations per batch")
    ap.add_argument("--out", default="breakdown.json")
    args = ap.parse_args()
    ensure_importable()
    import jax
    import numpy as np

    from jaxoverlap import steps
    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine
    from jaxoverlap.sampling_params import SamplingParams

    max_b = max(args.batches)
    engine = Engine(EngineConfig(
        model=model_dir(TINY if args.tiny else QWEN3_8B), load_format="dummy",
        dtype="float32" if args.tiny else "bfloat16", max_running_requests=max_b, max_context_len=4096,
        kv_cache_tokens=max_b * 512, batch_buckets=tuple(sorted(args.batches)), disable_prefix_cache=True,
    ))
    r = engine.runner
    timer = Timer()
    # The runner looks both up at call time, so patching them here times the real loop.
    steps.decode_step = timer.wrap("jit_call", steps.decode_step)
    array_cls = type(jax.numpy.zeros(1))
    array_cls.copy_to_host_async = timer.wrap("copy_to_host_async", array_cls.copy_to_host_async)
    r.launch = timer.wrap("runner_launch", r.launch)
    sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    rows = []
    for B in args.batches:
        for warm in (True, False):
            timer.times.clear()
            for i in range(B):
                engine.add_request(f"{B}-{warm}-{i}", [int(t) for t in rng.integers(10, min(1000, engine.model_config.vocab_size), 128)], sp)
            start = len(engine.timings)
            sent0, reused0 = r.inputs.sent, r.inputs.reused
            engine.drain()
        dec = [x for x in list(engine.timings)[start:] if x.kind == "decode" and x.batch_size == B]
        # The timers also saw the prefill launches: keep the decode ones (the last len(dec)).
        n = len(dec)
        launch = timer.times["runner_launch"][-n:]
        call = timer.times["jit_call"][-n:]
        copies = timer.times.get("copy_to_host_async", [])

        # The same program with its arguments already on the device.
        inputs = steps.DecodeInputs.empty(B, r._decode_res_capacity(B))
        step, a, static = r._decode_program(inputs, None, r.ctx_buckets[0], False, False)
        put, dev_call = [], []
        for _ in range(30):
            t = time.perf_counter()
            inputs_dev = jax.device_put(inputs)
            put.append(time.perf_counter() - t)
            t = time.perf_counter()
            r.state, out = step(r.params, r.state, inputs_dev, **static)
            dev_call.append(time.perf_counter() - t)
        jax.block_until_ready(out.packed)
        # One decode program for every length (the Pallas kernels walk visible pages only):
        # the device-bound step at the smallest context bucket that holds the rows against
        # the same step compiled for the whole table.
        periods = {}
        if not args.no_ctx_compare:
            real = steps.DecodeInputs.of(np.arange(1, B + 1, dtype=np.int32),
                                         steps.Reservations.empty(r._decode_res_capacity(B)))
            for ctx in (256, r.table_width):
                step, a, static = r._decode_program(real, None, ctx, False, False)
                relay = r.state.relay
                r.state = dataclasses.replace(r.state, relay=dataclasses.replace(
                    relay, seq_lens=relay.seq_lens.at[1:B + 1].set(176)))
                r.state, out = step(r.params, r.state, real, **static)  # compile
                jax.block_until_ready(out.packed)
                t = time.perf_counter()
                for _ in range(20):
                    r.state, out = step(r.params, r.state, real, **static)
                jax.block_until_ready(out.packed)
                periods[f"device_step_ms_ctx{ctx}"] = (time.perf_counter() - t) / 20 * 1e3
        row = {
            "batch": B, "decode_steps": n, **periods,
            # Small decode inputs sent to the device vs reused unchanged (runner.DeviceInputs).
            "inputs_sent": r.inputs.sent - sent0, "inputs_reused": r.inputs.reused - reused0,
            "engine_launch_ms": median([x.launch_s for x in dec]) * 1e3,
            "runner_launch_ms": median(launch) * 1e3,
            "jit_call_numpy_args_ms": median(call) * 1e3,
            "copy_to_host_async_ms": median(copies) * 1e3 if copies else float("nan"),
            "device_put_args_ms": median(put[3:]) * 1e3,
            "jit_call_device_args_ms": median(dev_call[3:]) * 1e3,
            "prepare_ms": median([x.prepare_s for x in dec]) * 1e3,
            "process_ms": median([x.process_s for x in dec]) * 1e3,
            "wait_ms": median([x.wait_s for x in dec]) * 1e3,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
