"""The `serve`, `client` and `bench` subcommands, for jaxoverlap/cli.py to wire up.

    add_serve_args(parser);  run_serve(args, engine_options) -> int
    add_client_args(parser); run_client(args) -> int
    add_bench_args(parser);  run_bench(args) -> int

`engine_options` is the dict of EngineConfig fields from the CLI's shared engine arguments,
including "model" (None serves the embedded default model). Options this module adds are skipped
when the parser already has a flag of that name (e.g. a shared `--max-queued-requests`), so the
shared engine arguments may be added before or after these.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import signal
import sys
import time

from jaxoverlap.server import bench as _bench

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50051


def _add(parser: argparse.ArgumentParser, *flags, **kw):
    if any(f in parser._option_string_actions for f in flags):  # noqa: SLF001 - argparse has no public query
        return None
    return parser.add_argument(*flags, **kw)


def _read_token(args) -> str | None:
    token = getattr(args, "auth_token", None)
    path = getattr(args, "auth_token_file", None)
    if path:
        with open(path) as f:
            token = f.read().strip()
    return token or None


# ---- serve --------------------------------------------------------------------------------------


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("server")
    _add(g, "--host", default="127.0.0.1",
         help="address to listen on (default 127.0.0.1; 0.0.0.0 or [::] to accept remote clients)")
    _add(g, "--port", type=int, default=DEFAULT_PORT, help=f"gRPC port (default {DEFAULT_PORT}; 0 picks a free one)")
    _add(g, "--tls-cert", default=None, help="PEM certificate chain: serve TLS (with --tls-key)")
    _add(g, "--tls-key", default=None, help="PEM private key for --tls-cert")
    _add(g, "--auth-token", default=os.environ.get("JAXOVERLAP_AUTH_TOKEN"),
         help="require 'authorization: Bearer <token>' (default: $JAXOVERLAP_AUTH_TOKEN; health stays open)")
    _add(g, "--auth-token-file", default=None, help="read the bearer token from this file")
    _add(g, "--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    _add(g, "--metrics-host", default=None, help="address for the metrics endpoint (default: --host)")
    _add(g, "--max-queued-requests", type=int, default=None,
         help="reject Generate with RESOURCE_EXHAUSTED beyond max_running_requests + this many in flight")
    _add(g, "--shutdown-grace", type=float, default=30.0,
         help="seconds to let in-flight requests finish on SIGTERM/SIGINT (default 30)")
    _add(g, "--watchdog-timeout", type=float, default=300.0,
         help="report health NOT_SERVING while requests wait on an engine that has finished no step for "
              "this many seconds, e.g. a hung device (default 300; 0: off). The server keeps running: "
              "the orchestrator decides whether to restart it")
    _add(g, "--no-warmup", action="store_true", help="skip the compile warmup request before serving")
    _add(g, "--engine-thread", action="store_true",
         help="run the engine on a thread of the server's process instead of a process of its own "
              "(they then share one GIL, and the server's per-stream Python delays the engine's steps)")
    _add(g, "--precompile", choices=("auto", "on", "all", "off"), default="auto",
         help="compile every decode batch bucket, greedy and sampling, before serving (auto: on GPU only); "
              "all: every prefill bucket too, so that no request compiles")
    _add(g, "--precompile-top-logprobs", action="store_true",
         help="with --precompile: also each program's variant that returns top logprobs (twice the "
              "programs), so that the first request asking for top_logprobs compiles nothing")
    _add(g, "--precompile-structured", action="store_true",
         help="with --precompile: also the programs of batches with structured output (each decode bucket's "
              "forward pass and sampling, with a drafter its draft, verify and accept programs; with 'all', each "
              "prefill's variant with allowed tokens), so that "
              "the first request with a structured_output compiles nothing")
    _add(g, "--precompile-prompt-logprobs", action="store_true",
         help="with --precompile all: also each prefill program's variant that returns prompt logprobs "
              "(scoring requests), so that they compile nothing either (a compile on the engine's "
              "thread stalls every stream)")
    return parser


class EngineBuildError(Exception):
    """build_engine's config or model folder can make no engine: the message of the error
    the construction raised (jaxoverlap.cli.BUILD_ERRORS), which `serve` reports in one line.
    Apart from the errors of the worker's warm-up, which keep their traceback."""


