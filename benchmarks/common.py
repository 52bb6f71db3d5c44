"""Helpers shared by the benchmarks: the model under test, the engines' arguments, the workload,
machine facts, results files.

Results files never hold absolute paths of the machine they were made on: paths under the model
cache directory start with ``$NOVAINFER_CACHE`` when that is set, paths inside the repository are
written relative to it, paths under the home directory start with ``~``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

# nano-vllm draws prompt token ids below this (clipped to the vocabulary of small models).
PROMPT_TOKEN_ID_LIMIT = 10000


# ---- paths and the command line -------------------------------------------------------------------
def scrub_path(text: str) -> str:
    """Replaces this machine's model cache directory with ``$NOVAINFER_CACHE`` (when that is set), its
    repository root with ``.`` and its home directory with ``~``."""
    text = str(text)
    cache = os.environ.get("NOVAINFER_CACHE")
    if cache:
        text = text.replace(str(Path(cache).expanduser()), "$NOVAINFER_CACHE")
    root = str(REPO_ROOT)
    if text == root:
        return "."
    text = text.replace(root + os.sep, "")
    home = str(Path.home())
    if home and home != os.sep:
        text = text.replace(home, "~")
    return text


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed from the repository root, e.g. ``python benchmarks/throughput.py --num-seqs 8``.

    ``argv``: the script's path then its arguments (default: ``sys.argv``).
    """
    argv = list(sys.argv if argv is None else argv)
    if argv:
        script = Path(argv[0])
        if script.suffix == ".py" and script.exists():
            try:
                argv[0] = str(script.resolve().relative_to(REPO_ROOT))
            except ValueError:
                argv[0] = script.name
        argv = ["python", *argv]
    return shlex.join(scrub_path(a) for a in argv)


# ---- where and on what it ran ----------------------------------------------------------------------
def _cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: Any = None) -> dict[str, Any]:
    """CPU, OS, library versions and the device; no host name."""
    import torch
    import transformers

    uname = platform.uname()
    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        usable_cpus = os.cpu_count()
    info: dict[str, Any] = {
        "processor": platform.processor() or uname.machine,
        "cpu_model": _cpu_model_name(),
        "system": f"{uname.system} {uname.release} {uname.machine}",
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus,
        "torch_num_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device) if device is not None else None,
    }
    if device is not None and str(device).startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        info.update({"gpu": props.name, "gpu_count": torch.cuda.device_count(),
                     "gpu_memory_gib": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda})
    return info


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages: other work on the machine makes timings noisy."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


# Iterations of host_probe's loop: about 11 ms on the H200 machines' hosts at their usual speed.
_HOST_PROBE_ITERATIONS = 300_000


def host_probe() -> dict[str, float]:
    """Wall and thread-CPU milliseconds of a fixed pure-Python loop: the host's speed at this moment.

    The GPU machines are virtual: there a run's speed followed this probe (correlation 0.8 over 42
    runs of a few seconds) while the GPU's copy and matrix rates held within 1%. A slow vCPU raises
    both figures; a vCPU taken away by the hypervisor raises the wall time alone.
    """
    wall, cpu = time.perf_counter(), time.thread_time()
    total = 0
    for i in range(_HOST_PROBE_ITERATIONS):
        total += i & 7
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return {"wall_ms": round(1e3 * wall, 2), "cpu_ms": round(1e3 * cpu, 2)}


# A run is a steady-host run when both of its host probes took at most this times the fastest probe
# (on the H200 hosts the probe took 10-14.5 ms at their usual speed and 17-34 ms in slow spells).
STEADY_HOST_MARGIN = 1.5


def steady_host(probes: Sequence[Sequence[float]]) -> list[bool]:
    """Per run, given its :func:`host_probe` wall times (before and after it), whether the host ran
    at its usual speed around it: each probe within ``STEADY_HOST_MARGIN`` times the fastest probe of
    all the runs given."""
    bound = STEADY_HOST_MARGIN * min(ms for run in probes for ms in run)
    return [max(run) <= bound for run in probes]


