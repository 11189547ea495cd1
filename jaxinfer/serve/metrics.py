"""Prometheus metrics of the server (`GET /metrics`), each registry per app.

Counters and histograms are per sample (a request with n = 4 is 4): received, finished by
finish reason (eos, stop, length, abort, error; so after a drain, received == the sum of
finished), rejected by HTTP status; TTFT, TPOT, ITL and end-to-end latency histograms from each
finished sample's `RequestMetrics`. Engine state is read at scrape time from the engine thread's
latest `Engine.stats()` snapshot: running/waiting requests, KV pages used/cached/total, prefix
cache hit tokens, preemptions, speculative drafted/accepted tokens, and LoRA adapters
(registered, resident in the device pool, loads into it, requests per adapter).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxinfer.engine.outputs import Completion

# Seconds; the latency of a 135M model on a CPU up to a 70B model's long prompts on a slice.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                   0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
# Engine stats -> (metric, kind, help).
ENGINE_STATS = {
    "running": ("jaxinfer_num_requests_running", "gauge", "Requests holding a slot."),
    "waiting": ("jaxinfer_num_requests_waiting", "gauge", "Requests queued in the scheduler."),
    "pages_used": ("jaxinfer_kv_pages_used", "gauge", "KV pages held by requests."),
    "pages_cached": ("jaxinfer_kv_pages_cached", "gauge", "KV pages in the prefix cache."),
    "pages_total": ("jaxinfer_kv_pages_total", "gauge", "KV pages in the pool."),
    "reused_tokens": ("jaxinfer_prefix_cache_hit_tokens", "counter",
                      "Prompt tokens served from the prefix cache."),
    "computed_tokens": ("jaxinfer_prompt_computed_tokens", "counter",
                        "Prompt token rows computed."),
    "prefix_queries": ("jaxinfer_prefix_cache_queries", "counter", "Prefix cache lookups."),
    "prefix_hits": ("jaxinfer_prefix_cache_hits", "counter", "Prefix cache lookups that hit."),
    "preemptions": ("jaxinfer_preemptions", "counter", "Requests preempted (recomputed)."),
    "spec_drafted_tokens": ("jaxinfer_spec_draft_tokens", "counter", "Speculative draft tokens."),
    "spec_accepted_tokens": ("jaxinfer_spec_accepted_tokens", "counter",
                      "Speculative draft tokens accepted."),
    "lora_adapters": ("jaxinfer_lora_adapters", "gauge", "LoRA adapters registered."),
    "lora_resident": ("jaxinfer_lora_adapters_resident", "gauge",
                      "LoRA adapters in the device pool."),
    "lora_loads": ("jaxinfer_lora_loads", "counter", "LoRA adapters paged into the pool."),
}


class ServerMetrics:
    """The server's registry. `engine_stats`: returns the engine thread's latest stats."""

    def __init__(self, engine_stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.received = Counter("jaxinfer_requests_received", "Samples accepted.", registry=r)
        self.finished = Counter("jaxinfer_requests_finished", "Samples finished, by reason.",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("jaxinfer_requests_rejected", "Requests refused, by status.",
                                ["status"], registry=r)
        self.ttft = self._histogram("time_to_first_token", "Arrival to first token.")
        self.tpot = self._histogram("time_per_output_token", "Mean gap after the first token.")
        self.itl = self._histogram("inter_token_latency", "Gap between consecutive tokens.")
        self.e2e = self._histogram("e2e_request_latency", "Arrival to last token.")
        self.output_tokens = Counter("jaxinfer_generation_tokens", "Tokens generated.",
                                     registry=r)
        r.register(_EngineCollector(engine_stats))

    def _histogram(self, name: str, help_: str) -> Histogram:
        return Histogram(f"jaxinfer_{name}_seconds", help_, buckets=LATENCY_BUCKETS,
                         registry=self.registry)

    def observe(self, completions: list[Completion]) -> None:
        """A finished request's samples (called on the engine thread)."""
        for c in completions:
            m = c.metrics
            self.finished.labels(c.finish_reason).inc()
            self.output_tokens.inc(len(c.token_ids))
            if m.ttft is not None:
                self.ttft.observe(m.ttft)
                self.e2e.observe(m.e2e)
            if m.tpot is not None:
                self.tpot.observe(m.tpot)
            for gap in m.itl:
                self.itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, engine_stats: Callable[[], dict]):
        self.engine_stats = engine_stats

    def collect(self):
        stats = self.engine_stats()
        for key, (name, kind, help_) in ENGINE_STATS.items():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            metric = family(name, help_)
            if key in stats:
                metric.add_metric([], float(stats[key]))
            yield metric
        per_adapter = CounterMetricFamily("jaxinfer_lora_requests",
                                          "Requests added per LoRA adapter.", labels=["adapter"])
        for name, count in stats.get("lora_requests", {}).items():
            per_adapter.add_metric([name], float(count))
        yield per_adapter
