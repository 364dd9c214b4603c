"""Where the host's time goes in a decode step with structured output: the forward pass's
launch, the rows' bitmasks, the sampling's launch and the processing of the step before,
each timed around the engine's own calls (Qwen3-8B shapes, dummy weights, every row
constrained as in structured_bench.py, overlap on). Variants, in turn on one engine:

  plain      no row constrained: the decode step's own launch (decode_call), for comparison
  default    as the engine runs
  put_mask   the mask sent with jax.device_put before the sampling's call (timed apart)
  one_exe    one executable per program instead of two in turn (alternate_executables off)

With --trace, one more constrained run at the largest batch is traced with the host tracer
only (as benchmarks/host_spans.py does): the host spans inside the forward pass's launch and
inside the sampling's launch (masks included), by depth and name, median per launch. The
tracer stretches the CUDA calls, so compare spans with each other, not with the untraced
times.

    python benchmarks/structured_launch_probe.py --batches 1 32 --new-tokens 64 --trace
    python benchmarks/structured_launch_probe.py --tiny
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_importable, median, print_table, write_results  # noqa: E402

REGEX = "[a-z ]{1,2000}"
VARIANTS = ("plain", "default", "put_mask", "one_exe")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--trace", action="store_true", help="also trace one constrained run (host spans)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="structured_launch_probe.json")
    args = ap.parse_args()
    ensure_importable()
    import jax
    import numpy as np

    from jaxoverlap.sampling_params import SamplingParams
    from structured_bench import build_engine

    engine = build_engine(args.tiny, args.batches)
    cfg, runner, max_b = engine.model_config, engine.runner, max(args.batches)

    # Timers around the engine's own calls: seconds per call, by name, for the current run.
    spans = collections.defaultdict(list)
    mode = {"variant": "default"}

    def timed(name, fn):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spans[name].append(time.perf_counter() - t)
        return call

    call_decode = runner._call_decode

    def call_decode_timed(key, step, args_, static):
        if key[0] == "sample" and mode["variant"] == "put_mask":
            t = time.perf_counter()
            allowed = jax.device_put(args_[3])
            spans["put_mask"].append(time.perf_counter() - t)
            args_ = args_[:3] + (allowed,)
        name = key[0] if key[0] in ("forward", "sample") else "decode"
        return timed(name + "_call", call_decode)(key, step, args_, static)

    runner._call_decode = call_decode_timed
    engine.grammars.bitmask = timed("bitmask", engine.grammars.bitmask)
    engine.scheduler.process = timed("process", engine.scheduler.process)

    def run(B: int, seed: int, constrained: bool = True) -> dict:
        rng = np.random.default_rng(seed)
        for i in range(B):
            sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True,
                                structured_output={"regex": REGEX} if constrained else None, detokenize=False)
            engine.add_request(f"{seed}-{i}", [int(t) for t in rng.integers(1, min(1000, cfg.vocab_size),
                                                                            args.prompt_len)], sp)
        spans.clear()
        start = len(engine.timings)
        while engine.has_work():
            engine.step()
        dec = [x for x in list(engine.timings)[start:] if x.kind == "decode" and x.batch_size == B]
        row = {"period_ms": median([x.prepare_s + x.launch_s + x.wait_s + x.process_s for x in dec]) * 1e3,
               "launch_ms": median([x.launch_s for x in dec]) * 1e3,
               "wait_ms": median([x.wait_s for x in dec]) * 1e3}
        for name in ("decode_call", "forward_call", "bitmask", "put_mask", "sample_call", "process"):
            row[name + "_ms"] = median(spans[name]) * 1e3 if spans.get(name) else float("nan")
        return row

    rows = []
    for B in args.batches:
        run(B, seed=99)  # compiles
        run(B, seed=98, constrained=False)
        got = collections.defaultdict(list)
        for rep in range(args.repeats):
            for variant in args.variants:
                mode["variant"] = variant
                runner.alternate_executables = variant != "one_exe"
                got[variant].append(run(B, seed=rep, constrained=variant != "plain"))
        mode["variant"], runner.alternate_executables = "default", True
        for variant in args.variants:
            res = got[variant]
            row = {"batch": B, "variant": variant}
            row.update({k: median([r[k] for r in res]) for k in res[0]})
            rows.append(row)
            print_table(rows[-1:], list(rows[-1]))
    print("\nsummary (medians over the decode iterations of each run, then over runs; ms)")
    print_table(rows, list(rows[0]))
    traced = trace_parts(engine, run, max_b) if args.trace else {}
    write_results(args.out, args, rows, regex=REGEX, traced=traced)


def trace_parts(engine, run, B: int) -> dict:
    """Host spans of the forward and sampling launches of one traced constrained run."""
    import tempfile

    import jax

    from host_spans import launch_spans
    from jaxoverlap.profiling.trace import load_events

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.device_tracer_level = 0
    options.host_tracer_level = 2
    trace_dir = tempfile.mkdtemp(prefix="structured-probe-")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True, profiler_options=options)
    run(B, seed=7)
    jax.block_until_ready(engine.runner.state)
    jax.profiler.stop_trace()
    events = load_events(trace_dir)
    # Every decode iteration of the run launches a forward pass, then a sampling: in turn.
    launches = sorted((e for e in events if e.get("ph") == "X" and e.get("name") == "jaxoverlap.launch"
                       and str((e.get("args") or {}).get("kind")) == "decode"), key=lambda e: float(e["ts"]))
    parts = {id(e): ("forward", "sample")[i % 2] for i, e in enumerate(launches)}
    out = {}
    for name in ("forward", "sample"):
        keep = [e for e in events if id(e) not in parts or parts[id(e)] == name]
        spans = launch_spans(keep, B)
        out[name] = spans
        print(f"\n{name} launches: {spans['launches']}, span median {spans['launch_span_median_us']:.1f} us")
        print_table(spans["rows"][:25], ["depth", "name", "median_us", "count"])
        print_table(spans["other_threads"][:8], ["thread", "name", "median_us"])
    return out


if __name__ == "__main__":
    main()
