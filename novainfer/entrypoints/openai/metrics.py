"""Prometheus metrics with vLLM's names under a ``novainfer:`` prefix, and the per-request log line.

Gauges and counters owned by the engine core (running/waiting requests, KV usage, token and prefix
cache totals) are read from each engine's stats snapshot when ``/metrics`` is scraped, by
:class:`EngineStatsCollector`. Finished requests by reason are counted by the front-end as they
finish (:meth:`ServerMetrics.count_finishes`). Per-request latencies are histograms fed by
:class:`RequestTracker`, from the engine's own timestamps. Every app gets its own
``CollectorRegistry``, so several apps (tests) in one process never clash. The server-side metrics
(latencies, rejections) keep their values in memory maps; with several API server processes, in one
file per process in a directory they share, and every scrape sums them all.
"""

from __future__ import annotations

import bisect
import functools
import fcntl
import glob
import itertools
import json
import logging
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO

from prometheus_client import CollectorRegistry
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


_U64 = struct.Struct("=Q")
_HEADER_SIZE = 2 * _U64.size  # bytes used (published last), then values per row


def _padded(length: int) -> int:
    """``length`` rounded up to whole 8-byte words, which keeps every row's values aligned."""
    return (length + 7) & ~7


def _open_alone(path: str) -> BinaryIO:
    """``path``, created if new and locked for as long as it stays open: two writers of one file would
    overwrite each other's rows."""
    file = open(path, "a+b")
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.close()
        raise RuntimeError(f"{path} is already written by another ServerMetrics: is its process_index "
                           f"given to two API server processes?") from None
    return file


def _published_rows(data: bytes | mmap.mmap, width: int, where: str) -> Iterator[tuple[tuple[str, ...], int]]:
    """Each row's label values and the byte offset of its values, of the rows published in ``data`` (the
    layout of :class:`_Rows`). A row still being appended lies past the bytes used, so it is not read."""
    if len(data) < _HEADER_SIZE:
        return  # a file that its writer has just created
    used, stored_width = _U64.unpack_from(data, 0)[0], _U64.unpack_from(data, _U64.size)[0]
    if used == 0:
        return  # or whose writer has not written the header yet
    if stored_width != width or used > len(data):
        raise ValueError(f"{where}: not rows of {width} values (header: {used} bytes used of {len(data)}, "
                         f"rows of {stored_width} values)")
    pos = _HEADER_SIZE
    while pos < used:
        key_length = _U64.unpack_from(data, pos)[0]
        start = pos + _U64.size + _padded(key_length)
        end = start + 8 * width
        if end > used:
            raise ValueError(f"{where}: the row at byte {pos} ends at byte {end}, past the {used} bytes used")
        yield tuple(json.loads(data[pos + _U64.size:pos + _U64.size + key_length])), start
        pos = end


