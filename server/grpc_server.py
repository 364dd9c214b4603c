"""The gRPC server: jaxoverlap.v1.Generation on grpc.aio, plus health, reflection and metrics.

One asyncio loop serves every call; the engine runs on the EngineWorker's thread. A Generate call
registers an output queue with the worker, then relays RequestOutputs as `chunk`s and ends with
one `complete` per sample (SamplingParams.n; one engine request each). Outputs that pile up
while the client is slow are merged into chunks of up to MAX_CHUNK_TOKENS tokens, so a slow
reader costs fewer messages, not more; a client that leaves more than MAX_UNREAD unread (it
stopped reading) has its call ended with RESOURCE_EXHAUSTED. When the call ends early for any
reason (client cancel, disconnect, deadline, server shutdown, that limit) its requests are
aborted in the engine.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import math
import time
import uuid

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxoverlap.errors import InvalidRequestError, PromptTooLongError, QueueFullError
from jaxoverlap.outputs import OutputText
from jaxoverlap.sampling_params import SamplingParams
from jaxoverlap.server import jaxoverlap_pb2 as pb
from jaxoverlap.server.engine_worker import DuplicateRequestError, EngineWorker, WorkerUnavailableError

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "jaxoverlap.v1.Generation"
REQUEST_ID_METADATA = "jaxoverlap-request-id"
SERVER_VERSION = "0.1.0"
MAX_REQUEST_ID_LEN = 256
# Text prompts are tokenized by the handler, never on the engine's thread, where a burst of
# long prompts would hold back the next step's launch (1.0 ms for a 1900-token text on a
# 2-core CPU, benchmarks/host_text_bench.py). Longer texts go to a worker thread,
# through the tokenizer's batch call, which releases the GIL, so neither the event loop nor
# the engine thread waits for them.
INLINE_TOKENIZE_MAX_CHARS = 2048
# A call that reuses the id of one that just ended early (a retry after a deadline or a
# cancel) waits up to this long for the engine to release the old requests: their aborts
# take effect at the engine's next step.
RETIRE_WAIT_S = 30.0
# Engine request ids of a call's samples (n > 1): `{request_id}#{k}`; refused in client ids.
SAMPLE_SEPARATOR = "#"
# A call that ends this close to its deadline (as the server counts it) is counted as past
# its deadline: the client's timer starts before the server's, so the client's cancel
# arrives while the server's copy of the deadline still has this much left.
DEADLINE_SLACK_S = 0.25
# A status message's length at most (_details): gRPC refuses metadata past 16 KiB.
MAX_DETAILS_CHARS = 2048
# Tokens of one chunk at most: a slow reader's outputs are merged, and a merged chunk must
# stay far below gRPC's 4 MiB message limit (about 200 bytes a token with 20 top logprobs).
MAX_CHUNK_TOKENS = 1024
# What a call may leave unread, in tokens plus their top-logprob entries, before the server
# ends it (RESOURCE_EXHAUSTED) and aborts its requests: a client that stops reading would
# otherwise have the server keep everything the engine makes for it (up to n x
# max_new_tokens outputs, a few KiB a token with top logprobs).
MAX_UNREAD = 1 << 17

_INPUT_FIELDS = frozenset(f.number for f in pb.GenerateRequest.DESCRIPTOR.oneofs_by_name["input"].fields)
_SAMPLING_SCALARS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "ignore_eos", "logprobs",
                     "prompt_logprobs", "prompt_logprobs_start", "repetition_penalty", "frequency_penalty",
                     "presence_penalty", "min_new_tokens", "top_logprobs", "n", "include_stop_str_in_output",
                     "skip_special_tokens")


# ---- request decoding ---------------------------------------------------------------------------


class _GenerateCall:
    """A parsed GenerateRequest plus how many oneof `input` fields were on the wire.

    Protobuf parsing keeps only the last member of a oneof, so "both text and token_ids" would
    silently become "token_ids". We count the members in the raw bytes to reject it instead.
    """

    __slots__ = ("message", "input_fields", "error")

    def __init__(self, message, input_fields: int, error: str | None = None):
        self.message = message  # None when the bytes are no GenerateRequest (`error` says why)
        self.input_fields = input_fields
        self.error = error


def _top_level_field_numbers(raw: bytes) -> set[int]:
    """Field numbers present at the top level of a serialized message (wire-format walk).
    Groups (wire types 3 and 4, which proto3 never writes) are stepped over with what they
    hold, so that fields after one still count."""
    seen = set()
    i, n = 0, len(raw)
    depth = 0  # groups open around the current field

    def varint(i):
        shift = value = 0
        while True:
            if i >= n:
                raise ValueError("truncated varint")
            b = raw[i]
            i += 1
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value, i
            shift += 7

    while i < n:
        key, i = varint(i)
        field, wire = key >> 3, key & 7
        if depth == 0 and wire != 4:
            seen.add(field)
        if wire == 0:
            _, i = varint(i)
        elif wire == 1:
            i += 8
        elif wire == 2:
            length, i = varint(i)
            i += length
        elif wire == 5:
            i += 4
        elif wire == 3:
            depth += 1
        elif wire == 4:
            depth -= 1
            if depth < 0:
                raise ValueError("end of a group that was not opened")
        else:
            raise ValueError(f"wire type {wire}")
    if depth:
        raise ValueError("unterminated group")
    return seen


def _decode_generate(raw: bytes) -> _GenerateCall:
    try:
        message = pb.GenerateRequest.FromString(raw)
    except DecodeError as e:  # answered INVALID_ARGUMENT by Generate (a raise here is UNKNOWN)
        return _GenerateCall(None, 0, f"malformed GenerateRequest: {e}")
    try:
        count = len(_top_level_field_numbers(raw) & _INPUT_FIELDS)
    except ValueError:
        count = 1 if message.WhichOneof("input") else 0
    return _GenerateCall(message, count)


def _decode_abort(raw: bytes) -> pb.AbortRequest | None:
    try:
        return pb.AbortRequest.FromString(raw)
    except DecodeError:
        return None  # Abort answers INVALID_ARGUMENT


def sampling_params_from_proto(sp: pb.SamplingParams) -> SamplingParams:
    """Unset fields keep SamplingParams' defaults; raises InvalidRequestError for bad values."""
    kw = {name: getattr(sp, name) for name in _SAMPLING_SCALARS if sp.HasField(name)}
    if sp.stop:
        kw["stop"] = tuple(sp.stop)
    if sp.stop_token_ids:
        kw["stop_token_ids"] = tuple(sp.stop_token_ids)
    if sp.logit_bias:
        kw["logit_bias"] = dict(sp.logit_bias)
    if sp.HasField("structured_output"):
        so = sp.structured_output
        kind = so.WhichOneof("kind")
        if kind is None:
            raise InvalidRequestError("invalid sampling params: structured_output sets none of its kinds")
        kw["structured_output"] = {kind: list(so.choice.options) if kind == "choice" else getattr(so, kind)}
    return SamplingParams(**kw)


