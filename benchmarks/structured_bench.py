"""What structured output costs a decode step: the same batch (Qwen3-8B shapes, dummy
weights) unconstrained, with every row constrained, and with one row of the batch
constrained, overlap on. A decode step with a constrained row launches its forward pass
behind the step in flight, processes that step while the forward pass runs (its tokens
advance the grammars), builds each constrained row's bitmask and launches the sampling with
it: the table gives the step period, the host's time per step (both launches in `launch`)
and tokens/s of each.

With `--speculative ALGO` the engine drafts (EAGLE with a random head, or an n-gram
drafter): a constrained batch's speculative step then runs as draft, verify and accept
programs, the host reading the drafts while the verify pass runs to build each window
position's mask; `accept_len` says how many tokens a row gained per step (a random head's
drafts are rejected: it times the step, not the acceptance).

The dummy model has no tokenizer, so the embedded default model's (1024 tokens) stands in:
llguidance's mask work per row grows with the tokenizer's vocabulary, so this host figure
is a lower bound for a real 150k-token one; the mask sent and applied is the model's full
vocabulary either way.

    python benchmarks/structured_bench.py --batches 1 32 --new-tokens 64
    python benchmarks/structured_bench.py --batches 1 32 --speculative eagle --precompile
    python benchmarks/structured_bench.py --tiny
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, median, model_dir, print_table, write_results  # noqa: E402

# Free text of letters and spaces, up to 2000 characters: every step is masked, and a row
# ends early only where the model picks EOS, which the grammar allows after a character
# (counted in `not_full_length`).
REGEX = "[a-z ]{1,2000}"


def build_engine(tiny: bool, batches, speculative: str | None = None):
    """An engine of Qwen3-8B shapes (TINY with `tiny`), dummy weights, and the embedded model's
    tokenizer standing in (see above), for batches up to max(batches) of 64-token prompts;
    with `speculative`, that drafter (EAGLE: a random head)."""
    import jax.numpy as jnp

    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine
    from jaxoverlap.models.config import ModelConfig
    from jaxoverlap.models.loader import default_model_path, dummy_params
    from jaxoverlap.models.tokenizer import Tokenizer

    hf = TINY if tiny else QWEN3_8B
    cfg = ModelConfig.from_hf_dict(hf)
    dtype = "float32" if tiny else "bfloat16"
    params = dummy_params(cfg, jnp.dtype(dtype), seed=0)
    max_b = max(batches)
    return Engine(EngineConfig(
        model=model_dir(hf), load_format="dummy", dtype=dtype, max_running_requests=max_b, max_context_len=512,
        kv_cache_tokens=max_b * 512, page_size=16, batch_buckets=tuple(sorted(batches)),
        disable_prefix_cache=True, speculative_algorithm=speculative), model_config=cfg, params=params,
        tokenizer=Tokenizer.from_path(default_model_path()))


def time_calls(engine) -> dict:
    """Wrap the engine's program calls, mask builders and wait for drafts with timers:
    {part: [seconds per call]}, cleared by the caller between runs (`--calls`)."""
    from jaxoverlap import runner as runner_module

    calls: dict = {}

    def timed(name_of, fn):  # name_of(*args, **kwargs): the part a call times, or None (not timed)
        def call(*a, **k):
            name, t = name_of(*a, **k), time.perf_counter()
            out = fn(*a, **k)
            if name is not None:
                calls.setdefault(name, []).append(time.perf_counter() - t)
            return out
        return call

    r = engine.runner
    # Program keys start with the program's name (forward, sample, spec_draft, ...), a decode step's with its batch.
    r._call_decode = timed(lambda key, *_: f"{key[0] if isinstance(key[0], str) else 'decode'}_call", r._call_decode)
    g = engine.grammars
    # A decode step's masks (always=True), not a prefill's.
    g.bitmask = timed(lambda *_, always=False, **__: "masks" if always else None, g.bitmask)
    g.window_bitmask = timed(lambda *_: "masks", g.window_bitmask)
    # The engine's call waits; launch_sample's own call then finds the drafts on the host: not timed.
    runner_module.ForwardedStep.wait_drafts = timed(lambda fwd: "wait_drafts" if fwd.drafts_on_host is None else None,
                                                    runner_module.ForwardedStep.wait_drafts)
    return calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each variant, in turn")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--precompile", action="store_true",
                    help="first time Engine.warmup(structured=True) for these batches (greedy programs)")
    ap.add_argument("--speculative", choices=["eagle", "ngram_device", "ngram"],
                    help="decode with this drafter (eagle: a random head)")
    ap.add_argument("--calls", action="store_true",
                    help="also time the launch's parts: each program call (by program), the masks, the wait for drafts")
    ap.add_argument("--out", default="structured_bench.json")
    args = ap.parse_args()
    ensure_importable()
    import numpy as np

    from jaxoverlap.sampling_params import SamplingParams

    engine = build_engine(args.tiny, args.batches, args.speculative)
    cfg = engine.model_config
    calls = time_calls(engine) if args.calls else None

    compiled = []
    if args.precompile:  # the programs a server's --precompile-structured adds, and their compile time
        t = time.perf_counter()
        compiled = engine.warmup(args.batches, sampling=(False,), structured=True)
        print(f"warmup(structured=True): {len(compiled)} programs in {time.perf_counter() - t:.1f} s")
        print_table(compiled, sorted({k for row in compiled for k in row}))

    def run(B: int, constrained: int, seed: int) -> dict:
        rng = np.random.default_rng(seed)
        for i in range(B):
            so = {"regex": REGEX} if i < constrained else None
            sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True,
                                structured_output=so, detokenize=False)
            engine.add_request(f"{seed}-{i}", [int(t) for t in rng.integers(1, min(1000, cfg.vocab_size), args.prompt_len)], sp)
        start, t = len(engine.timings), time.perf_counter()
        if calls is not None:
            calls.clear()
        finals = {}
        while engine.has_work():
            for o in engine.step():
                if o.finished:
                    finals[o.request_id] = o
        wall = time.perf_counter() - t
        dec = [x for x in list(engine.timings)[start:] if x.kind == "decode" and x.batch_size == B]
        period = median([x.prepare_s + x.launch_s + x.wait_s + x.process_s + x.fresh_wait_s for x in dec])
        host = median([x.prepare_s + x.launch_s + x.process_s + x.fresh_process_s for x in dec])
        rows = sum(x.verify_rows for x in dec)
        accept_len = sum(x.accepted_tokens for x in dec) / rows if rows else 1.0
        bad = sum(f.finish_reason != "length" or len(f.token_ids) != args.new_tokens for f in finals.values())
        return {"period_ms": period * 1e3, "host_ms": host * 1e3, "accept_len": accept_len,
                "tok_s": B * accept_len / period if dec else float("nan"),
                "launch_ms": median([x.launch_s for x in dec]) * 1e3,
                "process_ms": median([x.process_s + x.fresh_process_s for x in dec]) * 1e3,
                "wall_s": wall, "not_full_length": bad,
                **({f"{k}_ms": median(v) * 1e3 for k, v in sorted(calls.items())} if calls else {})}

    rows = []
    for B in args.batches:
        variants = [("none", 0), ("all", B)] + ([("one", 1)] if B > 1 else [])
        for _, n in variants:  # compile every variant's programs outside the timed runs
            run(B, n, seed=99)
        got = {name: [] for name, _ in variants}
        for rep in range(args.repeats):
            for name, n in variants:
                got[name].append(run(B, n, seed=rep))
        base = median([r["period_ms"] for r in got["none"]])
        for name, n in variants:
            res = got[name]
            period = median([r["period_ms"] for r in res])
            rows.append({"batch": B, "constrained_rows": n, "variant": name, "period_ms": period,
                         "vs_unconstrained": period / base, "host_ms": median([r["host_ms"] for r in res]),
                         "launch_ms": median([r["launch_ms"] for r in res]),
                         "process_ms": median([r["process_ms"] for r in res]),
                         "accept_len": median([r["accept_len"] for r in res]),
                         "tok_s": median([r["tok_s"] for r in res]),
                         "not_full_length": sum(r["not_full_length"] for r in res),
                         **{k: median([r.get(k, float("nan")) for r in res]) for k in res[0] if k.endswith("_call_ms")
                            or k in ("masks_ms", "wait_drafts_ms")}})
            print_table(rows[-1:], list(rows[-1]))
    print("\nsummary (period: median decode loop iteration; host: prepare + launch + process)")
    print_table(rows, list(dict.fromkeys(k for row in rows for k in row)))
    write_results(args.out, args, rows, regex=REGEX, compiled=compiled)


if __name__ == "__main__":
    main()
