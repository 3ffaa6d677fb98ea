"""Prometheus text exposition (format 0.0.4) for the server: counters, gauges and histograms.

Written here rather than taken from `prometheus_client`: the server needs a dozen metrics, and a
per-server registry (no process-global state) lets tests run several servers in one process and
read each one's numbers. Every metric is thread-safe: the engine thread observes tokens and
latencies while the event loop counts HTTP requests and renders `/metrics`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return str(int(v)) if float(v).is_integer() and abs(v) < 2**53 else repr(float(v))


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    type = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        self.name, self.help, self.labelnames = name, help, tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name}: labels {sorted(labels)} != {sorted(self.labelnames)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.type}"]


class Counter(_Metric):
    type = "counter"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        super().__init__(name, help, labelnames)
        self._values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up (inc by {amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_number(v)}" for k, v in items]


class Gauge(_Metric):
    """A value set directly, or read from `fn` at every scrape."""

    type = "gauge"

    def __init__(self, name: str, help: str, fn: Callable[[], float] | None = None):
        super().__init__(name, help)
        self._value, self.fn = 0.0, fn

    def set(self, value: float) -> None:
        self._value = float(value)

    def value(self) -> float:
        return float(self.fn()) if self.fn is not None else self._value

    def lines(self) -> list[str]:
        return self.header() + [f"{self.name} {_number(self.value())}"]


class Histogram(_Metric):
    type = "histogram"

    def __init__(self, name: str, help: str, buckets: Iterable[float] = LATENCY_BUCKETS):
        super().__init__(name, help)
        self.bounds = tuple(sorted(buckets))
        self._counts = [0] * (len(self.bounds) + 1)  # last: above every bound
        self._sum, self._count = 0.0, 0

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        with self._lock:
            self._counts[i] += 1
            self._sum += value
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def lines(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._count
        out, running = self.header(), 0
        for bound, c in zip(self.bounds + (math.inf,), counts):
            running += c
            out.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {running}')
        return out + [f"{self.name}_sum {_number(total)}", f"{self.name}_count {n}"]


class Registry:
    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def add(self, metric: _Metric):
        if any(m.name == metric.name for m in self.metrics):
            raise ValueError(f"metric {metric.name} registered twice")
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(line for m in self.metrics for line in m.lines()) + "\n"


class ServerMetrics:
    """The server's metrics. Gauges read the scheduler at scrape time (`bind`)."""

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.requests = r.add(Counter("dsv41_http_requests_total", "HTTP requests by route and status code.",
                                      ("route", "status")))
        self.finished = r.add(Counter("dsv41_requests_finished_total",
                                      "Generation requests that left the scheduler, by reason "
                                      "(stop, length, cancelled, timeout, error).", ("reason",)))
        self.prompt_tokens = r.add(Counter("dsv41_prompt_tokens_total",
                                           "Prompt tokens prefilled (cached ones included)."))
        self.completion_tokens = r.add(Counter("dsv41_completion_tokens_total",
                                               "Tokens sampled (final stop tokens included)."))
        self.ttft = r.add(Histogram("dsv41_time_to_first_token_seconds",
                                    "Time from submission to the first sampled token."))
        self.itl = r.add(Histogram("dsv41_inter_token_latency_seconds", "Time between a request's consecutive tokens."))
        self.prefix_lookups = r.add(Counter("dsv41_prefix_cache_lookups_total",
                                            "Prefills that consulted the prefix cache."))
        self.prefix_hits = r.add(Counter("dsv41_prefix_cache_hits_total",
                                         "Prefills that resumed from the prefix cache."))
        self.cached_tokens = r.add(Counter("dsv41_prefix_cached_tokens_total",
                                           "Prompt tokens served from the prefix cache."))
        self.replayed_tokens = r.add(Counter("dsv41_prefix_replayed_tokens_total",
                                             "Cached tokens run through the encoder again to rebuild its windows."))
        self.running = r.add(Gauge("dsv41_requests_running", "Sequences in the engine's running batch."))
        self.waiting = r.add(Gauge("dsv41_requests_waiting", "Requests queued, not yet admitted."))
        self.kv_used = r.add(Gauge("dsv41_kv_cache_used_bytes",
                                   "KV bytes held by running sequences (global KV rows + window rings)."))
        self.kv_capacity = r.add(Gauge("dsv41_kv_cache_capacity_bytes",
                                       "Bytes of the engine's fixed KV pools (allocated once at start-up)."))
        self.preemptions = r.add(Gauge("dsv41_preemptions", "Sequences swapped to the host when pages ran out."))

    def bind(self, scheduler) -> None:
        self.running.fn = lambda: len(scheduler.engine.running)
        self.waiting.fn = lambda: scheduler.counts()["waiting"]
        self.kv_used.fn = lambda: scheduler.kv_used_bytes
        self.kv_capacity.fn = lambda: scheduler.kv_capacity_bytes
        stats = getattr(scheduler.engine, "stats", None)
        self.preemptions.fn = lambda: stats.preemptions if stats is not None else 0

    def render(self) -> str:
        return self.registry.render()


def parse(text: str) -> dict[str, float]:
    """Samples of an exposition as {"name{labels}": value} (for tests and the load benchmark)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
