"""`jaxoverlap profile`: arguments and main. Imports JAX only when the command runs."""
from __future__ import annotations

import argparse
import os
import platform
import sys


def add_profile_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("profile")
    g.add_argument("--out", default="results/profile", help="folder for profile.json and the PNGs")
    g.add_argument("--batch-size", type=int, nargs="+", default=[8], help="requests per workload (several: one each)")
    g.add_argument("--prompt-len", type=int, default=64)
    g.add_argument("--new-tokens", type=int, default=64, help="tokens each request generates (EOS ignored)")
    g.add_argument("--steps", type=int, default=8, help="loop iterations traced per loop (decode phase)")
    g.add_argument("--skip", type=int, default=2, help="decode iterations before the trace starts")
    g.add_argument("--repeats", type=int, default=3, help="timed runs per loop for throughput")
    g.add_argument("--keep-traces", action="store_true", help="copy the raw traces into --out")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--whole-run", action="store_true",
                   help="also trace one overlap run whole, prefill included: the run against the device-only bound")


def run_profile(args: argparse.Namespace, engine_options: dict) -> int:
    import jax

    from jaxoverlap.cli import exit_on_build_error
    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine
    from jaxoverlap.errors import InvalidRequestError
    from jaxoverlap.profiling import capture, report

    for name in ("steps", "repeats"):
        if getattr(args, name) < 1:
            sys.exit(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.skip < 0:
        sys.exit(f"--skip must be >= 0, got {args.skip}")
    if min(args.batch_size) < 1:
        sys.exit(f"--batch-size must be >= 1, got {min(args.batch_size)}")
    if len(set(args.batch_size)) < len(args.batch_size):  # each writes the same plots and traces
        sys.exit(f"--batch-size lists a size twice: {args.batch_size}")
    if args.prompt_len < 1:
        sys.exit(f"--prompt-len must be >= 1, got {args.prompt_len}")
    if engine_options.get("disable_overlap"):
        sys.exit("profile runs both loops, overlap and normal, itself: drop --disable-overlap")
    if args.new_tokens < args.skip + 2:
        sys.exit(f"--new-tokens {args.new_tokens} leaves no decode steps to trace after --skip {args.skip}")
    needed = max(args.batch_size)
    opts = dict(engine_options)
    if opts.get("max_running_requests", needed) < needed:
        sys.exit(f"--batch-size {needed} > --max-running-requests {opts['max_running_requests']}")
    try:
        os.makedirs(args.out, exist_ok=True)
        if not os.access(args.out, os.W_OK):
            raise PermissionError(f"cannot write to {args.out}")
    except OSError as e:
        sys.exit(f"--out {args.out}: {e.strerror or e}")
    if args.steps < 3 and not args.no_plots:
        print(f"--steps {args.steps}: no timeline plot (it draws three consecutive decode steps)", file=sys.stderr)
    with exit_on_build_error():
        engine = Engine(EngineConfig.from_options(args.model, **opts))
    workloads = [capture.Workload(b, args.prompt_len, args.new_tokens) for b in args.batch_size]
    try:  # a prompt this engine cannot take (longer than its context): say so before compiling anything
        for w in workloads:
            capture.check_workload(engine, w)
    except InvalidRequestError as e:
        sys.exit(f"--prompt-len {args.prompt_len} --new-tokens {args.new_tokens}: {e}")
    print(f"profiling {engine.model_name} on {jax.devices()[0].device_kind} ({jax.default_backend()}): "
          f"batch {args.batch_size}, prompt {args.prompt_len}, {args.new_tokens} new tokens", file=sys.stderr)
    results = capture.profile(engine, workloads, repeats=args.repeats,
                              window=capture.TraceWindow(args.steps, args.skip),
                              keep_traces=args.out if args.keep_traces else None, whole_run=args.whole_run,
                              log=lambda s: print(s, file=sys.stderr))
    meta = {
        "model": engine.model_name, "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
        "jax": jax.__version__, "python": platform.python_version(), "dtype": str(engine.dtype.__name__),
        "engine_options": {k: v for k, v in opts.items() if isinstance(v, (int, float, str, bool, type(None)))},
        "trace_steps": args.steps, "skip": args.skip, "repeats": args.repeats,
    }
    rep = report.build(results, meta)
    report.write_json(rep, os.path.join(args.out, "profile.json"))
    print(report.table(rep))
    if not args.no_plots:
        from jaxoverlap.profiling import plots

        for path in plots.write_all(rep, args.out):
            print(f"wrote {path}", file=sys.stderr)
    print(f"wrote {os.path.join(args.out, 'profile.json')}", file=sys.stderr)
    return 0
