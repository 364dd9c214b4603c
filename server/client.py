"""Python client for the jaxoverlap gRPC server (sync `GenerationClient`, asyncio `AsyncGenerationClient`).

    from jaxoverlap.server.client import GenerationClient

    with GenerationClient("127.0.0.1:50051", token=None, tls_ca=None) as c:
        for item in c.generate("Hello", max_new_tokens=32, temperature=0):
            print(item)                        # Chunk(...) ... then one Completion(...)
        result = c.generate_text([1, 2, 3], max_new_tokens=8)   # token ids work too
        samples = c.generate_samples("Hello", 4, temperature=0.8, seed=1)  # n samples, by index
        chat = c.generate_text([{"role": "user", "content": "Hi"}], chat_template_kwargs={"enable_thinking": False})
        print(result.text, result.finish_reason, c.model_info(), c.health())

Errors arrive as grpc.RpcError (`.code()`, `.details()`), e.g. INVALID_ARGUMENT for bad input.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import uuid
from typing import AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxoverlap.server import jaxoverlap_pb2 as pb
from jaxoverlap.server import jaxoverlap_pb2_grpc as pb_grpc

SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "logprobs", "prompt_logprobs", "prompt_logprobs_start", "repetition_penalty",
                   "frequency_penalty", "presence_penalty", "min_new_tokens", "top_logprobs", "logit_bias", "n",
                   "structured_output", "include_stop_str_in_output", "skip_special_tokens")


@dataclasses.dataclass
class Chunk:
    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token id, most likely first
    index: int = 0  # the sample (0 .. n-1) these tokens belong to


@dataclasses.dataclass
class Completion:
    request_id: str
    finish_reason: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    accept_length: float
    time_to_first_token: float
    # prompt_logprobs: for prompt tokens 1 .. n-1, the logprob and whether it was the argmax
    prompt_logprobs: list[float] | None = None
    prompt_top1: list[bool] | None = None
    index: int = 0  # the sample (0 .. n-1) that finished


@dataclasses.dataclass
class GenerateResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    accept_length: float
    time_to_first_token: float
    logprobs: list[float] | None = None
    prompt_logprobs: list[float] | None = None  # for prompt tokens 1 .. n-1
    prompt_top1: list[bool] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per output token, most likely first
    index: int = 0  # which sample (0 .. n-1)


Prompt = str | Sequence[int] | Sequence[dict]


def _set_structured_output(msg: pb.StructuredOutput, value: dict) -> None:
    """SamplingParams.structured_output's dict form into the message; the server checks it."""
    if not isinstance(value, dict) or len(value) != 1:
        raise TypeError("structured_output is a dict of one of json_schema, json_object, regex, choice, grammar")
    [(kind, spec)] = value.items()
    kind = "json_schema" if kind == "json" else kind
    if kind == "json_schema":
        msg.json_schema = spec if isinstance(spec, str) else json.dumps(spec)
    elif kind == "choice":
        msg.choice.options.extend(spec)
    elif kind in ("json_object", "regex", "grammar"):
        setattr(msg, kind, spec)
    else:
        raise TypeError(f"unknown structured_output kind {kind!r}")


def build_request(prompt: Prompt, request_id: str | None = None, *, chat_template_kwargs: dict | None = None,
                  add_generation_prompt: bool | None = None, **sampling) -> pb.GenerateRequest:
    """A GenerateRequest for a text prompt, a sequence of token ids, or chat messages (dicts
    with "role" and "content", made into the prompt by the server's chat template, which
    `chat_template_kwargs` and `add_generation_prompt` go to). None sampling values stay unset."""
    unknown = sorted(set(sampling) - set(SAMPLING_FIELDS))
    if unknown:
        raise TypeError(f"unknown sampling options {unknown}; known: {list(SAMPLING_FIELDS)}")
    sp = pb.SamplingParams()
    for name, value in sampling.items():
        if value is None:
            continue
        if name == "stop":
            sp.stop.extend([value] if isinstance(value, str) else list(value))
        elif name == "stop_token_ids":
            sp.stop_token_ids.extend(int(t) for t in value)
        elif name == "logit_bias":  # {token id: bias}; JSON's string keys too
            sp.logit_bias.update({int(t): float(b) for t, b in value.items()})
        elif name == "structured_output":  # {"json_schema": {...} or "...", "regex": ..., "choice": [...], ...}
            _set_structured_output(sp.structured_output, value)
        else:
            setattr(sp, name, value)
    req = pb.GenerateRequest(request_id=request_id or uuid.uuid4().hex, sampling_params=sp)
    is_chat = not isinstance(prompt, str) and len(prompt) > 0 and isinstance(prompt[0], dict)
    if not is_chat and (chat_template_kwargs is not None or add_generation_prompt is not None):
        raise TypeError("chat_template_kwargs and add_generation_prompt are for chat messages only")
    if isinstance(prompt, str):
        req.text = prompt
    elif is_chat:
        for m in prompt:
            req.chat.messages.add(role=m["role"], content=m["content"])
        if add_generation_prompt is not None:
            req.chat.add_generation_prompt = add_generation_prompt
        if chat_template_kwargs:
            req.chat.chat_template_kwargs_json = json.dumps(chat_template_kwargs)
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
    return req


