"""How much of the decode launch is the call's signature, and how much the program? (issue 4)

The engine's launch of a decode step is mostly JAX's, PjRt's and XLA's host work per
execution (benchmarks/RESULTS.md). Part of that work is per argument and per output buffer
(flattening, signature checks, usage holds, donation, new output arrays), part per command
of the step's CUDA graph. This probe separates them. It launches, paced as the engine's
overlap loop does (launch N+1, start its output's copy to the host, then wait for N):

- step: the real decode step through the runner (two executables in turn);
- same_leaves: a trivial program over the same arguments (`keep_unused`, so none is
  pruned), the state donated and handed back, one packed output;
- packed_relay: the same with the relay's ten [E] arrays as one [E, 8] int32 array and
  its hidden state (the state then has 5 leaves instead of 13);
- one_weight: the same as same_leaves with one weight array instead of all of them;
- bare: the step's input array only, no state, no weights;
- with --fresh-inputs, the step with its input array sent anew every step.

Each trivial program also runs three [n, n] matrix products, so that, as in the engine,
the device is busy with step N while the host launches N+1. Prints a table, writes JSON.

    python benchmarks/signature_floor.py --batches 1 32 --out signature.json
    python benchmarks/signature_floor.py --tiny          # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, git_commit, median, model_dir, print_table  # noqa: E402
from slow_launches import thread_usage, usage_delta  # noqa: E402


def paced_launch_ms(call, iters: int) -> float:
    """Median time until `call()` returns, paced as the overlap loop: launch N+1, start its
    copy, then wait for N's copy. `call` returns the array the host reads."""
    import numpy as np

    prev = call()
    prev.copy_to_host_async()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        out = call()
        out.copy_to_host_async()
        ts.append(time.perf_counter() - t)
        np.asarray(prev)
        prev = out
    np.asarray(prev)
    return median(ts[3:]) * 1e3


MODES = ("back_to_back", "paced", "paced_delay_0.5", "paced_delay_2", "idle", "spin_copy", "spin_nocopy", "queue3",
         "back_to_back_sleep", "back_to_back_pollute", "back_to_back_spin", "paced_spin_wait")


