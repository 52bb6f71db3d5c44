"""The benchmark scripts, end to end on the tiny model on CPU: they count what was produced and
compare NovaInfer with transformers on the same requests (whose greedy tokens are the oracle)."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks import api_process, latency, launch_cost, mixed_step, sampling_paths, spec_decode, throughput
from benchmarks.architectures import ARCHITECTURES, get_architecture, hf_config


def test_architecture_preset_rejects_unknown_names_and_fields():
    assert get_architecture("qwen2-1.5b", {"num_hidden_layers": 2}).num_hidden_layers == 2
    with pytest.raises(ValueError, match="qwen2-0.5b"):  # lists the presets that exist
        get_architecture("qwen2-0.6b")
    with pytest.raises(ValueError, match="num_layers"):
        get_architecture("qwen2-0.5b", {"num_layers": 2})


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_presets_build_the_same_model_as_transformers(name):
    """Each preset's config gives transformers' class and ours the same parameters (two layers, on
    the meta device: no memory, no time), and the whole model the published parameter count."""
    import torch
    import transformers

    from novainfer.model_loader.loader import build_model

    def num_parameters(model) -> int:
        return sum(p.numel() for p in model.parameters())

    arch = get_architecture(name)
    two_layers = hf_config(get_architecture(name, {"num_hidden_layers": 2}))
    assert type(two_layers).__name__ == {"Qwen2ForCausalLM": "Qwen2Config", "LlamaForCausalLM": "LlamaConfig"}[
        arch.architecture]
    with torch.device("meta"):
        theirs = getattr(transformers, arch.architecture)(two_layers)
    ours = build_model(two_layers, torch.bfloat16, torch.device("meta"))
    assert type(ours).__name__ == arch.architecture
    assert num_parameters(ours) == num_parameters(theirs)
    assert dict((n, p.shape) for n, p in ours.named_parameters() if "layers.1.mlp.down" in n) == {
        "model.layers.1.mlp.down_proj.weight": (arch.hidden_size, arch.intermediate_size)}
    published = {"smollm2-135m": 134_515_008, "llama-3.1-8b": 8_030_261_248}
    if name in published:
        whole = build_model(hf_config(arch), torch.bfloat16, torch.device("meta"))
        assert num_parameters(whole) == published[name]
    if name == "llama-3.1-8b":
        rope = ours.model.rotary_emb
        assert (rope.max_position, rope.base, rope.scaling.rope_type, rope.scaling.factor) == (131072, 5e5, "llama3", 8)


def test_throughput_against_continuous_batching(tmp_path):
    results = throughput.main(["--num-seqs", "5", "--max-input", "40", "--min-output", "3", "--max-output", "12",
                               "--repeats", "1", "--peer", "continuous-batching", "--profile", "--profile-steps", "2",
                               "--results-dir", str(tmp_path), "--output", "run"])
    assert json.loads((tmp_path / "run.json").read_text())["output_tokens_per_s"] == results["output_tokens_per_s"]
    total = results["workload"]["total_output_tokens"]
    assert results["novainfer"]["output_tokens"] == total
    assert results["peer"]["output_tokens"] == total  # each request got its own max_new_tokens
    assert results["peer"]["greedy_agreement_with_novainfer"]["identical_requests"] == 5
    decode = results["novainfer"]["profile"]["decode_profile"]
    assert decode["batch_size"] == 5 and decode["top"]
    assert results["command"].startswith("python benchmarks/throughput.py --num-seqs 5")


def test_throughput_of_a_sampled_run_with_text(tmp_path):
    """Text is on by default; a run with every sampling setting produces each request's output length."""
    args = ["--num-seqs", "4", "--max-input", "30", "--min-output", "3", "--max-output", "9", "--repeats", "1",
            "--peer", "none", "--temperature", "0.6", "--top-p", "0.9", "--top-k", "20", "--repetition-penalty",
            "1.1", "--logprobs", "2", "--seed-per-request", "--results-dir", str(tmp_path), "--output", "run"]
    results = throughput.main(args)
    assert results["sampling"] == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                                   "logprobs": 2, "seed_per_request": True, "detokenize": True}
    assert results["novainfer"]["output_tokens"] == results["workload"]["total_output_tokens"]
    assert throughput.main([*args, "--no-detokenize"])["sampling"]["detokenize"] is False
    with pytest.raises(SystemExit):  # a peer decodes greedy only
        throughput.parse_args(["--temperature", "0.6"])


