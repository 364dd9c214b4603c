"""Plain decoding on Qwen3-8B shapes with dummy weights: step time vs the weight-bytes floor,
throughput with overlap on and off in the same run, and host time per step.

    python benchmarks/decode_bench.py --batches 1 8 32 64 --out results.json

`--model qwen3-30b-a3b` runs the mixture-of-experts model instead; its floor per batch is
the bytes of the experts a batch is expected to reach plus all other weights
(common.step_bytes), and `floor_all_ms` that of every weight.

Prints a table and writes JSON. Meant for the GPU; runs on CPU with --tiny.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MODELS, git_commit, copy_bandwidth_gbs, ensure_importable, median, model_dir, print_table, step_bytes  # noqa: E402



def device_step_ms(engine, batch_size: int, iters: int) -> float:
    """Back-to-back decode steps with no host work between them (async dispatch keeps the
    queue full): the device time of one step. Rows beyond the reserved pages write the
    dummy page, which is harmless here."""
    import jax
    import numpy as np

    from jaxoverlap import steps

    r = engine.runner
    entries = np.zeros((batch_size,), np.int32)
    entries[:] = np.arange(1, batch_size + 1)
    cap = max(8, batch_size * r.decode_pages_per_row)
    inputs = steps.DecodeInputs.of(entries, steps.Reservations.empty(cap))
    ctx = r.ctx_buckets[0] if len(r.ctx_buckets) == 1 else r.ctx_buckets[1]

    def call():
        r.state, out = steps.decode_step(r.params, r.state, inputs, cfg=r.model_cfg, ctx_len=ctx,
                                         page_size=r.page_size, attention=r.attention, sampling=False)
        return out

    jax.block_until_ready(call().packed)
    t = time.perf_counter()
    for _ in range(iters):
        out = call()
    jax.block_until_ready(out.packed)
    ms = (time.perf_counter() - t) / iters * 1e3
    # Reset the relay lengths these steps advanced, so the engine's bookkeeping stays true.
    relay = r.state.relay
    import dataclasses
    r.state = dataclasses.replace(r.state, relay=dataclasses.replace(relay, seq_lens=relay.seq_lens * 0))
    return ms


def run_workload(engine, batch_size: int, prompt_len: int, new_tokens: int, seed: int, jitter: int = 0):
    import numpy as np

    from jaxoverlap.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch_size):
        n = prompt_len + (int(rng.integers(0, jitter)) if jitter else 0)
        engine.add_request(f"b{batch_size}-{seed}-{i}", [int(t) for t in rng.integers(0, vocab, n)], params)
    start = len(engine.timings)
    t = time.perf_counter()
    finals = {}
    while engine.has_work():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o.token_ids
    wall = time.perf_counter() - t
    timings = list(engine.timings)[start:]
    # Steady state: decode iterations with the full batch.
    dec = [x for x in timings if x.kind == "decode" and x.batch_size == batch_size]
    period = [x.prepare_s + x.launch_s + x.wait_s + x.process_s for x in dec]
    return {
        "wall_s": wall,
        "tokens": sum(len(v) for v in finals.values()),
        "decode_steps": len(dec),
        "step_period_ms": median(period) * 1e3,
        "decode_tok_s": batch_size / median(period) if period else float("nan"),
        "e2e_tok_s": sum(len(v) for v in finals.values()) / wall,
        "host_prepare_ms": median([x.prepare_s for x in dec]) * 1e3,
        "host_launch_ms": median([x.launch_s for x in dec]) * 1e3,
        # Decode steps that reserved pages (each sends its reservations with the launch).
        "steps_with_reservations": sum(1 for x in dec if x.reservations) / max(1, len(dec)),
        "host_process_ms": median([x.process_s for x in dec]) * 1e3,
        "host_total_ms": median([x.prepare_s + x.launch_s + x.process_s for x in dec]) * 1e3,
        # The mean too: a launch that waits for XLA to update the step's CUDA graph costs
        # 2-3 ms, and a few of them barely move the median.
        "host_total_mean_ms": (sum(x.prepare_s + x.launch_s + x.process_s for x in dec) / len(dec) * 1e3
                               if dec else float("nan")),
        "wait_ms": median([x.wait_s for x in dec]) * 1e3,
        "outputs": finals,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device-iters", type=int, default=50)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--variants", nargs="+", default=["default"],
                    choices=["default", "fused", "unfused", "fused_attention", "single_exec", "stacked", "per_layer",
                             "group4", "group12", "no_host_copy", "on_change", "jit_turns", "no_expert_kernel",
                             "fp8", "fp8_kernel"],
                    help="compared in the same run: the engine's default, the Pallas fused decode kernels on (fused) "
                         "or off (unfused), only the attention one (fused_attention), the default kernels with "
                         "one executable per decode program instead of two in turn (single_exec), the weights in "
                         "one stack, per layer or in groups of 4 or 12 layers (a second copy of them), or without "
                         "starting each step's copy to the host at launch (no_host_copy: fetch copies once the step "
                         "is done), or with the step's input array sent only when it changed (on_change, "
                         "EngineConfig.decode_inputs), or with the first executable's turns launched through jit "
                         "instead of as the compiled executable (jit_turns), or (a MoE model) the experts of small "
                         "steps in XLA ops instead of the Pallas expert-matmul kernel (no_expert_kernel), or the "
                         "layers' matrices in FP8 (fp8: EngineConfig.quantization, a second copy of them; "
                         "its floor is of its own bytes), or those through the Pallas fp8_matmul kernel "
                         "(fp8_kernel; off in the engine until measured)")
    ap.add_argument("--prompt-len-jitter", type=int, default=0,
                    help="prompts of prompt_len + [0, N) tokens: rows then cross page boundaries on different "
                         "steps, so most steps reserve pages (0: every row reserves on the same step)")
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-8b")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    ap.add_argument("--out", default="decode_bench.json")
    args = ap.parse_args()
    ensure_importable()
    import jax

    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine
    from jaxoverlap.models.params import layers_per_stack, stack_layers, unstack_layers

    t0 = time.perf_counter()
    bw = copy_bandwidth_gbs(1 << 26 if args.tiny else 4 << 30)
    max_b = max(args.batches)
    ctx = 1024
    engine = Engine(EngineConfig(
        model=model_dir(MODELS[args.model][1 if args.tiny else 0]), load_format="dummy", dtype="bfloat16",
        max_running_requests=max_b, max_context_len=ctx, kv_cache_tokens=max_b * ctx // 2,
        chunked_prefill_size=2048, max_prefill_requests=8, page_size=16, batch_buckets=tuple(sorted(args.batches)),
        attention_backend=args.attention_backend,
        # Both loops run the same prompts; a prefix-cache hit in the second run would change
        # its prefill shapes (and bf16 rounding), so the comparison runs without the cache.
        disable_prefix_cache=True,
    ))
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(engine.runner.params))
    floor_ms = weight_bytes / (bw * 1e9) * 1e3
    default_params = engine.runner.params
    # A layout variant needs a second copy of the weights (made only when one is asked for:
    # a MoE model's second copy does not fit beside the first on an 80 GB card).
    layout_variants = {"stacked": None, "per_layer": 1, "group4": 4, "group12": 12}
    layouts = {}
    if any(v in layout_variants for v in args.variants):
        per_layer = unstack_layers(default_params)
        layouts = {k: (per_layer if g == 1 else stack_layers(per_layer, group_size=g))
                   for k, g in layout_variants.items() if k in args.variants}
    if "fp8" in args.variants or "fp8_kernel" in args.variants:
        from jaxoverlap.models.quant import quantize_params

        # Per layer, as the engine keeps 8-bit weights (a stacked 8-bit matrix reads ~4x slower).
        # Unstacking copies the weights (a peak of twice their bf16 bytes); each copy is dropped
        # as soon as it is quantized.
        per_layer = unstack_layers(default_params)
        layouts["fp8"] = layouts["fp8_kernel"] = quantize_params(per_layer,
                                                                 delete_source=per_layer is not default_params)
    print(f"weight leaves {len(jax.tree.leaves(default_params))} (layers per stack: "
          f"{layers_per_stack(default_params)})", flush=True)
    print(f"device {jax.devices()[0].device_kind}; copy bandwidth {bw:.0f} GB/s; weights {weight_bytes / 1e9:.2f} GB; "
          f"floor {floor_ms:.3f} ms; engine ready in {time.perf_counter() - t0:.1f} s", flush=True)

    rows = []
    alternate = engine.runner.alternate_executables  # the engine's choice (on for one GPU)
    default_attention = engine.runner.attention
    for B in args.batches:
        first_outputs = None
        for variant in args.variants:
            engine.runner.alternate_executables = alternate and variant != "single_exec"
            engine.runner.params = layouts.get(variant, default_params)
            engine.runner.start_host_copy = variant != "no_host_copy"
            engine.runner.decode_inputs = "on_change" if variant == "on_change" else "every_step"
            engine.runner.launch_compiled = variant != "jit_turns"
            engine.runner.attention = default_attention
            if variant in ("fused", "unfused", "fused_attention"):
                engine.set_fused_decode(variant != "unfused")
            if variant == "fused_attention":
                # The attention kernel fused, the residual add + norm left to XLA: a backend
                # object of its own (so its own compilations), for this comparison only.
                from jaxoverlap.pallas_kernels.attention import PallasAttention

                engine.runner.attention = PallasAttention(interpret=jax.default_backend() != "gpu")
                engine.runner.attention.add_rms_norm = None
            if variant == "fp8_kernel":  # the engine's kernels plus fp8_matmul for the 8-bit matrices
                from jaxoverlap.pallas_kernels.attention import PallasAttention

                if not isinstance(default_attention, PallasAttention):
                    raise SystemExit(f"fp8_kernel needs the Pallas backend on one device, not {default_attention!r}")
                engine.runner.attention = copy.copy(default_attention)
                del engine.runner.attention.fp8_matmul  # the instance's None hid the kernel method
            if variant == "no_expert_kernel":  # the same kernels but the expert matmul (models/moe.py)
                from jaxoverlap.pallas_kernels.attention import PallasAttention

                if not isinstance(default_attention, PallasAttention):
                    raise SystemExit(f"no_expert_kernel needs the Pallas backend on one device, not "
                                     f"{default_attention!r}")
                # A copy: its own compilations, the engine's other kernel choices kept.
                engine.runner.attention = copy.copy(default_attention)
                engine.runner.attention.expert_matmul = None
            tc = time.perf_counter()
            run_workload(engine, B, args.prompt_len, 4, seed=99)  # compile this batch's (and variant's) programs
            compile_s = time.perf_counter() - tc
            dev_ms = device_step_ms(engine, B, args.device_iters)
            res = {}
            for overlap in (True, False):
                engine.set_overlap(overlap)
                res[overlap] = run_workload(engine, B, args.prompt_len, args.new_tokens, seed=B,
                                            jitter=args.prompt_len_jitter)
            engine.set_overlap(True)
            if first_outputs is None:
                first_outputs = res[True]["outputs"]
            # bf16: another kernel may round differently, so report how many tokens agree.
            same_tokens = sum(a == b for k, v in res[True]["outputs"].items() for a, b in zip(v, first_outputs[k]))
            batch_floor_ms = step_bytes(engine.runner.params, engine.model_config, B) / (bw * 1e9) * 1e3
            rows.append(make_row(B, variant, compile_s, dev_ms, batch_floor_ms, res))
            rows[-1]["floor_all_ms"] = floor_ms
            rows[-1]["tokens_as_first_variant"] = same_tokens / max(1, sum(len(v) for v in first_outputs.values()))
            write_json(args, bw, weight_bytes, floor_ms, rows)
            print_table(rows[-1:], ["batch", "variant", "device_step_ms", "step_over_floor", "overlap_period_ms",
                                    "normal_period_ms", "overlap_gain", "host_prepare_ms", "host_launch_ms",
                                    "host_process_ms", "greedy_identical", "tokens_as_first_variant"])
    print("\nsummary")
    print_table(rows, ["batch", "variant", "compile_s", "device_step_ms", "floor_ms", "step_over_floor",
                       "overlap_period_ms", "normal_period_ms", "overlap_tok_s", "normal_tok_s", "overlap_gain",
                       "host_prepare_ms", "host_launch_ms", "host_process_ms", "host_total_ms",
                       "host_total_mean_ms", "steps_with_reservations", "greedy_identical", "tokens_as_first_variant"])
    print(f"wrote {args.out}")


def make_row(B, variant, compile_s, dev_ms, floor_ms, res) -> dict:
    """One table row from the overlap (res[True]) and normal (res[False]) runs of a batch."""
    same = res[True].pop("outputs") == res[False].pop("outputs")
    return {
        "batch": B, "variant": variant, "compile_s": compile_s, "device_step_ms": dev_ms, "floor_ms": floor_ms,
        "step_over_floor": dev_ms / floor_ms,
        "overlap_period_ms": res[True]["step_period_ms"], "normal_period_ms": res[False]["step_period_ms"],
        "overlap_tok_s": res[True]["decode_tok_s"], "normal_tok_s": res[False]["decode_tok_s"],
        "overlap_gain": res[True]["decode_tok_s"] / res[False]["decode_tok_s"] - 1,
        "overlap_e2e_tok_s": res[True]["e2e_tok_s"], "normal_e2e_tok_s": res[False]["e2e_tok_s"],
        "host_prepare_ms": res[True]["host_prepare_ms"], "host_launch_ms": res[True]["host_launch_ms"],
        "host_process_ms": res[True]["host_process_ms"], "host_total_ms": res[True]["host_total_ms"],
        "host_total_mean_ms": res[True]["host_total_mean_ms"],
        "steps_with_reservations": res[True]["steps_with_reservations"],
        "normal_host_total_ms": res[False]["host_total_ms"], "normal_wait_ms": res[False]["wait_ms"],
        "greedy_identical": same, "detail": res,
    }


def write_json(args, bw, weight_bytes, floor_ms, rows) -> None:
    """Written after every row, so a run cut short keeps what it measured."""
    import jax

    commit = git_commit()
    with open(args.out, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": platform.python_version(),
                   "commit": commit, "copy_bandwidth_gbs": bw, "weight_bytes": weight_bytes, "floor_ms": floor_ms,
                   "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
