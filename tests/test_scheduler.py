"""The scheduler and its reservation arithmetic, driven by a numpy fake device (no JAX)."""
from hypothesis import given, settings, strategies as st

from fake_device import FakeDevice, check_writes, drive
from fake_device import make_request as req
from jaxoverlap.page_allocator import EntryAllocator, PageAllocator
from jaxoverlap.prefix_cache import PrefixCache
from jaxoverlap.request import Status
from jaxoverlap.scheduler import Scheduler, SchedulerConfig


def make_scheduler(num_pages, page_size=4, max_running=4, chunk=16, max_context=64, prefix=True, slack=0):
    width = -(-max_context // page_size) * page_size
    cfg = SchedulerConfig(page_size=page_size, max_running=max_running, chunked_prefill_size=chunk,
                          max_prefill_requests=4, max_context_len=max_context, table_width=width, reserve_slack=slack)
    s = Scheduler(cfg, PageAllocator(num_pages, page_size), EntryAllocator(max_running), PrefixCache(page_size, prefix))
    return s, FakeDevice(max_running + 1, width, page_size)


def test_plain_workload_drains_and_frees_everything():
    sched, dev = make_scheduler(num_pages=64)
    reqs = [req(i, 5 + 3 * i, 10) for i in range(6)]
    done = drive(sched, dev, {0: reqs[:3], 4: reqs[3:]})
    assert sorted(r.request_id for r in done) == sorted(r.request_id for r in reqs)
    assert all(len(r.output_ids) == 10 and r.finish_reason == "length" for r in done)
    assert sched.entries.num_free == 4
    assert sched.pages.num_free + sched.prefix.num_pages == sched.pages.capacity


def test_prefix_cache_reuse_counts_cached_tokens():
    sched, dev = make_scheduler(num_pages=64)
    shared = list(range(1, 17))  # 4 full pages
    first = req(0, 3, 4, prefix=shared)
    drive(sched, dev, {0: [first]})
    second = req(1, 3, 4, prefix=shared)
    drive(sched, dev, {0: [second]})
    assert second.metrics.cached_prompt_tokens == 16


def test_memory_pressure_retracts_fewest_generated_first_and_resumes():
    # 12 pages of 4 tokens for 4 requests that each grow to ~40 tokens: retraction is forced.
    sched, dev = make_scheduler(num_pages=13, max_context=64, prefix=False)
    reqs = [req(i, 6, 30) for i in range(4)]
    done = drive(sched, dev, {0: reqs})
    assert sched.num_retractions > 0
    assert all(len(r.output_ids) == 30 for r in done)
    assert any(r.metrics.num_retractions for r in reqs)


def test_finish_found_one_step_late_drops_extra_tokens():
    sched, dev = make_scheduler(num_pages=64)
    r = req(0, 4, 3)
    done = drive(sched, dev, {0: [r]}, overlap=True)
    # The overlap loop launched a step beyond the finishing one; its token was dropped.
    assert done == [r] and len(r.output_ids) == 3


def test_abort_of_waiting_and_running():
    sched, dev = make_scheduler(num_pages=64, max_running=1)
    a, b = req(0, 4, 50), req(1, 4, 50)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    sched.process(batch, *dev.run(batch)[:2])
    assert a.status is Status.RUNNING and b.status is Status.WAITING
    sched.abort(b)
    assert b.finish_reason == "abort"
    sched.abort(a)
    assert sched.schedule() is None
    assert a.finish_reason == "abort"
    sched.check_integrity()
    assert sched.pages.num_free + sched.prefix.num_pages == sched.pages.capacity


def test_admission_leaves_room_for_two_decode_steps_of_growth():
    """The overlap loop processes two decode steps (the one in flight and the next) between
    admitting a request and the next top-up: every running row may have grown by two windows.
    Admission keeps that many pages free, so the request it admits is not retracted right
    after its prefill, before it produced a token (its prefill wasted). With one-token
    pages, two steps of growth are two pages a row."""
    for num_pages in range(41, 81):
        sched, dev = make_scheduler(num_pages=num_pages, page_size=1, chunk=64, max_context=128, prefix=False)
        wasted = []
        retract = sched._retract
        sched._retract = lambda r: (wasted.append(r.request_id) if not r.output_ids else None, retract(r))
        done = drive(sched, dev, {0: [req(0, 8, 60), req(1, 8, 60)], 10: [req(2, 20, 10)]})
        assert sorted(r.request_id for r in done) == ["r0", "r1", "r2"]
        assert not wasted, f"{num_pages} pages: {wasted} retracted before its first token"


@settings(max_examples=30, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30), st.integers(0, 6)), min_size=1, max_size=8),
    num_pages=st.integers(16, 60),
    page_size=st.sampled_from([1, 2, 4, 8]),
    overlap=st.booleans(),
    prefix=st.booleans(),
    slack=st.sampled_from([0, 3, 8]),
)
def test_property_reservations_cover_every_write(lens, num_pages, page_size, overlap, prefix, slack):
    """Random prompts, outputs, arrival times, cache sizes and reservation slack: no step
    writes outside the request's reserved pages, every request completes, nothing leaks."""
    sched, dev = make_scheduler(num_pages=num_pages, page_size=page_size, max_context=64, prefix=prefix, slack=slack)
    shared = [3] * 8
    arrivals = {}
    reqs = []
    for i, (n_prompt, n_new, at) in enumerate(lens):
        n_prompt = min(n_prompt, 63 - 1)
        r = req(i, n_prompt, n_new, prefix=shared if i % 2 else ())
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
        # Alone and still too big for the whole cache: it ends early with "length".
        out_of_cache = sched._reserved_target(r.total_len) > sched.pages.capacity
        assert full or out_of_cache
    assert sched.pages.num_free + sched.prefix.num_pages == sched.pages.capacity