def test_throughput_with_the_engine_core_in_its_own_process(tmp_path):
    args = ["--num-seqs", "4", "--max-input", "30", "--min-output", "3", "--max-output", "9", "--repeats", "2",
            "--peer", "none", "--logprobs", "2", "--results-dir", str(tmp_path), "--output", "run"]
    with pytest.raises(SystemExit):  # the profile reaches into the core, which must be in this process
        throughput.parse_args([*args, "--multiprocess", "--profile"])
    results = throughput.main([*args, "--multiprocess"])
    assert results["novainfer"]["engine"]["multiprocess"] is True
    assert results["novainfer"]["engine"]["enable_prefix_caching"] is True
    for run in results["novainfer"]["runs"]:  # the core's prefix cache was emptied before every run
        assert run["engine_prompt_tokens_computed"] == results["workload"]["total_input_tokens"]
        assert run["output_tokens"] == results["workload"]["total_output_tokens"]


def test_sampling_paths_interleave_settings_against_greedy(tmp_path):
    args = ["--num-seqs", "4", "--max-input", "30", "--min-output", "3", "--max-output", "9", "--rounds", "2",
            "--settings", "logprobs5-text,topp-topk-seed-text", "--results-dir", str(tmp_path), "--output", "run"]
    results = sampling_paths.main(args)
    settings = results["settings"]
    assert list(settings) == ["greedy", "logprobs5-text", "topp-topk-seed-text"]  # the baseline runs first
    assert settings["greedy"]["vs_greedy_per_round"] == [1.0, 1.0] and settings["greedy"]["vs_greedy_best_runs"] == 1.0
    best_greedy = max(run["output_tokens_per_s"] for run in settings["greedy"]["runs"])
    best_logprobs = max(run["output_tokens_per_s"] for run in settings["logprobs5-text"]["runs"])
    assert settings["logprobs5-text"]["vs_greedy_best_runs"] == round(best_logprobs / best_greedy, 4)
    assert settings["greedy"]["sampling"]["detokenize"] is False
    assert settings["logprobs5-text"]["sampling"]["logprobs"] == 5
    assert settings["topp-topk-seed-text"]["sampling"]["seed_per_request"] is True
    for row in settings.values():
        assert [run["output_tokens"] for run in row["runs"]] == [results["workload"]["total_output_tokens"]] * 2
        for run in row["runs"]:
            assert len(run["host_probe_ms"]) == 2 and min(run["host_probe_ms"]) > 0
        assert 0 <= row["steady_host_runs"] <= 2
    with pytest.raises(SystemExit):
        sampling_paths.parse_args(["--settings", "greedy,top-q"])


def test_steady_host_runs_keep_runs_whose_probes_stayed_near_the_fastest():
    def run(rate, before, after):
        return {"output_tokens_per_s": rate, "host_probe_ms": [before, after]}

    runs = {"greedy": [run(100.0, 10.0, 11.0), run(70.0, 10.5, 25.0), run(90.0, 14.0, 12.0)],
            "topk": [run(80.0, 30.0, 12.0), run(95.0, 15.0, 15.0), run(85.0, 15.1, 10.0)]}
    bound_runs = sampling_paths.steady_host_runs(runs)  # fastest probe 10 ms: bound 15 ms
    assert bound_runs == {"greedy": [100.0, 90.0], "topk": [95.0]}


