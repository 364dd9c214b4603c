"""`jaxoverlap profile` on Qwen3-8B shapes with random weights (GPU): per-step device time, the
gap between steps, host time per step and throughput, with and without overlap; writes
profile.json and the PNGs to --out. Any `jaxoverlap profile` option passes through.

    python benchmarks/profile_step.py --out results/profile_qwen3_8b --batch-size 1 32 --keep-traces

The repo need not be installed (common.ensure_importable), so this runs on the lent GPU
machine as it is.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, ensure_importable, model_dir  # noqa: E402

# Defaults for an 8B model on one GPU; later flags on the command line override them.
DEFAULTS = ["--load-format", "dummy", "--dtype", "bfloat16", "--max-context-len", "1024",
            "--kv-cache-tokens", "65536", "--max-running-requests", "64"]


def main() -> int:
    ensure_importable()
    from jaxoverlap.cli import main as cli_main

    argv = sys.argv[1:]
    if "--model" not in argv:
        argv = ["--model", model_dir(QWEN3_8B)] + argv
    return cli_main(["profile"] + DEFAULTS + argv)


if __name__ == "__main__":
    sys.exit(main())
