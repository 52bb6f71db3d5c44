"""Server-side metrics shared by several API server processes: each writes its own rows in a shared
directory and a scrape of any one of them reports the sums over all. Prometheus' own text parser
reads the exposition; the expected values are counted by hand from the observations."""

import builtins
import math
import multiprocessing
import os
import random
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from novainfer.entrypoints.openai.metrics import ServerMetrics

CHILD_TIMEOUT_S = 300.0  # the spawned process's imports alone take seconds; never hit when it works
Observation = tuple[str, float, int]  # model, value, count


def _observations(seed: int, models: list[str], bounds: tuple[float, ...], n: int = 40) -> list[Observation]:
    """Values around and exactly on the bucket bounds, some past the last."""
    rng = random.Random(seed)
    candidates = [*bounds, bounds[-1] * 3, *(rng.uniform(0, bounds[-1] * 1.2) for _ in range(n))]
    return [(rng.choice(models), rng.choice(candidates), rng.randint(1, 5)) for _ in range(n)]


def _expected_histogram(observations: list[Observation], bounds: tuple[float, ...]) -> dict:
    expected = {}
    for model in {model for model, _, _ in observations}:
        flat = [value for m, value, count in observations if m == model for _ in range(count)]
        for bound in (*bounds, math.inf):
            expected[("bucket", model, bound)] = sum(value <= bound for value in flat)
        expected[("count", model, None)] = len(flat)
        expected[("sum", model, None)] = sum(flat)
    return expected


