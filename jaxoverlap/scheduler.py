"""The scheduler: which requests run next, their page reservations, and the bookkeeping of
results that are one step old. Pure Python (no JAX), so it is tested without a device.

Reservation rule (the article's section 5.2): when the host prepares step N+1, step N is
still in flight, so the device's length of a request can be one window ahead of the
host's count (`kv_committed`), and step N+1 writes one more window. Every running row is
therefore kept filled two windows beyond `kv_committed`, rounded up to whole pages, and
capped at the table width (positions past the table go to the dummy slot on the device).

Speculative steps (window = 1 + draft tokens): a row gains `accept_len` tokens (1..window)
per step, and the host learns it one step late. A drafter whose cache runs ahead of the
target's (the EAGLE head keeps its state for position p in the slot of p + 1) needs
`lookahead` more reserved positions; positions after a rejected draft are simply
overwritten by the next window.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from typing import Callable

import numpy as np

from jaxoverlap.buckets import PrefillShapes
from jaxoverlap.page_allocator import EntryAllocator, PageAllocator
from jaxoverlap.prefix_cache import PrefixCache
from jaxoverlap.request import Request, Status


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    max_running: int
    chunked_prefill_size: int
    max_prefill_requests: int  # requests one prefill step takes
    max_context_len: int  # a request's prompt + output never exceeds this
    table_width: int  # columns of req_to_token (max_context_len rounded up to pages)
    window: int = 1  # tokens a step can add to a request (1 + draft tokens when speculating)
    lookahead: int = 0  # positions past the window the drafter's cache writes (EAGLE head: 1)
    # Trailing positions of kv_committed whose drafter state may still be stale (the draft
    # model rewrites position seq_len - 1 at the start of each step): not prefix-cached.
    cache_lag: int = 0
    # Resume a retracted request from its last output token (see Request.resume_token)
    # rather than by sampling a new token after all of its output.
    resume_with_last_token: bool = False
    # Decode batches of more rows than this draft nothing (ScheduledBatch.draft); None: all
    # draft. Their reservations still cover a full window, so that any step can draft again.
    draft_max_rows: int | None = None
    # Positions reserved beyond the rule whenever a decode step must reserve pages anyway,
    # while free pages allow (never by evicting or retracting). Every row then gets its next
    # pages in the same step, and the next step that must send reservations to the device
    # comes at least this many tokens later, instead of rows crossing page boundaries on
    # different steps and nearly every step sending some. 0: reserve only what the rule needs.
    reserve_slack: int = 0
    # The prefill programs' shapes (the runner's), which plan each prefill batch: a bucket
    # T, and requests' chunks cut into rows of at most T tokens, within the chunk budget
    # (buckets.PrefillShapes.plan). None: one row per request, limited by tokens only.
    prefill_shapes: PrefillShapes | None = None


@dataclasses.dataclass
class BatchRow:
    req: Request
    epoch: int
    start: int = 0  # prefill: first position of the chunk
    length: int = 1  # prefill: tokens in the chunk
    is_last: bool = True  # prefill: the chunk ends the prompt (the sampled token counts)


@dataclasses.dataclass
class ScheduledBatch:
    kind: str  # "prefill" | "decode"
    rows: list[BatchRow]
    reservations: list[tuple[int, int, int]]  # (entry, page_index, page)
    ctx_len: int  # the highest position any row may read, plus one
    # Decode with a drafter: whether this step drafts and verifies (False: speculation is
    # paused for this batch size, and the step adds one token per row).
    draft: bool = False

    @property
    def size(self) -> int:
        return len(self.rows)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        pages: PageAllocator,
        entries: EntryAllocator,
        prefix_cache: PrefixCache,
        stop_checker: Callable[[Request], str | None] | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ):
        self.cfg = cfg
        self.pages = pages
        self.entries = entries
        self.prefix = prefix_cache
        # Returns a finish reason for a request whose newest token ends it, else None.
        self.stop_checker = stop_checker or (lambda req: None)
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Request] = deque()
        # Requests queued but not yet schedulable: their grammar is compiling (Engine.add_request).
        # `release` moves one to `waiting`. Status WAITING; they hold no pages and no entry.
        self.held: list[Request] = []
        self.prefilling: Request | None = None  # the one request whose prompt is mid-chunk
        # Changed only through _start_running / _stop_running, which drop the cached rows.
        self.running: list[Request] = []
        # The decode rows while `running` is unchanged: the same list object every step, so
        # the runner can keep what it built from them (runner._decode_rows).
        self._decode_rows: list[BatchRow] | None = None
        self._aborts: list[Request] = []  # admitted requests with an abort to apply
        self.finished_since_last_poll: list[Request] = []
        self.num_retractions = 0
        # Speculative decoding: tokens the device accepted (bonus included) over processed rows.
        self.num_accepted_tokens = 0
        self.num_verify_rows = 0
        self.num_paused_steps = 0  # decode steps that did not draft although a drafter is set

    # -- requests in and out ------------------------------------------------------------------
    def fits(self, prompt_len: int) -> bool:
        """Whether a prompt can ever be admitted: its pages must fit the whole cache."""
        return self._reserved_target(prompt_len) <= self.pages.capacity

    @property
    def row_headroom(self) -> int:
        """Positions a row keeps reserved past its tokens: two windows (the steps in flight
        and the next) and the drafter's lookahead. Part of what a prompt needs to be admitted."""
        return 2 * self.cfg.window + self.cfg.lookahead

    def add(self, req: Request, held: bool = False) -> None:
        """Queue a request; with `held`, not schedulable until `release`d."""
        # The token ids that end this request, looked up once per generated token.
        req.stop_ids = req.params.ending_token_ids(self.eos_token_ids)
        (self.held if held else self.waiting).append(req)

    def release(self, req: Request) -> None:
        """A held request may be scheduled: it queues behind the waiting ones."""
        self.held.remove(req)
        self.waiting.append(req)

    @property
    def num_queued(self) -> int:
        """Requests not yet admitted, held ones included."""
        return len(self.waiting) + len(self.held)

    def abort(self, req: Request) -> None:
        """Waiting and held requests end at once; admitted ones at the next schedule (their
        rows in the in-flight step, if any, are dropped when it is processed)."""
        if req.status is Status.WAITING:
            (self.held if req in self.held else self.waiting).remove(req)
            self._finish(req, "abort")
        elif not req.finished:
            req.abort_requested = True
            self._aborts.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.held)

    def has_schedulable_work(self) -> bool:
        """Work that a step can launch now (held requests wait for something else)."""
        return bool(self.waiting or self.prefilling or self.running)

    def poll_finished(self) -> list[Request]:
        out, self.finished_since_last_poll = self.finished_since_last_poll, []
        return out

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """The next batch, decided from results up to the last processed step."""
        self._apply_aborts()
        batch = self._schedule_prefill()
        if batch is None:
            batch = self._schedule_decode()
        return batch

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, []
        for req in aborts:  # admitted when asked (abort), and nothing retracts before this
            if not req.finished:
                self._finish(req, "abort")

    def _start_running(self, req: Request) -> None:
        self.running.append(req)
        self._decode_rows = None

    def _stop_running(self, req: Request) -> None:
        self.running.remove(req)
        self._decode_rows = None

    def _reserved_target(self, num_positions: int) -> int:
        """Pages a row needs so that positions [0, num_positions + 2 windows + lookahead) are reserved."""
        want = min(num_positions + self.row_headroom, self.cfg.table_width)
        return _cdiv(want, self.cfg.page_size)

    def _schedule_prefill(self) -> ScheduledBatch | None:
        first = self.prefilling
        if first is None and not self._can_admit():
            return None  # (every decode step comes here: nothing below runs without a prefill to plan)
        budget = self.cfg.chunked_prefill_size
        rows: list[BatchRow] = []
        reservations: list[tuple[int, int, int]] = []
        headroom = self._admission_headroom()
        if first is None:  # admit the first row's request before planning around it
            if not self._admit(self.waiting[0], reservations, headroom):
                return None
            first = self.waiting.popleft()
        self.prefilling = None
        max_rows, cap = self.cfg.max_prefill_requests, budget
        num_requests = 1
        if self.cfg.prefill_shapes is not None:
            T, max_rows = self.cfg.prefill_shapes.plan(self._pending_tokens(first, budget))
            cap = T - self.cfg.prefill_shapes.lead
        budget -= self._add_chunk(first, rows, budget, max_rows, cap)
        while (
            budget > 0
            and self.prefilling is None
            and len(rows) < max_rows
            and num_requests < self.cfg.max_prefill_requests
            # Rows whose prompt this batch completes are in `running` already; a row that
            # does not complete it is `prefilling`, which ends the loop.
            and self._can_admit()
        ):
            req = self.waiting[0]
            if not self._admit(req, reservations, headroom):
                break
            self.waiting.popleft()
            num_requests += 1
            budget -= self._add_chunk(req, rows, budget, max_rows, cap)
        ctx_len = max(r.start + r.length for r in rows)
        return ScheduledBatch("prefill", rows, reservations, ctx_len)

    def _admission_headroom(self) -> int:
        """Pages admission leaves free for the running requests' next top-up, so that it does
        not force an immediate retraction of what it admits: by then each row may have grown
        by two windows (the overlap loop processes two decode steps, the one in flight and the
        next, around this prefill). At least a page a row."""
        grown = self._row_targets(2 * self.cfg.window)
        return max(len(self.running), sum(max(0, t - len(r.pages)) for r, t in zip(self.running, grown)))

    def _can_admit(self) -> bool:
        return bool(self.waiting) and len(self.running) < self.cfg.max_running and self.entries.can_allocate()

    def _pending_tokens(self, first: Request, budget: int) -> list[int]:
        """Prompt tokens left to prefill of the requests the next prefill batch would take,
        in order, each capped at the budget: exact for `first` (admitted), estimated for the
        waiting ones behind it. With the prefix cache on, a waiting prompt's pages in common
        with the first or the one just ahead count as cached, as they will be once that
        one's prefill is scheduled (requests that arrive with one system prompt); pages
        cached before are not looked up, so the estimate is high for those."""
        pending = [min(len(first.fill_ids) - first.prefill_pos, budget)]
        ps, share = self.cfg.page_size, self.prefix.enabled
        ahead: list[list[int]] = [first.fill_ids] if share else []
        arrays: dict[int, np.ndarray] = {}  # index in `ahead` -> its first `budget` tokens, made once

        def head(i: int) -> np.ndarray:
            if i not in arrays:
                arrays[i] = np.asarray(ahead[i][:budget])
            return arrays[i]

        for req in itertools.islice(self.waiting, self.cfg.max_prefill_requests - 1):
            shared = 0
            if share:
                ids = req.fill_ids
                ahead.append(ids)
                # The first prompt and the one just ahead (a system prompt, n samples of one
                # prompt), where their first page is the same: most prompts differ there.
                same = [i for i in {0, len(ahead) - 2} if ahead[i][:ps] == ids[:ps]]
                if same:
                    mine = head(len(ahead) - 1)
                    shared = max(_common_prefix(mine, head(i)) for i in same) // ps * ps
            pending.append(max(1, min(len(req.fill_ids) - shared, budget)))
        return pending

    def _admit(self, req: Request, reservations: list, headroom: int) -> bool:
        ps = self.cfg.page_size
        # At least one token must be computed; a request that wants its prompt's logprobs
        # from position k on computes every position from k - 1 on (its state scores k);
        # one with penalties computes all, so that its prefill sees every token
        # (penalties.py keeps their history on the device).
        limit = len(req.fill_ids) - 1
        if req.params.prompt_logprobs:
            limit = min(limit, req.params.prompt_logprobs_start - 1)
        if req.params.has_penalties:
            limit = 0
        path = self.prefix.match(req.fill_ids[:limit])
        self.prefix.lock(path)
        need = self._reserved_target(len(req.fill_ids)) - len(path)
        short = need + headroom - self.pages.num_free
        if short > 0:
            self.pages.free(self.prefix.evict(short))
        if not self.pages.can_allocate(need + headroom):
            self.prefix.unlock(path)
            return False
        req.entry = self.entries.allocate()
        new_pages = self.pages.allocate(need)
        req.prefix_nodes = path
        req.pages = [n.page for n in path] + new_pages
        # The whole row is (re)written: the entry's previous owner left its slots there.
        reservations.extend((req.entry, i, p) for i, p in enumerate(req.pages))
        req.prefill_pos = req.admitted_at = len(path) * ps
        req.kv_committed = req.prefill_pos
        req.metrics.cached_prompt_tokens = max(req.metrics.cached_prompt_tokens, min(req.prefill_pos, len(req.prompt_ids)))
        req.status = Status.PREFILL
        return True

    def _add_chunk(self, req: Request, rows: list[BatchRow], budget: int, max_rows: int, cap: int) -> int:
        """Add the request's next chunk to the batch, as rows of at most `cap` tokens while
        rows are left (the last may be shorter): at most `budget` tokens. Returns its length."""
        n = min(len(req.fill_ids) - req.prefill_pos, budget, (max_rows - len(rows)) * cap)
        end = req.prefill_pos + n
        is_last = end == len(req.fill_ids)
        for start in range(req.prefill_pos, end, cap):
            length = min(cap, end - start)
            rows.append(BatchRow(req, req.epoch, start=start, length=length, is_last=is_last and start + length == end))
        req.prefill_pos += n
        req.kv_committed = req.prefill_pos  # the launched chunk will have written these
        self._share_prefilled_pages(req)
        if is_last:
            # Decodable at once: the next decode step reads the relay entry this prefill
            # writes, and the device runs the two in order.
            req.status = Status.RUNNING
            self._start_running(req)
        else:
            self.prefilling = req
        return n

    def _share_prefilled_pages(self, req: Request) -> None:
        """Put the full pages that this request's prefill has written, once the chunk just
        scheduled has run, into the prefix cache now, locked for the request as if it had
        matched them. A request admitted later, even into the same prefill batch, then
        shares them instead of prefilling the same tokens again: n samples of one prompt, or
        many requests with one system prompt, that arrive together. Safe under overlap
        because the device runs steps in launch order, and within a step each layer writes
        every row's K/V before any row attends. A page another request cached first for the
        same tokens stops the sharing there: this request keeps its own copy, and its pages
        after that one stay private (an unlocked page of ours in the tree could be evicted
        under it)."""
        if not self.prefix.enabled:
            return
        ps = self.cfg.page_size
        n_full = max(0, req.kv_committed - self.cfg.cache_lag) // ps
        have = len(req.prefix_nodes)
        if n_full <= have:
            return
        tokens = req.fill_ids[: n_full * ps]
        if len(self.prefix.match(tokens)) > have:
            return  # the node after our last shared page is another request's
        rejected = self.prefix.insert(tokens, req.pages[:n_full])
        assert not rejected, "pages past a request's shared prefix are its own"
        new = self.prefix.match(tokens)[have:]
        self.prefix.lock(new)
        req.prefix_nodes = req.prefix_nodes + new

    def _schedule_decode(self) -> ScheduledBatch | None:
        if not self.running:
            return None
        targets = self._top_up_or_retract()
        if not self.running:
            return None
        reservations: list[tuple[int, int, int]] = []
        if self.cfg.reserve_slack and any(t > len(r.pages) for r, t in zip(self.running, targets)):
            targets = self._with_slack(targets)
        most_pages = 0
        for req, target in zip(self.running, targets):
            have = len(req.pages)
            if target > have:
                new = self.pages.allocate(target - have)
                reservations.extend((req.entry, have + i, p) for i, p in enumerate(new))
                req.pages.extend(new)
                have = target
            most_pages = max(most_pages, have)
        if self._decode_rows is None:
            self._decode_rows = [BatchRow(req, req.epoch) for req in self.running]
        rows = self._decode_rows
        ctx_len = min(most_pages * self.cfg.page_size, self.cfg.table_width)
        limit = self.cfg.draft_max_rows
        draft = self.cfg.window > 1 and (limit is None or len(rows) <= limit)
        self.num_paused_steps += self.cfg.window > 1 and not draft
        return ScheduledBatch("decode", rows, reservations, ctx_len, draft=draft)

    def _row_targets(self, slack: int = 0) -> list[int]:
        """_reserved_target of every running row's kv_committed (+ `slack` positions),
        inlined: this runs for every row on every decode step."""
        extra = 2 * self.cfg.window + self.cfg.lookahead + slack
        width, ps = self.cfg.table_width, self.cfg.page_size
        return [-(-min(r.kv_committed + extra, width) // ps) for r in self.running]

    def _with_slack(self, targets: list[int]) -> list[int]:
        """The page targets of a top-up round: `reserve_slack` more positions for every row,
        if the free pages hold them; else the rule's own targets."""
        wide = self._row_targets(self.cfg.reserve_slack)
        need = sum(w - len(r.pages) for r, w in zip(self.running, wide) if w > len(r.pages))
        return wide if need <= self.pages.num_free else targets

    def _top_up_or_retract(self) -> list[int]:
        """Make sure every running row can be topped up: evict cached prefixes first, then
        retract the requests with the fewest generated tokens. Returns the rows' page
        targets (_row_targets) for the requests still running."""

        def shortfall(targets) -> int:
            need = sum(max(0, t - len(r.pages)) for r, t in zip(self.running, targets))
            return need - self.pages.num_free

        targets = self._row_targets()
        short = shortfall(targets)
        if short > 0:
            self.pages.free(self.prefix.evict(short))
            short = shortfall(targets)
        while short > 0 and self.running:
            if len(self.running) == 1:
                # Even alone it does not fit: the cache is smaller than this request's context.
                self._finish(self.running[0], "length")
                break
            victim = min(self.running, key=lambda r: (len(r.output_ids), -r.arrival_time))
            self._retract(victim)
            targets = self._row_targets()
            short = shortfall(targets)
            if short > 0:  # the victim's shared prompt pages went to the cache, not to the free pages
                self.pages.free(self.prefix.evict(short))
                short = shortfall(targets)
        return targets

    def _retract(self, req: Request) -> None:
        self._stop_running(req)
        self._release(req, cache=False)
        req.status = Status.WAITING
        req.epoch += 1
        # Resume by prefilling everything so far; the output is kept.
        req.fill_ids = req.prompt_ids + req.output_ids
        req.resume_token = None
        if self.cfg.resume_with_last_token and req.output_ids:
            # The last token has no K/V yet: it is the next step's input, as before.
            req.fill_ids = req.fill_ids[:-1]
            req.resume_token = req.output_ids[-1]
        req.prefill_pos = 0
        req.kv_committed = 0
        req.metrics.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    # -- results ------------------------------------------------------------------------------
    def process(self, batch: ScheduledBatch, tokens, logprobs, accept_lens=None, prompt_logprobs=None,
                top_logprobs=None) -> list[Request]:
        """Bookkeeping for a step whose small outputs have reached the host.

        Plain steps: tokens, logprobs have one value per row (padded rows are ignored).
        Speculative decode steps: tokens, logprobs are [rows, window] and accept_lens [rows]
        says how many of each row's tokens the device accepted (bonus included). A stop
        condition met mid-window ends the request there; the rest of its window is
        dropped. Rows of requests that finished or were retracted after the launch are
        dropped: that is the one extra step a late-detected finish costs.

        Prefill steps in which a row asked for its prompt's logprobs also hand over
        `prompt_logprobs`: ([R, Q] logprobs, [R, Q] argmax flags) of the token after each
        position of each row's chunk. Steps in which a row asked for top logprobs hand over
        `top_logprobs`: ([R, K] token ids, [R, K] logprobs), most likely first, or for
        speculative decode steps [R, W, K] each (every window position).
        """
        if prompt_logprobs is not None:
            self._record_prompt_logprobs(batch, *prompt_logprobs)
        now = time.perf_counter()
        updated: list[Request] = []
        # Python ints and floats, converted once per array rather than once per element.
        tokens, logprobs = np.asarray(tokens).tolist(), np.asarray(logprobs).tolist()
        top = None if top_logprobs is None else (np.asarray(top_logprobs[0]).tolist(),
                                                 np.asarray(top_logprobs[1], np.float64).tolist())
        if batch.kind == "decode" and accept_lens is None:
            return self._process_plain(batch.rows, tokens, logprobs, top)
        accept_lens = None if accept_lens is None else np.asarray(accept_lens).tolist()
        for i, row in enumerate(batch.rows):
            req = row.req
            if row.epoch != req.epoch or req.status is not Status.RUNNING:  # finished, retracted
                continue
            if batch.kind == "prefill":
                if not row.is_last:
                    continue
                req.metrics.first_token_time = req.metrics.first_token_time or now
                if req.resume_token is not None:
                    req.resume_token = None  # the prefill used the token it already had
                    continue
                new = [(tokens[i], logprobs[i])]
            else:
                n = accept_lens[i]
                # The device's length grew by n whatever the host keeps: K/V of the input
                # token and of the n - 1 accepted drafts.
                req.kv_committed += n
                req.metrics.num_steps += 1
                req.metrics.decode_tokens += n
                if batch.draft:  # acceptance counts only steps that drafted
                    self.num_accepted_tokens += n
                    self.num_verify_rows += 1
                new = list(zip(tokens[i][:n], logprobs[i][:n]))
            reason = None
            row_top = None  # per new token: (K ids, K logprobs)
            if top is not None and req.output_top_logprobs is not None:
                row_top = [(top[0][i], top[1][i])] if batch.kind == "prefill" else list(zip(top[0][i], top[1][i]))
            for j, (tok, lp) in enumerate(new):
                req.output_ids.append(tok)
                req.output_logprobs.append(lp)
                if row_top is not None:
                    _record_top(req, row_top[j])
                reason = self._check_stop(req)
                if reason is not None:
                    break
            req.metrics.output_tokens = len(req.output_ids)
            updated.append(req)
            if reason is not None:
                self._finish(req, reason)
        return updated

    def _record_prompt_logprobs(self, batch: ScheduledBatch, logprobs, top1) -> None:
        for i, row in enumerate(batch.rows):
            req = row.req
            live = row.epoch == req.epoch and req.status in (Status.PREFILL, Status.RUNNING)
            if req.prompt_logprobs is None or not live:  # not scoring, or finished / retracted since
                continue
            # Column j scores the token at row.start + j + 1. Nothing is recorded before
            # prompt_logprobs_start, nor past the prompt (the sampled token, or output
            # re-prefilled after a retraction).
            skip = max(0, req.params.prompt_logprobs_start - 1 - row.start)
            end = min(row.length, len(req.prompt_ids) - 1 - row.start)
            if end <= skip:
                continue
            first = row.start + 1 + skip
            req.prompt_logprobs[first : first + end - skip] = np.asarray(logprobs[i, skip:end], np.float64).tolist()
            req.prompt_top1[first : first + end - skip] = np.asarray(top1[i, skip:end], bool).tolist()

    def _process_plain(self, rows: list[BatchRow], tokens: list, logprobs: list, top=None) -> list[Request]:
        """`process` for a plain decode step: one token per row. The same bookkeeping as
        the general loop, written out for the one case that runs on every step of every row."""
        updated: list[Request] = []
        running = Status.RUNNING
        for i, (row, tok, lp) in enumerate(zip(rows, tokens, logprobs)):  # padded rows have no BatchRow: zip stops
            req = row.req
            if row.epoch != req.epoch or req.status is not running:  # finished, retracted
                continue
            req.kv_committed += 1  # the step wrote the K/V of its input token
            metrics = req.metrics
            metrics.num_steps += 1
            metrics.decode_tokens += 1
            if top is not None and req.output_top_logprobs is not None:
                _record_top(req, (top[0][i], top[1][i]))
            req.output_ids.append(tok)
            req.output_logprobs.append(lp)
            metrics.output_tokens = len(req.output_ids)
            updated.append(req)
            reason = self._check_stop(req)
            if reason is not None:
                self._finish(req, reason)
        return updated

    def _check_stop(self, req: Request) -> str | None:
        if req.matcher is not None and (req.matcher.is_error() or req.grammar_failed_at == len(req.output_ids)):
            # Its structured output failed while the token's mask was made (a parser limit; with
            # a drafter, maybe on the walk's copy of the matcher, Request.grammar_failed_at):
            # the mask allowed EOS only, which must not read as a completed output.
            return "abort"
        if req.output_ids[-1] in req.stop_ids:
            return "stop"
        reason = self.stop_checker(req)
        if reason is not None:
            return reason
        n = len(req.output_ids)
        if n >= req.params.max_new_tokens or n + len(req.prompt_ids) >= self.cfg.max_context_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        if req.status is Status.RUNNING:
            self._stop_running(req)
        if self.prefilling is req:
            self.prefilling = None
        if req.status in (Status.PREFILL, Status.RUNNING):
            self._release(req, cache=True)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.metrics.finish_time = time.perf_counter()
        self.finished_since_last_poll.append(req)

    def _release(self, req: Request, cache: bool) -> None:
        """Give back the request's entry and pages at once. A step still in flight may write
        into them; the device runs it before any later step that reuses them."""
        ps = self.cfg.page_size
        to_free = req.pages[len(req.prefix_nodes):]
        if cache and self.prefix.enabled:
            n_full = max(0, min(req.kv_committed - self.cfg.cache_lag, len(req.all_ids))) // ps
            rejected = self.prefix.insert(req.all_ids[: n_full * ps], req.pages[:n_full])
            # Pages that stay: the ones the cache took, and the matched prefix it already had.
            keep = (set(req.pages[:n_full]) - set(rejected)) | {n.page for n in req.prefix_nodes}
            to_free = [p for p in req.pages if p not in keep]
        self.pages.free(to_free)
        self.prefix.unlock(req.prefix_nodes)
        self.entries.free(req.entry)
        req.entry, req.pages, req.prefix_nodes = 0, [], []

    # -- checks -------------------------------------------------------------------------------
    def held_pages(self) -> list[int]:
        held = list(self.prefix.pages())
        cached = set(held)
        for req in self._admitted():
            held.extend(p for p in req.pages if p not in cached)
        return held

    def _admitted(self) -> list[Request]:
        return self.running + ([self.prefilling] if self.prefilling is not None else [])

    def check_integrity(self) -> None:
        self.prefix.check_integrity()
        for req in self._admitted():
            assert [n.page for n in req.prefix_nodes] == req.pages[: len(req.prefix_nodes)]
        self.pages.check_integrity(self.held_pages())
        self.entries.check_integrity([r.entry for r in self._admitted()])


def _record_top(req: Request, top: tuple[list, list]) -> None:
    """One output token's most likely tokens (K ids, K logprobs), as many as it asked for."""
    k = req.params.top_logprobs
    req.output_top_logprobs.append(list(zip(top[0][:k], top[1][:k])))