def build_engine(config):
    """The serve command's engine factory (module-level: an EngineProcess sends it to its child)."""
    from jaxoverlap.cli import BUILD_ERRORS
    from jaxoverlap.engine import Engine

    try:
        return Engine(config)
    except BUILD_ERRORS as e:
        raise EngineBuildError(str(e)) from e


def serve_engine_config(engine_options: dict):
    """(EngineConfig, the server's --max-queued-requests) from the CLI's engine options."""
    from jaxoverlap.config import EngineConfig

    opts = dict(engine_options)
    model = opts.pop("model", None)
    # --max-queued-requests shares its name with an EngineConfig field, so the CLI's option
    # collector hands it over here too. It is the server's admission limit (in flight beyond
    # max_running_requests); the engine's own limit counts requests waiting between two steps,
    # which a burst of arrivals exceeds easily, so the engine keeps its default.
    server_max_queued = opts.pop("max_queued_requests", None)
    # A server restarts with the same programs: by default it keeps them in the persistent
    # compilation cache (on a GPU; Engine resolves "auto"), so that a restart loads in seconds
    # what took minutes to compile.
    if opts.get("compilation_cache_dir") is None:
        opts["compilation_cache_dir"] = "auto"
    return EngineConfig.from_options(model, **opts), server_max_queued


def serve_worker_options(args) -> dict:
    """What the engine's worker does before it serves (EngineWorker / EngineProcess options),
    from the serve command's --no-warmup, --precompile, --precompile-top-logprobs,
    --precompile-structured and --precompile-prompt-logprobs (which needs --precompile all:
    SystemExit otherwise)."""
    precompile = getattr(args, "precompile", "auto")
    prompt = getattr(args, "precompile_prompt_logprobs", False)
    if prompt and precompile != "all":
        sys.exit("error: --precompile-prompt-logprobs compiles prefill programs: it needs --precompile all")
    return dict(warmup=not getattr(args, "no_warmup", False),
                precompile={"on": True, "all": True, "off": False}.get(precompile, "auto"),
                precompile_prefill=precompile == "all",
                precompile_top_logprobs=getattr(args, "precompile_top_logprobs", False),
                precompile_structured=getattr(args, "precompile_structured", False),
                precompile_prompt_logprobs=prompt)


def run_serve(args, engine_options: dict) -> int:
    """Build the engine from engine_options, serve it until SIGINT/SIGTERM, shut down gracefully."""
    from jaxoverlap.server.engine_worker import EngineWorker

    if not logging.getLogger().handlers:  # warnings of the server (drain, engine death) on stderr
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from jaxoverlap.cli import exit_on_build_error

    with exit_on_build_error():
        config, server_max_queued = serve_engine_config(engine_options)
    worker_options = serve_worker_options(args)
    if getattr(args, "engine_thread", False):
        worker = EngineWorker(engine_factory=functools.partial(build_engine, config), **worker_options)
    else:
        from jaxoverlap.server.engine_process import EngineProcess

        worker = EngineProcess(functools.partial(build_engine, config), **worker_options)
    t0 = time.perf_counter()
    print(f"loading {config.model or 'the embedded default model'} ...", file=sys.stderr, flush=True)
    try:
        worker.start()
    except RuntimeError as e:  # "engine failed to start", from what the engine or its warm-up raised
        if isinstance(e.__cause__, EngineBuildError):
            sys.exit(f"error: {e.__cause__}")
        raise
    print(f"engine ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    max_queued = getattr(args, "max_queued_requests", None)
    if max_queued is None:
        max_queued = server_max_queued
    try:
        asyncio.run(_serve(args, worker, max_queued))
    finally:
        worker.stop()
    return 0


async def _serve(args, worker, max_queued) -> None:
    from jaxoverlap.server.grpc_server import GenerationServer

    server = GenerationServer(
        worker, host=args.host, port=args.port, tls_cert=args.tls_cert, tls_key=args.tls_key,
        auth_token=_read_token(args), metrics_port=args.metrics_port or None, metrics_host=args.metrics_host,
        max_queued_requests=max_queued, owns_worker=True, stall_timeout=args.watchdog_timeout or None)
    await server.start()
    scheme = "TLS" if args.tls_cert else "plaintext"
    print(f"serving on {args.host}:{server.port} ({scheme}{', token auth' if server.auth_token else ''})"
          + (f"; metrics on http://{server.metrics_host}:{server.metrics_port}/metrics" if server.metrics_port else ""),
          file=sys.stderr, flush=True)
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task] = []

    def on_signal(signame):
        if not stopping:
            print(f"{signame}: draining for up to {args.shutdown_grace:.0f}s (again to stop now)", file=sys.stderr,
                  flush=True)
            stopping.append(loop.create_task(server.stop(args.shutdown_grace)))
        else:
            server.force_stop()  # a second signal: cancel what is left right away

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal, sig.name)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-Unix or not the main thread
            pass
    await server.wait_for_termination()
    for t in stopping:
        await t