def steal_seconds() -> float | None:
    """CPU time the hypervisor gave to others while this machine's vCPUs wanted it, summed over
    vCPUs since boot (``/proc/stat``); None where the kernel does not report it."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def git_commit() -> str:
    """``git rev-parse --short HEAD``, with ``-dirty`` when tracked or untracked files differ from it.

    ``NOVAINFER_COMMIT`` overrides it, for a copy of the tree whose git metadata is not the tree's
    own (e.g. the files were copied to a benchmark machine without their history).
    """
    if os.environ.get("NOVAINFER_COMMIT"):
        return os.environ["NOVAINFER_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    try:
        dirty = bool(git("status", "--porcelain"))
    except (OSError, subprocess.SubprocessError):
        dirty = False
    return commit + ("-dirty" if dirty else "")


# ---- the model under test --------------------------------------------------------------------------
def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Which model (a directory, the tiny model or an architecture preset), on which device, in which dtype."""
    from benchmarks.architectures import ARCHITECTURES

    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="Hugging Face model directory, GGUF file or built-in model name such as smollm2 (default: "
                        "the built-in tiny random Qwen2)")
    g.add_argument("--tiny-config", default=None,
                   help='JSON overrides for a tiny model variant, e.g. \'{"hidden_size": 256}\'')
    g.add_argument("--arch", default=None, choices=sorted(ARCHITECTURES),
                   help="a real architecture with random bfloat16 weights, built once under the cache directory")
    g.add_argument("--arch-overrides", default=None,
                   help='JSON overrides of the --arch preset, e.g. \'{"num_hidden_layers": 2}\' for a quick run')
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16 or float16")


def _json_object(flag: str, text: str | None) -> dict[str, Any]:
    value = json.loads(text) if text else {}
    if not isinstance(value, dict):
        raise SystemExit(f"{flag} must be a JSON object of config overrides, got {text!r}")
    return value


def resolve_model(model: str | None, tiny_config: str | None = None, arch: str | None = None,
                  arch_overrides: str | None = None, device: Any = "cpu") -> tuple[str, str]:
    """Returns (model directory, short tag): ``--model DIR``, an ``--arch`` preset (built on ``device`` if
    not cached) or the built-in tiny model (with ``--tiny-config`` overrides)."""
    from novainfer.tiny_model import get_tiny_model_dir

    chosen = [flag for flag, value in (("--model", model), ("--tiny-config", tiny_config), ("--arch", arch))
              if value]
    if len(chosen) > 1:
        raise SystemExit(f"{' and '.join(chosen)} exclude each other")
    if arch_overrides and not arch:
        raise SystemExit("--arch-overrides needs --arch")
    if model:
        from novainfer.builtin_models import builtin_model
        from novainfer.model_loader.gguf import is_gguf_file

        builtin = builtin_model(model)
        path = builtin.locate() if builtin is not None else Path(model).expanduser()
        if not ((path / "config.json").is_file() or is_gguf_file(path)):
            raise SystemExit(f"--model {model!r} is neither a Hugging Face model directory (no config.json) nor "
                             f"a GGUF file nor a built-in model")
        return str(path), model if builtin is not None else path.resolve().stem
    if arch:
        from benchmarks.architectures import build_model_dir, get_architecture

        overrides = _json_object("--arch-overrides", arch_overrides)
        try:
            spec = get_architecture(arch, overrides)
        except ValueError as exc:
            raise SystemExit(f"--arch {arch} --arch-overrides {arch_overrides}: {exc}") from exc
        path = build_model_dir(arch, spec, device)
        return str(path), arch if not overrides else path.name
    overrides = _json_object("--tiny-config", tiny_config)
    path = get_tiny_model_dir(**overrides)
    return str(path), "tiny" if not overrides else path.name


