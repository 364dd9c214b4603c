"""Padding costs nothing it need not: padded tokens, reservations and rows write nothing
(their scatter indices are distinct and past the end, because colliding indices are what
XLA's GPU scatter serializes: jaxoverlap/scatter.py), and a prefill batch's padded rows x
tokens stay within the chunk budget (buckets.PrefillShapes, applied by the scheduler)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_fixtures import make_engine, run_workload
from fake_device import FakeDevice, drive
from fake_device import make_request as req
from jaxoverlap.buckets import PrefillShapes
from jaxoverlap.models.transformer import write_cache
from jaxoverlap.page_allocator import EntryAllocator, PageAllocator
from jaxoverlap.prefix_cache import PrefixCache
from jaxoverlap.sampling_params import SamplingParams
from jaxoverlap.scatter import dropped_where_invalid, set_rows
from jaxoverlap.scheduler import Scheduler, SchedulerConfig
from jaxoverlap.speculative.ngram_device import write_tokens
from jaxoverlap.steps import Reservations, apply_reservations


# -- padding writes nothing --------------------------------------------------------------------
def test_invalid_indices_become_distinct_and_past_the_end():
    idx = jnp.array([[3, 0, 0], [0, 7, 0]], jnp.int32)
    valid = jnp.array([[True, False, False], [False, True, False]])
    out = np.asarray(dropped_where_invalid(idx, valid, 10))
    assert out.shape == (2, 3)
    assert out[0, 0] == 3 and out[1, 1] == 7
    dropped = out[~np.asarray(valid)]
    assert (dropped >= 10).all() and len(set(dropped.tolist())) == dropped.size


def test_write_cache_writes_valid_tokens_only():
    cache = jnp.zeros((2, 8, 1, 2), jnp.float32)  # [L, S, KVH, HD]
    slots = jnp.array([3, 0, 5, 0], jnp.int32)
    valid = jnp.array([True, False, True, False])
    values = jnp.arange(1, 5, dtype=jnp.float32)[:, None, None] * jnp.ones((4, 1, 2))  # token t holds t + 1
    out = np.asarray(write_cache(cache, 1, slots, valid, values))
    want = np.zeros((2, 8, 1, 2), np.float32)
    want[1, 3], want[1, 5] = 1.0, 3.0
    np.testing.assert_array_equal(out, want)  # slot 0 (the padding's old target) untouched


def test_per_entry_writes_skip_entry_0():
    array = jnp.full((4, 2), -1, jnp.int32)  # [E, D]
    out = np.asarray(set_rows(array, jnp.array([2, 0, 3, 0]), jnp.arange(8, dtype=jnp.int32).reshape(4, 2)))
    assert out.tolist() == [[-1, -1], [-1, -1], [0, 1], [4, 5]]


def test_padded_reservations_leave_the_dummy_row_alone():
    table = jnp.full((3, 8), 9, jnp.int32)  # [E, W]; 9 marks "not written"
    res = Reservations.of(entries=[2, 0, 0], page_index=[1, 0, 0], pages=[3, 0, 0])
    out = np.asarray(apply_reservations(table, res, page_size=4))
    assert out[2, 4:].tolist() == [12, 13, 14, 15]
    assert (out[0] == 9).all() and (out[1] == 9).all() and (out[2, :4] == 9).all()


def test_ngram_history_records_valid_tokens_only():
    slot_tokens = jnp.full((16,), -1, jnp.int32)
    table = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)  # entry 1 maps position p to slot 8 + p
    out = np.asarray(write_tokens(slot_tokens, table, entries=jnp.array([1, 0]),
                                  positions=jnp.array([[0, 1], [0, 0]]), tokens=jnp.array([[5, 6], [7, 7]]),
                                  valid=jnp.array([[True, True], [False, False]])))
    assert out[8] == 5 and out[9] == 6
    assert (np.delete(out, [8, 9]) == -1).all()


@pytest.mark.parametrize("algo", [None, "ngram_device"])
def test_padded_rows_write_nothing(algo):
    """A workload whose prefills and decode steps carry padded rows and tokens (odd prompt
    lengths, batches below their bucket; one request penalized, so the penalty state is
    written too) never writes the dummy page's K/V slots, nor entry 0's relay and penalty
    state, where padding used to go (XLA path: the padding is dropped)."""
    engine = make_engine(kv_cache_tokens=1024, chunked_prefill_size=64,
                         **({"speculative_algorithm": algo} if algo else {}))
    ps = engine.config.page_size
    state = engine.runner.state
    entry0 = jax.tree.map(lambda x: np.asarray(x[0]), (state.relay, state.penalty))  # as initialized
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    penalized = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, presence_penalty=0.5,
                               logit_bias={3: 1.0}, min_new_tokens=2, stop_token_ids=[5])
    # Three prompts prefill as 4 rows of 16 and decode as 4 rows: one padded row each.
    arrivals = {0: [(f"a{i}", [3 + i] * (5 + i), greedy) for i in range(3)],
                2: [("b", [8] * 29, penalized)]}
    finals = run_workload(engine, arrivals)
    assert len(finals) == 4 and all(len(o.token_ids) == 6 for o in finals.values())
    state = engine.runner.state
    for cache in (state.k_cache, state.v_cache):
        assert not np.asarray(cache[:, :ps]).any()  # [L, S, KVH, HD]: slots of page 0
    assert np.asarray(state.k_cache[:, ps:]).any()  # real pages were written
    now = jax.tree.map(lambda x: np.asarray(x[0]), (state.relay, state.penalty))
    jax.tree.map(np.testing.assert_array_equal, now, entry0)
    assert np.asarray(state.relay.seq_lens[1:]).any()  # real entries were written


# -- prefill shapes within the chunk budget ------------------------------------------------------
def test_prefill_shapes_rule():
    shapes = PrefillShapes(max_prefill_requests=8, chunked_prefill_size=2048)
    assert shapes.row_buckets == (1, 2, 4, 8) and shapes.len_buckets[0] == 16 and shapes.len_buckets[-1] == 2048
    assert shapes.shape(3, 300) == (4, 512)
    assert shapes.runs(1, 2048) and shapes.runs(8, 256) and shapes.runs(2, 1024)
    assert not shapes.runs(8, 2048) and not shapes.runs(2, 2048)
    assert shapes.longest_chunk(1, 1088) == 0  # a second row would pad both to 2048
    assert shapes.longest_chunk(1, 100) == 1024  # 2 rows x 1024
    assert shapes.longest_chunk(3, 64) == 512  # 4 rows x 512
    assert shapes.longest_chunk(8, 16) == 0  # no row bucket left
    # The speculative prefill's rows hold the token before the chunk too.
    spec = PrefillShapes(8, 2048, lead=1)
    assert spec.shape(1, 2047) == (1, 2048) and spec.longest_chunk(1, 100) == 1023


def test_a_chunk_just_past_a_bucket_is_cut():
    shapes = PrefillShapes(8, 2048)  # the default step cost: 384 tokens
    assert shapes.chunk(1088) == 1024  # 1024 + 64 + 384 < 2048
    assert shapes.chunk(520) == 512  # 512 + 16 + 384 < 1024
    assert shapes.chunk(600) == 600  # 512 + 128 + 384 = 1024: not less
    assert shapes.chunk(1900) == 1900 and shapes.chunk(1024) == 1024 and shapes.chunk(100) == 100
    assert shapes.chunk(300, num_rows=1, longest=500) == 300  # within the batch's bucket
    assert shapes.chunk(600, num_rows=1, longest=8) == 512  # 2 x 512 + 128 + 384 < 2 x 1024
    assert PrefillShapes(8, 2048, lead=1).chunk(1088) == 1023  # the lead token fills the bucket
    assert PrefillShapes(8, 2048, step_cost_tokens=2048).chunk(1088) == 1088


def _scheduler(shapes: bool, chunk=64, max_prefill=4, page_size=4, step_cost=PrefillShapes.STEP_COST_TOKENS):
    max_context, max_running = 128, 8
    cfg = SchedulerConfig(page_size=page_size, max_running=max_running, chunked_prefill_size=chunk,
                          max_prefill_requests=max_prefill, max_context_len=max_context, table_width=max_context,
                          prefill_shapes=PrefillShapes(max_prefill, chunk, step_cost_tokens=step_cost) if shapes else None)
    sched = Scheduler(cfg, PageAllocator(256, page_size), EntryAllocator(max_running), PrefixCache(page_size, True))
    return sched, FakeDevice(max_running + 1, max_context, page_size)


def _prefill_batches(sched, dev, arrivals):
    seen, schedule = [], sched.schedule

    def recording():
        batch = schedule()
        if batch is not None and batch.kind == "prefill":
            seen.append([row.length for row in batch.rows])
        return batch

    sched.schedule = recording
    done = drive(sched, dev, arrivals)
    return seen, done


@pytest.mark.parametrize("shapes", [True, False])
def test_a_long_row_does_not_pad_short_ones(shapes):
    """One long prompt with short ones behind it: with the rule the long row runs alone and
    the short ones together; without it (the check can fail) all four share one 4 x 64 step."""
    sched, dev = _scheduler(shapes)
    reqs = [req(0, 40, 3)] + [req(i, 8, 3) for i in range(1, 4)]
    seen, done = _prefill_batches(sched, dev, {0: reqs})
    assert len(done) == 4 and all(len(r.output_ids) == 3 for r in done)
    if shapes:
        assert seen == [[40], [8, 8, 8]]
    else:
        assert seen[0] == [40, 8, 8, 8]


def test_a_row_is_cut_to_the_shape_that_fits():
    """A short row, then a long one: the long one gets the chunk that keeps 2 rows within
    the budget (2 x 32) and continues in the next step."""
    sched, dev = _scheduler(True)
    seen, done = _prefill_batches(sched, dev, {0: [req(0, 10, 3), req(1, 40, 3)]})
    assert seen[0] == [10, 32] and seen[1][0] == 8
    assert len(done) == 2


def test_the_scheduler_cuts_a_chunk_just_past_a_bucket():
    """A 40-token prompt (bucket 64) runs as 32, then its last 8 with the short prompt that
    waited (2 x 16); a cost of 64 tokens a step makes the whole chunk cheaper (the check can fail)."""
    for step_cost, expected in ((0, [[32], [8, 8]]), (64, [[40], [8]])):
        sched, dev = _scheduler(True, step_cost=step_cost)
        seen, done = _prefill_batches(sched, dev, {0: [req(0, 40, 3), req(1, 8, 3)]})
        assert seen == expected and len(done) == 2 and all(len(r.output_ids) == 3 for r in done)


@pytest.mark.parametrize("seed", range(4))
def test_every_prefill_batch_has_a_shape_that_runs(seed):
    rng = np.random.default_rng(seed)
    sched, dev = _scheduler(True, step_cost=int(rng.integers(0, 64)))
    shapes = sched.cfg.prefill_shapes
    arrivals = {int(t): [req(100 * int(t) + i, int(rng.integers(1, 90)), 2) for i in range(int(rng.integers(1, 5)))]
                for t in rng.integers(0, 30, size=6)}
    seen, done = _prefill_batches(sched, dev, arrivals)
    assert len(done) == sum(len(v) for v in arrivals.values())
    assert any(len(rows) > 1 for rows in seen)  # batching still happens
    for rows in seen:
        assert sum(rows) <= 64 and shapes.runs(*shapes.shape(len(rows), max(rows)))


@pytest.mark.parametrize("algo", [None, "eagle"])
def test_cut_chunks_give_the_tokens_of_whole_ones(algo):
    """Chunks cut at a bucket (a step cost of 0: every cut that shrinks the padded area)
    give the greedy tokens of uncut chunks, plain and with EAGLE's lead token; and the cut
    does happen (the check can fail)."""
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    arrivals = {0: [("a", [3 + i % 50 for i in range(40)], greedy), ("b", [7] * 20, greedy)],
                3: [("c", [(5 * i) % 90 + 1 for i in range(70)], greedy)]}
    results = {}
    for cost in (0, 10**9):
        engine = make_engine(kv_cache_tokens=1024, chunked_prefill_size=64, max_prefill_requests=4,
                             **({"speculative_algorithm": algo} if algo else {}))
        engine.scheduler.cfg.prefill_shapes.step_cost_tokens = cost  # the runner's too: one object
        launched, launch = [], engine.runner._launch_prefill

        def traced(batch, launch=launch, launched=launched):
            launched.append([row.length for row in batch.rows])
            return launch(batch)

        engine.runner._launch_prefill = traced
        finals = run_workload(engine, arrivals)
        results[cost] = ({rid: out.token_ids for rid, out in finals.items()}, launched)
    (cut, cut_chunks), (whole, whole_chunks) = results[0], results[10**9]
    assert len(cut) == 3 and cut == whole
    assert cut_chunks != whole_chunks and len(cut_chunks) > len(whole_chunks)
