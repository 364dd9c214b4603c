"""Why does the host spend ~2 ms inside the jitted decode call? (GPU diagnostics, issue 4.)

For each XLA flag variant (one subprocess each, since XLA_FLAGS is read at backend start)
this calls `steps.decode_step` directly on Qwen3-8B shapes with dummy weights and device
inputs, and measures:

- dispatch_ms: the time the jitted call takes to return while earlier steps still run;
- period_ms: wall time per step of a run of async steps (the device-bound step time);
- sync_ms: call plus wait, one step at a time (what the normal loop pays);
- args_ms: the dispatch of a trivial jitted function over the same arguments (JAX's own
  argument handling, without the step's kernels);
- with --paced, the same call paced as in the engine loop (`paced_dispatch`);
- with --unroll N..., programs of N chained decode steps, paced the same way: the launch
  cost per decode step if one launch ran several (`unrolled_dispatch`);
- with --trace, a profiler trace of a few steps: device ops per step and the host-side
  events that take the dispatch time;
- with --addresses, which argument and output buffers move between calls (`address_report`);
- with --stable-out, the step writing its outputs into donated buffers, so that no buffer
  moves and XLA need not update the graph (`stable_output_dispatch`);
- with --alternate, two executables of the same step used in turn, so that each sees its
  outputs at one address (`alternating_dispatch`);
- with --host-out, the step placing its packed output in pinned host memory itself, with
  no copy to start after the call (`host_output_dispatch`);
- variants vlog_update / vlog_thunk: XLA's own logs of each graph update (`_vlog_summary`).

    python benchmarks/launch_probe.py --batches 1 32 --out launch.json --trace-dir $OUT
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, median, model_dir, print_table, run_variant  # noqa: E402

VARIANTS = {
    "default": "",
    "cmdbuf_off": "--xla_gpu_enable_command_buffer=",
    "cmdbuf_all_min1": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN "
                       "--xla_gpu_graph_min_graph_size=1",
    # XLA updates a recorded CUDA graph whenever a buffer address changed since the last run
    # (the step's small inputs and outputs are new buffers every step). Newer XLA can give
    # the graph's buffers stable virtual addresses instead (the VMM allocator), chosen by
    # `xla_gpu_command_buffer_update_mode`, whose value names changed between XLA versions
    # (ALWAYS_UPDATE / NEVER_UPDATE / CAPTURE_CMD_NEVER_UPDATE, then SKIP_TEMP /
    # SKIP_PROFILED, then DYNAMIC_ALLOCATE / VMM_PERSISTENT_TEMP). A name the installed
    # jaxlib does not know stops that variant at start-up, which the table reports.
    **{f"update_{mode.lower()}": f"--xla_gpu_command_buffer_update_mode={mode}"
       for mode in ("NEVER_UPDATE", "CAPTURE_CMD_NEVER_UPDATE", "SKIP_TEMP", "SKIP_PROFILED", "VMM_PERSISTENT_TEMP")},
    "va_remap": "--xla_gpu_enable_command_buffer_va_remapping=true",
    # Order of the recorded graph: a chain of nodes or a DAG of independent branches.
    **{f"sched_{m.lower()}": f"--xla_gpu_command_buffer_scheduling_mode={m}" for m in ("SERIALIZE", "CONCURRENT", "LHS")},
    "vlog_update": "",  # default flags, with XLA's command-buffer logging on (VARIANT_ENV)
    "vlog_thunk": "",
}
# Environment beyond XLA_FLAGS. vlog_update: XLA's logs of when and why it updates the step's
# CUDA graph (C++ VLOG of the command-buffer thunk and of the graph itself); `_vlog_summary`
# counts them per call.
VARIANT_ENV = {
    "vlog_update": {"TF_CPP_MIN_LOG_LEVEL": "0",
                    "TF_CPP_VMODULE": "command_buffer_thunk=3,command_buffer_cmd=2,command_buffer_cmd_emitter=2,"
                                      "gpu_command_buffer=2,cuda_command_buffer=2,command_buffer_conversion_pass=2"},
    # Everything the thunk logs (which allocations changed, where this XLA says so); no
    # per-node lines, which would drown it.
    "vlog_thunk": {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "command_buffer_thunk=10,command_buffer_cmd=10"},
}


def _vlog_summary(stderr: str, top: int = 40) -> dict:
    """XLA's log lines, grouped with their numbers blanked out: how often each message came,
    with one example of it (the first). Lines are matched loosely (any VLOG from the modules
    above), so the summary shows whatever this XLA version logs."""
    import re

    groups: dict[str, list] = {}
    for line in stderr.splitlines():
        m = re.match(r"^[IWE]\d{4} [\d:.]+\s+\d+ (\S+?):\d+\] (.*)$", line)
        if not m:
            continue
        key = m.group(1) + ": " + re.sub(r"0x[0-9a-f]+|\d+", "N", m.group(2))[:160]
        g = groups.setdefault(key, [0, line[:400]])
        g[0] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    # How many allocations changed per graph update, by graph size ("num_commands").
    updates = collections.Counter(re.findall(r"num_commands=(\d+); updated_allocs=(\d+)", stderr))
    return {"lines": sum(g[0] for g in groups.values()),
            "updates_by_size": {f"{n} commands, {u} allocs changed": c for (n, u), c in updates.most_common(20)},
            "messages": [{"count": c, "pattern": k, "example": ex} for k, (c, ex) in ranked]}


def _trace_summary(trace_dir: str, steps: int) -> dict:
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return {"error": "no trace file"}
    ev = json.load(gzip.open(files[0]))
    evs = ev["traceEvents"] if isinstance(ev, dict) else ev
    procs = {e["pid"]: e["args"]["name"] for e in evs if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in evs
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    dev = [e for e in evs if e.get("ph") == "X" and "/device:GPU" in procs.get(e.get("pid"), "")]
    host = [e for e in evs if e.get("ph") == "X" and "/device:GPU" not in procs.get(e.get("pid"), "")]
    by_host = collections.Counter()
    count_host = collections.Counter()
    for e in host:
        key = f"{threads.get((e['pid'], e['tid']), e['tid'])} | {e['name'][:80]}"
        by_host[key] += e["dur"]
        count_host[key] += 1
    by_dev = collections.Counter()
    count_dev = collections.Counter()
    for e in dev:
        by_dev[e["name"][:80]] += e["dur"]
        count_dev[e["name"][:80]] += 1
    # Idle device time: the gaps between one kernel's end and the next one's start (over the
    # union of the device streams), which is where a step of many small kernels loses time.
    idle, end = 0.0, None
    for e in sorted(dev, key=lambda e: e["ts"]):
        if end is not None and e["ts"] > end:
            idle += e["ts"] - end
        end = max(end or 0.0, e["ts"] + e["dur"])
    sample_args = [e.get("args", {}) for e in dev[:3]]
    return {
        "files": files,
        "device_ops_per_step": len(dev) / steps,
        "device_busy_us_per_step": sum(e["dur"] for e in dev) / steps,
        "device_idle_us_per_step": idle / steps,
        "top_device_ops_us_per_step": {k: v / steps for k, v in by_dev.most_common(12)},
        # name: [count per step, us per step], every kernel name
        "device_ops": {k: [count_dev[k] / steps, v / steps] for k, v in by_dev.most_common()},
        "top_host_events_us_per_step": {k: (v / steps, count_host[k] / steps) for k, v in by_host.most_common(25)},
        "device_event_args_sample": sample_args,
    }


def stable_address_dispatch(r, B, kw, reset_lengths, iters) -> dict:
    """Is the dispatch time the CUDA graph update that changed buffer addresses force?

    The same decode step with its input array (entries, reservations) baked into the
    program as constants, so that every argument is a buffer that stays put (the weights,
    and the donated state, whose outputs alias it): once still returning the sampled tokens
    (a new output buffer per step), once returning the state only."""
    import jax
    import numpy as np

    from jaxoverlap import steps

    inputs = steps.DecodeInputs.of(np.arange(1, B + 1, dtype=np.int32),
                                   steps.Reservations.empty(max(8, B * r.decode_pages_per_row)))

    def inner(p, s):
        return steps.decode_step(p, s, inputs, **kw)

    with_tokens = jax.jit(inner, donate_argnums=1)
    state_only = jax.jit(lambda p, s: inner(p, s)[0], donate_argnums=1)
    out = {}
    for name, fn, returns_tokens in (("const_inputs", with_tokens, True), ("const_inputs_state_only", state_only, False)):
        def call():
            got = fn(r.params, r.state)
            r.state = got[0] if returns_tokens else got

        reset_lengths()
        t = time.perf_counter()
        call()
        jax.block_until_ready(r.state.relay.seq_lens)
        out[f"{name}_compile_s"] = time.perf_counter() - t
        reset_lengths()
        ts = []
        t0 = time.perf_counter()
        for _ in range(iters):
            t = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t)
        jax.block_until_ready(r.state.relay.seq_lens)
        out[f"{name}_dispatch_ms"] = median(ts[2:]) * 1e3
        out[f"{name}_period_ms"] = (time.perf_counter() - t0) / iters * 1e3
    return out


def paced_dispatch(r, inputs, kw, reset_lengths, iters) -> dict:
    """Why is the same call slower in the engine loop than back to back? The engine keeps one
    step in flight and blocks on the previous step's tokens between launches; back to back,
    the host runs far ahead and never waits. Each mode paces the same call differently and
    reports the median time the call takes to return:

    - engine_block: launch N+1, start its tokens' copy, then block on step N's tokens
      (np.asarray), as the overlap loop does;
    - engine_spin: the same, but poll `is_ready()` until step N is done before reading, so
      the thread never sleeps in the driver;
    - engine_block_nocopy: engine_block without copy_to_host_async;
    - sleep_1ms / spin_1ms: back to back (the queue grows) with 1 ms of idle sleep or busy
      spinning between calls: does an idle host thread alone make the next call slower?
    """
    import jax
    import numpy as np

    from jaxoverlap import steps

    def call():
        r.state, o = steps.decode_step(r.params, r.state, inputs, **kw)
        return o

    def spin_until(deadline):
        while time.perf_counter() < deadline:
            pass

    out = {}
    for mode in ("engine_block", "engine_spin", "engine_block_nocopy", "sleep_1ms", "spin_1ms"):
        reset_lengths()
        prev = call()
        jax.block_until_ready(prev.packed)
        ts, waits = [], []
        t0 = time.perf_counter()
        for _ in range(iters):
            t = time.perf_counter()
            o = call()
            ts.append(time.perf_counter() - t)
            if mode.startswith("engine"):
                if mode != "engine_block_nocopy":
                    o.packed.copy_to_host_async()
                tw = time.perf_counter()
                if mode == "engine_spin":
                    while not prev.packed.is_ready():
                        pass
                np.asarray(prev.packed)
                waits.append(time.perf_counter() - tw)
                prev = o
            elif mode == "sleep_1ms":
                time.sleep(1e-3)
            else:
                spin_until(time.perf_counter() + 1e-3)
        jax.block_until_ready(o.packed)
        out[f"{mode}_dispatch_ms"] = median(ts[2:]) * 1e3
        out[f"{mode}_period_ms"] = (time.perf_counter() - t0) / iters * 1e3
        if waits:
            out[f"{mode}_wait_ms"] = median(waits[2:]) * 1e3
    return out


def address_report(r, inputs, kw, reset_lengths, calls: int = 6) -> dict:
    """Which buffers of the decode call move between calls? XLA re-records the CUDA graph's
    nodes whose buffers changed address since the last run. The state is donated (outputs
    alias inputs), so its leaves should keep their addresses; the outputs are new buffers.
    Returns, per argument and output leaf whose address changed, how many distinct addresses
    it had over `calls` calls."""
    import jax

    from jaxoverlap import steps

    def addresses(tree, prefix):
        flat, _ = jax.tree_util.tree_flatten_with_path(tree)
        return {prefix + jax.tree_util.keystr(path): x.unsafe_buffer_pointer() for path, x in flat
                if hasattr(x, "unsafe_buffer_pointer")}

    reset_lengths()
    seen: dict[str, set] = {}
    prev = None
    for _ in range(calls):
        args = {**addresses(r.params, "params"), **addresses(r.state, "state"), **addresses(inputs, "inputs")}
        r.state, o = steps.decode_step(r.params, r.state, inputs, **kw)
        outs = addresses(o, "out")
        for k, v in {**args, **outs}.items():
            seen.setdefault(k, set()).add(v)
        if prev is not None:
            jax.block_until_ready(prev.packed)
        prev = o  # keep one step's outputs alive, as the engine does
    jax.block_until_ready(prev.packed)
    moved = {k: len(v) for k, v in seen.items() if len(v) > 1}
    return {"address_calls": calls, "address_leaves": len(seen), "address_moved": moved}


def stable_output_dispatch(r, inputs, kw, reset_lengths, iters) -> dict:
    """Does the graph update go away when no buffer moves? The decode call's only moving
    buffers are its fresh outputs (tokens, logprobs: `address_report`), and XLA updates the
    recorded CUDA graph for them on every call. Here the step writes them into donated
    buffers instead (same address every call) and a tiny second call copies them out for the
    host, whose own fresh output is too small a program for a CUDA graph. Timed back to
    back and in the engine pattern (launch N+1, copy it out, block on N's copy)."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxoverlap import steps

    @functools.partial(jax.jit, static_argnames=tuple(kw), donate_argnames=("state", "out"))
    def step_into(params, state, out, inputs, **static):
        state, o = steps.decode_step(params, state, inputs, **static)
        # Written into `out` (not just shaped like it): an argument the result does not
        # use is dropped from the program, and its donation with it.
        return state, jax.tree.map(lambda b, x: jax.lax.dynamic_update_slice(b, x.astype(b.dtype), (0,) * b.ndim),
                                   out, o)

    copy_out = jax.jit(lambda o: jax.tree.map(jnp.copy, o))

    reset_lengths()
    r.state, o = steps.decode_step(r.params, r.state, inputs, **kw)
    out = jax.tree.map(jnp.zeros_like, o)
    r.state, out = step_into(r.params, r.state, out, inputs, **kw)  # compile
    jax.block_until_ready(copy_out(out))
    res_ = {}
    reset_lengths()
    ts, where = [], set()
    t0 = time.perf_counter()
    for _ in range(iters):
        t = time.perf_counter()
        r.state, out = step_into(r.params, r.state, out, inputs, **kw)
        ts.append(time.perf_counter() - t)
        where.add(out.packed.unsafe_buffer_pointer())
    jax.block_until_ready(out)
    res_["stable_out_distinct_addresses"] = len(where)  # 1: the donation kept them in place
    res_["stable_out_back_to_back_dispatch_ms"] = median(ts[2:]) * 1e3
    res_["stable_out_back_to_back_period_ms"] = (time.perf_counter() - t0) / iters * 1e3
    reset_lengths()
    prev = copy_out(out)
    jax.block_until_ready(prev)
    ts, tc, waits = [], [], []
    for _ in range(iters):
        t = time.perf_counter()
        r.state, out = step_into(r.params, r.state, out, inputs, **kw)
        t1 = time.perf_counter()
        o = copy_out(out)
        t2 = time.perf_counter()
        o.packed.copy_to_host_async()
        np.asarray(prev.packed)
        waits.append(time.perf_counter() - t2)
        ts.append(t1 - t)
        tc.append(t2 - t1)
        prev = o
    jax.block_until_ready(prev)
    res_["stable_out_engine_dispatch_ms"] = median(ts[2:]) * 1e3
    res_["stable_out_engine_copy_out_ms"] = median(tc[2:]) * 1e3
    res_["stable_out_engine_wait_ms"] = median(waits[2:]) * 1e3
    return res_


def alternating_dispatch(r, inputs, kw, reset_lengths, iters) -> dict:
    """Does a second executable of the same step remove the per-call graph update?

    XLA keeps one recorded CUDA graph per executable and updates it when a buffer moved
    since that executable's last run. In the engine's pattern the outputs of step N are
    still alive while step N+1 is launched, so one executable sees its outputs alternate
    between two addresses and updates its graph on every call. Two executables used in turn
    each see the same output address every other step. Two ways to get the second one:
    - jit: a second `jax.jit` of the same function (a second compilation);
    - aot: the compiled step serialized and loaded again (no compilation).
    Each mode runs the engine pattern (launch N+1, start its outputs' copies, block on N)
    and reports the call's median time and how many output addresses each executable saw.
    """
    import jax
    import numpy as np
    from jax.experimental import serialize_executable

    from jaxoverlap import steps

    static = dict(kw)

    def same_step(params, state, inputs):
        return steps.decode_step.__wrapped__(params, state, inputs, **static)

    one = lambda p, s, i: steps.decode_step(p, s, i, **static)  # noqa: E731
    t = time.perf_counter()
    jit_twin = jax.jit(same_step, donate_argnums=1)
    reset_lengths()
    r.state, o = jit_twin(r.params, r.state, inputs)
    jax.block_until_ready(o.packed)
    out = {"alt_jit_twin_compile_s": time.perf_counter() - t}
    t = time.perf_counter()
    compiled = steps.decode_step.lower(r.params, r.state, inputs, **static).compile()
    blob, in_tree, out_tree = serialize_executable.serialize(compiled)
    loaded = serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
    out["alt_aot_copy_s"] = time.perf_counter() - t
    aot_a = lambda p, s, i: compiled(p, s, i)  # noqa: E731
    aot_b = lambda p, s, i: loaded(p, s, i)  # noqa: E731
    modes = {"single": (one, one), "single_aot": (aot_a, aot_a), "alt_jit": (one, jit_twin),
             "alt_aot": (aot_a, aot_b)}
    for name, fns in modes.items():
        for copies in (True, False):
            mode = name + ("" if copies else "_nocopy")
            reset_lengths()
            r.state, prev = fns[0](r.params, r.state, inputs)
            jax.block_until_ready(prev.packed)
            ts, where = [], [set(), set()]
            for i in range(iters):
                fn = fns[(i + 1) % 2]
                t = time.perf_counter()
                r.state, o = fn(r.params, r.state, inputs)
                ts.append(time.perf_counter() - t)
                where[(i + 1) % 2].add(o.packed.unsafe_buffer_pointer())
                if copies:
                    o.packed.copy_to_host_async()
                np.asarray(prev.packed)
                prev = o
            jax.block_until_ready(prev.packed)
            out[f"{mode}_dispatch_ms"] = median(ts[2:]) * 1e3
            out[f"{mode}_out_addresses"] = [len(w) for w in where]
    return out


def host_output_dispatch(r, inputs, kw, reset_lengths, iters) -> dict:
    """Would the step writing its packed output straight into pinned host memory shorten the
    launch? The engine starts one `copy_to_host_async` per step after the call; here the
    program itself places the output in host memory (`jax.device_put` to a `pinned_host`
    sharding inside the jit), so no copy is started. Both modes run two serialized copies
    of their program in turn, as the engine does, in the engine pattern (launch N+1, block
    on N's output); reports the call's median, the wait, and whether the tokens agree."""
    import jax
    import numpy as np
    from jax.experimental import serialize_executable

    from jaxoverlap import steps

    static = dict(kw)
    device = inputs.packed.devices().pop()
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")

    def to_host(params, state, inputs):
        state, o = steps.decode_step.__wrapped__(params, state, inputs, **static)
        return state, steps.StepOutput(jax.device_put(o.packed, host))

    def pair(fn):
        compiled = fn.lower(r.params, r.state, inputs).compile()
        blob, in_tree, out_tree = serialize_executable.serialize(compiled)
        return compiled, serialize_executable.deserialize_and_load(blob, in_tree, out_tree)

    t = time.perf_counter()
    plain = pair(jax.jit(lambda p, s, i: steps.decode_step.__wrapped__(p, s, i, **static), donate_argnums=1))
    pinned = pair(jax.jit(to_host, donate_argnums=1))
    out = {"host_out_compile_s": time.perf_counter() - t}
    last = {}
    start_tokens = np.asarray(r.state.relay.tokens)  # both modes start from the same tokens and lengths
    for mode, fns, copies in (("device_out", plain, True), ("pinned_out", pinned, False)):
        reset_lengths()
        relay = dataclasses.replace(r.state.relay, tokens=jax.device_put(start_tokens, device))
        r.state = dataclasses.replace(r.state, relay=relay)
        r.state, prev = fns[0](r.params, r.state, inputs)
        np.asarray(prev.packed)
        out[f"{mode}_memory_kind"] = prev.packed.sharding.memory_kind
        ts, waits = [], []
        for i in range(iters):
            t = time.perf_counter()
            r.state, o = fns[(i + 1) % 2](r.params, r.state, inputs)
            if copies:
                o.packed.copy_to_host_async()
            t1 = time.perf_counter()
            last[mode] = np.asarray(prev.packed)
            ts.append(t1 - t)
            waits.append(time.perf_counter() - t1)
            prev = o
        last[mode] = np.asarray(prev.packed)
        out[f"{mode}_dispatch_ms"] = median(ts[2:]) * 1e3
        out[f"{mode}_wait_ms"] = median(waits[2:]) * 1e3
    out["host_out_tokens_equal"] = bool(np.array_equal(last["device_out"], last["pinned_out"]))
    return out


def unrolled_dispatch(r, inputs, kw, reset_lengths, iters, unroll) -> dict:
    """Would several decode steps per launch amortise the launch? For each n in `unroll`,
    one program chains n decode steps (each feeds the next through the relay, as
    consecutive launches do) and is called as the overlap loop calls a step: launch, start
    the tokens' copy, block on the previous launch's tokens. Reports the time the call takes
    to return, per call and per decode step, and the wall time per decode step. The
    scheduler cannot do this yet: it is the measurement that decides whether to build it."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxoverlap import steps

    out = {}
    for n in unroll:
        def chain(p, s, inputs, n=n):
            tokens = []
            for _ in range(n):
                s, o = steps.decode_step(p, s, inputs, **kw)  # inlined: one program
                tokens.append(o.tokens)
            return s, jnp.stack(tokens)  # [n, B]

        fn = jax.jit(chain, donate_argnums=1)
        reset_lengths()
        t = time.perf_counter()
        r.state, prev = fn(r.params, r.state, inputs)
        jax.block_until_ready(prev)
        out[f"unroll{n}_compile_s"] = time.perf_counter() - t
        calls = max(4, iters // n)
        reset_lengths()
        ts = []
        t0 = time.perf_counter()
        for _ in range(calls):
            t = time.perf_counter()
            r.state, toks = fn(r.params, r.state, inputs)
            ts.append(time.perf_counter() - t)
            toks.copy_to_host_async()
            np.asarray(prev)
            prev = toks
        jax.block_until_ready(prev)
        out[f"unroll{n}_dispatch_ms"] = median(ts[2:]) * 1e3
        out[f"unroll{n}_dispatch_per_step_ms"] = median(ts[2:]) * 1e3 / n
        out[f"unroll{n}_period_per_step_ms"] = (time.perf_counter() - t0) / (calls * n) * 1e3
    return out


def child(args) -> dict:
    ensure_importable()
    import jax
    import numpy as np

    from jaxoverlap import steps
    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine

    max_b = max(args.batches)
    engine = Engine(EngineConfig(
        model=model_dir(TINY if args.tiny else QWEN3_8B), load_format="dummy",
        dtype="float32" if args.tiny else "bfloat16", max_running_requests=max_b,
        max_context_len=1024, kv_cache_tokens=max_b * 512, page_size=16, batch_buckets=tuple(sorted(args.batches)),
        attention_backend=args.attention_backend, disable_prefix_cache=True,
    ))
    r = engine.runner
    ps = r.page_size
    out = {"variant": args.variant, "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__,
           "attention": args.attention_backend, "rows": []}
    stable_job = None
    for B in args.batches:
        pages_per_row = 256 // ps
        cap = B * pages_per_row
        entries = np.arange(1, B + 1, dtype=np.int32)
        ent_np = np.repeat(entries, pages_per_row)
        inputs_full = jax.device_put(steps.DecodeInputs.of(entries, steps.Reservations.of(
            ent_np, np.tile(np.arange(pages_per_row, dtype=np.int32), B), np.arange(1, cap + 1, dtype=np.int32))))
        inputs_none = jax.device_put(steps.DecodeInputs.of(entries, steps.Reservations.empty(cap)))
        kw = dict(cfg=r.model_cfg, ctx_len=r.ctx_buckets[0], page_size=ps, attention=r.attention, sampling=False)

        def reset_lengths():
            relay = dataclasses.replace(r.state.relay, seq_lens=r.state.relay.seq_lens.at[1:B + 1].set(128))
            r.state = dataclasses.replace(r.state, relay=relay)

        t = time.perf_counter()
        r.state, o = steps.decode_step(r.params, r.state, inputs_full, **kw)
        jax.block_until_ready(o.packed)
        compile_s = time.perf_counter() - t

        def run_async(n):
            ts = []
            t0 = time.perf_counter()
            for _ in range(n):
                t = time.perf_counter()
                r.state, o = steps.decode_step(r.params, r.state, inputs_none, **kw)
                ts.append(time.perf_counter() - t)
            jax.block_until_ready(o.packed)
            return ts, (time.perf_counter() - t0) / n

        reset_lengths()
        run_async(5)
        reset_lengths()
        ts, period = run_async(args.iters)
        sync = []
        reset_lengths()
        for _ in range(args.iters):
            t = time.perf_counter()
            r.state, o = steps.decode_step(r.params, r.state, inputs_none, **kw)
            jax.block_until_ready(o.packed)
            sync.append(time.perf_counter() - t)

        trivial = jax.jit(lambda p, s, i: s.relay.seq_lens[i.entries] + i.reservations.pages[0])
        jax.block_until_ready(trivial(r.params, r.state, inputs_none))
        targs = []
        for _ in range(30):
            t = time.perf_counter()
            y = trivial(r.params, r.state, inputs_none)
            targs.append(time.perf_counter() - t)
        jax.block_until_ready(y)

        # Same greedy tokens in every variant, or the variant is wrong, not just fast.
        checksum = int(np.asarray(o.tokens, np.int64).sum())
        row = {"batch": B, "compile_s": compile_s, "tokens_checksum": checksum, "dispatch_ms": median(ts[2:]) * 1e3, "period_ms": period * 1e3,
               "sync_ms": median(sync[2:]) * 1e3, "args_ms": median(targs[3:]) * 1e3}
        if args.variant == "default" and B == args.batches[0] and not args.no_stable:
            # Run last: its extra steps write the cache, and the checksums of the other
            # batches must not depend on whether it ran.
            stable_job = (row, B, kw, reset_lengths)
        if args.trace_dir and B == args.batches[0]:
            d = tempfile.mkdtemp()
            reset_lengths()
            n = 6
            jax.profiler.start_trace(d, create_perfetto_trace=True)
            for _ in range(n):
                r.state, o = steps.decode_step(r.params, r.state, inputs_none, **kw)
            jax.block_until_ready(o.packed)
            jax.profiler.stop_trace()
            row["trace"] = _trace_summary(d, n)
            os.makedirs(args.trace_dir, exist_ok=True)
            for f in glob.glob(os.path.join(d, "**", "*.json.gz"), recursive=True):
                kind = "perfetto" if "perfetto" in os.path.basename(f) else "trace"
                dst = os.path.join(args.trace_dir, f"launch_{kind}_{args.variant}_{args.attention_backend}_b{B}.json.gz")
                shutil.copy(f, dst)
        if args.paced:  # after the checksum: its extra steps write the cache
            row.update(paced_dispatch(r, inputs_none, kw, reset_lengths, args.iters))
        if args.stable_out:  # after the checksum, like the paced calls
            row.update(stable_output_dispatch(r, inputs_none, kw, reset_lengths, args.iters))
        if args.addresses:  # after the checksum, like the paced calls
            row.update(address_report(r, inputs_none, kw, reset_lengths))
        if args.alternate:  # after the checksum, like the paced calls
            row.update(alternating_dispatch(r, inputs_none, kw, reset_lengths, args.iters))
        if args.host_out:  # after the checksum, like the paced calls
            row.update(host_output_dispatch(r, inputs_none, kw, reset_lengths, args.iters))
        if args.unroll:  # after the checksum, like the paced calls
            row.update(unrolled_dispatch(r, inputs_none, kw, reset_lengths, args.iters, args.unroll))
        out["rows"].append(row)
        print(json.dumps(row)[:3000], flush=True)
    if stable_job is not None:
        row, B, kw, reset_lengths = stable_job
        row.update(stable_address_dispatch(r, B, kw, reset_lengths, args.iters))
        print(json.dumps(row)[:3000], flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--timeout-s", type=int, default=150, help="per variant")
    ap.add_argument("--out", default="launch.json")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    ap.add_argument("--no-stable", action="store_true", help="skip the constant-input programs (two compilations)")
    ap.add_argument("--paced", action="store_true", help="also time the call paced as in the engine loop")
    ap.add_argument("--unroll", type=int, nargs="*", default=[],
                    help="also time programs of this many chained decode steps, paced as in the engine")
    ap.add_argument("--addresses", action="store_true", help="also report which buffers move between calls")
    ap.add_argument("--stable-out", action="store_true",
                    help="also time the step writing its outputs into donated buffers (no graph update)")
    ap.add_argument("--alternate", action="store_true",
                    help="also time two executables of the step used in turn (no graph update per call)")
    ap.add_argument("--host-out", action="store_true",
                    help="also time the step writing its packed output into pinned host memory")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--variant", default="default")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    results = []
    for name in args.variants:
        child_args = ["--iters", str(args.iters), "--attention-backend", args.attention_backend,
                      "--batches", *map(str, args.batches)]
        if args.trace_dir:
            child_args += ["--trace-dir", args.trace_dir]
        for flag in ("tiny", "no_stable", "paced", "addresses", "stable_out", "alternate", "host_out"):
            if getattr(args, flag):
                child_args.append("--" + flag.replace("_", "-"))
        if args.unroll:
            child_args += ["--unroll", *map(str, args.unroll)]
        result, stderr = run_variant(__file__, name, VARIANTS[name], child_args, args.timeout_s, VARIANT_ENV.get(name))
        if name in VARIANT_ENV and "rows" in result:
            result["vlog"] = _vlog_summary(stderr)
            for m in result["vlog"]["messages"][:15]:
                print(f"  vlog {m['count']:7d}  {m['pattern']}", flush=True)
        results.append(result)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    table = [dict(variant=res["variant"], **{k: v for k, v in row.items() if k != "trace"})
             for res in results for row in res.get("rows", [])]
    if table:
        print_table(table, ["variant", "batch", "compile_s", "dispatch_ms", "period_ms", "sync_ms", "args_ms",
                            "tokens_checksum", "const_inputs_dispatch_ms", "const_inputs_state_only_dispatch_ms"])
        paced = [k for k in table[0] if k.endswith(("_dispatch_ms", "_wait_ms", "_per_step_ms", "_addresses"))
                 and not k.startswith("const")]
        if len(paced) > 1:
            print_table(table, ["variant", "batch", *paced])


if __name__ == "__main__":
    main()
