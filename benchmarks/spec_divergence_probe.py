"""Probe: why does spec_bench's greedy ngram_device run at batch 32 give different tokens
with overlap on and off (H100, 2026-12-06 fourth session)? Runs the same workload (Qwen3-8B
shapes, dummy weights, bf16, repeated-piece prompts) on one engine with overlap on and
off, and plain decoding without a drafter, each with the top-2 logprobs of every output
token; prints, per request that differs, the first differing position and the top-1 /
top-2 margin there in each run, and the prefill steps' shapes of each run. Tiny margins
(bf16 near-ties reached through differently shaped prefills) mean numerics; large ones a
bug.

    python benchmarks/spec_divergence_probe.py --batch 32 --new-tokens 96
    python benchmarks/spec_divergence_probe.py --tiny
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, model_dir  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=127)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--dtype", default=None, help="default bfloat16 (float32 with --tiny): float32 shows whether "
                    "differences are bf16 rounding")
    ap.add_argument("--variants", nargs="+", default=["plain:xla", "plain:pallas", "ngram_device:xla",
                                                      "ngram_device:pallas"],
                    help="algo:backend[:normal][:single] (backend xla, pallas or unfused; normal: overlap off; "
                         "single: one executable per decode program); the first is the reference")
    ap.add_argument("--again", action="store_true",
                    help="run each variant's workload twice on its engine (same programs) and compare")
    ap.add_argument("--out", default="spec_divergence.json")
    args = ap.parse_args()
    ensure_importable()
    import jax.numpy as jnp
    import numpy as np

    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine
    from jaxoverlap.models.config import ModelConfig
    from jaxoverlap.models.loader import dummy_params
    from jaxoverlap.sampling_params import SamplingParams

    hf = TINY if args.tiny else QWEN3_8B
    cfg = ModelConfig.from_hf_dict(hf)
    dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    params = dummy_params(cfg, jnp.dtype(dtype), seed=0)
    B, ctx = args.batch, 512
    rng = np.random.default_rng(B)
    prompts = []
    for _ in range(B):  # spec_bench's "repeat" prompts, so that the n-gram drafter finds matches
        piece = [int(t) for t in rng.integers(0, cfg.vocab_size, 16)]
        prompts.append((piece * (args.prompt_len // 16 + 1))[: args.prompt_len])
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True, logprobs=True,
                        top_logprobs=2)

    def engine(algo, backend, single=False):
        spec = {} if algo == "plain" else dict(speculative_algorithm=algo, speculative_num_steps=3)
        attention = dict(attention_backend="pallas", disable_fused_decode=True) if backend == "unfused" else \
            dict(attention_backend=backend)
        if single:
            attention["alternate_decode_executables"] = False
        return Engine(EngineConfig(
            model=model_dir(hf), load_format="dummy", dtype=dtype, max_running_requests=B, max_context_len=ctx,
            kv_cache_tokens=B * ctx, chunked_prefill_size=1024, max_prefill_requests=8, page_size=16,
            batch_buckets=(1, B), disable_prefix_cache=True,
            layers_per_weight_stack=1,  # the probe's own weights, not a stacked copy (f32 8B would not fit twice)
            **attention, **spec), model_config=cfg, params=params)

    def run(eng, overlap, tag):
        eng.set_overlap(overlap)
        shapes = []
        inner = eng.runner._launch_prefill

        def launch_prefill(batch):
            shapes.append(list(eng.runner._prefill_shape(batch)) + [[f"{r.req.request_id.split('-')[-1]}:{r.start}+{r.length}"
                                                                     for r in batch.rows]])
            return inner(batch)

        eng.runner._launch_prefill = launch_prefill
        for i, p in enumerate(prompts):
            eng.add_request(f"{tag}-{i}", p, sp)
        finals, top = {}, {}
        while eng.has_work():
            for o in eng.step():
                i = int(o.request_id.split("-")[-1])
                top.setdefault(i, []).extend(o.new_top_logprobs or [])
                if o.finished:
                    finals[i] = o
        eng.runner._launch_prefill = inner
        for i, f in finals.items():
            f.top_logprobs = top[i]  # [(token, logprob)] x 2 per output token
        return finals, shapes

    # Each variant "algo:backend[:normal]"; backend xla | pallas | unfused (pallas without the
    # fused decode kernel). The first is the reference.
    runs = {}
    for v in args.variants:
        algo, backend, *mode = v.split(":")
        eng = engine(algo, backend, single="single" in mode)
        runs[v] = run(eng, "normal" not in mode, v.replace(":", "_"))
        if args.again:  # the same workload once more on the same engine and programs
            runs[v + ":again"] = run(eng, "normal" not in mode, v.replace(":", "_") + "_again")
            print(f"{v} again: tokens equal to its first run for "
                  f"{sum(runs[v][0][i].token_ids == runs[v + ':again'][0][i].token_ids for i in range(B))} of {B}")
        del eng
    tokens = {k: {i: f.token_ids for i, f in v[0].items()} for k, v in runs.items()}

    def margin(run, i, j):
        top = runs[run][0][i].top_logprobs[j]
        return round(top[0][1] - top[1][1], 5)

    ref = args.variants[0]
    summary = {}
    for v in [k for k in runs if k != ref]:
        firsts = []
        for i in range(B):
            ta, tb = tokens[ref][i], tokens[v][i]
            if ta != tb:
                j = next(j for j in range(min(len(ta), len(tb))) if ta[j] != tb[j])
                firsts.append({"request": i, "first_diff": j, "margin_ref": margin(ref, i, j), "margin": margin(v, i, j)})
        summary[v] = firsts
        print(f"{v} against {ref}: {len(firsts)} of {B} requests differ; first differences (position, margin in "
              f"{ref}, margin in {v}): {[(f['first_diff'], f['margin_ref'], f['margin']) for f in firsts]}")
    for k, (_, shapes) in runs.items():
        print(f"{k}: prefill steps (rows, tokens): {[s[:2] for s in shapes]}")
    all_margins = [m for f in runs[ref][0].values() for m in (t[0][1] - t[1][1] for t in f.top_logprobs)]
    print(f"{ref}, top-1 / top-2 margin over every token: min {min(all_margins):.4f}, "
          f"1st percentile {np.percentile(all_margins, 1):.4f}, median {np.median(all_margins):.4f}")
    out = {"summary": summary, "shapes": {k: v[1] for k, v in runs.items()}, "tokens": tokens,
           "margin_min": float(min(all_margins)), "margin_p1": float(np.percentile(all_margins, 1))}
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
