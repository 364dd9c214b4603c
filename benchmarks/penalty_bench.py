"""What repetition / frequency / presence penalties cost a decode step (penalties.py), on
Qwen3-8B shapes with dummy weights, in one process.

Per batch size:
  device_ms   back-to-back decode steps (no host work between them) of the greedy program,
              the sampling program with the engine's penalty history, and the sampling
              program of a state without it (what an engine with enable_penalties=False
              runs): the device time the history's reads and writes add to a step;
  workloads   the engine's own loop, overlap on, over B requests of 128 random prompt
              tokens and --new-tokens out: greedy, sampled (temperature 0.8, top-k 50),
              sampled with penalties, greedy with penalties (which runs the sampling
              program); median step period and host time per decode step;
  off         the greedy workload on a second engine over the same weights with
              enable_penalties=False (no history in the state: three fewer arguments per
              launch), in turn with the first (on, off, off, on): what serving penalties
              costs requests that use none.

    python benchmarks/penalty_bench.py --batches 1 32 --out penalty.json
    python benchmarks/penalty_bench.py --tiny --batches 2 --new-tokens 8   # CPU smoke run
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, median, model_dir, print_table, write_results  # noqa: E402

WORKLOADS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8, top_k=50),
    "sampled_penalties": dict(temperature=0.8, top_k=50, repetition_penalty=1.1, frequency_penalty=0.5,
                              presence_penalty=0.5),
    "greedy_penalties": dict(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.5),
}


def device_ms(engine, B: int, iters: int, sampling: bool, with_history: bool) -> float:
    """Back-to-back decode steps of rows 1..B: the device time of one step."""
    import jax
    import numpy as np

    from jaxoverlap import steps

    r = engine.runner
    saved = r.state
    state = saved if with_history else dataclasses.replace(saved, penalty=None)
    inputs = steps.DecodeInputs.of(np.arange(1, B + 1, dtype=np.int32), steps.Reservations.empty(B * 4))

    def call(state):
        return steps.decode_step(r.params, state, inputs, cfg=r.model_cfg, ctx_len=r.decode_ctx_buckets[0],
                                 page_size=r.page_size, attention=r.attention, sampling=sampling)

    state, out = call(state)  # compiles
    jax.block_until_ready(out.packed)
    t = time.perf_counter()
    for _ in range(iters):
        state, out = call(state)
    jax.block_until_ready(out.packed)
    ms = (time.perf_counter() - t) / iters * 1e3
    # The lengths these steps advanced back to zero (the engine is idle), and the history
    # back where the steps ran without it (it was not donated with the rest).
    relay = state.relay
    r.state = dataclasses.replace(state, relay=dataclasses.replace(relay, seq_lens=relay.seq_lens * 0),
                                  penalty=state.penalty if with_history else saved.penalty)
    return ms


def run(engine, B: int, new_tokens: int, params: dict, seed: int) -> dict:
    import numpy as np

    from jaxoverlap.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=seed, **params)
    for i in range(B):
        engine.add_request(f"{seed}-{i}", [int(t) for t in rng.integers(0, engine.model_config.vocab_size, 128)], sp)
    start = len(engine.timings)
    while engine.has_work():
        engine.step()
    dec = [x for x in list(engine.timings)[start:] if x.kind == "decode" and x.batch_size == B]
    return {
        "period_ms": median([x.prepare_s + x.launch_s + x.wait_s + x.process_s for x in dec]) * 1e3,
        "host_ms": median([x.prepare_s + x.launch_s + x.process_s for x in dec]) * 1e3,
        "launch_ms": median([x.launch_s for x in dec]) * 1e3,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device-iters", type=int, default=20)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="penalty.json")
    args = ap.parse_args()
    ensure_importable()
    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine

    max_b = max(args.batches)
    config = EngineConfig(
        model=model_dir(TINY if args.tiny else QWEN3_8B), load_format="dummy", dtype="bfloat16",
        max_running_requests=max_b, max_context_len=1024, kv_cache_tokens=max_b * 1024, page_size=16,
        batch_buckets=tuple(sorted(args.batches)), disable_prefix_cache=True,
    )
    engine = Engine(config)
    off = Engine(dataclasses.replace(config, enable_penalties=False), model_config=engine.model_config,
                 params=engine.runner.params, tokenizer=engine.tokenizer)
    rows = []
    for B in args.batches:
        row = {"batch": B}
        for name, sampling, history in (("greedy", False, True), ("sampling", True, True),
                                        ("sampling_no_history", True, False)):
            row[f"device_{name}_ms"] = device_ms(engine, B, args.device_iters, sampling, history)
        row["history_over_none"] = row["device_sampling_ms"] / row["device_sampling_no_history_ms"]
        run(engine, B, 4, WORKLOADS["sampled_penalties"], seed=1)  # compile this batch's programs
        run(engine, B, 4, WORKLOADS["greedy"], seed=1)
        for i, (name, params) in enumerate(WORKLOADS.items()):
            for k, v in run(engine, B, args.new_tokens, params, seed=100 + i).items():
                row[f"{name}_{k}"] = v
        row["penalties_over_sampled"] = row["sampled_penalties_period_ms"] / row["sampled_period_ms"]
        run(off, B, 4, WORKLOADS["greedy"], seed=1)  # compile
        pairs = {"on": [], "off": []}
        for i, name in enumerate(("on", "off", "off", "on")):
            pairs[name].append(run(engine if name == "on" else off, B, args.new_tokens, WORKLOADS["greedy"],
                                   seed=200 + i))
        for name, runs in pairs.items():
            for k in ("period_ms", "host_ms", "launch_ms"):
                row[f"greedy_{name}_{k}"] = sum(r[k] for r in runs) / len(runs)
        row["launch_on_over_off"] = row["greedy_on_launch_ms"] / row["greedy_off_launch_ms"]
        rows.append(row)
        print_table([row], list(row))
    write_results(args.out, args, rows)


if __name__ == "__main__":
    main()
