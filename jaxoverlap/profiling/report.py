"""Numbers of a profile: per-step device time, gaps between steps, host time per step,
throughput; as the dict written to profile.json and as a printed table.

Device numbers come from the traced run of each loop, host and throughput numbers from the
timed (untraced) runs. Host numbers are per loop iteration that launched a decode step:
in the overlap loop that iteration prepares and launches step N+1 and waits for and
processes step N, in the normal loop it does all four for one step.
"""
from __future__ import annotations

import collections
import json

import numpy as np

from jaxoverlap.profiling.capture import MODES, BatchResult, Run
from jaxoverlap.profiling.trace import Attribution, Step, union_length

HOST_PARTS = ("prepare", "launch", "wait", "process")  # StepTiming fields, without the _s
TIMELINE_STEPS = 3


def summary(values, scale: float = 1.0) -> dict:
    """median / p90 / mean / max / min of values * scale, and their count."""
    v = np.asarray(list(values), np.float64) * scale
    if v.size == 0:
        return {"n": 0}
    return {"n": int(v.size), "median": float(np.median(v)), "p90": float(np.percentile(v, 90)),
            "mean": float(v.mean()), "max": float(v.max()), "min": float(v.min())}


def _host_part(t, part: str) -> float:
    return t.all_wait_s if part == "wait" else t.all_process_s if part == "process" else getattr(t, f"{part}_s")


def host_section(runs: list[Run]) -> dict:
    timings = [t for r in runs for t in r.timings]
    decode = [t for t in timings if t.kind == "decode"]
    out = {"iterations": len(decode)}
    # wait and process hold, for the host n-gram drafter's batches, also the wait for and the
    # processing of step N before the launch (fresh_wait, also given alone).
    for part in HOST_PARTS + ("fresh_wait",):
        out[f"{part}_ms"] = summary([_host_part(t, part) for t in decode], 1e3)
    # What the host spends on one step itself (the article's Figure 3), waiting excluded.
    out["busy_ms"] = summary([t.prepare_s + t.launch_s + t.all_process_s for t in decode], 1e3)
    # One loop iteration, waits included: once the loop runs steadily, one step per this
    # long, untraced (the tracer slows the host down; see device.launch_span_ms).
    out["iteration_ms"] = summary([t.prepare_s + t.launch_s + t.wait_s + t.process_s + t.fresh_wait_s
                                   for t in decode], 1e3)
    # Sums over every iteration of the timed runs (prefill and drain ones too), to hold
    # against their wall time: the rest is the loop's own overhead.
    out["totals_s"] = {part: float(sum(getattr(t, f"{part}_s") for t in timings)) for part in HOST_PARTS + ("fresh_wait",)}
    out["totals_s"]["iterations"] = len(timings)
    out["totals_s"]["wall"] = float(sum(r.wall_s for r in runs))
    return out


def device_section(a: Attribution) -> dict:
    decode = [s for s in a.steps if s.launch.kind == "decode"]
    periods = [b.start - s.start for s, b in zip(decode, decode[1:]) if b.launch.index == s.launch.index + 1]
    placed = sum(len(s.ops) for s in a.steps)
    return {
        "platform": a.platform,
        "launches": len(a.launches),
        "steps": len(a.steps),
        "decode_steps": len(decode),
        "step_ms": summary([s.span for s in decode], 1e-3),
        "busy_ms": summary([s.busy for s in decode], 1e-3),
        "gap_ms": summary(a.gaps(("decode",)), 1e-3),
        "period_ms": summary(periods, 1e-3),
        "ops_per_step": summary([len(s.ops) for s in decode]),
        # The host launch spans as traced, to hold against host.launch_ms (untraced): on a GPU
        # the tracer's callbacks make launches slower, which widens the gaps of the normal loop.
        "launch_span_ms": summary([s.launch.dur for s in decode], 1e-3),
        "ops_placed": placed,
        "ops_unplaced": len(a.unplaced),
        "placed_by": a.methods,
    }


