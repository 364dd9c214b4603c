"""Padding costs nothing it need not: padded tokens, reservations and rows write nothing
(their scatter indices are distinct and past the end, because colliding indices are what
XLA's GPU scatter serializes: jaxoverlap/scatter.py), and a prefill batch's padded rows x
tokens stay within the chunk budget (buckets.PrefillShapes, applied by the scheduler)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_fixtures import make_engine, run_workload, tiny_config, tiny_params
from fake_device import FakeDevice, drive
from fake_device import make_request as req
from jaxoverlap.buckets import PrefillShapes
from jaxoverlap.models.transformer import write_cache
from jaxoverlap.page_allocator import EntryAllocator, PageAllocator
from jaxoverlap.prefix_cache import PrefixCache
from jaxoverlap.sampling_params import SamplingParams
from jaxoverlap.scatter import dropped_where_invalid, last_segment_rows, last_segments, set_rows
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


def test_only_a_chunks_last_row_writes_its_entry():
    entries = jnp.array([3, 3, 5, 0, 3, 0])  # entry 3 in three rows (segments of one chunk)
    starts = jnp.array([0, 16, 0, 0, 32, 0])
    assert np.asarray(last_segments(entries, starts)).tolist() == [0, 0, 5, 0, 3, 0]
    # The rows that sample: those last segments, then distinct indices past the end.
    assert np.asarray(last_segment_rows(entries, starts, 4)).tolist() == [2, 4, 8, 9]


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


# -- prefill shapes within the chunk budget, rows planned --------------------------------------
def test_prefill_shapes_rule():
    shapes = PrefillShapes(max_rows=8, chunked_prefill_size=2048)
    assert shapes.row_buckets == (1, 2, 4, 8) and shapes.len_buckets[0] == 16 and shapes.len_buckets[-1] == 2048
    assert shapes.shape(3, 300) == (4, 512)
    assert shapes.runs(1, 2048) and shapes.runs(8, 256) and shapes.runs(2, 1024)
    assert not shapes.runs(8, 2048) and not shapes.runs(2, 2048)
    # The speculative prefill's rows hold the token before the chunk too.
    assert PrefillShapes(8, 2048, lead=1).shape(1, 2047) == (1, 2048)


@pytest.mark.parametrize("pending, plan, why", [
    ([1088], (1024, 1), "1024 + 64 next (1856 with two step costs) beats one 2048 (2432)"),
    ([1624], (2048, 1), "1024 + 600 next (2816) does not"),
    ([1500], (1024, 1), "1024 + 476 as 512 (2304) beats 2432"),
    ([100], (128, 1), "one row in its bucket"),
    ([2048], (2048, 1), "a full row"),
    ([1088] * 8, (256, 8), "a burst: every step full, 8 rows of 256"),
    ([1088] + [64] * 7, (1024, 1), "one system prompt: 1024 alone, then 8 x 64 of the rest"),
    ([600, 300], (128, 8), "segments: 8 x 128 holds both (1408), whole rows need 2 x 1024 (2432)"),
    ([64] * 8, (64, 8), "short prompts, one row each"),
])
def test_the_plan(pending, plan, why):
    assert PrefillShapes(8, 2048).plan(pending) == plan, why


def test_the_plan_with_a_lead_and_other_step_costs():
    assert PrefillShapes(8, 2048, lead=1).plan([1088]) == (1024, 1)  # 1023 + the lead token
    assert PrefillShapes(8, 2048, step_cost_tokens=2048).plan([1088]) == (2048, 1)  # a second step costs too much
    # 512 prompts of 6 tokens with 4096 a step: two full steps of 256 x 16, not one row now
    # and the rest later (the rest counted in the steps it takes, not as dense tokens)
    assert PrefillShapes(512, 4096).plan([6] * 512) == (16, 256)
    # With rows to spare, a burst is cut finer: 8 x 1088 as 32 rows of 64 (no padding), not 8 x 256
    assert PrefillShapes(64, 2048).plan([1088] * 8) == (64, 32)
    for pending in ([40, 8, 8, 8], [40], [5, 60, 33]):  # every plan runs, and the first gets a row
        for cost in (0, 64, 384):
            shapes = PrefillShapes(4, 64, step_cost_tokens=cost)
            T, R = shapes.plan(pending)
            assert shapes.runs(R, T) and T in shapes.len_buckets and R in shapes.row_buckets


def _scheduler(shapes: bool, chunk=64, max_prefill=4, page_size=4, step_cost=PrefillShapes.STEP_COST_TOKENS,
               cache=True, max_rows=None):
    max_context, max_running = 128, 8
    cfg = SchedulerConfig(page_size=page_size, max_running=max_running, chunked_prefill_size=chunk,
                          max_prefill_requests=max_prefill, max_context_len=max_context, table_width=max_context,
                          prefill_shapes=PrefillShapes(max_rows or max_prefill, chunk, step_cost_tokens=step_cost)
                          if shapes else None)
    sched = Scheduler(cfg, PageAllocator(256, page_size), EntryAllocator(max_running), PrefixCache(page_size, cache))
    return sched, FakeDevice(max_running + 1, max_context, page_size)


def _prefill_batches(sched, dev, arrivals):
    """Drive the workload; returns (each prefill batch's rows as (request id, start,
    length, is_last), the finished requests)."""
    seen, schedule = [], sched.schedule

    def recording():
        batch = schedule()
        if batch is not None and batch.kind == "prefill":
            seen.append([(row.req.request_id, row.start, row.length, row.is_last) for row in batch.rows])
        return batch

    sched.schedule = recording
    done = drive(sched, dev, arrivals)
    return seen, done


def _lengths(seen):
    return [[length for _, _, length, _ in rows] for rows in seen]


@pytest.mark.parametrize("shapes", [True, False])
def test_a_long_prompt_is_cut_into_rows(shapes):
    """One long prompt with short ones behind it. Planned: the long one as rows of 16 with
    one short one (4 x 16), then the other two (2 x 16), instead of all four padded to the
    long one's 64 (4 x 64, past the budget: what happens without a plan, the check that
    can fail)."""
    sched, dev = _scheduler(shapes)
    reqs = [req(0, 40, 3)] + [req(i, 8, 3) for i in range(1, 4)]
    seen, done = _prefill_batches(sched, dev, {0: reqs})
    assert len(done) == 4 and all(len(r.output_ids) == 3 for r in done)
    if shapes:
        assert _lengths(seen) == [[16, 16, 8, 8], [8, 8]]
        rows = seen[0][:3]  # the long prompt's rows: consecutive, the last one ends it
        assert [(start, is_last) for _, start, _, is_last in rows] == [(0, False), (16, False), (32, True)]
    else:
        assert _lengths(seen)[0] == [40, 8, 8, 8]


def test_more_rows_than_requests():
    """Rows and requests are limited apart (EngineConfig.max_prefill_rows). Two prompts of
    40 with 4 rows and 2 requests a step start as 4 x 16 (56 tokens); with 2 rows, as
    1 x 32 (2 x 16 holds as many tokens, in more rows). A third request waits for a later
    step all the same."""

    def arrivals():  # fresh requests for each scheduler
        return {0: [req(0, 40, 2), req(1, 40, 2), req(2, 8, 2)]}

    sched, dev = _scheduler(True, max_prefill=2, max_rows=4, step_cost=16)
    seen, done = _prefill_batches(sched, dev, arrivals())
    assert len(done) == 3
    assert seen[0] == [("r0", 0, 16, False), ("r0", 16, 16, False), ("r0", 32, 8, True), ("r1", 0, 16, False)]
    assert all(len({rid for rid, *_ in rows}) <= 2 for rows in seen)
    sched, dev = _scheduler(True, max_prefill=2, step_cost=16)  # rows = requests
    seen, done = _prefill_batches(sched, dev, arrivals())
    assert len(done) == 3 and _lengths(seen)[0] == [32] and max(len(rows) for rows in seen) <= 2


def test_max_prefill_rows_option():
    import argparse

    from jaxoverlap.cli import add_engine_args, engine_options
    from jaxoverlap.config import EngineConfig

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    options = engine_options(parser.parse_args(["--max-prefill-requests", "4", "--max-prefill-rows", "32"]))
    assert options["max_prefill_rows"] == 32 and options["max_prefill_requests"] == 4
    assert engine_options(parser.parse_args([]))["max_prefill_rows"] is None
    with pytest.raises(ValueError, match="max_prefill_rows"):
        EngineConfig(max_prefill_requests=8, max_prefill_rows=4)  # every request of a step takes a row
    with pytest.raises(ValueError, match="max_prefill_requests"):
        EngineConfig(max_prefill_requests=0)
    # The default: a row per 32 tokens of the chunk budget, at least a row per request.
    assert EngineConfig().prefill_rows == 2048 // 32
    assert EngineConfig(chunked_prefill_size=512, max_prefill_requests=4).prefill_rows == 16
    assert EngineConfig(chunked_prefill_size=32).prefill_rows == 8
    assert EngineConfig(max_prefill_rows=8).prefill_rows == 8


def test_default_prefill_rows_reach_the_scheduler_and_runner():
    from jaxoverlap.config import EngineConfig

    eng = make_engine(chunked_prefill_size=256, max_prefill_requests=2)
    assert EngineConfig(chunked_prefill_size=256, max_prefill_requests=2).prefill_rows == 8
    assert eng.runner.prefill_row_buckets[-1] == 8
    assert eng.scheduler.cfg.prefill_shapes.row_buckets[-1] == 8


@pytest.mark.parametrize("cache", [True, False])
def test_the_plan_counts_pages_that_earlier_prompts_will_share(cache):
    """Three prompts with one 34-token system prompt: with the prefix cache, the second and
    third count only what follows its 8 whole pages of 4 (they will share those once the
    first prompt's prefill is scheduled); without it, everything."""
    sched, _ = _scheduler(True, cache=cache)
    system = list(range(1, 35))
    first, *others = [req(i, 6, 2, prefix=system) for i in range(3)]
    for r in others:
        sched.add(r)
    assert sched._pending_tokens(first, 64) == ([40, 8, 8] if cache else [40, 40, 40])


@pytest.mark.parametrize("seed", range(6))
def test_every_prefill_batch_runs_and_holds_consecutive_rows(seed):
    rng = np.random.default_rng(seed)
    sched, dev = _scheduler(True, step_cost=int(rng.integers(0, 400)), cache=bool(seed % 2))
    shapes = sched.cfg.prefill_shapes
    arrivals = {int(t): [req(100 * int(t) + i, int(rng.integers(1, 90)), 2) for i in range(int(rng.integers(1, 5)))]
                for t in rng.integers(0, 30, size=6)}
    seen, done = _prefill_batches(sched, dev, arrivals)
    assert len(done) == sum(len(v) for v in arrivals.values())
    assert any(len({rid for rid, *_ in rows}) > 1 for rows in seen)  # requests still batch
    covered = {}
    for rows in seen:
        lengths = [length for _, _, length, _ in rows]
        assert sum(lengths) <= 64 and shapes.runs(*shapes.shape(len(rows), max(lengths)))
        for rid, start, length, is_last in rows:  # each request's rows follow on, whatever the step
            assert covered.get(rid, start) == start
            covered[rid] = start + length
    for r in done:  # every prompt prefilled to its end (the cache may have covered a prefix)
        assert covered[r.request_id] == len(r.fill_ids)


@pytest.mark.parametrize("algo", [None, "eagle", "draft_model"])
def test_rows_of_one_chunk_give_the_tokens_of_whole_chunks(algo):
    """Prompts prefilled as several rows of one batch (the plan) give the tokens and
    prompt logprobs of one row per request, plain, with EAGLE's lead token and with a draft
    model; one request is penalized, so the penalty history sums every row's tokens; one
    samples and asks for top logprobs, from the rows that sample only (a step of 2 requests in
    4 rows samples after 2: steps.sample_after_chunks); and the rows do happen (the check can
    fail)."""
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    penalized = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True, frequency_penalty=0.7,
                               repetition_penalty=1.5, logit_bias={4: 0.5}, min_new_tokens=2, stop_token_ids=[9])
    scored = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    # Sampled, with top logprobs: the token after the prompt comes from the rows that sample.
    sampled = SamplingParams(max_new_tokens=5, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True, logprobs=True,
                             top_logprobs=3)
    arrivals = {0: [("a", [3 + i % 50 for i in range(40)], penalized), ("b", [7 + i for i in range(8)], sampled)],
                3: [("e", [(3 * i) % 80 + 2 for i in range(45)], scored),
                    ("c", [(5 * i) % 90 + 1 for i in range(70)], greedy), ("d", [11, 12] * 9, greedy)]}
    extra = {}
    if algo == "draft_model":
        cfg = tiny_config()
        extra = dict(draft_model_config=cfg, draft_params=tiny_params(cfg, 1))
    results, tops = {}, {}
    for planned in (True, False):
        # Planned: 2 requests a step, in up to 4 rows (max_prefill_rows); whole: 4 and 4.
        engine = make_engine(kv_cache_tokens=1024, chunked_prefill_size=64, max_prefill_requests=2 if planned else 4,
                             max_prefill_rows=4,
                             **({"speculative_algorithm": algo} if algo else {}), **extra)
        shapes = engine.scheduler.cfg.prefill_shapes  # the runner's too: one object
        if not planned:  # one row per request: rows as long as the budget allows
            shapes.plan = lambda pending, s=shapes: (s.len_buckets[-1], s.row_buckets[-1])
        launched, launch = [], engine.runner._launch_prefill

        def traced(batch, launch=launch, launched=launched):
            launched.append([(row.req.request_id, row.length) for row in batch.rows])
            return launch(batch)

        engine.runner._launch_prefill = traced
        tops[planned], step = [], engine.step

        def stepped(step=step, top=tops[planned]):  # b's top logprobs, update by update
            outs = step()
            top.extend(t for o in outs if o.request_id == "b" for t in o.new_top_logprobs)
            return outs

        engine.step = stepped
        finals = run_workload(engine, arrivals)
        results[planned] = ({rid: (out.token_ids, out.prompt_logprobs) for rid, out in finals.items()}, launched)
    (planned, planned_rows), (whole, whole_rows) = results[True], results[False]
    assert len(planned) == 5 and {rid: toks for rid, (toks, _) in planned.items()} == {
        rid: toks for rid, (toks, _) in whole.items()}
    assert len(tops[True]) == 5 and [[t for t, _ in top] for top in tops[True]] == [
        [t for t, _ in top] for top in tops[False]]
    np.testing.assert_allclose([[lp for _, lp in top] for top in tops[True]],
                               [[lp for _, lp in top] for top in tops[False]], rtol=1e-4, atol=1e-4)
    lp_planned, lp_whole = planned["e"][1], whole["e"][1]  # the scored prompt's logprobs, row by row
    assert lp_planned[0] is None and len(lp_planned) == 45
    np.testing.assert_allclose(lp_planned[1:], lp_whole[1:], rtol=1e-4, atol=1e-4)
    for rid in "ae":  # the penalized and the scored prompt in several rows of one step
        assert any([r for r, _ in rows].count(rid) > 1 for rows in planned_rows)
    assert max(len(rows) for rows in planned_rows) > 2  # more rows than requests
    assert any(("b", 8) in rows and len(rows) > 2 for rows in planned_rows)  # b's whole prompt in such a step
    assert all(len({rid for rid, _ in rows}) <= 2 for rows in planned_rows)
    assert all(len(rows) == len({rid for rid, _ in rows}) for rows in whole_rows)