# ---- client -------------------------------------------------------------------------------------


def add_client_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _add(parser, "prompt", nargs="?", default=None, help="prompt text (or use --token-ids)")
    g = parser.add_argument_group("connection")
    _add(g, "--target", default=f"127.0.0.1:{DEFAULT_PORT}", help="server address host:port")
    _add(g, "--token", default=os.environ.get("JAXOVERLAP_AUTH_TOKEN"),
         help="bearer token (default: $JAXOVERLAP_AUTH_TOKEN)")
    _add(g, "--tls-ca", default=None, help="CA certificate (PEM) to connect with TLS")
    _add(g, "--tls", action="store_true", help="connect with TLS using the system's roots")
    _add(g, "--tls-server-name", default=None, help="name to check the server certificate against")
    _add(g, "--timeout", type=float, default=None, help="deadline of the call in seconds")
    g = parser.add_argument_group("request")
    _add(g, "--token-ids", default=None, help="comma-separated prompt token ids instead of text")
    _add(g, "--chat", action="store_true",
         help="send the prompt as a user message, under the model's chat template")
    _add(g, "--system", default=None, help="with --chat: a system message before it")
    _add(g, "--chat-template-kwargs", default=None,
         help='with --chat: JSON object of template variables, e.g. \'{"enable_thinking": false}\'')
    _add(g, "--request-id", default=None)
    _add(g, "--max-new-tokens", type=int, default=None)
    _add(g, "--temperature", type=float, default=None)
    _add(g, "--top-k", type=int, default=None)
    _add(g, "--top-p", type=float, default=None)
    _add(g, "--min-p", type=float, default=None)
    _add(g, "--seed", type=int, default=None)
    _add(g, "-n", "--n", type=int, default=None, help="independent samples of the prompt (sample k uses --seed + k)")
    _add(g, "--stop", action="append", default=None, help="stop string (repeatable)")
    _add(g, "--stop-token-ids", default=None, help="comma-separated stop token ids")
    _add(g, "--ignore-eos", action="store_true", default=None)
    _add(g, "--include-stop-str-in-output", action="store_true", default=None,
         help="the text ends with the stop string that ended it")
    _add(g, "--keep-special-tokens", action="store_true", default=None,
         help="write special tokens (<|im_end|> and the like) into the text")
    _add(g, "--logprobs", action="store_true", default=None)
    _add(g, "--top-logprobs", type=int, default=None)
    _add(g, "--repetition-penalty", type=float, default=None)
    _add(g, "--frequency-penalty", type=float, default=None)
    _add(g, "--presence-penalty", type=float, default=None)
    _add(g, "--min-new-tokens", type=int, default=None)
    _add(g, "--logit-bias", type=json.loads, default=None, help='JSON object {token id: bias}, e.g. \'{"5": -100}\'')
    _add(g, "--json-schema", default=None,
         help="structured output: the output follows this JSON schema (JSON text, or a file holding it)")
    _add(g, "--regex", default=None, help="structured output: the whole output matches this regex")
    _add(g, "--choice", nargs="+", default=None, help="structured output: the output is one of these strings")
    g = parser.add_argument_group("other calls (instead of generating)")
    _add(g, "--info", action="store_true", help="print model and server info as JSON")
    _add(g, "--health", action="store_true", help="print the health status (exit status 1 unless SERVING)")
    _add(g, "--abort", metavar="REQUEST_ID", default=None, help="abort a running request")
    _add(g, "--json", action="store_true", help="print the final result as JSON instead of streaming text")
    return parser


