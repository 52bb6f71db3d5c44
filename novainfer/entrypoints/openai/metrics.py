"""Prometheus metrics with vLLM's names under a ``novainfer:`` prefix, and the per-request log line.

Gauges and counters owned by the engine (running/waiting requests, KV usage, token and prefix
cache totals, finished requests by reason) are read from each engine's stats snapshot when
``/metrics`` is scraped, by :class:`EngineStatsCollector`. Per-request latencies are histograms
fed by :class:`RequestTracker`, from the engine's own timestamps. Every app gets its own
``CollectorRegistry``, so several apps (tests) in one process never clash.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from novainfer.engine.llm_engine import EngineStats
from novainfer.outputs import RequestOutput

PREFIX = "novainfer:"
request_logger = logging.getLogger("novainfer.entrypoints.openai.requests")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)


class EngineStatsCollector(Collector):
    """Reads ``{model_name: EngineStats}`` at scrape time."""

    def __init__(self, get_stats: Callable[[], dict[str, EngineStats]],
                 get_alive: Callable[[], dict[str, bool]]) -> None:
        self._get_stats = get_stats
        self._get_alive = get_alive

    def collect(self) -> Iterable[Metric]:
        stats = self._get_stats()
        labels = ["model_name"]
        alive = GaugeMetricFamily(PREFIX + "engine_alive", "1 while the model's engine runs, 0 once it died.",
                                  labels=labels)
        for model, running in self._get_alive().items():
            alive.add_metric([model], 1.0 if running else 0.0)
        yield alive

        def gauge(name: str, doc: str, attr: str) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for model, s in stats.items():
                family.add_metric([model], float(getattr(s, attr)))
            return family

        def counter(name: str, doc: str, attr: str) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for model, s in stats.items():
                family.add_metric([model], float(getattr(s, attr)))
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", "num_running_reqs")
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting_reqs")
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).", "kv_cache_usage")
        yield counter("prompt_tokens", "Prompt tokens processed (prefill).", "prompt_tokens_total")
        yield counter("generation_tokens", "Tokens generated.", "generation_tokens_total")
        yield counter("num_preemptions", "Requests preempted.", "num_preemptions_total")
        yield counter("prefix_cache_queries", "Tokens looked up in the prefix cache.", "prefix_cache_queries_total")
        yield counter("prefix_cache_hits", "Tokens found in the prefix cache.", "prefix_cache_hits_total")
        yield counter("spec_decode_num_drafts", "Requests' steps with draft tokens (speculative decoding).",
                      "spec_decode_num_drafts_total")
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding).",
                      "spec_decode_num_draft_tokens_total")
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted (speculative decoding).",
                      "spec_decode_num_accepted_tokens_total")
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the step's drafts (from 0).",
                                      labels=["model_name", "position"])
        for model, s in stats.items():
            for position, count in enumerate(s.spec_decode_num_accepted_tokens_per_pos_total):
                per_pos.add_metric([model, str(position)], float(count))
        yield per_pos
        finished = CounterMetricFamily(PREFIX + "request_success", "Finished requests, by finish reason.",
                                       labels=["model_name", "finished_reason"])
        for model, s in stats.items():
            for reason in sorted(set(s.finished_requests_total) | {"stop", "length", "abort"}):
                finished.add_metric([model, reason], float(s.finished_requests_total.get(reason, 0)))
        yield finished


class LatencyHistogram(Collector):
    """A histogram of latencies in seconds per model, that observes many equal values in one call: a
    stream's output carries the tokens of every step since the previous one, and their gaps are
    observed together (prometheus_client's ``Histogram`` takes one value per call, under a lock,
    which cost a served burst about a tenth of its event loop). Used on the event loop only, like
    the ``/metrics`` handler that collects it."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets of {name} must ascend strictly, got {buckets}")
        self.name = PREFIX + name
        self.doc = doc
        self.bounds = buckets  # the upper bounds ("le"); +Inf follows
        self._counts: dict[str, list[int]] = {}  # per model: observations per bucket (not cumulative)
        self._sums: dict[str, float] = {}

    def observe(self, model: str, value: float, count: int = 1) -> None:
        """``count`` observations of ``value``."""
        counts = self._counts.get(model)
        if counts is None:
            counts = self._counts[model] = [0] * (len(self.bounds) + 1)
            self._sums[model] = 0.0
        counts[bisect.bisect_left(self.bounds, value)] += count  # value <= bound: that bucket
        self._sums[model] += value * count

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for model, counts in self._counts.items():
            family.add_metric([model], list(zip(les, itertools.accumulate(counts))), self._sums[model])
        yield family


