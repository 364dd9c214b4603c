"""Host-side speculative bookkeeping without JAX: reservations with random accept lengths,
stops inside a window, the n-gram trie, and the engine options."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fake_device import FakeDevice, drive
from fake_device import make_request as req
from jaxoverlap.config import EngineConfig
from jaxoverlap.page_allocator import EntryAllocator, PageAllocator
from jaxoverlap.prefix_cache import PrefixCache
from jaxoverlap.request import Request, Status
from jaxoverlap.sampling_params import SamplingParams
from jaxoverlap.scheduler import Scheduler, SchedulerConfig
from jaxoverlap.speculative.ngram_host import HostNgramDrafter
from jaxoverlap.speculative.ngram_index import NgramIndex


def make(num_pages, page_size=4, window=4, lookahead=0, rewrite=0, max_running=4, max_context=64, prefix=True,
         stop_ids=(), draft_max_rows=None, slack=0):
    width = -(-max_context // page_size) * page_size
    cfg = SchedulerConfig(page_size=page_size, max_running=max_running, chunked_prefill_size=15,
                          max_prefill_requests=4, max_context_len=max_context, table_width=width, window=window,
                          lookahead=lookahead, cache_lag=rewrite, resume_with_last_token=True,
                          draft_max_rows=draft_max_rows, reserve_slack=slack)
    sched = Scheduler(cfg, PageAllocator(num_pages, page_size), EntryAllocator(max_running),
                      PrefixCache(page_size, prefix), eos_token_ids=frozenset(stop_ids))
    dev = FakeDevice(max_running + 1, width, page_size, window=window, lookahead=lookahead, rewrite=rewrite)
    return sched, dev


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30), st.integers(0, 6)), min_size=1, max_size=8),
    num_pages=st.integers(20, 60),
    page_size=st.sampled_from([1, 2, 4, 8]),
    window=st.integers(2, 5),
    drafter=st.sampled_from(["eagle", "draft_model", "ngram"]),
    overlap=st.booleans(),
    prefix=st.booleans(),
    seed=st.integers(0, 1000),
    draft_max_rows=st.one_of(st.none(), st.integers(1, 4)),
    slack=st.sampled_from([0, 5]),
)
def test_property_speculative_reservations_cover_every_write(lens, num_pages, page_size, window, drafter, overlap,
                                                             prefix, seed, draft_max_rows, slack):
    """Random prompts, outputs, arrivals, cache sizes and accept lengths 1..window, with
    speculation paused above a random batch size: no step writes a slot outside its
    request's reserved row, everything completes, nothing leaks."""
    lookahead, rewrite = {"eagle": (1, 0), "draft_model": (0, 1), "ngram": (0, 0)}[drafter]
    sched, dev = make(num_pages, page_size, window, lookahead, rewrite, prefix=prefix, draft_max_rows=draft_max_rows,
                      slack=slack)
    dev.rng = np.random.default_rng(seed)
    arrivals, reqs = {}, []
    for i, (n_prompt, n_new, at) in enumerate(lens):
        r = req(i, min(n_prompt, 60), n_new, prefix=[3] * 8 if i % 2 else ())
        r.prompt_ids = r.prompt_ids[:60]
        r.fill_ids = list(r.prompt_ids)
        if not sched.fits(len(r.prompt_ids)):
            continue  # the engine rejects these at add_request
        reqs.append(r)
        arrivals.setdefault(at, []).append(r)
    done = drive(sched, dev, arrivals, overlap=overlap)
    assert len(done) == len(reqs)
    for r in reqs:
        assert r.finish_reason == "length"
        full = len(r.output_ids) == min(r.params.max_new_tokens, 64 - len(r.prompt_ids))
        out_of_cache = sched._reserved_target(r.total_len) > sched.pages.capacity
        assert full or out_of_cache
    assert sched.pages.num_free + sched.prefix.num_pages == sched.pages.capacity
    assert sched.entries.num_free == 4


def _admit_and_prefill(sched, dev, r):
    sched.add(r)
    batch = sched.schedule()
    tokens, lps, _ = dev.run(batch)
    sched.process(batch, tokens, lps)
    assert r.status is Status.RUNNING
    return len(r.output_ids)


