"""What the engine hands back: incremental deltas while a request runs, and final results."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    output_tokens: int = 0
    num_steps: int = 0  # decode/speculative steps this request took part in (its results processed)
    num_retractions: int = 0
    # Tokens that decode/speculative steps gave it (accepted drafts and the bonus token; not
    # the prefill's first token, nor one a re-prefill after a retraction samples).
    decode_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tokens_per_second(self) -> float | None:
        if self.finish_time is None or self.first_token_time is None:
            return None
        dt = self.finish_time - self.arrival_time
        return self.output_tokens / dt if dt > 0 else None

    @property
    def accept_length(self) -> float:
        """Tokens gained per step (1.0 for plain decoding; includes the bonus token)."""
        return self.decode_tokens / self.num_steps if self.num_steps else 1.0


@dataclasses.dataclass
class RequestOutput:
    """One update for one request: the tokens (and text) that are new since the last update."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    metrics: RequestMetrics
    new_logprobs: list[float] | None = None
    # The request's live output list and its length at this update: `token_ids` slices it
    # only when asked, so a step does not copy every running request's whole output.
    _output_ids: list[int] = dataclasses.field(default_factory=list, repr=False)
    _num_tokens: int = 0
    # SamplingParams.prompt_logprobs, on the final update: per prompt position, its token's
    # logprob given the tokens before it, and whether it was the model's top choice (None
    # at position 0, which nothing precedes).
    prompt_logprobs: list[float | None] | None = None
    prompt_top1: list[bool | None] | None = None
    # SamplingParams.top_logprobs: per new token, [(token id, logprob), ...] most likely first.
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    # On a final "abort" update: why the engine ended a request it had accepted (its
    # structured output's grammar failed to compile, which Engine.add_request does not wait
    # for); None for a client's abort and every other update.
    error: str | None = None

    @property
    def token_ids(self) -> list[int]:
        """All output tokens up to this update."""
        return self._output_ids[: self._num_tokens]


@dataclasses.dataclass
class GenerationResult:
    """The final result of one prompt (one of its samples when SamplingParams.n > 1) for `LLM.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics
    logprobs: list[float] | None = None
    prompt_logprobs: list[float | None] | None = None  # SamplingParams.prompt_logprobs (RequestOutput)
    prompt_top1: list[bool | None] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # SamplingParams.top_logprobs, per output token
    sample_index: int = 0  # which of the prompt's SamplingParams.n samples (0 .. n-1)
    error: str | None = None  # RequestOutput.error of its final update


class OutputText:
    """The text of one request's outputs, made from their token ids by the consumer: what the
    engine's own text would be for a request without stop strings, for requests submitted
    with `SamplingParams(detokenize=False)`.

    The engine decodes each new token on its thread (Engine._check_stop_strings); a consumer
    on another thread (the gRPC server's handler) can take that work off it. Same rules: one
    token at a time, a stop token's text left out, and the held-back tail of an incomplete
    character flushed at the end.

    `ending_ids`: the ids that end the request (`params.ending_token_ids(engine.eos_token_ids)`).
    Without them, a "stop" finish is taken to end on such a token, which holds for every
    request but one with structured output: its grammar may complete on a token of text.
    `skip_special_tokens`: the request's SamplingParams.skip_special_tokens.
    """

    def __init__(self, tokenizer, prompt_ids, ending_ids=None, *, skip_special_tokens: bool = True):
        self._decoder = tokenizer.incremental_decoder(prompt_ids, skip_special_tokens=skip_special_tokens)
        self._ending_ids = None if ending_ids is None else frozenset(ending_ids)

    def delta(self, out: RequestOutput) -> str:
        ids = out.new_token_ids
        if out.finished and out.finish_reason == "stop" and ids and (
                self._ending_ids is None or ids[-1] in self._ending_ids):
            ids = ids[:-1]  # the stop (or EOS) token: the engine never decodes it
        text = "".join([self._decoder.step(t) for t in ids])
        if out.finished:
            text += self._decoder.flush()
        return text