def parse_response(resp: pb.GenerateResponse) -> Chunk | Completion:
    if resp.WhichOneof("response") == "chunk":
        c = resp.chunk
        top = [list(zip(t.token_ids, t.logprobs)) for t in c.top_logprobs]
        return Chunk(list(c.token_ids), c.text, list(c.logprobs) or None, top or None, c.index)
    c = resp.complete
    return Completion(c.request_id, c.finish_reason, list(c.token_ids), c.usage.prompt_tokens,
                      c.usage.completion_tokens, c.usage.cached_tokens, c.accept_length, c.time_to_first_token,
                      list(c.prompt_logprobs) or None, list(c.prompt_top1) or None, c.index)


def _result(chunks: list[Chunk], done: Completion) -> GenerateResult:
    logprobs = [lp for c in chunks for lp in (c.logprobs or ())]
    top = [alts for c in chunks for alts in (c.top_logprobs or ())]
    return GenerateResult(done.request_id, "".join(c.text for c in chunks), done.token_ids, done.finish_reason,
                          done.prompt_tokens, done.completion_tokens, done.cached_tokens, done.accept_length,
                          done.time_to_first_token, logprobs or None, done.prompt_logprobs, done.prompt_top1,
                          top or None, done.index)


def _results(items) -> list[GenerateResult]:
    """A whole stream's items as one GenerateResult per sample, by index."""
    chunks: dict[int, list[Chunk]] = collections.defaultdict(list)
    done: dict[int, Completion] = {}
    for item in items:
        if isinstance(item, Chunk):
            chunks[item.index].append(item)
        else:
            done[item.index] = item
    if not done:  # pragma: no cover - the server always ends a stream with complete or an error
        raise RuntimeError("stream ended without a completion")
    return [_result(chunks[k], done[k]) for k in sorted(done)]


def _one_sample(sampling: dict) -> None:
    if (sampling.get("n") or 1) > 1:
        raise TypeError("generate_text returns one result: use generate_samples for n > 1")


def _model_info(r: pb.GetModelInfoResponse) -> dict:
    return {"model_name": r.model_name, "vocab_size": r.vocab_size, "max_context_len": r.max_context_len,
            "eos_token_ids": list(r.eos_token_ids), "speculative_algorithm": r.speculative_algorithm,
            "has_chat_template": r.has_chat_template}


def _server_info(r: pb.GetServerInfoResponse) -> dict:
    return {"engine_config": json.loads(r.engine_config_json or "{}"), "running_requests": r.running_requests,
            "queued_requests": r.queued_requests, "kv_used_tokens": r.kv_used_tokens,
            "kv_total_tokens": r.kv_total_tokens, "kv_usage": r.kv_usage, "active_streams": r.active_streams,
            "uptime_s": r.uptime_s, "stats": json.loads(r.stats_json or "{}"), "server_version": r.server_version}


def _credentials(tls: bool, tls_ca: str | None):
    if not (tls or tls_ca):
        return None
    root = None
    if tls_ca:
        with open(tls_ca, "rb") as f:
            root = f.read()
    return grpc.ssl_channel_credentials(root_certificates=root)


def _channel_options(tls_server_name: str | None, options) -> list:
    opts = list(options or ())
    if tls_server_name:
        opts.append(("grpc.ssl_target_name_override", tls_server_name))
    return opts


class GenerateStream:
    """Iterate for Chunk items then one Completion; `cancel()` ends the call (the server aborts it)."""

    def __init__(self, call, request_id: str):
        self._call = call
        self.request_id = request_id

    def __iter__(self) -> Iterator[Chunk | Completion]:
        for resp in self._call:
            yield parse_response(resp)

    def cancel(self) -> bool:
        return self._call.cancel()

    # `with client.generate(...) as stream:` ends the call on the way out, read to the end
    # or not (leaving a for loop early keeps it: the stream may be read on).
    def __enter__(self) -> "GenerateStream":
        return self

    def __exit__(self, *exc) -> None:
        self._call.cancel()  # a no-op once the call has ended