class _Rows:
    """Rows of ``width`` float64 values, one per tuple of label values, written by this process alone:
    in a file at ``path`` that other processes read while this one writes, or without a path in
    anonymous memory.

    Layout, in native byte order: two uint64, the bytes used and ``width``; then the rows, each a uint64
    key length, the key (the label values as a JSON list) zero-padded to 8 bytes, and ``width`` float64.
    A new row is written whole before the bytes used grow over it, so readers see it whole or not at all;
    values are updated in place by aligned 8-byte stores, through ``values``, a float64 view of it all.
    The file doubles when full; a file left by an earlier process of the same index is carried on.
    """

    def __init__(self, width: int, path: str | None = None) -> None:
        self.width = width
        self._file = None if path is None else _open_alone(path)
        size = mmap.PAGESIZE if self._file is None else max(mmap.PAGESIZE, os.fstat(self._file.fileno()).st_size)
        self._map = self._mapped(size)
        self.values = memoryview(self._map).cast("d")
        self._starts = {labels: start // 8 for labels, start in  # label values -> index in values
                        _published_rows(self._map, width, path or "anonymous rows")}
        self._used = _U64.unpack_from(self._map, 0)[0]
        if self._used == 0:
            self._map[_U64.size:_HEADER_SIZE] = _U64.pack(width)
            self._publish(_HEADER_SIZE)

    @property
    def buffer(self) -> mmap.mmap:
        """All the rows, in their layout."""
        return self._map

    def row(self, labels: tuple[str, ...]) -> int:
        """The index in ``values`` of the first value of ``labels``' row, appended as zeros if new."""
        start = self._starts.get(labels)
        if start is None:
            start = self._starts[labels] = self._append(labels)
        return start

    def close(self) -> None:
        """Unmaps the rows and closes (unlocks) the file, which stays for other processes to read."""
        self.values.release()
        self._map.close()
        if self._file is not None:
            self._file.close()

    def _append(self, labels: tuple[str, ...]) -> int:
        key = json.dumps(labels).encode()
        row = _U64.pack(len(key)) + key.ljust(_padded(len(key)), b"\0") + bytes(8 * self.width)
        end = self._used + len(row)
        if end > len(self._map):
            self._grow(end)
        self._map[self._used:end] = row
        self._publish(end)
        return end // 8 - self.width

    def _publish(self, used: int) -> None:
        self._used = used
        self._map[0:_U64.size] = _U64.pack(used)

    def _grow(self, needed: int) -> None:
        size = len(self._map)
        while size < needed:
            size *= 2
        old = self._map
        self.values.release()  # an exported buffer cannot be closed
        self._map = self._mapped(size)
        if self._file is None:
            self._map[:len(old)] = old
        old.close()
        self.values = memoryview(self._map).cast("d")

    def _mapped(self, size: int) -> mmap.mmap:
        if self._file is None:
            return mmap.mmap(-1, size)
        self._file.truncate(size)  # never shrinks: size is at least the file's
        return mmap.mmap(self._file.fileno(), size)


class _RowsCollector(Collector):
    """A metric whose values are kept in :class:`_Rows`. With ``shared_dir``, every API server process
    writes its own file there (``<name>.<process_index>.rows``) and collecting sums the rows of all of
    them, so a scrape of any one process reports the whole server."""

    def __init__(self, name: str, doc: str, width: int, shared_dir: str | None, process_index: int) -> None:
        self.name = PREFIX + name
        self.doc = doc
        self._shared_dir = shared_dir
        self._file_pattern = f"{name}.*.rows"
        path = None if shared_dir is None else os.path.join(shared_dir, f"{name}.{process_index}.rows")
        self._rows = _Rows(width, path)

    def close(self) -> None:
        """Releases this process's rows (and its file); it must not observe anything after."""
        self._rows.close()

    def _totals(self) -> dict[tuple[str, ...], list[float]]:
        """Each label tuple's values, summed over the rows of every process."""
        totals: dict[tuple[str, ...], list[float]] = {}
        row_format = f"={self._rows.width}d"
        for where, data in self._sources():
            for labels, start in _published_rows(data, self._rows.width, where):
                total = totals.setdefault(labels, [0.0] * self._rows.width)
                for i, value in enumerate(struct.unpack_from(row_format, data, start)):
                    total[i] += value
        return totals

    def _sources(self) -> Iterator[tuple[str, bytes | mmap.mmap]]:
        if self._shared_dir is None:
            yield "this process's rows", self._rows.buffer
            return
        for path in sorted(glob.glob(os.path.join(glob.escape(self._shared_dir), self._file_pattern))):
            with open(path, "rb") as file:
                yield path, file.read()


