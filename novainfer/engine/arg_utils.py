"""Engine arguments with vLLM's names, and turning them into an EngineConfig."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from novainfer.builtin_models import resolve_model
from novainfer.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, normalize_parallel_config, \
    resolve_device
from novainfer.core.sched.scheduler import SchedulerConfig
from novainfer.spec_decode.config import SpeculativeConfig
from novainfer.tokenizer import get_tokenizer


@dataclass
class EngineArgs:
    # A directory, a .gguf file, or a built-in model's name ("smollm2", "tiny"); None: SmolLM2-135M-Instruct.
    model: str | None = None
    tokenizer: str | None = None
    # "auto": the checkpoint's float type; for quantized GGUF weights (the built-in SmolLM2), bfloat16 where
    # the device computes it natively, else float32 (novainfer.config.preferred_dtype).
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    # Steps of up to this many tokens (decode, prefill or both) replay CUDA graphs.
    max_cudagraph_capture_size: int = 1024
    # Schedule and launch each step before the previous one's tokens reach the host, so that the
    # host's work overlaps the device's. None: on for GPUs (a CPU computes while it schedules).
    async_scheduling: bool | None = None
    attention_backend: str | None = None  # "torch", "sdpa" or "triton"; default: the fastest for the device
    # 1: torch.compile (inductor) of the model forward for the steps without a CUDA graph; 2: the same
    # with inductor's C++ wrapper (faster eager steps, longer first compilations); 0: none.
    compilation_level: int = 0
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "uni"  # "uni" (ranks as threads of this process) or "mp"
    tensor_parallel_device_ids: list[int] | None = None  # the GPU of each rank; default 0..tp-1
    enable_vocab_parallel: bool = False  # split the embedding and LM head over the vocabulary
    disable_custom_all_reduce: bool = False  # small GPU all-reduces through NCCL, not the custom kernels
    log_stats_interval: float = 5.0
    # Speculative decoding, with vLLM's keys: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": 1, "prompt_lookup_max": 3, "disable_by_batch_size": 8}, or
    # {"method": "draft_model", "model": DIR, "num_speculative_tokens": k}. None: off.
    speculative_config: dict[str, Any] | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Like the constructor, but an unknown argument names every argument that exists."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; valid arguments are {sorted(known)}")
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        model = resolve_model(self.model)
        device = resolve_device(self.device)
        speculative_config = self._speculative_config()
        model_config = ModelConfig(model, tokenizer=self.tokenizer, dtype=self.dtype, seed=self.seed,
                                   max_model_len=self.max_model_len, enforce_eager=self.enforce_eager,
                                   max_cudagraph_capture_size=self.max_cudagraph_capture_size,
                                   attention_backend=self.attention_backend,
                                   compilation_level=self.compilation_level, device=device)
        draft_model_config = (draft_model_config_for(speculative_config.model, model_config)
                              if speculative_config is not None and speculative_config.method == "draft_model"
                              else None)
        cache_config = CacheConfig(block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
                                   num_gpu_blocks_override=self.num_gpu_blocks_override,
                                   kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                                   enable_prefix_caching=self.enable_prefix_caching)
        max_batched = self.max_num_batched_tokens or max(8192, model_config.max_model_len)
        scheduler_config = SchedulerConfig(max_num_batched_tokens=max_batched, max_num_seqs=self.max_num_seqs,
                                           max_model_len=model_config.max_model_len,
                                           # With speculation, only steps without drafts are pipelined
                                           # (EngineCore._can_pipeline).
                                           async_scheduling=(device.type == "cuda" if self.async_scheduling is None
                                                             else self.async_scheduling),
                                           # Steps with decodes stay within the captured graphs.
                                           max_mixed_step_tokens=(self.max_cudagraph_capture_size
                                                                  if device.type == "cuda" and not self.enforce_eager
                                                                  else None),
                                           num_lookahead_tokens=(speculative_config.num_speculative_tokens
                                                                 if draft_model_config is not None else 0))
        if self.compilation_level and self.tensor_parallel_size > 1:
            raise ValueError(f"compilation_level {self.compilation_level} needs tensor_parallel_size 1, got "
                             f"{self.tensor_parallel_size}")
        parallel_config = normalize_parallel_config(ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            tensor_parallel_device_ids=self.tensor_parallel_device_ids,
            enable_vocab_parallel=self.enable_vocab_parallel,
            disable_custom_all_reduce=self.disable_custom_all_reduce), device)
        return EngineConfig(model_config, cache_config, scheduler_config, parallel_config, device, speculative_config,
                            draft_model_config)

    def _speculative_config(self) -> SpeculativeConfig | None:
        """The validated speculative configuration, refusing what the engine cannot run with it yet."""
        if self.speculative_config is None:
            return None
        config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.tensor_parallel_size > 1:
            raise NotImplementedError(f"speculative_config needs tensor_parallel_size 1, got "
                                      f"{self.tensor_parallel_size}")
        return config

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)


def draft_model_config_for(draft_model: str, target: ModelConfig) -> ModelConfig:
    """The draft model's configuration: the target's dtype, context length and step settings, after
    checking that it shares the target's vocabulary and tokenizer (its tokens are the target's)."""
    key = "speculative_config['model']"
    try:
        draft = ModelConfig(draft_model, dtype=target.torch_dtype, seed=target.seed, max_model_len=target.max_model_len,
                            enforce_eager=target.enforce_eager,
                            max_cudagraph_capture_size=target.max_cudagraph_capture_size,
                            attention_backend=target.attention_backend, device=target.device)
    except ValueError as exc:
        raise ValueError(f"{key} {draft_model!r} cannot draft for the target: {exc}") from exc
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{key} {draft_model!r} has vocab_size {draft.vocab_size}, the target {target.model!r} has "
                         f"{target.vocab_size}: a draft model must share the target's vocabulary")
    try:
        draft_tokenizer = get_tokenizer(draft.tokenizer)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{key} {draft_model!r}: its tokenizer cannot be loaded ({exc}); a draft model must "
                         f"share the target's tokenizer") from exc
    differences = _tokenizer_differences(get_tokenizer(target.tokenizer), draft_tokenizer)
    if differences:
        raise ValueError(f"{key} {draft_model!r} has another tokenizer than the target {target.model!r} "
                         f"({differences}): a draft model must share the target's tokenizer")
    return draft


def _tokenizer_differences(target: Any, draft: Any) -> str:
    """What differs between two tokenizers' vocabularies, in words ('' when nothing does)."""
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    differing = sorted(t for t in target_vocab.keys() | draft_vocab.keys() if target_vocab.get(t) != draft_vocab.get(t))
    if not differing:
        return ""
    example = differing[0]

    def where(vocab: dict[str, int], name: str) -> str:
        return f"id {vocab[example]} in the {name}" if example in vocab else f"absent from the {name}"

    return f"{len(differing)} token(s) differ, e.g. {example!r}: {where(target_vocab, 'target')}, " \
           f"{where(draft_vocab, 'draft')}"
