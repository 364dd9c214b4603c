"""The engine on a tiny model: overlap vs normal loop, retraction, prefix sharing, leaks."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_fixtures import VOCAB, assert_drained, make_engine, run_workload, tiny_config, tiny_params
from jaxoverlap.models.transformer import dense_logits
from jaxoverlap.sampling_params import SamplingParams
from jaxoverlap.sync_guard import no_host_sync


def random_workload(seed: int, n: int = 12, greedy: bool = True):
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(0, VOCAB, size=12)]
    arrivals = {}
    for i in range(n):
        own = [int(t) for t in rng.integers(0, VOCAB, size=int(rng.integers(1, 30)))]
        prompt = (shared + own) if i % 3 == 0 else own
        params = SamplingParams(
            max_new_tokens=int(rng.integers(1, 40)), ignore_eos=True,
            temperature=0.0 if greedy or i % 2 else 0.8, top_k=0 if i % 4 else 20, seed=1000 + i,
        )
        arrivals.setdefault(int(rng.integers(0, 30)), []).append((f"r{i}", prompt, params))
    return arrivals


@pytest.mark.parametrize("kv_cache_tokens", [512, 96])
def test_greedy_identical_with_and_without_overlap(kv_cache_tokens):
    """Staggered arrivals, shared prefixes, and (at 96 tokens) a cache small enough to force
    retraction: outputs match token for token."""
    results, retractions = [], []
    for disable_overlap in (False, True):
        eng = make_engine(kv_cache_tokens=kv_cache_tokens, disable_overlap=disable_overlap)
        finals = run_workload(eng, random_workload(0))
        assert_drained(eng)
        results.append({k: v.token_ids for k, v in finals.items()})
        retractions.append(eng.stats()["num_retractions"])
        assert all(len(v.token_ids) == v_params for v, v_params in
                   ((finals[k], p.max_new_tokens) for k, p in _params(random_workload(0)).items()))
    assert results[0] == results[1]
    if kv_cache_tokens == 96:
        assert min(retractions) > 0, "the small cache should force retraction"


def _params(arrivals):
    return {rid: p for reqs in arrivals.values() for rid, _, p in reqs}


def test_seeded_sampling_identical_with_and_without_overlap():
    outs = []
    for disable_overlap in (False, True):
        eng = make_engine(disable_overlap=disable_overlap)
        finals = run_workload(eng, random_workload(1, greedy=False))
        outs.append({k: v.token_ids for k, v in finals.items()})
    assert outs[0] == outs[1]


def test_engine_matches_dense_reference():
    """Paged prefill + decode reproduce the dense forward's greedy continuation."""
    cfg = tiny_config()
    params = tiny_params(cfg)
    prompt = [5, 17, 33, 2, 90, 41, 7]
    eng = make_engine(chunked_prefill_size=4)  # forces 2 prefill chunks
    finals = run_workload(eng, {0: [("a", prompt, SamplingParams(max_new_tokens=12, temperature=0.0, logprobs=True))]})
    got = finals["a"].token_ids
    seq = list(prompt)
    for _ in range(12):
        logits = dense_logits(params, cfg, jnp.asarray(seq, jnp.int32))
        seq.append(int(jnp.argmax(logits[-1])))
    assert got == seq[len(prompt):]


def test_logprobs_match_dense_reference():
    cfg = tiny_config()
    params = tiny_params(cfg)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    eng = make_engine()
    eng.add_request("a", prompt, SamplingParams(max_new_tokens=6, temperature=0.0, logprobs=True))
    lps, toks = [], []
    for out in eng.drain():
        lps += out.new_logprobs or []
        toks += out.new_token_ids
    logits = dense_logits(params, cfg, jnp.asarray(prompt + toks[:-1], jnp.int32))
    ref = jax.nn.log_softmax(logits, -1)[len(prompt) - 1 :]
    np.testing.assert_allclose(lps, [float(ref[i, t]) for i, t in enumerate(toks)], rtol=1e-4, atol=1e-5)


def test_launch_path_has_no_device_to_host_transfer():
    eng = make_engine()
    eng.guard_launch = True  # every launch runs under sync_guard.no_host_sync()
    finals = run_workload(eng, random_workload(2, n=6, greedy=False))
    assert len(finals) == 6
    # ... and the guard does catch a hidden sync, also on the CPU backend.
    for read in (np.asarray, int, lambda x: x.item(), lambda x: x.block_until_ready()):
        with pytest.raises(Exception, match="[Dd]isallowed"):
            with no_host_sync():
                read(jnp.arange(1) + 1)
    assert int(jnp.arange(1)[0] + 1) == 1  # and only while it is active


