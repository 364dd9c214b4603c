"""Host-side state of one request: plain ints and lists with explicit names. No JAX."""
from __future__ import annotations

import dataclasses
import enum
import time

from jaxoverlap.outputs import RequestMetrics
from jaxoverlap.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued (new, or retracted and requeued)
    PREFILL = "prefill"  # admitted; prompt chunks still to run
    RUNNING = "running"  # prompt done; decoding
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the effective sampling seed (the request's own, or one the engine drew)
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)

    status: Status = Status.WAITING
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    # SamplingParams.top_logprobs: per output token, [(token id, logprob), ...] most likely first.
    output_top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    abort_requested: bool = False
    # The token ids that end this request: its stop_token_ids, and EOS unless ignore_eos
    # (set by Scheduler.add, which knows the model's EOS ids).
    stop_ids: frozenset[int] = frozenset()

    # Resources, held from admission until the request finishes or is retracted.
    entry: int = 0  # relay entry / req_to_token row
    pages: list[int] = dataclasses.field(default_factory=list)  # page i holds positions [i*ps, (i+1)*ps)
    prefix_nodes: list = dataclasses.field(default_factory=list)  # locked prefix-cache nodes (pages[:n])

    # Prefill progress. fill_ids is the prompt, plus the output so far after a retraction.
    fill_ids: list[int] = dataclasses.field(default_factory=list)
    # Speculative engines resume a retracted request with its last output token as the next
    # input (fill_ids then ends before it), instead of sampling a new one after it: the
    # request continues exactly as it would have without the retraction.
    resume_token: int | None = None
    prefill_pos: int = 0  # next position to prefill
    admitted_at: int = 0  # the position its prefill started from at its last admission (after the cached prefix)
    # Positions whose K/V the host knows to be written once every launched prefill and
    # every processed decode step has run. The device may be up to one window ahead.
    kv_committed: int = 0
    # Bumped whenever the request leaves the running set (retraction): rows of a step that
    # was launched before carry the old epoch, and their results are dropped.
    epoch: int = 0

    # Streaming: how many output ids have been handed out, and the decoded text that has
    # not been (only the tail that may begin a stop string is ever held back).
    num_emitted: int = 0
    pending_text: str = ""
    detok: object = None  # the tokenizer's incremental decoder
    # SamplingParams.structured_output: its llguidance matcher, advanced by every output token
    # (structured.py), from which each step's allowed tokens come.
    matcher: object = None
    # Until the matcher is made: the Future of its grammar's compile (Grammars.compile); the
    # scheduler holds the request back meanwhile (Scheduler.held).
    grammar_future: object = None
    # Why the engine ended the request although its parameters were checked (its grammar's
    # compile failed on the compile thread), for RequestOutput.error; None otherwise.
    error: str | None = None
    # With a drafter: where the grammar failed (a parser limit) while the masks of the step
    # being launched were walked along its drafts (on a copy of the matcher,
    # Grammars.window_bitmask), as len(output_ids) once the token drawn under the failed mask
    # is appended; that token ends the request with "abort", as a failure of the matcher's own
    # mask would. Set for each split speculative step (ModelRunner.launch_sample), None if none.
    grammar_failed_at: int | None = None

    # SamplingParams.prompt_logprobs: per prompt position, the logprob of its token given
    # the tokens before it and whether it was the argmax there (None at position 0), filled
    # in as the prefill chunks' results arrive.
    prompt_logprobs: list[float | None] | None = None
    prompt_top1: list[bool | None] | None = None

    metrics: RequestMetrics = dataclasses.field(default_factory=RequestMetrics)

    def __post_init__(self):
        self.metrics.arrival_time = self.arrival_time
        self.metrics.prompt_tokens = len(self.prompt_ids)
        self.fill_ids = list(self.prompt_ids)
        if self.params.top_logprobs:
            self.output_top_logprobs = []
        if self.params.prompt_logprobs:
            self.prompt_logprobs = [None] * len(self.prompt_ids)
            self.prompt_top1 = [None] * len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