def _details(message: str) -> str:
    """A status message short enough for gRPC's metadata (16 KiB at most, or the client gets
    a transport error in place of the status): llguidance's errors quote the grammar."""
    if len(message) <= MAX_DETAILS_CHARS:
        return message
    return f"{message[:MAX_DETAILS_CHARS]}... ({len(message) - MAX_DETAILS_CHARS} more characters cut)"


class _Rejected(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# ---- auth ---------------------------------------------------------------------------------------


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` metadata on every method except the open ones.

    Health stays open by default so that load balancers and orchestrators can probe without the
    secret.
    """

    def __init__(self, token: str, open_prefixes: tuple[str, ...] = (f"/{grpc_health.SERVICE_NAME}/",)):
        if not token:
            raise ValueError("empty auth token")
        self._expected = f"Bearer {token}".encode()
        self._open = open_prefixes

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(self._open) or self._authorized(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return None if handler is None else _deny_handler(handler)

    def _authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else bytes(value)
                # Constant time, so the token cannot be guessed byte by byte from timings.
                return hmac.compare_digest(got, self._expected)
        return False


def _deny_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def deny(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token "
                            "(send metadata 'authorization: Bearer <token>')")

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    return grpc.stream_stream_rpc_method_handler(deny, **kw)


# ---- the service --------------------------------------------------------------------------------


def _engine_tokenizer(engine):
    """The engine's tokenizer, for the handlers' own tokenizer work (a module-level function,
    so that an EngineProcess can send it to the engine's process; its answer is pickled back)."""
    return getattr(engine, "tokenizer", None)


def _read_model_info(engine) -> dict:
    """Static facts about the engine (run once on the engine thread)."""
    tok = engine.tokenizer
    mc = engine.model_config
    # engine.eos_token_ids merges the model's and the tokenizer's; older engines may lack it.
    eos = (getattr(engine, "eos_token_ids", None) or getattr(mc, "eos_token_ids", None)
           or getattr(tok, "eos_token_ids", ()) or ())
    cfg = engine.config
    try:
        cfg_dict = dataclasses.asdict(cfg)
    except TypeError:
        cfg_dict = dict(vars(cfg))
    return {
        "model_name": str(getattr(engine, "model_name", "") or ""),
        "vocab_size": int(getattr(mc, "vocab_size", 0) or getattr(tok, "vocab_size", 0)),
        "max_context_len": int(engine.max_context_len),
        "eos_token_ids": sorted(int(t) for t in eos),
        "speculative_algorithm": _speculative_algorithm(engine),
        "max_running_requests": int(getattr(cfg, "max_running_requests", 0) or 0),
        "engine_config_json": json.dumps(cfg_dict, default=str, sort_keys=True),
        "has_chat_template": getattr(tok, "chat_template", None) is not None,
    }


def _speculative_algorithm(engine) -> str:
    # The engine API has no fixed name for this yet; accept the likely spellings.
    for owner in (engine, getattr(engine, "config", None)):
        for name in ("speculative_algorithm", "spec_algorithm", "drafter", "draft_model"):
            value = getattr(owner, name, None)
            if value:
                return str(value)
    return ""


class _OutputQueue:
    """Per-call mailbox filled by the worker (on this loop) and drained by the handler.

    It also knows which of its engine requests may still send outputs (`live`): a call that
    ends early (cancel, deadline) only queues its aborts, and its id stays taken in the
    engine until their final outputs arrive (`released`)."""

    __slots__ = ("_items", "_event", "engine_ids", "live", "released", "on_released", "added", "abort_requested",
                 "unread", "overflowed", "on_overflow")

    def __init__(self, engine_ids: list[str]):
        self._items: list = []
        self._event = asyncio.Event()
        self.engine_ids = engine_ids  # the engine's request ids of the call's samples
        self.live = set(engine_ids)
        self.released = asyncio.Event()
        self.on_released = None  # called once, when `released` is set
        self.added = False  # every sample's add was accepted by the engine
        self.abort_requested = False  # Abort came before that: abort them once they are
        self.unread = 0  # tokens and top-logprob entries put and not yet taken (MAX_UNREAD)
        self.overflowed = False  # past MAX_UNREAD: outputs are dropped, the call ends
        self.on_overflow = None  # called once, when `overflowed` is set (aborts the requests)

    def put(self, item) -> None:
        if isinstance(item, BaseException):  # the worker failed: it dropped every request
            self.live.clear()
        elif item.finished:
            self.live.discard(item.request_id)
        if not self.overflowed:
            self._items.append(item)
            self._event.set()
            if not isinstance(item, BaseException):
                self.unread += len(item.new_token_ids) + sum(map(len, item.new_top_logprobs or ()))
                if self.unread > MAX_UNREAD:
                    # The client has not read for a long while (its transport buffer is full):
                    # what waits for it goes, and so does the rest of the call.
                    self.overflowed, self._items = True, []
                    if self.on_overflow is not None:
                        self.on_overflow()
        self._check_released()

    def forget(self, engine_id: str) -> None:
        """This sample never reached the engine (its add failed or was never sent)."""
        self.live.discard(engine_id)
        self._check_released()

    def _check_released(self) -> None:
        if not self.live and not self.released.is_set():
            self.released.set()
            if self.on_released is not None:
                self.on_released()

    async def get_all(self) -> list:
        """What was put since the last call (waits for something); [] once overflowed."""
        while not self._items and not self.overflowed:
            self._event.clear()
            await self._event.wait()
        items, self._items, self.unread = self._items, [], 0
        return items


@dataclasses.dataclass
class _ChunkParts:
    """What one sample's outputs add to the next chunk."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    texts: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list = dataclasses.field(default_factory=list)  # pb.TopLogprobs


def _merge(outputs, sample_of: dict[str, int], text_makers) -> tuple[list, list]:
    """One call's outputs taken together (those that piled up while the client read) as
    ([(sample, _ChunkParts)], [(sample, final RequestOutput)]): each sample's outputs merged
    in order into chunks of MAX_CHUNK_TOKENS tokens or a little more (a chunk ends with the
    output that fills it). `text_makers`: the samples' OutputText, where the handler makes
    the text, else None."""
    parts: dict[int, _ChunkParts] = {}  # each sample's newest chunk
    chunks, finals = [], []
    for out in outputs:
        k = sample_of[out.request_id]
        part = parts.get(k)
        if part is None or len(part.tokens) >= MAX_CHUNK_TOKENS:
            part = parts[k] = _ChunkParts()
            chunks.append((k, part))
        part.tokens.extend(out.new_token_ids)
        text = out.new_text if text_makers is None else text_makers[k].delta(out)
        if text:
            part.texts.append(text)
        if out.new_logprobs:
            part.logprobs.extend(out.new_logprobs)
        if out.new_top_logprobs:
            part.top.extend(pb.TopLogprobs(token_ids=[t for t, _ in alts], logprobs=[lp for _, lp in alts])
                            for alts in out.new_top_logprobs)
        if out.finished:
            finals.append((k, out))
    return chunks, finals


def _tokenize_long(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """For a worker thread: the batch call, which releases the GIL (the single encode does not)."""
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]


def _chat_chars(chat: pb.Chat) -> int:
    """What a chat input's rendering reads, in characters."""
    return sum(len(m.content) + len(m.role) for m in chat.messages) + len(chat.chat_template_kwargs_json)


def _chat_text(tokenizer, chat: pb.Chat) -> str:
    """The prompt text of a `chat` input under the model's template (GenerationServicer._prepare
    checked that there is one and that the chat has messages); InvalidRequestError for a
    conversation it refuses or bad template variables."""
    template_kwargs = {}
    if chat.chat_template_kwargs_json:
        try:
            template_kwargs = json.loads(chat.chat_template_kwargs_json)
        except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested deeper than json reads
            raise InvalidRequestError(f"chat_template_kwargs_json is not JSON: {type(e).__name__}: {e}") from None
        if not isinstance(template_kwargs, dict):
            raise InvalidRequestError("chat_template_kwargs_json must be a JSON object")
        reserved = sorted({"messages", "add_generation_prompt"} & template_kwargs.keys())
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs_json may not set {', '.join(reserved)}: "
                                      f"they come from the chat's own fields")
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else None  # on, but see render
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add, **template_kwargs)


class GenerationServicer:
    def __init__(self, worker: EngineWorker, model_info: dict, metrics=None, max_queued_requests: int | None = None,
                 tokenizer=None):
        self.worker = worker
        self.tokenizer = tokenizer  # the engine's (read-only, so usable from this thread)
        self.info = model_info
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.accepting = True
        self.streams: dict[str, _OutputQueue] = {}
        # Calls that ended before their engine requests did, by request id, until those are
        # released: a retry with the same id waits for them instead of meeting ALREADY_EXISTS.
        self.retiring: dict[str, _OutputQueue] = {}
        # The engine requests of the live calls and of those still retiring (a call with n
        # samples has n): a call's count goes when the engine has released its requests, so a
        # client that starts and cancels calls fast cannot queue more than the limit.
        self.engine_requests = 0
        self.started = time.monotonic()
        self.drained = asyncio.Event()
        self.drained.set()

    # -- Generate

    def _prepare(self, call: _GenerateCall):
        req = call.message
        if req is None:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, call.error)
        if not self.accepting:
            raise _Rejected(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        if call.input_fields > 1:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "set exactly one of text, token_ids and chat")
        kind = req.WhichOneof("input")
        if kind is None:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "no input: set text, token_ids or chat")
        if kind == "chat":
            if self.tokenizer is None:
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "this model has no tokenizer: send token_ids")
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "this model has no chat template: send text or token_ids")
            if not req.chat.messages:
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "empty input: chat has no messages")
            prompt = req.chat  # rendered by Generate (a long one on a worker thread), then tokenized
        elif kind == "text":
            if not req.text:
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "empty input: text is empty")
            if self.tokenizer is None:
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "this model has no tokenizer: send token_ids")
            prompt = req.text  # tokenized by Generate, once the request id is registered
        else:
            prompt = list(req.token_ids.ids)
            if not prompt:
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "empty input: token_ids is empty")
        try:
            params = sampling_params_from_proto(req.sampling_params)
        except InvalidRequestError as e:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except (TypeError, ValueError, RecursionError) as e:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"invalid sampling params: {e}") from None
        rid = req.request_id or uuid.uuid4().hex
        if len(rid) > MAX_REQUEST_ID_LEN:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request_id is {len(rid)} characters long; at most {MAX_REQUEST_ID_LEN} are allowed")
        if not (rid.isascii() and rid.isprintable()):
            # It goes back to the client as a metadata value, which gRPC allows in printable ASCII only.
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request_id {rid!r} must be printable ASCII (it is sent back as gRPC metadata)")
        if SAMPLE_SEPARATOR in rid:
            # The engine knows the samples of a call with n > 1 as `id#k`: a client's "x#0"
            # would meet another call's sample 0 of "x".
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request_id {rid!r} must not contain {SAMPLE_SEPARATOR!r} (the server names the "
                            f"samples of a call id{SAMPLE_SEPARATOR}k)")
        if rid in self.streams:
            raise _Rejected(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already running")
        if self.max_queued_requests is not None:
            # Admission control on the server side, with no round trip to the engine: at most
            # max_running_requests run and max_queued_requests wait behind them.
            limit = self.info["max_running_requests"] + self.max_queued_requests
            if params.n > limit:  # never admitted, however long the client waits: not a retry's matter
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                                f"n={params.n} samples: the server admits {limit} requests at once "
                                f"(max_running_requests + max_queued_requests={self.max_queued_requests})")
            if self.engine_requests + params.n > limit:
                raise _Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many queued requests: {self.engine_requests} in flight, the server admits "
                                f"{limit} (max_running_requests + max_queued_requests={self.max_queued_requests})"
                                + (f"; this call's n={params.n} samples count one each" if params.n > 1 else ""))
        # The chat template writes any BOS itself, so a chat prompt's text is encoded without
        # the tokenizer's special tokens (as transformers' apply_chat_template does).
        return rid, prompt, params, kind != "chat"

    async def Generate(self, call: _GenerateCall, context):
        t0 = time.perf_counter()
        try:
            rid, prompt, params, add_special_tokens = self._prepare(call)
        except _Rejected as r:
            await self._reject(context, r.code, r.message)
            return
        # SamplingParams.n > 1: one engine request per sample, `rid#k`, sharing the prompt's
        # prefill through the prefix cache; their outputs meet in this call's one mailbox.
        samples = params.samples()
        engine_ids = [rid] if len(samples) == 1 else [f"{rid}{SAMPLE_SEPARATOR}{k}" for k in range(len(samples))]
        mailbox = _OutputQueue(engine_ids)
        mailbox.on_overflow = lambda: [self.worker.abort_nowait(eid) for eid in engine_ids]
        self.streams[rid] = mailbox
        self.engine_requests += len(engine_ids)
        self.drained.clear()
        add_futures = []
        unfinished = set(range(len(samples)))  # samples the engine may still be running
        try:
            await context.send_initial_metadata(((REQUEST_ID_METADATA, rid),))
            if isinstance(prompt, pb.Chat):
                # The template runs on this loop for a short conversation (microseconds), and on
                # a worker thread for a long one, which would hold every other call's stream.
                try:
                    if _chat_chars(prompt) > INLINE_TOKENIZE_MAX_CHARS:
                        prompt = await asyncio.to_thread(_chat_text, self.tokenizer, prompt)
                    else:
                        prompt = _chat_text(self.tokenizer, prompt)
                except InvalidRequestError as e:
                    await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
                    return
            if isinstance(prompt, str):
                try:
                    if len(prompt) > INLINE_TOKENIZE_MAX_CHARS:
                        prompt = await asyncio.to_thread(_tokenize_long, self.tokenizer, prompt, add_special_tokens)
                    else:
                        prompt = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
                except Exception as e:  # noqa: BLE001 - a tokenizer bug; still answer with a status
                    logger.exception("tokenizing %s failed", rid)
                    await self._reject(context, grpc.StatusCode.INTERNAL, f"tokenizer failed: {e!r}")
                    return
            earlier = self.retiring.get(rid)
            if earlier is not None:
                try:  # bounded: past it, the engine's own duplicate check answers ALREADY_EXISTS
                    await asyncio.wait_for(earlier.released.wait(), RETIRE_WAIT_S)
                except asyncio.TimeoutError:
                    pass
            text_makers = None
            if (self.tokenizer is not None and not params.stop and params.structured_output is None
                    and not params.include_stop_str_in_output):
                # No stop strings, so the engine needs no text: this handler makes it from the
                # token ids, on the event loop, while the engine's thread waits for the device.
                # (A "stop" finish then ends on a stop token, whose text OutputText leaves out;
                # a grammar's last token is output, so those requests keep the engine's text, as
                # do those that ask for the stop token's text.)
                samples = [dataclasses.replace(sp, detokenize=False) for sp in samples]
                text_makers = [OutputText(self.tokenizer, prompt, skip_special_tokens=params.skip_special_tokens)
                               for _ in samples]
            loop = asyncio.get_running_loop()
            add_futures = [self.worker.submit_add(eid, prompt, sp, loop, mailbox.put)
                           for eid, sp in zip(engine_ids, samples)]
            for add_future in add_futures:
                try:
                    await asyncio.shield(asyncio.wrap_future(add_future))
                except DuplicateRequestError as e:
                    await self._reject(context, grpc.StatusCode.ALREADY_EXISTS, str(e))
                    return
                except (PromptTooLongError, QueueFullError) as e:
                    await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
                    return
                except InvalidRequestError as e:
                    await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
                    return
                except WorkerUnavailableError as e:
                    await self._reject(context, grpc.StatusCode.UNAVAILABLE, str(e))
                    return
                except Exception as e:  # noqa: BLE001 - an engine bug; still answer with a status
                    logger.exception("add_request(%s) failed", rid)
                    await self._reject(context, grpc.StatusCode.INTERNAL, f"engine failed to add the request: {e!r}")
                    return
            mailbox.added = True
            if mailbox.abort_requested:
                for eid in engine_ids:
                    self.worker.abort_nowait(eid)
            sample_of = {eid: k for k, eid in enumerate(engine_ids)}
            while True:
                items = await mailbox.get_all()
                if mailbox.overflowed:
                    await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       f"the client left more than {MAX_UNREAD} tokens and top logprobs unread: "
                                       f"the call's requests were aborted")
                    return
                for out in items:
                    if isinstance(out, BaseException):
                        unfinished.clear()  # the worker already dropped the requests
                        await self._reject(context, grpc.StatusCode.UNAVAILABLE, f"engine failed: {out}")
                        return
                    if out.error is not None:
                        # The engine refused the request after accepting it (its grammar did not
                        # compile; Engine.add_request does not wait for the compile).
                        unfinished.discard(sample_of[out.request_id])
                        await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, out.error)
                        return
                chunks, finals = _merge(items, sample_of, text_makers)
                for k, part in chunks:
                    if part.tokens or part.texts:
                        if self.metrics is not None:
                            self.metrics.generated_tokens.inc(len(part.tokens))
                        yield pb.GenerateResponse(chunk=pb.Chunk(
                            token_ids=part.tokens, text="".join(part.texts), logprobs=part.logprobs,
                            top_logprobs=part.top, index=k))
                for k, final in finals:
                    unfinished.discard(k)
                    self._record_finish(final, time.perf_counter() - t0)
                    yield pb.GenerateResponse(complete=self._complete(rid, final, k))
                if not unfinished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            # The client cancelled or went away, or the deadline passed: no status of ours
            # ends the call, so count it here (a rejected call is counted by _reject).
            if self.metrics is not None:
                remaining = context.time_remaining()
                code = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED"
                self.metrics.errors.labels(code).inc()
            raise
        finally:
            if self.streams.get(rid) is mailbox:
                del self.streams[rid]
            if not self.streams:
                self.drained.set()
            loop = asyncio.get_running_loop()
            for k in unfinished:
                if k < len(add_futures):
                    # The call ended before this sample did (cancel, disconnect, deadline,
                    # shutdown, another sample refused): free its slots. If the add is still
                    # in flight, abort once it is accepted.
                    add_futures[k].add_done_callback(
                        lambda f, eid=engine_ids[k]: _abort_if_added(self.worker, eid, f, loop, mailbox))
                else:
                    mailbox.forget(engine_ids[k])
            if mailbox.released.is_set():
                self.engine_requests -= len(engine_ids)
            else:
                self.retiring[rid] = mailbox
                mailbox.on_released = functools.partial(self._retired, rid, mailbox)

    def _retired(self, rid: str, mailbox: _OutputQueue) -> None:
        self.engine_requests -= len(mailbox.engine_ids)
        if self.retiring.get(rid) is mailbox:
            del self.retiring[rid]

    @staticmethod
    def _complete(rid: str, final, index: int = 0) -> pb.Complete:
        m = final.metrics
        ttft = m.time_to_first_token
        return pb.Complete(
            finish_reason=final.finish_reason or "",
            token_ids=final.token_ids,
            usage=pb.Usage(prompt_tokens=m.prompt_tokens, completion_tokens=len(final.token_ids),
                           cached_tokens=m.cached_prompt_tokens),
            accept_length=float(m.accept_length),
            time_to_first_token=float(ttft) if ttft is not None else 0.0,
            request_id=rid,
            # Positions not scored (before prompt_logprobs_start) go as NaN / false.
            prompt_logprobs=[math.nan if lp is None else lp for lp in (final.prompt_logprobs or [None])[1:]],
            prompt_top1=[bool(t) for t in (final.prompt_top1 or [None])[1:]],
            index=index,
        )

    def _record_finish(self, final, latency: float) -> None:
        mt = self.metrics
        if mt is None:
            return
        m = final.metrics
        mt.requests.labels(final.finish_reason or "unknown").inc()
        mt.prompt_tokens.inc(m.prompt_tokens)
        mt.cached_tokens.inc(m.cached_prompt_tokens)
        mt.e2e.observe(latency)
        if m.time_to_first_token is not None:
            mt.ttft.observe(m.time_to_first_token)
        if m.num_steps:
            mt.accept_length.observe(m.accept_length)

    async def _reject(self, context, code: grpc.StatusCode, message: str):
        if self.metrics is not None:
            self.metrics.errors.labels(code.name).inc()
        await context.abort(code, _details(message))

    # -- the unary calls

    async def Abort(self, request: pb.AbortRequest | None, context):
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed AbortRequest")
        rid = request.request_id
        stream = self.streams.get(rid)
        if stream is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no running request with id {rid!r}")
        if not stream.added:
            # Its adds are still on their way (a long text being tokenized, the engine inside a
            # step): Generate aborts the samples as soon as the engine has accepted them.
            stream.abort_requested = True
            return pb.AbortResponse()
        try:
            # Every sample's, at once; shielded, so that an Abort call cancelled or past its
            # deadline (while the engine is inside a long step) still aborts them all.
            ok = any(await asyncio.shield(asyncio.gather(*(self.worker.abort(eid) for eid in stream.engine_ids))))
        except WorkerUnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if not ok:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request {rid!r} already finished")
        return pb.AbortResponse()

    async def GetModelInfo(self, request, context):
        i = self.info
        return pb.GetModelInfoResponse(model_name=i["model_name"], vocab_size=i["vocab_size"],
                                       max_context_len=i["max_context_len"], eos_token_ids=i["eos_token_ids"],
                                       speculative_algorithm=i["speculative_algorithm"],
                                       has_chat_template=i.get("has_chat_template", False))

    async def GetServerInfo(self, request, context):
        try:
            stats = await asyncio.wait_for(self.worker.stats(), timeout=10)
        except (WorkerUnavailableError, asyncio.TimeoutError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine did not answer: {e!r}")
        used = int(stats.get("kv_used_tokens", 0))
        total = int(stats.get("kv_total_tokens", 0))
        return pb.GetServerInfoResponse(
            engine_config_json=self.info["engine_config_json"],
            running_requests=int(stats.get("num_running", 0)),
            queued_requests=int(stats.get("num_waiting", 0)),
            kv_used_tokens=used,
            kv_total_tokens=total,
            kv_usage=used / total if total else 0.0,
            active_streams=len(self.streams),
            uptime_s=time.monotonic() - self.started,
            stats_json=json.dumps(stats, default=str, sort_keys=True),
            server_version=SERVER_VERSION,
        )


def _abort_if_added(worker: EngineWorker, rid: str, fut, loop, mailbox: _OutputQueue) -> None:
    """An add's done-callback (on the worker's thread, or this loop's if it was done): abort the
    request if the engine took it, else tell its mailbox that it never will send outputs."""
    if not fut.cancelled() and fut.exception() is None:
        worker.abort_nowait(rid)
        return
    try:
        loop.call_soon_threadsafe(mailbox.forget, rid)
    except RuntimeError:  # the loop has closed: nobody waits for the mailbox any more
        pass


def _handlers(servicer: GenerationServicer) -> dict:
    return {
        # A custom deserializer for Generate (see _GenerateCall); the rest use the generated types.
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_decode_generate,
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=_decode_abort,
            response_serializer=pb.AbortResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, request_deserializer=pb.GetModelInfoRequest.FromString,
            response_serializer=pb.GetModelInfoResponse.SerializeToString),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetServerInfo, request_deserializer=pb.GetServerInfoRequest.FromString,
            response_serializer=pb.GetServerInfoResponse.SerializeToString),
    }


