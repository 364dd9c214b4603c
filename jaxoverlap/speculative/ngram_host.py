"""Host n-gram drafts for a batch, from one trie over all prompts and outputs. No JAX.

This drafter needs each request's newest tokens, i.e. the previous step's accepted tokens,
on the host before it can build the next step: the engine's overlap loop waits for the
in-flight step before launching such a batch (the article's section 8.3). That wait is
the cost that ngram_device.py removes.

The trie is shared by all requests, so a request's drafts depend on what the others had
produced by the time it looked up. Greedy output does not depend on drafts; sampled output
keeps the target's distribution, but its tokens are not reproducible across batchings or
loops the way they are with the other drafters (whose drafts depend on the request alone).
"""
from __future__ import annotations

import weakref

import numpy as np

from jaxoverlap.request import Request
from jaxoverlap.speculative.ngram_index import Cursor, NgramIndex


class HostNgramDrafter:
    def __init__(self, num_draft: int, min_match: int, max_match: int, capacity: int = 4_000_000,
                 refeed_tail: int = 256):
        self.num_draft = num_draft
        self.min_match = min_match
        self.max_match = max_match
        self.index = NgramIndex(max_match + num_draft, capacity)
        self.refeed_tail = refeed_tail  # tokens a request re-feeds after the trie starts over
        self._cursors: "weakref.WeakKeyDictionary[Request, Cursor]" = weakref.WeakKeyDictionary()

    def clear(self) -> None:
        """Forget every sequence (benchmarks compare runs of the same prompts from scratch)."""
        self.index = NgramIndex(self.index.max_depth, self.index.capacity)
        self._cursors = weakref.WeakKeyDictionary()

    def _cursor(self, req: Request) -> Cursor:
        cur = self._cursors.get(req)
        if cur is None or self.index.is_stale(cur):
            fresh = cur is None
            cur = self.index.cursor()
            # A request seen for the first time feeds its whole prompt; after a reset only its
            # recent tokens, so a reset does not cost a pass over every long context.
            cur.length = 0 if fresh else max(0, req.total_len - self.refeed_tail)
            self._cursors[req] = cur
        return cur

    def _feed(self, req: Request, cur: Cursor) -> None:
        n_prompt = len(req.prompt_ids)
        if cur.length < n_prompt:
            self.index.feed(cur, req.prompt_ids[cur.length :])
        start = cur.length - n_prompt
        if start < len(req.output_ids):
            self.index.feed(cur, req.output_ids[start:])

    def drafts(self, reqs: list[Request], rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Drafts [rows, k] int32 and counts [rows] int32 for the batch's requests (padded
        rows get none). Feeds every request's new tokens into the trie first."""
        self.index.maybe_reset()  # past capacity every cursor goes stale; _cursor re-creates them
        tokens = np.zeros((rows, self.num_draft), np.int32)
        counts = np.zeros((rows,), np.int32)
        for i, req in enumerate(reqs):
            cur = self._cursor(req)
            self._feed(req, cur)
            found = self.index.lookup(cur, self.min_match, self.max_match, self.num_draft)
            tokens[i, : len(found)] = found
            counts[i] = len(found)
        return tokens, counts
