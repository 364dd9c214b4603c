"""Shared pieces of the GPU benchmark scripts: model shapes, timing, the results table."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

# The repo is copied to the GPU machine but not installed there: map the folders onto the
# `jaxoverlap` namespace the way pyproject.toml does.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ensure_importable() -> None:
    try:
        import jaxoverlap.models  # noqa: F401
        return
    except ImportError:
        pass
    import importlib.util

    sys.path.insert(0, _ROOT)
    import jaxoverlap

    for sub, folder in (("models", "models"), ("pallas_kernels", "pallas_kernels"), ("server", "server")):
        path = os.path.join(_ROOT, folder, "__init__.py")
        spec = importlib.util.spec_from_file_location(f"jaxoverlap.{sub}", path,
                                                      submodule_search_locations=[os.path.dirname(path)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[f"jaxoverlap.{sub}"] = mod
        setattr(jaxoverlap, sub, mod)
        spec.loader.exec_module(mod)


QWEN3_8B = {
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "eos_token_id": 151645, "bos_token_id": 151643,
}


# Qwen3-30B-A3B: 128 experts of width 768, 8 per token (about 3.3B of its 30.5B weights per token).
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": 151645, "bos_token_id": 151643,
}


# Qwen3-8B's layout shrunk for CPU smoke runs of the benchmark scripts (--tiny).
TINY = dict(QWEN3_8B, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32)
TINY_MOE = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=128, moe_intermediate_size=64, num_experts=16,
                num_experts_per_tok=4, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32)
# --model choices of the benchmarks that take one: (GPU shapes, CPU smoke shapes).
MODELS = {"qwen3-8b": (QWEN3_8B, TINY), "qwen3-30b-a3b": (QWEN3_30B_A3B, TINY_MOE)}


def step_bytes(params, cfg, batch: int) -> int:
    """Weight bytes one decode step of `batch` tokens must read: all of them for a dense
    model; for a mixture of experts, the experts a batch of independent tokens is expected
    to reach (E (1 - (1 - k/E)^B) per layer, as if routing were uniform) and everything else."""
    import jax

    total = sum(x.nbytes for x in jax.tree.leaves(params))
    if not cfg.is_moe:
        return total
    from jaxoverlap.models.params import layer_at, num_layers

    E, k = cfg.num_experts, cfg.experts_per_token
    layers = [layer_at(params, i) for i in range(num_layers(params))]
    experts = sum(x.nbytes for lw in layers for x in jax.tree.leaves((lw.w_gate_up, lw.w_down)))  # plain or FP8
    reached = E * (1 - (1 - k / E) ** batch)
    return int(total - experts + experts * reached / E)


def model_dir(config: dict) -> str:
    """A checkpoint folder holding only config.json, for load_format='dummy'; removed when
    the process exits (a server it starts is stopped before then)."""
    d = tempfile.mkdtemp(prefix="jaxoverlap-model-")
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    return d


def copy_bandwidth_gbs(nbytes: int = 4 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)  # one read and one write per element
    f(x).block_until_ready()
    t = time.perf_counter()
    for _ in range(iters):
        y = f(x)
    y.block_until_ready()
    dt = (time.perf_counter() - t) / iters
    return 2 * nbytes / dt / 1e9


def git_commit() -> str:
    """The short commit of the checkout, or "" outside git. (On the lent GPU the copied
    `.git` can be stale: RESULTS.md names the commit of the tree that ran.)"""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=_ROOT).stdout.strip()
    except OSError:
        return ""


def write_results(path: str, args, rows: list[dict], **extra) -> None:
    """The JSON a benchmark writes: the device, versions, the checkout's commit, its
    arguments and rows, plus any extra fields."""
    import platform

    import jax

    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": platform.python_version(),
           "commit": git_commit(), "args": vars(args), "rows": rows, **extra}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def print_table(rows: list[dict], cols: list[str]) -> None:
    widths = {c: max([len(c)] + [len(_fmt(r.get(c))) for r in rows]) for c in cols}
    print("  ".join(c.rjust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in cols))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def run_variant(script: str, name: str, xla_flags: str, child_args: list[str], timeout_s: int,
                extra_env: dict | None = None) -> tuple[dict, str]:
    """Run `script --child --variant name *child_args` in a subprocess with `xla_flags`
    added to XLA_FLAGS (read once, at backend start, hence one process per variant).
    Returns (the child's `RESULT {json}` line, or {"variant", "error"}; its stderr)."""
    import subprocess

    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + xla_flags).strip(), **(extra_env or {}))
    cmd = [sys.executable, os.path.abspath(script), "--child", "--variant", name, *child_args]
    print(f"== {name}: XLA_FLAGS={env['XLA_FLAGS']!r}", flush=True)
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(out[-3000:], flush=True)
        return {"variant": name, "error": f"timeout after {timeout_s}s"}, ""
    print(p.stdout[-4000:], p.stderr[-1500:] if p.returncode else "", flush=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if lines:
        return json.loads(lines[-1][len("RESULT "):]), p.stderr
    # The cause is usually one line near the top (an unknown flag, a bad value), followed
    # by the whole flag help: keep those lines and the tail.
    keys = ("Unknown", "unknown", "update_mode", "Check failed", "Error", "rror:")
    err = [ln for ln in p.stderr.splitlines() if any(k in ln for k in keys)][:10]
    return {"variant": name, "error": "\n".join(err + [p.stderr[-1500:]])}, p.stderr