def _host_rows(step: Step, run: Run) -> dict:
    """Host intervals of the loop iteration that launched `step`, in trace microseconds: the
    launch span is measured in the trace; prepare, wait and process are placed around it
    from that iteration's StepTiming (same order as in engine.py)."""
    lt = step.launch
    if not 0 <= lt.iteration < len(run.timings):
        return {"launch": [lt.ts, lt.dur]}
    t = run.timings[lt.iteration]
    fresh = t.fresh_wait_s * 1e6
    return {
        "prepare": [lt.ts - fresh - t.prepare_s * 1e6, t.prepare_s * 1e6],
        "launch": [lt.ts, lt.dur],
        "wait": [lt.end, t.wait_s * 1e6],
        "process": [lt.end + t.wait_s * 1e6, t.process_s * 1e6],
    }


def _intervals(ops, t0: float, join_us: float = 1.0) -> list:
    """Device busy intervals for the plot, [start_us, dur_us, is_copy]: kernels and copies
    apart, ops less than join_us apart merged (a GPU step is ~700 back-to-back kernels, and
    a pixel of the plot is ~20 us)."""
    out = []
    for copy in (False, True):
        cur = None  # [start, end] being merged
        for o in sorted((o for o in ops if o.is_copy == copy), key=lambda o: o.ts):
            if cur is not None and o.ts - cur[1] <= join_us:
                cur[1] = max(cur[1], o.end)
                continue
            if cur is not None:
                out.append([round(cur[0] - t0, 3), round(cur[1] - cur[0], 3), copy])
            cur = [o.ts, o.end]
        if cur is not None:
            out.append([round(cur[0] - t0, 3), round(cur[1] - cur[0], 3), copy])
    return out


def timeline_section(run: Run, n: int = TIMELINE_STEPS) -> dict:
    """n consecutive decode steps for the timeline plot (the second to n+1-th of the window
    where there are enough: the first may feel the trace's start), with the device ops of
    the steps just before and after them as context. Times in us from the first one's
    prepare. Each host interval names the launch it works for: prepare and launch work for
    the step launched in that iteration; wait and process for the previous launch in the
    overlap loop, for the same one in the normal loop."""
    steps = run.attribution.steps
    runs_of_n = [i for i in range(len(steps) - n + 1)
                 if all(s.launch.kind == "decode" for s in steps[i:i + n])
                 and steps[i + n - 1].launch.index == steps[i].launch.index + n - 1]
    if not runs_of_n:
        return {"steps": [], "context": []}
    first = runs_of_n[1] if len(runs_of_n) > 1 else runs_of_n[0]
    chosen = steps[first:first + n]
    context = steps[max(0, first - 1):first] + steps[first + n:first + n + 1]
    host = [_host_rows(s, run) for s in chosen]
    t0 = min([s.start for s in chosen] + [h[k][0] for h in host for k in h])
    lag = 1 if run.mode == "overlap" else 0
    out = []
    for s, h in zip(chosen, host):
        idx = s.launch.index
        out.append({
            "launch_index": idx, "iteration": s.launch.iteration, "kind": s.launch.kind,
            "start_us": s.start - t0, "end_us": s.end - t0,
            "ops": _intervals(s.ops, t0),  # busy intervals, [start_us, dur_us, is_copy]
            # part -> [start_us, dur_us, launch index it works for]
            "host": {k: [v[0] - t0, v[1], idx - lag if k in ("wait", "process") else idx] for k, v in h.items()},
        })
    ctx = _intervals([o for s in context for o in s.ops], t0)
    return {"steps": out, "context": ctx}


def bound_section(run: Run) -> dict:
    """The overlap loop against the device-only bound, from one run traced whole (prefill
    included): the bound is the time the device is busy (union of every op of every step),
    the run is the time from the first launch's start to the last op's end. The same trace
    gives both, so the tracer's cost on the device counts on both sides; the host work
    before the first launch (schedule, prefill arrays: well under a millisecond) is left out.
    `idle` says where the rest of the run went (`idle_breakdown`)."""
    a = run.attribution
    ops = [o for st in a.steps for o in st.ops] + list(a.unplaced)
    if not ops or not a.launches:
        return {}
    busy = union_length([(o.ts, o.end) for o in ops])
    t0 = min(la.ts for la in a.launches)
    span = max(o.end for o in ops) - t0
    kinds = collections.Counter(st.launch.kind for st in a.steps)
    return {"steps": dict(kinds), "device_busy_ms": busy / 1e3, "run_ms": span / 1e3,
            "run_over_bound": span / busy if busy > 0 else None,
            "prefill_busy_ms": sum(st.busy for st in a.steps if st.launch.kind == "prefill") / 1e3,
            "idle": idle_breakdown(a, t0)}


