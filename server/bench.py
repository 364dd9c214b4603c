"""Serving benchmark for a running jaxoverlap server (`jaxoverlap bench`).

Modelled on the usual serving benchmarks (SGLang's bench_serving, JetStream's benchmark_serving):

* prompts come from a ShareGPT-format JSON file (a list of {"conversations": [{"from": "human",
  "value": ...}, {"from": "gpt", "value": ...}, ...]}; the first human turn is the prompt and the
  reply that follows sets the output length) or are synthetic random token ids with input and
  output lengths drawn from a fixed value ("128") or a uniform range ("64:256");
* load is a request rate with Poisson arrivals (or "inf": everything at once), burstier or
  steadier with --burstiness (gamma-distributed gaps, as vLLM's benchmark), and/or a cap on
  concurrent requests;
* per request we time the first chunk (TTFT), the gaps between chunks (ITL), and the whole call;
  TPOT is (latency - TTFT) / (output tokens - 1). We report throughput (output tokens/s,
  requests/s), TTFT/TPOT/ITL/E2E (mean, median, p99), the server-reported accept length
  (per request, and over all tokens), and with --goodput SLOs the rate of requests that met
  every one of them (goodput, as in DistServe and vLLM's benchmark);
* from each jaxoverlap server it also reads the engine loop's totals before and after the timed
  runs (GetServerInfo), and reports per decode step the engine's host time, its wait for the
  device and the share of steps where the device may have waited for the host;
* two targets can be compared on the same prompts and arrival schedule, one after the other
  ("sequential") or in alternating blocks ("alternating", which spreads slow drifts such as
  thermal throttling or a shared host's noise evenly over both), with a side-by-side table.

Requests default to ignore_eos=True so that every request produces exactly its planned output
length, which is what makes two runs comparable; pass --disable-ignore-eos to let EOS stop them.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import random
import sys
import time
from typing import Sequence

import grpc
import numpy as np

from jaxoverlap.server.client import AsyncGenerationClient, Chunk


# ---- workload -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """A fixed length ("128") or a uniform integer range, both ends included ("64:256")."""

    low: int
    high: int

    @classmethod
    def parse(cls, spec: str | int) -> "LengthDist":
        if isinstance(spec, int):
            low = high = spec
        else:
            s = str(spec).strip()
            for prefix in ("uniform:", "fixed:"):
                if s.startswith(prefix):
                    s = s[len(prefix):]
            parts = s.split(":")
            try:
                if len(parts) == 1:
                    low = high = int(parts[0])
                elif len(parts) == 2:
                    low, high = int(parts[0]), int(parts[1])
                else:
                    raise ValueError
            except ValueError:
                raise ValueError(f"bad length spec {spec!r}: use N (fixed) or LOW:HIGH (uniform)") from None
        if low < 1 or high < low:
            raise ValueError(f"bad length spec {spec!r}: need 1 <= LOW <= HIGH")
        return cls(low, high)

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self):
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclasses.dataclass
class BenchRequest:
    prompt: str | list[int]
    input_len: int  # known for synthetic prompts, estimated for ShareGPT ones
    output_len: int


def synthetic_requests(num: int, input_len: LengthDist, output_len: LengthDist, vocab_size: int,
                       rng: random.Random, avoid_ids: Sequence[int] = ()) -> list[BenchRequest]:
    """Random token-id prompts. Low ids (often special/control tokens) and `avoid_ids` are skipped."""
    low = min(100, vocab_size // 4)
    avoid = set(avoid_ids)
    out = []
    for _ in range(num):
        n = input_len.sample(rng)
        ids = []
        while len(ids) < n:
            t = rng.randrange(low, vocab_size)
            if t not in avoid:
                ids.append(t)
        out.append(BenchRequest(ids, n, output_len.sample(rng)))
    return out


def _load_tokenizer(path: str | None):
    if not path:
        return None
    from tokenizers import Tokenizer

    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    return Tokenizer.from_file(path)


def _count_tokens(tokenizer, text: str) -> int:
    if tokenizer is None:
        return max(1, len(text) // 4)  # ~4 characters per token for English text
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def sharegpt_requests(path: str, num: int, rng: random.Random, tokenizer=None, output_len: int | None = None,
                      max_input_len: int | None = None, max_output_len: int | None = None,
                      min_len: int = 4) -> list[BenchRequest]:
    """Sample `num` prompts from a ShareGPT JSON file (shuffled with rng; repeats if too few)."""
    with open(path) as f:
        data = json.load(f)
    pairs = []
    for entry in data:
        conv = (entry.get("conversations") or entry.get("conversation") or []) if isinstance(entry, dict) else []
        turns = [t for t in conv if isinstance(t, dict)]
        for ask, answer in zip(turns, turns[1:]):
            if ask.get("from") == "human" and answer.get("from") in ("gpt", "assistant", "chatgpt"):
                prompt, reply = ask.get("value"), answer.get("value")
                if isinstance(prompt, str) and isinstance(reply, str):  # (some dumps hold nulls)
                    pairs.append((prompt, reply))
                break
    rng.shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(out) >= num:
            break
        if not prompt:
            continue
        n_in = _count_tokens(tokenizer, prompt)
        n_out = output_len if output_len is not None else _count_tokens(tokenizer, reply)
        if n_in < min_len or n_out < 1 or (output_len is None and n_out < min_len):
            continue
        if max_input_len is not None and n_in > max_input_len:
            continue
        if max_output_len is not None:
            n_out = min(n_out, max_output_len)
        out.append(BenchRequest(prompt, n_in, n_out))
    if not out:
        raise ValueError(f"no usable conversations in {path}")
    usable = len(out)
    while len(out) < num:  # a small file: reuse its prompts in turn (prefix caching will then show up)
        out.append(dataclasses.replace(out[len(out) % usable]))
    return out[:num]


def arrival_offsets(num: int, request_rate: float, rng: random.Random, burstiness: float = 1.0) -> list[float]:
    """Send times in seconds from the start, all 0 for an infinite rate. Otherwise gaps drawn
    from a gamma distribution of mean 1 / request_rate and shape `burstiness`: 1 is a Poisson
    process, below 1 burstier (gaps vary more), above 1 steadier."""
    if not burstiness > 0 or math.isinf(burstiness):
        raise ValueError(f"burstiness must be a positive number, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num
    if not request_rate > 0:
        raise ValueError("request rate must be > 0 (or inf)")
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
    return out


GOODPUT_METRICS = {"ttft": "time to first token", "tpot": "time per output token", "e2el": "end-to-end latency"}


def parse_goodput(specs: Sequence[str] | None) -> dict[str, float]:
    """SLOs given as "ttft:200 tpot:50 e2el:5000" (milliseconds) -> {metric: ms}."""
    slos: dict[str, float] = {}
    for spec in specs or ():
        name, sep, value = str(spec).partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"goodput SLO {spec!r}: write METRIC:MS with METRIC one of {sorted(GOODPUT_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {spec!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"goodput SLO {spec!r}: the limit must be a positive number of milliseconds")
        slos[name] = ms
    return slos


# ---- running ------------------------------------------------------------------------------------


@dataclasses.dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    start: float = 0.0  # perf_counter at send
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    planned_output_len: int = 0
    accept_length: float = 0.0
    finish_reason: str = ""


async def _one_request(client: AsyncGenerationClient, req: BenchRequest, sampling: dict,
                       timeout: float | None) -> RequestResult:
    r = RequestResult(planned_output_len=req.output_len)
    r.start = last = time.perf_counter()
    first = True
    try:
        async for item in client.generate(req.prompt, timeout=timeout, max_new_tokens=req.output_len, **sampling):
            now = time.perf_counter()
            if isinstance(item, Chunk):
                if not item.token_ids:
                    continue
                if first:
                    r.ttft = now - r.start
                    first = False
                else:  # one gap per streamed chunk, whatever its tokens (vLLM's ITL; TPOT is per token)
                    r.itl.append(now - last)
                last = now
            else:
                r.latency = now - r.start
                r.output_tokens = item.completion_tokens
                r.prompt_tokens = item.prompt_tokens
                r.accept_length = item.accept_length
                r.finish_reason = item.finish_reason
                r.success = item.finish_reason != "abort"
                if not r.success:
                    r.error = "aborted"
    except grpc.RpcError as e:
        r.error = f"{e.code().name}: {e.details()}"
    except Exception as e:  # noqa: BLE001 - one broken request must not end the benchmark
        r.error = repr(e)
    if not r.latency:
        r.latency = time.perf_counter() - r.start
    return r


async def run_load(client: AsyncGenerationClient, requests: Sequence[BenchRequest], offsets: Sequence[float],
                   sampling: dict, max_concurrency: int | None = None, timeout: float | None = None,
                   pbar=None) -> tuple[list[RequestResult], float]:
    """Send `requests` at `offsets` (seconds from now), at most max_concurrency at a time."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def fire(i: int):
        delay = offsets[i] - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is None:
            res = await _one_request(client, requests[i], sampling, timeout)
        else:
            async with sem:
                res = await _one_request(client, requests[i], sampling, timeout)
        if pbar is not None:
            pbar.update(1)
        return res

    results = await asyncio.gather(*(fire(i) for i in range(len(requests))))
    return list(results), time.perf_counter() - t0


