"""A numpy stand-in for the device side of a step, to test the scheduler without JAX.

It keeps the relay lengths and req_to_token like the real step programs do, applies
reservations in the step's prologue, and records every slot a step writes, so tests can
check that each write lands in a page that the request owns at launch time.
"""
import numpy as np


class FakeDevice:
    def __init__(self, num_entries, table_width, page_size, vocab=50, seed=0):
        self.ps = page_size
        self.seq_lens = np.zeros(num_entries, np.int64)
        self.table = np.zeros((num_entries, table_width), np.int64)
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab

    def run(self, batch):
        """Execute a ScheduledBatch; return (tokens, logprobs, writes) with writes a list of
        (request, position, slot)."""
        for entry, block, page in batch.reservations:
            self.table[entry, block * self.ps : (block + 1) * self.ps] = page * self.ps + np.arange(self.ps)
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
                slot = int(self.table[e, p]) if p < self.table.shape[1] else 0
                writes.append((row.req, p, slot))
            tokens.append(int(self.rng.integers(1, self.vocab)))
        return np.array(tokens), np.zeros(len(tokens)), writes
