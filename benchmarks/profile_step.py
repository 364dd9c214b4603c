"""Where does a decode step's time go? A device trace of a few engine steps plus a dispatch
micro-test (numpy inputs vs device inputs). GPU diagnostics; prints a table, writes JSON.

    python benchmarks/profile_step.py --batch 1 --out profile.json
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, ensure_importable, median, model_dir  # noqa: E402


def device_events(trace_dir: str):
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    ev = json.load(gzip.open(files[0]))
    evs = ev["traceEvents"] if isinstance(ev, dict) else ev
    procs = {e["pid"]: e["args"]["name"] for e in evs if e.get("ph") == "M" and e.get("name") == "process_name"}
    dev = [e for e in evs if e.get("ph") == "X" and "/device:GPU" in procs.get(e.get("pid"), "")]
    return sorted(dev, key=lambda e: e["ts"])


def dispatch_test(engine, B: int, iters: int = 30) -> dict:
    import jax
    import numpy as np

    from jaxoverlap import steps

    r = engine.runner
    entries = np.arange(1, B + 1, dtype=np.int32)
    cap = max(8, B * r.decode_pages_per_row)
    res_np = steps.Reservations(*(np.zeros(cap, np.int32) for _ in range(3)))
    res_dev = jax.device_put(res_np)
    ent_dev = jax.device_put(entries)
    kw = dict(cfg=r.model_cfg, ctx_len=r.ctx_buckets[0], page_size=r.page_size, attention=r.attention)
    out = {}
    for name, mk in (("numpy_inputs", lambda: (entries, res_np)), ("device_inputs", lambda: (ent_dev, res_dev)),
                     ("device_put_each_call", lambda: (jax.device_put(entries), jax.device_put(res_np)))):
        ts = []
        for i in range(iters):
            e, res = mk()
            t = time.perf_counter()
            r.state, o = steps.decode_step(r.params, r.state, e, res, **kw)
            ts.append(time.perf_counter() - t)
        jax.block_until_ready(o.tokens)
        out[name] = median(ts[3:]) * 1e3
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--attention-backend", default="xla")
    ap.add_argument("--out", default="profile.json")
    args = ap.parse_args()
    ensure_importable()
    import jax
    import numpy as np

    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine
    from jaxoverlap.sampling_params import SamplingParams

    max_b = max(args.batches)
    engine = Engine(EngineConfig(model=model_dir(QWEN3_8B), load_format="dummy", dtype="bfloat16",
                                 max_running_requests=max_b, max_context_len=1024, kv_cache_tokens=max_b * 512,
                                 page_size=16, batch_buckets=tuple(sorted(args.batches)),
                                 attention_backend=args.attention_backend))
    result = {}
    for B in args.batches:
        rng = np.random.default_rng(B)
        for i in range(B):
            engine.add_request(f"w{B}-{i}", [int(t) for t in rng.integers(0, 500, 64)],
                               SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True))
        for _ in range(8):  # compile + reach the steady decode batch
            engine.step()
        d = tempfile.mkdtemp()
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        n0 = len(engine.timings)
        for _ in range(args.steps):
            engine.step()
        engine.drain()
        jax.profiler.stop_trace()
        host = list(engine.timings)[n0:n0 + args.steps]
        ev = device_events(d)
        by_name = collections.defaultdict(float)
        for e in ev:
            by_name[e["name"]] += e["dur"]
        # Steps: split the device timeline at gaps longer than 100 us.
        spans, gaps = [], []
        start = end = None
        for e in ev:
            if start is None:
                start, end = e["ts"], e["ts"] + e["dur"]
            elif e["ts"] - end > 100:
                spans.append(end - start)
                gaps.append(e["ts"] - end)
                start, end = e["ts"], e["ts"] + e["dur"]
            else:
                end = max(end, e["ts"] + e["dur"])
        if start is not None:
            spans.append(end - start)
        total = sum(by_name.values())
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:20]
        print(f"\nB={B}: {len(ev)} device ops, busy {total / 1e3:.2f} ms over {args.steps} steps; "
              f"segments {[round(s / 1e3, 3) for s in spans][:14]} ms; gaps>100us {[round(g / 1e3, 3) for g in gaps][:14]}")
        for name, us in top:
            print(f"  {us / args.steps:9.1f} us/step  {name[:100]}")
        disp = dispatch_test(engine, B)
        print(f"  dispatch ms/call: {disp}")
        print(f"  host launch ms (engine): {median([t.launch_s for t in host]) * 1e3:.3f}, "
              f"wait ms {median([t.wait_s for t in host]) * 1e3:.3f}")
        result[B] = {"top_ops_us_per_step": {k: v / args.steps for k, v in top}, "segments_us": spans, "gaps_us": gaps,
                     "dispatch_ms": disp, "busy_ms_per_step": total / 1e3 / args.steps}
        engine.drain()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