class LatencyHistogram(_RowsCollector):
    """A histogram of latencies in seconds per model, that observes many equal values in one call: a
    stream's output carries the tokens of every step since the previous one, and their gaps are
    observed together (prometheus_client's ``Histogram`` takes one value per call, under a lock,
    which cost a served burst about a tenth of its event loop). Used on the event loop only, like
    the ``/metrics`` handler that collects it."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], shared_dir: str | None = None,
                 process_index: int = 0) -> None:
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets of {name} must ascend strictly, got {buckets}")
        # A row: the observations per bucket (not cumulative; +Inf last), then their sum.
        super().__init__(name, doc, len(buckets) + 2, shared_dir, process_index)
        self.bounds = buckets  # the upper bounds ("le"); +Inf follows
        self._sum_index = len(buckets) + 1
        self._starts: dict[str, int] = {}  # model -> its row's start: saves building a key per observation

    def observe(self, model: str, value: float, count: int = 1) -> None:
        """``count`` observations of ``value``."""
        start = self._starts.get(model)
        if start is None:
            start = self._starts[model] = self._rows.row((model,))
        values = self._rows.values  # only now: adding the row may have replaced it
        values[start + bisect.bisect_left(self.bounds, value)] += count  # value <= bound: that bucket
        values[start + self._sum_index] += value * count

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for (model,), row in self._totals().items():
            family.add_metric([model], list(zip(les, itertools.accumulate(row[:-1]))), row[-1])
        yield family


class LabeledCounter(_RowsCollector):
    """A counter with labels, exposed as ``<name>_total``. Used on the event loop only."""

    def __init__(self, name: str, doc: str, labelnames: list[str], shared_dir: str | None = None,
                 process_index: int = 0) -> None:
        super().__init__(name, doc, 1, shared_dir, process_index)
        self.labelnames = labelnames

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        """Adds ``amount`` to the count of ``labels`` (one value per label name)."""
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} has labels {self.labelnames}, got values {labels}")
        start = self._rows.row(labels)  # first: adding the row may replace ``values``
        self._rows.values[start] += amount

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        for labels, (value,) in self._totals().items():
            family.add_metric(list(labels), value)
        yield family


class ServerMetrics:
    """All metrics of one app, in its own registry.

    With several API server processes, each is given the same ``shared_dir`` (private to them, made
    and removed by their supervisor) and its own ``process_index``: the server-side metrics below
    are then the sums over all of them, whichever process is scraped. The engine's come from the
    engine core, the same in every process.
    """

    def __init__(self, get_stats: Callable[[], dict[str, EngineStats]],
                 get_alive: Callable[[], dict[str, bool]], shared_dir: str | None = None,
                 process_index: int = 0) -> None:
        if process_index < 0:
            raise ValueError(f"process_index must be at least 0, got {process_index}")
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineStatsCollector(get_stats, get_alive))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> LatencyHistogram:
            collector = LatencyHistogram(name, doc, buckets, shared_dir, process_index)
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
        self.requests_rejected = LabeledCounter(
            "requests_rejected", "Requests refused by admission control (429), by reason.",
            ["model_name", "reason"], shared_dir, process_index)
        self.registry.register(self.requests_rejected)
        # Counted by the front-end (stop strings end requests there), so summed over the processes.
        self.requests_finished = LabeledCounter("request_success", "Finished requests, by finish reason.",
                                                ["model_name", "finished_reason"], shared_dir, process_index)
        self.registry.register(self.requests_finished)

    def count_finishes(self, model: str) -> Callable[[str], None]:
        """What counts the finished sequences of ``model`` by reason (its usual reasons listed at 0).
        Called on the thread that serves (rows are made by one thread only)."""
        for reason in ("stop", "length", "abort"):
            self.requests_finished.inc(model, reason, amount=0.0)
        return functools.partial(self.requests_finished.inc, model)

    def close(self) -> None:
        """Releases this process's metric rows and files (the others' stay, for their scrapes)."""
        for collector in (self.time_to_first_token, self.inter_token_latency, self.e2e_request_latency,
                          self.request_queue_time, self.requests_rejected, self.requests_finished):
            collector.close()


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