def launch_modes(call, iters: int, modes=MODES, spin_wait_s: float = 6e-3) -> dict:
    """The same launch in other paces, each as (median wall ms, median thread CPU ms) of the
    call: is the paced launch slow because the thread works longer (CPU time grows with the
    wall) or because it waits inside the call (CPU time stays, the wall grows)?

    - back_to_back: calls in a row, no copies, no waits (the device queue grows);
    - paced: as `paced_launch_ms`;
    - paced_delay_X: paced, but X ms of busy spinning after the wait, before the next launch
      (the device is still busy with the step launched before);
    - idle: the device finished everything, then 2 ms of sleep, then the launch;
    - spin_copy: paced, but the host polls `is_ready()` of step N until it is done and only
      then reads it (the copy started at launch), so it sleeps only for the copy's end;
    - spin_nocopy: the same without copy_to_host_async: the read copies synchronously;
    - queue3: paced three steps deep (wait for N-2 after launching N+1): blocking waits,
      but more steps queued;
    - back_to_back_sleep: back to back with 4 ms of sleep between calls, no reads;
    - back_to_back_spin: the same with 4 ms of busy spinning instead of the sleep;
    - paced_spin_wait: paced, but the host spins `spin_wait_s` (longer than a step) before it
      reads step N, so the read finds it done and the thread never sleeps;
    - back_to_back_pollute: back to back, but between calls the thread sums a fresh 8 MB
      array (it evicts the launch's code and data from the core's caches), no reads."""
    import jax
    import numpy as np

    def timed(fn):
        u = thread_usage()
        t, c = time.perf_counter(), time.thread_time()
        out = fn()
        w, c = time.perf_counter() - t, time.thread_time() - c
        usages.append(usage_delta(u, thread_usage()))
        return out, w, c

    def spin(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    res = {}
    big = np.ones((1 << 20,), np.float64)
    for mode in modes:
        jax.block_until_ready(call())
        walls, cpus, usages = [], [], []
        queue = []
        for _ in range(iters):
            if mode == "idle":
                time.sleep(2e-3)
            out, w, c = timed(call)
            walls.append(w)
            cpus.append(c)
            if mode == "back_to_back_sleep":
                time.sleep(4e-3)
            if mode == "back_to_back_spin":
                spin(4e-3)
            if mode == "back_to_back_pollute":
                (big + 1.0).sum()
            if mode.startswith("back_to_back"):
                continue
            if mode != "spin_nocopy":
                out.copy_to_host_async()
            if mode == "idle":
                np.asarray(out)
                continue
            queue.append(out)
            if len(queue) < (3 if mode == "queue3" else 2):
                continue
            prev = queue.pop(0)
            if mode == "paced_spin_wait":
                spin(spin_wait_s)
            if mode.startswith("spin"):
                while not prev.is_ready():
                    pass
            np.asarray(prev)
            if mode.startswith("paced_delay"):
                spin(float(mode.rsplit("_", 1)[1]) * 1e-3)
        jax.block_until_ready(out)
        res[f"{mode}_wall_ms"] = median(walls[3:]) * 1e3
        res[f"{mode}_cpu_ms"] = median(cpus[3:]) * 1e3
        for k in ("sys_ms", "minflt", "vcsw"):  # means: rusage's times may be counted in ticks
            vals = [u[k] for u in usages[3:] if k in u]
            if vals:
                res[f"{mode}_{k}"] = sum(vals) / len(vals)
    return res


def trivial_programs(busy_n: int):
    """The trivial programs: (with_state, bare). with_state(weights, state, inputs
    (steps.DecodeInputs), busy matrix) -> (state, packed [B, 2] int32), the state donated;
    bare(inputs, busy matrix) -> packed."""
    import jax
    import jax.numpy as jnp

    def busy(m):  # three chained products keep the device busy for a few ms
        for _ in range(3):
            m = (m @ m) * (1.0 / busy_n)
        return m[0, 0].astype(jnp.int32)

    def with_state(weights, state, inputs, m):
        seq_lens, entries = state["seq_lens"], inputs.entries
        packed = jnp.stack([seq_lens[entries] + inputs.reservations.table[0, :1] + busy(m), entries], axis=1)  # [B, 2]
        return dict(state, seq_lens=seq_lens.at[entries].add(1)), packed

    def bare(inputs, m):
        entries = inputs.entries
        return jnp.stack([entries + inputs.reservations.table[0, :1] + busy(m), entries], axis=1)

    jit_state = jax.jit(with_state, donate_argnums=(1,), keep_unused=True)
    return jit_state, jax.jit(bare, keep_unused=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--busy-n", type=int, default=None, help="side of the busy matrix (default 8192; 256 with --tiny)")
    ap.add_argument("--modes", nargs="*", default=None, choices=MODES,
                    help="also time the bare program and the step in other paces (these, or all without a "
                         "name): wall and thread CPU time, system time, page faults, context switches")
    ap.add_argument("--fresh-inputs", action="store_true",
                    help="also launch the step with its input array sent anew every step")
    ap.add_argument("--pin-core", type=int, default=None, help="with --modes: pin the launching thread to this core")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    ap.add_argument("--out", default="signature_floor.json")
    args = ap.parse_args()
    ensure_importable()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxoverlap import steps
    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine

    busy_n = args.busy_n or (256 if args.tiny else 8192)
    max_b = max(args.batches)
    engine = Engine(EngineConfig(
        model=model_dir(TINY if args.tiny else QWEN3_8B), load_format="dummy",
        dtype="float32" if args.tiny else "bfloat16", max_running_requests=max_b, max_context_len=1024,
        kv_cache_tokens=max_b * 512, page_size=16, batch_buckets=tuple(sorted(args.batches)), disable_prefix_cache=True,
    ))
    r = engine.runner
    weights = jax.tree.leaves(r.params)
    matrix = jax.device_put(np.ones((busy_n, busy_n), np.float32)).astype(jnp.bfloat16)
    jit_state, jit_bare = trivial_programs(busy_n)

    def state_copy(state) -> dict:
        """A copy of the DeviceState's leaves as a flat dict (for the trivial programs, which
        donate it: the runner's own state stays untouched)."""
        seq_lens = state.relay.seq_lens
        leaves = {f"leaf{i}": jnp.copy(x) for i, x in enumerate(jax.tree.leaves(state)) if x is not seq_lens}
        return dict(leaves, seq_lens=jnp.copy(seq_lens))

    E = r.state.relay.seq_lens.shape[0]
    rows, mode_rows = [], []
    for B in args.batches:
        host_inputs = steps.DecodeInputs.of(np.arange(1, B + 1, dtype=np.int32),
                                            steps.Reservations.empty(r._decode_res_capacity(B)))
        inputs = jax.device_put(host_inputs)
        key = r._program_key(B, False, r.decode_ctx_buckets[0], False, False)
        step, _, static = r._decode_program(inputs, None, r.decode_ctx_buckets[0], False, False)

        def real_step():
            _, a, _ = r._decode_program(inputs, None, r.decode_ctx_buckets[0], False, False)
            r.state, out = r._call_decode(key, step, a, static)
            return out.packed

        holders = {}

        def trivial(name):
            def call():
                w, st = holders[name]
                st, packed = jit_state(w, st, inputs, matrix)
                holders[name] = (w, st)
                return packed
            return call

        row = {"batch": B, "state_leaves": len(jax.tree.leaves(r.state)), "weight_leaves": len(weights)}
        calls = {"step": real_step, **{n: trivial(n) for n in ("same_leaves", "packed_relay", "one_weight")},
                 "bare": lambda: jit_bare(inputs, matrix)}
        for name, call in calls.items():
            if name != "step" and name != "bare":  # a fresh copy of the state for each
                full = state_copy(r.state)
                if name == "packed_relay":
                    # seq_lens stays a leaf of its own: the trivial program updates it (a real
                    # packed relay would hold it as a column of `ints`), so one leaf more here.
                    full = {"k": full["leaf0"], "v": full["leaf1"], "req_to_token": full["leaf2"],
                            "seq_lens": full["seq_lens"], "ints": jnp.zeros((E, 8), jnp.int32),
                            "hidden": jnp.copy(r.state.relay.draft_hidden)}
                holders[name] = (weights[:1] if name == "one_weight" else weights, full)
            jax.block_until_ready(call())  # compile
            row[f"{name}_ms"] = paced_launch_ms(call, args.iters)
            holders.pop(name, None)  # frees this variant's copy of the state
        if args.fresh_inputs:
            # The step with its input array sent anew every step (the engine's default,
            # decode_inputs="every_step"), as a fresh device_put or as a numpy argument,
            # against the one array on the device that the other calls reuse.
            def step_with(make_inputs):
                def call():
                    _, a, _ = r._decode_program(make_inputs(), None, r.decode_ctx_buckets[0], False, False)
                    r.state, out = r._call_decode(key, step, a, static)
                    return out.packed
                return call

            fresh = lambda: steps.DecodeInputs(host_inputs.packed.copy(), batch=B)  # noqa: E731
            for name, make_inputs in (("fresh_device_put", lambda: jax.device_put(fresh())), ("numpy_arg", fresh),
                                      ("reused", lambda: inputs)):
                call = step_with(make_inputs)
                jax.block_until_ready(call())
                row[f"step_{name}_ms"] = paced_launch_ms(call, args.iters)
        rows.append(row)
        print_table([row], list(row))
        if args.modes is not None:
            if args.pin_core is not None:  # this thread only (pid 0): PjRt's threads keep their cores
                os.sched_setaffinity(0, {args.pin_core})
            for name, call in (("bare", calls["bare"]), ("step", real_step)):
                modes = {"batch": B, "program": name, **launch_modes(call, args.iters, args.modes or MODES)}
                mode_rows.append(modes)
                print_table([modes], list(modes))
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": platform.python_version(),
           "commit": git_commit(), "args": vars(args), "busy_n": busy_n, "rows": rows,
           "modes": mode_rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
