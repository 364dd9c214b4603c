"""What a step call takes and hands back, and how a decode step is launched:

- the layer matrices stacked [G, ...] in groups of G layers, or [L, ...] in one stack, on one
  device (models/params.stack_layers): the same model with fewer argument leaves;
- one packed int32 array per step (steps.pack_for_host), unpacked on the host without loss;
- two loaded executables of each decode program used in turn (runner._call_decode), which
  must give exactly the outputs of the one executable.

The engine alternates only on GPU (where XLA records CUDA graphs); these tests switch it on
for the CPU backend. They use a model shape of their own: XLA:CPU cannot serialize some
executables that another test's jit call compiled first, and the runner then keeps one.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_fixtures import assert_drained, make_engine, run_workload, tiny_config, tiny_params
from jaxoverlap.models.loader import dummy_params
from jaxoverlap.models.params import (LayerParams, layer_at, layers_per_stack, num_layers, stack_layers,
                                      unstack_layers)
from jaxoverlap.models.transformer import dense_logits
from jaxoverlap.speculative.step import SpecStepOutput
from jaxoverlap.steps import StepOutput
from test_engine_overlap import random_workload

@pytest.mark.parametrize("group_size", [None, 2, 3, 5])
def test_stacked_layers_are_the_same_model(group_size):
    cfg = tiny_config(num_layers=3)
    params = tiny_params(cfg)
    stacked = stack_layers(params, group_size=group_size)
    per_layer = params.layers[0].wqkv.shape
    if group_size is None:  # one stack
        assert isinstance(stacked.layers, LayerParams) and stacked.layers.wqkv.shape == (3, *per_layer)
        groups = 1
    else:  # groups of group_size layers, the last one shorter where 3 does not divide
        sizes = [g.wqkv.shape[0] for g in stacked.layers]
        assert sizes == [min(group_size, 3 - s) for s in range(0, 3, group_size)]
        assert all(g.wqkv.shape[1:] == per_layer for g in stacked.layers)
        groups = len(sizes)
    assert layers_per_stack(stacked) == (3 if group_size is None else min(group_size, 3))
    assert layers_per_stack(params) == 1
    assert num_layers(stacked) == num_layers(params) == 3
    for i in range(3):
        for a, b in zip(jax.tree.leaves(layer_at(stacked, i)), jax.tree.leaves(params.layers[i])):
            np.testing.assert_array_equal(a, b)
    assert len(jax.tree.leaves(stacked)) == len(jax.tree.leaves(params)) - 4 * (3 - groups)
    ids = jnp.arange(1, 12, dtype=jnp.int32)
    np.testing.assert_array_equal(dense_logits(stacked, cfg, ids), dense_logits(params, cfg, ids))
    assert stack_layers(stacked, group_size=group_size) is stacked
    back = unstack_layers(stacked)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)


def test_stacking_rejects_an_empty_group():
    with pytest.raises(ValueError, match="group_size"):
        stack_layers(tiny_params(tiny_config()), group_size=0)
    with pytest.raises(ValueError, match="layers_per_weight_stack"):
        make_engine(layers_per_weight_stack=0)


@pytest.mark.parametrize("group_size", [None, 1])
def test_stacking_can_delete_the_per_layer_arrays(group_size):
    cfg = tiny_config()
    own = dummy_params(cfg, jnp.float32, 0)
    kept = own.layers[1].w_down
    want = np.asarray(kept)
    stacked = stack_layers(own, group_size=group_size, delete_source=True)
    assert kept.is_deleted() and all(l.wqkv.is_deleted() for l in own.layers)
    np.testing.assert_array_equal(layer_at(stacked, 1).w_down, want)


def test_the_engine_stacks_when_asked_and_leaves_the_callers_weights():
    assert layers_per_stack(make_engine().runner.params) == 1  # per layer by default
    eng = make_engine(layers_per_weight_stack=2)
    params = tiny_params(tiny_config())  # the weights make_engine passed in
    assert layers_per_stack(eng.runner.params) == 2 and isinstance(eng.runner.params.layers, tuple)
    assert not any(l.wqkv.is_deleted() for l in params.layers)  # passed in: the caller's to keep


def test_stacked_engine_gives_the_tokens_of_the_per_layer_one():
    from test_engine_overlap import random_workload

    results = [{k: v.token_ids for k, v in run_workload(make_engine(layers_per_weight_stack=group),
                                                        random_workload(5)).items()}
               for group in (2, 1)]
    assert results[0] == results[1]


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
    t, lp, a = out.unpack(np.asarray(out.packed))
    np.testing.assert_array_equal(t, tokens)
    np.testing.assert_array_equal(lp, logprobs)
    np.testing.assert_array_equal(a, accept)
    for name, want in (("tokens", tokens), ("logprobs", logprobs), ("accept_lens", accept), ("drafts", drafts)):
        np.testing.assert_array_equal(np.asarray(getattr(out, name)), want)


def _decode_launches(eng) -> int:
    return sum(t.kind == "decode" for t in eng.timings)


OWN_SHAPE = tiny_config(intermediate_size=112)  # no other test compiles programs of this shape


def engine(alternate: bool, **options):
    eng = make_engine(OWN_SHAPE, **options)
    eng.runner.alternate_executables = alternate
    return eng


@pytest.mark.parametrize("greedy", [True, False])
def test_two_executables_in_turn_give_the_outputs_of_one(greedy):
    """Staggered arrivals over several batch buckets, sampled rows included: the same tokens
    (logprobs through the engine: test_engine_overlap), and the twin really ran about half of each program's launches."""
    results = {}
    for alternate in (True, False):
        eng = engine(alternate)
        finals = run_workload(eng, random_workload(3, greedy=greedy))
        assert_drained(eng)
        results[alternate] = {k: v.token_ids for k, v in finals.items()}
        r = eng.runner
        if alternate:
            programs = [k for k, (_, twin) in r._executables.items() if twin is not None]
            assert len(programs) >= 2, "the workload should use several decode programs"
            # Each program alternates, starting with the compiled executable: the twin ran
            # at most one launch fewer than it, per program.
            launches = _decode_launches(eng)
            assert launches - len(programs) <= 2 * r.twin_launches <= launches
        else:
            assert r.twin_launches == 0 and not r._executables
    assert results[True] == results[False]


