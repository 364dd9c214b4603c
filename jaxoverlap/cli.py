"""The `jaxoverlap` command line: generate, batch, profile, serve, client, bench.

argparse lives here only; everything below it takes EngineConfig / SamplingParams.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time

from jaxoverlap.config import EngineConfig


# JAX's GPU allocator takes 75% of the card unless told otherwise: a serving engine wants
# most of it (vLLM's default share is 0.9): on an 80 GB card 0.75 leaves 59.7 GiB, less than
# Qwen3-30B-A3B's 57 GiB of weights plus a prefill chunk's 2.4-4.5 GB of MoE temporaries,
# before any KV cache (it loaded and stacked at 0.9 on an H100: RESULTS.md, 2026-12-07).
DEVICE_MEMORY_FRACTION = 0.9


def claim_device_memory(fraction: float, environ=os.environ) -> None:
    """Ask JAX's allocator for `fraction` of each GPU, unless XLA_PYTHON_CLIENT_MEM_FRACTION
    is set already. Before the backend starts (it reads the variable once): the commands call
    this before building an engine."""
    if not 0.0 < fraction <= 1.0:
        raise SystemExit(f"--device-memory-fraction must be in (0, 1], got {fraction}")
    environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(fraction))


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine options")
    g.add_argument("--model", default=None, help="HF checkpoint folder (default: the embedded tiny model)")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: the layers' weight matrices (experts too) in 8 bits with a scale per output "
                        "column (half their memory and bytes per decode step; activations stay in --dtype, the KV "
                        "cache in --kv-cache-dtype)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="auto: the KV cache in --dtype; fp8 (= fp8_e4m3) or fp8_e5m2: in 8 bits, with the "
                        "checkpoint's per-layer k/v scales where it has them, else 1 (twice the tokens in the same "
                        "memory, half the bytes attention reads per token)")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--max-running-requests", type=int, default=64)
    g.add_argument("--max-context-len", type=int, default=None)
    g.add_argument("--chunked-prefill-size", type=int, default=2048,
                   help="prompt tokens per prefill step at most, and padded rows x tokens")
    g.add_argument("--max-prefill-requests", type=int, default=8, help="requests of one prefill step at most")
    g.add_argument("--max-prefill-rows", type=int, default=None,
                   help="rows of one prefill step at most: prompts are cut into rows of one token bucket, so a "
                        "long prompt may take several (default: one per 32 tokens of --chunked-prefill-size, "
                        "at least --max-prefill-requests: 64 for 2048)")
    g.add_argument("--kv-cache-tokens", type=int, default=None)
    g.add_argument("--kv-cache-memory-fraction", type=float, default=0.85)
    g.add_argument("--device-memory-fraction", type=float, default=DEVICE_MEMORY_FRACTION,
                   help="share of each GPU's memory that JAX's allocator takes, which the weights, the KV cache "
                        "and the programs' temporaries share (XLA_PYTHON_CLIENT_MEM_FRACTION, which wins where "
                        "set; JAX's own default is 0.75)")
    g.add_argument("--disable-overlap", action="store_true", help="use the normal (non-overlap) loop")
    g.add_argument("--disable-prefix-cache", action="store_true")
    g.add_argument("--tensor-parallel-size", type=int, default=1)
    g.add_argument("--attention-backend", default="auto", choices=["auto", "xla", "pallas"])
    g.add_argument("--disable-fused-decode", action="store_true",
                   help="pallas: separate kernels for decode's q/k norm, RoPE, cache write and attention")
    g.add_argument("--weights-cache-dir", default=None)
    g.add_argument("--compilation-cache-dir", default=None,
                   help="JAX persistent compilation cache folder, so that a restart loads the compiled programs; "
                        "'auto': ~/.cache/jaxoverlap/jax_compilation_cache on a GPU (the serve default), "
                        "'none': no cache")
    g.add_argument("--single-decode-executable", dest="alternate_decode_executables", action="store_false",
                   help="run each decode program as one executable, not two copies in turn")
    g.add_argument("--layers-per-weight-stack", type=int, default=None,
                   help="one device: store the weight matrices of this many consecutive layers as one array per "
                        "kind, for fewer arguments per step call (default: 4 on a GPU, 1 elsewhere)")
    g.add_argument("--reserve-slack-tokens", type=int, default=None,
                   help="positions each row gets beyond its need when a decode step reserves pages anyway, so "
                        "that rows take pages together and few steps send reservations (default: 2 pages)")
    g.add_argument("--decode-inputs", default="every_step", choices=["every_step", "on_change"],
                   help="send the decode step's input array (entries and page reservations) every step (one "
                        "device: keeps the step's buffers in place, so XLA need not re-record its CUDA graph) "
                        "or only when it changed")
    g.add_argument("--no-freeze-gc", dest="freeze_gc", action="store_false",
                   help="leave Python's garbage collector alone (default: gc.freeze() once the engine is built)")
    g.add_argument("--disable-penalties", dest="enable_penalties", action="store_false",
                   help="refuse repetition/frequency/presence penalties, logit_bias and min_new_tokens, and keep no "
                        "per-request token history on the device ([max running + 1, vocab] int32)")
    g.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("speculative decoding (SGLang's flag names)")
    s.add_argument("--speculative-algorithm", default=None, choices=["eagle", "draft_model", "ngram", "ngram_device"])
    s.add_argument("--speculative-num-steps", type=int, default=None, help="draft tokens per step (default 3)")
    s.add_argument("--speculative-num-draft-tokens", type=int, default=None, help="window: 1 + num steps")
    s.add_argument("--speculative-eagle-topk", type=int, default=1)
    s.add_argument("--speculative-draft-model-path", default=None)
    s.add_argument("--speculative-eagle-head-path", default=None)
    s.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="decode batches of more rows than this draft nothing (speculation paused)")


# What building an engine raises for options or a model folder it cannot use: EngineConfig's
# checks and the engine's own (a tensor-parallel size the devices do not allow), a checkpoint
# that is not one (CheckpointError), a --model that is not there.
BUILD_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError)


@contextlib.contextmanager
def exit_on_build_error():
    """Around building an LLM / Engine (or its EngineConfig) from the command line's options:
    a BUILD_ERRORS error ends the command with its reason in one line, not a traceback. Only
    around the construction: the same errors later are bugs and keep their traceback."""
    try:
        yield
    except BUILD_ERRORS as e:
        sys.exit(f"error: {e}")


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options given on the command line, keyed like EngineConfig's fields."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    return {k: v for k, v in vars(args).items() if k in names}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("-n", "--n", type=int, default=1,
                   help="independent samples per prompt (sample k uses --sampling-seed + k)")
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--stop-token-ids", type=int, nargs="*", default=[])
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--include-stop-str-in-output", action="store_true",
                   help="the text ends with the stop string that ended it")
    g.add_argument("--keep-special-tokens", action="store_true",
                   help="write special tokens (<|im_end|> and the like) into the text")
    g.add_argument("--logprobs", action="store_true")
    g.add_argument("--top-logprobs", type=int, default=0,
                   help="per output token, this many (at most 20) most likely tokens and their logprobs")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide positive logits (multiply negative ones) of tokens in the prompt or output (1 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times the count of each token generated so far (-2..2)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from each token generated so far (-2..2)")
    g.add_argument("--logit-bias", type=json.loads, default=None,
                   help='JSON object {token id: bias (-100..100)} added to those logits, e.g. \'{"151643": -100}\'')
    g.add_argument("--min-new-tokens", type=int, default=0,
                   help="no EOS or stop token id among the first this many output tokens")
    g.add_argument("--prompt-logprobs", action="store_true",
                   help="each prompt token's logprob given the ones before it (loglikelihood scoring)")
    add_structured_output_args(g)


def add_structured_output_args(g) -> None:
    g.add_argument("--json-schema", default=None,
                   help="structured output: the output follows this JSON schema (JSON text, or a file holding it)")
    g.add_argument("--regex", default=None, help="structured output: the whole output matches this regex")
    g.add_argument("--choice", nargs="+", default=None, help="structured output: the output is one of these strings")


def sampling_params(args: argparse.Namespace):
    from jaxoverlap.sampling_params import SamplingParams
    from jaxoverlap.structured import from_command_line

    return SamplingParams(
        structured_output=from_command_line(args.json_schema, args.regex, args.choice),
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, seed=args.sampling_seed, n=args.n, stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_ids),
        ignore_eos=args.ignore_eos, logprobs=args.logprobs, top_logprobs=args.top_logprobs,
        include_stop_str_in_output=args.include_stop_str_in_output, skip_special_tokens=not args.keep_special_tokens,
        prompt_logprobs=args.prompt_logprobs, repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty, min_new_tokens=args.min_new_tokens, logit_bias=args.logit_bias or (),
    )


def _checked_sampling_params(args: argparse.Namespace):
    """The command's SamplingParams, or exit with what is wrong (before the model loads)."""
    from jaxoverlap.errors import InvalidRequestError

    try:
        return sampling_params(args)
    except InvalidRequestError as e:
        sys.exit(str(e))


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxoverlap.llm import LLM

    # Checked before the model loads, so that a mistake costs no minutes.
    params = _checked_sampling_params(args)
    if args.system and not args.chat:
        sys.exit("--system needs --chat")
    if args.stream:
        if params.n > 1 or len(args.prompts) > 1:
            sys.exit("--stream prints one text as it comes: give one prompt and leave --n at 1")
        if args.json or params.logprobs or params.top_logprobs or params.prompt_logprobs:
            sys.exit("--stream prints text only: drop it for --json, --logprobs, --top-logprobs or --prompt-logprobs")
    t0 = time.perf_counter()
    with exit_on_build_error():
        llm = LLM(args.model, **engine_options(args))
    t_load = time.perf_counter() - t0
    if args.chat:  # each prompt is one user message, under the model's chat template
        if llm.tokenizer is None:
            sys.exit("--chat needs the model's tokenizer (tokenizer.json), and this checkpoint has none")
        system = [{"role": "system", "content": args.system}] if args.system else []
        try:
            prompts = [llm.tokenizer.encode_chat(system + [{"role": "user", "content": p}]) for p in args.prompts]
        except ValueError as e:  # InvalidRequestError: no template, or one that refuses the messages
            sys.exit(str(e))
    else:
        prompts = args.prompts
    from jaxoverlap.errors import InvalidRequestError

    try:  # a prompt the engine refuses (empty, too long): its reason, not a traceback
        if args.stream:
            for out in llm.generate_stream(prompts, params):
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            return 0
        results = llm.generate(prompts, params)
    except InvalidRequestError as e:
        sys.exit(str(e))
    for i, r in enumerate(results):
        prompt = args.prompts[i // params.n]  # results[n * p + k]: sample k of prompt p
        if args.json:
            print(json.dumps({
                "prompt": prompt, **({"sample_index": r.sample_index} if params.n > 1 else {}),
                "text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                "ttft_s": r.metrics.time_to_first_token, "tokens_per_s": r.metrics.tokens_per_second,
                **({"logprobs": r.logprobs} if r.logprobs is not None else {}),
                **({"top_logprobs": r.top_logprobs} if r.top_logprobs is not None else {}),
                **({"prompt_logprobs": r.prompt_logprobs, "prompt_top1": r.prompt_top1}
                   if r.prompt_logprobs is not None else {}),
            }))
        else:
            print(f"{prompt}{r.text}")
            tps = r.metrics.tokens_per_second
            print(f"  [{len(r.token_ids)} tokens, finish={r.finish_reason}, "
                  f"ttft={r.metrics.time_to_first_token * 1e3:.1f} ms, "
                  f"{tps:.1f} tok/s incl. compile; load {t_load:.1f} s]", file=sys.stderr)
    return 0


EXIT_BATCH_ERRORS = 3  # `jaxoverlap batch`: the run finished, but some lines got error lines


def cmd_batch(args: argparse.Namespace) -> int:
    import os

    from jaxoverlap.batch import print_summary, run_batch
    from jaxoverlap.llm import LLM

    # Checked before the model loads, so that a mistake costs no minutes.
    if not os.path.isfile(args.input):
        sys.exit(f"no input file {args.input!r}" + (" (it is a folder)" if os.path.isdir(args.input) else ""))
    if os.path.isdir(args.output):
        sys.exit(f"the output {args.output!r} is a folder: name a file")
    if os.path.exists(args.output) and os.path.samefile(args.input, args.output):
        sys.exit(f"the output {args.output!r} is the input file: name another")
    if os.path.exists(args.output) and not (args.resume or args.overwrite):
        sys.exit(f"{args.output} exists: pass --resume to continue it or --overwrite to start again")
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        sys.exit(f"no folder {folder!r} for the output")
    probe = args.output + ".tmp"  # run_batch rewrites the output through this file
    try:
        open(probe, "a").close()
        os.remove(probe)
    except OSError as e:
        sys.exit(f"cannot write the output next to {args.output!r}: {e.strerror or e}")
    defaults = _checked_sampling_params(args)
    try:
        template_kwargs = json.loads(args.chat_template_kwargs)
    except json.JSONDecodeError as e:
        sys.exit(f"--chat-template-kwargs is not JSON: {e}")
    if not isinstance(template_kwargs, dict):
        sys.exit("--chat-template-kwargs must be a JSON object")
    with exit_on_build_error():
        llm = LLM(args.model, **engine_options(args))
    with llm:
        try:
            summary = run_batch(llm, args.input, args.output, defaults, resume=args.resume,
                                overwrite=args.overwrite, progress=not args.no_progress,
                                chat_template_kwargs=template_kwargs)
        except KeyboardInterrupt:
            print(f"\ninterrupted: the results finished so far are in {args.output}; run again with --resume "
                  "to finish the rest", file=sys.stderr)
            return 130
    print_summary(summary)
    # A line that ended as an error line is a failure a pipeline should see (it stays in the
    # output, and --resume tries it again).
    return EXIT_BATCH_ERRORS if summary.errors else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxoverlap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from prompts (offline)")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--stream", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON line per prompt")
    g.add_argument("--chat", action="store_true", help="send each prompt as a user message, under the model's "
                                                       "chat template")
    g.add_argument("--system", default=None, help="with --chat: a system message before each prompt")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("batch", help="generate for every request of a JSONL file (offline evaluation)",
                       description="One JSON request per input line, one JSON result per output line, written "
                                   "as each request finishes; see jaxoverlap/batch.py for both formats. The "
                                   "sampling options are the defaults that a line's sampling_params override. "
                                   f"Exit status {EXIT_BATCH_ERRORS} when some lines got error lines (the others "
                                   "are written; --resume tries the failed ones again).")
    b.add_argument("input", help="JSONL requests: prompt, prompt_token_ids or messages per line")
    b.add_argument("-o", "--output", required=True, help="JSONL results")
    mode = b.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="skip the ids whose results the output already holds")
    mode.add_argument("--overwrite", action="store_true", help="start the output again")
    b.add_argument("--chat-template-kwargs", default="{}",
                   help='JSON object passed to the chat template for messages, e.g. \'{"enable_thinking": false}\'')
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(b)
    add_sampling_args(b)
    b.set_defaults(func=cmd_batch)

    from jaxoverlap.profiling.cli import add_profile_args, run_profile

    p = sub.add_parser("profile", help="device trace and host timings with and without overlap (plots, JSON)")
    add_profile_args(p)
    add_engine_args(p)
    p.set_defaults(func=lambda a: run_profile(a, engine_options(a)))

    try:
        from jaxoverlap.server import cli_commands
    except ImportError as e:  # the server extras are optional for offline use
        cli_commands = None
        server_error = e
    for name, helptext in (("serve", "run the gRPC server"), ("client", "call a running server"),
                           ("bench", "benchmark a running server")):
        p = sub.add_parser(name, help=helptext)
        if cli_commands is None:
            p.set_defaults(func=lambda a, e=server_error: sys.exit(f"the server is unavailable: {e}"))
            continue
        if name == "serve":
            cli_commands.add_serve_args(p)
            add_engine_args(p)
            p.set_defaults(func=lambda a: cli_commands.run_serve(a, dict(engine_options(a), model=a.model)))
        elif name == "client":
            cli_commands.add_client_args(p)
            p.set_defaults(func=cli_commands.run_client)
        else:
            cli_commands.add_bench_args(p)
            p.set_defaults(func=cli_commands.run_bench)

    args = parser.parse_args(argv)
    if getattr(args, "device_memory_fraction", None) is not None:
        claim_device_memory(args.device_memory_fraction)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