def idle_breakdown(a: Attribution, t0: float, longest: int = 8) -> dict:
    """Every moment between `t0` (the first launch) and the last op in which no op runs,
    labelled by the steps around it, in ms: "head" (before the first kernel: the host's
    first launch, which the first step's input copies only split up), "inside <kind>"
    (between two ops of one step), "<kind>-><kind>" (between the last op of one step and
    the first of another). With `bound_section`'s busy time they add up to its run time.
    "longest" lists the `longest` moments with the ops on either side, to find them in a
    trace (at: ms after t0; iteration: the loop iteration that launched the step after)."""
    ops = [(o.ts, o.end, st.launch.index, st.launch.kind, o.name, st.launch.iteration)
           for st in a.steps for o in st.ops]
    ops += [(o.ts, o.end, -1, "unplaced", o.name, -1) for o in a.unplaced]
    ops.sort()
    first_kernel = min((o.ts for st in a.steps for o in st.ops if not o.is_copy), default=float("inf"))
    out: dict[str, dict] = {}
    moments = []

    def add(label, start, dur, before, after):
        if dur <= 0:
            return
        d = out.setdefault(label, {"ms": 0.0, "count": 0, "max_ms": 0.0})
        d["ms"] += dur / 1e3
        d["count"] += 1
        d["max_ms"] = max(d["max_ms"], dur / 1e3)
        moments.append({"label": label, "at_ms": (start - t0) / 1e3, "ms": dur / 1e3, "before": before,
                        "after": after[0], "iteration": after[1]})

    if not ops:
        return out
    add("head", t0, ops[0][0] - t0, None, (ops[0][4], ops[0][5]))
    cur = ops[0]  # the op that ends last so far: it owns the time up to the next idle moment
    for op in ops[1:]:
        ts, end, index, kind, name, iteration = op
        if ts > cur[1]:
            label = ("head" if ts <= first_kernel else
                     f"inside {kind}" if index == cur[2] else f"{cur[3]}->{kind}")
            add(label, cur[1], ts - cur[1], cur[4], (name, iteration))
        if end >= cur[1]:
            cur = op
    moments.sort(key=lambda m: -m["ms"])
    if out:
        out["longest"] = moments[:longest]
    return out


def edges_section(runs: list[Run]) -> dict:
    """Where an untraced run's wall time lies around its steps, from the host clock (medians
    over the runs, ms). head: loop start to the end of the first launch (the device has
    nothing to run before); tail: the end of the last wait for a step's outputs (the device
    is done) to the loop's end; middle: the rest, the device's time plus any idle moment in
    it. near_zero_waits: decode iterations (after the first) whose wait was under 20 us,
    the only ones after which the device can have been idle under overlap."""
    heads, tails, middles, walls, zeros = [], [], [], [], []
    for r in runs:
        t = [x for x in r.timings if x.start_s > 0]
        if not t or r.start_s <= 0:
            continue
        first = t[0]
        head = first.start_s + first.prepare_s + first.fresh_wait_s + first.launch_s - r.start_s
        waited = [x for x in t if x.wait_s > 0]
        last = max((x.start_s + x.prepare_s + x.fresh_wait_s + x.launch_s + x.wait_s for x in waited), default=None)
        if last is None:
            continue
        tail = r.start_s + r.wall_s - last
        heads.append(head)
        tails.append(tail)
        walls.append(r.wall_s)
        middles.append(r.wall_s - head - tail)
        decode = [x for x in t if x.kind == "decode"][1:]
        zeros.append(sum(x.all_wait_s < 20e-6 for x in decode))
    if not walls:
        return {}
    med = lambda v: float(np.median(v)) * 1e3  # noqa: E731
    return {"runs": len(walls), "wall_ms": med(walls), "head_ms": med(heads), "tail_ms": med(tails),
            "middle_ms": med(middles), "wall_over_middle": float(np.median([w / m for w, m in zip(walls, middles)])),
            "near_zero_waits": int(np.median(zeros))}