def test_two_executables_with_a_speculative_drafter():
    """The speculative step (packed window, accept lengths) alternates as well."""
    results = {}
    for alternate in (True, False):
        eng = engine(alternate, speculative_algorithm="ngram_device")
        finals = run_workload(eng, random_workload(4, n=6))
        assert_drained(eng)
        results[alternate] = {k: v.token_ids for k, v in finals.items()}
        assert (eng.runner.twin_launches > 0) == alternate
    assert results[True] == results[False]


def test_warmup_loads_the_twin_of_each_program_and_runs_both():
    """The warm-up makes each program's second executable and runs each program once on
    each executable (padding rows only), so that no first execution falls on a served step."""
    eng = engine(True, batch_buckets=(2, 4), max_running_requests=4)
    report = eng.warmup()
    r = eng.runner
    keys = {r._program_key(x["batch"], False, x["ctx_len"], x["sampling"], x["draft"]) for x in report}
    assert keys <= set(r._executables) and all(r._executables[k][1] is not None for k in keys)
    assert r.twin_launches == len(report) and all(x["run_seconds"] > 0 for x in report)


def test_the_engine_alternates_only_on_gpu():
    import jax

    from jaxoverlap.config import EngineConfig

    assert make_engine().runner.alternate_executables == (jax.default_backend() == "gpu")
    assert not make_engine(alternate_decode_executables=False).runner.alternate_executables
    assert EngineConfig().alternate_decode_executables


def test_decode_inputs_are_sent_as_configured():
    """EngineConfig.decode_inputs. A decode call takes one input array (steps.DecodeInputs:
    the rows' entries, then the reservations table). "every_step": numpy with every call,
    so every step allocates the same device buffers (on a GPU the step's CUDA graph then
    keeps its addresses). "on_change": a device array, the same object while neither the
    running set nor the reservations changed. The tokens are the same in both modes."""
    import jax

    from jaxoverlap import steps

    tokens = {}
    for mode in ("every_step", "on_change"):
        eng = make_engine(decode_inputs=mode)
        seen = []  # (packed inputs, entries, reserved pages) per decode call
        call = eng.runner._call_decode

        def spy(key, step, args, static, call=call, seen=seen):
            inputs = args[2]
            assert isinstance(inputs, steps.DecodeInputs)
            host = steps.DecodeInputs(np.asarray(inputs.packed), batch=inputs.batch)
            reserved = int(np.count_nonzero(host.reservations.table[2]))
            seen.append((inputs.packed, host.entries.copy(), reserved))
            return call(key, step, args, static)

        eng.runner._call_decode = spy
        finals = run_workload(eng, random_workload(5, n=6))
        assert_drained(eng)
        tokens[mode] = {k: v.token_ids for k, v in finals.items()}
        reserving = [n > 0 for _, _, n in seen]
        assert any(reserving) and not all(reserving), "the workload should have steps with and without reservations"
        assert all(set(e.tolist()) - {0} for _, e, _ in seen), "every decode call has a real row"
        if mode == "every_step":
            assert all(isinstance(p, np.ndarray) for p, _, _ in seen)
        else:
            assert all(isinstance(p, jax.Array) for p, _, _ in seen)
            assert len({id(p) for p, _, _ in seen}) < len(seen)  # reused while nothing changed
            assert eng.runner.inputs.reused > 0
    assert tokens["every_step"] == tokens["on_change"]
    with pytest.raises(ValueError, match="decode_inputs"):
        make_engine(decode_inputs="sometimes")


def test_decode_inputs_pack_entries_then_reservations():
    """steps.DecodeInputs: one int32 array, the entries first, then the reservations table
    row by row; the batch size is static (part of the pytree's structure), so a program
    splits it with static slices and one leaf travels to the device."""
    import jax

    from jaxoverlap import steps

    res = steps.Reservations.of([3, 4], [0, 1], [7, 8])  # [3, 2]
    inp = steps.DecodeInputs.of([1, 2, 0], res)
    np.testing.assert_array_equal(inp.packed, [1, 2, 0, 3, 4, 0, 1, 7, 8])
    np.testing.assert_array_equal(inp.entries, [1, 2, 0])
    np.testing.assert_array_equal(inp.reservations.table, res.table)
    assert len(jax.tree.leaves(inp)) == 1
    assert jax.tree.structure(inp) != jax.tree.structure(steps.DecodeInputs(inp.packed, batch=4))
    on_device = jax.device_put(inp)
    assert isinstance(on_device.packed, jax.Array) and on_device.batch == 3

    @jax.jit
    def split(i):
        return i.entries * 100 + i.reservations.pages[0], i.reservations.entries

    scaled, res_entries = split(on_device)
    np.testing.assert_array_equal(scaled, [107, 207, 7])
    np.testing.assert_array_equal(res_entries, [3, 4])
    assert steps.DecodeInputs.empty(2, 8).packed.shape == (2 + 3 * 8,)
