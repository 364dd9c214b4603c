"""Why some launches are slow: every launch of an engine workload, its wall time next to
the calling thread's CPU time and resource usage (system time, page faults, context
switches), the garbage collections and JAX compilations that ran inside it, and (with
--vlog) XLA's command-buffer log lines written while it ran.

A launch whose CPU time is far below its wall time waited for something (the device, a
lock, an allocation; a voluntary context switch says the thread slept); one whose CPU time
equals its wall time worked the whole time (a graph update, a collection). The log lines
say which graphs XLA re-recorded inside it. With --warmup-first the engine's warm-up
replaces the compiling run, so any trace or compilation in a timed launch is one that the
warm-up missed (--warmup-prefill: the prefill programs are part of the warm-up).

    python benchmarks/slow_launches.py --algo ngram_device --batch 32 --vlog --out slow.json
    python benchmarks/slow_launches.py --algo plain --batch 32 --finish-jitter 32 \
        --runs 4 --variants every_step on_change          # EngineConfig.decode_inputs, in turn
    python benchmarks/slow_launches.py --tiny --algo plain --batch 4      # CPU smoke run

The engine's stderr is sent to a file while the timed run runs (XLA's C++ log writes to
file descriptor 2), with a marker line before and after each launch, and parsed after.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, model_dir, print_table  # noqa: E402

UPDATE = re.compile(r"Create/Update command buffer.*num_commands=(\d+); updated_allocs=(\d+)")
UPDATED = re.compile(r"Updated command buffer in (\d+)")
EXECUTE = "Execute command buffer"


def thread_usage() -> tuple:
    """The calling thread's (user s, system s, minor faults, voluntary and involuntary
    context switches) so far; None where RUSAGE_THREAD is missing."""
    if not hasattr(resource, "RUSAGE_THREAD"):
        return None
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime, r.ru_stime, r.ru_minflt, r.ru_nvcsw, r.ru_nivcsw


def usage_delta(before, after) -> dict:
    """What the thread spent between two `thread_usage` readings: user and system ms (the
    system share is syscalls and faults), minor page faults, context switches."""
    if before is None or after is None:
        return {}
    d = [a - b for a, b in zip(after, before)]
    return {"user_ms": d[0] * 1e3, "sys_ms": d[1] * 1e3, "minflt": d[2], "vcsw": d[3], "ivcsw": d[4]}


def instrument(engine, marks: list):
    """Wrap the runner's launch: marker lines on fd 2, (wall, thread CPU) and the thread's
    resource usage per launch. Collections are timed by a gc callback."""
    runner, launch = engine.runner, engine.runner.launch
    last_end = [None]  # the thread's usage when the previous launch returned

    def timed_launch(batch):
        i = len(marks)
        os.write(2, f"@@begin {i}\n".encode())
        u = thread_usage()
        w, c = time.perf_counter(), time.thread_time()
        out = launch(batch)
        wall, cpu = time.perf_counter() - w, time.thread_time() - c
        end = thread_usage()
        usage = usage_delta(u, end)
        # between the previous launch and this one: the wait for the device, process, prepare
        usage.update({f"between_{k}": v for k, v in usage_delta(last_end[0], u).items()})
        last_end[0] = end
        os.write(2, f"@@end {i}\n".encode())
        marks.append({"i": i, "variant": runner.decode_inputs, "kind": batch.kind, "batch": batch.size, "start": w,
                      "wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3, "reserved_pages": len(batch.reservations or ()),
                      **usage})
        return out

    runner.launch = timed_launch


def gc_recorder(events: list):
    """A gc.callbacks hook that appends {gen, start, ms} per collection."""
    started = [0.0]

    def cb(phase, info):
        now = time.perf_counter()
        if phase == "start":
            started[0] = now
        else:
            events.append({"gen": info["generation"], "start": started[0], "ms": (now - started[0]) * 1e3})
    return cb


def jax_event_recorder(events: list):
    """A jax.monitoring listener that appends {name, end, secs} per duration event (tracing,
    lowering, backend compilation, persistent-cache loads): a launch holding one compiled
    or traced something."""
    def on_event(name, secs, **_):
        events.append({"name": name, "end": time.perf_counter(), "secs": secs})
    return on_event


def parse_log(path: str, marks: list) -> None:
    """Adds to each launch the XLA log lines written between its markers."""
    by_i = {m["i"]: m for m in marks}
    cur = None
    for m in marks:
        m.update(graph_updates=0, updated_allocs=0, updated_commands=0, update_ms=0.0, graph_executions=0)
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("@@begin "):
                cur = by_i.get(int(line.split()[1]))
            elif line.startswith("@@end "):
                cur = None
            elif cur is not None:
                u = UPDATE.search(line)
                if u:
                    cur["graph_updates"] += 1
                    cur["updated_commands"] += int(u.group(1))
                    cur["updated_allocs"] += int(u.group(2))
                elif UPDATED.search(line):
                    cur["update_ms"] += int(UPDATED.search(line).group(1)) / 1e3
                elif EXECUTE in line:
                    cur["graph_executions"] += 1


def _row(sel: list) -> dict:
    """Medians of the times, means of the counts, of some launches."""
    def mean(k):
        return sum(m[k] for m in sel) / len(sel)

    return {"n": len(sel), "wall_ms": statistics.median(m["wall_ms"] for m in sel),
            "cpu_ms": statistics.median(m["cpu_ms"] for m in sel),
            "cpu_share": sum(m["cpu_ms"] for m in sel) / sum(m["wall_ms"] for m in sel),
            "gc_ms": mean("gc_ms"), "graph_updates": mean("graph_updates"), "update_ms": mean("update_ms"),
            "updated_allocs": mean("updated_allocs"),
            **{k: mean(k) for k in ("user_ms", "sys_ms", "minflt", "vcsw", "ivcsw", "between_sys_ms",
                                    "between_minflt", "between_vcsw") if all(k in m for m in sel)},
            "reserving": sum(1 for m in sel if m["reserved_pages"]) / len(sel)}


def summarize(marks: list, slow_ms: float) -> list[dict]:
    """One row per (variant, kind, batch size) for all, slow and fast launches."""
    groups = {}
    for m in marks:
        groups.setdefault((m["variant"], m["kind"], m["batch"]), []).append(m)
    rows = []
    for (variant, kind, b), ms in sorted(groups.items()):
        for label, sel in (("all", ms), ("slow", [m for m in ms if m["wall_ms"] > slow_ms]),
                           ("fast", [m for m in ms if m["wall_ms"] <= slow_ms])):
            if sel:
                rows.append({"variant": variant, "kind": kind, "batch": b, "launches": label, **_row(sel)})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--algo", default="ngram_device", choices=("plain", "eagle", "ngram", "ngram_device"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=127)
    ap.add_argument("--prompt-kind", choices=("random", "repeat"), default="repeat")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--finish-jitter", type=int, default=0,
                    help="request i asks for new_tokens - (i * this) // batch tokens, so the rows finish on "
                         "different steps and the running set changes at the end of the run")
    ap.add_argument("--max-context-len", type=int, default=512)
    ap.add_argument("--runs", type=int, default=2, help="timed runs of the workload after the compiling one")
    ap.add_argument("--variants", nargs="+", default=["every_step"],
                    choices=("every_step", "on_change"),
                    help="the runner's decode_inputs (EngineConfig.decode_inputs), one per timed run in turn")
    ap.add_argument("--slow-ms", type=float, default=2.0, help="a launch longer than this counts as slow")
    ap.add_argument("--vlog", action="store_true",
                    help="XLA's command-buffer log (TF_CPP_VMODULE=command_buffer_thunk=3); it slows each update")
    ap.add_argument("--device-iters", type=int, default=0,
                    help="also time this many back-to-back steps (the device step, spec_bench's measure)")
    ap.add_argument("--warmup-first", action="store_true",
                    help="Engine.warmup() for the batch size instead of a compiling run of the workload: do the "
                         "first timed launches after the warm-up trace or compile anything?")
    ap.add_argument("--warmup-prefill", action="store_true",
                    help="with --warmup-first: Engine.warmup(prefill=True), every prefill program compiled too")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.collect() and gc.freeze() after the compiling run (the engine freezes once built)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compilation-cache-dir", default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--log", default=None, help="keep the captured stderr here (default: a temporary file)")
    ap.add_argument("--out", default="slow_launches.json")
    args = ap.parse_args()
    if args.vlog:  # read by XLA when it loads: before jax is imported
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
        os.environ["TF_CPP_VMODULE"] = "command_buffer_thunk=3"
    if args.tiny:
        args.dtype = "float32"
    # spec_bench.make_engine reads these
    args.batches, args.disable_by_batch_size, args.enable_prefix_cache = [args.batch], None, False
    ensure_importable()
    import jax
    import jax.numpy as jnp

    from jaxoverlap.buckets import pick
    from jaxoverlap.models.config import ModelConfig
    from jaxoverlap.models.loader import dummy_params
    from jaxoverlap.sampling_params import SamplingParams
    from spec_bench import make_engine, prompts, run_workload

    def run(seed):
        if not args.finish_jitter:
            return run_workload(engine, args, args.batch, args.new_tokens, seed=seed)
        vocab = engine.model_config.vocab_size
        for i, p in enumerate(prompts(args, vocab, args.batch, seed)):
            n = args.new_tokens - (i * args.finish_jitter) // args.batch
            engine.add_request(f"{seed}-{i}", p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
        t = time.perf_counter()
        while engine.has_work():
            engine.step()
        return {"wall_s": time.perf_counter() - t}

    hf = TINY if args.tiny else QWEN3_8B
    cfg = ModelConfig.from_hf_dict(hf)
    params = dummy_params(cfg, jnp.dtype(args.dtype), seed=0)
    engine = make_engine(args, args.algo, "auto", model_dir(hf), cfg, params)
    jax_events = []
    jax.monitoring.register_event_duration_secs_listener(jax_event_recorder(jax_events))
    t = time.perf_counter()
    if args.warmup_first:  # the decode programs; the first run compiles its prefills unless --warmup-prefill
        engine.runner.decode_inputs = args.variants[0]  # the warm-up passes inputs as the first run will
        engine.warmup(batch_sizes=(pick(engine.runner.batch_buckets, args.batch),), prefill=args.warmup_prefill)
        print(f"warm-up {time.perf_counter() - t:.1f} s", flush=True)
    else:
        run(seed=1)  # compiles every program the runs use
        print(f"compiling run {time.perf_counter() - t:.1f} s; gc objects {len(gc.get_objects())}", flush=True)
    jax_events.clear()
    device = {}
    if args.device_iters:
        from spec_bench import device_step_ms, last_ctx_bucket

        ctx = last_ctx_bucket(engine, args)
        ms, accept = device_step_ms(engine, args.batch, ctx, args.device_iters)
        device = {"device_step_ms": ms, "device_accept": accept, "ctx_len": ctx}
        print(f"device step {ms:.3f} ms (accept length {accept:.3f}, ctx {ctx})", flush=True)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    marks, gcs = [], []
    instrument(engine, marks)
    recorder = gc_recorder(gcs)
    gc.callbacks.append(recorder)
    log = open(args.log, "w") if args.log else tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        results = []
        for r in range(args.runs):
            engine.runner.decode_inputs = args.variants[r % len(args.variants)]
            results.append(dict(run(seed=2 + r), variant=engine.runner.decode_inputs))
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        log.close()
    gc.callbacks.remove(recorder)
    for m in marks:
        end = m["start"] + m["wall_ms"] / 1e3
        m["gc_ms"] = sum(g["ms"] for g in gcs if m["start"] <= g["start"] < end)
        m["gc_gens"] = [g["gen"] for g in gcs if m["start"] <= g["start"] < end]
        inside = [e for e in jax_events if m["start"] <= e["end"] <= end]
        m["jax_events"] = {e["name"].rsplit("/", 1)[-1]: round(e["secs"], 4) for e in inside}
    parse_log(log.name, marks)
    rows = summarize(marks, args.slow_ms)
    print_table(rows, list(rows[0]))
    by_gen = {}
    for g in gcs:
        by_gen.setdefault(g["gen"], []).append(g["ms"])
    for m in marks:
        if m["jax_events"]:
            print(f"launch {m['i']} ({m['kind']}, batch {m['batch']}, {m['wall_ms']:.1f} ms): {m['jax_events']}")
    print("collections during the timed runs (generation: count, median ms, max ms): " + "; ".join(
        f"{k}: {len(v)}, {statistics.median(v):.3f}, {max(v):.3f}" for k, v in sorted(by_gen.items())))
    for r in results:
        r.pop("outputs", None)
    with open(args.out, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "args": vars(args),
                   "summary": rows, **device, "launches": marks, "collections": gcs, "runs": results}, f, indent=1)
    print(f"wrote {args.out}; XLA log {log.name}")


if __name__ == "__main__":
    main()
