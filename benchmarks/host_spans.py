"""Where the host's decode launch goes, span by span and by sampling (GPU diagnostics, issue 4).

The profiler's device tracer (CUPTI) stretches the CUDA calls it watches, above all the
`cuGraphLaunch` of a step's ~400-node graph, so traces taken with it cannot time the
launch. This runs the engine's overlap loop on Qwen3-8B shapes (dummy weights) and traces
it asking for the host only (`device_tracer_level=0`; the CUDA plugin of JAX 0.11.2 still
traced the device, so on the GPU the CUDA calls stay stretched: compare the traced launch
with the untraced one). For the steady decode launches of each batch size it reports, per
launch:

- every host span inside the engine's `jaxoverlap.launch` span on the Python thread, by
  nesting depth and name: the median time per launch and how many there were;
- spans of other threads that overlap the launch (PjRt's worker threads);
- the launch time from the engine's own timings, untraced and traced (the tracer's cost).

With --sample-s S it also samples the untraced loop with py-spy (`--native`, attached to this
process for S seconds of steady decoding): of the samples whose stack holds the engine's
launch (prefill launches included), the share that holds each frame (inclusive), turned into
microseconds of the untraced launch. Nothing is instrumented; but py-spy pauses the process for each
native sample, which stretches the sampled launches, so the shares are the result, not the
times (its error count is reported).

With --graph-nodes N... it first times, in a child process, a CUDA graph of N tiny kernels
recorded with PyTorch and replayed as the engine launches (replay k+1, then wait for k):
what the driver charges for a graph launch of that size, apart from XLA.

    python benchmarks/host_spans.py --batches 1 32 --graph-nodes 100 400 --out host_spans.json
    python benchmarks/host_spans.py --batches 1 32 --sample-s 3 --no-trace   # py-spy only
    python benchmarks/host_spans.py --tiny --batches 2            # CPU smoke run
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, git_commit, median, model_dir, print_table  # noqa: E402

LAUNCH = "jaxoverlap.launch"


def span_name(name: str) -> str:
    """TraceMe names can carry `#key=value#` metadata: keep the name."""
    return name.split("#", 1)[0]


def launch_spans(events: list[dict], batch_size: int) -> dict:
    """Host spans inside the decode launches of `batch_size` rows (see the module docstring).
    Returns {"launches": n, "rows": [{depth, name, median_us, count}], "other_threads": [...]}."""
    threads = {(e.get("pid"), e.get("tid")): str((e.get("args") or {}).get("name", ""))
               for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    by_thread = collections.defaultdict(list)
    for e in spans:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
    launches = [e for e in spans if e["name"] == LAUNCH and str((e.get("args") or {}).get("kind")) == "decode"
                and str((e.get("args") or {}).get("size")) == str(batch_size)]
    per_key: dict[tuple, list[float]] = collections.defaultdict(list)  # (depth, name) -> us per launch
    counts: dict[tuple, list[int]] = collections.defaultdict(list)
    other: dict[tuple, list[float]] = collections.defaultdict(list)
    for launch in launches:
        t0, t1, home = float(launch["ts"]), float(launch["ts"]) + float(launch["dur"]), (launch["pid"], launch["tid"])
        total: dict[tuple, float] = collections.Counter()
        n: dict[tuple, int] = collections.Counter()
        stack: list[float] = [t1]  # end times of the open spans; the launch is depth 0
        for e in by_thread[home]:
            ts, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            if e is launch or ts < t0 or end > t1 + 0.01:
                continue
            while len(stack) > 1 and ts >= stack[-1]:
                stack.pop()
            key = (len(stack), span_name(e["name"]))
            total[key] += float(e["dur"])
            n[key] += 1
            stack.append(end)
        for key in set(per_key) | set(total):
            per_key[key].append(total.get(key, 0.0))
            counts[key].append(n.get(key, 0))
        busy: dict[tuple, float] = collections.Counter()
        for tkey, evs in by_thread.items():
            if tkey == home:
                continue
            for e in evs:
                ts, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
                if end > t0 and ts < t1:
                    busy[(threads.get(tkey, str(tkey)), span_name(e["name"]))] += min(end, t1) - max(ts, t0)
        for key in set(other) | set(busy):
            other[key].append(busy.get(key, 0.0))
    n_launch = len(launches)

    def pad(xs: list) -> list:  # keys first seen in a later launch
        return [0.0] * (n_launch - len(xs)) + list(xs)

    rows = [{"depth": d, "name": name, "median_us": median(pad(v)), "count": median(pad(counts[(d, name)]))}
            for (d, name), v in per_key.items()]
    rows.sort(key=lambda r: (r["depth"], -r["median_us"]))
    others = [{"thread": t, "name": name, "median_us": median(pad(v))} for (t, name), v in other.items()]
    others.sort(key=lambda r: -r["median_us"])
    launch_us = median([float(e["dur"]) for e in launches]) if launches else float("nan")
    return {"launches": n_launch, "launch_span_median_us": launch_us, "rows": rows, "other_threads": others[:20]}


def sampled_frames(raw_path: str, launch_ms: float, top: int = 60) -> dict:
    """py-spy's raw output (one `frame;frame;... count` line per distinct stack) -> the
    frames inside the launch: share of the launch samples that hold each frame (inclusive,
    once per stack) and that share of the untraced launch time in microseconds."""
    inclusive: dict[str, int] = collections.Counter()
    launch_samples = total = 0
    with open(raw_path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not count.isdigit():
                continue
            total += int(count)
            frames = [fr.split(" (")[0][:160] for fr in stack.split(";")]
            if "ModelRunner.launch" not in frames:
                continue
            launch_samples += int(count)
            inside = frames[frames.index("ModelRunner.launch") + 1:]
            for name in set(inside):
                inclusive[name] += int(count)
    rows = [{"frame": name, "share": n / launch_samples, "est_us": n / launch_samples * launch_ms * 1e3}
            for name, n in inclusive.most_common(top)] if launch_samples else []
    return {"samples": total, "launch_samples": launch_samples, "rows": rows}


def sample_with_py_spy(seconds: float, out_path: str, rate: int) -> subprocess.Popen:
    """py-spy attached to this process (root, or a ptrace-permitting system)."""
    return subprocess.Popen(["py-spy", "record", "--native", "--pid", str(os.getpid()),
                             "--duration", str(max(1, round(seconds))),
                             "--rate", str(rate), "--format", "raw", "--output", out_path],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def graph_launch_child(nodes: int, iters: int) -> dict:
    """A CUDA graph of `nodes` one-block kernels (PyTorch), replayed back to back and paced as
    the engine launches: host time of `replay()` (median us) and device time per replay."""
    import torch

    x = torch.zeros(256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1.0)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(nodes):
            x.add_(1.0)
    torch.cuda.synchronize()
    back = []
    for _ in range(iters):
        t = time.perf_counter()
        graph.replay()
        back.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    paced, prev = [], None
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        t = time.perf_counter()
        graph.replay()
        paced.append(time.perf_counter() - t)
        done = torch.cuda.Event()
        done.record()
        if prev is not None:
            prev.synchronize()  # the engine waits for the step before the one it just launched
        prev = done
    stop.record()
    torch.cuda.synchronize()
    return {"nodes": nodes, "back_to_back_us": median(back) * 1e6, "paced_us": median(paced) * 1e6,
            "device_ms_per_replay": start.elapsed_time(stop) / iters}


def run_workload(engine, batch: int, prompt_len: int, new_tokens: int, tag: str) -> list:
    import numpy as np

    from jaxoverlap.sampling_params import SamplingParams

    rng = np.random.default_rng(batch)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{batch}-{i}", rng.integers(1, vocab, prompt_len).tolist(), params)
    start = len(engine.timings)
    while engine.has_work():
        engine.step()
    return [t for t in list(engine.timings)[start:] if t.kind == "decode" and t.batch_size == batch]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--host-level", type=int, default=3, help="the profiler's host_tracer_level (1-3)")
    ap.add_argument("--graph-nodes", type=int, nargs="*", default=[])
    ap.add_argument("--graph-iters", type=int, default=200)
    ap.add_argument("--sample-s", type=float, default=0.0, help="py-spy sampling of the untraced loop (seconds)")
    ap.add_argument("--sample-rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--no-trace", action="store_true", help="skip the profiler trace")
    ap.add_argument("--raw-dir", default=None, help="where py-spy's raw stacks go (default: next to --out)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--top", type=int, default=30, help="rows of the printed table per batch")
    ap.add_argument("--out", default="host_spans.json")
    ap.add_argument("--child-graph", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_graph is not None:
        print("RESULT " + json.dumps(graph_launch_child(args.child_graph, args.graph_iters)), flush=True)
        return
    result = {"commit": git_commit(), "args": vars(args), "graphs": [], "batches": []}
    for nodes in args.graph_nodes:  # before this process touches the GPU
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-graph", str(nodes),
                               "--graph-iters", str(args.graph_iters)], capture_output=True, text=True, timeout=300)
        rows = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        result["graphs"].append(rows[0] if rows else {"nodes": nodes, "error": proc.stderr[-800:]})
    if result["graphs"]:
        print_table([g for g in result["graphs"] if "error" not in g],
                    ["nodes", "back_to_back_us", "paced_us", "device_ms_per_replay"])

    ensure_importable()
    import jax

    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine
    from jaxoverlap.profiling.trace import load_events

    max_b, ctx = max(args.batches), 1024
    engine = Engine(EngineConfig(
        model=model_dir(TINY if args.tiny else QWEN3_8B), load_format="dummy", dtype="bfloat16",
        max_running_requests=max_b, max_context_len=ctx, kv_cache_tokens=max_b * ctx // 2,
        chunked_prefill_size=2048, max_prefill_requests=8, page_size=16, batch_buckets=tuple(sorted(args.batches)),
        disable_prefix_cache=True,
    ))
    result["device"] = jax.devices()[0].device_kind
    result["jax"] = jax.__version__
    for B in args.batches:
        run_workload(engine, B, args.prompt_len, 4, "warm")  # compiles this batch's programs
        plain = run_workload(engine, B, args.prompt_len, args.new_tokens, "untraced")
        row = {"batch": B, "launch_ms_untraced": median([t.launch_s for t in plain]) * 1e3}
        if args.sample_s > 0:
            raw = os.path.join(args.raw_dir or os.path.dirname(os.path.abspath(args.out)), f"py_spy_b{B}.txt")
            spy = sample_with_py_spy(args.sample_s, raw, args.sample_rate)
            time.sleep(0.5)  # py-spy attaches
            t0, sampled = time.perf_counter(), []
            while time.perf_counter() - t0 < args.sample_s + 0.5:
                sampled += run_workload(engine, B, args.prompt_len, args.new_tokens, "sampled")
            spy_log = spy.communicate(timeout=120)[0]
            if not os.path.exists(raw):
                raise RuntimeError(f"py-spy wrote nothing: {spy_log[-800:]}")
            row["launch_ms_sampled"] = median([t.launch_s for t in sampled]) * 1e3
            row["py_spy"] = sampled_frames(raw, row["launch_ms_untraced"])
            row["py_spy"]["log"] = spy_log[-400:]
            print(f"\nbatch {B}: py-spy {row['py_spy']['launch_samples']} launch samples of "
                  f"{row['py_spy']['samples']}; launch {row['launch_ms_untraced']:.3f} ms untraced, "
                  f"{row['launch_ms_sampled']:.3f} ms while sampled", flush=True)
            print_table(row["py_spy"]["rows"][: args.top], ["frame", "share", "est_us"])
        if not args.no_trace:
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0
            options.device_tracer_level = 0  # asks for no CUPTI (the GPU plugin of JAX 0.11.2 traces the device anyway)
            options.host_tracer_level = args.host_level
            trace_dir = tempfile.mkdtemp(prefix="host-spans-")
            jax.profiler.start_trace(trace_dir, create_perfetto_trace=True, profiler_options=options)
            traced = run_workload(engine, B, args.prompt_len, args.new_tokens, "traced")
            jax.block_until_ready(engine.runner.state)
            jax.profiler.stop_trace()
            spans = launch_spans(load_events(trace_dir), B)
            row.update(launch_ms_traced=median([t.launch_s for t in traced]) * 1e3, **spans)
            print(f"\nbatch {B}: launch {row['launch_ms_untraced']:.3f} ms untraced, {row['launch_ms_traced']:.3f} ms "
                  f"traced, span median {row['launch_span_median_us']:.1f} us over {row['launches']} launches",
                  flush=True)
            print_table(spans["rows"][: args.top], ["depth", "name", "median_us", "count"])
            print_table(spans["other_threads"][:8], ["thread", "name", "median_us"])
        result["batches"].append(row)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
