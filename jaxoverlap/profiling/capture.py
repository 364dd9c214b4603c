"""Run the profile workload on an Engine, with the overlap loop and with the normal loop: timed
runs for throughput and host timings, and one traced run per loop for the device timeline.

The workload is `batch_size` requests of `prompt_len` random prompt tokens, all queued at
once, each generating exactly `new_tokens` tokens greedily (EOS ignored), so both loops do
the same work. Every run draws new prompts, so the prefix cache never turns a later run's
prefill into a cache hit.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time

import jax
import numpy as np

from jaxoverlap.buckets import pick
from jaxoverlap.engine import Engine, StepTiming
from jaxoverlap.errors import InvalidRequestError
from jaxoverlap.profiling import trace as trace_mod
from jaxoverlap.sampling_params import SamplingParams

MODES = ("overlap", "normal")  # engine.overlap True / False


@dataclasses.dataclass(frozen=True)
class Workload:
    batch_size: int
    prompt_len: int
    new_tokens: int

    def params(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.new_tokens, temperature=0.0, ignore_eos=True)


def check_workload(engine: Engine, w: Workload) -> None:
    """Raises the InvalidRequestError (PromptTooLongError: a prompt the context cannot hold)
    that engine.add_request would raise for the workload's requests, before anything runs;
    and InvalidRequestError where the context cannot hold the new tokens too (the engine
    would end the requests early, and the runs would make fewer tokens than asked)."""
    engine.check_request([1] * w.prompt_len, w.params())
    if w.prompt_len + w.new_tokens > engine.max_context_len:
        raise InvalidRequestError(f"{w.prompt_len} prompt tokens + {w.new_tokens} new tokens do not fit the "
                                  f"context of {engine.max_context_len} tokens")


@dataclasses.dataclass(frozen=True)
class TraceWindow:
    steps: int  # loop iterations to trace
    skip: int = 2  # start once this many iterations in a row launched decode steps


@dataclasses.dataclass
class Run:
    mode: str
    wall_s: float
    tokens: int
    timings: list[StepTiming]
    attribution: trace_mod.Attribution | None = None  # traced runs only
    trace_file: str | None = None  # kept trace (when asked for)
    start_s: float = 0.0  # time.perf_counter() when the loop started (timings' start_s is on this clock)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


class WorkloadRunner:
    def __init__(self, engine: Engine, seed: int = 0):
        self.engine = engine
        self._rng = np.random.default_rng(seed)
        self._runs = 0

    def _submit(self, w: Workload) -> None:
        vocab = self.engine.model_config.vocab_size
        params = w.params()
        for i in range(w.batch_size):
            prompt = self._rng.integers(1, vocab, w.prompt_len).tolist()  # [prompt_len]
            self.engine.add_request(f"profile-{self._runs}-{i}", prompt, params)
        self._runs += 1

    def run(self, w: Workload, mode: str, window: TraceWindow | None = None, trace_dir: str | None = None) -> Run:
        """One workload to completion. With a window, traces that many loop iterations of the
        decode phase into trace_dir and attributes the trace's device ops to steps."""
        engine = self.engine
        engine.set_overlap(mode == "overlap")
        # Launch spans name their iteration as len(engine.timings): clearing makes it the
        # index into this run's timings.
        engine.timings.clear()
        tokens0 = engine.tokens_generated
        self._submit(w)
        tracing, traced = False, 0
        profiler_s = 0.0  # starting and stopping the profiler (writing the trace): not the run's time
        t0 = time.perf_counter()
        while engine.has_work():
            if window is not None and not tracing and traced == 0 and self._steady(window.skip):
                t = time.perf_counter()
                _start_trace(trace_dir, engine)
                profiler_s += time.perf_counter() - t
                tracing = True
            engine.step()
            if tracing:
                traced += 1
                if traced >= window.steps:
                    t = time.perf_counter()
                    _stop_trace(engine)
                    profiler_s += time.perf_counter() - t
                    tracing = False
        wall = time.perf_counter() - t0 - profiler_s
        if tracing:  # the workload ended inside the window
            _stop_trace(engine)
        run = Run(mode, wall, engine.tokens_generated - tokens0, list(engine.timings), start_s=t0)
        if window is not None:
            if traced == 0:
                raise RuntimeError(f"the workload never reached {window.skip} decode steps in a row: "
                                   "raise --new-tokens")
            run.trace_file = trace_mod.find_trace_file(trace_dir)
            run.attribution = trace_mod.attribute_events(trace_mod.load_events(run.trace_file))
        return run

    def _steady(self, skip: int) -> bool:
        t = self.engine.timings
        return len(t) >= skip and all(t[-1 - i].kind == "decode" for i in range(skip))


def _start_trace(trace_dir: str, engine: Engine) -> None:
    # Under overlap the step launched by the last untraced iteration is still in flight: wait
    # for it (the device state is its output) so that none of its ops runs inside the trace,
    # where no traced launch launched it. The first traced launch then finds the device
    # idle, as it mostly would anyway after the profiler's slow start; the steps after it
    # are back in the loop's steady state (report.timeline_section skips the first).
    jax.block_until_ready(engine.runner.state)
    # The Python tracer would record every Python call and slow the host several times over,
    # which is the very time this profile measures; JAX's own C++ host events stay.
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True, profiler_options=options)


