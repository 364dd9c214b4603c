#!/usr/bin/env python3
"""Decode-attention kernel variants on the GPU, one process: correctness against the
XLA reference and time per call, for the Pallas Triton-lowering kernel (the engine's),
the native Triton kernel through jax-triton and the Pallas Mosaic GPU kernel.

    PYTHONPATH=/path/to/jax_triton python3 benchmarks/kernel_variants.py

Each variant's own `gpu_self_check` prints the table rows; a variant that cannot
run here (jax-triton missing) is reported and skipped, not hidden.
"""
from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_importable  # noqa: E402


def main() -> int:
    ensure_importable()
    from jaxoverlap.pallas_kernels import mosaic_decode, triton_native

    failed = 0
    for name, module in (("triton_native (jax-triton)", triton_native), ("mosaic_decode (Mosaic GPU)", mosaic_decode)):
        print(f"\n== {name}: available={module.available()}", flush=True)
        if not module.available():
            failed += 1
            continue
        try:
            print(f"== {name}: {module.gpu_self_check(bench=True)}", flush=True)
        except Exception:
            traceback.print_exc()
            failed += 1
    return failed


if __name__ == "__main__":
    sys.exit(main())