def _stats(values, scale: float = 1000.0) -> dict:
    """mean/median/p99/std in ms (scale) of a list; zeros when empty."""
    if not len(values):
        return {"mean": 0.0, "median": 0.0, "p99": 0.0, "std": 0.0}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99)),
            "std": float(a.std())}


def _tpot(r: "RequestResult") -> float | None:
    """Time per output token after the first; None for a one-token output."""
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def _meets(r: "RequestResult", slos: dict[str, float]) -> bool:
    """Whether a completed request met every SLO (ms). TPOT of a one-token output is 0."""
    got = {"ttft": r.ttft, "tpot": _tpot(r) or 0.0, "e2el": r.latency}
    return all(1e3 * got[name] <= ms for name, ms in slos.items())


def _overall_accept_length(ok: Sequence["RequestResult"]) -> float:
    """Decode tokens over decode steps, summed over every request: each request's steps are
    its decode tokens (all but the prefill's first) over its accept length. Unlike the mean
    of the per-request values, long outputs weigh as many steps as they took."""
    tokens = sum(r.output_tokens - 1 for r in ok if r.output_tokens > 1 and r.accept_length > 0)
    steps = sum((r.output_tokens - 1) / r.accept_length for r in ok if r.output_tokens > 1 and r.accept_length > 0)
    return tokens / steps if steps else 0.0


