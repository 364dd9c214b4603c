"""Does a prefill program compiled for the table's width run as fast as one compiled for
the prompt's context bucket? (issue 4)

With the Pallas kernels the engine launches every prefill at the table's width (one
program per rows x tokens bucket instead of one per context bucket too; runner.py). The
prefill kernel streams each row's visible blocks only, so the device time should not
move. This times back-to-back prefill steps of Qwen3-8B shapes (dummy weights) for a few
(rows, tokens) shapes at both context lengths, in one process, and reports each one's
compile time. It also times the table-width program greedy (static sampling=False): the
engine's prefill programs always sample, and the ratio is what the sort over the
vocabulary costs a prefill. And it times the table-width program that also returns each
prompt token's logprob (`SamplingParams.prompt_logprobs`: the variant with
`PrefillInputs.targets`), for what scoring a prompt costs over prefilling it. Prints a
table, writes JSON.

    python benchmarks/prefill_ctx_bench.py --out prefill_ctx.json
    python benchmarks/prefill_ctx_bench.py --tiny          # CPU smoke run
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, model_dir, print_table, write_results  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["1x128", "1x1024", "4x256"],
                    help="rows x tokens of each prefill")
    ap.add_argument("--max-context-len", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="prefill_ctx.json")
    args = ap.parse_args()
    ensure_importable()
    import jax
    import numpy as np

    from jaxoverlap import steps
    from jaxoverlap.buckets import pick
    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine

    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    max_rows = max(R for R, _ in shapes)
    engine = Engine(EngineConfig(
        model=model_dir(TINY if args.tiny else QWEN3_8B), load_format="dummy",
        dtype="float32" if args.tiny else "bfloat16", max_running_requests=max(8, max_rows),
        max_context_len=args.max_context_len, kv_cache_tokens=max_rows * args.max_context_len, page_size=16,
        max_prefill_requests=max_rows, chunked_prefill_size=max(T for _, T in shapes), disable_prefix_cache=True,
        attention_backend="pallas" if not args.tiny else "auto",
    ))
    r = engine.runner
    rng = np.random.default_rng(0)
    rows = []
    for R, T in shapes:
        inp = r._prefill_inputs([], R, T)
        inp.tokens[:] = rng.integers(0, engine.model_config.vocab_size, inp.tokens.shape)
        inp.chunk_lens[:] = T
        inp.entries[:] = np.arange(1, R + 1)
        # Distinct pages for every row's positions, as a real prefill has: writes to one
        # shared slot would serialize the cache's scatter and hide the attention's time.
        n = -(-T // r.page_size)
        table = np.zeros((3, r._prefill_res_capacity(R)), np.int32)
        table[:, : R * n] = [np.repeat(np.arange(1, R + 1), n), np.tile(np.arange(n), R), 1 + np.arange(R * n)]
        res = steps.Reservations(table)
        row = {"rows": R, "tokens": T}
        # The engine's prefill programs always sample (runner._prefill_program); "greedy" is
        # the table-width program without the sort over the vocabulary, for its cost.
        scored = dataclasses.replace(inp, targets=rng.integers(0, engine.model_config.vocab_size, (R, T)).astype(np.int32))
        variants = (("bucket", inp, pick(r.ctx_buckets, T), True), ("table", inp, r.table_width, True),
                    ("greedy", inp, r.table_width, False), ("logprobs", scored, r.table_width, True))
        for name, vinp, ctx, sampling in variants:
            step, a, static = r._prefill_program(vinp, res, ctx)
            static = dict(static, sampling=sampling)
            t = time.perf_counter()
            r.state, out = step(*a, **static)
            jax.block_until_ready(out.packed)
            row[f"{name}_ctx"] = ctx
            row[f"{name}_compile_s"] = time.perf_counter() - t
            times = []
            for _ in range(args.iters):
                t = time.perf_counter()
                _, a, _ = r._prefill_program(vinp, res, ctx)
                r.state, out = step(*a, **static)
                jax.block_until_ready(out.packed)
                times.append(time.perf_counter() - t)
            row[f"{name}_ms"] = float(np.median(times)) * 1e3
        row["table_over_bucket"] = row["table_ms"] / row["bucket_ms"]
        row["sampling_over_greedy"] = row["table_ms"] / row["greedy_ms"]
        row["logprobs_over_table"] = row["logprobs_ms"] / row["table_ms"]
        rows.append(row)
        print_table([row], list(row))
    print_table(rows, list(rows[0]))
    write_results(args.out, args, rows)


if __name__ == "__main__":
    main()
