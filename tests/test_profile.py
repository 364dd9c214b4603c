"""`jaxoverlap profile`: trace parsing on synthetic events (step attribution, gaps, overlap
with zero gaps, GPU correlation ids), and real runs on CPU (the tiny test engine through
the API, the embedded default model through the CLI)."""
from __future__ import annotations

import gzip
import json
import os
import tempfile

import numpy as np
import pytest

from jaxoverlap.profiling import trace

HOST, PY = 1, 10  # host process and its Python thread
CPU_POOL = 11  # an XLA CPU worker thread
WORKER = 12  # a PJRT worker thread (GPU copies' host events)
GPU, STREAM, H2D, D2H, DERIVED = 2, 20, 21, 22, 23


def proc(pid, name):
    return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}


def thread(pid, tid, name):
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def x(name, ts, dur, pid=HOST, tid=PY, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


def launch(k, ts, dur=10.0, kind="decode", program="decode_step"):
    """A launch span with its (doubly nested, as JAX writes it) PjitFunction inside."""
    return [x("jaxoverlap.launch", ts, dur, kind=kind, size="4", iteration=str(100 + k)),
            x(f"PjitFunction({program})", ts + 1, dur - 2), x(f"PjitFunction({program})", ts + 1, dur - 2)]


def cpu_execution(run_id, start, n_ops=4, op_us=5.0, program="jit_decode_step"):
    """One program execution on the CPU thunk runtime: n back-to-back thunks (plus the
    `end:` markers and ThunkExecutor span, which are no ops)."""
    ev = [x("ThunkExecutor::Execute", start, n_ops * op_us, tid=CPU_POOL)]
    for i in range(n_ops):
        ts = start + i * op_us
        ev.append(x(f"fusion.{i}", ts, op_us, tid=CPU_POOL, hlo_module=program, hlo_op=f"fusion.{i}", run_id=run_id))
        ev.append(x(f"end: fusion.{i}", ts + op_us - 0.1, 0.05, tid=CPU_POOL))
    return ev


def cpu_header():
    return [proc(HOST, "/host:CPU"), thread(HOST, PY, "python"), thread(HOST, CPU_POOL, "tf_XLAPjRtCpuClient/1")]


def test_normal_loop_cpu_steps_and_gaps():
    # Launch k at 100k; its execution starts 15 us later, runs 20 us: gaps of 80 us.
    ev = cpu_header()
    for k in range(4):
        ev += launch(k, 100.0 * k)
        ev += cpu_execution(str(500 + k), 100.0 * k + 15)
    a = trace.attribute_events(ev)
    assert a.platform == "cpu"
    assert [s.launch.index for s in a.steps] == [0, 1, 2, 3]
    assert [s.launch.iteration for s in a.steps] == [100, 101, 102, 103]
    assert all(s.launch.programs == ("decode_step",) for s in a.steps)  # nested duplicate dropped
    for k, s in enumerate(a.steps):
        assert {o.run_id for o in s.ops} == {str(500 + k)}
        assert len(s.ops) == 4  # `end:` markers and ThunkExecutor::Execute are no ops
        assert s.start == pytest.approx(100.0 * k + 15) and s.span == pytest.approx(20.0)
    assert a.gaps() == pytest.approx([80.0, 80.0, 80.0])
    assert a.methods == {"program_order": 16} and not a.unplaced


def test_overlap_zero_gaps_attributed_by_launch_not_by_time():
    # Overlap: launch k+1 happens while execution k still runs, executions back to back.
    # Time order alone would give the tail of execution k to launch k+1; gap splitting
    # would see one long step.
    ev = cpu_header()
    for k in range(5):
        ev += launch(k, 100.0 * k)
        ev += cpu_execution(str(700 + k), 20.0 + 100.0 * k, n_ops=4, op_us=25.0)  # [20+100k, 120+100k]
    a = trace.attribute_events(ev)
    assert len(a.steps) == 5
    for k, s in enumerate(a.steps):
        assert {o.run_id for o in s.ops} == {str(700 + k)}
        assert s.span == pytest.approx(100.0)
        assert s.launch.end < s.end and s.end > 100.0 * (k + 1)  # ran past the next launch
    assert a.gaps() == pytest.approx([0.0] * 4)


def test_execution_from_before_the_trace_stays_unplaced():
    ev = cpu_header()
    ev += cpu_execution("1", 0.0, op_us=30.0)  # launched before the trace began: [0, 120]
    for k in range(3):
        ev += launch(k, 50.0 + 100.0 * k)
        ev += cpu_execution(str(2 + k), 120.0 + 100.0 * k, op_us=25.0)
    a = trace.attribute_events(ev)
    assert [{o.run_id for o in s.ops} for s in a.steps] == [{"2"}, {"3"}, {"4"}]
    assert {o.run_id for o in a.unplaced} == {"1"} and len(a.unplaced) == 4


def test_overlap_step_in_flight_when_the_trace_starts_is_not_given_to_the_first_launch():
    # Overlap: the step launched before the trace (run "1") only starts on the device after
    # the first traced launch span has begun. Launch order alone would hand it to launch 0
    # (and launch 0's own execution, "2", would then go unplaced); there are more
    # executions than launches, and the trace ends on a completed step, so the extra one is
    # the oldest.
    ev = cpu_header()
    ev += launch(0, 0.0)
    ev += cpu_execution("1", 20.0, op_us=25.0)  # [20, 120]: launched before the trace
    ev += cpu_execution("2", 120.0, op_us=25.0)  # launch 0's step, queued behind it
    for k in (1, 2):
        ev += launch(k, 100.0 * k + 50.0)
        ev += cpu_execution(str(2 + k), 120.0 + 100.0 * k, op_us=25.0)
    a = trace.attribute_events(ev)
    assert [{o.run_id for o in s.ops} for s in a.steps] == [{"2"}, {"3"}, {"4"}]
    assert {o.run_id for o in a.unplaced} == {"1"}
    assert a.gaps() == pytest.approx([0.0, 0.0])


def test_programs_matched_by_name_and_order():
    # A prefill launch and a decode launch whose executions start in the other order: the
    # names, not the start times, decide.
    ev = cpu_header()
    ev += launch(0, 0.0, kind="prefill", program="prefill_step")
    ev += launch(1, 20.0, kind="decode", program="decode_step")
    ev += cpu_execution("9", 40.0, program="jit_decode_step")
    ev += cpu_execution("8", 70.0, program="jit_prefill_step")
    a = trace.attribute_events(ev)
    by_kind = {s.launch.kind: {o.run_id for o in s.ops} for s in a.steps}
    assert by_kind == {"prefill": {"8"}, "decode": {"9"}}
    # Gaps follow launch order: here the decode ran before the prefill ended.
    assert a.gaps() == pytest.approx([40.0 - 90.0])
    assert a.gaps(("decode",)) == []  # no decode -> decode pair


def gpu_trace(n_steps=4, step_us=1000.0, gap_us=0.0, kernels=5):
    """As JAX 0.11 on an H200 writes it: a step's kernels on the compute stream with the
    correlation id of the cuGraphLaunch inside its launch span, an input copy (H2D) whose
    host event is on a PJRT worker thread during the launch, and an output copy (D2H) on its
    own stream whose host event fires when the kernels are done (here inside the next
    launch span, as under overlap); plus a derived 'XLA Ops' row that repeats the kernels.
    No run ids."""
    ev = [proc(HOST, "/host:CPU"), thread(HOST, PY, "python"), thread(HOST, WORKER, "pjrt_async_work_runner/1"),
          proc(GPU, "/device:GPU:0"), thread(GPU, STREAM, "Stream #14(Compute)"),
          thread(GPU, H2D, "Stream #15(MemcpyH2D)"), thread(GPU, D2H, "Stream #16(MemcpyD2H)"),
          thread(GPU, DERIVED, "XLA Ops")]
    cid = 0
    for k in range(n_steps):
        ts = 300.0 + k * (step_us + gap_us)  # host launches step k while step k-1 runs
        t_dev = 500.0 + k * (step_us + gap_us)
        ev.append(x("jaxoverlap.launch", ts, 400.0, kind="decode", size="1", iteration=str(k)))
        cid += 1
        ev.append(x("MemcpyH2D", ts + 20, 5.0, tid=WORKER, correlation_id=str(cid)))
        ev.append(x("MemcpyH2D", t_dev - 10, 2.0, pid=GPU, tid=H2D, correlation_id=str(cid)))
        cid += 1
        ev.append(x("cuGraphLaunch (CudaGraph:1)", ts + 100, 50.0, correlation_id=str(cid)))
        for i in range(kernels):
            kt = t_dev + i * step_us / kernels
            ev.append(x(f"loop_fusion_{i}", kt, step_us / kernels, pid=GPU, tid=STREAM, correlation_id=str(cid),
                        hlo_module="jit_decode_step"))
            ev.append(x(f"loop_fusion_{i}", kt, step_us / kernels, pid=GPU, tid=DERIVED))
        cid += 1
        ev.append(x("MemcpyD2H", t_dev + step_us + 10, 5.0, tid=WORKER, correlation_id=str(cid)))
        ev.append(x("MemcpyD2H", t_dev + step_us + 20, 50.0, pid=GPU, tid=D2H, correlation_id=str(cid)))
    return ev


@pytest.mark.parametrize("gap_us", [0.0, 280.0])
def test_gpu_correlation_ids(gap_us):
    a = trace.attribute_events(gpu_trace(gap_us=gap_us))
    assert a.platform == "gpu"
    assert len(a.steps) == 4 and not a.unplaced
    # 5 kernels + the input copy by correlation id, the output copy after its step; the
    # derived row is no ops.
    assert a.methods == {"correlation_id": 4 * 6, "after_step": 4}
    for k, s in enumerate(a.steps):
        assert len(s.ops) == 7 and sum(o.is_copy for o in s.ops) == 2 and sum(o.is_d2h for o in s.ops) == 1
        (d2h,) = [o for o in s.ops if o.is_d2h]
        assert d2h.ts == pytest.approx(500.0 + k * (1000.0 + gap_us) + 1020.0)  # its own step's outputs
        assert s.span == pytest.approx(1000.0)  # kernels only: the copies lie outside
    assert a.gaps() == pytest.approx([gap_us] * 3)


def _drop_args(events, *keys):
    for e in events:
        for k in keys:
            (e.get("args") or {}).pop(k, None)
    return events


@pytest.mark.parametrize("gap_us", [0.0, 280.0])
def test_gpu_without_correlation_ids_cuts_executions_by_kernel_names(gap_us):
    ev = gpu_trace(gap_us=gap_us)
    # The tail of a step launched before the trace began: stays unplaced.
    ev += [x(f"loop_fusion_{i}", 200.0 + 100 * j, 100.0, pid=GPU, tid=STREAM, hlo_module="jit_decode_step")
           for j, i in enumerate((3, 4))]
    a = trace.attribute_events(_drop_args(ev, "correlation_id"))
    assert len(a.steps) == 4 and a.methods["program_order"] == 4 * 5
    for k, s in enumerate(a.steps):
        kernels = [o for o in s.ops if not o.is_copy]
        assert [o.name for o in kernels] == [f"loop_fusion_{i}" for i in range(5)]
        assert kernels[0].ts == pytest.approx(500.0 + k * (1000.0 + gap_us))
    assert a.gaps() == pytest.approx([gap_us] * 3)
    assert sorted(o.ts for o in a.unplaced if not o.is_copy) == [200.0, 300.0]


def test_gpu_without_any_ids_falls_back_to_time_order():
    a = trace.attribute_events(_drop_args(gpu_trace(gap_us=280.0), "correlation_id", "hlo_module"))
    assert a.methods == {"time_order": 4 * 7} and len(a.steps) == 4


def test_name_period():
    assert trace.name_period(list("abcabcab")) == 3
    assert trace.name_period(list("abcab")) is None  # fewer than two whole periods
    assert trace.name_period(list("abcabd")) is None


def test_helpers_and_loading(tmp_path):
    assert trace.union_length([(0, 10), (5, 12), (20, 25)]) == 17
    assert trace.normalize_program("jit_decode_step") == "decode_step"
    assert trace.normalize_program("PjitFunction(decode_step)") == "decode_step"
    assert trace.normalize_program("jit_decode_step(42)") == "decode_step"
    assert trace.normalize_program("PjitFunction(jit(decode_step))") == "decode_step"  # a compiled executable's call
    d = tmp_path / "plugins" / "profile" / "run1"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": gpu_trace()}, f)
    assert len(trace.attribute_events(trace.load_events(str(tmp_path))).steps) == 4


# -- real runs ---------------------------------------------------------------------------------------
def test_profile_api_on_tiny_engine():
    from engine_fixtures import make_engine

    from jaxoverlap.profiling import capture, report

    engine = make_engine()
    w = capture.Workload(batch_size=4, prompt_len=12, new_tokens=14)
    results = capture.profile(engine, [w], repeats=1, window=capture.TraceWindow(steps=6, skip=2), log=lambda s: None)
    rep = report.build(results, {})
    (b,) = rep["batches"]
    for mode in ("overlap", "normal"):
        run, traced, m = results[0].timed[mode][0], results[0].traced[mode], b["modes"][mode]
        assert run.tokens == traced.tokens == 4 * 14
        # Host numbers are those of engine.timings.
        dec = [t for t in run.timings if t.kind == "decode"]
        assert m["host"]["iterations"] == len(dec) > 0
        for part in ("prepare", "launch", "wait", "process"):
            assert m["host"][f"{part}_ms"]["median"] == pytest.approx(np.median([getattr(t, f"{part}_s") for t in dec]) * 1e3)
            assert m["host"]["totals_s"][part] == pytest.approx(sum(getattr(t, f"{part}_s") for t in run.timings))
        tot = m["host"]["totals_s"]
        timed_sum = tot["prepare"] + tot["launch"] + tot["wait"] + tot["process"] + tot["fresh_wait"]
        assert 0.5 * tot["wall"] < timed_sum <= tot["wall"]  # the rest is loop overhead
        # Every traced launch span names the loop iteration whose StepTiming it belongs to.
        a = traced.attribution
        assert len(a.launches) == 6
        for s in a.steps:
            t = traced.timings[s.launch.iteration]
            assert (t.kind, t.batch_size) == (s.launch.kind, s.launch.size) == ("decode", 4)
        d = m["device"]
        assert d["platform"] == "cpu" and d["decode_steps"] >= 5
        assert set(d["placed_by"]) == {"program_order"}  # CPU traces carry no correlation ids
        assert d["step_ms"]["median"] > 0 and d["busy_ms"]["median"] <= d["step_ms"]["median"] + 1e-9
        assert d["gap_ms"]["n"] >= 4
    assert b["modes"]["normal"]["device"]["ops_unplaced"] == 0  # nothing in flight when the trace starts
    # The normal loop launches a step only after the device finished the one before, so
    # with the ops given to the right steps each launch follows the previous step's last op,
    # and the device idles between steps.
    steps = results[0].traced["normal"].attribution.steps
    assert all(b_.launch.ts >= a_.end - 1.0 for a_, b_ in zip(steps, steps[1:]))
    assert b["modes"]["normal"]["device"]["gap_ms"]["min"] > 0
    # (Whether overlap shrinks the gap on CPU depends on the cores: with 2, the host thread
    # slows XLA's worker threads down, and the tiny model's step is shorter than the host's.)


def test_profile_compiles_every_decode_program_before_timing():
    """With speculation requests finish at different steps, so the batch shrinks through
    smaller buckets in a pattern each run's fresh prompts change: the profile compiles
    every decode program the workload can meet first, and no timed run compiles one."""
    import logging

    import jax

    from engine_fixtures import make_engine

    from jaxoverlap.profiling import capture

    # Pages of 16 and contexts of 64, 128, 256: the reservation's slack of two pages takes
    # the last steps past 64 (the profile left it out, and the timed runs compiled).
    engine = make_engine(speculative_algorithm="ngram_device", speculative_num_steps=2, page_size=16,
                         max_context_len=256, batch_buckets=(1, 2, 4, 8))
    w = capture.Workload(batch_size=4, prompt_len=20, new_tokens=14)
    batch_sizes, ctx_lens = capture.decode_programs(engine, w)
    assert batch_sizes == [1, 2, 4] and ctx_lens == [64, 128]
    engine.warmup(batch_sizes, ctx_lens)

    compiled = []

    class Catch(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if msg.startswith("Compiling ") and "decode_step" in msg:
                compiled.append(msg[:80])

    handler, logger = Catch(), logging.getLogger("jax")
    logger.addHandler(handler)
    runner = capture.WorkloadRunner(engine)
    try:
        with jax.log_compiles(True):
            runs = [runner.run(w, mode) for _ in range(2) for mode in capture.MODES]
    finally:
        logger.removeHandler(handler)
    sizes = {t.batch_size for r in runs for t in r.timings if t.kind == "decode"}
    assert min(sizes) < 4  # the batch did shrink, so smaller programs were needed
    assert compiled == []


def test_profile_cli_writes_json_and_plots(tmp_path, capsys):
    from jaxoverlap.cli import main

    out = tmp_path / "prof"
    rc = main(["profile", "--out", str(out), "--batch-size", "1", "2", "--prompt-len", "8", "--new-tokens", "10",
               "--steps", "4", "--repeats", "1", "--max-running-requests", "4", "--max-context-len", "64",
               "--kv-cache-tokens", "512", "--whole-run"])
    assert rc == 0
    rep = json.loads((out / "profile.json").read_text())
    assert [b["batch_size"] for b in rep["batches"]] == [1, 2]
    for b in rep["batches"]:
        # The run traced whole: its prefill and all of its decode steps (10 tokens: the
        # first from prefill, 9 decode steps, plus one the overlap loop launches before it
        # sees the requests finish).
        bd = b["bound"]
        assert bd["steps"]["prefill"] >= 1 and bd["steps"]["decode"] >= 9
        assert 0 < bd["prefill_busy_ms"] < bd["device_busy_ms"] <= bd["run_ms"]
        assert bd["run_over_bound"] == pytest.approx(bd["run_ms"] / bd["device_busy_ms"])
        # Busy and idle moments tile the run.
        idle = {k: v for k, v in bd["idle"].items() if k != "longest"}
        assert bd["device_busy_ms"] + sum(v["ms"] for v in idle.values()) == pytest.approx(bd["run_ms"])
        assert bd["idle"]["longest"][0]["ms"] == max(v["max_ms"] for v in idle.values())
        e = b["modes"]["overlap"]["edges"]
        assert e["runs"] == 1 and e["head_ms"] > 0 and e["tail_ms"] >= 0 and e["middle_ms"] > 0
        assert e["head_ms"] + e["middle_ms"] + e["tail_ms"] == pytest.approx(e["wall_ms"])
        assert set(b["modes"]) == {"overlap", "normal"}
        for m in b["modes"].values():
            assert m["throughput_tok_s"] > 0 and m["tokens_per_run"] == b["batch_size"] * 10
            assert m["device"]["step_ms"]["median"] > 0
            assert len(m["timeline"]["steps"]) == 3
    for name in ("timeline_b1.png", "timeline_b2.png", "host_time.png", "throughput.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, name
    table = capsys.readouterr().out
    assert "overlap" in table and "normal" in table and "gain" in table
    assert not os.path.exists(out / "trace_overlap_b1.json.gz")  # traces kept only when asked


def test_bound_section_counts_device_busy_time_once_and_the_span_from_the_first_launch():
    from jaxoverlap.profiling.capture import Run
    from jaxoverlap.profiling.report import bound_section

    def op(ts, dur, copy=False):
        return trace.DeviceOp("k", ts, dur, "decode_step", None, None, "Stream", copy)

    la = [trace.Launch(i, ts, 5.0, kind, 4, i, PY, ("decode_step",)) for i, (ts, kind) in enumerate([(0.0, "prefill"), (10.0, "decode")])]
    # Prefill busy 20..60; decode 60..100 with a copy (50..70) that overlaps both; then a 10 us
    # idle gap and the decode's last kernel 110..120.
    steps = [trace.Step(la[0], [op(20.0, 40.0)]), trace.Step(la[1], [op(60.0, 40.0), op(50.0, 20.0, True),
                                                                     op(110.0, 10.0)])]
    a = trace.Attribution(steps, la, [], {}, "gpu")
    bd = bound_section(Run("overlap", 1.0, 8, [], a))
    assert bd["steps"] == {"prefill": 1, "decode": 1}
    assert bd["device_busy_ms"] == pytest.approx(0.090)  # 20..100 and 110..120
    assert bd["run_ms"] == pytest.approx(0.120)  # first launch at 0 to the last op's end
    assert bd["prefill_busy_ms"] == pytest.approx(0.040)
    assert bd["run_over_bound"] == pytest.approx(120 / 90)
    # 0..20 before the first op; 100..110 between two kernels of the decode step (the copy
    # that starts in the prefill and ends in the decode hands the time on to the decode).
    longest = bd["idle"].pop("longest")
    assert bd["idle"] == {"head": pytest.approx({"ms": 0.020, "count": 1, "max_ms": 0.020}),
                          "inside decode": pytest.approx({"ms": 0.010, "count": 1, "max_ms": 0.010})}
    assert [m["label"] for m in longest] == ["head", "inside decode"]
    assert longest[1]["at_ms"] == pytest.approx(0.100) and longest[1]["iteration"] == 1


def test_idle_breakdown_labels_gaps_between_steps_by_their_kinds():
    from jaxoverlap.profiling.report import idle_breakdown

    def op(ts, dur):
        return trace.DeviceOp("k", ts, dur, "step", None, None, "Stream", False)

    kinds = ["prefill", "prefill", "decode", "decode"]
    la = [trace.Launch(i, 2.0 * i, 1.0, k, 4, i, PY, ("step",)) for i, k in enumerate(kinds)]
    # prefill 10..30, prefill 32..50 (2 idle), decode 55..70 (5 idle), decode 71..80 (1 idle).
    spans = [(10.0, 20.0), (32.0, 18.0), (55.0, 15.0), (71.0, 9.0)]
    steps = [trace.Step(l, [op(ts, d)]) for l, (ts, d) in zip(la, spans)]
    idle = idle_breakdown(trace.Attribution(steps, la, [], {}, "gpu"), 0.0)
    assert [m["label"] for m in idle.pop("longest")] == ["head", "prefill->decode", "prefill->prefill", "decode->decode"]
    assert idle["head"]["count"] == 1
    assert set(idle) == {"head", "prefill->prefill", "prefill->decode", "decode->decode"}
    assert idle["head"]["ms"] == pytest.approx(0.010)
    assert idle["prefill->prefill"]["ms"] == pytest.approx(0.002)
    assert idle["prefill->decode"]["ms"] == pytest.approx(0.005)
    assert idle["decode->decode"]["ms"] == pytest.approx(0.001)


def test_idle_before_the_first_kernel_is_head_even_after_input_copies():
    from jaxoverlap.profiling.report import idle_breakdown

    la = [trace.Launch(0, 0.0, 1.0, "prefill", 4, 0, PY, ("step",))]
    # Input copy at 5..6, then the host's launch still runs: the first kernel at 30..40.
    ops = [trace.DeviceOp("MemcpyH2D", 5.0, 1.0, None, None, None, "Stream", True),
           trace.DeviceOp("k", 30.0, 10.0, "step", None, None, "Stream", False),
           trace.DeviceOp("k", 42.0, 8.0, "step", None, None, "Stream", False)]
    idle = idle_breakdown(trace.Attribution([trace.Step(la[0], ops)], la, [], {}, "gpu"), 0.0)
    assert idle["head"]["ms"] == pytest.approx(0.029) and idle["head"]["count"] == 2  # 0..5 and 6..30
    assert idle["inside prefill"]["ms"] == pytest.approx(0.002)  # 40..42


def test_edges_section_splits_the_wall_at_the_first_launch_and_the_last_wait():
    from jaxoverlap.engine import StepTiming
    from jaxoverlap.profiling.capture import Run
    from jaxoverlap.profiling.report import edges_section

    t0 = 100.0
    timings = [
        # kind, size, prepare, launch, wait, process, fresh, draft, accepted, rows, start
        StepTiming("prefill", 2, 0.001, 0.002, 0.0, 0.0005, 0.0, 0.0, 0, 0, t0 + 0.001),
        StepTiming("decode", 2, 0.001, 0.002, 0.005, 0.0005, 0.0, 0.0, 0, 0, t0 + 0.010),
        StepTiming("decode", 2, 0.001, 0.002, 0.00001, 0.0005, 0.0, 0.0, 0, 0, t0 + 0.020),
        StepTiming("", 0, 0.0001, 0.0, 0.05, 0.001, 0.0, 0.0, 0, 0, t0 + 0.9),
    ]
    e = edges_section([Run("overlap", 1.0, 4, timings, start_s=t0)])
    assert e["head_ms"] == pytest.approx(4.0)  # 1 ms in, 1 ms prepare, 2 ms launch
    assert e["tail_ms"] == pytest.approx(1000 * (1.0 - 0.9501))  # after the drain's wait
    assert e["head_ms"] + e["middle_ms"] + e["tail_ms"] == pytest.approx(1000.0)
    assert e["near_zero_waits"] == 1  # the second decode iteration's 10 us wait


def test_host_ngram_waits_and_processing_before_the_launch_count_as_wait_and_process():
    """With the host n-gram drafter the overlap loop waits for and processes step N before
    it launches (fresh_wait): the report's wait, process and busy include those parts."""
    from jaxoverlap.engine import StepTiming
    from jaxoverlap.profiling.capture import Run
    from jaxoverlap.profiling.report import edges_section, host_section

    t0 = 100.0
    timings = [StepTiming("prefill", 2, 0.001, 0.002, 0.0, 0.0005, start_s=t0 + 0.001)] + [
        StepTiming("decode", 2, 0.001, 0.002, 0.0, 0.0002, fresh_wait_s=0.004, fresh_process_s=0.001,
                   start_s=t0 + 0.01 * i) for i in range(1, 4)] + [
        StepTiming("", 0, 0.0001, 0.0, 0.002, 0.001, start_s=t0 + 0.04)]  # the drain
    host = host_section([Run("overlap", 0.05, 6, timings, start_s=t0)])
    assert host["wait_ms"]["median"] == pytest.approx(3.0) and host["process_ms"]["median"] == pytest.approx(1.2)
    assert host["busy_ms"]["median"] == pytest.approx(1.0 + 2.0 + 1.2)
    assert host["fresh_wait_ms"]["median"] == pytest.approx(4.0)
    assert host["iteration_ms"]["median"] == pytest.approx(1.0 + 2.0 + 0.2 + 4.0)  # nothing counted twice
    assert edges_section([Run("overlap", 0.05, 6, timings, start_s=t0)])["near_zero_waits"] == 0


def test_the_traced_runs_wall_leaves_out_the_profiler(monkeypatch):
    """Starting and stopping the profiler (writing the trace) is not the run's time."""
    import time

    from engine_fixtures import make_engine

    from jaxoverlap.profiling import capture

    stop = capture._stop_trace
    monkeypatch.setattr(capture, "_stop_trace", lambda engine: (time.sleep(1.0), stop(engine)))
    engine = make_engine()
    w = capture.Workload(batch_size=2, prompt_len=8, new_tokens=10)
    runner = capture.WorkloadRunner(engine)
    runner.run(w, "overlap")  # compiles
    with tempfile.TemporaryDirectory() as d:
        run = runner.run(w, "overlap", capture.TraceWindow(steps=3, skip=2), d)
    assert run.wall_s < 1.0


def test_the_trace_starts_with_no_step_in_flight(monkeypatch):
    """Under overlap a step is in flight when the window opens: the profile waits for it
    first, so none of its device ops runs inside the trace (it would be a step that no
    traced launch launched)."""
    import jax

    from engine_fixtures import make_engine

    from jaxoverlap.profiling import capture

    engine = make_engine()
    ready_at_start = []
    start = jax.profiler.start_trace

    def checked_start(*args, **kwargs):
        ready_at_start.append(all(leaf.is_ready() for leaf in jax.tree.leaves(engine.runner.state)))
        start(*args, **kwargs)

    monkeypatch.setattr(jax.profiler, "start_trace", checked_start)
    w = capture.Workload(batch_size=2, prompt_len=8, new_tokens=10)
    runner = capture.WorkloadRunner(engine)
    runner.run(w, "overlap")  # compiles
    with tempfile.TemporaryDirectory() as d:
        run = runner.run(w, "overlap", capture.TraceWindow(steps=3, skip=2), d)
    assert ready_at_start == [True]
    assert not run.attribution.unplaced and len(run.attribution.steps) == 3


def test_profile_cli_refuses_options_it_cannot_honour(tmp_path):
    from jaxoverlap.cli import main

    base = ["profile", "--out", str(tmp_path / "p"), "--model", str(tmp_path / "no-model")]
    for extra, message in ((["--repeats", "0"], "--repeats must be >= 1"), (["--steps", "0"], "--steps must be >= 1"),
                           (["--skip", "-1"], "--skip must be >= 0"), (["--disable-overlap"], "drop --disable-overlap"),
                           (["--batch-size", "2", "0"], "--batch-size must be >= 1, got 0"),
                           (["--prompt-len", "0"], "--prompt-len must be >= 1, got 0"),
                           (["--batch-size", "2", "2"], "lists a size twice"),
                           ([], r"error: .*No such file .*no-model")):  # the model folder is not there
        with pytest.raises(SystemExit, match=message):
            main(base + extra)
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="--out .*file: File exists"):
        main(["profile", "--out", str(tmp_path / "file"), "--model", str(tmp_path / "no-model")])


def test_profile_cli_refuses_a_prompt_the_engine_cannot_take_before_any_run(tmp_path, monkeypatch):
    from jaxoverlap.cli import main
    from jaxoverlap.profiling import capture

    def no_profile(*a, **k):
        raise AssertionError("compiled and ran the workload before its requests were checked")

    monkeypatch.setattr(capture, "profile", no_profile)
    with pytest.raises(SystemExit, match="--prompt-len 100 --new-tokens 10: prompt has 100 tokens; .* at most 63 "
                                         "prompt tokens fit"):
        main(["profile", "--out", str(tmp_path / "p"), "--batch-size", "1", "--prompt-len", "100", "--new-tokens", "10",
              "--max-running-requests", "4", "--max-context-len", "64", "--kv-cache-tokens", "512"])
    # New tokens past the context: the engine would end each request early, with fewer tokens than asked.
    with pytest.raises(SystemExit, match="24 prompt tokens \\+ 100 new tokens do not fit the context of 64"):
        main(["profile", "--out", str(tmp_path / "p"), "--batch-size", "1", "--prompt-len", "24", "--new-tokens", "100",
              "--max-running-requests", "4", "--max-context-len", "64", "--kv-cache-tokens", "512"])


def test_timeline_intervals_merge_back_to_back_ops():
    from jaxoverlap.profiling.report import _intervals

    ops = [trace.DeviceOp(f"k{i}", 100.0 + 10 * i, 9.5, "decode_step", None, None, "Stream", False) for i in range(5)]
    ops += [trace.DeviceOp("k5", 200.0, 5.0, "decode_step", None, None, "Stream", False),
            trace.DeviceOp("MemcpyD2H", 120.0, 2.0, None, None, None, "Stream #16(MemcpyD2H)", True, True)]
    assert _intervals(ops, t0=100.0) == [[0.0, 49.5, False], [100.0, 5.0, False], [20.0, 2.0, True]]


def test_keep_trace_copies_the_trace_or_forgets_it(tmp_path):
    from jaxoverlap.profiling.capture import Run, _keep_trace

    src = tmp_path / "tmp" / "t.json.gz"
    src.parent.mkdir()
    src.write_bytes(b"trace")
    kept = Run("overlap", 1.0, 1, [], trace_file=str(src))
    _keep_trace(kept, str(tmp_path / "out"), "trace_whole_b1.json.gz")
    assert kept.trace_file == str(tmp_path / "out" / "trace_whole_b1.json.gz")
    assert (tmp_path / "out" / "trace_whole_b1.json.gz").read_bytes() == b"trace"
    dropped = Run("overlap", 1.0, 1, [], trace_file=str(src))
    _keep_trace(dropped, None, "x.json.gz")
    assert dropped.trace_file is None