def summarize(results: Sequence[RequestResult], duration: float, slos: dict[str, float] | None = None) -> dict:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [_tpot(r) for r in ok if r.output_tokens > 1]
    itls = [g for r in ok for g in r.itl]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1
    ranked = sorted(errors.items(), key=lambda kv: -kv[1])
    shown = dict(ranked[:10])  # the most frequent messages; the rest counted together, so they sum to `failed`
    if len(ranked) > 10:
        shown["(other errors)"] = sum(n for _, n in ranked[10:])
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": shown,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        # Little's law: the average number of requests in flight.
        "concurrency": sum(r.latency for r in ok) / duration if duration > 0 else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats(itls),
        "e2e_latency_ms": _stats([r.latency for r in ok]),
        "accept_length": _stats([r.accept_length for r in ok], scale=1.0),
        "accept_length_overall": _overall_accept_length(ok),
        # Requests per second that completed within every SLO (None: no SLO given).
        "goodput": (sum(_meets(r, slos) for r in ok) / duration if duration > 0 else 0.0) if slos else None,
    }


_LOOP_KEYS = ("decode_iterations", "decode_host_s", "decode_wait_s", "decode_host_bound_iterations",
              "compiling_launches")


async def _loop_totals(client) -> dict | None:
    """The server's engine loop totals (Engine.stats()["loop"]), or None if it reports none."""
    try:
        loop = (await client.server_info(timeout=10))["stats"].get("loop")
    except grpc.RpcError:
        return None
    return {k: loop[k] for k in _LOOP_KEYS} if loop and all(k in loop for k in _LOOP_KEYS) else None


