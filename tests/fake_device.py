"""A numpy stand-in for the device side of a step, to test the scheduler without JAX.

It keeps the relay lengths and req_to_token like the real step programs do, applies
reservations in the step's prologue, and records every slot a step writes, so tests can
check that each write lands in a page that the request owns at launch time.

Speculative mode (window > 1): a decode step writes the window's positions L .. L+W-1,
plus `lookahead` positions after it (the EAGLE head's state sits one slot ahead) and
`rewrite` positions before it (the draft model re-reads position L-1); the row gains a
random accept length in 1..W, which the step returns next to the [B, W] tokens.
"""
import numpy as np


class FakeDevice:
    def __init__(self, num_entries, table_width, page_size, vocab=50, seed=0, window=1, lookahead=0, rewrite=0):
        self.ps = page_size
        self.seq_lens = np.zeros(num_entries, np.int64)
        self.table = np.zeros((num_entries, table_width), np.int64)
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.window, self.lookahead, self.rewrite = window, lookahead, rewrite

    def _slot(self, e, p):
        return int(self.table[e, p]) if p < self.table.shape[1] else 0

    def run(self, batch):
        """Execute a ScheduledBatch; return (tokens, logprobs, writes) with writes a list of
        (request, position, slot); speculative decode steps also return accept lengths."""
        for entry, block, page in batch.reservations:
            self.table[entry, block * self.ps : (block + 1) * self.ps] = page * self.ps + np.arange(self.ps)
        if batch.kind == "decode" and self.window > 1:
            return self._run_speculative(batch)
        writes, tokens = [], []
        for row in batch.rows:
            e = row.req.entry
            if batch.kind == "prefill":
                positions = range(row.start, row.start + row.length)
                self.seq_lens[e] = row.start + row.length
            else:
                positions = [int(self.seq_lens[e])]
                self.seq_lens[e] += 1
            for p in positions:
                writes.append((row.req, p, self._slot(e, p)))
            tokens.append(int(self.rng.integers(1, self.vocab)))
        return np.array(tokens), np.zeros(len(tokens)), writes

    def _run_speculative(self, batch):
        W = self.window
        writes = []
        tokens = self.rng.integers(1, self.vocab, size=(len(batch.rows), W))
        accept = self.rng.integers(1, W + 1, size=len(batch.rows))
        for i, row in enumerate(batch.rows):
            e = row.req.entry
            L = int(self.seq_lens[e])
            for p in range(max(0, L - self.rewrite), L + W + self.lookahead):
                writes.append((row.req, p, self._slot(e, p)))
            self.seq_lens[e] = L + accept[i]
        return tokens, np.zeros(tokens.shape), writes, accept
