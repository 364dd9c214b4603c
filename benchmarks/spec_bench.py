"""Speculative decoding on Qwen3-8B shapes with dummy weights (and a dummy EAGLE head):
speculative step time against plain step time, overlap on and off, host time per step, and
the host n-gram wait against the on-device n-gram lookup. Every figure sits next to the
accept length it was measured at: two runs compare only at the same accept length.

    python benchmarks/spec_bench.py --batches 1 8 32 --out spec_bench.json
    python benchmarks/spec_bench.py --tiny            # CPU smoke run
    python benchmarks/spec_bench.py --algos plain eagle --batches 32 \
        --sampling-params '{"temperature": 0.8, "presence_penalty": 0.5}'   # sampled, with a penalty
    python benchmarks/spec_bench.py --batches 20 --batch-buckets 32   # 12 padded rows per step

--sampling-params (SamplingParams fields as JSON; default greedy) sets every request's
sampling; request i gets seed 1000 + i, so overlap on and off still give the same tokens.
When they make the steps sampling programs, the device time is also measured with the
engine's penalty history left out of the state (`device_no_history_ms`: what
enable_penalties=False runs), so the history's cost shows next to the step it is part of.

One engine per drafter shares the target's weights. Each (drafter, batch) compiles one
decode and one prefill program (about half a minute each on 8B shapes): pass
--compilation-cache-dir to make reruns cheap, and --algos / --batches to split the work
over several runs. Results are written after every row, so a run cut short keeps them.

Prompts are --prompt-len tokens (default 127: a speculative prefill row carries one more
token, the one before the chunk, so 127 + 1 stays in the 128 bucket); --prompt-kind repeat
builds them from a repeated 16-token piece so that the n-gram drafters find matches.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, git_commit, ensure_importable, median, model_dir, print_table  # noqa: E402

ALGOS = ("plain", "eagle", "ngram", "ngram_device")


def make_engine(args, algo, backend, model_path, cfg, params):
    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine

    max_b = max(args.batches)
    ctx = args.max_context_len
    spec = {} if algo == "plain" else dict(speculative_algorithm=algo, speculative_num_steps=args.num_steps,
                                           speculative_disable_by_batch_size=args.disable_by_batch_size)
    return Engine(EngineConfig(
        model=model_path, load_format="dummy", dtype=args.dtype, max_running_requests=max_b, max_context_len=ctx,
        kv_cache_tokens=max_b * ctx, chunked_prefill_size=1024, max_prefill_requests=8, page_size=16,
        batch_buckets=tuple(sorted(args.batch_buckets or args.batches)), attention_backend=backend,
        compilation_cache_dir=args.compilation_cache_dir, disable_prefix_cache=not args.enable_prefix_cache, **spec,
    ), model_config=cfg, params=params)


def prompts(args, vocab, batch_size, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batch_size):
        if args.prompt_kind == "repeat":
            piece = [int(t) for t in rng.integers(0, vocab, 16)]
            out.append((piece * (args.prompt_len // 16 + 1))[: args.prompt_len])
        else:
            out.append([int(t) for t in rng.integers(0, vocab, args.prompt_len)])
    return out


def sampling_params(args, new_tokens: int, i: int):
    from jaxoverlap.sampling_params import SamplingParams

    return SamplingParams(**{"temperature": 0.0, **args.sampling_params, "max_new_tokens": new_tokens,
                             "ignore_eos": True, "seed": 1000 + i})


def run_workload(engine, args, batch_size, new_tokens, seed):
    drafter = engine.runner.drafter
    if drafter is not None and drafter.host is not None:
        drafter.host.clear()  # each run starts from an empty trie, not from the last run's text
    for i, p in enumerate(prompts(args, engine.model_config.vocab_size, batch_size, seed)):
        engine.add_request(f"b{batch_size}-{seed}-{i}", p, sampling_params(args, new_tokens, i))
    start = len(engine.timings)
    t = time.perf_counter()
    finals = {}
    while engine.has_work():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o.token_ids
    wall = time.perf_counter() - t
    # Steady state: decode (plain or speculative) iterations with the full batch.
    dec = [x for x in list(engine.timings)[start:] if x.kind == "decode" and x.batch_size == batch_size]
    period = median([x.prepare_s + x.launch_s + x.wait_s + x.process_s + x.fresh_wait_s for x in dec])
    rows = sum(x.verify_rows for x in dec)
    accept = sum(x.accepted_tokens for x in dec) / rows if rows else 1.0
    return {
        "wall_s": wall,
        "tokens": sum(len(v) for v in finals.values()),
        "decode_steps": len(dec),
        "accept_length": accept,
        "step_period_ms": period * 1e3,
        "decode_tok_s": batch_size * accept / period if dec else float("nan"),
        "e2e_tok_s": sum(len(v) for v in finals.values()) / wall,
        "host_prepare_ms": median([x.prepare_s for x in dec]) * 1e3,
        "host_launch_ms": median([x.launch_s for x in dec]) * 1e3,
        "host_launch_p90_ms": sorted(x.launch_s for x in dec)[int(0.9 * (len(dec) - 1))] * 1e3 if dec else float("nan"),
        # Decode steps that reserved pages (each sends its reservations with the launch).
        "steps_with_reservations": sum(1 for x in dec if x.reservations) / max(1, len(dec)),
        "host_process_ms": median([x.process_s for x in dec]) * 1e3,
        "host_total_ms": median([x.prepare_s + x.launch_s + x.process_s for x in dec]) * 1e3,
        "host_total_mean_ms": (sum(x.prepare_s + x.launch_s + x.process_s for x in dec) / len(dec) * 1e3
                               if dec else float("nan")),
        "wait_ms": median([x.wait_s for x in dec]) * 1e3,
        # Host n-gram: blocked on the previous step before the launch, and the trie lookup.
        "ngram_wait_ms": median([x.fresh_wait_s for x in dec]) * 1e3,
        "draft_ms": median([x.draft_s for x in dec]) * 1e3,
        "outputs": finals,
    }


def last_ctx_bucket(engine, args) -> int:
    """The context bucket of the workload's last steps: reserved up to two windows (plus
    the drafter's lookahead) past the longest request, in whole pages."""
    from jaxoverlap.buckets import pick

    r, spec = engine.runner, engine.runner.spec
    reserved = args.prompt_len + args.new_tokens + (2 * spec.window + spec.lookahead if spec else 2)
    return pick(r.ctx_buckets, min(-(-reserved // 16) * 16, r.table_width))


def device_step_ms(engine, batch_size, ctx_len, iters, sampling=False, history=True):
    """Back-to-back steps with no host work between them (async dispatch keeps the queue
    full): the device time of one plain or speculative step, greedy or (`sampling`) the
    sampling program, with the engine's penalty history or (history=False) without it.
    The rows start at length 0 and write slots of freed pages, which is harmless here; the
    relay lengths are reset afterwards so the engine's bookkeeping stays true. Returns (ms,
    accept length)."""
    import jax
    import numpy as np

    from jaxoverlap import steps
    from jaxoverlap.buckets import pick

    r = engine.runner
    # The rows of the batch's bucket past its own are padding (entry 0), as the engine sends them.
    bucket = pick(r.batch_buckets, batch_size)
    entries = np.zeros((bucket,), np.int32)
    entries[:batch_size] = np.arange(1, batch_size + 1)
    cap = max(8, bucket * r.decode_pages_per_row)
    inputs = steps.DecodeInputs.of(entries, steps.Reservations.empty(cap))

    penalty = r.state.penalty
    if not history:
        r.state = dataclasses.replace(r.state, penalty=None)

    def reset():
        relay = r.state.relay
        r.state = dataclasses.replace(r.state, relay=dataclasses.replace(relay, seq_lens=relay.seq_lens * 0))

    if r.spec is None:
        def call():
            r.state, out = steps.decode_step(r.params, r.state, inputs, cfg=r.model_cfg, ctx_len=ctx_len,
                                             page_size=r.page_size, attention=r.attention, sampling=sampling)
            return out
    else:
        from jaxoverlap.speculative.step import HostDrafts, spec_decode_step

        host = None
        draft = r.draft_max_rows is None or batch_size <= r.draft_max_rows
        spec = r.spec if draft else r.paused_spec  # the program the engine runs at this batch size
        if draft and r.spec.host_drafts:  # the device cost only; the host lookup is measured in the workload
            host = HostDrafts(np.zeros((bucket, r.spec.num_draft), np.int32),
                              np.full((bucket,), r.spec.num_draft, np.int32))

        def call():
            r.state, out = spec_decode_step(r.params, r.drafter.params, r.state, inputs, host,
                                            cfg=r.model_cfg, spec=spec, ctx_len=ctx_len, page_size=r.page_size,
                                            attention=r.attention, sampling=sampling)
            return out

    reset()
    jax.block_until_ready(call().packed)
    reset()
    outs = []
    t = time.perf_counter()
    for _ in range(iters):
        outs.append(call())
    jax.block_until_ready(outs[-1].packed)
    ms = (time.perf_counter() - t) / iters * 1e3
    accept = 1.0
    if r.spec is not None:
        accept = float(np.mean([np.asarray(o.accept_lens).mean() for o in outs]))
    reset()
    if not history:
        r.state = dataclasses.replace(r.state, penalty=penalty)
    return ms, accept


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--batch-buckets", type=int, nargs="+", default=None,
                    help="the engine's batch buckets (default: the batches); a batch below its bucket "
                         "runs with padded rows")
    ap.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    ap.add_argument("--num-steps", type=int, default=3, help="draft tokens per step (window = 1 + this)")
    ap.add_argument("--prompt-len", type=int, default=127)
    ap.add_argument("--prompt-kind", choices=("random", "repeat"), default="repeat")
    ap.add_argument("--enable-prefix-cache", action="store_true",
                    help="keep the prefix cache on (the overlap-off run then reuses the first run's pages)")
    ap.add_argument("--new-tokens", type=int, default=120)
    ap.add_argument("--sampling-params", type=json.loads, default={},
                    help='SamplingParams fields as JSON for every request, e.g. \'{"temperature": 0.8}\' '
                         "(default greedy)")
    ap.add_argument("--max-context-len", type=int, default=512)
    ap.add_argument("--device-iters", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention-backend", nargs="+", default=["auto"],
                    help="several: every drafter runs on each, in this one process (kernels on vs off)")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="speculative_disable_by_batch_size for every drafter: larger batches draft nothing")
    ap.add_argument("--compilation-cache-dir", default=None)
    ap.add_argument("--compare-single-executable", action="store_true",
                    help="also run the overlap workload with one executable per decode program (host time and "
                         "period against the default's two in turn)")
    ap.add_argument("--compare-per-layer", action="store_true",
                    help="also run the overlap workload with the target's weights per layer (the engine stacks them "
                         "on one GPU)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    ap.add_argument("--out", default="spec_bench.json")
    args = ap.parse_args()
    if args.tiny:
        args.dtype = "float32"
        args.device_iters = min(args.device_iters, 5)
    ensure_importable()
    import jax
    import jax.numpy as jnp

    from jaxoverlap.buckets import pick
    from jaxoverlap.models.config import ModelConfig
    from jaxoverlap.models.loader import dummy_params

    hf = TINY if args.tiny else QWEN3_8B
    path = model_dir(hf)
    cfg = ModelConfig.from_hf_dict(hf)
    t0 = time.perf_counter()
    params = dummy_params(cfg, jnp.dtype(args.dtype), seed=0)  # shared by every engine
    jax.block_until_ready(params)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    print(f"device {jax.devices()[0].device_kind}; weights {weight_bytes / 1e9:.2f} GB in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    commit = git_commit()
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": platform.python_version(),
            "commit": commit, "weight_bytes": weight_bytes, "args": vars(args)}
    rows, plain_ms = [], {}
    cols = ["backend", "batch", "bucket", "algo", "drafts", "accept_length", "normal_accept_length", "device_step_ms",
            "device_no_history_ms", "device_accept", "ms_per_token", "speedup_vs_plain", "overlap_period_ms",
            "normal_period_ms", "overlap_tok_s", "normal_tok_s", "host_total_ms", "host_total_mean_ms", "ngram_wait_ms",
            "draft_ms", "greedy_identical"]
    if args.compare_single_executable or args.compare_per_layer:
        cols.append("host_launch_ms")
    for name, on in (("single_exec", args.compare_single_executable), ("per_layer", args.compare_per_layer)):
        if on:
            cols += [f"{name}_host_launch_ms", f"{name}_host_total_ms", f"{name}_period_ms", f"{name}_identical"]
    for backend, algo in [(b, a) for b in args.attention_backend for a in args.algos]:
        tc = time.perf_counter()
        engine = make_engine(args, algo, backend, path, cfg, params)
        print(f"\n{algo} ({backend} attention): engine ready in {time.perf_counter() - tc:.1f} s", flush=True)
        for B in args.batches:
            tc = time.perf_counter()
            run_workload(engine, args, B, 4, seed=99)  # compile this batch's programs
            compile_s = time.perf_counter() - tc
            ctx = last_ctx_bucket(engine, args)
            sp = sampling_params(args, args.new_tokens, 0)
            sampling = sp.temperature > 0 or sp.uses_history  # the program the workload runs (runner.batch_samples)
            dev_ms, dev_accept = device_step_ms(engine, B, ctx, args.device_iters, sampling)
            no_history_ms = float("nan")
            if sampling and engine.runner.state.penalty is not None:
                no_history_ms = device_step_ms(engine, B, ctx, args.device_iters, sampling, history=False)[0]
            res = {}
            for overlap in (True, False):
                engine.set_overlap(overlap)
                res[overlap] = run_workload(engine, args, B, args.new_tokens, seed=B)
            engine.set_overlap(True)
            compared = {}
            for name, on in (("single_exec", args.compare_single_executable), ("per_layer", args.compare_per_layer)):
                if not on:
                    continue
                r = engine.runner
                saved = r.alternate_executables, r.params
                if name == "single_exec":
                    r.alternate_executables = False
                else:
                    r.params = params  # the caller's per-layer weights (the engine stacked its own copy)
                one = run_workload(engine, args, B, args.new_tokens, seed=B)
                r.alternate_executables, r.params = saved
                compared.update({f"{name}_host_launch_ms": one["host_launch_ms"],
                                 f"{name}_host_total_ms": one["host_total_ms"],
                                 f"{name}_period_ms": one["step_period_ms"],
                                 f"{name}_identical": one.pop("outputs") == res[True]["outputs"]})
            same = res[True].pop("outputs") == res[False].pop("outputs")
            ov, no = res[True], res[False]
            if algo == "plain":
                plain_ms[backend, B] = ov["step_period_ms"]
            ms_per_token = ov["step_period_ms"] / ov["accept_length"]
            rows.append({
                "backend": backend, "batch": B, "bucket": pick(engine.runner.batch_buckets, B), "algo": algo,
                "compile_s": compile_s, "ctx_len": ctx,
                # False where speculation is paused at this batch size (--disable-by-batch-size)
                "drafts": algo != "plain" and (args.disable_by_batch_size is None or B <= args.disable_by_batch_size),
                "device_step_ms": dev_ms, "device_accept": dev_accept, "sampling_program": sampling,
                "device_no_history_ms": no_history_ms,
                "accept_length": ov["accept_length"], "normal_accept_length": no["accept_length"],
                "ms_per_token": ms_per_token,
                "speedup_vs_plain": (plain_ms[backend, B] / ms_per_token if (backend, B) in plain_ms
                                     else float("nan")),
                "overlap_period_ms": ov["step_period_ms"], "normal_period_ms": no["step_period_ms"],
                "overlap_tok_s": ov["decode_tok_s"], "normal_tok_s": no["decode_tok_s"],
                "overlap_gain": ov["decode_tok_s"] / no["decode_tok_s"] - 1,
                "host_prepare_ms": ov["host_prepare_ms"], "host_launch_ms": ov["host_launch_ms"],
                "host_process_ms": ov["host_process_ms"], "host_total_ms": ov["host_total_ms"],
                "host_total_mean_ms": ov["host_total_mean_ms"],
                "normal_host_total_ms": no["host_total_ms"], "normal_wait_ms": no["wait_ms"],
                "ngram_wait_ms": ov["ngram_wait_ms"], "draft_ms": ov["draft_ms"],
                "greedy_identical": same, **compared, "detail": res,
            })
            print_table(rows[-1:], cols)
            with open(args.out, "w") as f:
                json.dump(dict(meta, rows=rows), f, indent=1)
        del engine
        gc.collect()
    print("\nsummary (accept_length: tokens per verified row, bonus included; device_accept: of the back-to-back "
          "device steps)")
    print_table(rows, cols)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