def engine_summary(delta: dict | None) -> dict | None:
    """Per decode iteration of the server's engine loop over the timed runs (iterations that
    launched a prefill are left out): the host's time (prepare + launch + process), the wait
    for the device, and the share of iterations that found the previous step already done
    (the device may have waited for the host); and the launches that compiled a program
    meanwhile (all kinds: what the server's warm-up left to the timed runs). Counts every
    client's traffic, so it is this run's only while nothing else uses the server."""
    if not delta or delta["decode_iterations"] <= 0:
        return None
    n = delta["decode_iterations"]
    return {"decode_iterations": n,
            "host_ms_per_decode": 1e3 * delta["decode_host_s"] / n,
            "wait_ms_per_decode": 1e3 * delta["decode_wait_s"] / n,
            "host_bound_share": delta["decode_host_bound_iterations"] / n,
            "compiling_launches": delta.get("compiling_launches", 0)}


# ---- reporting ----------------------------------------------------------------------------------

_ROWS = [
    ("Successful requests", "completed", "{:.0f}"),
    ("Failed requests", "failed", "{:.0f}"),
    ("Duration (s)", "duration_s", "{:.2f}"),
    ("Total input tokens", "total_input_tokens", "{:.0f}"),
    ("Total output tokens", "total_output_tokens", "{:.0f}"),
    ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
    ("Output token throughput (tok/s)", "output_throughput", "{:.2f}"),
    ("Total token throughput (tok/s)", "total_token_throughput", "{:.2f}"),
    ("Concurrency", "concurrency", "{:.2f}"),
]
_DIST_ROWS = [("TTFT (ms)", "ttft_ms"), ("TPOT (ms)", "tpot_ms"), ("ITL per chunk (ms)", "itl_ms"),
              ("E2E latency (ms)", "e2e_latency_ms"), ("Accept length", "accept_length")]
# Whether a larger value is better, for the comparison column.
_HIGHER_IS_BETTER = {"request_throughput", "output_throughput", "total_token_throughput", "completed", "accept_length",
                     "accept_length_overall", "goodput"}


_ENGINE_ROWS = [("Engine host time per decode step (ms)", "host_ms_per_decode"),
                ("Engine device wait per decode step (ms)", "wait_ms_per_decode"),
                ("Engine host-bound decode steps (share)", "host_bound_share"),
                ("Engine launches that compiled", "compiling_launches")]


def _flat_rows(summary: dict, engine_rows: bool = True) -> list[tuple[str, str, float]]:
    rows = [(label, key, float(summary[key])) for label, key, _ in _ROWS]
    if summary.get("goodput") is not None:
        rows.append(("Request goodput (req/s within the SLOs)", "goodput", float(summary["goodput"])))
    for label, key in _DIST_ROWS:
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {label}", f"{key}.{stat}", float(summary[key][stat])))
    rows.append(("Accept length over all tokens", "accept_length_overall", float(summary["accept_length_overall"])))
    if engine_rows:
        rows += [(label, f"engine.{key}", float(summary["engine"][key])) for label, key in _ENGINE_ROWS]
    return rows


def format_table(summaries: dict[str, dict]) -> str:
    """One column per target; with two targets, a last column with B relative to A."""
    labels = list(summaries)
    engine_rows = all(s.get("engine") for s in summaries.values())  # servers that report their loop
    per = {name: _flat_rows(s, engine_rows) for name, s in summaries.items()}
    width = max(len(r[0]) for r in next(iter(per.values())))
    colw = max(14, *(len(n) for n in labels))
    head = f"{'Metric':<{width}}  " + "  ".join(f"{n:>{colw}}" for n in labels)
    if len(labels) == 2:
        rel = f"vs {labels[0]}"  # the second target relative to the first
        relw = max(9, len(rel))
        head += f"  {rel:>{relw}}"
    lines = ["=" * len(head), head, "-" * len(head)]
    for i, (label, key, _) in enumerate(per[labels[0]]):
        vals = [per[n][i][2] for n in labels]
        line = f"{label:<{width}}  " + "  ".join(f"{v:>{colw}.2f}" for v in vals)
        if len(labels) == 2:
            a, b = vals
            line += f"  {(b / a - 1) * 100:>+{relw - 1}.1f}%" if a else f"  {'':>{relw}}"
        lines.append(line)
    lines.append("=" * len(head))
    return "\n".join(lines)


