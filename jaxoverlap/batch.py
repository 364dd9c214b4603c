"""Offline batch generation: a JSONL file of requests in, a JSONL file of results out
(`jaxoverlap batch`), for evaluation runs over whole datasets.

One request per input line, a JSON object:

    {"id": "q17", "prompt": "text"}                              # or "prompt_token_ids": [1, 2, 3]
    {"id": 18, "messages": [{"role": "user", "content": "hi"}],   # under the model's chat template
     "chat_template_kwargs": {"enable_thinking": false},
     "sampling_params": {"temperature": 0.7, "seed": 1, "max_new_tokens": 256},
     "metadata": {"answer": "42"}}                               # copied to the result as is

`id` defaults to the line's number (from 1); `sampling_params` override the defaults given
on the command line field by field (SamplingParams' names). Any other field is an error,
so that a misspelt one is not silently ignored. A request with `"n": 4` among its sampling
params gets four result lines, `"sample_index"` 0 to 3 (pass@k evaluations).

Results are written in the order requests finish, one line each, flushed at once, so an
interrupted run keeps everything it finished; `resume=True` runs only the ids the output
does not hold yet (a line that errored is tried again). A line that cannot be served gets
an error result and the rest run:

    {"id": "q17", "text": "...", "token_ids": [...], "finish_reason": "stop", "prompt_tokens": 12,
     "cached_prompt_tokens": 0, "output_tokens": 40, "time_to_first_token_s": 0.05}
    {"id": 18, "error": "invalid sampling params: temperature must be ..."}
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

from jaxoverlap.errors import InvalidRequestError
from jaxoverlap.sampling_params import SamplingParams

INPUT_FIELDS = ("id", "prompt", "prompt_token_ids", "messages", "chat_template_kwargs", "sampling_params", "metadata")
_PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")
_NO_METADATA = object()


@dataclasses.dataclass
class BatchRequest:
    id: Any  # a string or an integer, as the input gave it
    prompt_ids: list[int]
    params: SamplingParams
    metadata: Any = _NO_METADATA


@dataclasses.dataclass
class BatchSummary:
    lines: int = 0  # requests in the input
    done_before: int = 0  # skipped: the output already held all their results (resume)
    errors: int = 0  # lines that could not be served
    generated: int = 0  # results written (one per sample of requests with n > 1)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


class BatchInputError(InvalidRequestError):
    """One input line that cannot be served; carries the line's id for its error result."""

    def __init__(self, request_id, message: str, metadata=_NO_METADATA):
        super().__init__(message)
        self.request_id = request_id
        self.metadata = metadata


def _decode_line(raw: bytes, line_number: int) -> str:
    try:
        return raw.decode("utf-8-sig" if line_number == 1 else "utf-8")  # (a BOM may open the file)
    except UnicodeDecodeError as e:
        raise BatchInputError(line_number, f"line {line_number} is not UTF-8: {e}") from None


def _id_key(request_id) -> str:
    # 7 and "7" are different ids, as they are different JSON values.
    return json.dumps(request_id)