def resolve_model_args(args: argparse.Namespace, device: Any) -> tuple[str, str, dict[str, Any]]:
    """(model directory, short tag, :func:`model_summary`) from the flags of :func:`add_model_arguments`."""
    model_dir, tag = resolve_model(args.model, args.tiny_config, args.arch, args.arch_overrides, device)
    summary = model_summary(model_dir, _json_object("--tiny-config", args.tiny_config) if args.tiny_config else None)
    if args.model:
        from novainfer.builtin_models import builtin_model

        if builtin_model(args.model) is not None:  # its name, not where its package put the file
            summary["path"] = f"built-in {args.model} ({Path(model_dir).name})"
    if args.arch:
        summary = {"preset": args.arch, "preset_overrides": _json_object("--arch-overrides", args.arch_overrides),
                   **summary}
    return model_dir, tag, summary


def model_summary(model_dir: str, tiny_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The architecture facts that decide the cost of a forward pass."""
    config_file = Path(model_dir) / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
    else:  # a GGUF file: its metadata as a config
        from novainfer.config import ModelConfig

        config = ModelConfig(model_dir).hf_config.to_dict()
    keys = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
            "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "torch_dtype", "dtype")
    summary: dict[str, Any] = {"path": scrub_path(str(model_dir))}
    summary.update({k: config[k] for k in keys if k in config})
    if tiny_overrides is not None:
        summary["tiny_overrides"] = tiny_overrides
    try:
        from safetensors import safe_open

        total = 0
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    total += _numel(f.get_slice(name).get_shape())
        summary["num_parameters"] = total
    except Exception:  # the summary is informative only
        pass
    return summary


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---- the engines under test ------------------------------------------------------------------------
def add_attention_backend_argument(g: argparse._ArgumentGroup) -> None:
    from novainfer.attention.backends.selector import BACKEND_NAMES

    g.add_argument("--attention-backend", default=None, choices=BACKEND_NAMES,
                   help="default: the fastest for the device (triton on CUDA, sdpa on CPU)")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """NovaInfer's engine arguments that a benchmark sets (vLLM's names)."""
    g = p.add_argument_group("NovaInfer engine")
    add_attention_backend_argument(g)
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=16384, help="most tokens per step")
    g.add_argument("--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory the engine may use (weights, activations and KV cache)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs NovaInfer shards the model over (the transformers peer uses one)")
    g.add_argument("--distributed-executor-backend", default="uni", choices=["uni", "mp"],
                   help="uni: every rank a thread of this process; mp: a process per rank")
    g.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="every all-reduce through NCCL (default: small ones through the custom kernels)")
    g.add_argument("--enable-vocab-parallel", action="store_true",
                   help="split the embedding and LM head over the vocabulary (default: replicated)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of shared prompt prefixes")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule each step before the previous one's tokens reach the host (default: on GPUs)")
    g.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help='speculative decoding, as JSON with vLLM\'s keys, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' (default: off)')


def _speculative_config(text: str) -> dict[str, Any]:
    """``--speculative-config``'s JSON object (its keys are checked when the engine starts)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments from the flags of :func:`add_model_arguments` and :func:`add_engine_arguments`."""
    kwargs = {"dtype": args.dtype, "device": args.device, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens,
              "gpu_memory_utilization": args.gpu_memory_utilization,
              "tensor_parallel_size": args.tensor_parallel_size,
              "distributed_executor_backend": args.distributed_executor_backend,
              "disable_custom_all_reduce": args.disable_custom_all_reduce,
              "enable_vocab_parallel": args.enable_vocab_parallel, "async_scheduling": args.async_scheduling,
              "enable_prefix_caching": args.enable_prefix_caching,
              "speculative_config": args.speculative_config, "attention_backend": args.attention_backend}
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    return kwargs


def greedy_params(max_tokens: int):
    """NovaInfer's parameters for one benchmark request: greedy, exactly ``max_tokens`` tokens, no text.

    Prompts are token ids and only the produced tokens are counted, so detokenizing would be work
    that neither the benchmark nor the peer (which returns token ids) needs.
    """
    from novainfer import SamplingParams

    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, detokenize=False)