def test_stop_token_inside_a_window_truncates_there():
    sched, dev = make(64, window=4, stop_ids=(7,))
    r = req(0, 5, 50)
    _admit_and_prefill(sched, dev, r)
    before_out, before_kv = list(r.output_ids), r.kv_committed
    batch = sched.schedule()
    dev.run(batch)
    sched.process(batch, np.array([[5, 7, 9, 11]]), np.zeros((1, 4)), np.array([4]))
    assert r.output_ids == before_out + [5, 7] and r.finish_reason == "stop"
    assert r.metrics.num_steps == 1
    # The device's length grew by the whole accept length; only full pages of the kept
    # tokens (5 prompt + 3 output = 8, two pages) enter the prefix cache.
    assert r.kv_committed == before_kv + 4 and sched.prefix.num_pages == 2
    sched.check_integrity()
    assert sched.pages.num_free + sched.prefix.num_pages == sched.pages.capacity


def test_max_new_tokens_inside_a_window_and_late_rows_dropped():
    sched, dev = make(64, window=4)
    r = req(0, 5, 3)  # prefill gives 1 token; the step may add at most 2
    _admit_and_prefill(sched, dev, r)
    b1 = sched.schedule()
    dev.run(b1)
    b2 = sched.schedule()  # overlap: launched before b1 is processed
    dev.run(b2)
    sched.process(b1, np.array([[5, 6, 8, 9]]), np.zeros((1, 4)), np.array([4]))
    assert len(r.output_ids) == 3 and r.output_ids[1:] == [5, 6] and r.finish_reason == "length"
    sched.process(b2, np.array([[1, 2, 3, 4]]), np.zeros((1, 4)), np.array([4]))  # one step late: dropped
    assert len(r.output_ids) == 3
    assert sched.num_accepted_tokens == 4 and sched.num_verify_rows == 1


def test_batches_above_the_draft_limit_do_not_draft_and_do_not_count_as_verified():
    sched, dev = make(64, window=4, draft_max_rows=1)
    a, b = req(0, 5, 50), req(1, 6, 2)  # b: one token from prefill, one from the next step
    _admit_and_prefill(sched, dev, a)
    one = sched.schedule()
    assert one.kind == "decode" and one.draft  # one row: at the limit, drafts
    dev.run(one)
    sched.process(one, np.array([[5, 6, 8, 9]]), np.zeros((1, 4)), np.array([3]))
    _admit_and_prefill(sched, dev, b)
    two = sched.schedule()
    assert two.size == 2 and not two.draft  # above the limit: paused
    dev.run(two)
    sched.process(two, np.array([[4], [2]]), np.zeros((2, 1)), np.array([1, 1]))
    assert a.output_ids[-4:] == [5, 6, 8, 4] and b.output_ids[-1] == 2
    # Acceptance counts the drafting step only; the paused one is counted apart.
    assert (sched.num_accepted_tokens, sched.num_verify_rows, sched.num_paused_steps) == (3, 1, 1)
    assert b.finish_reason == "length"  # one row again: drafting resumes
    assert sched.schedule().draft


def test_plain_decoding_never_drafts():
    sched, dev = make(64, window=1, draft_max_rows=None)
    _admit_and_prefill(sched, dev, req(0, 5, 5))
    batch = sched.schedule()
    assert batch.kind == "decode" and not batch.draft and sched.num_paused_steps == 0


def test_retracted_request_resumes_from_its_last_token():
    """A speculative engine re-prefills all but the last output token and keeps that token
    as the next input, so the request continues exactly where it was."""
    sched, dev = make(64, window=4)
    r = req(0, 5, 50)
    _admit_and_prefill(sched, dev, r)
    batch = sched.schedule()
    dev.run(batch)
    sched.process(batch, np.array([[5, 6, 8, 9]]), np.zeros((1, 4)), np.array([3]))
    out = list(r.output_ids)
    sched._retract(r)
    assert r.fill_ids == r.prompt_ids + out[:-1] and r.resume_token == out[-1]
    batch = sched.schedule()
    assert batch.kind == "prefill" and batch.rows[0].is_last
    tokens, lps, _ = dev.run(batch)
    sched.process(batch, tokens, lps)
    assert r.output_ids == out and r.resume_token is None  # no new token from the re-prefill
    assert r.kv_committed == len(r.prompt_ids) + len(out) - 1  # the last token is the next input
    sched.check_integrity()


