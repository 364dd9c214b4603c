"""SamplingParams: the public, per-request sampling and stopping contract."""
from __future__ import annotations

import dataclasses
import math
import operator
import re

import numpy as np

from jaxoverlap.errors import InvalidRequestError
from jaxoverlap.structured import StructuredOutput

MAX_TOP_LOGPROBS = 20  # SamplingParams.top_logprobs at most (what OpenAI's API allows)
MAX_LOGIT_BIAS = 64  # tokens one request's logit_bias may name (a fixed-width row on the device: penalties.py)
MAX_SAMPLES = 128  # SamplingParams.n at most (as OpenAI's API)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 (or -1) disables
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    # Independent samples of the prompt (pass@k evaluations, OpenAI's n). The engine serves one
    # sequence per request: callers queue `samples()`, one request each, which share the
    # prompt's prefill through the prefix cache (LLM.generate, jaxoverlap batch, gRPC).
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # The text ends with the stop string, or the text of the stop token (EOS, stop_token_ids),
    # that ended it (vLLM's include_stop_str_in_output); by default it ends just before it.
    include_stop_str_in_output: bool = False
    # Special tokens of the output (added tokens marked special, such as <|im_end|>) are
    # left out of its text, as transformers' decode(skip_special_tokens=True) does; False
    # writes them (vLLM's option).
    skip_special_tokens: bool = True
    logprobs: bool = False
    # Per output token, this many most likely tokens and their logprobs under the raw model
    # distribution (OpenAI's top_logprobs; at most MAX_TOP_LOGPROBS). A program
    # variant of its own, compiled on first use.
    top_logprobs: int = 0
    # Penalties on tokens the request has seen (repetition: prompt and output) or generated
    # (frequency, presence), as in vLLM and SGLang; penalties.py. Such a request prefills
    # its whole prompt (no prefix cache).
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # No stop token (EOS unless ignore_eos, stop_token_ids) among the first this many output
    # tokens: they are masked on the device (vLLM's min_tokens, SGLang's min_new_tokens).
    # Nor does a stop string end the output there: as in vLLM, only one that ends in the
    # text of a later token counts.
    min_new_tokens: int = 0
    # Added to the logits of these token ids before the token is chosen (OpenAI's
    # logit_bias; -100 bans a token, +100 all but forces it). A dict {token id: bias} (JSON
    # string keys accepted), stored as sorted (id, bias) pairs; at most MAX_LOGIT_BIAS of
    # them. Kept with the penalties' history on the device.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The logprob of each prompt token under the model, and whether it was the model's top
    # choice there: loglikelihood scoring (multiple-choice evaluations). From prompt
    # position `prompt_logprobs_start` on (earlier positions stay None; position 0 has no
    # context); the prefix cache may serve the pages before it, so that the choices of one
    # question prefill their shared context once.
    prompt_logprobs: bool = False
    prompt_logprobs_start: int = 1
    # False: the engine makes no text for this request (outputs carry token ids and an empty
    # new_text). For callers that decode elsewhere, e.g. the gRPC server's handlers, which
    # keep that work off the engine's thread (outputs.OutputText), or that need ids only.
    detokenize: bool = True
    # The output follows a JSON schema, a regex, a choice of strings or a grammar
    # (structured.py): a StructuredOutput, or a dict of its fields such as
    # {"json_schema": {...}} or {"regex": "..."}. Such a request needs a tokenizer; its
    # decode steps sample in a program of their own (steps.decode_sample_step; with a
    # drafter, speculative.step.spec_accept_step), after the host has made the masks, and it
    # stops when its grammar is complete.
    structured_output: StructuredOutput | None = None

    def __post_init__(self):
        # Accept lists (and a bare string for `stop`) from callers; store tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        stop_ids = () if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(stop_ids, (str, bytes)) or not hasattr(stop_ids, "__iter__"):
            # "12" would iterate as "1", "2"; a bare id is a mistake of the same kind.
            raise InvalidRequestError(f"invalid sampling params: stop_token_ids must be a list of token ids, "
                                      f"got {stop_ids!r}")
        stop_ids = tuple(_token_id(t, "stop_token_ids") for t in stop_ids)
        object.__setattr__(self, "stop_token_ids", stop_ids)
        for name in _NUMBERS:
            object.__setattr__(self, name, _plain(getattr(self, name)))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        object.__setattr__(self, "structured_output", StructuredOutput.of(self.structured_output))
        self.validate()

    def samples(self) -> tuple["SamplingParams", ...]:
        """The n requests this one stands for, each with n=1. Sample k gets seed + k (mod
        2**32) when a seed is given, so the whole set is reproducible and its samples differ;
        without one the engine draws a seed per request."""
        if self.n == 1:
            return (self,)
        return tuple(dataclasses.replace(self, n=1, seed=None if self.seed is None else (self.seed + k) % 2**32)
                     for k in range(self.n))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def ending_token_ids(self, eos_token_ids) -> frozenset[int]:
        """The token ids that end this request: its stop_token_ids, and EOS unless ignore_eos."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def uses_history(self) -> bool:
        """Whether the device's per-request token history serves this request (penalties.py)."""
        return self.has_penalties or self.min_new_tokens > 0 or bool(self.logit_bias)

    def validate(self) -> None:
        def bad(msg: str):
            raise InvalidRequestError(f"invalid sampling params: {msg}")

        for name in ("ignore_eos", "logprobs", "prompt_logprobs", "detokenize", "include_stop_str_in_output",
                     "skip_special_tokens"):
            # Real bools only: any other value (the string "false" from a JSON line, 0/1)
            # would be taken by its truth value.
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            bad(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad(f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_SAMPLES:
            bad(f"n must be an integer in [1, {MAX_SAMPLES}], got {self.n!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**32):
            bad(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2.0 <= value <= 2.0:
                bad(f"{name} must be in [-2, 2] (0 = off), got {value!r}")
        if not isinstance(self.top_logprobs, int) or isinstance(self.top_logprobs, bool) or not (
                0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            bad(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if (not isinstance(self.min_new_tokens, int) or isinstance(self.min_new_tokens, bool)
                or not 0 <= self.min_new_tokens <= self.max_new_tokens):
            bad(f"min_new_tokens must be an integer in [0, max_new_tokens], got {self.min_new_tokens!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad(f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for tok, bias in self.logit_bias:
            if tok < 0 or not _finite(bias) or not -100.0 <= bias <= 100.0:
                bad(f"logit_bias maps token ids >= 0 to numbers in [-100, 100], got {tok}: {bias!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if t < 0:
                bad(f"stop_token_ids must be >= 0, got {t}")
        if (not isinstance(self.prompt_logprobs_start, int) or isinstance(self.prompt_logprobs_start, bool)
                or self.prompt_logprobs_start < 1):
            bad(f"prompt_logprobs_start must be an integer >= 1, got {self.prompt_logprobs_start!r}")
        if self.stop and not self.detokenize:
            bad("stop strings need the engine's text: detokenize must be True")


# The numeric fields: numpy scalars given for them (np.float32(0.7), np.int64(16)) are
# stored as Python's int / float (`_plain`), so that the frozen object holds plain values
# and validate() judges them as it does Python numbers.
_NUMBERS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "n", "top_logprobs",
            "repetition_penalty", "frequency_penalty", "presence_penalty", "min_new_tokens", "prompt_logprobs_start")
_DIGITS = re.compile(r"-?[0-9]+")  # a token id as a string (JSON object keys)


def _plain(x):
    """A numpy integer or floating scalar as Python's int or float; anything else as it is
    (np.bool_ is neither, so it stays refused as bool is)."""
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    return x


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _bias_pairs(value) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a dict (keys may be JSON strings) or pairs."""
    if not value:
        return ()
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = {_token_id(tok, "logit_bias"): _plain(bias) for tok, bias in items}
    except InvalidRequestError:
        raise
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"invalid sampling params: logit_bias must map token ids to numbers: {e}") from None
    return tuple(sorted(pairs.items()))


def _token_id(value, what: str) -> int:
    """A token id given as an integer (numpy's too) or, as JSON object keys are, a string of
    digits (ASCII ones, an optional minus: "--5" or "²" pass str.isdigit() but not int()).
    Never a float or a bool: int() would quietly turn 2.7 into token 2."""
    if isinstance(value, str) and _DIGITS.fullmatch(value.strip()):
        return int(value)
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidRequestError(f"invalid sampling params: {what} must hold integer token ids, got {value!r}")
    return operator.index(value)