def build(results: list[BatchResult], meta: dict) -> dict:
    batches = []
    for r in results:
        modes = {}
        for mode in MODES:
            timed, traced = r.timed[mode], r.traced[mode]
            tps = [x.tokens_per_s for x in timed]
            modes[mode] = {
                "throughput_tok_s": float(np.median(tps)) if tps else 0.0,
                "throughput_runs_tok_s": tps,
                "tokens_per_run": timed[0].tokens if timed else traced.tokens,
                "traced_run_tok_s": traced.tokens_per_s,
                "host": host_section(timed or [traced]),
                "device": device_section(traced.attribution),
                "timeline": timeline_section(traced),
                "edges": edges_section(timed),
                "trace_file": traced.trace_file,
            }
        for m in modes.values():
            # Device idle per step without the tracer, estimated: the untraced loop period
            # less the device step (0 where the loop keeps the device busy).
            it, step = m["host"]["iteration_ms"].get("median"), m["device"]["step_ms"].get("median")
            m["untraced_gap_estimate_ms"] = max(0.0, it - step) if it is not None and step is not None else None
        on, off = modes["overlap"]["throughput_tok_s"], modes["normal"]["throughput_tok_s"]
        batches.append({
            "batch_size": r.workload.batch_size, "prompt_len": r.workload.prompt_len,
            "new_tokens": r.workload.new_tokens, "modes": modes,
            "overlap_gain": on / off - 1.0 if off > 0 else None,
            "bound": bound_section(r.whole) if r.whole is not None else None,
        })
    return {"meta": meta, "batches": batches}


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def _ms(d: dict, key: str = "median") -> str:
    v = d.get(key)
    return "-" if v is None else f"{v:.3f}"


def table(report: dict) -> str:
    cols = ["B", "loop", "tok/s", "step med", "step p90", "gap med", "gap p90", "gap max", "gap est",
            "prepare", "launch", "process", "wait", "host busy", "iter", "traced launch"]
    rows = []
    for b in report["batches"]:
        for mode, m in b["modes"].items():
            d, h = m["device"], m["host"]
            rows.append([str(b["batch_size"]), mode, f"{m['throughput_tok_s']:.1f}",
                         _ms(d["step_ms"]), _ms(d["step_ms"], "p90"),
                         _ms(d["gap_ms"]), _ms(d["gap_ms"], "p90"), _ms(d["gap_ms"], "max"),
                         _ms({"median": m["untraced_gap_estimate_ms"]}),
                         _ms(h["prepare_ms"]), _ms(h["launch_ms"]), _ms(h["process_ms"]), _ms(h["wait_ms"]),
                         _ms(h["busy_ms"]), _ms(h["iteration_ms"]), _ms(d["launch_span_ms"])])
        if b["overlap_gain"] is not None:
            rows.append([str(b["batch_size"]), "gain", f"{100 * b['overlap_gain']:+.1f}%"] + [""] * (len(cols) - 3))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    lines.append("ms; step, gap: traced device ops of decode steps; prepare..iter: medians per decode loop "
                 "iteration, untraced (engine.timings); gap est = iter - step; traced launch: launch span in the trace")
    for b in report["batches"]:
        bd = b.get("bound")
        if bd:
            lines.append(f"B={b['batch_size']} overlap run traced whole ({bd['steps']}): first launch to last op "
                         f"{bd['run_ms']:.3f} ms, device busy {bd['device_busy_ms']:.3f} ms (prefill "
                         f"{bd['prefill_busy_ms']:.3f}): run / device-only bound = {bd['run_over_bound']:.4f}")
            kinds = {k: v for k, v in bd.get("idle", {}).items() if k != "longest"}
            idle = ", ".join(f"{k} {v['ms']:.3f} ({v['count']}x, max {v['max_ms']:.3f})"
                             for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]["ms"]))
            lines.append(f"  device idle in that run, ms: {idle or 'none'}")
            for m in bd.get("idle", {}).get("longest", [])[:4]:
                lines.append(f"    {m['ms']:.3f} ms {m['label']} at {m['at_ms']:.3f} ms (iteration {m['iteration']}): "
                             f"{m['before']} -> {m['after']}")
        e = b["modes"].get("overlap", {}).get("edges")
        if e:
            lines.append(f"B={b['batch_size']} overlap, untraced ({e['runs']} runs): wall {e['wall_ms']:.3f} ms = head "
                         f"{e['head_ms']:.3f} + middle {e['middle_ms']:.3f} + tail {e['tail_ms']:.3f}; "
                         f"wall / middle = {e['wall_over_middle']:.4f}; waits under 20 us: {e['near_zero_waits']}")
    return "\n".join(lines)