def test_reservation_keeps_two_windows_plus_lookahead():
    for window, lookahead in ((4, 0), (4, 1), (2, 1)):
        sched, dev = make(64, page_size=4, window=window, lookahead=lookahead)
        r = req(0, 9, 50)
        _admit_and_prefill(sched, dev, r)
        for _ in range(5):
            batch = sched.schedule()
            out = dev.run(batch)
            assert len(r.pages) * 4 >= r.kv_committed + 2 * window + lookahead
            sched.process(batch, out[0], out[1], out[3])


# -- the host n-gram trie -------------------------------------------------------------------


def test_ngram_index_prefers_longest_match_then_most_frequent():
    idx = NgramIndex(max_depth=6)
    a = idx.cursor()
    idx.feed(a, [1, 2, 3, 4, 5, 9, 2, 3, 7, 2, 3, 7])
    b = idx.cursor()
    idx.feed(b, [8, 1, 2, 3])
    # "1 2 3" occurred once, followed by "4 5 9"; the 2-gram "2 3" is more often followed by 7.
    assert idx.lookup(b, 1, 3, 3) == [4, 5, 9]
    assert idx.lookup(b, 1, 2, 3) == [7, 2, 3]
    c = idx.cursor()
    idx.feed(c, [42])
    assert idx.lookup(c, 1, 3, 3) == []  # never seen before: no draft


def test_ngram_index_incremental_feed_equals_one_shot():
    seq = [int(x) for x in np.random.default_rng(0).integers(0, 5, 200)]
    one, inc = NgramIndex(5), NgramIndex(5)
    ca, cb = one.cursor(), inc.cursor()
    one.feed(ca, seq)
    for i in range(0, 200, 7):
        inc.feed(cb, seq[i : i + 7])
    assert one.num_nodes == inc.num_nodes
    assert one.lookup(ca, 1, 3, 2) == inc.lookup(cb, 1, 3, 2)


def test_host_drafter_shares_text_across_requests_and_survives_reset():
    drafter = HostNgramDrafter(num_draft=3, min_match=1, max_match=3, capacity=60, refeed_tail=8)
    a = Request("a", [10, 11, 12, 13, 14, 15], SamplingParams(), seed=0)
    tokens, counts = drafter.drafts([a], rows=2)
    assert counts.tolist() == [0, 0]
    b = Request("b", [99, 11, 12], SamplingParams(), seed=0)
    tokens, counts = drafter.drafts([a, b], rows=2)
    assert counts.tolist() == [0, 3] and tokens[1].tolist() == [13, 14, 15]
    b.output_ids += [13, 14]
    tokens, counts = drafter.drafts([b], rows=1)
    assert tokens[0].tolist() == [15, 0, 0] and counts[0] == 1
    for i in range(40):  # past capacity: the trie starts over and cursors re-feed their tails
        b.output_ids.append(20 + i % 5)
        drafter.drafts([b], rows=1)
    assert drafter.index.generation > 1
    tokens, counts = drafter.drafts([b], rows=1)
    assert counts[0] > 0  # the recent periodic tail is found again


# -- options --------------------------------------------------------------------------------


def test_speculative_options_are_checked():
    cfg = EngineConfig(speculative_algorithm="EAGLE")
    assert cfg.speculative_algorithm == "eagle"
    assert (cfg.speculative_num_steps, cfg.speculative_num_draft_tokens) == (3, 4)
    assert EngineConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=6).speculative_num_steps == 5
    with pytest.raises(ValueError, match="chain drafting"):
        EngineConfig(speculative_algorithm="eagle", speculative_eagle_topk=4)
    with pytest.raises(ValueError, match="num_steps \\+ 1"):
        EngineConfig(speculative_algorithm="eagle", speculative_num_steps=3, speculative_num_draft_tokens=8)
    with pytest.raises(ValueError, match="speculative_algorithm must be"):
        EngineConfig(speculative_algorithm="medusa")
    with pytest.raises(ValueError, match="min_match"):
        EngineConfig(speculative_algorithm="ngram", speculative_ngram_min_match_window_size=5,
                     speculative_ngram_max_match_window_size=2)
    assert EngineConfig().speculative_algorithm is None