def parse_request(line: str, line_number: int, defaults: SamplingParams, engine,
                  chat_template_kwargs: dict | None = None) -> BatchRequest:
    """One input line -> a BatchRequest the engine accepts (Engine.check_request), or
    BatchInputError saying what is wrong with it."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise BatchInputError(line_number, f"line {line_number} is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BatchInputError(line_number, f"line {line_number} must be a JSON object, got {type(obj).__name__}")
    try:  # "\ud800" is valid JSON, but no UTF-8 text: neither tokenized nor written back
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BatchInputError(line_number, f"line {line_number} holds a lone surrogate (an unpaired \\ud800-\\udfff "
                                           "escape), which is not text") from None
    request_id = obj.get("id", line_number)
    metadata = obj.get("metadata", _NO_METADATA)

    def bad(message: str) -> BatchInputError:
        return BatchInputError(request_id, message, metadata)

    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        raise BatchInputError(line_number, f"line {line_number}: id must be a string or an integer, got {request_id!r}",
                              metadata)
    unknown = sorted(set(obj) - set(INPUT_FIELDS))
    if unknown:
        raise bad(f"unknown field(s) {', '.join(map(repr, unknown))}; a line takes {', '.join(INPUT_FIELDS)}")
    given = [f for f in _PROMPT_FIELDS if f in obj]
    if len(given) != 1:
        raise bad(f"give exactly one of {', '.join(_PROMPT_FIELDS)}" + (f" (got {', '.join(given)})" if given else ""))
    overrides = obj.get("sampling_params", {})
    if not isinstance(overrides, dict):
        raise bad("sampling_params must be an object")
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(SamplingParams)})
    if unknown:
        raise bad(f"invalid sampling params: unknown field(s) {', '.join(map(repr, unknown))}")
    try:
        params = dataclasses.replace(defaults, **overrides)
    except (TypeError, ValueError, OverflowError) as e:  # bad values: SamplingParams.validate, int("x")
        raise bad(e.args[0] if isinstance(e, InvalidRequestError) else f"invalid sampling params: {e}") from None
    try:
        if "messages" in obj:
            template_kwargs = dict(chat_template_kwargs or {})
            extra = obj.get("chat_template_kwargs", {})
            if not isinstance(extra, dict):
                raise InvalidRequestError("chat_template_kwargs must be an object")
            template_kwargs.update(extra)
            if engine.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: messages need one")
            prompt = engine.tokenizer.encode_chat(obj["messages"], **template_kwargs)
        elif "chat_template_kwargs" in obj:
            raise InvalidRequestError("chat_template_kwargs is for messages only")
        else:
            prompt = obj.get("prompt", obj.get("prompt_token_ids"))
            if "prompt" in obj and not isinstance(prompt, str):
                raise InvalidRequestError("prompt must be a string (token ids go in prompt_token_ids)")
            if "prompt_token_ids" in obj and not isinstance(prompt, list):
                raise InvalidRequestError("prompt_token_ids must be a list of integers")
        prompt_ids = engine.check_request(prompt, params)
    except InvalidRequestError as e:
        raise bad(str(e)) from None
    return BatchRequest(request_id, prompt_ids, params, metadata)


def _read_done(output_path: str) -> tuple[list[str], set[tuple[str, int]]]:
    """The result lines of an earlier run worth keeping (those without an error), and their
    (id, sample index) pairs. A line cut short by an interrupted write is dropped."""
    keep, done = [], set()
    with open(output_path, "rb") as f:  # line by line: a write cut inside a character spoils only its line
        for raw in f:
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(record, dict) and "id" in record and "error" not in record:
                keep.append(json.dumps(record, ensure_ascii=False))
                done.add((_id_key(record["id"]), record.get("sample_index", 0)))
    return keep, done


def _result_record(request: BatchRequest, sample_index: int, result) -> dict:
    m = result.metrics
    record = {"id": request.id}
    if request.params.n > 1:
        record["sample_index"] = sample_index
    record |= {
        "text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
        "prompt_tokens": m.prompt_tokens, "cached_prompt_tokens": m.cached_prompt_tokens,
        "output_tokens": m.output_tokens, "time_to_first_token_s": m.time_to_first_token,
    }
    if result.logprobs is not None:
        record["logprobs"] = result.logprobs
    if result.top_logprobs is not None:  # per output token: [[token id, logprob], ...], most likely first
        record["top_logprobs"] = result.top_logprobs
    if result.prompt_logprobs is not None:
        record["prompt_logprobs"], record["prompt_top1"] = result.prompt_logprobs, result.prompt_top1
    if request.metadata is not _NO_METADATA:
        record["metadata"] = request.metadata
    return record


def _error_record(error: BatchInputError) -> dict:
    record = {"id": error.request_id, "error": str(error)}
    if error.metadata is not _NO_METADATA:
        record["metadata"] = error.metadata
    return record


def run_batch(llm, input_path: str, output_path: str, defaults: SamplingParams | None = None, *,
              resume: bool = False, overwrite: bool = False, progress: bool = True,
              chat_template_kwargs: dict | None = None) -> BatchSummary:
    """Serve every request of `input_path` with `llm` (a jaxoverlap.LLM) and write one
    result line each to `output_path` (the module's docstring has both formats).

    An existing output is kept safe: without `resume` or `overwrite` the call refuses to
    start. With `resume`, the ids whose results it holds are skipped (of a request with n > 1
    samples, the samples it holds), and its error lines and any half-written last line are
    dropped before the rest is appended."""
    defaults = defaults or SamplingParams()
    summary = BatchSummary()
    t0 = time.perf_counter()
    done: set[tuple[str, int]] = set()
    kept: list[str] = []
    if os.path.exists(output_path):
        if resume:
            kept, done = _read_done(output_path)
        elif not overwrite:
            raise FileExistsError(f"{output_path} exists: pass resume=True (--resume) to continue it, "
                                  "or overwrite=True (--overwrite)")

    work: list[tuple[BatchRequest, int, SamplingParams]] = []  # (request, sample index, its params)
    errors: list[BatchInputError] = []
    seen: set[str] = set()
    with open(input_path, "rb") as f:  # decoded line by line: one bad byte spoils only its line
        for line_number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            summary.lines += 1
            try:
                line = _decode_line(raw, line_number)
                request = parse_request(line, line_number, defaults, llm.engine, chat_template_kwargs)
            except BatchInputError as e:
                errors.append(e)
                seen.add(_id_key(e.request_id))  # a later line with this id is a duplicate too
                continue
            key = _id_key(request.id)
            if key in seen:
                errors.append(BatchInputError(request.id, f"line {line_number}: id {request.id!r} is used by an "
                                                           "earlier line", request.metadata))
            else:
                missing = [(request, k, params) for k, params in enumerate(request.params.samples())
                           if (key, k) not in done]
                summary.done_before += not missing
                work.extend(missing)
            seen.add(key)

    # Rewrite what is kept through a temporary file, so an interruption here loses nothing.
    tmp = output_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        for line in kept:
            out.write(line + "\n")
    os.replace(tmp, output_path)
    with open(output_path, "a", encoding="utf-8") as out:

        def write(record: dict) -> None:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()

        for error in errors:
            write(_error_record(error))
        summary.errors = len(errors)
        results = llm.generate_unordered([r.prompt_ids for r, _, _ in work], [params for _, _, params in work],
                                         use_tqdm=progress)
        for index, result in results:
            request, sample_index, _ = work[index]
            if result.error is not None:  # ended by the engine (a grammar refused after queueing): --resume retries it
                record = _error_record(BatchInputError(request.id, result.error, request.metadata))
                if request.params.n > 1:
                    record["sample_index"] = sample_index
                write(record)
                summary.errors += 1
                continue
            write(_result_record(request, sample_index, result))
            summary.generated += 1
            summary.prompt_tokens += result.metrics.prompt_tokens
            summary.cached_prompt_tokens += result.metrics.cached_prompt_tokens
            summary.output_tokens += result.metrics.output_tokens
    summary.wall_s = time.perf_counter() - t0
    return summary


def print_summary(summary: BatchSummary, file=None) -> None:
    print(f"{summary.lines} requests: {summary.generated} generated, {summary.errors} errors, "
          f"{summary.done_before} done before; {summary.prompt_tokens} prompt tokens "
          f"({summary.cached_prompt_tokens} from the prefix cache), {summary.output_tokens} output tokens "
          f"in {summary.wall_s:.1f} s ({summary.output_tokens_per_s:.1f} output tok/s)", file=file or sys.stderr)
