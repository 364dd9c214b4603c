#!/usr/bin/env python3
"""GPU benchmark of the paged attention kernels against the XLA reference.

Measures device-to-device copy bandwidth, then times decode (batch 1..64,
context 512..32k), window (Q=4) and prefill shapes for the XLA reference and
the Pallas kernels (bf16, 32 q heads, 8 kv heads, head_dim 128, page 16),
checks each kernel's max error against the reference on the GPU, prints a
table and writes JSON. Attention bandwidth = bytes of K+V read / time.
`--kv-dtypes bf16 fp8` times every decode, window and prefill shape on a bf16
cache and on an FP8 (e4m3) copy of it (EngineConfig.kv_cache_dtype="fp8"),
which moves half the bytes; `fp8_vs_bf16_err` is the kernel's error against
the bf16 cache's reference (the rounding of K/V to 8 bits).

Run from the repository root (the repo need not be pip-installed):
  PYTHONPATH=. python3 benchmarks/attention_bench.py --out /tmp/attn.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import types
from pathlib import Path

import numpy as np
import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
H, KVH, HD, PAGE = 32, 8, 128, 16
DTYPE = jnp.bfloat16
NUM_LAYERS = 2  # the timed calls alternate layers 0/1 of the stacked cache
INTERPRET = False  # --smoke: tiny shapes through the Pallas interpreter (CPU)


def _import_kernels():
    """Import jaxoverlap.pallas_kernels, mapping ./pallas_kernels if the
    package is not installed (the device copy of the repo is not)."""
    try:
        from jaxoverlap.pallas_kernels import attention  # noqa: F401
        return
    except ImportError:
        pass
    if "jaxoverlap" not in sys.modules:
        try:
            import jaxoverlap  # noqa: F401  (namespace dir in the repo root)
        except ImportError:
            stub = types.ModuleType("jaxoverlap")
            stub.__path__ = []
            sys.modules["jaxoverlap"] = stub
    pkg_dir = ROOT / "pallas_kernels"
    spec = importlib.util.spec_from_file_location(
        "jaxoverlap.pallas_kernels", pkg_dir / "__init__.py",
        submodule_search_locations=[str(pkg_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["jaxoverlap.pallas_kernels"] = module
    spec.loader.exec_module(module)


_import_kernels()
from jaxoverlap.pallas_kernels.reference import paged_attention_ref, to_cache_dtype  # noqa: E402
from jaxoverlap.pallas_kernels.decode import paged_decode_attention  # noqa: E402
from jaxoverlap.pallas_kernels.prefill import paged_prefill_attention  # noqa: E402
from jaxoverlap.pallas_kernels import acceptance  # noqa: E402


def time_calls(make_fn, args, n_unroll: int, min_time: float = 0.1, max_reps: int = 200):
    """Mean seconds of one call: n_unroll calls per jit, each on its own layer
    argument (alternating layers; distinct operands so XLA cannot CSE them),
    executed `reps` times after a warm-up run."""
    layers = [jnp.asarray(i % NUM_LAYERS, jnp.int32) for i in range(n_unroll)]

    @jax.jit
    def many(args, layers):
        return [make_fn(*args[:3], layer, *args[3:]) for layer in layers]

    t0 = time.perf_counter()
    jax.block_until_ready(many(args, layers))  # compile + warm-up
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(many(args, layers))
    est = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(max_reps, max(3, min_time / est)))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = many(args, layers)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / (reps * n_unroll), compile_s


def copy_bandwidth(gib: float = 4.0):
    """Bytes (read + written) per second of a device-to-device copy.

    Two copies of `gib` GiB: bf16 (2**31 elements, so XLA needs 64-bit
    indexing) and f32 (2**30 elements); copy_GBps is the faster one, the
    ceiling the attention kernels are compared against. read_GBps is a
    read-only reduction over the bf16 array."""
    res = {}
    for dtype, name in ((jnp.bfloat16, "copy_bf16"), (jnp.float32, "copy_f32")):
        n = int(gib * 2**30) // jnp.dtype(dtype).itemsize
        x = jnp.zeros((n,), dtype) + 1
        fns = [(name, jax.jit(lambda a: a + jnp.asarray(1, a.dtype)), 2 * x.nbytes)]
        if dtype == jnp.bfloat16:
            fns.append(("read", jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), x.nbytes))
        for label, fn, moved in fns:
            jax.block_until_ready(fn(x))
            reps = 20
            t0 = time.perf_counter()
            for _ in range(reps):
                y = fn(x)
            jax.block_until_ready(y)
            res[label + "_GBps"] = moved * reps / (time.perf_counter() - t0) / 1e9
        del x, y
    res["copy_GBps"] = max(res["copy_bf16_GBps"], res["copy_f32_GBps"])
    return res


class Cache:
    """One big stacked cache shared by every config; configs take random pages."""

    def __init__(self, max_tokens: int, seed: int = 0):
        self.num_pages = max_tokens // PAGE + 1  # + dummy page 0
        shape = (NUM_LAYERS, self.num_pages * PAGE, KVH, HD)
        self.k = self._random(jax.random.key(seed), shape)
        self.v = self._random(jax.random.key(seed + 1), shape)
        self.rng = np.random.default_rng(seed)
        self.copies = {"bf16": (self.k, self.v)}

    def kv(self, name: str):
        """(k, v) in the cache dtype `name`: "bf16", or "fp8" (made once, rounded as the
        engine's cache writes round)."""
        if name not in self.copies:
            dtype = {"fp8": jnp.float8_e4m3fn}[name]
            self.copies[name] = tuple(jax.jit(to_cache_dtype, static_argnums=1)(a, dtype) for a in (self.k, self.v))
        return self.copies[name]

    @staticmethod
    def _random(key, shape):
        """Normal bf16 [L, slots, KVH, HD], drawn in pieces of < 2**30 values."""
        per = max(1, 2**30 // (shape[0] * shape[2] * shape[3]))  # slots per draw
        pieces = []
        for i, start in enumerate(range(0, shape[1], per)):
            n = min(per, shape[1] - start)
            piece_shape = (shape[0], n, shape[2], shape[3])  # [L, n, KVH, HD]
            pieces.append(jax.random.normal(jax.random.fold_in(key, i), piece_shape, DTYPE))
        return jnp.concatenate(pieces, axis=1)  # [L, slots, KVH, HD]

    def batch(self, batch: int, kv_len: int, num_q: int):
        """Args (q, k, v, req_to_token, entries, q_positions, kv_lens); layer goes
        between v and req_to_token at call time."""
        ppr = -(-kv_len // PAGE)
        pages = self.rng.permutation(np.arange(1, self.num_pages))[: batch * ppr]
        pages = pages.reshape(batch, ppr)  # [R, pages per row]
        slots = pages[:, :, None] * PAGE + np.arange(PAGE)  # [R, ppr, PAGE]
        req = np.zeros((batch + 1, ppr * PAGE), np.int32)
        req[1:] = slots.reshape(batch, ppr * PAGE)
        entries = np.arange(1, batch + 1, dtype=np.int32)
        qpos = np.broadcast_to(np.arange(kv_len - num_q, kv_len, dtype=np.int32), (batch, num_q))
        q = jax.random.normal(jax.random.key(batch * 7 + kv_len), (batch, num_q, H, HD), DTYPE)
        return (q, self.k, self.v, jnp.asarray(req), jnp.asarray(entries),
                jnp.asarray(qpos), jnp.full((batch,), kv_len, jnp.int32))


def kernel_fns(kind: str, ctx: int, scale: float, **tuning):
    if kind == "xla":
        return lambda *a: paged_attention_ref(*a, scale=scale, ctx_len=ctx)
    if kind == "decode":
        return lambda *a: paged_decode_attention(*a, scale=scale, ctx_len=ctx,
                                                 interpret=INTERPRET, **tuning)
    if kind == "prefill":
        return lambda *a: paged_prefill_attention(*a, scale=scale, ctx_len=ctx,
                                                  interpret=INTERPRET, **tuning)
    raise ValueError(kind)


def bench_one(cache, results, *, shape, batch, kv_len, num_q, kinds, copy_bw,
              n_unroll=8, check=True, tag=None, kv_dtype="bf16", **tuning):
    args = cache.batch(batch, kv_len, num_q)
    bf16_full = args[:3] + (1,) + args[3:]  # the bf16 cache's call, for the FP8 rounding error
    args = args[:1] + cache.kv(kv_dtype) + args[3:]
    scale = HD ** -0.5
    itemsize = jnp.dtype(args[1].dtype).itemsize
    kv_bytes = batch * kv_len * KVH * HD * 2 * itemsize  # K and V
    flops = 4 * batch * num_q * H * HD * kv_len  # upper bound (no causal saving)
    ref_out = bf16_ref = None
    full = args[:3] + (1,) + args[3:]
    for kind in kinds:
        fn = kernel_fns(kind, kv_len, scale, **(tuning if kind != "xla" else {}))
        rec = dict(shape=shape, kind=kind, batch=batch, kv_len=kv_len, num_q=num_q, kv_dtype=kv_dtype,
                   tag=tag, tuning=tuning if kind != "xla" else {})
        try:
            unroll = 2 if kind == "xla" else n_unroll
            sec, comp = time_calls(fn, args, unroll)
            rec.update(time_us=sec * 1e6, compile_s=comp, kv_GBps=kv_bytes / sec / 1e9,
                       frac_copy_bw=kv_bytes / sec / 1e9 / copy_bw,
                       TFLOPs=flops / sec / 1e12)
            if check:
                out = jax.jit(fn)(*full)
                if kind == "xla":
                    ref_out = out.astype(jnp.float32)
                elif ref_out is not None:
                    rec["max_err"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out)))
                    rec["finite"] = bool(jnp.all(jnp.isfinite(out)))
                if kv_dtype != "bf16":
                    if bf16_ref is None:
                        bf16_ref = jax.jit(kernel_fns("xla", kv_len, scale))(*bf16_full).astype(jnp.float32)
                    rec["fp8_vs_bf16_err"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - bf16_ref)))
        except Exception as e:  # report and keep benchmarking the rest
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        results.append(rec)
        print(_row(rec), flush=True)


