"""benchmarks/serve.py end to end on the tiny model on CPU: a started server measured at two request
rates, then the same prompts through LLM.generate. Token counts are checked against the model's own
tokenizer (transformers) and the requests' max_tokens; plot_serve.py draws the results file."""

from __future__ import annotations

import json
import math
import os
import re
import sys

import pytest

from benchmarks import plot_serve, serve

OUTPUT_LEN = 4
MAX_WORDS = 12
TEXTS = ["What is the capital of France and why did it become the capital instead of another large city?",
         "Write a short poem about the sea.",
         "Explain how a hash map works, with its average and worst case costs for lookups and inserts.",
         "def add(a, b): return a + b  # what does this function do?",
         "Summarize the plot of a famous novel in two sentences.",
         "List three prime numbers greater than one hundred and show how you checked them."]
# CPU clocks count in ticks: each process's time may read a tick more than was spent.
CPU_TICK_SLACK_S = 2 / os.sysconf("SC_CLK_TCK")


def assert_rate(per_s: float, count: float, duration_s: float, count_rounding: float = 0.0) -> None:
    """``per_s`` is ``count / duration`` for a duration that rounds to ``duration_s`` (milliseconds)
    and a count within ``count_rounding`` of ``count`` (a count the report rounded too)."""
    low, high = count - count_rounding, count + count_rounding
    assert low / (duration_s + 0.0005) - 0.01 <= per_s <= high / max(duration_s - 0.0005, 1e-9) + 0.01


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[dict, object]:
    """One run of serve.py: rates inf then 50, twice, with the offline companion; (report, results directory)."""
    out = tmp_path_factory.mktemp("serve")
    dataset = out / "conversations.json"
    dataset.write_text(json.dumps([{"conversations": [{"from": "human", "value": t}]} for t in TEXTS]))
    report = serve.main(["--device", "cpu", "--dataset", str(dataset), "--num-prompts", str(len(TEXTS)),
                         "--max-input-tokens", str(MAX_WORDS), "--output-len", str(OUTPUT_LEN),
                         "--request-rates", "inf,50", "--rounds", "2", "--offline-companion", "--offline-repeats", "2",
                         "--client-processes", "2", "--save-detailed", "--server-log", str(out / "server.log"),
                         "--results-dir", str(out), "--output", "run"])
    return report, out


def test_request_rates_are_parsed_and_bad_ones_named(capsys):
    assert serve.parse_args(["--request-rates", "8,32,inf"]).request_rates == [8.0, 32.0, math.inf]
    assert serve.parse_args(["--request-rate", "4"]).request_rates == [4.0]  # the single-rate spelling
    assert serve.parse_args([]).request_rates == [math.inf]
    for bad, message in (("0", "must be > 0"), ("nan", "must be > 0"), ("fast", "not a number"),
                         ("8,8", "listed twice")):
        with pytest.raises(SystemExit):
            serve.parse_args(["--request-rates", bad])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve.parse_args(["--base-url", "http://127.0.0.1:9", "--offline-companion"])
    assert "--offline-companion needs the server this benchmark starts" in capsys.readouterr().err


def test_server_flags_become_the_servers_engine_arguments(capsys):
    """Engine flags are taken, serving-only flags accepted and dropped, unknown flags refused."""
    engine_args = serve.served_engine_args("tiny", ["--device", "cpu", "--max-num-seqs", "8", "--max-waiting-requests",
                                                    "5", "--no-enable-prefix-caching", "--block-size", "32"])
    assert (engine_args.model, engine_args.device, engine_args.max_num_seqs, engine_args.enable_prefix_caching,
            engine_args.block_size) == ("tiny", "cpu", 8, False, 32)
    with pytest.raises(SystemExit):
        serve.served_engine_args("tiny", ["--max-num-sequences", "8"])
    assert "--max-num-sequences" in capsys.readouterr().err


