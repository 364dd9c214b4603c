"""A numpy stand-in for the device side of a step, to test the scheduler without JAX.

It keeps the relay lengths and req_to_token like the real step programs do, applies
reservations in the step's prologue, and records every slot a step writes, so tests can
check that each write lands in a page that the request owns at launch time.

Speculative mode (window > 1): a decode step writes the window's positions L .. L+W-1,
plus `lookahead` positions after it (the EAGLE head's state sits one slot ahead) and
`rewrite` positions before it (the draft model re-reads position L-1); the row gains a
random accept length in 1..W, which the step returns next to the [B, W] tokens. A batch
that does not draft (ScheduledBatch.draft False: speculation paused) runs a window of one.
"""
import numpy as np

from jaxoverlap.request import Request
from jaxoverlap.sampling_params import SamplingParams


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
        W = self.window if batch.draft else 1
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


# -- the host-side loop around the fake device, shared by the scheduler tests --------------------

def cached_nodes(prefix) -> dict:
    """{page: radix node} of every page in the prefix cache."""
    out, stack = {}, list(prefix._root.children.values())
    while stack:
        n = stack.pop()
        out[n.page] = n
        stack.extend(n.children.values())
    return out


def check_writes(sched, writes, cached_before=None):
    """Every slot a step writes is in a page its request owns and no other request reads:
    never a page whose cached content was there before the step was scheduled (the same
    radix node before and after; an evicted page may be given out and filled again), and a
    page that the step's scheduling put into the cache (a prefill's pages are shared at
    once) only by the one request that fills it. `cached_before`: cached_nodes() before
    `schedule()` (default: now)."""
    cached = cached_nodes(sched.prefix)
    cached_before = cached if cached_before is None else cached_before
    fillers = {}
    for r, pos, slot in writes:
        if pos >= sched.cfg.table_width:
            assert slot == 0
            continue
        page = slot // sched.cfg.page_size
        assert page in r.pages, f"{r.request_id} wrote position {pos} into page {page}, outside its reserved row"
        node = cached.get(page)
        assert node is None or cached_before.get(page) is not node, \
            f"{r.request_id} wrote position {pos} into a shared cached page"
        if node is not None:
            filler = fillers.setdefault(page, r.request_id)
            assert filler == r.request_id, f"{r.request_id} wrote into page {page}, shared by {filler} this step"


def drive(sched, dev, arrivals, overlap=True, max_steps=5000):
    """Run the overlap (or normal) loop over the fake device until it drains.

    arrivals: {loop_iteration: [Request, ...]}. Returns the finished requests."""
    inflight, done, step = None, [], 0
    while step < max_steps and (sched.has_work() or inflight is not None or any(k >= step for k in arrivals)):
        for r in arrivals.get(step, []):
            sched.add(r)
        cached_before = cached_nodes(sched.prefix)
        batch = sched.schedule()
        launched = None
        if batch is not None:
            out = dev.run(batch)
            check_writes(sched, out[2], cached_before)
            accept = out[3] if len(out) == 4 else None
            launched = (batch, out[0], out[1], accept)
        prev, inflight = (inflight, launched) if overlap else (launched, None)
        if prev is not None:
            sched.process(*prev)
        done.extend(sched.poll_finished())
        sched.check_integrity()
        step += 1
    assert not sched.has_work(), "did not drain"
    return done


def make_request(i, n_prompt, n_new, prefix=(), **params):
    prompt = list(prefix) + [(i * 7 + j) % 45 + 1 for j in range(n_prompt)]
    return Request(f"r{i}", prompt, SamplingParams(max_new_tokens=n_new, temperature=0.0, **params), seed=i)
