"""Test helpers: a fake engine with the Engine's public surface, and a server running in a thread.

FakeEngine lets the server, client and bench be exercised without JAX: it "decodes" one
deterministic token per running request per step, with the real engine's validation rules,
admission limits and finish reasons. ServerThread runs a GenerationServer on its own asyncio loop
in a background thread so that synchronous tests (and the sync client) can talk to it.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time

from jaxoverlap.config import EngineConfig
from jaxoverlap.errors import InvalidRequestError, PromptTooLongError, QueueFullError
from jaxoverlap.outputs import RequestMetrics, RequestOutput


class FakeTokenizer:
    """One token per character: id = byte value + 3 (0..2 are reserved, 2 is EOS)."""

    def __init__(self, vocab_size: int = 259, eos_token_ids=(2,)):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.calls: list[tuple[str, int]] = []  # (method, thread id) of each encode call
        self.special_flags: list[bool] = []  # add_special_tokens of each encode call
        self.chat_template = None  # a models.chat_template.ChatTemplate, if a test sets one

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append(("encode", threading.get_ident()))
        self.special_flags.append(add_special_tokens)
        return [b + 3 for b in text.encode("utf-8")]

    def encode_batch(self, texts, add_special_tokens: bool = True) -> list[list[int]]:
        self.calls.append(("encode_batch", threading.get_ident()))
        self.special_flags.append(add_special_tokens)
        return [[b + 3 for b in t.encode("utf-8")] for t in texts]

    def apply_chat_template(self, messages, *, add_generation_prompt: bool | None = None, **template_kwargs) -> str:
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)

    def decode(self, ids) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")

    def incremental_decoder(self, prompt_ids=(), *, skip_special_tokens: bool = True) -> "FakeIncrementalDecoder":
        return FakeIncrementalDecoder(self)


class FakeIncrementalDecoder:
    """models.tokenizer.IncrementalDecoder's contract for FakeTokenizer: text is emitted once
    its bytes form whole characters."""

    def __init__(self, tokenizer: FakeTokenizer):
        self._tokenizer = tokenizer
        self._pending: list[int] = []

    def step(self, new_ids) -> str:
        self._pending.extend([new_ids] if isinstance(new_ids, int) else new_ids)
        text = self._tokenizer.decode(self._pending)
        if text.endswith("\ufffd"):
            return ""
        self._pending = []
        return text

    def flush(self) -> str:
        text, self._pending = self._tokenizer.decode(self._pending), []
        return text


@dataclasses.dataclass
class FakeModelConfig:
    vocab_size: int = 259
    eos_token_ids: tuple[int, ...] = (2,)


@dataclasses.dataclass
class _FakeRequest:
    request_id: str
    prompt: list[int]
    params: object
    metrics: RequestMetrics
    output: list[int] = dataclasses.field(default_factory=list)
    sent: int = 0
    aborted: bool = False
    prefilled: int = 0  # of FakeEngine.prefill_steps


class FakeEngine:
    """Implements add_request/abort/step/has_work/stats/check_integrity like the real Engine.

    Generated token i of a request is `3 + (sum(prompt) + i) % 26` (letters 'a'..'z' after
    decoding) unless `eos_after` makes it emit EOS. `step_delay` sleeps inside step() to mimic
    device time; `crash_after_tokens` makes step() raise, as a failing device would;
    `prefill_steps` steps of a request make no token first, as a long prompt's prefill chunks.
    """

    def __init__(self, config: EngineConfig | None = None, *, step_delay: float = 0.0, eos_after: int | None = None,
                 crash_after_tokens: int | None = None, prefill_steps: int = 0):
        self.config = config or EngineConfig(max_running_requests=8, max_context_len=64, kv_cache_tokens=1024)
        self.tokenizer = FakeTokenizer()
        self.model_config = FakeModelConfig()
        self.model_name = "fake-model"
        self.max_context_len = self.config.max_context_len or 64
        self.step_delay = step_delay
        self.eos_after = eos_after
        self.crash_after_tokens = crash_after_tokens  # step() raises once this many tokens were made
        self.prefill_steps = prefill_steps
        self._waiting: collections.deque[_FakeRequest] = collections.deque()
        self._running: dict[str, _FakeRequest] = {}
        self._all: dict[str, _FakeRequest] = {}
        self._finished_pending: list[_FakeRequest] = []  # aborted, to be reported next step
        self.tokens_generated = 0
        self.thread_ids: set[int] = set()  # which threads called into the engine (must be one)
        self.prompt_kinds: list[str] = []  # the type of each prompt add_request got
        self.detokenize_flags: list[bool] = []  # and its SamplingParams.detokenize

    def _touch(self):
        self.thread_ids.add(threading.get_ident())

    def add_request(self, request_id, prompt, params) -> None:
        self._touch()
        if request_id in self._all:
            raise InvalidRequestError(f"duplicate request_id {request_id!r}")
        self.prompt_kinds.append(type(prompt).__name__)
        self.detokenize_flags.append(getattr(params, "detokenize", True))
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids outside the vocabulary [0, {self.model_config.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_context_len:
            raise PromptTooLongError(f"prompt has {len(ids)} tokens; the context holds {self.max_context_len}")
        if len(self._waiting) >= self.config.max_queued_requests:
            raise QueueFullError("too many queued requests")
        req = _FakeRequest(request_id, ids, params, RequestMetrics(arrival_time=time.monotonic(), prompt_tokens=len(ids)))
        self._all[request_id] = req
        self._waiting.append(req)

    def abort(self, request_id) -> bool:
        self._touch()
        req = self._all.get(request_id)
        if req is None or req.aborted:
            return False
        req.aborted = True
        self._finished_pending.append(req)
        return True

    def has_work(self) -> bool:
        self._touch()
        return bool(self._waiting or self._running or self._finished_pending)

    def step(self) -> list[RequestOutput]:
        self._touch()
        if self.crash_after_tokens is not None and self.tokens_generated >= self.crash_after_tokens:
            raise RuntimeError("device on fire")
        if self.step_delay:
            time.sleep(self.step_delay)
        outs = []
        for req in self._finished_pending:
            self._running.pop(req.request_id, None)
            try:
                self._waiting.remove(req)
            except ValueError:
                pass
            outs.append(self._emit(req, finished=True, reason="abort"))
        self._finished_pending.clear()
        while self._waiting and len(self._running) < self.config.max_running_requests:
            req = self._waiting.popleft()
            self._running[req.request_id] = req
        now = time.monotonic()
        for rid, req in list(self._running.items()):
            if req.prefilled < self.prefill_steps:
                req.prefilled += 1
                continue
            i = len(req.output)
            p = req.params
            if self.eos_after is not None and i >= self.eos_after and not p.ignore_eos:
                tok = self.model_config.eos_token_ids[0]
            else:
                tok = 3 + (sum(req.prompt) + i) % 26 + ord("a")
            req.output.append(tok)
            self.tokens_generated += 1
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            else:
                req.metrics.num_steps += 1
                req.metrics.decode_tokens += 1
            reason = None
            if tok in self.model_config.eos_token_ids or tok in p.stop_token_ids:
                reason = "stop"
            elif len(req.output) >= p.max_new_tokens or len(req.prompt) + len(req.output) >= self.max_context_len:
                reason = "length"
            if reason:
                del self._running[rid]
            outs.append(self._emit(req, finished=reason is not None, reason=reason))
        return outs

    def _emit(self, req: _FakeRequest, finished: bool, reason: str | None) -> RequestOutput:
        new = req.output[req.sent:]
        req.sent = len(req.output)
        req.metrics.output_tokens = len(req.output)
        if finished:
            req.metrics.finish_time = time.monotonic()
            del self._all[req.request_id]
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=list(new),
            new_text=self.tokenizer.decode(new) if getattr(req.params, "detokenize", True) else "",
            finished=finished,
            finish_reason=reason,
            metrics=dataclasses.replace(req.metrics),
            new_logprobs=[-1.0] * len(new) if getattr(req.params, "logprobs", False) else None,
            new_top_logprobs=([[(t, -1.0)] * req.params.top_logprobs for t in new]
                              if getattr(req.params, "top_logprobs", 0) else None),
            _output_ids=list(req.output),
            _num_tokens=len(req.output),
        )

    def stats(self) -> dict:
        self._touch()
        used = sum(len(r.prompt) + len(r.output) for r in self._running.values())
        return {
            "num_running": len(self._running),
            "num_waiting": len(self._waiting),
            "kv_used_tokens": used,
            "kv_total_tokens": self.config.kv_cache_tokens or 1024,
            "tokens_generated": self.tokens_generated,
        }

    def check_integrity(self) -> None:
        self._touch()
        assert not self._running and not self._waiting and not self._finished_pending, "requests left in the engine"
        assert not self._all, f"request entries leaked: {sorted(self._all)}"


class ServerThread:
    """Run a GenerationServer on a private event loop in a daemon thread (for tests and tools).

    `kwargs` go to GenerationServer; the bound port is in `.port` once `start()` returns.
    """

    def __init__(self, worker, **kwargs):
        self.worker = worker
        self.kwargs = kwargs
        self.loop = asyncio.new_event_loop()
        self.server = None
        self.port = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="jaxoverlap-grpc", daemon=True)

    def start(self) -> "ServerThread":
        from jaxoverlap.server.grpc_server import GenerationServer

        self._thread.start()

        async def _start():
            self.server = GenerationServer(self.worker, **self.kwargs)
            await self.server.start()
            return self.server.port

        self.port = self.run(_start())
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def run(self, coro, timeout: float | None = 60):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: float = 5.0) -> None:
        if self.server is not None:
            self.run(self.server.stop(grace), timeout=grace + 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