# ---- orchestration ------------------------------------------------------------------------------


@dataclasses.dataclass
class BenchConfig:
    targets: list[str]
    labels: list[str] | None = None
    dataset: str = "random"  # "random" or a path to a ShareGPT JSON file
    num_prompts: int = 200
    input_len: str = "256"
    output_len: str = "128"
    sharegpt_output_len: int | None = None
    max_input_len: int | None = None
    max_output_len: int | None = None
    tokenizer: str | None = None
    request_rate: float = float("inf")
    burstiness: float = 1.0
    goodput: dict[str, float] = dataclasses.field(default_factory=dict)  # SLO per metric, ms (parse_goodput)
    max_concurrency: int | None = None
    compare_mode: str = "alternating"  # or "sequential"
    rounds: int = 4
    warmup_requests: int = 2
    seed: int = 0
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    ignore_eos: bool = True
    # Every request's structured output ({"json_schema": ...} | {"regex": ...} | {"choice": [...]}):
    # a request then ends where its grammar does, before its planned output length.
    structured_output: dict | None = None
    timeout: float | None = None
    token: str | None = None
    tls_ca: str | None = None
    tls: bool = False
    output_file: str | None = None
    save_requests: bool = False
    progress: bool = True

    def check(self) -> None:
        """ValueError for a config that cannot run, before anything connects."""
        if not self.targets or len(self.targets) > 2:
            raise ValueError("give one target, or two to compare")
        if self.labels is not None and len(self.labels) != len(self.targets):
            raise ValueError(f"give one label per target ({len(self.targets)}), got {len(self.labels)}")
        if self.compare_mode not in ("alternating", "sequential"):
            raise ValueError("compare_mode must be 'alternating' or 'sequential'")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 (or unset: no cap), got {self.max_concurrency}")
        if self.rounds < 1 or self.warmup_requests < 0:
            raise ValueError("rounds must be >= 1 and warmup_requests >= 0")
        if self.dataset != "random" and not os.path.isfile(self.dataset):
            raise ValueError(f"no dataset file {self.dataset!r} (give 'random' or a ShareGPT JSON file)")
        if self.output_file not in (None, "-") and os.path.isdir(self.output_file):
            raise ValueError(f"the output file {self.output_file!r} is a folder")


def build_requests(cfg: BenchConfig, vocab_size: int, eos_ids: Sequence[int]) -> list[BenchRequest]:
    rng = random.Random(cfg.seed)
    if cfg.dataset == "random":
        return synthetic_requests(cfg.num_prompts, LengthDist.parse(cfg.input_len), LengthDist.parse(cfg.output_len),
                                  vocab_size, rng, avoid_ids=eos_ids)
    return sharegpt_requests(cfg.dataset, cfg.num_prompts, rng, tokenizer=_load_tokenizer(cfg.tokenizer),
                             output_len=cfg.sharegpt_output_len, max_input_len=cfg.max_input_len,
                             max_output_len=cfg.max_output_len)


