"""The Python API for notebooks and offline scripts.

    from jaxoverlap import LLM, SamplingParams
    llm = LLM("path/to/hf_checkpoint", dtype="bfloat16", max_running_requests=32)
    results = llm.generate(["Hello"], SamplingParams(max_new_tokens=32, temperature=0))
    print(results[0].text, results[0].metrics.time_to_first_token)
    llm.close()  # frees the weights and the KV cache now (or: with LLM(...) as llm: ...)
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import numbers
import sys
import threading
from typing import Iterator, Sequence

import numpy as np

from jaxoverlap import interrupts
from jaxoverlap.config import EngineConfig
from jaxoverlap.engine import Engine, _int_list
from jaxoverlap.errors import EngineClosedError, InvalidRequestError
from jaxoverlap.outputs import GenerationResult, RequestOutput
from jaxoverlap.sampling_params import SamplingParams

# Requests an LLM call keeps queued in the engine (at least twice max_running_requests): the
# rest of its prompts wait in the call itself, so a call takes any number of prompts.
QUEUE_DEPTH = 64


@dataclasses.dataclass(frozen=True)
class _Pending:
    """One request of an LLM call, checked and not yet queued in the engine."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # n == 1
    prompt_index: int  # in the call's prompts
    sample_index: int  # 0 .. n-1 of SamplingParams.n


def _one_prompt(prompts) -> bool:
    """Whether `prompts` is one prompt (a text, or token ids as a list or a 1-D array of
    integers, numpy's included) rather than a list of prompts."""
    if isinstance(prompts, str):
        return True
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 1
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequestError(f"prompts must be a string, a list of token ids, or a list of those, got "
                                  f"{type(prompts).__name__}")
    return len(prompts) > 0 and isinstance(prompts[0], numbers.Integral) and not isinstance(prompts[0], bool)


