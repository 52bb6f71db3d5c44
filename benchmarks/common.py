"""Helpers shared by the benchmarks: the model under test, the workload, machine facts, results files.

Results files never hold absolute paths of the machine they were made on: paths inside the
repository are written relative to it, paths under the home directory start with ``~``.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

# nano-vllm draws prompt token ids below this (clipped to the vocabulary of small models).
PROMPT_TOKEN_ID_LIMIT = 10000


# ---- paths and the command line -------------------------------------------------------------------
def scrub_path(text: str) -> str:
    """Replaces this machine's repository root with ``.`` and its home directory with ``~``."""
    text = str(text)
    root = str(REPO_ROOT)
    if text == root:
        return "."
    text = text.replace(root + os.sep, "")
    home = str(Path.home())
    if home and home != os.sep:
        text = text.replace(home, "~")
    return text


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed from the repository root, e.g. ``python benchmarks/throughput.py --num-seqs 8``."""
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


def git_commit() -> str:
    """``git rev-parse --short HEAD``, with ``-dirty`` when tracked or untracked files differ from it."""
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
def resolve_model(model: str | None, tiny_config: str | None = None) -> tuple[str, str]:
    """Returns (model directory, short tag): ``--model DIR`` or the built-in tiny model (with overrides)."""
    from novainfer.tiny_model import get_tiny_model_dir

    if model and tiny_config:
        raise SystemExit("--model and --tiny-config exclude each other")
    if model:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise SystemExit(f"--model {model!r} is not a Hugging Face model directory (no config.json)")
        return str(path), path.resolve().name
    overrides = json.loads(tiny_config) if tiny_config else {}
    if not isinstance(overrides, dict):
        raise SystemExit("--tiny-config must be a JSON object of config overrides")
    path = get_tiny_model_dir(**overrides)
    return str(path), "tiny" if not overrides else path.name


def model_summary(model_dir: str, tiny_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The architecture facts that decide the cost of a forward pass."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    keys = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
            "tie_word_embeddings", "torch_dtype")
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
def write_results(name: str, results: dict[str, Any]) -> Path:
    """Writes ``benchmarks/results/<name>.json`` and returns its path."""
    if not name or os.sep in name or name.startswith("."):
        raise SystemExit(f"--output must be a plain file name, got {name!r}")
    if name.endswith(".json"):
        name = name[: -len(".json")]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path