def test_prefix_cache_hits_and_drains():
    eng = make_engine()
    prompt = list(range(1, 30))
    run_workload(eng, {0: [("a", prompt, SamplingParams(max_new_tokens=3, temperature=0.0))]})
    finals = run_workload(eng, {0: [("b", prompt + [7], SamplingParams(max_new_tokens=3, temperature=0.0))]})
    assert finals["b"].metrics.cached_prompt_tokens == 28
    assert_drained(eng)


def test_abort_running_and_waiting_frees_everything():
    eng = make_engine(max_running_requests=2)
    for i in range(4):
        eng.add_request(f"r{i}", [1 + i, 2, 3], SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert eng.abort("r0") and eng.abort("r3")
    assert not eng.abort("nope")
    finals = {o.request_id: o for o in eng.drain() if o.finished}
    assert finals["r0"].finish_reason == "abort" and finals["r3"].finish_reason == "abort"
    assert finals["r1"].finish_reason == "length" and len(finals["r1"].token_ids) == 50
    assert_drained(eng)


@pytest.mark.parametrize("kv_cache_tokens", [512, 96])
def test_every_request_of_a_staggered_workload_matches_the_dense_reference(kv_cache_tokens):
    """Requests arrive, finish and (at 96 tokens) are retracted at different steps, so the
    decode batch's rows change often; each row must still read its own request's entry
    (the runner builds the entries array once per running set: runner._decode_rows)."""
    cfg = tiny_config()
    params = tiny_params(cfg)
    arrivals = random_workload(3, n=6)
    eng = make_engine(kv_cache_tokens=kv_cache_tokens)
    finals = run_workload(eng, arrivals)
    assert (eng.stats()["num_retractions"] > 0) == (kv_cache_tokens == 96)
    # Causal: tokens after position n - 1 do not change its logits, so one padded length
    # (one compilation) serves every prefix.
    greedy_step = jax.jit(lambda ids, n: jnp.argmax(dense_logits(params, cfg, ids)[n - 1]))
    for rid, prompt, p in (x for reqs in arrivals.values() for x in reqs):
        seq = list(prompt)
        for _ in range(p.max_new_tokens):
            padded = np.zeros((128,), np.int32)
            padded[: len(seq)] = seq
            seq.append(int(greedy_step(padded, len(seq))))
        assert finals[rid].token_ids == seq[len(prompt):], rid


def test_loop_totals_count_iterations_host_time_and_host_bound_steps():
    """Engine.stats()["loop"] sums every iteration's timing. The overlap loop counts the
    iterations whose wait found the previous step done: none in the normal loop, and nearly
    every decode iteration when the host is made slower than the device's step."""
    import time

    def run(eng, n_tokens):
        eng.add_request(f"x{time.perf_counter()}", [1, 2, 3], SamplingParams(max_new_tokens=n_tokens, temperature=0.0,
                                                                            ignore_eos=True))
        eng.drain()
        return eng.stats()["loop"]

    eng = make_engine(disable_overlap=True)
    loop = run(eng, 12)
    timings = list(eng.timings)
    assert loop["prefill_iterations"] == sum(t.kind == "prefill" for t in timings) == 1
    assert loop["decode_iterations"] == sum(t.kind == "decode" for t in timings) == 11
    for phase in ("prepare", "launch", "process", "wait"):
        assert loop[f"{phase}_s"] == pytest.approx(sum(getattr(t, f"{phase}_s") for t in timings))
    assert loop["host_bound_iterations"] == 0  # counted in the overlap loop only

    eng = make_engine()
    before = run(eng, 4)  # compiles, and the first launch has nothing to wait for
    schedule = eng.scheduler.schedule

    def slow_schedule():  # a host far slower than the tiny model's step
        time.sleep(0.03)
        return schedule()

    eng.scheduler.schedule = slow_schedule
    after = run(eng, 12)
    decode = after["decode_iterations"] - before["decode_iterations"]
    bound = after["host_bound_iterations"] - before["host_bound_iterations"]
    # 11 decode steps for 12 tokens, and one more: the overlap loop finds the finish a step late.
    assert decode == 12 and bound >= decode - 1, (decode, bound)


def test_loop_totals_count_a_host_bound_iteration_only_under_overlap():
    from jaxoverlap.engine import LoopTotals, StepTiming

    def timing(kind="decode", found_done=False, fresh=0.0):
        return StepTiming(kind, 4, 0.001, 0.002, 0.003, 0.0005, fresh, 0.0, 0, 0, 0.0, 0, found_done)

    totals = LoopTotals()
    totals.add(timing(found_done=True), overlap=True)  # counted
    totals.add(timing(found_done=False), overlap=True)  # the host waited: the device was busy
    totals.add(timing(found_done=True), overlap=False)  # the normal loop idles the device by design
    totals.add(timing(kind="", found_done=True), overlap=True)  # nothing launched: a drain iteration
    totals.add(timing(fresh=0.004), overlap=True)  # host n-gram: processed before the launch
    assert totals.host_bound_iterations == 2
    assert totals.decode_iterations == 4 and totals.prefill_iterations == 0
    assert totals.wait_s == pytest.approx(5 * 0.003 + 0.004)  # the early wait before a launch too
    assert totals.decode_wait_s == pytest.approx(4 * 0.003 + 0.004)  # the drain iteration is no decode step
    assert totals.decode_host_bound_iterations == 2


def test_samples_of_one_prompt_share_its_prefill_and_match_the_dense_reference():
    """n samples of one prompt submitted together (pass@k): all but the first reuse the
    first's prompt pages, in the same prefill batch, while they are being written. Greedy
    samples equal the dense reference; seeded samples equal the same request run alone."""
    cfg = tiny_config()
    params = tiny_params(cfg)
    rng = np.random.default_rng(7)
    prompt = [int(t) for t in rng.integers(0, VOCAB, size=23)]  # 5 full pages of 4, and 3 tokens
    sampled = [SamplingParams(max_new_tokens=12, temperature=0.9, seed=s, ignore_eos=True) for s in range(3)]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    eng = make_engine()
    finals = run_workload(eng, {0: [(f"s{i}", prompt, p) for i, p in enumerate(sampled)] + [("g", prompt, greedy)]})
    assert [finals[k].metrics.cached_prompt_tokens for k in ("s0", "s1", "s2", "g")] == [0, 20, 20, 20]
    assert_drained(eng)
    for i, p in enumerate(sampled):
        alone = run_workload(make_engine(disable_prefix_cache=True), {0: [("x", prompt, p)]})["x"]
        assert finals[f"s{i}"].token_ids == alone.token_ids
    assert len({tuple(finals[f"s{i}"].token_ids) for i in range(3)}) > 1  # the seeds differ
    # Causal: one padded length (one compilation) serves every prefix.
    greedy_step = jax.jit(lambda ids, n: jnp.argmax(dense_logits(params, cfg, ids)[n - 1]))
    seq = list(prompt)
    for _ in range(12):
        padded = np.zeros((48,), np.int32)
        padded[: len(seq)] = seq
        seq.append(int(greedy_step(padded, len(seq))))
    assert finals["g"].token_ids == seq[len(prompt):]


def test_loop_totals_per_decode_step_leave_prefills_out_and_count_the_early_wait():
    """LoopTotals.decode_*: sums over the decode iterations only (what `jaxoverlap bench`
    divides by the decode steps); every wait and processing counted, the host n-gram
    drafter's before its launch too."""
    eng = make_engine(speculative_algorithm="ngram", max_context_len=128)
    prompt = [5, 6, 7, 8] * 6  # repeats: the n-gram drafter proposes
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    run_workload(eng, {0: [(f"r{i}", prompt[i:], params) for i in range(3)], 4: [("late", prompt, params)]})
    loop, timings = eng.stats()["loop"], list(eng.timings)
    decode = [t for t in timings if t.kind == "decode"]
    assert loop["decode_iterations"] == len(decode) and any(t.kind == "prefill" for t in timings)
    assert any(t.fresh_wait_s > 0 for t in decode), "no early wait: the check cannot fail"
    assert loop["decode_host_s"] == pytest.approx(sum(t.prepare_s + t.launch_s + t.all_process_s for t in decode))
    assert loop["decode_wait_s"] == pytest.approx(sum(t.all_wait_s for t in decode))
    assert loop["wait_s"] == pytest.approx(sum(t.all_wait_s for t in timings))
    assert loop["process_s"] == pytest.approx(sum(t.all_process_s for t in timings))
    assert loop["decode_host_s"] < loop["prepare_s"] + loop["launch_s"] + loop["process_s"]  # prefills left out


def test_kv_usage_counts_what_requests_hold_not_the_prefix_cache():
    eng = make_engine(max_context_len=128)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    run_workload(eng, {0: [(f"r{i}", [(3 * i + j) % 90 + 1 for j in range(40)], params) for i in range(4)]})
    idle = eng.stats()
    assert idle["kv_cached_tokens"] > 0 and idle["kv_used_tokens"] == 0 and idle["kv_usage"] == 0.0
    eng.add_request("busy", list(range(1, 41)), dataclasses.replace(params, max_new_tokens=50))
    eng.step()
    eng.step()
    busy = eng.stats()
    assert busy["kv_used_tokens"] >= 40 and busy["kv_usage"] == busy["kv_used_tokens"] / busy["kv_total_tokens"]
    eng.abort("busy")
    eng.drain()
