#!/usr/bin/env python3
"""What text costs the engine's thread: detokenization and stop strings per decode step,
and taking in a long prompt as token ids or as text.

The embedded default model (it has a tokenizer) decodes B requests together, greedy, in the
overlap loop. Three workloads of the same prompts, each timed per decode step at the full
batch (median ms of the engine's prepare / launch / process):
  ids        the engine has no tokenizer for these requests: no text at all;
  text       every new token is decoded (models/tokenizer.IncrementalDecoder);
  text_stop  the same with two stop strings that never match, checked on every token;
  text_off   text prompts with SamplingParams(detokenize=False), as the gRPC server submits
             requests without stop strings (its handlers decode the ids, off this thread).
Then `--long-tokens` new tokens for 8 requests with a stop string: process in the first and
the last 100 steps (a step must not cost more as the output grows). Last, `add_request` of
a long prompt as ids and as text (the best of 5): what one arrival costs the engine's
thread between two steps. The gRPC server tokenizes text itself, off that thread.

CPU only, no GPU needed: these are the engine's Python costs. The "device" is XLA:CPU on the
same cores, so compare runs of one machine (e.g. two revisions in turn), not absolute times.

    python benchmarks/host_text_bench.py --out host_text.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_importable, print_table, write_results  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOPS = ("\n\n\n\n", "zzqx")  # never produced by the default model on these prompts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--long-tokens", type=int, default=1900)
    ap.add_argument("--out", default="host_text_bench.json")
    args = ap.parse_args()
    ensure_importable()
    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine
    from jaxoverlap.sampling_params import SamplingParams

    B = args.batch
    engine = Engine(EngineConfig.from_options(
        None, dtype="float32", max_running_requests=B, max_context_len=2048,
        kv_cache_tokens=max(B * (400 + args.new_tokens), 8 * (200 + args.long_tokens)) + 256,
        chunked_prefill_size=2048, max_prefill_requests=8, page_size=16, batch_buckets=(8, B),
        disable_prefix_cache=True))
    tokenizer = engine.tokenizer
    with open(os.path.join(_ROOT, "README.md"), encoding="utf-8") as f:
        corpus = f.read()
    prompts = [corpus[i * 97 : i * 97 + 400] for i in range(B)]

    def run(kind: str, n: int, new_tokens: int, stop=(), detokenize=True) -> dict:
        engine.tokenizer = None if kind == "ids" else tokenizer  # no tokenizer: no text for these requests
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, stop=stop,
                                detokenize=detokenize)
        for i in range(n):
            prompt = tokenizer.encode(prompts[i]) if kind == "ids" else prompts[i]
            engine.add_request(f"{kind}-{i}-{time.perf_counter()}", prompt, params)
        engine.timings.clear()
        while engine.has_work():
            engine.step()
        engine.tokenizer = tokenizer
        steps = [t for t in engine.timings if t.kind == "decode" and t.batch_size == n]
        ms = lambda ts, key: 1e3 * float(np.median([getattr(t, key) for t in ts]))  # noqa: E731
        return {"steps": len(steps), "prepare_ms": ms(steps, "prepare_s"), "launch_ms": ms(steps, "launch_s"),
                "process_ms": ms(steps, "process_s"), "process_first100_ms": ms(steps[:100], "process_s"),
                "process_last100_ms": ms(steps[-100:], "process_s")}

    for kind in ("text", "ids"):  # compile every program first
        run(kind, B, 8)
    run("text", 8, 8)
    rows = []
    for name, kind, stop in (("ids", "ids", ()), ("text", "text", ()), ("text_stop", "text", STOPS),
                             ("text_off", "text", ())):
        rows.append({"workload": name, "batch": B, **run(kind, B, args.new_tokens, stop, name != "text_off")})
        print_table(rows[-1:], ["workload", "batch", "steps", "prepare_ms", "launch_ms", "process_ms"])
    rows.append({"workload": f"text_stop, {args.long_tokens} tokens", "batch": 8,
                 **run("text", 8, args.long_tokens, STOPS[1:])})
    print_table(rows[-1:], ["workload", "batch", "steps", "process_first100_ms", "process_last100_ms"])

    long_ids = (tokenizer.encode(corpus) * 4)[:1900]
    long_text = tokenizer.decode(long_ids)
    add = {}
    for name, prompt in (("ids", long_ids), ("text", long_text)):
        times = []
        for i in range(5):
            rid = f"add-{name}-{i}"
            t = time.perf_counter()
            engine.add_request(rid, prompt, SamplingParams(max_new_tokens=1))
            times.append(time.perf_counter() - t)
            engine.abort(rid)
        engine.drain()
        add[f"add_request_{name}_ms"] = 1e3 * min(times)
        print(f"add_request of a {len(long_ids)}-token prompt as {name}: {add[f'add_request_{name}_ms']:.3f} ms")
    write_results(args.out, args, rows, prompt_tokens_of_add=len(long_ids), **add)


if __name__ == "__main__":
    main()