def _row(r):
    if "error" in r:
        return f"{r['shape']:8s} {r['kind']:8s} b={r['batch']:3d} kv={r['kv_len']:6d} q={r['num_q']:5d}  ERROR {r['error'][:300]}"
    err = f" err={r['max_err']:.3g}" if "max_err" in r else ""
    tag = f" [{r['tag']}]" if r.get("tag") else ""
    if "fp8_vs_bf16_err" in r:
        err += f" vs_bf16={r['fp8_vs_bf16_err']:.3g}"
    return (f"{r['shape']:8s} {r['kind']:8s} {r.get('kv_dtype', 'bf16'):4s} b={r['batch']:3d} kv={r['kv_len']:6d} q={r['num_q']:5d} "
            f"{r['time_us']:10.1f} us {r['kv_GBps']:8.0f} GB/s {100 * r['frac_copy_bw']:5.1f}% copy "
            f"{r['TFLOPs']:7.1f} TF/s{err}{tag}")


def check_acceptance(results):
    """Pallas acceptance kernels == jnp reference on the GPU."""
    B, K, V = (64, 4, 32000) if not INTERPRET else (4, 3, 40)
    ks = jax.random.split(jax.random.key(1), 5)
    tp = jax.nn.softmax(jax.random.normal(ks[0], (B, K + 1, V)), -1)
    dp = jax.nn.softmax(jax.random.normal(ks[1], (B, K, V)), -1)
    dt = jax.random.categorical(ks[2], jnp.log(dp)).astype(jnp.int32)
    u, su = jax.random.uniform(ks[3], (B, K)), jax.random.uniform(ks[4], (B,))
    nd = jnp.arange(B, dtype=jnp.int32) % (K + 1)
    rec = {"shape": "accept", "B": B, "K": K, "V": V}
    try:
        r = acceptance.rejection_sample_ref(tp, dp, dt, u, su, nd)
        k = acceptance.rejection_sample_pallas(tp, dp, dt, u, su, nd, interpret=INTERPRET)
        rec["rejection_tokens_equal"] = int(jnp.sum(r[0] == k[0]))
        rec["rejection_emit_equal"] = int(jnp.sum(r[1] == k[1]))
        tt = jnp.concatenate([dt, dt[:, :1]], 1).at[::3, 1].set(0)
        g = (acceptance.greedy_accept_ref(dt, tt, nd),
             acceptance.greedy_accept_pallas(dt, tt, nd, interpret=INTERPRET))
        rec["greedy_equal"] = bool(jnp.all(g[0][0] == g[1][0]) and jnp.all(g[0][1] == g[1][1]))
        fn = jax.jit(lambda *a: acceptance.rejection_sample_pallas(*a, interpret=INTERPRET))
        jax.block_until_ready(fn(tp, dp, dt, u, su, nd))
        t0 = time.perf_counter()
        for _ in range(20):
            o = fn(tp, dp, dt, u, su, nd)
        jax.block_until_ready(o)
        rec["rejection_pallas_us"] = (time.perf_counter() - t0) / 20 * 1e6
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
    results.append(rec)
    print(rec, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attention_bench.json")
    ap.add_argument("--quick", action="store_true", help="fewer configs")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tuning sweep")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting configs after this")
    ap.add_argument("--decode-tuning", default="{}", help="JSON kwargs for the decode kernel")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpreter (CPU check)")
    ap.add_argument("--kv-dtypes", nargs="+", default=["bf16"], choices=["bf16", "fp8"],
                    help="cache dtypes of the decode, window and prefill shapes (the tuning sweeps use bf16)")
    opts = ap.parse_args()
    if opts.smoke:
        global INTERPRET, H, KVH, HD
        INTERPRET, H, KVH, HD = True, 8, 2, 64
    start = time.perf_counter()
    tuning = json.loads(opts.decode_tuning)
    info = dict(jax=jax.__version__, devices=[str(d) for d in jax.devices()])
    print(info, flush=True)
    bw = copy_bandwidth(4.0 if not opts.smoke else 0.01)
    print(f"copy bandwidth (read+write) {bw['copy_GBps']:.0f} GB/s, read-only {bw['read_GBps']:.0f} GB/s", flush=True)
    copy_bw = bw["copy_GBps"]
    results = []
    batches = [1, 8, 32, 64] if not opts.quick else [1, 32]
    ctxs = [512, 2048, 8192, 32768] if not opts.quick else [2048, 8192]
    if opts.smoke:
        batches, ctxs = [2], [40, 70]
    tb, tc = (32, 2048) if not opts.smoke else (2, 70)  # headline config
    # Sized for the largest decode config; every other config fits inside it.
    cache = Cache(max(batches + [tb]) * -(-max(ctxs + [tc]) // PAGE) * PAGE)

    def out_of_time():
        return time.perf_counter() - start > opts.budget_s

    # The headline config first, then the tuning sweep around it; the fastest
    # block_k / num_warps / num_stages found there is used for the rest.
    bench_one(cache, results, shape="decode", batch=tb, kv_len=tc, num_q=1,
              kinds=("xla", "decode"), copy_bw=copy_bw, tag="target", **tuning)
    if not opts.no_sweep:
        sweep = [dict(block_k=bk, num_splits=s) for bk in (32, 64, 128) for s in (1, 2, 4)]
        sweep += [dict(block_k=64, num_splits=2, num_warps=w) for w in (2, 8)]
        sweep += [dict(block_k=64, num_splits=2, num_stages=st) for st in (1, 3, 4)]
        sweep += [dict(block_k=128, num_splits=2, num_warps=8, num_stages=3)]
        for t in sweep if not opts.smoke else sweep[:2]:
            if out_of_time():
                break
            bench_one(cache, results, shape="decode", batch=tb, kv_len=tc, num_q=1,
                      kinds=("decode",), copy_bw=copy_bw, check=False, tag="sweep", **t)
        timed = [r for r in results if r["kind"] == "decode" and "time_us" in r]
        if timed:
            best = min(timed, key=lambda r: r["time_us"])
            tuning = {k: v for k, v in best["tuning"].items() if k != "num_splits"}
            print(f"best at target: {best['tuning']} {best['time_us']:.1f} us", flush=True)
            bench_one(cache, results, shape="decode", batch=tb, kv_len=tc, num_q=1,
                      kinds=("xla", "decode"), copy_bw=copy_bw, tag="target-best",
                      **best["tuning"])
    for b in batches:
        for c in ctxs:
            for kv_dtype in opts.kv_dtypes:
                if out_of_time() or ((b, c) == (tb, tc) and kv_dtype == "bf16"):
                    continue
                bench_one(cache, results, shape="decode", batch=b, kv_len=c, num_q=1,
                          kinds=("xla", "decode"), copy_bw=copy_bw, kv_dtype=kv_dtype, **tuning)
    for b, c in ((8, 2048), (32, 2048), (32, 8192)) if not opts.smoke else ((2, 40),):
        for kv_dtype in opts.kv_dtypes:
            if not out_of_time():
                bench_one(cache, results, shape="window", batch=b, kv_len=c, num_q=4,
                          kinds=("xla", "decode"), copy_bw=copy_bw, kv_dtype=kv_dtype, **tuning)
    for b, c, qn in (((1, 1024, 1024), (1, 5120, 1024), (4, 2560, 512)) if not opts.smoke
                     else ((2, 50, 20),)):
        for kv_dtype in opts.kv_dtypes:
            if not out_of_time():
                bench_one(cache, results, shape="prefill", batch=b, kv_len=c, num_q=qn,
                          kinds=("xla", "prefill"), copy_bw=copy_bw, n_unroll=4, kv_dtype=kv_dtype)
    # Extra data for the split heuristic (small batch, long context) and prefill tiles.
    for b, c in ((1, 8192), (8, 32768)) if not opts.smoke else ():
        for sp in (4, 8, 16, 32):
            if not out_of_time():
                bench_one(cache, results, shape="decode", batch=b, kv_len=c, num_q=1,
                          kinds=("decode",), copy_bw=copy_bw, check=False,
                          tag="split-sweep", **dict(tuning, num_splits=sp))
    for br, bk, nw in ((64, 64, 4), (128, 32, 4), (128, 64, 4), (64, 32, 4)) if not opts.smoke else ():
        if not out_of_time():
            bench_one(cache, results, shape="prefill", batch=1, kv_len=5120, num_q=1024,
                      kinds=("prefill",), copy_bw=copy_bw, check=False, n_unroll=4,
                      tag="prefill-sweep", block_rows=br, block_k=bk, num_warps=nw)
    check_acceptance(results)
    summary = dict(info, **bw, elapsed_s=time.perf_counter() - start,
                   out_of_time=out_of_time(), results=results)
    Path(opts.out).write_text(json.dumps(summary, indent=1))
    print(f"wrote {opts.out} in {summary['elapsed_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