def test_every_rate_serves_every_request_in_full(sweep, model_dir):
    from transformers import AutoTokenizer

    report, out = sweep
    assert json.loads((out / "run.json").read_text()) == report
    assert report["workload"]["request_rates"] == ["inf", 50.0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cut = [" ".join(t.split()[:MAX_WORDS]) for t in TEXTS]
    runs = report["results"]
    assert [(run["round"], run["request_rate"]) for run in runs] == [(1, "inf"), (1, 50.0), (2, "inf"), (2, 50.0)]
    for index, run in enumerate(runs):
        # The completions endpoint encodes text without special tokens, as the engine does.
        expected_input = sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in serve.tag_prompts(cut, index))
        assert (run["completed"], run["failed"], run["errors"]) == (len(TEXTS), 0, [])
        # max_tokens caps every request at OUTPUT_LEN: the total is reached only if each produced all of them.
        assert run["total_output_tokens"] == len(TEXTS) * OUTPUT_LEN
        assert run["total_input_tokens"] == expected_input
        assert_rate(run["output_throughput_tok_per_s"], run["total_output_tokens"], run["duration_s"])
        assert 0 < run["ttft_ms"]["median"] <= run["e2e_latency_ms"]["median"]
        assert 0 < run["time_to_headers_ms"]["median"] <= run["ttft_ms"]["median"]
        assert run["ttft_ms"]["median"] <= run["ttft_ms"]["p99"]
        # No gaps at all when every stream's tokens came in one chunk (a busy machine reads them late).
        itl = run["itl_ms"]
        assert (itl["median"], itl["p99"]) == (None, None) or itl["median"] <= itl["p99"]
        # The timeline: every request sent before the last token came, the last token within the duration.
        assert 0 <= run["last_request_sent_s"] < run["last_token_s"] <= run["duration_s"] + 0.001
        assert 0 < run["first_token_s"] <= run["last_token_s"]
        # --save-detailed: each request's moments, in order, matching the run's timeline.
        requests = run["requests"]
        assert len(requests) == len(TEXTS) and all(r["error"] is None for r in requests)
        assert [r["output_tokens"] for r in requests] == [OUTPUT_LEN] * len(TEXTS)
        for r in requests:
            assert 0 <= r["sent_s"] <= r["headers_s"] <= r["first_token_s"] <= r["end_s"] <= run["duration_s"] + 0.001
        assert max(r["sent_s"] for r in requests) == pytest.approx(run["last_request_sent_s"], abs=0.002)
        assert min(r["first_token_s"] for r in requests) == pytest.approx(run["first_token_s"], abs=0.002)
        assert max(r["end_s"] for r in requests) == pytest.approx(run["last_token_s"], abs=0.002)


def test_client_cpu_time_is_within_what_the_machine_allows(sweep):
    report, _ = sweep
    cpus = report["machine"]["usable_cpus"]
    for run in report["results"]:
        cpu, wall = run["client_cpu"], run["duration_s"]
        assert cpu["processes"] == 2
        assert 0 <= cpu["total_s"] <= wall * cpus + 2 * CPU_TICK_SLACK_S
        assert_rate(cpu["fraction_of_wall"], cpu["total_s"], wall, count_rounding=0.0005)  # both in ms
        # The busiest of the two carries at least half and at most all of the total.
        busiest = cpu["busiest_process_fraction_of_wall"]
        assert cpu["fraction_of_wall"] / 2 - 0.001 <= busiest <= cpu["fraction_of_wall"] + 0.001


def test_server_cpu_time_is_within_what_the_machine_allows(sweep):
    """The started server's processes: the API server itself and at least its engine core below it."""
    report, _ = sweep
    cpus = report["machine"]["usable_cpus"]
    for run in report["results"]:
        cpu, wall = run["server_cpu"], run["duration_s"]
        assert len(cpu["children_s"]) >= 1 and cpu["children_s"] == sorted(cpu["children_s"], reverse=True)
        processes = [cpu["started_process_s"], *cpu["children_s"]]
        assert all(s >= 0 for s in processes)
        assert cpu["total_s"] == pytest.approx(sum(processes), abs=0.002)
        assert cpu["total_s"] <= wall * cpus + len(processes) * CPU_TICK_SLACK_S
        assert_rate(cpu["fraction_of_wall"], cpu["total_s"], wall, count_rounding=0.0005)
    assert sum(run["server_cpu"]["total_s"] for run in report["results"]) > 0  # the server worked


def test_server_log_holds_the_engine_cores_steps(sweep):
    """Every served token after a request's first comes from a decode step the core logged."""
    _, out = sweep
    steps = re.findall(r"novainfer\.engine\.core: step \d+: .*decode_tokens=(\d+)", (out / "server.log").read_text())
    served_requests = 4 * len(TEXTS)  # two rates, twice
    assert sum(int(n) for n in steps) >= served_requests * (OUTPUT_LEN - 1)


