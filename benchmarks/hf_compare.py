"""Offline greedy throughput: jaxoverlap's `LLM.generate` against Hugging Face transformers
`generate`, same model shapes (Qwen3-8B, random weights), same prompts and output lengths,
in one run on one GPU (issue 4: the target is >= 5x).

    python benchmarks/hf_compare.py --batch-sizes 1 32 --prompt-len 128 --new-tokens 128 --out hf.json
    python benchmarks/hf_compare.py --tiny            # CPU smoke run

Each side runs in its own subprocess, one after the other, so that JAX's memory
preallocation and torch's allocator never share the GPU. Each side does one untimed
warm-up run (compilation, CUDA kernels' first use) and then one timed run of the same
shapes. The weights are random on both sides, so the outputs are not compared; both run
greedy with EOS ignored, so both produce exactly batch x new_tokens tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, git_commit, ensure_importable, model_dir, print_table  # noqa: E402



def make_prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(10, vocab, length)] for _ in range(batch)]


def run_ours(args, hf_config: dict) -> list[dict]:
    ensure_importable()
    import jax

    from jaxoverlap import LLM, SamplingParams

    max_b = max(args.batch_sizes)
    t = time.perf_counter()
    llm = LLM(model_dir(hf_config), load_format="dummy", dtype=args.dtype, max_running_requests=max_b,
              max_context_len=args.prompt_len + args.new_tokens + 64, disable_prefix_cache=True,
              kv_cache_tokens=max_b * (args.prompt_len + args.new_tokens + 64),
              chunked_prefill_size=max(2048, args.prompt_len), max_prefill_requests=max_b)
    load_s = time.perf_counter() - t
    sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for B in args.batch_sizes:
        prompts = make_prompts(hf_config["vocab_size"], B, args.prompt_len, seed=B)
        t = time.perf_counter()
        llm.generate(make_prompts(hf_config["vocab_size"], B, args.prompt_len, seed=1000 + B), sp)  # warm-up
        warm_s = time.perf_counter() - t
        t = time.perf_counter()
        results = llm.generate(prompts, sp)
        wall = time.perf_counter() - t
        n = sum(len(r.token_ids) for r in results)
        rows.append({"side": "jaxoverlap", "batch": B, "tokens": n, "wall_s": wall, "tok_s": n / wall,
                     "warmup_s": warm_s, "load_s": load_s, "jax": jax.__version__})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run_hf(args, hf_config: dict) -> list[dict]:
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    cfg = transformers.AutoConfig.for_model(**hf_config)
    t = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):  # random init on the device itself, as our dummy loader does
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    model.eval()
    load_s = time.perf_counter() - t
    rows = []
    for B in args.batch_sizes:
        def gen(prompts):
            ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                     min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
            if device == "cuda":
                torch.cuda.synchronize()
            return out[:, ids.shape[1]:]

        t = time.perf_counter()
        gen(make_prompts(hf_config["vocab_size"], B, args.prompt_len, seed=1000 + B))
        warm_s = time.perf_counter() - t
        t = time.perf_counter()
        out = gen(make_prompts(hf_config["vocab_size"], B, args.prompt_len, seed=B))
        wall = time.perf_counter() - t
        n = int(out.numel())
        rows.append({"side": "hf", "batch": B, "tokens": n, "wall_s": wall, "tok_s": n / wall, "warmup_s": warm_s,
                     "load_s": load_s, "transformers": transformers.__version__, "torch": torch.__version__})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    ap.add_argument("--timeout-s", type=int, default=280, help="per side")
    ap.add_argument("--out", default="hf_compare.json")
    ap.add_argument("--child", choices=("ours", "hf"))
    args = ap.parse_args()
    if args.tiny:
        args.dtype = "float32"
    hf_config = TINY if args.tiny else QWEN3_8B
    if args.child:
        rows = run_ours(args, hf_config) if args.child == "ours" else run_hf(args, hf_config)
        print("RESULT " + json.dumps(rows), flush=True)
        return
    rows, errors = [], {}
    for side in ("ours", "hf"):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", side] + [a for a in sys.argv[1:]]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
            got = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
            if got:
                rows += json.loads(got[-1][7:])
            else:
                errors[side] = p.stderr[-3000:]
                print(p.stderr[-3000:], flush=True)
        except subprocess.TimeoutExpired:
            errors[side] = f"timeout after {args.timeout_s} s"
    ratio = []
    for B in args.batch_sizes:
        ours = [r for r in rows if r["side"] == "jaxoverlap" and r["batch"] == B]
        hf = [r for r in rows if r["side"] == "hf" and r["batch"] == B]
        if ours and hf:
            ratio.append({"batch": B, "ours_tok_s": ours[0]["tok_s"], "hf_tok_s": hf[0]["tok_s"],
                          "speedup": ours[0]["tok_s"] / hf[0]["tok_s"]})
    commit = git_commit()
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "commit": commit, "python": platform.python_version(), "rows": rows,
                   "speedup": ratio, "errors": errors}, f, indent=1)
    print_table(rows, ["side", "batch", "tokens", "wall_s", "tok_s", "warmup_s", "load_s"])
    if ratio:
        print_table(ratio, ["batch", "ours_tok_s", "hf_tok_s", "speedup"])
    print(f"wrote {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