def _stop_trace(engine: Engine) -> None:
    # Under overlap the last traced step is still running: wait for it (the device state is
    # its output) so that all of its ops are in the trace.
    jax.block_until_ready(engine.runner.state)
    jax.profiler.stop_trace()


@dataclasses.dataclass
class BatchResult:
    workload: Workload
    timed: dict[str, list[Run]]  # mode -> timed runs (untraced)
    traced: dict[str, Run]  # mode -> the traced run
    whole: Run | None = None  # overlap loop traced from its first step to its end (whole_run=True)


def decode_programs(engine: Engine, w: Workload) -> tuple[list[int], list[int]]:
    """Batch and context buckets of every decode program the workload can meet.

    The batch can shrink through every smaller bucket: with speculation, requests finish at
    different steps, and each run's fresh prompts give another pattern, so one warm-up run
    does not visit them all (a later run then compiles inside its timing). The context
    reaches the pages reserved for the prompt, the new tokens, the two windows and the
    lookahead beyond them and the reservation's slack (Scheduler._schedule_decode)."""
    r, cfg = engine.runner, engine.scheduler.cfg
    top_batch = pick(r.batch_buckets, w.batch_size)
    longest = w.prompt_len + w.new_tokens + 2 * cfg.window + cfg.lookahead + cfg.reserve_slack
    longest = -(-longest // cfg.page_size) * cfg.page_size  # whole pages
    top_ctx = pick(r.decode_ctx_buckets, min(longest, r.decode_ctx_buckets[-1]))
    return ([b for b in r.batch_buckets if b <= top_batch], [c for c in r.decode_ctx_buckets if c <= top_ctx])


def _keep_trace(run: Run, folder: str | None, name: str) -> None:
    """Copy a traced run's trace (in a temporary folder about to go) to folder/name and
    point the run at the copy; without a folder the run keeps no trace file."""
    if folder:
        os.makedirs(folder, exist_ok=True)
        dst = os.path.join(folder, name)
        shutil.copyfile(run.trace_file, dst)
        run.trace_file = dst
    else:
        run.trace_file = None


# Traces a run from its first loop iteration (prefill included) to its end.
WHOLE_RUN = TraceWindow(steps=1 << 30, skip=0)


def profile(engine: Engine, workloads: list[Workload], *, repeats: int = 3, window: TraceWindow = TraceWindow(8),
            keep_traces: str | None = None, whole_run: bool = False, log=print) -> list[BatchResult]:
    """For each workload: the decode programs it can meet compiled ahead (`decode_programs`),
    a warm-up run per loop (compiles the rest), `repeats` timed runs per loop (the loops
    alternate, so drift hits both alike), then one traced run per loop; with `whole_run`,
    also one overlap run traced whole, for the device-only bound (report.bound_section)."""
    runner = WorkloadRunner(engine)
    results = []
    for w in workloads:
        t = time.perf_counter()
        compiled = engine.warmup(*decode_programs(engine, w))
        log(f"  B={w.batch_size} {len(compiled)} decode programs ready in {time.perf_counter() - t:.1f} s")
        for mode in MODES:
            runner.run(w, mode)  # compile every shape this workload meets
        timed = {m: [] for m in MODES}
        for r in range(repeats):
            for mode in MODES:
                run = runner.run(w, mode)
                if any(t.compiled for t in run.timings):  # a program no run before met: its compile is timed
                    log(f"  B={w.batch_size} {mode:7s} run {r} compiled a program; run again")
                    run = runner.run(w, mode)
                timed[mode].append(run)
                log(f"  B={w.batch_size} {mode:7s} run {r}: {run.tokens} tokens in {run.wall_s:.3f} s = "
                    f"{run.tokens_per_s:.1f} tok/s")
        traced = {}
        for mode in MODES:
            tmp = tempfile.mkdtemp(prefix="jaxoverlap-trace-")
            try:
                run = runner.run(w, mode, window, tmp)
                _keep_trace(run, keep_traces, f"trace_{mode}_b{w.batch_size}.json.gz")
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            traced[mode] = run
            a = run.attribution
            log(f"  B={w.batch_size} {mode:7s} traced: {len(a.steps)} steps, {sum(len(s.ops) for s in a.steps)} "
                f"device ops placed by {a.methods}, {len(a.unplaced)} unplaced")
        whole = None
        if whole_run:
            tmp = tempfile.mkdtemp(prefix="jaxoverlap-trace-")
            try:
                whole = runner.run(w, "overlap", WHOLE_RUN, tmp)
                _keep_trace(whole, keep_traces, f"trace_whole_b{w.batch_size}.json.gz")
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            log(f"  B={w.batch_size} overlap traced whole: {len(whole.attribution.steps)} steps")
        results.append(BatchResult(w, timed, traced, whole))
    return results