# ---- lifecycle ----------------------------------------------------------------------------------


class GenerationServer:
    """A started EngineWorker served over gRPC. Create and use it on one asyncio loop.

    host/port: where to listen (port 0 picks a free one; see `.port`). tls_cert/tls_key: PEM file
    paths to serve TLS. auth_token: require `authorization: Bearer <token>` (health stays open).
    metrics_port: Prometheus endpoint port (None or 0: off; -1: any free port, see
    `.metrics_port`). max_queued_requests: reject Generate with RESOURCE_EXHAUSTED once more than
    max_running_requests + this many calls are in flight (None: only the engine's own limit).
    owns_worker: stop the worker in stop(). stall_timeout: report health NOT_SERVING while calls
    wait on an engine that has finished no step for this many seconds (None or 0: never).
    """

    def __init__(self, worker: EngineWorker, *, host: str = "127.0.0.1", port: int = 0,
                 tls_cert: str | None = None, tls_key: str | None = None, auth_token: str | None = None,
                 metrics_port: int | None = None, metrics_host: str | None = None,
                 max_queued_requests: int | None = None, owns_worker: bool = False, grpc_options=(),
                 stall_timeout: float | None = 300.0):
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both a certificate and a key file")
        if max_queued_requests is not None and max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        self.worker = worker
        self.host = host
        self.requested_port = port
        self.tls_cert, self.tls_key = tls_cert, tls_key
        self.auth_token = auth_token
        self.requested_metrics_port = metrics_port
        self.metrics_host = metrics_host or host
        self.max_queued_requests = max_queued_requests
        self.owns_worker = owns_worker
        self.stall_timeout = stall_timeout
        self.stalled = False
        self.grpc_options = tuple(grpc_options)
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.metrics = None
        self.servicer: GenerationServicer | None = None
        self.health: grpc_health.aio.HealthServicer | None = None
        self._server: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()
        self._force = asyncio.Event()
        self._stopping = False
        self._watchdog: asyncio.Future | None = None

    @property
    def active_streams(self) -> int:
        return len(self.servicer.streams) if self.servicer else 0

    async def start(self) -> "GenerationServer":
        from jaxoverlap.server.metrics import ServerMetrics

        info = await self.worker.call(_read_model_info)
        tokenizer = await self.worker.call(_engine_tokenizer)
        if self.requested_metrics_port:
            self.metrics = ServerMetrics(self.worker, self)
        self.servicer = GenerationServicer(self.worker, info, self.metrics, self.max_queued_requests, tokenizer)
        interceptors = [BearerTokenInterceptor(self.auth_token)] if self.auth_token else []
        options = [
            # gRPC turns SO_REUSEPORT on by default: a second server on a busy port would start
            # "fine" and steal half the connections. Fail loudly instead.
            ("grpc.so_reuseport", 0),
            *self.grpc_options,
        ]
        server = grpc.aio.server(interceptors=interceptors, options=options)
        handlers = _handlers(self.servicer)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        if hasattr(server, "add_registered_method_handlers"):
            server.add_registered_method_handlers(SERVICE_NAME, handlers)
        self.health = grpc_health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, grpc_health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        host = self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # a bare IPv6 address
        address = f"{host}:{self.requested_port}"
        if self.tls_cert:
            with open(self.tls_cert, "rb") as f:
                cert = f.read()
            with open(self.tls_key, "rb") as f:
                key = f.read()
            port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            port = server.add_insecure_port(address)
        if not port:
            raise RuntimeError(f"could not bind {address}")
        self.port = port
        await server.start()
        if self.metrics is not None:
            mport = 0 if self.requested_metrics_port < 0 else self.requested_metrics_port
            try:
                self.metrics_port = self.metrics.serve(mport, self.metrics_host.strip("[]"))
            except BaseException:
                # (A metrics port taken.) The gRPC server must not stay up, answering SERVING,
                # behind a start that failed.
                await server.stop(0)
                raise
        self._server = server
        serving = health_pb2.HealthCheckResponse.SERVING
        await self.health.set("", serving)
        await self.health.set(SERVICE_NAME, serving)
        self._watchdog = asyncio.ensure_future(self._watch_engine())
        logger.info("serving %s on %s:%d%s", info["model_name"], self.host, port, " (TLS)" if self.tls_cert else "")
        return self

    async def _watch_engine(self, interval: float = 0.5) -> None:
        """Health NOT_SERVING, so that orchestrators restart us, once the engine has died, and
        while it is stalled: calls wait on it and it has finished no step for `stall_timeout`
        seconds (a hung device or kernel; SGLang's watchdog, which kills its server after 300 s
        by default, watches the same). Health turns SERVING again if the steps resume."""
        interval = min(interval, self.stall_timeout / 4) if self.stall_timeout else interval
        steps, since = self.worker.steps, time.monotonic()
        while self.worker.dead_error is None:
            await asyncio.sleep(interval)
            now = time.monotonic()
            if self.worker.steps != steps or not self.servicer.streams:
                steps, since = self.worker.steps, now
                if self.stalled:
                    self.stalled = False
                    logger.warning("the engine finished a step again: reporting SERVING")
                    await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            elif self.stall_timeout and not self.stalled and now - since > self.stall_timeout:
                self.stalled = True
                logger.error("the engine has finished no step for %.0f s while %d calls wait on it: "
                             "reporting NOT_SERVING", now - since, len(self.servicer.streams))
                await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        logger.error("engine thread died (%r): reporting NOT_SERVING", self.worker.dead_error)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _set_health(self, status) -> None:
        await self.health.set("", status)
        await self.health.set(SERVICE_NAME, status)

    async def stop(self, grace: float = 30.0) -> None:
        """Graceful shutdown: refuse new Generate calls, let in-flight ones finish for up to
        `grace` seconds (health turns NOT_SERVING meanwhile, other calls still work), then cancel
        the rest, which aborts them in the engine."""
        if self._server is None or self._stopped.is_set():
            return
        if self._stopping:
            return await self._stopped.wait()
        self._stopping = True
        self._watchdog.cancel()
        self.servicer.accepting = False
        await self.health.enter_graceful_shutdown()
        drained = asyncio.ensure_future(self.servicer.drained.wait())
        forced = asyncio.ensure_future(self._force.wait())
        await asyncio.wait((drained, forced), timeout=max(0.0, grace), return_when=asyncio.FIRST_COMPLETED)
        drained.cancel()
        forced.cancel()
        if self.servicer.streams:
            logger.warning("cancelling %d requests still running after the grace period", len(self.servicer.streams))
        # Whatever is still running is cancelled here, and each cancelled call aborts its request.
        await self._server.stop(0.5)
        if self.metrics is not None:
            self.metrics.close()
        if self.owns_worker:
            await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)
        self._stopped.set()

    def force_stop(self) -> None:
        """Cut the drain of a stop() in progress short (e.g. on a second Ctrl-C)."""
        self._force.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()