def test_spec_decode_steady_host_speedup_uses_only_runs_the_host_probes_keep():
    def side(runs, probes, prefill):
        return [({"generate_s_runs": runs, "generate_host_probe_ms": probes, "prefill_s_median": prefill}, [])]

    # Fastest probe 10 ms: runs with a probe above 15 ms are dropped on either side.
    off = side([1.1, 2.0, 1.3], [[10, 11], [30, 12], [12, 14]], 0.1)
    on = side([0.6, 0.5], [[16, 10], [11, 11]], 0.1)
    steady = spec_decode.steady_host_speedup(off, on, output_len=11)["steady_host"]
    assert steady["runs"] == {"off": 2, "on": 1}
    assert steady["off_ms_per_token"] == round(1e3 * (1.2 - 0.1) / 10, 4)
    assert steady["on_ms_per_token"] == round(1e3 * (0.5 - 0.1) / 10, 4)
    assert steady["speedup"] == round(110.0 / 40.0, 3)


def test_mixed_step_benchmark_times_the_step_kinds_it_names(tmp_path):
    """Every timed step of each kind is of that kind by the engine's own count (a mixed step holds
    the decodes and the new chunk)."""
    results = mixed_step.main(["--decodes", "5", "--chunk", "24", "--context", "20", "--warmup", "1", "--steps", "3",
                               "--results-dir", str(tmp_path), "--output", "run"])
    assert json.loads((tmp_path / "run.json").read_text())["mixed_over_decode"] == results["mixed_over_decode"]
    decode, mixed = results["steps"]
    assert decode["steps_by_kind"] == {"decode": 4} and mixed["steps_by_kind"] == {"mixed": 4}
    assert results["ratio_of"] == "wall_ms" and results["mixed_over_decode"] > 0


def test_busy_time_counts_overlapping_kernels_once():
    """Against a count of the unit cells some interval covers (integer end points)."""
    generator = random.Random(0)
    for _ in range(200):
        intervals = []
        for _ in range(generator.randint(0, 8)):
            start = generator.randint(0, 40)
            intervals.append((start, start + generator.randint(0, 12)))
        covered = {cell for start, end in intervals for cell in range(start, end)}
        assert mixed_step.busy_time(intervals) == len(covered)


def test_launch_cost_times_every_torch_call_on_cpu(tmp_path):
    results = launch_cost.main(["--device", "cpu", "--calls", "20", "--repeats", "2", "--tokens", "8", "--hidden", "16",
                                "--qkv", "24", "--results-dir", str(tmp_path), "--output", "run"])
    assert json.loads((tmp_path / "run.json").read_text())["us_per_call"] == results["us_per_call"]
    assert set(results["us_per_call"]) == {"torch.mm", "torch.empty", "nn.Module call", "Tensor.split (3)"}
    assert all(us > 0 for us in results["us_per_call"].values())
    assert results["floor"] == {}  # the floor needs the Triton rows (CUDA)


def test_latency_times_both_sides(tmp_path):
    results = latency.main(["--input-len", "16", "--output-len", "6", "--warmup", "1", "--repeats", "2",
                            "--results-dir", str(tmp_path), "--output", "run"])
    for side in (results["novainfer"], results["peer"]):
        assert len(side["runs"]) == 2
        for run in side["runs"]:
            assert run["num_tokens"] == 6 and 0 < run["ttft_s"] < run["total_s"]
    assert results["peer"]["greedy_outputs_identical"]