class ServerMetrics:
    """All metrics of one app, in its own registry."""

    def __init__(self, get_stats: Callable[[], dict[str, EngineStats]],
                 get_alive: Callable[[], dict[str, bool]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineStatsCollector(get_stats, get_alive))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> LatencyHistogram:
            collector = LatencyHistogram(name, doc, buckets)
            self.registry.register(collector)
            return collector

        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Time from arrival to the first generated token.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Time between consecutive generated tokens.", _ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Time from arrival to the end of the request.", _REQUEST_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Time from arrival to first being scheduled.", _REQUEST_BUCKETS)
        self.requests_rejected = Counter(
            PREFIX + "requests_rejected", "Requests refused by admission control (429), by reason.",
            ["model_name", "reason"], registry=self.registry)


class RequestTracker:
    """Follows one API request's engine outputs; observes latencies and logs one line at the end."""

    def __init__(self, metrics: ServerMetrics, request_id: str, model: str, endpoint: str,
                 arrival_time: float, log_requests: bool = True, response_id: str | None = None,
                 principal: str | None = None) -> None:
        self.metrics = metrics
        self.principal = principal
        self.request_id = request_id
        self.response_id = response_id
        self.model = model
        self.endpoint = endpoint
        self.arrival_time = arrival_time
        self.log_requests = log_requests
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.first_token_time: float | None = None
        self.first_scheduled_time: float | None = None
        self._last_token_time: dict[str, float] = {}  # per engine request: of its latest output
        self._done = False

    def on_output(self, output: RequestOutput) -> None:
        """Records one engine output (of any of the request's prompts; a delta, the final one, or
        cumulative: its ``delta_token_ids`` are the tokens new since the previous)."""
        metrics = output.metrics
        new = sum(len(c.delta_token_ids) for c in output.outputs)
        self.completion_tokens += new
        if metrics is None:
            return
        if metrics.first_scheduled_time is not None and self.first_scheduled_time is None:
            self.first_scheduled_time = metrics.first_scheduled_time
        if metrics.first_token_time is not None and (
                self.first_token_time is None or metrics.first_token_time < self.first_token_time):
            self.first_token_time = metrics.first_token_time
        now = metrics.last_token_time
        if new == 0 or now is None:
            return
        previous = self._last_token_time.get(output.request_id)
        if previous is None and metrics.first_token_time is not None:
            previous, new = metrics.first_token_time, new - 1  # no gap before the first token
        if previous is not None and new > 0:
            self.metrics.inter_token_latency.observe(self.model, max(now - previous, 0.0) / new, new)
        self._last_token_time[output.request_id] = now

    def set_usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = prompt_tokens, completion_tokens, \
            cached_tokens

    def finish(self, status: str, http_status: int | None = None, error: str | None = None) -> None:
        """Observes the request's latencies (once) and writes its log line."""
        if self._done:
            return
        self._done = True
        now = time.time()
        ttft = self.first_token_time - self.arrival_time if self.first_token_time is not None else None
        queue = self.first_scheduled_time - self.arrival_time if self.first_scheduled_time is not None else None
        latency = now - self.arrival_time
        model = self.model
        if ttft is not None:
            self.metrics.time_to_first_token.observe(model, max(ttft, 0.0))
        if queue is not None:
            self.metrics.request_queue_time.observe(model, max(queue, 0.0))
        if self.first_scheduled_time is not None:
            self.metrics.e2e_request_latency.observe(model, max(latency, 0.0))
        if self.log_requests:
            record = {"event": "request_finished", "request_id": self.request_id, "response_id": self.response_id,
                      "client": self.principal, "model": model,
                      "endpoint": self.endpoint, "status": status, "http_status": http_status,
                      "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                      "cached_tokens": self.cached_tokens,
                      "ttft_s": round(ttft, 4) if ttft is not None else None,
                      "queue_s": round(queue, 4) if queue is not None else None,
                      "latency_s": round(latency, 4)}
            if error:
                record["error"] = error
            request_logger.info(json.dumps(record))