@contextmanager
def transformers_errors_only() -> Iterator[None]:
    """Silences transformers' warnings, e.g. that -1 (our way to never stop at EOS) is not a real token id."""
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)


def load_transformers_model(model_dir: str, dtype: Any, device: Any, attn_implementation: str | None = None):
    """The peer's model: transformers ``AutoModelForCausalLM`` on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs).to(device).eval()


def release_device_memory(device: Any) -> dict[str, float] | None:
    """Collects garbage and empties the CUDA cache; returns what is still allocated (GiB), ``None`` on CPU.

    The engine that ran first must not keep memory the next one would then lack: transformers'
    continuous batching sizes its KV cache from the memory this process has not allocated.
    """
    import torch

    gc.collect()
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return {"allocated_gib": round(torch.cuda.memory_allocated(device) / 2**30, 3),
            "reserved_gib": round(torch.cuda.memory_reserved(device) / 2**30, 3)}


# ---- the workload ----------------------------------------------------------------------------------
@dataclass
class Workload:
    """nano-vllm's offline throughput shape: random prompts, EOS ignored, each with its own output length."""

    num_seqs: int
    min_input: int
    max_input: int
    min_output: int
    max_output: int
    seed: int
    token_id_limit: int
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def total_input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        del d["prompts"], d["output_lens"]
        d.update(total_input_tokens=self.total_input_tokens, total_output_tokens=self.total_output_tokens,
                 token_ids="uniform in [0, token_id_limit)", lengths="uniform, bounds inclusive",
                 ignore_eos=True)
        return d


def make_workload(num_seqs: int, vocab_size: int, min_input: int, max_input: int, min_output: int,
                  max_output: int, seed: int = 0) -> Workload:
    """Random prompt token ids in [0, min(10000, vocab)); prompt and output lengths uniform in the bounds."""
    if not (1 <= min_input <= max_input and 1 <= min_output <= max_output and num_seqs >= 1):
        raise SystemExit("need num_seqs >= 1, 1 <= min_input <= max_input and 1 <= min_output <= max_output")
    rng = random.Random(seed)
    limit = min(PROMPT_TOKEN_ID_LIMIT, vocab_size)
    prompts = [[rng.randrange(limit) for _ in range(rng.randint(min_input, max_input))] for _ in range(num_seqs)]
    output_lens = [rng.randint(min_output, max_output) for _ in range(num_seqs)]
    return Workload(num_seqs, min_input, max_input, min_output, max_output, seed, limit, prompts, output_lens)


# ---- results ---------------------------------------------------------------------------------------
def add_output_arguments(p: argparse.ArgumentParser, default_name: str) -> None:
    """Where the results file goes (reduced runs belong outside the repository: ``--results-dir``)."""
    g = p.add_argument_group("output")
    g.add_argument("--output", default=None,
                   help=f"results file name (default: {default_name})")
    g.add_argument("--results-dir", default=None,
                   help="directory of the results file (default: benchmarks/results in the repository)")


def run_facts(device: Any, load_at_start: list[float] | None, argv: Sequence[str] | None,
              script: str) -> dict[str, Any]:
    """What every results file records about its run: machine, GPU, commit, command, time."""
    machine = machine_info(device)
    return {"gpu": machine.get("gpu"),
            "machine": {**machine, "load_average_1_5_15m": {"start": load_at_start, "end": load_average()}},
            "commit": git_commit(),
            "command": command_line(None if argv is None else [script, *argv]),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def write_results(name: str, results: dict[str, Any], directory: str | Path | None = None) -> Path:
    """Writes ``<directory>/<name>.json`` (default directory: ``benchmarks/results``) and returns its path."""
    if not name or os.sep in name or name.startswith("."):
        raise SystemExit(f"--output must be a plain file name, got {name!r}")
    if name.endswith(".json"):
        name = name[: -len(".json")]
    directory = Path(directory) if directory is not None else RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path