def _families(metrics: ServerMetrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def _histogram(metrics: ServerMetrics, name: str) -> dict:
    """The histogram's samples as ``(kind, model, le)``: value."""
    samples = {}
    for sample in _families(metrics)[name].samples:
        kind = sample.name.removeprefix(name + "_")
        if kind in ("bucket", "count", "sum"):
            le = sample.labels.get("le")
            samples[(kind, sample.labels["model_name"], None if le is None else float(le))] = sample.value
    return samples


def _rejected(metrics: ServerMetrics) -> dict[tuple[str, str], float]:
    return {(s.labels["model_name"], s.labels["reason"]): s.value
            for s in _families(metrics)["novainfer:requests_rejected"].samples
            if s.name == "novainfer:requests_rejected_total"}


@pytest.fixture
def make_metrics() -> Iterator[Callable[..., ServerMetrics]]:
    """Builds ServerMetrics (no engines) and closes them after the test."""
    made: list[ServerMetrics] = []

    def make(shared_dir: Path | None, process_index: int = 0) -> ServerMetrics:
        metrics = ServerMetrics(dict, dict, None if shared_dir is None else str(shared_dir), process_index)
        made.append(metrics)
        return metrics

    yield make
    for metrics in made:
        metrics.close()


def test_two_servers_in_one_process_report_the_sums(tmp_path, make_metrics):
    servers = [make_metrics(tmp_path, 0), make_metrics(tmp_path, 1)]
    histograms = ["time_to_first_token", "inter_token_latency", "e2e_request_latency", "request_queue_time"]
    observed: dict[str, list[Observation]] = {name: [] for name in histograms}
    rejected: dict[tuple[str, str], int] = {}
    for index, server in enumerate(servers):
        for offset, name in enumerate(histograms):
            histogram = getattr(server, name)
            observations = _observations(10 * index + offset, ["a", "b"], histogram.bounds)
            for model, value, count in observations:
                histogram.observe(model, value, count)
            observed[name] += observations
        for model, reason in [("a", "queue_full"), ("a", "queue_full"), ("b", f"reason_{index}")]:
            server.requests_rejected.inc(model, reason)
            rejected[(model, reason)] = rejected.get((model, reason), 0) + 1

    for server in servers:
        for name in histograms:
            histogram = getattr(server, name)
            expected = _expected_histogram(observed[name], histogram.bounds)
            assert _histogram(server, histogram.name) == pytest.approx(expected), name
        assert _rejected(server) == rejected


def _child_observations() -> list[Observation]:
    return [("a", 0.003, 2), ("a", 0.2, 1), ("child-only", 50.0, 4)]


def _observe_in_child(shared_dir: str) -> None:
    """A second API server process: observes, is rejected once, and exits."""
    metrics = ServerMetrics(dict, dict, shared_dir=shared_dir, process_index=1)
    for model, value, count in _child_observations():
        metrics.inter_token_latency.observe(model, value, count)
    metrics.requests_rejected.inc("a", "queue_full")


def test_a_scrape_includes_another_process(tmp_path, make_metrics):
    server = make_metrics(tmp_path, 0)
    own = [("a", 0.01, 3), ("a", 7.0, 1)]
    for model, value, count in own:
        server.inter_token_latency.observe(model, value, count)
    server.requests_rejected.inc("a", "queue_full")
    assert _rejected(server) == {("a", "queue_full"): 1}  # scraped before the other process exists

    context = multiprocessing.get_context("spawn")
    child = context.Process(target=_observe_in_child, args=(str(tmp_path),))
    child.start()
    child.join(CHILD_TIMEOUT_S)
    assert child.exitcode == 0, f"the child process ended with {child.exitcode}"

    bounds = server.inter_token_latency.bounds
    expected = _expected_histogram(own + _child_observations(), bounds)
    assert _histogram(server, server.inter_token_latency.name) == pytest.approx(expected)
    assert _rejected(server) == {("a", "queue_full"): 2}


def test_label_values_that_appear_after_a_scrape(tmp_path, make_metrics):
    first, second = make_metrics(tmp_path, 0), make_metrics(tmp_path, 1)
    first.time_to_first_token.observe("m0", 0.5)
    name = first.time_to_first_token.name
    assert {model for _, model, _ in _histogram(second, name)} == {"m0"}
    assert _rejected(first) == {}

    # Enough new rows that the second's files grow several times while the first keeps reading them.
    models = [f"model-{i}" for i in range(300)]
    observed = [("m0", 0.5, 1)]
    for i, model in enumerate(models):
        second.time_to_first_token.observe(model, 0.01 * i, 2)
        observed.append((model, 0.01 * i, 2))
        second.requests_rejected.inc(model, "queue_full" if i % 2 else "client_limit")
    first.requests_rejected.inc("m0", "tokens_limit")

    expected = _expected_histogram(observed, first.time_to_first_token.bounds)
    assert _histogram(first, name) == pytest.approx(expected)
    assert _rejected(first) == {("m0", "tokens_limit"): 1,
                                **{(m, "queue_full" if i % 2 else "client_limit"): 1 for i, m in enumerate(models)}}


def test_a_row_being_appended_is_not_read(tmp_path, make_metrics):
    """A scrape while another process is between writing a new row and publishing it: the bytes past
    the published end (here garbage, as a torn write would leave) are not read."""
    first, second = make_metrics(tmp_path, 0), make_metrics(tmp_path, 1)
    first.requests_rejected.inc("a", "queue_full")
    second.requests_rejected.inc("a", "queue_full")
    [path] = tmp_path.glob("requests_rejected.1.*")
    with open(path, "r+b") as file:
        used = struct.unpack("=Q", file.read(8))[0]
        file.seek(used)
        file.write(struct.pack("=Q", 10**6) + b"\xff" * 64)  # a key length past the end, then garbage
    assert _rejected(first) == {("a", "queue_full"): 2}


def test_a_restarted_process_carries_on_its_counts(tmp_path, make_metrics):
    reader = make_metrics(tmp_path, 0)
    crashed = make_metrics(tmp_path, 1)
    crashed.requests_rejected.inc("a", "queue_full")
    crashed.close()  # as its death would; its file stays
    restarted = make_metrics(tmp_path, 1)
    restarted.requests_rejected.inc("a", "queue_full")
    restarted.requests_rejected.inc("b", "queue_full")
    assert _rejected(reader) == {("a", "queue_full"): 2, ("b", "queue_full"): 1}


def test_one_process_index_has_one_writer(tmp_path, make_metrics):
    make_metrics(tmp_path, 1)
    with pytest.raises(RuntimeError, match="process_index"):
        make_metrics(tmp_path, 1)


def test_without_shared_dir_nothing_is_written(tmp_path, monkeypatch, make_metrics):
    monkeypatch.chdir(tmp_path)

    def no_files(*args, **kwargs):
        raise AssertionError(f"opened {args}")

    models = [f"model-{i}" for i in range(100)]  # enough rows to grow its memory
    observed = [(model, 0.1 * i, 1 + i % 3) for i, model in enumerate(models)]
    with monkeypatch.context() as patch:
        patch.setattr(builtins, "open", no_files)
        patch.setattr(os, "open", no_files)
        metrics = make_metrics(None)
        for model, value, count in observed:
            metrics.e2e_request_latency.observe(model, value, count)
        metrics.requests_rejected.inc("a", "queue_full")
        text = generate_latest(metrics.registry)
    assert list(tmp_path.iterdir()) == []
    assert b'novainfer:requests_rejected_total{model_name="a",reason="queue_full"} 1.0' in text
    expected = _expected_histogram(observed, metrics.e2e_request_latency.bounds)
    assert _histogram(metrics, metrics.e2e_request_latency.name) == pytest.approx(expected)
