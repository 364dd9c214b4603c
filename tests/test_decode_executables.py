"""What a decode step hands the host, and how it is launched:

- one packed int32 array per step (steps.pack_for_host), unpacked on the host without loss;
- two loaded executables of each decode program used in turn (runner._call_decode), which
  must give exactly the outputs of the one executable.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from engine_fixtures import assert_drained, make_engine, run_workload
from jaxoverlap.speculative.step import SpecStepOutput
from jaxoverlap.steps import StepOutput
from test_engine_overlap import random_workload

EDGE_LOGPROBS = np.array([0.0, -0.0, -1e-30, -3.25, -np.inf, -88.7], np.float32)


def test_packed_plain_output_round_trips():
    tokens = np.array([0, 1, 151935, 2**31 - 1, 7, 42], np.int32)
    out = StepOutput.of(jnp.asarray(tokens), jnp.asarray(EDGE_LOGPROBS))
    assert out.packed.shape == (6, 2) and out.packed.dtype == jnp.int32
    host_tokens, host_lp, accept = StepOutput.unpack(np.asarray(out.packed))
    assert accept is None
    np.testing.assert_array_equal(host_tokens, tokens)
    # Bit for bit: the signed zero and -inf survive.
    np.testing.assert_array_equal(host_lp.view(np.int32), EDGE_LOGPROBS.view(np.int32))
    # The device-side views read the same values.
    np.testing.assert_array_equal(np.asarray(out.tokens), tokens)
    np.testing.assert_array_equal(np.asarray(out.logprobs).view(np.int32), EDGE_LOGPROBS.view(np.int32))


def test_packed_speculative_output_round_trips():
    rng = np.random.default_rng(0)
    B, W = 3, 4
    tokens = rng.integers(-1, 1000, (B, W)).astype(np.int32)
    logprobs = rng.standard_normal((B, W)).astype(np.float32)
    logprobs[0, 0] = -np.inf
    accept = np.array([1, 4, 2], np.int32)
    drafts = rng.integers(0, 1000, (B, W - 1)).astype(np.int32)
    out = SpecStepOutput.of(jnp.asarray(tokens), jnp.asarray(logprobs), jnp.asarray(accept), jnp.asarray(drafts))
    assert out.packed.shape == (B, 2 * W + 1) and out.window == W
    t, lp, a = SpecStepOutput.unpack(np.asarray(out.packed))
    np.testing.assert_array_equal(t, tokens)
    np.testing.assert_array_equal(lp, logprobs)
    np.testing.assert_array_equal(a, accept)
    for name, want in (("tokens", tokens), ("logprobs", logprobs), ("accept_lens", accept), ("drafts", drafts)):
        np.testing.assert_array_equal(np.asarray(getattr(out, name)), want)


def _decode_launches(eng) -> int:
    return sum(t.kind == "decode" for t in eng.timings)


@pytest.mark.parametrize("greedy", [True, False])
def test_two_executables_in_turn_give_the_outputs_of_one(greedy):
    """Staggered arrivals over several batch buckets, sampled rows included: the same tokens
    (logprobs through the engine: test_engine_overlap), and the twin really ran about half of each program's launches."""
    results = {}
    for alternate in (True, False):
        eng = make_engine(alternate_decode_executables=alternate)
        finals = run_workload(eng, random_workload(3, greedy=greedy))
        assert_drained(eng)
        results[alternate] = {k: v.token_ids for k, v in finals.items()}
        r = eng.runner
        if alternate:
            programs = [k for k, twin in r._twins.items() if twin is not None]
            assert len(programs) >= 2, "the workload should use several decode programs"
            # Each program alternates, starting with the jit executable: the twin ran at
            # most one launch fewer than it, per program.
            launches = _decode_launches(eng)
            assert launches - len(programs) <= 2 * r.twin_launches <= launches
        else:
            assert r.twin_launches == 0 and not r._twins
    assert results[True] == results[False]


def test_two_executables_with_a_speculative_drafter():
    """The speculative step (packed window, accept lengths) alternates as well."""
    results = {}
    for alternate in (True, False):
        eng = make_engine(alternate_decode_executables=alternate, speculative_algorithm="ngram_device",
                          max_context_len=128)
        finals = run_workload(eng, random_workload(4, n=6))
        assert_drained(eng)
        results[alternate] = {k: v.token_ids for k, v in finals.items()}
        assert (eng.runner.twin_launches > 0) == alternate
    assert results[True] == results[False]


def test_warmup_loads_the_twin_of_each_program():
    eng = make_engine(batch_buckets=(2, 4), max_running_requests=4)
    report = eng.warmup()
    r = eng.runner
    keys = {r._program_key(x["batch"], False, x["ctx_len"], x["sampling"], x["draft"]) for x in report}
    assert keys <= set(r._twins) and all(r._twins[k] is not None for k in keys)