def test_decode_rows_are_one_list_until_the_running_set_changes():
    """The runner keeps what it built from a decode batch's rows (its entries array) for as
    long as it gets the same list object, so the scheduler must hand out a new list
    whenever a request joins or leaves the running set."""
    sched, dev = make_scheduler(num_pages=64)
    a, b, c = req(0, 4, 3), req(1, 4, 20), req(2, 4, 20)
    for r in (a, b):
        sched.add(r)
    first = sched.schedule()  # prefill of a and b
    sched.process(first, *dev.run(first)[:2])
    d1 = sched.schedule()
    sched.process(d1, *dev.run(d1)[:2])
    d2 = sched.schedule()
    assert d1.kind == d2.kind == "decode" and d2.rows is d1.rows
    sched.process(d2, *dev.run(d2)[:2])  # a's third token: a finishes
    assert a.finish_reason == "length"
    d3 = sched.schedule()
    assert d3.rows is not d2.rows and [row.req for row in d3.rows] == [b]
    sched.process(d3, *dev.run(d3)[:2])
    sched.add(c)
    p = sched.schedule()  # c's prefill; c then joins the running set
    sched.process(p, *dev.run(p)[:2])
    d4 = sched.schedule()
    assert d4.rows is not d3.rows and [row.req for row in d4.rows] == [b, c]
    sched.abort(b)
    d5 = sched.schedule()
    assert d5.rows is not d4.rows and [row.req for row in d5.rows] == [c]


def _reserving_steps(slack, num_pages=200):
    """(share of decode steps that send reservations, retractions) for four rows whose
    prompts end at different offsets in their pages, so that without slack they cross page
    boundaries on different steps."""
    sched, dev = make_scheduler(num_pages=num_pages, page_size=4, max_context=128, prefix=False, slack=slack)
    reqs = [req(i, 5 + i, 60) for i in range(4)]
    for r in reqs:
        sched.add(r)
    decode = reserving = 0
    while sched.has_work():
        batch = sched.schedule()
        out = dev.run(batch)
        check_writes(sched, out[2])
        sched.process(batch, out[0], out[1])
        if batch.kind == "decode":
            decode += 1
            reserving += bool(batch.reservations)
    assert all(len(r.output_ids) == 60 for r in reqs)
    assert sched.pages.num_free == sched.pages.capacity
    return reserving / decode, sched.num_retractions


