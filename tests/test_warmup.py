"""Engine.warmup compiles the decode programs ahead of use and runs each once on padding
rows: the first launches of those shapes then compile nothing, for plain decoding and for
a speculative drafter, and requests in flight during a warm-up are not disturbed."""
import jax
import pytest

from engine_fixtures import make_engine, run_workload, tiny_config
from jaxoverlap.sampling_params import SamplingParams

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts XLA backend compilations while installed (jax.monitoring has no unregister,
    so the listener stays and only counts while `active`)."""

    def __init__(self):
        self.active, self.count = False, 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name, _secs, **_):
        if self.active and name == COMPILE_EVENT:
            self.count += 1


COUNTER = CompileCounter()


@pytest.mark.parametrize("algo", [None, "ngram"])
def test_warmup_leaves_nothing_to_compile(algo):
    opts = dict(batch_buckets=(4,), max_context_len=64, disable_prefix_cache=True)
    if algo:
        opts["speculative_algorithm"] = algo
    eng = make_engine(**opts)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    # Prefill programs are not part of the warm-up: a first run of the same prompts compiles
    # the one they use. One new token each, in the normal loop, so that run launches no
    # decode step (the overlap loop would launch one before it sees the requests finish).
    eng.set_overlap(False)
    first = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    run_workload(eng, {0: [(f"w{i}", [5, 6, 7, 8, 9], first) for i in range(3)]})
    eng.set_overlap(True)
    assert not any(t.kind == "decode" for t in eng.timings)
    report = eng.warmup()
    r = eng.runner
    assert {(x["batch"], x["ctx_len"]) for x in report} == {(b, c) for b in r.batch_buckets for c in r.decode_ctx_buckets}
    assert len(report) >= 2 and all(x["seconds"] > 0 for x in report)
    # The decode steps run as the executables the warm-up compiled (one each on the CPU),
    # not through jit's call path.
    calls = []
    r._executables = {k: (lambda *a, _c=c: calls.append(1) or _c(*a), twin) for k, (c, twin) in r._executables.items()}
    COUNTER.active, COUNTER.count = True, 0
    try:
        finals = run_workload(eng, {0: [(f"r{i}", [5, 6, 7, 8, 9], params) for i in range(3)]})
    finally:
        COUNTER.active = False
    assert all(len(f.token_ids) == 6 for f in finals.values())
    assert COUNTER.count == 0, f"{COUNTER.count} programs compiled after the warm-up"
    assert len(calls) == sum(t.kind == "decode" for t in eng.timings) > 0


def test_warmup_of_sizes_between_buckets_compiles_their_buckets():
    eng = make_engine(batch_buckets=(2, 4), max_running_requests=4, max_context_len=64)
    for bad, message in (([0], "positive integers"), ([True], "positive integers"), ([5], "largest bucket")):
        with pytest.raises(ValueError, match=message):
            eng.warmup(batch_sizes=bad)
    ctx = eng.runner.decode_ctx_buckets
    report = eng.warmup(batch_sizes=[3, 4], ctx_lens=[ctx[0] - 1, 10_000])  # 3 runs as 4; past the table: its width
    assert {(x["batch"], x["ctx_len"]) for x in report} == {(4, ctx[0]), (4, ctx[-1])}


def test_the_check_can_fail():
    """Without the warm-up, a new decode bucket compiles on first use: the counter sees it."""
    # A model shape no other test uses, so jit's in-process cache cannot hold its programs.
    eng = make_engine(tiny_config(hidden_size=48), batch_buckets=(2,), max_context_len=64, disable_prefix_cache=True)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    COUNTER.active, COUNTER.count = True, 0
    try:
        run_workload(eng, {0: [("a", [1, 2, 3], params)]})
    finally:
        COUNTER.active = False
    assert COUNTER.count > 0


def test_warmup_with_speculation_paused_above_a_batch_size():
    """Above speculative_disable_by_batch_size the decode step is the paused program: the
    warm-up compiles, per batch bucket, the variants that bucket's sizes can need and no
    other, and a run whose batch crosses the limit compiles nothing."""
    eng = make_engine(batch_buckets=(1, 2, 4), max_running_requests=4, max_context_len=64, disable_prefix_cache=True,
                      speculative_algorithm="ngram_device", speculative_disable_by_batch_size=2)
    eng.set_overlap(False)
    first = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    run_workload(eng, {0: [(f"w{i}", [5, 6, 7, 8, 9], first) for i in range(3)]})  # compiles the prefill
    eng.set_overlap(True)
    report = eng.warmup()
    ctx = eng.runner.decode_ctx_buckets
    # Bucket 4 holds 3 or 4 rows, both above the limit: only its paused program.
    assert sorted((x["batch"], x["ctx_len"], x["draft"]) for x in report) == sorted(
        (b, c, d) for b, d in ((1, True), (2, True), (4, False)) for c in ctx)
    COUNTER.active, COUNTER.count = True, 0
    try:
        finals = run_workload(eng, {0: [(f"r{i}", [5, 6, 7, 8, 9], SamplingParams(
            max_new_tokens=n, temperature=0.0, ignore_eos=True)) for i, n in enumerate((4, 10, 16))]})
    finally:
        COUNTER.active = False
    assert [len(finals[f"r{i}"].token_ids) for i in range(3)] == [4, 10, 16]
    sizes = {t.batch_size for t in eng.timings if t.kind == "decode"}
    assert {1, 2, 3} <= sizes and eng.stats()["spec_paused_steps"] > 0
    assert COUNTER.count == 0, f"{COUNTER.count} programs compiled after the warm-up"


def test_the_engine_freezes_the_garbage_collector_once_built_and_after_warmup():
    """EngineConfig.freeze_gc: the objects alive once the engine is built (and once warmup
    compiled its programs) leave the collector's view, so that no full collection of them
    lands inside a step. gc.freeze is process-wide: conftest undoes it after each test."""
    import gc

    gc.unfreeze()
    eng = make_engine(freeze_gc=False)
    assert gc.get_freeze_count() == 0
    eng.warmup(batch_sizes=(1,))
    assert gc.get_freeze_count() == 0
    eng = make_engine()  # on by default
    assert gc.get_freeze_count() > 0
    gc.unfreeze()
    eng.warmup(batch_sizes=(1,))
    assert gc.get_freeze_count() > 0


@pytest.mark.parametrize("algo", [None, "ngram_device", "ngram"])
def test_warmup_while_requests_run_leaves_their_tokens_unchanged(algo):
    """The warm-up's padding-row steps read and write only the dummy entry and page: a
    warm-up between two steps of running requests (one step still in flight under
    overlap) changes none of their tokens."""
    opts = dict(batch_buckets=(2, 4), max_running_requests=4, max_context_len=64, disable_prefix_cache=True)
    if algo:
        opts["speculative_algorithm"] = algo
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": [3 + i, 9, 4, 1 + i, 7, 3 + i, 9] for i in range(3)}
    tokens = {}
    for warm in (False, True):
        eng = make_engine(**opts)
        for rid, prompt in prompts.items():
            eng.add_request(rid, prompt, params)
        finals = {}
        for i in range(200):
            if not eng.has_work():
                break
            if warm and i == 4:
                assert eng._inflight is not None  # a step is in flight across the warm-up
                eng.warmup()
            finals.update({o.request_id: o for o in eng.step() if o.finished})
        tokens[warm] = {rid: finals[rid].token_ids for rid in prompts}
        eng.check_integrity()
    assert all(len(t) == 10 for t in tokens[True].values())
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("mode", ["every_step", "on_change"])
def test_warmup_runs_programs_with_the_input_kind_the_engine_launches_with(mode):
    """On the H200 a speculative program that first ran with numpy inputs compiled once more
    at its first launch with a device array, and the other way round (benchmarks/RESULTS.md,
    2026-12-04, fifth session). So the warm-up's runs pass the input array as the engine's
    decode_inputs will: numpy with every_step, a device array with on_change."""
    import numpy as np

    from jaxoverlap import steps

    eng = make_engine(batch_buckets=(2, 4), max_running_requests=4, max_context_len=64, disable_prefix_cache=True,
                      speculative_algorithm="ngram_device", decode_inputs=mode)
    kinds = []
    call = eng.runner._call_decode

    def spy(key, step, args, static):
        inputs = next(a for a in args if isinstance(a, steps.DecodeInputs))
        kinds.append(type(inputs.packed))
        return call(key, step, args, static)

    eng.runner._call_decode = spy
    report = eng.warmup()
    assert len(kinds) == len(report) * (2 if eng.runner.alternate_executables else 1) > 0
    if mode == "every_step":
        assert all(k is np.ndarray for k in kinds)
    else:
        assert all(issubclass(k, jax.Array) for k in kinds)


def _prefill_workload():
    """Prompts of several lengths (one longer than a chunk), alone and two at a time, one
    repeated so that it hits the prefix cache: prefills of every row and token bucket, with
    different numbers of reservations."""
    p = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=4, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    long = [(7 * i) % 90 + 1 for i in range(40)]
    return {0: [("a", [5, 6, 7], p)], 3: [("b", long, p), ("c", [9] * 20, p)],
            12: [("d", long, p), ("e", [4, 4, 8, 1], sampled)]}


@pytest.mark.parametrize("algo", [None, "ngram_device"])
def test_warmup_with_prefill_leaves_nothing_to_compile(algo):
    """warmup(prefill=True) also compiles every prefill program (each rows x tokens bucket;
    the reservations table has a fixed size per rows bucket, so their count is no part of
    the shape): requests of any prompt length, batched or alone, prefix hits included,
    greedy or sampled, then compile nothing, as `jaxoverlap serve --precompile all` promises
    (decode programs greedy and sampling, one prefill program per shape, which samples).
    The same workload without the prefill programs does compile (the check can fail)."""
    spec = {"speculative_algorithm": algo} if algo else {}
    opts = dict(batch_buckets=(4,), max_context_len=64, max_prefill_requests=2, chunked_prefill_size=32, **spec)
    # Model shapes no other test uses, so that jit's in-process cache holds none of their programs.
    counts = {}
    for hidden, prefill in ((40, False), (56, True)):
        eng = make_engine(tiny_config(hidden_size=hidden), **opts)
        report = eng.warmup(prefill=prefill, sampling=(False, True))
        r = eng.runner
        assert {x["sampling"] for x in report if x["program"] == "decode"} == {False, True}
        pre = sorted((x["rows"], x["tokens"], x["ctx_len"]) for x in report if x["program"] == "prefill")
        # Every shape the scheduler can launch: R x T within the chunk budget, or one row.
        budget = eng.config.chunked_prefill_size
        every = [(R, T, c) for R in r.prefill_row_buckets for T in r.prefill_len_buckets for c in r.prefill_ctx_buckets
                 if R * T <= budget or R == 1]
        assert len(every) < len(r.prefill_row_buckets) * len(r.prefill_len_buckets) * len(r.prefill_ctx_buckets)
        assert pre == (sorted(every) if prefill else [])
        calls = []
        if prefill:  # the prefills run as the executables the warm-up compiled, not through jit
            assert len(r._prefill_executables) == len(pre)
            r._prefill_executables = {k: (lambda *a, _c=c, _k=k: calls.append(_k) or _c(*a))
                                      for k, c in r._prefill_executables.items()}
        COUNTER.active, COUNTER.count = True, 0
        try:
            finals = run_workload(eng, _prefill_workload())
        finally:
            COUNTER.active = False
        assert len(calls) == (sum(t.kind == "prefill" for t in eng.timings) if prefill else 0)
        # The engine counts the launches that compiled (Engine.stats, the server's metrics).
        loop = eng.stats()["loop"]
        assert loop["compiling_launches"] == sum(t.compiled > 0 for t in eng.timings)
        assert (loop["compiling_launches"] > 0) == (loop["compiling_launch_s"] > 0) == (COUNTER.count > 0)
        assert sorted(finals) == ["a", "b", "c", "d", "e"] and all(len(f.token_ids) == 4 for f in finals.values())
        assert finals["d"].metrics.cached_prompt_tokens > 0  # "d" repeats "b": a prefix hit
        sizes = {t.batch_size for t in eng.timings if t.kind == "prefill"}
        assert sizes == {1, 2}, sizes
        counts[prefill] = COUNTER.count
    assert counts[False] > 0, "the workload compiles nothing without the prefill warm-up: the check cannot fail"
    assert counts[True] == 0, f"{counts[True]} programs compiled after warmup(prefill=True)"


def test_prefill_programs_serve_every_context_with_length_adaptive_attention():
    """With the Pallas kernels (length-adaptive), a prefill's program does not depend on its
    context: every prefill batch launches at the table's width. The XLA gather path keeps
    the context buckets. Both give the same greedy tokens."""
    from jaxoverlap.scheduler import BatchRow, ScheduledBatch

    outs = {}
    for backend in ("xla", "pallas"):
        eng = make_engine(attention_backend=backend, max_context_len=128, batch_buckets=(2,))
        r = eng.runner
        short = ScheduledBatch("prefill", [BatchRow(None, 0, start=0, length=5, is_last=True)], [], 5)  # ctx_len 5
        want = r.table_width if backend == "pallas" else r.ctx_buckets[0]
        assert r._ctx_len(short) == want
        assert (len(r.prefill_ctx_buckets) == 1) == (backend == "pallas")
        p = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
        finals = run_workload(eng, {0: [("a", [3, 4, 5], p), ("b", list(range(1, 40)), p)]})
        outs[backend] = {k: v.token_ids for k, v in finals.items()}
    assert outs["xla"] == outs["pallas"]


def test_compilation_cache_dir_auto_means_a_user_cache_on_a_gpu_only(monkeypatch, tmp_path):
    """EngineConfig.compilation_cache_dir: a folder as given; "none" or None: none; "auto"
    (the serve default): the user's cache folder on a GPU, unless JAX_COMPILATION_CACHE_DIR
    already set JAX's own, and none on a CPU."""
    from jaxoverlap import engine as engine_mod

    resolve = engine_mod.compilation_cache_dir
    assert resolve(None) is None and resolve("none") is None and resolve("None") is None
    assert resolve(str(tmp_path)) == str(tmp_path)
    assert jax.default_backend() == "cpu" and resolve("auto") is None
    monkeypatch.setattr(engine_mod.jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    before = jax.config.jax_compilation_cache_dir
    try:  # nothing compiles meanwhile, so no cache is opened
        jax.config.update("jax_compilation_cache_dir", None)
        assert resolve("auto") == str(tmp_path / "jaxoverlap" / "jax_compilation_cache")
        jax.config.update("jax_compilation_cache_dir", "/elsewhere")
        assert resolve("auto") is None  # JAX keeps the folder it was given
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_serve_keeps_compiled_programs_by_default():
    """`jaxoverlap serve` asks for the "auto" compilation cache unless told a folder or none."""
    import argparse

    from jaxoverlap import cli
    from jaxoverlap.server import cli_commands

    p = argparse.ArgumentParser()
    cli.add_engine_args(p)
    cli_commands.add_serve_args(p)
    for argv, want in (([], "auto"), (["--compilation-cache-dir", "/tmp/c"], "/tmp/c"),
                       (["--compilation-cache-dir", "none"], "none")):
        config, _ = cli_commands.serve_engine_config(cli.engine_options(p.parse_args(argv)))
        assert config.compilation_cache_dir == want
    assert cli_commands.serve_worker_options(p.parse_args([])) == dict(
        warmup=True, precompile="auto", precompile_prefill=False, precompile_top_logprobs=False,
        precompile_structured=False, precompile_prompt_logprobs=False)
    argv = ["--precompile", "all", "--precompile-top-logprobs", "--precompile-structured",
            "--precompile-prompt-logprobs"]
    assert cli_commands.serve_worker_options(p.parse_args(argv)) == dict(
        warmup=True, precompile=True, precompile_prefill=True, precompile_top_logprobs=True,
        precompile_structured=True, precompile_prompt_logprobs=True)
    with pytest.raises(SystemExit, match="needs --precompile all"):  # prompt logprobs are prefill programs
        cli_commands.serve_worker_options(p.parse_args(["--precompile", "on", "--precompile-prompt-logprobs"]))


def test_compile_watch_counts_compilations_of_its_own_thread_only():
    """CompileWatch counts programs compiled on the thread that entered it (the engine's
    launches), not compilations on other threads meanwhile (a warm-up's pool)."""
    import threading

    import jax.numpy as jnp

    from jaxoverlap.compile_watch import CompileWatch

    a, b, c = jnp.arange(7), jnp.arange(9), jnp.arange(5)  # made outside: making them compiles too
    watch = CompileWatch()
    with watch:
        t = threading.Thread(target=lambda: jax.jit(lambda x: x * 3 + 11)(a).block_until_ready())
        t.start()
        t.join()
        assert watch.programs == 0
        jax.jit(lambda x: x * 5 - 13)(b).block_until_ready()  # a new program, compiled on this thread
        assert watch.programs == 1
    jax.jit(lambda x: x * 7 + 17)(c).block_until_ready()  # after the block
    assert watch.programs == 1


def test_warmup_with_top_logprobs_leaves_nothing_to_compile():
    """warmup(top_logprobs=True) (`jaxoverlap serve --precompile-top-logprobs`) also compiles
    each program's variant that returns top logprobs, so that requests asking for them,
    among others that do not, compile nothing; without it the same workload compiles the
    variants on first use (the check can fail)."""
    opts = dict(batch_buckets=(4,), max_context_len=64, max_prefill_requests=2, chunked_prefill_size=32)
    top = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, top_logprobs=3)
    plain = SamplingParams(max_new_tokens=4, temperature=0.7, ignore_eos=True)
    workload = {0: [("a", [3, 4, 5, 6, 7, 8], top), ("b", [9, 10, 11], plain)],
                2: [("c", list(range(2, 22)), plain)], 5: [("d", [5, 5, 6], top)]}
    counts = {}
    # Model shapes no other test uses, so that jit's in-process cache holds none of their programs.
    for hidden, with_top in ((72, False), (88, True)):
        eng = make_engine(tiny_config(hidden_size=hidden, head_dim=hidden // 4), **opts)
        report = eng.warmup(prefill=True, sampling=(False, True), top_logprobs=with_top)
        assert {x["top_logprobs"] for x in report} == ({False, True} if with_top else {False})
        COUNTER.active, COUNTER.count = True, 0
        try:
            finals = run_workload(eng, workload)
        finally:
            COUNTER.active = False
        assert all(len(f.token_ids) == 4 for f in finals.values())
        counts[with_top] = COUNTER.count
    # Everything else was warmed up, so what compiles here is the top-logprobs variants.
    assert counts[False] > 0, "top logprobs compile nothing without their warm-up: the check cannot fail"
    assert counts[True] == 0, f"{counts[True]} programs compiled after warmup(top_logprobs=True)"


@pytest.mark.parametrize("algo, hidden_sizes", [(None, (136, 152)), ("eagle", (168,))])
def test_warmup_with_prompt_logprobs_leaves_nothing_to_compile(algo, hidden_sizes):
    """warmup(prefill=True, prompt_logprobs=True) (`jaxoverlap serve --precompile all
    --precompile-prompt-logprobs`) also compiles each prefill program's variant that returns
    the prompt's logprobs: scoring requests among plain ones then compile nothing (with a
    drafter too, whose prefill scores one column fewer). Without it the same workload
    compiles them on first use: that control runs once (no drafter)."""
    opts = dict(batch_buckets=(4,), max_context_len=64, max_prefill_requests=2, chunked_prefill_size=32)
    if algo:
        opts["speculative_algorithm"] = algo
    score = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    plain = SamplingParams(max_new_tokens=4, temperature=0.7, ignore_eos=True)
    long_prompt = list(range(2, 42))  # 40 tokens: two chunks of the 32-token budget
    workload = {0: [("a", [3, 4, 5, 6, 7, 8], score), ("b", [9, 10, 11], plain)],
                2: [("c", long_prompt, score)], 4: [("d", [5, 5, 6], plain)]}
    counts = {}
    for hidden, warm in zip(hidden_sizes, (False, True) if len(hidden_sizes) == 2 else (True,)):
        eng = make_engine(tiny_config(hidden_size=hidden, head_dim=hidden // 4), **opts)
        report = eng.warmup(prefill=True, sampling=(False, True), prompt_logprobs=warm)
        prefills = [x for x in report if x["program"] == "prefill"]
        assert {x["prompt_logprobs"] for x in prefills} == ({False, True} if warm else {False})
        # Each prefill launch looks up the warm-up's executable by its key (runner._prefill_key,
        # whose 6th field is prompt_logprobs): record whether it found one. (A jit call of the
        # same shapes would reuse the compiled program without it, so the compile count alone
        # would not see a key that differs.)
        lookups = []

        class Recording(dict):
            def get(self, key, default=None):
                found = super().get(key, default)
                lookups.append((key[5], found is not None))
                return found

        eng.runner._prefill_executables = Recording(eng.runner._prefill_executables)
        COUNTER.active, COUNTER.count = True, 0
        try:
            finals = run_workload(eng, workload)
        finally:
            COUNTER.active = False
        # A logprob for every prompt token but the first (None), over both chunks of "c".
        assert len(finals["a"].prompt_logprobs) == 6 and len(finals["c"].prompt_logprobs) == 40
        assert all(lp is not None and lp <= 0 for lp in finals["c"].prompt_logprobs[1:])
        assert len(finals["b"].token_ids) == 4
        scoring = [found for is_scoring, found in lookups if is_scoring]
        assert len(scoring) >= 3, lookups  # "a" and both chunks of "c"
        assert all(found for _, found in lookups) if warm else not any(scoring), lookups
        counts[warm] = COUNTER.count
    if False in counts:
        assert counts[False] > 0, "prompt logprobs compile nothing without their warm-up: the check cannot fail"
    assert counts[True] == 0, f"{counts[True]} programs compiled after warmup(prompt_logprobs=True)"
    with pytest.raises(ValueError, match="prefill=True"):
        eng.warmup(prompt_logprobs=True)


# With a drafter: EAGLE only (the device n-gram drafter's speculative step has the same
# split programs; its constrained outputs are test_spec_structured's).
@pytest.mark.parametrize("algo, hidden_sizes", [(None, (56, 104)), ("eagle", (120,))])
def test_warmup_with_structured_leaves_nothing_to_compile(algo, hidden_sizes):
    """warmup(structured=True) (`jaxoverlap serve --precompile-structured`) also compiles the
    forward and sampling programs of decode batches with structured output (with a drafter,
    each speculative step's draft, verify and accept programs), and with prefill=True each
    prefill's variant with allowed tokens: constrained requests among plain ones then
    compile nothing. Without it the same workload compiles them on first use, which shows
    the check can fail; that control runs once (no drafter), for the suite's time: with a
    drafter, the constrained text (possible only through the allowed-token programs) shows
    that the workload ran them."""
    from jaxoverlap.models.loader import default_model_path
    from jaxoverlap.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(default_model_path())
    opts = dict(batch_buckets=(4,), max_context_len=64, max_prefill_requests=2, chunked_prefill_size=32)
    word = SamplingParams(max_new_tokens=8, temperature=0.0, structured_output={"regex": "[a-z]{4,6}"})
    plain = SamplingParams(max_new_tokens=6, temperature=0.7, ignore_eos=True)
    workload = {0: [("a", [3, 4, 5, 6, 7, 8], word), ("b", [9, 10, 11], plain)],
                2: [("c", list(range(2, 22)), plain)], 4: [("d", [5, 5, 6], word)]}
    if algo:
        opts["speculative_algorithm"] = algo
    split = {"spec_split"} if algo else {"forward", "sample"}
    counts = {}
    # Model shapes no other test uses, so that jit's in-process cache holds none of their programs.
    for hidden, structured in zip(hidden_sizes, (False, True) if len(hidden_sizes) == 2 else (True,)):
        eng = make_engine(tiny_config(vocab_size=tokenizer.vocab_size, hidden_size=hidden, head_dim=hidden // 4),
                          tokenizer=tokenizer, **opts)
        report = eng.warmup(prefill=True, sampling=(False, True), structured=structured)
        programs = {x["program"] for x in report}
        assert programs == ({"decode", "prefill"} | split if structured else {"decode", "prefill"})
        COUNTER.active, COUNTER.count = True, 0
        try:
            finals = run_workload(eng, workload)
        finally:
            COUNTER.active = False
        text = tokenizer.decode(finals["a"].token_ids)
        assert 4 <= len(text) <= 6 and text.isalpha() and text.islower(), text
        assert len(finals["b"].token_ids) == 6
        counts[structured] = COUNTER.count
    if False in counts:
        assert counts[False] > 0, "structured output compiles nothing without its warm-up: the check cannot fail"
    assert counts[True] == 0, f"{counts[True]} programs compiled after warmup(structured=True)"


def test_precompile_on_a_cpu_stops_with_a_clear_error_before_memory_mappings_run_out(monkeypatch):
    """XLA:CPU holds memory mappings per compiled program; past vm.max_map_count LLVM would
    abort the process. With too few mappings left, the precompile stops (the queued
    programs are skipped) and says why, instead."""
    from jaxoverlap import runner as runner_module

    assert runner_module.memory_map_headroom() > 0  # Linux: the limit and the maps are readable
    eng = make_engine(batch_buckets=(2, 4), max_context_len=64, disable_prefix_cache=True)
    headroom = iter([runner_module.CPU_MAP_RESERVE + 1, runner_module.CPU_MAP_RESERVE - 1])
    monkeypatch.setattr(runner_module, "memory_map_headroom", lambda: next(headroom, 0))
    with pytest.raises(runner_module.PrecompileLimitError, match="vm.max_map_count"):
        eng.warmup(threads=1)
    jobs = len(eng.runner.batch_buckets) * len(eng.runner.decode_ctx_buckets)
    assert jobs > 2 and len(eng.runner._executables) == 2  # the third and later were skipped


def test_programs_compile_on_one_thread_per_core_at_most_16(monkeypatch):
    from jaxoverlap import runner

    for cores, want in ((2, 2), (16, 16), (64, 16)):
        monkeypatch.setattr(runner.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)), raising=False)
        assert runner.default_compile_threads() == want