class LLM:
    def __init__(self, model: str | None = None, **engine_options):
        self.engine = Engine(EngineConfig.from_options(model, **engine_options))
        self._ids = itertools.count()
        # Every open call's outputs, by request id: a step may be taken by any open call (a
        # stream paused in a notebook while another generate() runs; two streams zipped),
        # and it files each output in its own call's inbox (one deque per call).
        self._routes: dict[str, collections.deque] = {}
        # The engine is single-threaded: calls from several threads take turns, a step (and the
        # filing of its outputs) at a time, so each thread's outputs are still its own.
        self._lock = threading.RLock()
        self._stepping = False

    def close(self) -> None:
        """Free the engine's device memory now (Engine.close); the LLM cannot generate after."""
        with self._lock:
            self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def warmup(self, batch_sizes=None, ctx_lens=None, **kw) -> list[dict]:
        """Compile the decode programs ahead of the first generate, and with prefill=True every
        prefill program too (Engine.warmup)."""
        with self._lock:
            return self.engine.warmup(batch_sizes, ctx_lens, **kw)

    def _prepare(self, prompts, sampling_params) -> collections.deque:
        """Every request of one call as a _Pending, all checked before any is queued: a bad
        prompt rejects the whole call and leaves the engine untouched. Text prompts are
        tokenized in one batch call. A prompt with SamplingParams.n > 1 becomes n requests
        (request ids `llm-N-0` .. `llm-N-{n-1}`), which share its prefill through the prefix cache."""
        if _one_prompt(prompts):
            prompts = [prompts]  # one prompt, as text or as token ids
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or not all(
                p is None or isinstance(p, SamplingParams) for p in sampling_params):
            raise InvalidRequestError("sampling_params must be a SamplingParams, None, or a list of them (one per "
                                      "prompt)")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        prompts = list(prompts)
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        tokenizer = self.engine.tokenizer
        if texts and tokenizer is not None:
            for i, ids in zip(texts, tokenizer.encode_batch([prompts[i] for i in texts])):
                prompts[i] = ids
        pending = collections.deque()
        for index, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            params = params or SamplingParams()
            try:
                prompt_ids = self.engine.check_request(prompt, params)
            except ValueError as e:  # the same error, saying which prompt of the batch it is
                if len(prompts) > 1:
                    e.args = (f"prompt {index}: {e}",)
                raise
            rid = f"llm-{next(self._ids)}"
            samples = params.samples()
            for k, sample in enumerate(samples):
                pending.append(_Pending(rid if len(samples) == 1 else f"{rid}-{k}", prompt_ids, sample, index, k))
        return pending

    def _feed(self, pending: collections.deque) -> None:
        """Queue requests of `pending` until the engine has QUEUE_DEPTH waiting. A call may hold
        any number of prompts (an evaluation set of thousands), while the engine's queue takes
        at most `max_queued_requests`; and each step then takes in a few, not all at once."""
        engine = self.engine
        depth = min(max(QUEUE_DEPTH, 2 * engine.config.max_running_requests), engine.config.max_queued_requests)
        while pending and engine.num_waiting < depth:
            p = pending.popleft()
            engine.add_request(p.request_id, p.prompt_ids, p.params)

    def _open_call(self, pending: collections.deque) -> collections.deque:
        """The inbox of a new call: every output of its requests lands there."""
        inbox = collections.deque()
        with self._lock:
            for p in pending:
                self._routes[p.request_id] = inbox
        return inbox

    def _outputs(self, inbox: collections.deque, pending: collections.deque) -> list[RequestOutput]:
        """The call's next outputs: those another call's steps filed for it, else the next
        steps' (the call queues more of its requests first)."""
        while True:
            with self._lock:
                if inbox:
                    outs = list(inbox)
                    inbox.clear()
                    return outs
                if self.engine.closed:  # e.g. a stream resumed after close()
                    raise EngineClosedError("the engine is closed")
                self._feed(pending)
                if not self.engine.has_work():  # (never expected: the call's requests are lost)
                    raise RuntimeError("the engine is idle but this call's requests have not finished")
                # Ctrl-C waits for the step and the filing of its outputs: a paused stream's
                # tokens are not dropped (the step itself defers it too: interrupts.py).
                with interrupts.deferred():
                    self._stepping = True
                    try:
                        outs = self.engine.step()
                    finally:
                        self._stepping = False
                    for out in outs:
                        box = self._routes.get(out.request_id)
                        if box is not None:  # not: a request given up, or one added to the engine directly
                            box.append(out)
                            if out.finished:
                                del self._routes[out.request_id]

    def generate_stream(
        self, prompts: Sequence[str] | Sequence[Sequence[int]] | str, sampling_params=None
    ) -> Iterator[RequestOutput]:
        """Yield RequestOutput deltas as the engine produces them (request ids `llm-N`, and
        `llm-N-k` for sample k of a prompt with SamplingParams.n > 1)."""
        pending = self._prepare(prompts, sampling_params)
        ids = {p.request_id for p in pending}
        inbox = self._open_call(pending)
        try:
            while ids:
                for out in self._outputs(inbox, pending):
                    yield out
                    if out.finished:
                        ids.discard(out.request_id)
        finally:  # the caller stopped early (break, close, an exception): nothing of this call runs on
            self._abandon(ids)

    def _abandon(self, ids) -> None:
        """Abort the call's requests that have not finished, so that a call given up (a loop
        left early, Ctrl-C in a notebook) leaves no work behind in the engine."""
        # A second Ctrl-C waits until every request is aborted and the engine settled: cut
        # short, the rest would run on and hold their batch slots until the next call.
        with interrupts.deferred(), self._lock:
            for rid in ids:
                self._routes.pop(rid, None)
                self.engine.abort(rid)  # False for those never queued or already done
            # Not while an error ends the call: the next call's steps finish this (a broken
            # engine would raise again here, over the first error). Ctrl-C breaks nothing
            # (the steps defer it), and it ends the call as the user's "stop" does.
            failing = sys.exc_info()[1]
            if failing is None or isinstance(failing, (GeneratorExit, KeyboardInterrupt)):
                self._settle()

    def _settle(self) -> None:
        """With no call left open, finish what the engine holds of the calls before: the
        overlap loop's step in flight, and the aborts of a call given up. The engine is then
        idle between calls (has_work() is False; set_overlap may switch loops), unless it
        runs requests added to it directly, which are left to their owner's steps."""
        engine = self.engine
        if (self._routes or engine.closed or self._stepping
                or any(not r.abort_requested for r in engine.requests.values())):
            return  # (_stepping: a stream given up from within a step, e.g. by the collector)
        while engine.has_work():
            engine.step()  # every output here is of a request no call waits for

    def chat(self, conversations, sampling_params=None, *, use_tqdm: bool = False,
             add_generation_prompt: bool | None = None, **template_kwargs) -> list[GenerationResult]:
        """generate() for chat messages: each conversation (a list of {"role", "content"}
        dicts, or a list of such lists) becomes its prompt under the checkpoint's chat
        template. `template_kwargs` reach the template (e.g. `enable_thinking=False` for
        Qwen3); `continue_final_message=True` continues the last message (a prefilled
        assistant answer) instead of opening a new turn."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # one conversation
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: chat needs one")
        prompts = [tokenizer.encode_chat(c, add_generation_prompt=add_generation_prompt, **template_kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def loglikelihood(self, requests, *, use_tqdm: bool = False) -> list[tuple[float, bool]]:
        """For (context, continuation) pairs, as evaluation harnesses score multiple-choice
        answers: the log-probability of the continuation given the context, and whether
        greedy decoding would have produced it (every continuation token the argmax). Each
        part is text or token ids; text continuations are encoded without special tokens and
        appended to the context's ids. Uses SamplingParams(prompt_logprobs=True)."""
        prompts, starts, params = [], [], []
        for pair in requests:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise InvalidRequestError(f"loglikelihood takes (context, continuation) pairs, got {pair!r:.80}")
            context, continuation = pair
            ctx = self._ids_of(context, special=True)
            cont = self._ids_of(continuation, special=False)
            if not ctx or not cont:
                raise InvalidRequestError("loglikelihood needs a non-empty context and continuation")
            prompts.append(ctx + cont)
            starts.append(len(ctx))
            # Scored from the continuation on: the context's pages may come from the prefix
            # cache, so the choices of one question prefill their shared context once.
            params.append(SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=True,
                                         prompt_logprobs_start=len(ctx), detokenize=False))
        results = self.generate(prompts, params, use_tqdm=use_tqdm)
        return [(float(sum(r.prompt_logprobs[start:])), all(r.prompt_top1[start:]))
                for r, start in zip(results, starts)]

    def loglikelihood_rolling(self, texts, *, max_length: int | None = None, prefix_token_id: int | None = None,
                              use_tqdm: bool = False) -> list[float]:
        """For whole texts, as perplexity evaluations score them (lm-eval's
        loglikelihood_rolling): the sum of log P(token | the tokens before it) over every
        token of each text (text, encoded without special tokens, or token ids). The first
        token is conditioned on `prefix_token_id` (default: the tokenizer's BOS, else its
        first EOS id, as lm-eval does).

        A text longer than `max_length` tokens (default and at most the context less two: a
        window's prompt plus the one token each request generates) is scored in disjoint
        windows of `max_length` predicted tokens, as lm-eval's rolling windows with a
        context of one: the first token of each later window sees the `max_length` tokens
        before it only up to that window's end. Every window is one request with
        prompt_logprobs, scored from its first predicted token."""
        limit = self.engine.max_context_len - 2
        max_length = limit if max_length is None else max_length
        if not 1 <= max_length <= limit:
            raise InvalidRequestError(f"max_length must be in [1, {limit}] (the context less two), got {max_length}")
        if prefix_token_id is None:
            prefix_token_id = self.prefix_token_id
        prompts, starts, owners = [], [], []
        for t, text in enumerate(texts):
            seq = [int(prefix_token_id)] + self._ids_of(text, special=False)  # seq[j + 1] is the text's token j
            n = len(seq) - 1
            if n == 0:
                raise InvalidRequestError("loglikelihood_rolling needs a non-empty text")
            end = 0  # tokens predicted so far
            while end < n:
                count = min(max_length, n - end)
                end += count
                first = max(0, end - max_length)  # the window's input: tokens end - max_length - 1 .. end - 2
                prompts.append(seq[first : end + 1])  # [input tokens..., the last predicted token]
                starts.append(end + 1 - count - first)
                owners.append(t)
        params = [SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=True,
                                 prompt_logprobs_start=start, detokenize=False) for start in starts]
        totals = [0.0] * len(texts)
        for index, r in self.generate_unordered(prompts, params, use_tqdm=use_tqdm):
            totals[owners[index]] += float(sum(r.prompt_logprobs[starts[index]:]))
        return totals

    @property
    def prefix_token_id(self) -> int:
        """The token a text's first token is conditioned on when it has no context, as
        lm-eval picks it: the tokenizer's BOS, else its EOS token; without either (or a
        tokenizer), the lowest EOS id."""
        tok = self.engine.tokenizer
        if tok is not None and tok.bos_token_id is not None:
            return tok.bos_token_id
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            return tok.eos_token_id
        if not self.engine.eos_token_ids:
            raise InvalidRequestError("no BOS or EOS token to condition the first token on: pass prefix_token_id")
        return min(self.engine.eos_token_ids)

    def _ids_of(self, part, *, special: bool) -> list[int]:
        if isinstance(part, str):
            if self.engine.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids")
            return self.engine.tokenizer.encode(part, add_special_tokens=special)
        if not isinstance(part, (list, tuple, np.ndarray)):
            raise InvalidRequestError(f"expected text or a list of token ids, got {type(part).__name__}")
        return _int_list(part)

    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = False) -> list[GenerationResult]:
        """Run prompts to completion; one GenerationResult per prompt, in order. With
        SamplingParams.n > 1 a prompt has n results in a row (sample_index 0 .. n-1): with n
        samples of every prompt, results[n * i + k] is sample k of prompt i."""
        results = {}
        unordered = self.generate_unordered(prompts, sampling_params, use_tqdm=use_tqdm)
        try:
            for index, result in unordered:
                results[index, result.sample_index] = result
        finally:  # Ctrl-C here: the call is given up now, not once a kept traceback lets it go
            unordered.close()
        return [results[key] for key in sorted(results)]

    def generate_unordered(
        self, prompts, sampling_params=None, *, use_tqdm: bool = False
    ) -> Iterator[tuple[int, GenerationResult]]:
        """Run prompts to completion and yield (index in `prompts`, GenerationResult) as each
        request finishes, so a long evaluation can save every result the moment it exists
        (`jaxoverlap batch`); a prompt with SamplingParams.n > 1 yields n of them, told apart
        by their sample_index. Leaving the loop early aborts what has not finished."""
        pending = self._prepare(prompts, sampling_params)
        by_id = {p.request_id: p for p in pending}
        inbox = self._open_call(pending)
        texts = {rid: [] for rid in by_id}
        logprobs = {rid: [] for rid in by_id}
        top = {rid: [] for rid in by_id}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(by_id), desc="generate", unit="req")
        try:
            while texts:
                for out in self._outputs(inbox, pending):
                    rid = out.request_id
                    texts[rid].append(out.new_text)
                    if out.new_logprobs is not None:
                        logprobs[rid].extend(out.new_logprobs)
                    if out.new_top_logprobs is not None:
                        top[rid].extend(out.new_top_logprobs)
                    if out.finished:
                        p = by_id[rid]
                        result = GenerationResult(
                            request_id=rid, prompt_token_ids=p.prompt_ids, token_ids=out.token_ids,
                            text="".join(texts.pop(rid)), finish_reason=out.finish_reason, metrics=out.metrics,
                            logprobs=logprobs[rid] if out.new_logprobs is not None else None,
                            prompt_logprobs=out.prompt_logprobs, prompt_top1=out.prompt_top1,
                            top_logprobs=top[rid] if out.new_top_logprobs is not None else None,
                            sample_index=p.sample_index, error=out.error,
                        )
                        del logprobs[rid], top[rid]
                        if bar is not None:
                            bar.update(1)
                        yield p.prompt_index, result
        finally:  # the caller stopped early (break, close, an exception): nothing of this call runs on
            self._abandon(list(texts))
            if bar is not None:
                bar.close()
