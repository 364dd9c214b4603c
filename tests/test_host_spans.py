"""The parsers of benchmarks/host_spans.py (where a decode launch's host time goes), on
synthetic trace events and py-spy output: no JAX, no GPU."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import host_spans  # noqa: E402


def _x(name, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid, "args": args}


def test_launch_spans_nests_by_time_and_keeps_other_batches_out():
    events = [{"ph": "M", "name": "thread_name", "pid": 7, "tid": 2, "args": {"name": "worker"}}]
    for k, t0 in enumerate((0.0, 100.0)):
        events += [
            _x("jaxoverlap.launch", t0, 50.0, kind="decode", size="4"),
            _x("PjitFunction(decode_step)", t0 + 1, 40.0),
            _x("Execute#run_id=9#", t0 + 2, 30.0),  # metadata after '#' is dropped
            _x("ParseArguments", t0 + 33, 5.0 + k),  # inside PjitFunction, after Execute
            _x("copy_to_host_async", t0 + 42, 6.0),
            _x("busy", t0 + 45, 20.0, tid=2),  # another thread, 5 us inside the launch
        ]
    events += [_x("jaxoverlap.launch", 300.0, 50.0, kind="decode", size="8"),  # another batch size
               _x("PjitFunction(decode_step)", 301.0, 49.0)]
    got = host_spans.launch_spans(events, batch_size=4)
    rows = {(r["depth"], r["name"]): r for r in got["rows"]}
    assert got["launches"] == 2 and got["launch_span_median_us"] == 50.0
    assert rows[(1, "PjitFunction(decode_step)")]["median_us"] == 40.0
    assert rows[(1, "copy_to_host_async")]["median_us"] == 6.0
    assert rows[(2, "Execute")]["median_us"] == 30.0 and rows[(2, "Execute")]["count"] == 1
    assert rows[(2, "ParseArguments")]["median_us"] == 5.5  # median of 5 and 6
    assert got["other_threads"] == [{"thread": "worker", "name": "busy", "median_us": 5.0}]


def test_sampled_frames_counts_each_frame_once_per_stack(tmp_path):
    raw = tmp_path / "spy.txt"
    raw.write_text(
        "main (a.py:1);Engine.step (e.py:2);ModelRunner.launch (r.py:3);PjitFunction::Call;Execute;Execute 3\n"
        "main (a.py:1);Engine.step (e.py:2);ModelRunner.launch (r.py:3);copy_to_host_async 1\n"
        "main (a.py:1);Engine.step (e.py:2);Scheduler.process (s.py:4) 6\n"
    )
    got = host_spans.sampled_frames(str(raw), launch_ms=0.8)
    shares = {r["frame"]: r["share"] for r in got["rows"]}
    assert got["samples"] == 10 and got["launch_samples"] == 4
    assert shares == {"PjitFunction::Call": 0.75, "Execute": 0.75, "copy_to_host_async": 0.25}
    assert abs({r["frame"]: r["est_us"] for r in got["rows"]}["Execute"] - 600.0) < 1e-9