async def benchmark(cfg: BenchConfig) -> dict:
    cfg.check()
    labels = cfg.labels or (["A", "B"][: len(cfg.targets)] if len(cfg.targets) == 2 else ["result"])
    clients = [AsyncGenerationClient(t, token=cfg.token, tls_ca=cfg.tls_ca, tls=cfg.tls) for t in cfg.targets]
    try:
        infos = [await c.model_info(timeout=30) for c in clients]
        if len(infos) == 2 and infos[0]["vocab_size"] != infos[1]["vocab_size"]:
            print(f"warning: the two servers have different vocabularies ({infos[0]['vocab_size']} vs "
                  f"{infos[1]['vocab_size']}); token-id prompts are generated for the smaller", file=sys.stderr)
        vocab = min(i["vocab_size"] for i in infos)
        eos = sorted({t for i in infos for t in i["eos_token_ids"]})
        requests = build_requests(cfg, vocab, eos)
        offsets = arrival_offsets(len(requests), cfg.request_rate, random.Random(cfg.seed + 1), cfg.burstiness)
        sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                    "ignore_eos": cfg.ignore_eos, "structured_output": cfg.structured_output}

        for c in clients:  # compile/caches warm, outside the timed region
            warm = [dataclasses.replace(r, output_len=min(r.output_len, 16)) for r in requests[: cfg.warmup_requests]]
            if warm:
                await run_load(c, warm, [0.0] * len(warm), sampling, timeout=cfg.timeout)

        # Blocks of (start, end) indices: the whole list for one target or sequential mode.
        n = len(requests)
        if len(clients) == 2 and cfg.compare_mode == "alternating":
            rounds = max(1, min(cfg.rounds, n))
            bounds = [round(i * n / rounds) for i in range(rounds + 1)]
            blocks = list(zip(bounds[:-1], bounds[1:]))
        else:
            blocks = [(0, n)]
        pbar = None
        if cfg.progress:
            from tqdm import tqdm

            pbar = tqdm(total=n * len(clients), desc="bench", unit="req", file=sys.stderr)
        results: list[list[RequestResult]] = [[] for _ in clients]
        durations = [0.0 for _ in clients]
        loop_deltas: list = [None for _ in clients]  # summed engine loop totals per target (False: none)
        for b, (lo, hi) in enumerate(blocks):
            # Swap the order every block so neither target always runs first.
            order = list(range(len(clients))) if b % 2 == 0 else list(reversed(range(len(clients))))
            if len(blocks) == 1:
                order = list(range(len(clients)))
            for k in order:
                base = offsets[lo]
                before = await _loop_totals(clients[k])
                res, dur = await run_load(clients[k], requests[lo:hi], [o - base for o in offsets[lo:hi]], sampling,
                                          cfg.max_concurrency, cfg.timeout, pbar)
                after = await _loop_totals(clients[k])
                results[k].extend(res)
                durations[k] += dur
                if before is None or after is None or loop_deltas[k] is False:
                    loop_deltas[k] = False  # this server reports no loop totals
                else:
                    loop_deltas[k] = {key: (loop_deltas[k] or {}).get(key, 0) + after[key] - before[key]
                                      for key in _LOOP_KEYS}
        if pbar is not None:
            pbar.close()
    finally:
        for c in clients:
            await c.close()

    summaries = {label: summarize(res, dur, cfg.goodput) for label, res, dur in zip(labels, results, durations)}
    for label, delta in zip(labels, loop_deltas):
        summaries[label]["engine"] = engine_summary(delta or None)
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                   for k, v in dataclasses.asdict(cfg).items() if k not in ("token",)},
        "targets": {label: {"target": t, "model": i} for label, t, i in zip(labels, cfg.targets, infos)},
        "results": summaries,
    }
    if cfg.save_requests:
        report["requests"] = {label: [dataclasses.asdict(r) for r in res] for label, res in zip(labels, results)}
    return report


