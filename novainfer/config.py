"""Engine configuration: what model, how much cache, how to schedule, how to parallelise.

Field names follow vLLM's so that users can carry their arguments over unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from novainfer.models.config_utils import get_head_dim
from novainfer.spec_decode.config import SpeculativeConfig

# 0 runs the model as written; 1 compiles its forward with torch.compile (inductor); 2 as 1 with
# inductor's C++ wrapper (see novainfer.models.compile).
COMPILATION_LEVELS = (0, 1, 2)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be one of 'auto', 'cpu', 'cuda', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but CUDA is not available")
    return torch.device(device)


def preferred_dtype(device: torch.device) -> torch.dtype:
    """The float type for weights that have none of their own (a quantized GGUF file's): bfloat16
    where ``device`` computes it natively (a CUDA GPU that supports it; a CPU with AVX512-BF16 or
    AMX, where reading half the bytes per token speeds decoding up: see the README's GGUF section),
    else float32."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    native = device.type == "cpu" and (getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
                                       or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    return torch.bfloat16 if native else torch.float32


@dataclass
class ModelConfig:
    model: str
    tokenizer: str | None = None
    # "auto": the checkpoint's own float type, or preferred_dtype(device) for one without (a
    # quantized GGUF file).
    dtype: str | torch.dtype = "auto"
    seed: int = 0
    max_model_len: int | None = None
    # Never capture CUDA graphs: every step runs eagerly (for debugging and comparison).
    enforce_eager: bool = False
    # The most tokens a step replayed from a CUDA graph holds (vLLM's name); larger steps run
    # eagerly, where the host's launch cost is small next to their kernels.
    max_cudagraph_capture_size: int = 1024
    # "torch" or "triton"; None picks the fastest for the device.
    attention_backend: str | None = None
    # 0 runs the model eagerly as written; 1 compiles its forward with torch.compile (inductor) for the
    # steps that replay no CUDA graph; 2 as 1, with inductor's C++ wrapper launching the kernels (see
    # novainfer.models.compile). Costs compilations at first use of each kind of step (cached under
    # the NovaInfer cache directory for the next start).
    compilation_level: int = 0
    # Where the model runs: decides "auto" for weights without a float type of their own.
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    hf_config: Any = field(default=None, repr=False)
    torch_dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        if self.hf_config is None:
            self.hf_config = self._load_hf_config()
        self.tokenizer = self.tokenizer or self.model
        self.torch_dtype = self._resolve_dtype()
        limit = int(getattr(self.hf_config, "max_position_embeddings", 0) or 0)
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len < 1 or (limit and self.max_model_len > limit):
            raise ValueError(f"max_model_len must be in [1, {limit}] (the model's max_position_embeddings), "
                             f"got {self.max_model_len}")
        if self.compilation_level not in COMPILATION_LEVELS:
            raise ValueError(f"compilation_level must be 0 (no compilation), 1 (torch.compile) or 2 (torch.compile "
                             f"with inductor's C++ wrapper), got {self.compilation_level}")
        if self.max_cudagraph_capture_size < 1:
            raise ValueError(f"max_cudagraph_capture_size must be >= 1, got {self.max_cudagraph_capture_size}")

    def _load_hf_config(self):
        from transformers import AutoConfig

        from novainfer.model_loader.gguf import is_gguf_file, load_gguf_config

        path = Path(self.model)
        if is_gguf_file(path):
            return load_gguf_config(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model must be a local Hugging Face model directory with a config.json, or a "
                             f".gguf file; got {self.model!r}")
        return AutoConfig.from_pretrained(str(path), local_files_only=True)

    def _resolve_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            configured = (self.hf_config.dtype if hasattr(self.hf_config, "dtype")
                          else getattr(self.hf_config, "torch_dtype", None))  # transformers' older name
            if isinstance(configured, torch.dtype):
                return configured
            if configured is None:
                return preferred_dtype(self.device)
            return _DTYPES.get(str(configured), torch.float32)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        return _DTYPES[self.dtype]

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def head_dim(self) -> int:
        return get_head_dim(self.hf_config)

    @property
    def num_kv_heads(self) -> int:
        return self.hf_config.num_key_value_heads

    def generation_eos_token_ids(self) -> list[int]:
        """EOS ids from ``generation_config.json`` (one id or a list), else from the model config."""
        gen_path = Path(self.model) / "generation_config.json"
        eos = json.loads(gen_path.read_text()).get("eos_token_id") if gen_path.is_file() else None
        if eos is None:
            eos = getattr(self.hf_config, "eos_token_id", None)
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None  # explicit KV budget; the default budget on CPU
    enable_prefix_caching: bool = True
    cpu_kv_cache_default_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")


_EXECUTOR_BACKENDS = ("uni", "mp", "ray")
_DISTRIBUTED_BACKENDS = ("nccl", "gloo")


@dataclass
class ParallelConfig:
    """Seed 000 section 5.1, with vLLM's field names.

    Filled in by :func:`normalize_parallel_config`: ``world_size``, ``rank`` and ``local_rank`` (the
    driver's: 0), ``use_single_process_tp`` (every rank lives in the driver process: ``uni``),
    ``distributed_backend`` when None and ``tensor_parallel_device_ids`` when None.
    ``master_port``, ``node_rank`` and ``nnodes`` only matter across nodes (not implemented); on one
    node ``mp`` meets at ``init_method``, or at a free port of ``master_addr`` when that is empty.

    NovaInfer's additions to vLLM's fields: ``distributed_backend`` (the collective library between
    worker processes: "nccl" on CUDA, "gloo" on CPU), ``init_method``, ``tp_group_name``,
    ``use_single_process_tp``, ``tensor_parallel_device_ids`` (the GPU of each rank) and
    ``enable_vocab_parallel`` (split the embedding and LM head over the vocabulary, seed 000
    section 7.1.9; off: both are replicated on every rank). ``disable_custom_all_reduce`` (vLLM's
    name) keeps every all-reduce on NCCL instead of the custom kernels for small GPU tensors.
    """

    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    node_rank: int = 0
    nnodes: int = 1
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    distributed_backend: str | None = None
    init_method: str = ""
    tp_group_name: str = "TP0"
    use_single_process_tp: bool = True
    tensor_parallel_device_ids: list[int] | None = None
    enable_vocab_parallel: bool = False
    disable_custom_all_reduce: bool = False


def _require_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _device_ids(cfg: ParallelConfig, device: torch.device) -> list[int]:
    """The validated GPU of each rank; by default consecutive ones from the device's index."""
    tp = cfg.tensor_parallel_size
    ids = cfg.tensor_parallel_device_ids
    if ids is None:
        first = device.index or 0
        ids = list(range(first, first + tp))
    else:
        if not isinstance(ids, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise ValueError(f"tensor_parallel_device_ids must be a list of integers, got {ids!r}")
        ids = list(ids)
        if len(ids) != tp:
            raise ValueError(f"tensor_parallel_device_ids has {len(ids)} entries ({ids}), expected "
                             f"tensor_parallel_size={tp}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"tensor_parallel_device_ids contains duplicates: {ids}; every rank needs its own device")
        if min(ids) < 0:
            raise ValueError(f"tensor_parallel_device_ids must be >= 0, got {ids}")
    if device.type == "cuda":
        count = torch.cuda.device_count()
        beyond = [i for i in ids if i >= count]
        if beyond:
            raise ValueError(f"tensor_parallel_device_ids {ids} name CUDA device(s) {beyond}, but {count} "
                             f"are visible (valid ids: 0..{count - 1}); lower tensor_parallel_size or pass "
                             f"tensor_parallel_device_ids")
    return ids


def normalize_parallel_config(cfg: ParallelConfig, device: torch.device | None = None) -> ParallelConfig:
    """Validates and fills in a ParallelConfig in one place (seed 000 section 5.2).

    ``device`` is the engine's device (default: what "auto" resolves to); it picks the collective
    library and bounds the device ids. Malformed values raise ``ValueError`` before features
    that are not implemented raise ``NotImplementedError``.
    """
    device = device if device is not None else resolve_device("auto")
    backend = cfg.distributed_executor_backend
    if backend not in _EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend must be one of {list(_EXECUTOR_BACKENDS)}, got {backend!r}")
    _require_int("tensor_parallel_size", cfg.tensor_parallel_size, 1)
    _require_int("pipeline_parallel_size", cfg.pipeline_parallel_size, 1)
    _require_int("nnodes", cfg.nnodes, 1)
    _require_int("node_rank", cfg.node_rank, 0, cfg.nnodes - 1)
    _require_int("master_port", cfg.master_port, 1, 65535)
    if not isinstance(cfg.master_addr, str) or not cfg.master_addr:
        raise ValueError(f"master_addr must be a non-empty host name or address, got {cfg.master_addr!r}")
    if not isinstance(cfg.tp_group_name, str) or not cfg.tp_group_name:
        raise ValueError(f"tp_group_name must be a non-empty string, got {cfg.tp_group_name!r}")
    cfg.tensor_parallel_device_ids = _device_ids(cfg, device)
    if cfg.distributed_backend is None:
        cfg.distributed_backend = "nccl" if device.type == "cuda" else "gloo"
    elif cfg.distributed_backend not in _DISTRIBUTED_BACKENDS:
        raise ValueError(f"distributed_backend must be one of {list(_DISTRIBUTED_BACKENDS)} (or None: by device), "
                         f"got {cfg.distributed_backend!r}")
    elif cfg.distributed_backend == "nccl" and device.type != "cuda":
        raise ValueError(f"distributed_backend='nccl' needs CUDA devices, but the device is {device}; use 'gloo'")
    if cfg.pipeline_parallel_size != 1:
        raise NotImplementedError(f"pipeline_parallel_size must be 1 (pipeline parallelism is not implemented), "
                                  f"got {cfg.pipeline_parallel_size}")
    if cfg.nnodes != 1:
        raise NotImplementedError(f"nnodes must be 1 (multi-node is not implemented), got {cfg.nnodes}")
    if backend == "ray":
        raise NotImplementedError("distributed_executor_backend='ray' is not implemented; use 'uni' or 'mp'")
    cfg.world_size = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    cfg.rank = 0
    cfg.local_rank = 0
    cfg.use_single_process_tp = backend == "uni"
    return cfg


@dataclass
class EngineConfig:
    """Everything an engine and its workers are built from."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: Any
    parallel_config: ParallelConfig
    device: torch.device
    speculative_config: SpeculativeConfig | None = None
    # The draft model of speculative decoding's "draft_model" method (same vocabulary as the target).
    draft_model_config: ModelConfig | None = None
