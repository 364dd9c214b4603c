"""Native Triton paged decode kernel (pallas_kernels/triton_native.py) on CPU.

Two halves, because Triton decides at @triton.jit time (i.e. when
triton_native is imported) whether a kernel is compiled or interpreted:

* In the normal pytest process: launch-plan checks, and a compile-only check
  that the kernel lowers all the way to an sm_90 cubin (Triton's CUDA backend
  and bundled ptxas run without a GPU), which catches typing errors the
  interpreter lets through.
* In a subprocess with TRITON_INTERPRET=1 (so the setting cannot leak into
  other tests): the real kernel, launched through the same plan / input order
  / split merge as the jax_triton path, on CPU torch tensors, against
  paged_attention_ref, over page-scattered slots with NaN in the dummy page
  (padding columns must never read it).

Dtypes: f32 and f16. The Triton 3.6 interpreter computes bf16 tl.dot wrongly
(results off by ~1e10), so bf16 is checked on the GPU by
triton_native.gpu_self_check instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

triton = pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if INTERPRET:
    # Triton 3.6's interpreter turns a scalar into an int with int() on a
    # 1-element array, which numpy >= 2.4 refuses, so `range(lo, hi)` over
    # runtime bounds fails (triton-lang/triton#9171, fixed after 3.6). Re-set
    # __index__ right after the interpreter installs its own.
    from triton.runtime import interpreter as _interpreter

    _original_patch_lang_tensor = _interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _original_patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patch_lang_tensor

import jax.numpy as jnp  # noqa: E402

from jaxoverlap.pallas_kernels import triton_native as tn  # noqa: E402
from jaxoverlap.pallas_kernels.reference import paged_attention_ref  # noqa: E402
from jaxoverlap.pallas_kernels.testing import make_paged_batch  # noqa: E402


if not INTERPRET:

    # ------------------------------------------------------------- interpreter, via subprocess

    def test_interpreter_suite_in_subprocess():
        """Run this file's interpreter cases with TRITON_INTERPRET=1 in a fresh process."""
        env = dict(os.environ, TRITON_INTERPRET="1")
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        t0 = time.perf_counter()
        proc = subprocess.run(
            # -n 0: in that one process (not pyproject's workers; its cases are quick).
            [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", os.path.abspath(__file__)],
            cwd=repo, env=env, capture_output=True, text=True, timeout=600)
        took = time.perf_counter() - t0
        tail = (proc.stdout + proc.stderr)[-6000:]
        assert proc.returncode == 0, f"interpreter suite failed ({took:.1f}s):\n{tail}"
        assert " passed" in proc.stdout and " skipped" not in proc.stdout, tail
        print(f"interpreter suite: {took:.1f}s\n{tail}")

    # ------------------------------------------------------------- launch plan

    def test_plan_decode_and_split_outputs():
        plan = tn.plan_launch((5, 1, 32, 128), np.float32, (2, 4096, 8, 128), np.float32,
                              (9, 2048), scale=0.1, ctx_len=2048, block_k=64, num_splits=1)
        assert plan.grid == (5, 8, 1)
        assert plan.constexprs["GROUP"] == 4 and plan.constexprs["BLOCK_ROWS"] == 16
        assert plan.constexprs["KV_STRIDE_LAYER"] == 4096 * 8 * 128
        assert plan.constexprs["KV_STRIDE_SLOT"] == 8 * 128
        assert plan.out_shapes[0] == ((5, 1, 32, 128), np.dtype(np.float32))
        split = tn.plan_launch((5, 2, 32, 128), jnp.bfloat16, (2, 4096, 8, 128), jnp.bfloat16,
                               (9, 2048), scale=0.1, ctx_len=2048, num_splits=3)
        assert split.grid == (5, 8, 3) and split.constexprs["BLOCK_ROWS"] == 16  # Q*G = 8
        assert [s for s, _ in split.out_shapes] == [(3, 5, 2, 32, 128), (3, 5, 2, 32), (3, 5, 2, 32)]
        assert all(d == np.float32 for _, d in split.out_shapes)
        assert split.constexprs["DOT_PRECISION"] == "tf32"  # only f32 caches ask for ieee
        assert split.out_dtype == jnp.bfloat16

    def test_plan_clamps_block_and_rejects_unsupported_shapes():
        small = tn.plan_launch((1, 1, 4, 64), np.float32, (1, 64, 4, 64), np.float32, (2, 20),
                               scale=1.0, ctx_len=20, block_k=128)
        assert small.constexprs["BLOCK_K"] == 32  # next_pow2(ctx_len), not past it
        with pytest.raises(ValueError, match="prefill"):  # Q * G = 9 * 8 > 64
            tn.plan_launch((1, 9, 8, 64), np.float32, (1, 64, 1, 64), np.float32, (2, 64),
                           scale=1.0, ctx_len=64)
        with pytest.raises(NotImplementedError):  # Triton tensors need power-of-two dims
            tn.plan_launch((1, 1, 4, 96), np.float32, (1, 64, 4, 96), np.float32, (2, 64),
                           scale=1.0, ctx_len=64)

    def test_not_available_without_gpu():
        assert tn.available() is False  # CPU jaxlib: no jax_triton / no GPU backend

    # ------------------------------------------------------------- sm_90 compile only

    _PTR = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32"}

    @pytest.mark.parametrize("num_q,heads,kv_heads,head_dim,splits,dtype", [
        (1, 32, 8, 128, 1, jnp.bfloat16),  # Qwen3-8B decode
        (1, 32, 8, 128, 4, jnp.bfloat16),  # split-K partials
        (4, 32, 4, 128, 1, jnp.bfloat16),  # speculative window, 32 rows
        (1, 8, 8, 64, 2, jnp.float16),  # MHA, HD 64
    ])
    def test_kernel_compiles_for_sm90(num_q, heads, kv_heads, head_dim, splits, dtype,
                                      tmp_path, monkeypatch):
        """Full Triton pipeline to a Hopper cubin, with the signature jax_triton builds
        (pointers 16-byte aligned, keyword metaparams as constexprs)."""
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
        plan = tn.plan_launch((32, num_q, heads, head_dim), dtype,
                              (36, 100_000, kv_heads, head_dim), dtype, (65, 4096),
                              scale=head_dim ** -0.5, ctx_len=2048, num_splits=splits)
        kernel = tn._paged_decode_kernel
        dt = _PTR[np.dtype(dtype).name]
        ptr_types = ["*i32"] * 5 + [f"*{dt}"] * 3 + [f"*{_PTR[d.name]}" for _, d in plan.out_shapes]
        signature = {kernel.arg_names[i]: t for i, t in enumerate(ptr_types)}
        signature.update({name: "constexpr" for name in plan.constexprs})
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(ptr_types))}
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs=dict(plan.constexprs), attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": plan.num_warps, "num_stages": plan.num_stages})
        assert "cubin" in compiled.asm
        assert "mma.sync" in compiled.asm["ptx"]  # the GQA rows really use tensor cores