def test_spec_decode_benchmark_reports_the_acceptance_of_each_figure(tmp_path):
    """Both modes on the tiny model whose greedy outputs repeat themselves: outputs with speculation
    equal those without, and each decode figure's acceptance equals a recount from those outputs
    (the drafts the reference n-gram search proposes, accepted while they agree with them) over the
    timed runs only (a warm-up run comes first)."""
    from novainfer import LLM, SamplingParams
    from tests.test_spec_decode import recount_speculation

    k, max_n, output_len = 3, 2, 12
    args = ["--tiny-config", '{"std": 0.1}', "--batch-sizes", "1", "2", "--input-len", "10", "--passage-len", "4",
            "--output-len", str(output_len), "--repeats", "1", "--warmup", "1", "--num-seqs", "4", "--min-input", "5",
            "--max-input", "20", "--min-output", "3", "--max-output", "10", "--speculative-config",
            f'{{"method": "ngram", "num_speculative_tokens": {k}, "prompt_lookup_max": {max_n}}}',
            "--results-dir", str(tmp_path), "--output", "run"]
    results = spec_decode.main(args)
    assert json.loads((tmp_path / "run.json").read_text()) == results
    assert results["command"].startswith("python benchmarks/spec_decode.py --tiny-config")
    parsed = spec_decode.parse_args(args)
    model_dir = results["model"]["path"].replace("~", str(__import__("pathlib").Path.home()), 1)
    llm = LLM(model_dir)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    for b in (1, 2):
        figure = results["decode"]["figures"][f"batch_{b}"]
        assert figure["greedy_outputs_identical"] and figure["off"]["draft_tokens"] == 0
        prompts = spec_decode.decode_prompts(parsed, results["model"]["vocab_size"], b)
        assert all(p[:4] * 3 == p[:12] or len(p) < 12 for p in prompts)  # a repeated passage
        outputs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                use_tqdm=False)]
        drafts, draft_tokens, accepted, per_pos = recount_speculation(prompts, outputs, k, max_n, output_len)
        on = figure["on"]
        assert (on["drafts"], on["draft_tokens"], on["accepted_tokens"]) == (drafts, draft_tokens, accepted)
        off_steps, on_steps = figure["off"]["steps"], on["steps"]
        assert off_steps["tokens_per_engine_step"] * off_steps["engine_steps"] == b * output_len  # one timed run
        if b == 1:  # each accepted draft is a step the lone request did not take
            assert off_steps["engine_steps"] - on_steps["engine_steps"] == accepted > 0
        assert on["acceptance_rate"] == figure["acceptance_rate"] == round(accepted / draft_tokens, 4)
        assert on["acceptance_rate_per_position"] == [round(n / drafts, 4) for n in per_pos]
        # Timings: present (their values depend on the machine's load, e.g. a prefill run slower than the whole),
        # the figure's the median (upper) round's of two.
        for side in (on, figure["off"]):
            assert isinstance(side["ms_per_token"], float) and len(side["ms_per_token_rounds"]) == 2
            assert side["ms_per_token"] == max(side["ms_per_token_rounds"])
            assert len(side["generate_host_probe_ms"]) == 1 and len(side["generate_host_probe_ms"][0]) == 2
        assert set(figure["steady_host"]["runs"]) == {"off", "on"}
        assert all(0 <= n <= 2 for n in figure["steady_host"]["runs"].values())
    tput = results["throughput"]
    assert tput["greedy_outputs_identical"] and tput["workload"]["num_seqs"] == 4
    assert tput["on"]["output_tokens"] == tput["off"]["output_tokens"] == tput["workload"]["total_output_tokens"]
    assert tput["on"]["draft_tokens"] > 0 and tput["off"]["draft_tokens"] == 0
    assert tput["on"]["engine"]["speculative_config"]["num_speculative_tokens"] == k
    # Two rounds (the default) of one run each: every side's runs are pooled.
    assert tput["rounds"] == 2 and all(len(tput[side]["output_tokens_per_s_runs"]) == 2 for side in ("off", "on"))


def test_api_process_benchmark_streams_every_burst_and_reports_per_token_cpu(tmp_path):
    """Every stream of every burst ends with [DONE] (the benchmark raises otherwise), and the figures
    follow from the recorded runs: the long bursts' extra CPU over the extra tokens."""
    results = api_process.main(["--num-prompts", "6", "--output-len", "5", "--repeats", "2",
                                "--results-dir", str(tmp_path), "--output", "run"])
    figures = results["figures"]
    assert [len(runs) for runs in figures["runs_cpu_s"].values()] == [2, 2]
    short, long = (sum(figures["runs_cpu_s"][k]) / 2 for k in ("1", "5"))  # medians of two
    assert figures["admission_and_one_token_cpu_s"] == round(short, 4) and figures["burst_cpu_s"] == round(long, 4)
    assert figures["streaming_us_per_token"] == pytest.approx((long - short) / (6 * 4) * 1e6, abs=0.01)
    assert json.loads((tmp_path / "run.json").read_text())["figures"] == figures
