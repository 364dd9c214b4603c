#!/usr/bin/env python3
"""Host time of the scheduler per decode step, without JAX or a GPU: a serving engine
whose prefix cache holds every old prefix, so that pages run short on nearly every step.

The scheduler (`jaxoverlap/scheduler.py`) drives a stand-in device that returns random
tokens. Before the timed steps the cache is filled with `--cached-pages` pages of
finished requests, as in a server that has been up for a while. Then `--batch` requests
decode together. Every page a growing row needs must be evicted from the cache first.

It reports the host time per decode step of `schedule()` (the engine's "prepare":
median, mean and max) and of `process()` (median), and the pages evicted meanwhile. With `--baseline REV` it also runs the prefix cache of git revision
REV in the same process, so the two can be compared within one run.

    python benchmarks/host_bench.py --batch 32 64 --out host_bench.json
    python benchmarks/host_bench.py --baseline 4b4cdfc      # against an older prefix cache
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_importable, git_commit, print_table  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prefix_cache_at(rev: str):
    """The PrefixCache class as it was at git revision `rev`."""
    src = subprocess.run(["git", "show", f"{rev}:jaxoverlap/prefix_cache.py"], cwd=_ROOT, check=True,
                         capture_output=True, text=True).stdout
    mod = types.ModuleType(f"prefix_cache_{rev}")
    exec(compile(src, f"{rev}:jaxoverlap/prefix_cache.py", "exec"), mod.__dict__)
    return mod.PrefixCache


def run(cache_cls, args, batch: int) -> dict:
    from jaxoverlap.page_allocator import EntryAllocator, PageAllocator
    from jaxoverlap.request import Request
    from jaxoverlap.sampling_params import SamplingParams
    from jaxoverlap.scheduler import Scheduler, SchedulerConfig

    ps = args.page_size
    width = -(-args.max_context // ps) * ps
    # The pool: the cached pages plus the rows of the decoding batch at their start.
    num_pages = args.cached_pages + batch * (-(-args.prompt_len // ps) + 2) + 1
    cfg = SchedulerConfig(page_size=ps, max_running=batch, chunked_prefill_size=8192, max_prefill_requests=batch,
                          max_context_len=args.max_context, table_width=width)
    sched = Scheduler(cfg, PageAllocator(num_pages, ps), EntryAllocator(batch), cache_cls(ps, True))
    rng = np.random.default_rng(0)

    def request(rid, n_prompt, n_new):
        prompt = rng.integers(1, 50000, n_prompt).tolist()
        return Request(rid, prompt, SamplingParams(max_new_tokens=n_new, temperature=0.0, ignore_eos=True), seed=0)

    def step():
        """One loop iteration in the normal order: schedule, run, process. Returns its times."""
        t0 = time.perf_counter()
        b = sched.schedule()
        t1 = time.perf_counter()
        if b is None:
            return None
        tokens = rng.integers(1, 50000, len(b.rows))
        sched.process(b, tokens, np.zeros(len(b.rows)))
        sched.poll_finished()
        return b.kind, t1 - t0, time.perf_counter() - t1

    # Fill the cache: finished requests with distinct prompts of whole pages.
    per = max(1, args.prompt_len // ps)
    n_fill = -(-args.cached_pages // per)
    for i in range(n_fill):
        sched.add(request(f"old{i}", per * ps, 1))
        if (i + 1) % batch == 0 or i == n_fill - 1:
            while sched.has_work():
                step()
    cached = sched.prefix.num_pages
    # The timed workload: `batch` requests decoding together from a full cache. Prompt
    # lengths differ, so rows cross page boundaries (and need a page) on different steps.
    for i in range(batch):
        n_prompt = int(rng.integers(args.prompt_len // 2, args.prompt_len * 3 // 2))
        sched.add(request(f"new{i}", n_prompt, args.steps + 1))
    gc.collect()  # the fill's garbage: its collection would land in some timed step
    evicted = []
    evict = sched.prefix.evict

    def counting_evict(n):
        got = evict(n)
        evicted.extend(got)
        return got

    sched.prefix.evict = counting_evict
    prepare, process = [], []
    while sched.has_work():
        got = step()
        if got is not None and got[0] == "decode" and len(sched.running) == batch:
            prepare.append(got[1])
            process.append(got[2])
    sched.check_integrity()
    ms = lambda xs, f: float(f(xs)) * 1e3  # noqa: E731
    return {"batch": batch, "cached_pages": cached, "decode_steps": len(prepare), "pages_evicted": len(evicted),
            "prepare_ms": ms(prepare, np.median), "prepare_mean_ms": ms(prepare, np.mean),
            "prepare_max_ms": ms(prepare, np.max), "process_ms": ms(process, np.median)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--cached-pages", type=int, default=40000, help="pages of old prefixes in the cache")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=200, help="decode steps of the timed requests")
    ap.add_argument("--baseline", default=None, help="git revision whose prefix cache also runs")
    ap.add_argument("--out", default="host_bench.json")
    args = ap.parse_args()
    ensure_importable()
    from jaxoverlap.prefix_cache import PrefixCache

    caches = [("current", PrefixCache)]
    if args.baseline:
        caches.append((f"prefix cache of {args.baseline}", prefix_cache_at(args.baseline)))
    rows = []
    for batch in args.batch:
        for name, cls in caches:
            rows.append({"prefix_cache": name, **run(cls, args, batch)})
            print_table(rows[-1:], list(rows[-1]))
    print("\nsummary (ms per decode step, host only)")
    print_table(rows, list(rows[0]))
    meta = {"commit": git_commit(), "python": platform.python_version(), "machine": platform.machine(),
            "args": vars(args)}
    with open(args.out, "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
