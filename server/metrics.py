"""Prometheus metrics of one server, on a private registry (so several servers can share a process).

Per-request metrics (tokens, TTFT, accept length, latency, outcomes) are recorded by the gRPC
handlers on the event loop. Engine-wide gauges (queue depth, running requests, KV usage) are read
when Prometheus scrapes, through one `engine.stats()` call run on the engine thread between two
steps: nothing is polled while nobody scrapes, and the step loop never waits for the exporter.
"""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxoverlap.server.engine_worker import engine_stats

logger = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


class _EngineCollector:
    """Gauges computed from engine.stats() at scrape time."""

    def __init__(self, worker, server=None, timeout: float = 2.0):
        self._worker = worker
        self._server = server
        self._timeout = timeout

    def describe(self):
        # Without describe(), registering would call collect() before the engine runs.
        return list(self._families().values())

    def _families(self):
        return {
            "queue": GaugeMetricFamily("jaxoverlap_queue_depth", "Requests waiting for a slot in the engine"),
            "running": GaugeMetricFamily("jaxoverlap_running_requests", "Requests running in the engine"),
            "kv_used": GaugeMetricFamily("jaxoverlap_kv_cache_used_tokens",
                                         "KV-cache tokens held by requests (not those only the prefix cache keeps)"),
            "kv_cached": GaugeMetricFamily("jaxoverlap_kv_cache_cached_tokens", "KV-cache tokens in the prefix cache"),
            "kv_total": GaugeMetricFamily("jaxoverlap_kv_cache_total_tokens", "KV-cache capacity in tokens"),
            "kv_usage": GaugeMetricFamily("jaxoverlap_kv_cache_usage_ratio", "KV-cache tokens in use / capacity"),
            "streams": GaugeMetricFamily("jaxoverlap_active_streams", "Generate calls in flight on the server"),
            "up": GaugeMetricFamily("jaxoverlap_engine_up", "1 if the engine answered this scrape"),
            # The engine loop (Engine.stats()["loop"]): rate(host seconds) / rate(iterations) is
            # the host's time per step, which the overlap loop hides while it stays under the
            # device's step; host-bound iterations count where it may not have.
            "iterations": CounterMetricFamily("jaxoverlap_engine_iterations",
                                              "Engine loop iterations by the kind of step they launched",
                                              labels=["kind"]),
            "host_seconds": CounterMetricFamily("jaxoverlap_engine_host_seconds",
                                                "Host time of the engine loop by phase (prepare, launch, process)",
                                                labels=["phase"]),
            "wait_seconds": CounterMetricFamily("jaxoverlap_engine_device_wait_seconds",
                                                "Time the engine loop spent blocked on the device"),
            "host_bound": CounterMetricFamily("jaxoverlap_engine_host_bound_iterations",
                                              "Overlap iterations that found the previous step already done "
                                              "when they came to wait for it: the device may have waited for "
                                              "the host"),
            "compiling": CounterMetricFamily("jaxoverlap_engine_compiling_launches",
                                             "Launches that compiled a program (or loaded one from the persistent "
                                             "compilation cache): every request waited for them"),
            "compiling_seconds": CounterMetricFamily("jaxoverlap_engine_compiling_launch_seconds",
                                                     "Time spent in launches that compiled or loaded a program"),
        }

    def collect(self):
        fams = self._families()
        try:
            stats = self._worker.call_sync(engine_stats, timeout=self._timeout)
        except Exception:  # noqa: BLE001 - a scrape must not raise; report the engine as down
            fams["up"].add_metric([], 0)
            yield fams["up"]
            return
        used = stats.get("kv_used_tokens", 0)
        total = stats.get("kv_total_tokens", 0)
        fams["queue"].add_metric([], stats.get("num_waiting", 0))
        fams["running"].add_metric([], stats.get("num_running", 0))
        fams["kv_used"].add_metric([], used)
        fams["kv_total"].add_metric([], total)
        fams["kv_cached"].add_metric([], stats.get("kv_cached_tokens", 0))
        fams["kv_usage"].add_metric([], used / total if total else 0.0)
        fams["up"].add_metric([], 1)
        loop = stats.get("loop")
        if loop:
            fams["iterations"].add_metric(["prefill"], loop["prefill_iterations"])
            fams["iterations"].add_metric(["decode"], loop["decode_iterations"])
            for phase in ("prepare", "launch", "process"):
                fams["host_seconds"].add_metric([phase], loop[f"{phase}_s"])
            fams["wait_seconds"].add_metric([], loop["wait_s"])
            fams["host_bound"].add_metric([], loop["host_bound_iterations"])
            fams["compiling"].add_metric([], loop["compiling_launches"])
            fams["compiling_seconds"].add_metric([], loop["compiling_launch_s"])
        else:  # an engine without loop totals (the test fake)
            for name in ("iterations", "host_seconds", "wait_seconds", "host_bound", "compiling", "compiling_seconds"):
                del fams[name]
        if self._server is not None:
            fams["streams"].add_metric([], self._server.active_streams)
        else:
            del fams["streams"]
        yield from fams.values()


class ServerMetrics:
    def __init__(self, worker, server=None):
        self.registry = CollectorRegistry()
        r = self.registry
        # Exported as jaxoverlap_generated_tokens_total; rate() of it is the generated tokens/s.
        self.generated_tokens = Counter("jaxoverlap_generated_tokens", "Output tokens streamed to clients", registry=r)
        self.prompt_tokens = Counter("jaxoverlap_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("jaxoverlap_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.requests = Counter("jaxoverlap_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.errors = Counter("jaxoverlap_request_errors", "Generate calls rejected or failed, by gRPC code", ["code"],
                              registry=r)
        self.ttft = Histogram("jaxoverlap_time_to_first_token_seconds", "Time to first token (engine-measured)",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("jaxoverlap_request_latency_seconds", "Generate call duration on the server",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.accept_length = Histogram("jaxoverlap_accept_length", "Tokens gained per decode step, per request",
                                       buckets=_ACCEPT_BUCKETS, registry=r)
        r.register(_EngineCollector(worker, server))
        self._http = None

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the /metrics HTTP endpoint; returns the bound port (port 0 picks one)."""
        httpd, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = httpd
        return httpd.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
