"""Would 8-bit weights make a decode step faster here, and in which form? (GPU diagnostics.)

A decode step at small batch reads every weight once, so its time follows the weight bytes.
8-bit weights halve them, if XLA reads the 8-bit matrix inside the matmul instead of first
writing a bf16 copy of it. This probe times Qwen3-8B's per-layer matmul chain (the qkv, o,
gate_up and down matrices of 36 layers, RMS norm and SwiGLU between; no attention) with the
weights held as:

- bf16: the baseline;
- fp8_channel / int8_channel: 8-bit weights with one scale per output column, applied to
  the matmul's float32 output (models/quant.py's `linear` on XLA's path), so only a convert
  sits on the operand;
- fp8_kernel: fp8_channel's weights through the Pallas kernel that converts them in
  registers (pallas_kernels/fp8_matmul.py, the Pallas backend's opt-in fp8_matmul), for
  batches of up to its 64 rows (larger ones fall back to fp8_channel's XLA matmul);
- fp8_block: 8-bit weights with one scale per 128 x 128 block (the layout of fine-grained
  FP8 checkpoints such as Qwen3-8B-FP8), dequantized in the program before the matmul;
- fp8_fp8: the activations quantized too (one dynamic scale per row), an fp8 x fp8 matmul.

For each it prints the period of back-to-back calls (the device-bound step time), the bytes
the weights hold, the implied GB/s, the first output's relative error against bf16's (the
formats quantize one draw of weights; bf16 runs first), and which kernels XLA chose for the matmuls (custom-call
targets and fusion kinds of the optimized HLO).

    python benchmarks/quant_matmul_probe.py --batches 1 32 --out quant.json
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_importable, median, print_table  # noqa: E402

QWEN3_8B = dict(layers=36, hidden=4096, qkv=6144, attn=4096, ffn=12288)
TINY = dict(layers=2, hidden=256, qkv=384, attn=256, ffn=512)
FORMATS = ("bf16", "fp8_channel", "fp8_kernel", "int8_channel", "fp8_block", "fp8_fp8")
BLOCK = 128


def make_weights(jax, jnp, shape, fmt, key):
    L, D, QKV, A, F = (shape[k] for k in ("layers", "hidden", "qkv", "attn", "ffn"))
    dims = {"wqkv": (D, QKV), "wo": (A, D), "wgu": (D, 2 * F), "wdown": (F, D)}
    fp8 = jnp.float8_e4m3fn

    def one(k, rows, cols):
        w = jax.random.normal(k, (rows, cols), jnp.float32) * 0.02
        if fmt == "bf16":
            return {"w": w.astype(jnp.bfloat16)}
        if fmt in ("fp8_channel", "fp8_kernel", "int8_channel", "fp8_fp8"):
            top = 448.0 if fmt != "int8_channel" else 127.0
            s = jnp.max(jnp.abs(w), axis=0) / top  # [cols]
            q = w / s
            q = q.astype(fp8) if fmt != "int8_channel" else jnp.round(q).astype(jnp.int8)
            return {"w": q, "s": s}
        # fp8_block: one scale per [BLOCK, BLOCK] tile
        blocks = w.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)  # [rows, cols] -> [Rb, 128, Cb, 128]
        s = jnp.max(jnp.abs(blocks), axis=(1, 3)) / 448.0  # [Rb, Cb]
        q = (blocks / s[:, None, :, None]).reshape(rows, cols).astype(fp8)  # back to [rows, cols]
        return {"w": q, "s": s}

    out = []
    make = jax.jit(one, static_argnums=(1, 2))
    for i in range(L):
        ks = jax.random.split(jax.random.fold_in(key, i), 4)
        out.append({name: make(k, *dims[name]) for k, name in zip(ks, dims)})
    return out


def matmul(jnp, x, w, fmt):
    if fmt == "bf16":
        return x @ w["w"]
    if fmt in ("fp8_channel", "int8_channel"):  # the engine's FP8 matmul (quantization="fp8")
        from jaxoverlap.models.quant import Fp8Weight, linear

        return linear(x, Fp8Weight(w["w"], w["s"]))
    if fmt == "fp8_kernel":
        import jax

        from jaxoverlap.models.quant import Fp8Weight, linear
        from jaxoverlap.pallas_kernels.fp8_matmul import fp8_matmul

        kernel = functools.partial(fp8_matmul, interpret=jax.default_backend() != "gpu")
        return linear(x, Fp8Weight(w["w"], w["s"]), kernel=kernel)
    if fmt == "fp8_block":
        rows, cols = w["w"].shape
        scale = jnp.repeat(jnp.repeat(w["s"], BLOCK, axis=0), BLOCK, axis=1)  # [Rb, Cb] -> [rows, cols]
        return x @ (w["w"].astype(jnp.float32) * scale).astype(x.dtype)
    # fp8_fp8: one dynamic scale per activation row
    xs = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True) / 448.0 + 1e-12  # [B, 1]
    xq = (x.astype(jnp.float32) / xs).astype(jnp.float8_e4m3fn)
    import jax
    y = jax.lax.dot_general(xq, w["w"], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * xs * w["s"]).astype(x.dtype)


def child(args) -> list[dict]:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    shape = TINY if args.tiny else QWEN3_8B
    A, F = shape["attn"], shape["ffn"]
    rows, reference = [], {}
    for fmt in args.formats:
        try:
            W = make_weights(jax, jnp, shape, fmt, jax.random.PRNGKey(0))
            jax.block_until_ready(W)
        except Exception as e:  # a dtype this backend lacks
            rows.append(dict(format=fmt, error=f"{type(e).__name__}: {e}"[:200]))
            continue
        nbytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(W))

        def rms(x):
            x32 = x.astype(jnp.float32)
            return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)

        @functools.partial(jax.jit, donate_argnums=(1,))
        def chain(W, x, fmt=fmt):
            for w in W:
                qkv = matmul(jnp, rms(x), w["wqkv"], fmt)  # [B, QKV]
                x = x + matmul(jnp, qkv[:, :A], w["wo"], fmt)
                gu = matmul(jnp, rms(x), w["wgu"], fmt)  # [B, 2F]
                x = x + matmul(jnp, jax.nn.silu(gu[:, :F]) * gu[:, F:], w["wdown"], fmt)
            return x

        for B in args.batches:
            row = dict(format=fmt, batch=B, weight_gb=round(nbytes / 1e9, 3))
            try:
                x = jnp.ones((B, shape["hidden"]), jnp.bfloat16)
                hlo = chain.lower(W, x).compile().as_text()
                targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo))
                kinds = collections.Counter(re.findall(r'"kind":"(__[a-z_]+)"', hlo))
                row["kernels"] = ", ".join(f"{k} x{v}" for k, v in sorted((targets + kinds).items()))[:160]
                x = chain(W, x)
                # The first output against bf16's (the weights are one draw in every format).
                first = np.asarray(x.astype(jnp.float32))
                reference.setdefault(B, first)
                row["rel_err"] = float(np.linalg.norm(first - reference[B]) / np.linalg.norm(reference[B]))
                periods = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    for _ in range(args.iters):
                        x = chain(W, x)
                    jax.block_until_ready(x)
                    periods.append((time.perf_counter() - t) / args.iters * 1e3)
                row["period_ms"] = round(median(periods), 4)
                row["gb_per_s"] = round(nbytes / (row["period_ms"] / 1e3) / 1e9, 1)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
        del W
    base = {r["batch"]: r["period_ms"] for r in rows if r.get("format") == "bf16" and "period_ms" in r}
    for r in rows:
        if "period_ms" in r and r.get("batch") in base:
            r["vs_bf16"] = round(r["period_ms"] / base[r["batch"]], 3)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS,
                   help="bf16 first: the others' error is measured against it")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ensure_importable()
    rows = child(args)
    print_table(rows, ["format", "batch", "weight_gb", "period_ms", "gb_per_s", "vs_bf16", "rel_err", "kernels",
                       "error"])
    if args.out:
        import jax
        with open(args.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
