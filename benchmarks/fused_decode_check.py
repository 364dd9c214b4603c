"""The fused decode-attention kernel against the unfused kernels on the GPU: error and time.

For Qwen3-8B attention shapes (32 q / 8 kv heads of 128, q/k norm, bf16, page 16) it runs
a decode layer's attention part both ways, compiled (not interpreted):
- unfused: split qkv, q/k RMS norm, RoPE, two cache scatters, the Pallas decode kernel;
- fused: `pallas_kernels.fused_decode.fused_decode_attention`, one kernel;
and reports the largest error of the attention output and of the written K against the
unfused result, and the time per layer of a chain of 36 such layers in one program (as in
a decode step, where each layer's small kernels cost launch and tail time).

    python benchmarks/fused_decode_check.py --batches 1 32 --ctx 256 2048 --out fused.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_importable, git_commit, median, print_table  # noqa: E402

H, KVH, HD, LAYERS = 32, 8, 128, 36


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--ctx", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--table-width", type=int, default=4096, help="static ctx_len, as the engine's one bucket")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16",
                    help="the cache's dtype (fp8 = e4m3, rounded from the bf16 cache)")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run")
    ap.add_argument("--out", default="fused_decode.json")
    args = ap.parse_args()
    ensure_importable()
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxoverlap.models.transformer import apply_rope, rms_norm, split_qkv
    from jaxoverlap.pallas_kernels.attention import paged_attention
    from jaxoverlap.pallas_kernels.fused_decode import fused_decode_attention, rope_frequencies
    from jaxoverlap.pallas_kernels.reference import to_cache_dtype
    from jaxoverlap.pallas_kernels.testing import make_paged_batch

    eps, scale = 1e-6, 1.0 / np.sqrt(HD)
    inv_freq = 1.0 / (1e6 ** (np.arange(0, HD, 2, dtype=np.float32) / HD))
    freq = rope_frequencies(inv_freq)
    attention = functools.partial(paged_attention, backend="pallas", interpret=args.interpret)

    def unfused_layer(qkv, kc, vc, req, ent, pos, lens, slots, qn, kn, ctx_len):
        R = qkv.shape[0]
        q, k, v = split_qkv(qkv[:, None], H, KVH, HD, 1)  # [R, 1, H | KVH, HD]
        q, k = rms_norm(q, qn[0], eps), rms_norm(k, kn[0], eps)
        q, k = apply_rope(q, pos[:, None], inv_freq), apply_rope(k, pos[:, None], inv_freq)
        kc = kc.at[0, slots].set(to_cache_dtype(k.reshape(R, KVH, HD), kc.dtype))  # [R, 1, KVH, HD] -> [R, KVH, HD]
        vc = vc.at[0, slots].set(to_cache_dtype(v.reshape(R, KVH, HD), vc.dtype))
        o = attention(q, kc, vc, 0, req, ent, pos[:, None], lens, scale=scale, ctx_len=ctx_len)
        return o[:, 0], kc, vc

    def fused_layer(qkv, kc, vc, req, ent, pos, lens, slots, qn, kn, ctx_len):
        return fused_decode_attention(qkv, kc, vc, 0, req, ent, pos, lens, slots, qn, kn, freq, num_heads=H,
                                      num_kv_heads=KVH, eps=eps, scale=scale, ctx_len=ctx_len,
                                      interpret=args.interpret)

    def chain(layer_fn, ctx_len):
        """LAYERS layer applications in one program; each feeds its output into the next
        one's qkv so none can be skipped."""
        def run(qkv, kc, vc, req, ent, pos, lens, slots, qn, kn):
            acc = jnp.zeros((), jnp.float32)
            for _ in range(LAYERS):
                o, kc, vc = layer_fn(qkv, kc, vc, req, ent, pos, lens, slots, qn, kn, ctx_len)
                acc = acc + o[0, 0, 0].astype(jnp.float32)
                qkv = qkv + (acc * 0).astype(qkv.dtype)
            return acc, kc, vc
        return jax.jit(run, donate_argnums=(1, 2))

    rows = []
    for B in args.batches:
        for ctx in args.ctx:
            b = make_paged_batch(kv_lens=[ctx] * B, num_q=1, num_heads=H, num_kv_heads=KVH, head_dim=HD,
                                 page_size=16, ctx_len=args.table_width, dtype=jnp.bfloat16, num_layers=1, layer=0)
            if args.kv_dtype == "fp8":
                b = dataclasses.replace(b, k_cache=to_cache_dtype(b.k_cache, jnp.float8_e4m3fn),
                                        v_cache=to_cache_dtype(b.v_cache, jnp.float8_e4m3fn))
            rng = np.random.default_rng(B + ctx)
            qkv = jnp.asarray(rng.normal(size=(B, (H + 2 * KVH) * HD)), jnp.bfloat16)
            pos = b.q_positions[:, 0]
            slots = jnp.asarray(np.asarray(b.req_to_token)[np.asarray(b.entries), np.asarray(pos)], jnp.int32)
            qn = jnp.asarray(1 + 0.2 * rng.normal(size=(1, HD)), jnp.bfloat16)
            kn = jnp.asarray(1 + 0.2 * rng.normal(size=(1, HD)), jnp.bfloat16)
            common = (b.req_to_token, b.entries, pos, b.kv_lens, slots, qn, kn)
            ref_o, ref_k, _ = jax.jit(unfused_layer, static_argnums=10)(qkv, b.k_cache, b.v_cache, *common,
                                                                         args.table_width)
            got_o, got_k, _ = jax.jit(fused_layer, static_argnums=10)(qkv, b.k_cache, b.v_cache, *common,
                                                                       args.table_width)
            s = np.asarray(slots)
            row = {"batch": B, "ctx": ctx, "kv_dtype": args.kv_dtype,
                   "o_max_err": float(jnp.max(jnp.abs(got_o.astype(jnp.float32) - ref_o.astype(jnp.float32)))),
                   "o_max_abs": float(jnp.max(jnp.abs(ref_o.astype(jnp.float32)))),
                   "k_max_err": float(np.max(np.abs(np.asarray(got_k[0, s], np.float32)
                                                    - np.asarray(ref_k[0, s], np.float32))))}
            for name, fn in (("unfused", unfused_layer), ("fused", fused_layer)):
                run = chain(fn, args.table_width)
                kc, vc = jnp.array(b.k_cache), jnp.array(b.v_cache)
                t = time.perf_counter()
                acc, kc, vc = run(qkv, kc, vc, *common)
                jax.block_until_ready(acc)
                row[f"{name}_compile_s"] = time.perf_counter() - t
                ts = []
                for _ in range(args.iters):
                    t = time.perf_counter()
                    acc, kc, vc = run(qkv, kc, vc, *common)
                    jax.block_until_ready(acc)
                    ts.append(time.perf_counter() - t)
                row[f"{name}_us_per_layer"] = median(ts[2:]) / LAYERS * 1e6
            row["fused_speedup"] = row["unfused_us_per_layer"] / row["fused_us_per_layer"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(args.out, "w") as f:
                json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                           "python": platform.python_version(), "commit": git_commit(), "args": vars(args),
                           "rows": rows}, f, indent=1)
    print_table(rows, ["batch", "ctx", "kv_dtype", "o_max_err", "o_max_abs", "k_max_err", "unfused_us_per_layer",
                       "fused_us_per_layer", "fused_speedup"])


if __name__ == "__main__":
    main()
