"""Why does a speculative decode program compile again when its input array changes kind?
(issue 4; benchmarks/RESULTS.md, 2026-12-04 fifth session)

On the H200, a speculative program first launched with its input array as numpy was traced
and compiled once more at its first launch with a device array (and the other way round);
plain programs were not. This probe launches each program with each kind, through
`jit` only (`--path jit`) or as the engine does after its warm-up (`--path warmup`: the
warm-up in the first kind, then the second kind through the second executable, through
jit, and as the runner's padding step). It counts the jit cache entries and JAX's trace and
compile events of each stage, and lowers the program with each kind to compare the two
modules' text.

    python benchmarks/input_kind_probe.py --algos plain ngram_device --layers 4 --out kinds.json
    python benchmarks/input_kind_probe.py --path warmup --out kinds_warmup.json
    python benchmarks/input_kind_probe.py --tiny
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, model_dir, print_table, write_results  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--algos", nargs="+", default=["plain", "ngram_device"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--order", nargs=2, default=["numpy", "device"], choices=("numpy", "device"))
    ap.add_argument("--path", choices=("jit", "warmup"), default="jit",
                    help="jit: call jit with each kind; warmup: the engine's warm-up in the first kind, then "
                         "the second kind through the twin executable, jit, and a padding step")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="input_kind.json")
    args = ap.parse_args()
    ensure_importable()
    import jax
    import jax.numpy as jnp

    from jaxoverlap import steps
    from jaxoverlap.models.config import ModelConfig
    from jaxoverlap.models.loader import dummy_params
    from spec_bench import make_engine

    events = []
    jax.monitoring.register_event_duration_secs_listener(lambda name, secs, **_: events.append((name, secs)))
    args.batches, args.num_steps, args.disable_by_batch_size = [args.batch], 3, None
    args.max_context_len, args.compilation_cache_dir, args.enable_prefix_cache = 512, None, False
    args.dtype = "float32" if args.tiny else "bfloat16"
    hf = dict(TINY if args.tiny else QWEN3_8B, num_hidden_layers=args.layers)
    cfg = ModelConfig.from_hf_dict(hf)
    params = dummy_params(cfg, jnp.dtype(args.dtype), seed=0)
    rows, diffs = [], {}
    for algo in args.algos:
        engine = make_engine(args, algo, "auto", model_dir(hf), cfg, params)
        r = engine.runner
        B = args.batch
        packed = steps.DecodeInputs.empty(B, r._decode_res_capacity(B)).packed
        kinds = {"numpy": lambda: packed.copy(), "device": lambda: jax.device_put(packed.copy())}
        host = r._no_host_drafts(B)
        ctx = r.decode_ctx_buckets[0]
        draft = r.spec is not None
        lowered = {}

        def stage(name, kind, fn, step_fn=None):
            events.clear()
            t = time.perf_counter()
            fn()
            jax.block_until_ready(r.state)
            row = {"algo": algo, "path": args.path, "stage": name, "kind": kind, "seconds": time.perf_counter() - t,
                   "jit_cache_entries": (step_fn or jit_step)._cache_size(),
                   "traces": sum(1 for n, _ in events if "trac" in n),
                   "compiles": sum(1 for n, _ in events if "backend_compile" in n),
                   "event_names": sorted({n for n, _ in events})}
            rows.append(row)
            print_table([row], [k for k in row if k != "event_names"])
            print("  events:", row["event_names"], flush=True)

        def call_jit(kind):
            inputs = steps.DecodeInputs(kinds[kind](), batch=B)
            step, a, static = r._decode_program(inputs, host, ctx, False, draft)
            r.state, _ = step(*a, **static)

        def call_twin(kind):
            inputs = steps.DecodeInputs(kinds[kind](), batch=B)
            step, a, static = r._decode_program(inputs, host, ctx, False, draft)
            r.state, _ = r._executables[key][1](*a)

        def padding_step(kind):
            r.decode_inputs = "every_step" if kind == "numpy" else "on_change"
            r._run_padding_step(B, ctx, False, draft)

        jit_step = r._decode_program(steps.DecodeInputs(packed, batch=B), host, ctx, False, draft)[0]
        key = r._program_key(B, host is not None, ctx, False, draft)
        first, second = args.order
        if args.path == "jit":  # jit's own call path only, one executable
            stage("jit", first, lambda: call_jit(first))
            stage("jit", second, lambda: call_jit(second))
        else:  # as the engine: warm-up in the first kind (compile in threads, run both executables)
            r.alternate_executables = True
            r.decode_inputs = "every_step" if first == "numpy" else "on_change"
            stage("warmup", first, lambda: r.precompile(batch_sizes=(B,), ctx_lens=(ctx,), execute=True))
            stage("twin", second, lambda: call_twin(second))
            stage("jit", second, lambda: call_jit(second))
            stage("padding_step", second, lambda: padding_step(second))
            stage("padding_step", first, lambda: padding_step(first))
        for kind in args.order:
            inputs = steps.DecodeInputs(kinds[kind](), batch=B)
            step, a, static = r._decode_program(inputs, host, ctx, False, draft)
            lowered[kind] = step.lower(*a, **static).as_text()  # after the launches, so as not to fill their caches
        a_txt, b_txt = lowered[args.order[0]], lowered[args.order[1]]
        diff = list(difflib.unified_diff(a_txt.splitlines(), b_txt.splitlines(), args.order[0], args.order[1],
                                         lineterm="", n=1))
        diffs[algo] = diff[:300]
        print(f"{algo}: lowered modules {'identical' if not diff else f'differ in {len(diff)} diff lines'}")
        for line in diff[:40]:
            print("  " + line[:300])
        engine.close()
    write_results(args.out, args, rows, lowering_diffs=diffs)


if __name__ == "__main__":
    main()