def test_offline_companion_generates_what_was_served(sweep):
    report, _ = sweep
    offline = report["offline_companion"]
    burst = report["results"][0]
    assert offline["prompts_of_rate"] == "inf"
    assert offline["engine_args"]["device"] == "cpu"
    assert offline["num_prompts"] == len(TEXTS)
    assert offline["total_output_tokens"] == burst["total_output_tokens"] == len(TEXTS) * OUTPUT_LEN
    assert len(offline["durations_s_of_each_run"]) == len(offline["host_probe_ms_of_each_run"]) == 2
    for run in [*offline["host_probe_ms_of_each_run"], *(r["host_probe_ms"] for r in report["results"])]:
        assert len(run) == 2 and min(run) > 0
    assert offline["total_input_tokens"] == burst["total_input_tokens"]
    assert_rate(offline["output_throughput_tok_per_s"], offline["total_output_tokens"], offline["duration_s"])
    for run in report["results"]:
        assert run["output_throughput_vs_offline"] == pytest.approx(
            run["output_throughput_tok_per_s"] / offline["output_throughput_tok_per_s"], abs=6e-5)  # 4 decimals


def test_rates_on_the_plot_axis():
    assert plot_serve.rate_positions([2, 50.0, "inf"]) == ([2.0, 50.0, 200.0], ["2", "50", "inf"])
    assert plot_serve.rate_positions(["inf"]) == ([1.0], ["inf"])


def test_plot_without_matplotlib_names_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"workload": {}, "results": []}))
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        plot_serve.main([str(path)])


def test_plot_of_the_sweep(sweep):
    pytest.importorskip("matplotlib", reason="matplotlib is not a NovaInfer dependency")
    from matplotlib.image import imread

    _, out = sweep
    png = plot_serve.main([str(out / "run.json")])
    assert png == out / "run.png"
    height, width, _ = imread(png).shape
    assert (width, height) == (1800, 540)


def test_sse_data_ends_lines_only_at_newlines():
    """Generated text may hold Unicode line boundaries (U+2028, U+0085, U+001C) inside a JSON string: the
    client's event parser keeps them, whichever way the response's bytes are split into reads."""
    import asyncio

    texts = ["a\u2028b", "c\x85d", "e\x1cf", "plain"]
    events = "".join(f"data: {json.dumps({'text': t}, ensure_ascii=False)}\n\n" for t in texts) + "data: [DONE]\n\n"

    class Response:
        def __init__(self, size: int) -> None:
            self.pieces = [events[i:i + size] for i in range(0, len(events), size)]

        async def aiter_text(self):
            for piece in self.pieces:
                yield piece

    async def collect(size: int) -> list[str]:
        return [data async for data in serve.sse_data(Response(size))]

    for size in (1, 7, len(events)):
        datas = asyncio.run(collect(size))
        assert datas[-1] == "[DONE]" and [json.loads(d)["text"] for d in datas[:-1]] == texts


def test_long_itl_gaps_are_placed_in_time():
    # Three streams sent at the rate's start (t=100): two share one stall at 1.0 s, one has a lone gap.
    def result(ttft: float, gaps_and_ends: list[tuple[float, float]]) -> serve.RequestResult:
        return serve.RequestResult(ok=True, ttft=ttft, sent_at=100.0, itl=[g for g, _ in gaps_and_ends],
                                   itl_ends=[e for _, e in gaps_and_ends])

    short = [(0.01, 0.1 + 0.01 * i) for i in range(1, 100)]  # 99 short gaps per stream
    results = [result(0.1, short + [(0.5, 1.004)]), result(0.1, short + [(0.5, 1.006)]),
               result(0.3, short + [(0.4, 0.25)])]
    gaps = serve.long_itl_gaps(results, start_at=100.0)
    # 300 gaps, 297 of 10 ms: the p99 (rank 296.01 of 0..299) is 1% of the way from 10 to 400 ms.
    assert gaps["threshold_ms"] == 13.9 and gaps["count"] == 3
    assert gaps["last_first_token_s"] == 0.3 and gaps["ending_before_last_first_token"] == 1
    assert gaps["in_windows_of_10_or_more"] == 0
    assert gaps["top_windows"][0] == {"ends_s": 1.0, "gaps": 2}
    assert serve.long_itl_gaps([], start_at=0.0)["count"] == 0