class GenerationClient:
    """Synchronous client. target is "host:port"; token adds `authorization: Bearer <token>`;
    tls_ca (a PEM file) or tls=True (system roots) selects TLS; tls_server_name overrides the
    name checked against the certificate; timeout is the default per-call deadline in seconds."""

    def __init__(self, target: str, token: str | None = None, tls_ca: str | None = None, *, tls: bool = False,
                 tls_server_name: str | None = None, timeout: float | None = None, options=()):
        creds = _credentials(tls, tls_ca)
        opts = _channel_options(tls_server_name, options)
        self.channel = (grpc.secure_channel(target, creds, options=opts) if creds
                        else grpc.insecure_channel(target, options=opts))
        self._stub = pb_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout = timeout

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _t(self, timeout):
        return self.timeout if timeout is None else timeout

    def wait_ready(self, timeout: float = 30.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def generate(self, prompt: Prompt, *, request_id: str | None = None, timeout: float | None = None,
                 **sampling) -> GenerateStream:
        req = build_request(prompt, request_id, **sampling)
        call = self._stub.Generate(req, metadata=self._metadata, timeout=self._t(timeout))
        return GenerateStream(call, req.request_id)

    def generate_text(self, prompt: Prompt, *, request_id: str | None = None,
                      timeout: float | None = None, **sampling) -> GenerateResult:
        _one_sample(sampling)
        [result] = _results(self.generate(prompt, request_id=request_id, timeout=timeout, **sampling))
        return result

    def generate_samples(self, prompt: Prompt, n: int, *, request_id: str | None = None,
                         timeout: float | None = None, **sampling) -> list[GenerateResult]:
        """n independent samples of the prompt in one call (SamplingParams.n), by index."""
        return _results(self.generate(prompt, request_id=request_id, timeout=timeout, n=n, **sampling))

    def abort(self, request_id: str, timeout: float | None = None) -> None:
        self._stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self._metadata, timeout=self._t(timeout))

    def model_info(self, timeout: float | None = None) -> dict:
        return _model_info(self._stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self._metadata,
                                                   timeout=self._t(timeout)))

    def server_info(self, timeout: float | None = None) -> dict:
        return _server_info(self._stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=self._metadata,
                                                     timeout=self._t(timeout)))

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """The serving status name: "SERVING", "NOT_SERVING", ... (NOT_FOUND error for unknown services)."""
        r = self._health.Check(health_pb2.HealthCheckRequest(service=service), metadata=self._metadata,
                               timeout=self._t(timeout) or 10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


class AsyncGenerateStream:
    def __init__(self, call, request_id: str):
        self._call = call
        self.request_id = request_id

    async def __aiter__(self) -> AsyncIterator[Chunk | Completion]:
        async for resp in self._call:
            yield parse_response(resp)

    def cancel(self) -> bool:
        return self._call.cancel()

    async def __aenter__(self) -> "AsyncGenerateStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self._call.cancel()  # a no-op once the call has ended

    def __del__(self) -> None:
        # Unlike the sync client's, a grpc.aio call outlives its last reference: a stream
        # dropped unread would keep the request running on the server to its end.
        try:
            if not self._call.done():
                self._call.cancel()
        except Exception:  # noqa: BLE001 - at interpreter exit the loop may be gone
            pass


class AsyncGenerationClient:
    """The asyncio twin of GenerationClient (same arguments); use inside a running loop."""

    def __init__(self, target: str, token: str | None = None, tls_ca: str | None = None, *, tls: bool = False,
                 tls_server_name: str | None = None, timeout: float | None = None, options=()):
        creds = _credentials(tls, tls_ca)
        opts = _channel_options(tls_server_name, options)
        self.channel = (grpc.aio.secure_channel(target, creds, options=opts) if creds
                        else grpc.aio.insecure_channel(target, options=opts))
        self._stub = pb_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout = timeout

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def _t(self, timeout):
        return self.timeout if timeout is None else timeout

    async def wait_ready(self, timeout: float = 30.0) -> None:
        await asyncio.wait_for(self.channel.channel_ready(), timeout)

    def generate(self, prompt: Prompt, *, request_id: str | None = None, timeout: float | None = None,
                 **sampling) -> AsyncGenerateStream:
        req = build_request(prompt, request_id, **sampling)
        call = self._stub.Generate(req, metadata=self._metadata, timeout=self._t(timeout))
        return AsyncGenerateStream(call, req.request_id)

    async def generate_text(self, prompt: Prompt, *, request_id: str | None = None,
                            timeout: float | None = None, **sampling) -> GenerateResult:
        _one_sample(sampling)
        [result] = _results([item async for item in self.generate(prompt, request_id=request_id, timeout=timeout,
                                                                  **sampling)])
        return result

    async def generate_samples(self, prompt: Prompt, n: int, *, request_id: str | None = None,
                               timeout: float | None = None, **sampling) -> list[GenerateResult]:
        """n independent samples of the prompt in one call (SamplingParams.n), by index."""
        return _results([item async for item in self.generate(prompt, request_id=request_id, timeout=timeout, n=n,
                                                              **sampling)])

    async def abort(self, request_id: str, timeout: float | None = None) -> None:
        await self._stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self._metadata,
                               timeout=self._t(timeout))

    async def model_info(self, timeout: float | None = None) -> dict:
        return _model_info(await self._stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self._metadata,
                                                         timeout=self._t(timeout)))

    async def server_info(self, timeout: float | None = None) -> dict:
        return _server_info(await self._stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=self._metadata,
                                                           timeout=self._t(timeout)))

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        r = await self._health.Check(health_pb2.HealthCheckRequest(service=service), metadata=self._metadata,
                                     timeout=self._t(timeout) or 10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
