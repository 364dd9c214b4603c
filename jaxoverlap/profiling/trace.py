"""Read a JAX profiler trace (trace-viewer / perfetto JSON) and give each device op to a step.

Pure Python on the list of trace events, so the tests can feed it synthetic events.

What the trace holds (timestamps `ts` and durations `dur` in microseconds):

- host launch spans: the engine wraps every step launch in
  `jax.profiler.TraceAnnotation("jaxoverlap.launch", kind=..., size=..., iteration=...)`;
  the keyword arguments come back as the event's `args` (as strings);
- the jitted calls inside a span: `PjitFunction(<name>)` host events (JAX's C++ dispatch),
  one per program that the launch dispatched (nested duplicates appear for one call);
- device ops:
  * GPU: X events of a process whose name holds `/device:GPU`, one thread per CUDA stream
    ("Stream #14(Compute)", "Stream #15(MemcpyH2D)", ...; derived rows such as "XLA Ops",
    which repeat the kernels, are skipped). Each kernel and copy carries `correlation_id`,
    which also appears on its host-side event: `cuGraphLaunch (CudaGraph:N)` on the Python
    thread inside the launch span (XLA runs a whole step as one CUDA graph: every kernel of
    the step has the graph launch's id), `MemcpyH2D` / `MemcpyD2H` on PJRT's worker threads.
    Seen on an H200 with JAX 0.11.2.
  * CPU (XLA's thunk runtime, checked with JAX 0.10.2): the "device" is a pool of host
    threads (`tf_XLAPjRtCpuClient/...`, `tf_XLAEigen/...`); every executed thunk is an X event
    there with args `hlo_module` (e.g. `jit_decode_step`), `hlo_op` and `run_id` (one id per
    execution of a program), followed by a short `end: <op>` event, which is not an op.
    `ThunkExecutor::Execute` spans an execution but names no program; it is not an op either.

Attribution of ops to steps, first rule that applies:

1. correlation id: the op's host event lies inside launch span k -> step k. Not for
   device-to-host copies: their host event fires when the step's kernels are done, which
   under overlap falls inside the next step's launch span;
2. execution: ops with the same (program, run_id) form one execution; an execution with
   any op placed by rule 1 goes, whole, to the launch most of those ops point to. Kernels
   that name their program but carry no run id (GPU) are cut into executions by the period
   of their names: each execution of a program runs the same kernels in the same order,
   and XLA names every kernel of a program apart. The cut is placed so that the sequence
   ends on a whole execution (`jaxoverlap profile` waits for the last step before it stops
   the trace); a partial execution at the start stays for rule 4;
3. program name + order (the fallback when correlation ids are missing): the executions
   of one program run in the order they were launched (one queue), so each launch takes,
   in launch order, the earliest unplaced execution of each program it dispatched
   (`PjitFunction` events) that starts after the launch span starts. Executions that
   start before the first launch (launched before the trace began) stay unplaced, and so
   do the oldest executions of a program beyond the launches left to take one: the trace
   ends on a completed step, so an extra one was launched before the trace, even where
   (under overlap) it started only after the first launch span had begun. Where the
   trace shows no `PjitFunction` events, each launch takes one execution of any program;
4. what is left (device-to-host copies, ops without ids) follows a step: it goes to the
   step whose kernels, as placed so far, ended last before the op starts ("after_step");
   an op before all of them stays unplaced (it belongs to a step from before the trace).
   Only where rules 1-3 placed nothing at all does an op go to the last launch that
   started before it ("time_order", crude under overlap).
   `Attribution.methods` counts the ops each rule placed.

None of this uses the gaps between device ops, which overlap brings down to about zero.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import glob
import gzip
import json
import os
import re

LAUNCH_SPAN = "jaxoverlap.launch"
# Rows that the trace viewer derives from the kernels (they repeat them, so they are no ops).
_DERIVED_ROWS = ("XLA Modules", "XLA Ops", "XLA TraceMe", "TensorFlow Ops", "TensorFlow Name Scope",
                 "Framework Ops", "Framework Name Scope", "Source code", "Steps", "Launch Stats")


@dataclasses.dataclass(frozen=True)
class Launch:
    """One host launch span (one engine step launch)."""

    index: int  # order among the launch spans of the trace
    ts: float
    dur: float
    kind: str  # "prefill" | "decode"
    size: int  # requests in the batch
    iteration: int  # index of the loop iteration's StepTiming in engine.timings (-1: unknown)
    tid: object
    programs: tuple[str, ...]  # normalized names of the programs dispatched inside, in order

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclasses.dataclass(frozen=True)
class DeviceOp:
    name: str
    ts: float
    dur: float
    program: str | None  # normalized module name (`decode_step`), when the event names one
    run_id: str | None
    correlation_id: str | None
    row: str  # thread (stream) name, for plots and for telling copies from kernels
    is_copy: bool  # a memcpy / memset rather than a kernel or thunk
    is_d2h: bool = False  # a device-to-host copy (a step's outputs)

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclasses.dataclass
class Step:
    """The device side of one launch."""

    launch: Launch
    ops: list[DeviceOp]

    def _timed(self) -> list[DeviceOp]:
        # Copies of a step's outputs (GPU: device-to-host on their own stream) may still run
        # while the next step computes; the step's time is that of its kernels where it has any.
        kernels = [o for o in self.ops if not o.is_copy]
        return kernels or self.ops

    @property
    def start(self) -> float:
        return min(o.ts for o in self._timed())

    @property
    def end(self) -> float:
        return max(o.end for o in self._timed())

    @property
    def span(self) -> float:
        """First op start to last op end (the step "between its two timestamps")."""
        return self.end - self.start

    @property
    def busy(self) -> float:
        """Time in which at least one of its ops runs (union of the op intervals)."""
        return union_length([(o.ts, o.end) for o in self._timed()])


@dataclasses.dataclass
class Attribution:
    steps: list[Step]  # one per launch that got ops, in launch order
    launches: list[Launch]
    unplaced: list[DeviceOp]  # ops no rule could give to a launch
    methods: dict[str, int]  # rule -> number of ops it placed
    platform: str  # "gpu" | "cpu" | ... (where the device ops were found)

    def gaps(self, kinds: tuple[str, ...] | None = None) -> list[float]:
        """Idle device time between consecutive steps: next step's first op start minus this
        step's last op end, for launches that follow each other directly (and, if kinds is
        given, are both of those kinds). Zero or slightly negative under overlap."""
        out = []
        for a, b in zip(self.steps, self.steps[1:]):
            if b.launch.index != a.launch.index + 1:
                continue
            if kinds is not None and (a.launch.kind not in kinds or b.launch.kind not in kinds):
                continue
            out.append(b.start - a.end)
        return out


def union_length(intervals) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def name_period(names: list[str]) -> int | None:
    """The smallest p with names[j] == names[j + p] for all j, if the sequence holds at
    least two whole periods; else None."""
    n = len(names)
    for p in range(1, n // 2 + 1):
        if all(names[j] == names[j + p] for j in range(n - p)):
            return p
    return None


def normalize_program(name: str | None) -> str | None:
    """`jit_decode_step`, `PjitFunction(decode_step)`, `jit_decode_step(123)`, and
    `PjitFunction(jit(decode_step))` (a call of the compiled executable) -> `decode_step`."""
    if not name:
        return None
    m = re.fullmatch(r"PjitFunction\((.*)\)", name)
    if m:
        name = m.group(1)
    m = re.fullmatch(r"jit\((.*)\)", name)
    if m:
        name = m.group(1)
    name = re.sub(r"\(\d+\)$", "", name)  # trace-viewer module rows append the program id
    if name.startswith("jit_"):
        name = name[4:]
    return name


# -- loading ---------------------------------------------------------------------------------------
def find_trace_file(path: str) -> str:
    """A trace JSON file itself, or the newest one under a `start_trace` folder (the perfetto
    file first: `*.trace.json.gz` holds the same events)."""
    if os.path.isfile(path):
        return path
    for pattern in ("perfetto_trace.json.gz", "*.trace.json.gz", "*trace*.json.gz", "*trace*.json"):
        files = glob.glob(os.path.join(path, "**", pattern), recursive=True)
        if files:
            return max(files, key=os.path.getmtime)
    raise FileNotFoundError(f"no trace JSON under {path}")


def load_events(path: str) -> list[dict]:
    path = find_trace_file(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


# -- parsing ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class ParsedTrace:
    launches: list[Launch]
    ops: list[DeviceOp]  # sorted by start
    api_ts: dict[str, float]  # correlation id -> start of its host API event
    platform: str


def _int_arg(args: dict, key: str, default: int) -> int:
    try:
        return int(args.get(key, default))
    except (TypeError, ValueError):
        return default


def parse(events: list[dict], launch_name: str = LAUNCH_SPAN) -> ParsedTrace:
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e.get("pid")] = str((e.get("args") or {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str((e.get("args") or {}).get("name", ""))
    device_pids = {pid for pid, name in procs.items() if "/device:" in name}
    platform = "cpu"
    for pid in device_pids:
        m = re.search(r"/device:([A-Za-z]+)", procs[pid])
        platform = m.group(1).lower() if m else "device"

    # On a device process, keep the stream rows where there are any, else all rows that are
    # not derived from the kernels.
    with_streams = {p for (p, _), n in threads.items() if p in device_pids and n.startswith("Stream")}

    def device_row_ok(pid, tid) -> bool:
        name = threads.get((pid, tid), "")
        if pid in with_streams:
            return name.startswith("Stream")
        return not name.startswith(_DERIVED_ROWS)

    spans, pjit, ops, api_ts = [], [], [], {}
    for e in events:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        pid, tid, name = e.get("pid"), e.get("tid"), str(e.get("name", ""))
        args = e.get("args") or {}
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        if pid in device_pids:
            if device_row_ok(pid, tid):
                row = threads.get((pid, tid), str(tid))
                is_copy = bool(re.match(r"(?i)mem(cpy|set)", name)) or "memcpy" in row.lower()
                ops.append(DeviceOp(
                    name, ts, dur, normalize_program(args.get("hlo_module")), _str_or_none(args.get("run_id")),
                    _str_or_none(args.get("correlation_id")), row, is_copy,
                    is_d2h=is_copy and bool(re.search(r"(?i)d(2|to)h", name + " " + row)),
                ))
            continue
        if name == launch_name:
            spans.append((ts, dur, args, tid))
        elif name.startswith("PjitFunction("):
            pjit.append((ts, dur, normalize_program(name), tid))
        elif "hlo_op" in args and not device_pids:
            # CPU thunk runtime: an executed thunk on one of XLA's worker threads.
            ops.append(DeviceOp(name, ts, dur, normalize_program(args.get("hlo_module")),
                                _str_or_none(args.get("run_id")), None, threads.get((pid, tid), str(tid)),
                                is_copy=False))
        elif "correlation_id" in args:
            # The host side of a kernel or copy: cuGraphLaunch / cuLaunchKernel on the
            # launching thread; memcpy events on PJRT's worker threads.
            cid = str(args["correlation_id"])
            api_ts[cid] = min(ts, api_ts.get(cid, ts))

    spans.sort(key=lambda s: s[0])
    pjit.sort(key=lambda p: p[0])
    launches = []
    for i, (ts, dur, args, tid) in enumerate(spans):
        # One jitted call can show as nested PjitFunction events: keep the outermost ones.
        inside = sorted((p for p in pjit if p[3] == tid and ts <= p[0] and p[0] + p[1] <= ts + dur),
                        key=lambda p: (p[0], -p[1]))
        programs, last_end = [], float("-inf")
        for p_ts, p_dur, program, _ in inside:
            if p_ts >= last_end:  # not inside the previous outermost call
                programs.append(program)
                last_end = p_ts + p_dur
        launches.append(Launch(i, ts, dur, str(args.get("kind", "")), _int_arg(args, "size", 0),
                               _int_arg(args, "iteration", -1), tid, tuple(programs)))
    ops.sort(key=lambda o: o.ts)
    return ParsedTrace(launches, ops, api_ts, platform)


def _str_or_none(v) -> str | None:
    return None if v is None else str(v)


# -- attribution -----------------------------------------------------------------------------------
def attribute(parsed: ParsedTrace) -> Attribution:
    launches = parsed.launches
    starts = [l.ts for l in launches]
    owner: dict[int, int] = {}  # op position -> launch index
    methods = collections.Counter()

    def launch_containing(ts: float) -> int | None:
        k = bisect.bisect_right(starts, ts) - 1
        if k >= 0 and ts <= launches[k].end:
            return k
        return None

    # 1. correlation ids
    for i, op in enumerate(parsed.ops):
        if op.correlation_id is not None and op.correlation_id in parsed.api_ts and not op.is_d2h:
            k = launch_containing(parsed.api_ts[op.correlation_id])
            if k is not None:
                owner[i] = k
                methods["correlation_id"] += 1

    # 2. executions: (program, run_id)
    executions: dict[tuple, list[int]] = collections.defaultdict(list)
    loose: list[int] = []
    for i, op in enumerate(parsed.ops):
        if op.run_id is not None and not op.is_d2h:
            executions[(op.program, op.run_id)].append(i)
        elif i not in owner:
            loose.append(i)
    # Kernels with a program but no run id: cut into executions by the period of their names.
    by_program: dict[str, list[int]] = collections.defaultdict(list)
    for i in loose:
        op = parsed.ops[i]
        if op.program is not None and not op.is_copy:
            by_program[op.program].append(i)
    cut = set()
    for program, members in by_program.items():
        period = name_period([parsed.ops[i].name for i in members])
        if period is None:
            continue
        for n, start in enumerate(range(len(members) % period, len(members), period)):
            executions[(program, f"cut-{n}")] = members[start:start + period]
            cut.update(members[start:start + period])
    loose = [i for i in loose if i not in cut]
    pending = []  # executions no op of which was placed by rule 1
    for key, members in executions.items():
        votes = collections.Counter(owner[i] for i in members if i in owner)
        if votes:
            k = votes.most_common(1)[0][0]
            for i in members:
                if i not in owner:
                    owner[i] = k
                    methods["execution"] += 1
        else:
            pending.append((parsed.ops[members[0]].ts, key, members))

    # 3. program name + launch order. Per program, its executions in start order form a
    # queue; an execution that starts before a launch can belong to no later launch either.
    any_programs = any(l.programs for l in launches)
    queues: dict[str | None, list] = collections.defaultdict(list)
    for ts, key, members in sorted(pending, key=lambda p: p[0]):
        queues[key[0] if any_programs else None].append((ts, members))
    # Launches still without an execution of each program: its dispatches less the
    # executions that rule 2 placed.
    slots = collections.Counter(p for l in launches for p in (l.programs if any_programs else (None,)))
    for key, members in executions.items():
        if any(i in owner for i in members):
            slots[key[0] if any_programs else None] -= 1
    # The trace ends on a completed step, so executions beyond those slots are the oldest:
    # a step launched before the trace that under overlap starts running only after the
    # first launch span began. Skipping them keeps it from taking launch 0's place.
    # heads: program -> position of its next unplaced execution.
    heads = collections.Counter({p: max(0, len(q) - slots[p]) for p, q in queues.items()})
    for k, launch in enumerate(launches):
        for program in (launch.programs if any_programs else (None,)):
            queue = queues.get(program, [])
            while heads[program] < len(queue) and queue[heads[program]][0] < launch.ts:
                heads[program] += 1  # launched before the trace began
            if heads[program] < len(queue):
                for i in queue[heads[program]][1]:
                    owner[i] = k
                    methods["program_order"] += 1
                heads[program] += 1

    # 4. after the step that ended last; time order only where nothing else placed an op
    placed_any = bool(owner)
    ends: dict[int, float] = {}  # launch -> end of its last kernel placed by rules 1-3
    for i, k in owner.items():
        if not parsed.ops[i].is_copy:
            ends[k] = max(ends.get(k, float("-inf")), parsed.ops[i].end)
    by_end = sorted((e, k) for k, e in ends.items())
    end_times = [e for e, _ in by_end]
    for i in loose:
        op = parsed.ops[i]
        j = bisect.bisect_right(end_times, op.ts) - 1
        if j >= 0:
            owner[i] = by_end[j][1]
            methods["after_step"] += 1
            continue
        k = bisect.bisect_right(starts, op.ts) - 1
        if k >= 0 and not placed_any:
            owner[i] = k
            methods["time_order"] += 1

    by_launch: dict[int, list[DeviceOp]] = collections.defaultdict(list)
    for i, k in owner.items():
        by_launch[k].append(parsed.ops[i])
    steps = [Step(launches[k], sorted(by_launch[k], key=lambda o: o.ts)) for k in sorted(by_launch)]
    unplaced = [op for i, op in enumerate(parsed.ops) if i not in owner]
    return Attribution(steps, launches, unplaced, dict(methods), parsed.platform)


def attribute_events(events: list[dict], launch_name: str = LAUNCH_SPAN) -> Attribution:
    return attribute(parse(events, launch_name))
