"""Structured output: constrain a request's tokens to a JSON schema, a regex, a choice of
strings or a grammar (vLLM's and SGLang's structured outputs), with llguidance.

The host keeps one llguidance matcher per constrained request. Before a step that holds a
constrained row launches, each such row's matcher gives the tokens allowed next as a
bitmask ([rows, ceil(V / 32)] int32, bit t of word t // 32); the step's sampler sets every
other logit to -inf (sampling.sample), greedy rows too. Each token the step returns then
advances the matcher (Engine._check_token), and the request stops when its grammar is
complete.

The mask of step N+1 depends on step N's token, which only the device knows when the
overlap loop prepares step N+1. So a decode batch that holds a constrained row runs as two
programs (Engine._step_overlap): its forward pass is queued behind step N, step N is
processed while it runs (its tokens advance the matchers), and the sampling is queued with
the masks; the device never waits for them while the forward pass outlasts the host's
work.

With speculative decoding each window position needs its own mask, which also follows from
the drafts before it (`Grammars.window_bitmask`). A constrained batch's speculative step
runs as three programs (speculative/step.py): the draft program and the verify pass are
queued behind step N; the host processes step N, reads the drafts (the draft program ends
long before the verify pass), walks each grammar along its row's drafts for the masks, and
queues the accept program with them. A draft the grammar refuses is rejected like any miss
(its masked target probability is 0), and the token drawn there is one the grammar allows.

Host-side only (numpy and llguidance): the device side is `allowed_mask` in sampling.py.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import json
import logging
import threading

import numpy as np

from jaxoverlap.errors import InvalidRequestError

logger = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON as json.dumps writes it: no whitespace but one space after "," and ":". llguidance's
# own default allows any whitespace between tokens, where a weak model can loop on spaces
# and newlines until max_new_tokens. A schema's "x-guidance" object overrides these.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CACHED_GRAMMARS = 64  # compiled grammars kept per engine, least recently used dropped
COMPILE_THREADS = 2  # grammars compiled at once (outside the GIL, beside the engine's loop)


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """Exactly one constraint. json_schema: a JSON schema (a dict or its JSON text, stored
    as JSON text, its keys in the order given: an object's properties come out in the order
    the schema lists them); json_object: any JSON object; regex: the whole output matches
    it (Rust regex syntax); choice: the output is one of these strings; grammar: a Lark (or
    GBNF) grammar in llguidance's dialect."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        schema = self.json_schema
        if schema is not None:
            try:
                value = json.loads(schema) if isinstance(schema, str) else schema
                text = schema if isinstance(schema, str) else json.dumps(schema)  # keys in their order
            except (TypeError, ValueError, RecursionError) as e:  # RecursionError: nesting deeper than json can read
                raise InvalidRequestError(f"invalid structured output: json_schema is not JSON: "
                                          f"{type(e).__name__}: {e}") from None
            if not isinstance(value, dict):
                raise InvalidRequestError(f"invalid structured output: json_schema must be a JSON object (a schema), "
                                          f"got {type(value).__name__}")
            object.__setattr__(self, "json_schema", text)
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError("invalid structured output: json_object must be true or false")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise InvalidRequestError("invalid structured output: choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(f"invalid structured output: give exactly one of {', '.join(KINDS)}, "
                                      f"got {given or 'none'}")
        if self.choice is not None and not self.choice:
            raise InvalidRequestError("invalid structured output: choice needs at least one string")
        for name in ("json_schema", "regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidRequestError(f"invalid structured output: {name} must be a string")

    @classmethod
    def of(cls, value) -> "StructuredOutput | None":
        """From a StructuredOutput, a dict of its fields ({"json_schema": {...}}, as JSON
        request files give it; "json" is taken for json_schema, as vLLM names it), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"invalid structured output: expected an object with one of {', '.join(KINDS)}, "
                                      f"got {type(value).__name__}")
        fields = dict(value)
        if "json" in fields:
            if "json_schema" in fields:
                raise InvalidRequestError("invalid structured output: give json or json_schema, not both")
            fields["json_schema"] = fields.pop("json")
        unknown = sorted(set(fields) - set(KINDS))
        if unknown:
            raise InvalidRequestError(f"invalid structured output: unknown field(s) {unknown}; "
                                      f"give one of {', '.join(KINDS)}")
        return cls(**fields)

    def grammar_text(self) -> str:
        """The llguidance grammar of this constraint (not yet checked)."""
        from llguidance import LLMatcher, grammar_from

        try:  # llguidance's builders raise ValueError themselves for some inputs (UnicodeError is one)
            if self.json_schema is not None:
                return LLMatcher.grammar_from_json_schema(self.json_schema, defaults=JSON_LAYOUT)
            if self.json_object:
                return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
            if self.regex is not None:
                return LLMatcher.grammar_from_regex(self.regex)
            if self.choice is not None:
                return grammar_from("choice", json.dumps(list(self.choice)))
            return grammar_from("grammar", self.grammar)  # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise InvalidRequestError(f"invalid structured output: {e}") from None


def from_command_line(json_schema: str | None = None, regex: str | None = None,
                      choice: list[str] | None = None) -> dict | None:
    """The structured_output of the commands' --json-schema (JSON text, or the path of a
    file holding it), --regex and --choice options; None when none is given."""
    given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("choice", choice)) if v}
    if len(given) > 1:
        raise InvalidRequestError("give one of --json-schema, --regex and --choice")
    if "json_schema" in given:
        text = given["json_schema"]
        if not text.lstrip().startswith("{"):  # a file's path
            try:
                with open(text, encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise InvalidRequestError(f"--json-schema is neither a JSON object nor a readable file: {e}") from None
        try:
            given["json_schema"] = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise InvalidRequestError(f"--json-schema is not JSON: {e}") from None
    return given or None


class Grammars:
    """An engine's structured output: its tokenizer as llguidance sees it, the grammars it
    has compiled (checked once per distinct constraint), and the matchers and masks of its
    requests. `vocab_size` is the model's (its logits'): ids past the tokenizer's are never
    allowed, nor are those the model has no logit for."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._hf = tokenizer.hf_tokenizer
        # The model's logits are usually padded past the tokenizer's ids; where a model has
        # fewer (a test model), the mask still covers every token id, and the sampler reads
        # only its own vocabulary's part of it.
        vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words of one row's bitmask
        # EOS ids the tokenizer has (llguidance refuses others); none: the tokenizer's own.
        self._eos = [int(t) for t in eos_token_ids if int(t) < tokenizer.vocab_size] or None
        self._tokenizer = None
        # spec -> Future of its compiled matcher at the grammar's start (a template that each
        # request copies), least recently used dropped. A failed compile stays: the same bad
        # spec is refused at once next time.
        self._compiled: collections.OrderedDict[StructuredOutput, concurrent.futures.Future] = \
            collections.OrderedDict()
        self._lock = threading.Lock()  # compile() is called from the engine's thread and callers' (check_request)
        self._tokenizer_lock = threading.Lock()  # the compile threads may ask for it together
        self._pool = None

    @property
    def tokenizer(self):
        with self._tokenizer_lock:
            if self._tokenizer is None:
                from llguidance import LLTokenizer

                # From the tokenizer's JSON, as llguidance's transformers bridge does (no transformers here).
                self._tokenizer = LLTokenizer(self._hf.to_str(), n_vocab=self.vocab_size, eos_token=self._eos)
        return self._tokenizer

    def compile(self, spec: StructuredOutput) -> concurrent.futures.Future:
        """A Future of `spec`'s compiled matcher, started on this object's compile threads
        unless one is cached. Its exception is InvalidRequestError with llguidance's message
        for a spec it refuses (a schema it cannot compile, a bad regex).

        A large schema or choice takes llguidance a few hundred milliseconds; it releases the
        GIL meanwhile, so the engine's loop goes on stepping (Engine.add_request holds the
        request back until its grammar is ready)."""
        with self._lock:
            future = self._compiled.get(spec)
            if future is not None:
                self._compiled.move_to_end(spec)
                return future
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, "jaxoverlap-grammar")
            future = self._compiled[spec] = self._pool.submit(self._build, spec)
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return future

    def _build(self, spec: StructuredOutput):
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, spec.grammar_text(), log_level=0, limits=self.limits)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid structured output: {matcher.get_error().strip()}")
        return matcher

    def check(self, spec: StructuredOutput) -> None:
        """Compile `spec` now (blocking); InvalidRequestError if llguidance refuses it."""
        self.compile(spec).result()

    def matcher(self, spec: StructuredOutput):
        """A fresh matcher at the start of `spec`'s grammar (blocking until it is compiled)."""
        return self.compile(spec).result().deep_copy()

    def close(self) -> None:
        """Stop the compile threads (compiles in progress finish; nothing else starts)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    @functools.cached_property
    def limits(self):
        from llguidance import LLParserLimits

        # Default limits, but short errors: a verbose one holds the whole grammar and parser state.
        return LLParserLimits(verbose_errors=False)

    def bitmask(self, rows, num_rows: int, sampled=None, *, always: bool = False) -> np.ndarray | None:
        """The allowed tokens of a step's rows ([num_rows, words] int32, every bit set for
        rows without a constraint and for padding), or None when no row is constrained
        (with `always`, every bit set then). `sampled(i)`: whether row i's token is the
        request's (prefill chunks before the last sample nothing that is kept)."""
        constrained = [(i, row.req.matcher) for i, row in enumerate(rows)
                       if row.req.matcher is not None and (sampled is None or sampled(i))]
        if not constrained and not always:
            return None
        from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

        mask = np.full((num_rows, self.words), -1, np.int32)
        # A row whose request ended meanwhile keeps every bit: its token is dropped.
        live = [(m, i) for i, m in constrained if not (m.is_stopped() or m.is_error())]
        if len(live) == 1:
            fill_next_token_bitmask(live[0][0], mask, live[0][1])
        elif live:  # the rows' masks at once, on llguidance's threads (outside the GIL)
            fill_next_token_bitmask_par(self.executor, live, mask)
        for m, i in live:
            if m.is_error():
                # A parser limit hit while computing the mask (the mask then allows EOS only):
                # the row's token ends its request with "abort" (Scheduler._check_stop).
                logger.warning("structured output of row %d failed: %s", i, m.get_error())
        return mask

    def window_bitmask(self, rows, num_rows: int, drafts: np.ndarray,
                       counts: np.ndarray) -> tuple[np.ndarray, dict[int, int]]:
        """The allowed tokens of each position of a speculative step's windows ([num_rows,
        k + 1, words] int32): position j of row i may take what its grammar allows after the
        row's first j drafts (`drafts` [num_rows, k], `counts` [num_rows] real drafts per row).

        Each row's grammar walks its drafts on a copy of the request's matcher, up to the
        first draft that the mask of its position refuses: the request's own matcher never
        moves (llguidance cannot roll back every grammar, `stop=` and `max_tokens=` lexemes
        among them, and its errors are final). Past that draft the mask is never read: the
        draft is refused at its position, so the window's tokens end there. Those positions,
        rows without a constraint and padding keep every bit set.

        Also returns {row: window position} of the rows whose grammar failed while a mask was
        made (a parser limit: that mask allows EOS only, and the token drawn under it must
        end the request with "abort", Request.grammar_failed_at)."""
        from llguidance.numpy import fill_next_token_bitmask_par

        W = drafts.shape[1] + 1
        mask = np.full((num_rows, W, self.words), -1, np.int32)
        flat = mask.reshape(num_rows * W, self.words)  # [rows, W, words] -> [rows * W, words], a view
        failed: dict[int, int] = {}
        # (row, the matcher whose state is that of the row's position j), for rows still walking
        walking = [(i, row.req.matcher) for i, row in enumerate(rows) if row.req.matcher is not None
                   and not (row.req.matcher.is_stopped() or row.req.matcher.is_error())]
        for j in range(W):
            if not walking:
                break
            fill_next_token_bitmask_par(self.executor, [(m, i * W + j) for i, m in walking], flat)
            for i, m in walking:
                if m.is_error():
                    failed[i] = j
                    logger.warning("structured output of row %d failed at window position %d: %s", i, j,
                                   m.get_error())
            if j == W - 1:
                break
            going = []
            for i, m in walking:
                token = int(drafts[i, j])
                if j >= counts[i] or not (int(mask[i, j, token // 32]) >> (token % 32)) & 1:
                    continue  # no draft here, or the grammar refuses it: the window ends at j
                if j == 0:
                    m = m.deep_copy()  # the request's matcher stays where the request is
                # A draft that completes the grammar stops the walk: the request ends at that
                # token (Engine._check_token), so the positions after it are never read.
                if m.consume_token(token) and not (m.is_stopped() or m.is_error()):
                    going.append((i, m))
            walking = going
        return mask, failed

    @functools.cached_property
    def executor(self):
        from llguidance import LLExecutor

        return LLExecutor()


def mark_failures(rows, failed: dict[int, int]) -> None:
    """Set each constrained row's Request.grammar_failed_at from `Grammars.window_bitmask`'s
    failures ({row: window position}; None for the others): the step's tokens are the next
    its request sees, so the token drawn at that position is output number len + j + 1."""
    for i, row in enumerate(rows):
        req = row.req
        if req.matcher is not None:
            req.grammar_failed_at = len(req.output_ids) + failed[i] + 1 if i in failed else None


def advance(req) -> str | None:
    """Feed a constrained request's newest token to its matcher: "stop" once the grammar is
    complete, "abort" if the token broke it (it cannot, while the mask holds), else None."""
    matcher = req.matcher
    if not matcher.consume_token(req.output_ids[-1]) or matcher.is_error():  # is_stopped() holds in error too
        logger.warning("request %s: token %d is outside its structured output (%s); ending it",
                       req.request_id, req.output_ids[-1], matcher.get_error())
        return "abort"
    return "stop" if matcher.is_stopped() else None