def _ids(text: str | None, flag: str):
    if not text:
        return None
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def run_client(args) -> int:
    import grpc

    from jaxoverlap.errors import InvalidRequestError
    from jaxoverlap.server.client import Chunk, GenerationClient
    from jaxoverlap.structured import from_command_line

    client = GenerationClient(args.target, token=args.token, tls_ca=args.tls_ca, tls=args.tls,
                              tls_server_name=args.tls_server_name, timeout=args.timeout)
    try:
        if args.health:
            status = client.health()
            print(status)
            return 0 if status == "SERVING" else 1  # a probe's exit status, as grpc_health_probe's
        if args.info:
            print(json.dumps({"model": client.model_info(), "server": client.server_info()}, indent=2))
            return 0
        if args.abort:
            client.abort(args.abort)
            print(f"aborted {args.abort}")
            return 0
        try:
            token_ids = _ids(args.token_ids, "--token-ids")
            stop_token_ids = _ids(args.stop_token_ids, "--stop-token-ids")
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        if (args.prompt is None) == (token_ids is None):
            print("give a prompt or --token-ids (one of them)", file=sys.stderr)
            return 2
        sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=args.stop,
                        stop_token_ids=stop_token_ids, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
                        top_logprobs=args.top_logprobs,
                        repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                        presence_penalty=args.presence_penalty, min_new_tokens=args.min_new_tokens,
                        logit_bias=args.logit_bias, include_stop_str_in_output=args.include_stop_str_in_output,
                        skip_special_tokens=None if args.keep_special_tokens is None else False)
        try:
            sampling["structured_output"] = from_command_line(args.json_schema, args.regex, args.choice)
        except InvalidRequestError as e:
            print(e, file=sys.stderr)
            return 2
        prompt = args.prompt if token_ids is None else token_ids
        if args.chat:
            if token_ids is not None:
                print("--chat takes a prompt text, not --token-ids", file=sys.stderr)
                return 2
            prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.prompt}]
            if args.chat_template_kwargs:
                try:
                    sampling["chat_template_kwargs"] = json.loads(args.chat_template_kwargs)
                except json.JSONDecodeError as e:
                    print(f"--chat-template-kwargs is not JSON: {e}", file=sys.stderr)
                    return 2
        elif args.system or args.chat_template_kwargs:
            print("--system and --chat-template-kwargs need --chat", file=sys.stderr)
            return 2
        if args.json:
            results = client.generate_samples(prompt, args.n or 1, request_id=args.request_id, **sampling)
            print(json.dumps([r.__dict__ for r in results] if args.n and args.n > 1 else results[0].__dict__,
                             indent=2))
            return 0
        if args.n and args.n > 1:  # the samples' chunks interleave: print each sample once it is done
            for r in client.generate_samples(prompt, args.n, request_id=args.request_id, **sampling):
                print(f"--- sample {r.index} [{r.finish_reason}, {r.completion_tokens} tokens]\n{r.text}")
            return 0
        done = None
        for item in client.generate(prompt, request_id=args.request_id, **sampling):
            if isinstance(item, Chunk):
                sys.stdout.write(item.text)
                sys.stdout.flush()
            else:
                done = item
        sys.stdout.write("\n")
        if done is not None:
            print(f"[{done.finish_reason}] prompt {done.prompt_tokens} tokens ({done.cached_tokens} cached), "
                  f"output {done.completion_tokens} tokens, TTFT {done.time_to_first_token * 1000:.1f} ms, "
                  f"accept length {done.accept_length:.2f}", file=sys.stderr)
        return 0
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()


# ---- bench --------------------------------------------------------------------------------------


def add_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return _bench.add_bench_args(parser)


def run_bench(args) -> int:
    return _bench.run_bench(args)