else:

    # ------------------------------------------------------------- interpreter cases

    import torch

    def _torch(x):
        return torch.from_numpy(np.array(x))  # copy: jax buffers are read-only

    def _batch(*, kv_lens, num_q, num_heads, num_kv_heads, head_dim, dtype, page_size=8,
               num_layers=2, layer=1, padded_rows=1, pad_positions="zero", seed=0):
        """testing.make_paged_batch with NaN in the dummy page 0: padding columns are
        clamped onto written slots and must never read it."""
        return make_paged_batch(kv_lens=kv_lens, num_q=num_q, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                head_dim=head_dim, dtype=dtype, page_size=page_size, num_layers=num_layers,
                                layer=layer, padded_rows=padded_rows, pad_positions=pad_positions, seed=seed,
                                nan_dummy_page=True)

    def _run(b, layer=None, **tuning):
        scale = b.q.shape[-1] ** -0.5
        layer = b.layer if layer is None else layer
        args = (_torch(b.q), _torch(b.k_cache), _torch(b.v_cache),
                torch.tensor([layer], dtype=torch.int32), _torch(b.req_to_token),
                _torch(b.entries), _torch(b.q_positions), _torch(b.kv_lens))
        out = tn.launch_torch(*args, scale=scale, ctx_len=b.ctx_len, **tuning)
        ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, layer, *b.args()[4:],
                                  scale=scale, ctx_len=b.ctx_len)
        return out, np.asarray(ref)

    CASES = {
        # name: (batch kwargs, tuning kwargs)
        "hd64_mha_f32_s1": (dict(kv_lens=[5, 77, 130], num_q=1, num_heads=4, num_kv_heads=4,
                                 head_dim=64, dtype=jnp.float32), dict(num_splits=1, block_k=32)),
        "hd128_gqa4_f32_s3": (dict(kv_lens=[1, 45, 150], num_q=1, num_heads=8, num_kv_heads=2,
                                   head_dim=128, dtype=jnp.float32), dict(num_splits=3, block_k=32)),
        "hd128_gqa8_f16_s1": (dict(kv_lens=[33, 100], num_q=1, num_heads=16, num_kv_heads=2,
                                   head_dim=128, dtype=jnp.float16), dict(num_splits=1, block_k=16)),
        "hd64_gqa8_f16_s4_empty_splits": (dict(kv_lens=[3, 50], num_q=1, num_heads=8,
                                               num_kv_heads=1, head_dim=64, dtype=jnp.float16),
                                          dict(num_splits=4, block_k=16)),
        "hd64_gqa4_f32_auto_splits": (dict(kv_lens=[17, 90], num_q=1, num_heads=8, num_kv_heads=2,
                                           head_dim=64, dtype=jnp.float32), dict(block_k=16)),
        # speculative windows: Q * G rows, kv_len < Q rows with garbage positions
        "window_q4_gqa4_f32_s2": (dict(kv_lens=[2, 40, 71], num_q=4, num_heads=8, num_kv_heads=2,
                                       head_dim=64, dtype=jnp.float32, pad_positions="garbage"),
                                  dict(num_splits=2, block_k=16)),
        "window_q8_gqa8_f16_64rows": (dict(kv_lens=[9, 60], num_q=8, num_heads=16, num_kv_heads=2,
                                           head_dim=64, dtype=jnp.float16), dict(block_k=32)),
    }

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_interp_matches_reference(name):
        batch_kw, tuning = CASES[name]
        b = _batch(**batch_kw, seed=len(name))
        out, ref = _run(b, **tuning)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert np.isfinite(out).all()
        assert (out[-1] == 0).all()  # padded row: entry 0, kv_len 0 -> exactly 0
        tol = 1e-5 if batch_kw["dtype"] == jnp.float32 else 1e-2
        np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32),
                                   atol=tol, rtol=tol)

    def test_interp_layer_is_a_runtime_argument():
        b = _batch(kv_lens=[20, 7], num_q=1, num_heads=4, num_kv_heads=2, head_dim=64,
                   dtype=jnp.float32)
        out0, ref0 = _run(b, layer=0, num_splits=2, block_k=16)
        out1, ref1 = _run(b, layer=1, num_splits=2, block_k=16)
        np.testing.assert_allclose(out0, ref0, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(out1, ref1, atol=1e-5, rtol=1e-5)
        assert not np.allclose(out0, out1)