def add_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser
    p.add_argument("--target", action="append", default=None, metavar="HOST:PORT",
                   help="server to measure (default 127.0.0.1:50051); give it twice to compare two servers")
    p.add_argument("--label", action="append", default=None, help="name of each target in the report")
    p.add_argument("--dataset", default="random",
                   help="'random' (synthetic token ids) or the path of a ShareGPT-format JSON file")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", default="256", help="synthetic prompt length: N or LOW:HIGH (uniform)")
    p.add_argument("--output-len", default="128", help="synthetic output length: N or LOW:HIGH (uniform)")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="fixed output length for ShareGPT prompts (default: the length of the recorded reply)")
    p.add_argument("--max-input-len", type=int, default=None, help="skip ShareGPT prompts longer than this")
    p.add_argument("--max-output-len", type=int, default=None, help="cap ShareGPT output lengths")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json (or a folder with one) to count ShareGPT tokens; default ~4 chars/token")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf sends everything at once (default)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="shape of the gamma-distributed gaps between arrivals at --request-rate: 1 is Poisson "
                        "(default), below 1 burstier, above 1 steadier")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:10000: also report the requests per second that met "
                        "all of them")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--compare-mode", choices=("alternating", "sequential"), default="alternating",
                   help="with two targets: alternate blocks of the workload, or run all of A then all of B")
    p.add_argument("--rounds", type=int, default=4, help="blocks in alternating mode")
    p.add_argument("--warmup-requests", type=int, default=2, help="untimed requests sent to each target first")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts and arrival times")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--disable-ignore-eos", action="store_true", help="let EOS end requests early")
    from jaxoverlap.cli import add_structured_output_args

    add_structured_output_args(p)  # every request constrained; it ends where its grammar does
    p.add_argument("--request-timeout", type=float, default=None, help="per-request deadline in seconds")
    p.add_argument("--token", default=os.environ.get("JAXOVERLAP_AUTH_TOKEN"),
                   help="bearer token (default: $JAXOVERLAP_AUTH_TOKEN)")
    p.add_argument("--tls-ca", default=None, help="CA certificate (PEM) to connect with TLS")
    p.add_argument("--tls", action="store_true", help="connect with TLS using the system's roots")
    p.add_argument("--output-file", default=None,
                   help="JSON result file (default results/bench-<date>.json; '-' for none)")
    p.add_argument("--save-requests", action="store_true", help="also store every request's timings in the file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def config_from_args(args) -> BenchConfig:
    from jaxoverlap.structured import from_command_line

    return BenchConfig(
        targets=args.target or ["127.0.0.1:50051"], labels=args.label, dataset=args.dataset,
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        sharegpt_output_len=args.sharegpt_output_len, max_input_len=args.max_input_len,
        max_output_len=args.max_output_len, tokenizer=args.tokenizer, request_rate=args.request_rate,
        burstiness=args.burstiness, goodput=parse_goodput(args.goodput),
        max_concurrency=args.max_concurrency, compare_mode=args.compare_mode, rounds=args.rounds,
        warmup_requests=args.warmup_requests, seed=args.seed, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, ignore_eos=not args.disable_ignore_eos,
        structured_output=from_command_line(args.json_schema, args.regex, args.choice),
        timeout=args.request_timeout, token=args.token,
        tls_ca=args.tls_ca, tls=args.tls, output_file=args.output_file, save_requests=args.save_requests,
        progress=not args.no_progress)


def run_bench(args) -> int:
    try:
        cfg = config_from_args(args)  # parses the SLOs and the constraint: a typo fails here, before connecting
        # Validate the length specs and the arrival shape before connecting, so typos fail fast.
        LengthDist.parse(cfg.input_len)
        LengthDist.parse(cfg.output_len)
        arrival_offsets(1, cfg.request_rate, random.Random(0), cfg.burstiness)
        cfg.check()
        path = cfg.output_file
        if path is None:
            path = os.path.join("results", f"bench-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
        if path != "-":  # the results' file is made now, not after the whole run
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            open(path, "a").close()
    except (ValueError, OSError) as e:  # (InvalidRequestError too)
        print(f"error: {e}", file=sys.stderr)
        return 2
    import grpc

    try:
        report = asyncio.run(benchmark(cfg))
    except grpc.RpcError as e:  # a server that is not there, or that failed the run
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        if path != "-" and os.path.getsize(path) == 0:
            os.remove(path)  # made above, and nothing to put in it
        return 1
    print(format_table(report["results"]))
    if path != "-":
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {path}")
    failed = sum(s["failed"] for s in report["results"].values())
    return 1 if failed and not any(s["completed"] for s in report["results"].values()) else 0