def test_reservation_slack_makes_rows_take_pages_together():
    # Without slack each row reserves a page every 4 tokens, each on its own step: nearly
    # every step sends some. With 8 positions of slack, a step that reserves gives every
    # row its next pages, and the next such step comes 8 or more steps later.
    assert _reserving_steps(0)[0] > 0.9
    assert _reserving_steps(8)[0] < 0.2


def test_reservation_slack_never_takes_pages_a_row_needs():
    # The rows grow to 64-67 positions, plus 2 reserved ahead: 18 pages of 4 each at most.
    # With just that many pages the slack fits only early on: no retraction, and more
    # steps reserve than with pages to spare.
    tight = 4 * 18 + 1  # + the dummy page
    assert _reserving_steps(0, num_pages=tight)[1] == 0
    share, retractions = _reserving_steps(8, num_pages=tight)
    assert retractions == 0
    assert share > _reserving_steps(8)[0]


def test_requests_arriving_together_share_a_prompt_prefilled_once():
    """n samples of one prompt, or requests with one system prompt, that arrive together:
    the first request's prefill puts its full pages into the prefix cache as it is
    scheduled, so the others (in the same prefill batch and after it) prefill only their own
    tail, and everything still drains and frees."""
    sched, dev = make_scheduler(num_pages=64, page_size=4, chunk=48)
    prompt = list(range(1, 21))  # 5 full pages
    samples = [req(i, 0, 3, prefix=prompt) for i in range(4)]
    for r in samples:
        sched.add(r)
    batch = sched.schedule()
    # The match keeps one token to compute: 4 of the 5 pages are shared.
    assert [(row.req.request_id, row.start, row.length) for row in batch.rows] == \
        [("r0", 0, 20), ("r1", 16, 4), ("r2", 16, 4), ("r3", 16, 4)]
    assert [r.metrics.cached_prompt_tokens for r in samples] == [0, 16, 16, 16]
    assert all(r.pages[:4] == samples[0].pages[:4] for r in samples)
    dev.run(batch)
    sched.check_integrity()

    # A long system prompt in chunks, requests arriving while it is prefilled.
    sched, dev = make_scheduler(num_pages=64, page_size=4, chunk=16, max_context=128)
    system = list(range(1, 41))  # 10 pages, three chunks
    users = [req(10 + i, 5, 4, prefix=system) for i in range(3)]
    done = drive(sched, dev, {0: users[:1], 1: users[1:2], 3: users[2:]})
    assert len(done) == 3 and all(len(r.output_ids) == 4 for r in done)
    assert users[0].metrics.cached_prompt_tokens == 0
    # One prompt is chunked at a time, so the second joins the batch of the first's last
    # chunk, and shares every page of the system prompt that the batch completes.
    assert users[1].metrics.cached_prompt_tokens == users[2].metrics.cached_prompt_tokens == 40
    assert sched.pages.num_free + sched.prefix.num_pages == sched.pages.capacity


def test_sharing_stops_at_a_page_another_request_cached_first():
    """A chunked prompt whose next pages another request cached first (a finished request
    of the same conversation, say): it keeps its own copies private, so that no page of its
    sits unlocked in the cache under another request's, and everything drains and frees."""
    sched, dev = make_scheduler(num_pages=64, page_size=4, chunk=8, max_context=128)
    b = req(1, 30, 3)  # 30 tokens: chunks of 8
    sched.add(b)
    batch = sched.schedule()
    sched.process(batch, *dev.run(batch)[:2])
    assert [n.page for n in b.prefix_nodes] == b.pages[:2]  # its first chunk is shared at once
    # Another request caches the pages of b's next 8 tokens (as its release would).
    other = sched.pages.allocate(2)
    assert not sched.prefix.insert(b.fill_ids[:16], b.pages[:2] + other)
    batch = sched.schedule()
    sched.process(batch, *dev.run(batch)[:2])
    assert [n.page for n in b.prefix_nodes] == b.pages[:2], "b's pages 2-3 hold tokens cached as other pages"
    assert not set(other) & set(b.pages)
    sched.check_integrity()
    done = drive(sched, dev, {})
    assert [r.request_id for r in done] == ["r1"] and len(b.output_ids) == 3
    assert sched.pages.num_free + sched.prefix.num_pages == sched.pages.capacity
