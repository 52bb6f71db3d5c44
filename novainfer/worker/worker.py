"""A Worker owns one device: it loads the model, sizes and holds the KV cache, runs steps."""

from __future__ import annotations

import logging
import os

import torch

from novainfer.config import EngineConfig
from novainfer.core.sched.output import SchedulerOutput
from novainfer.worker.model_runner import ModelRunner, ModelRunnerOutput, SequenceInput

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, local_rank: int = 0, rank: int = 0,
                 distributed_init_method: str | None = None, is_driver_worker: bool = True) -> None:
        self.config = config
        self.local_rank = local_rank
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        device = self.config.device
        if device.type == "cuda":
            device_ids = self.config.parallel_config.tensor_parallel_device_ids or [0]
            device = torch.device("cuda", device_ids[self.local_rank])
            torch.cuda.set_device(device)
        self.device = device
        torch.manual_seed(self.config.model_config.seed)
        logger.info("worker pid=%d rank=%d local_rank=%d device=%s", os.getpid(), self.rank, self.local_rank, device)

    def load_model(self) -> None:
        self.model_runner = ModelRunner(self.config.model_config, self.config.cache_config, self.device)
        self.model_runner.load_model()

    def profile(self) -> int:
        """Peak bytes a full-budget forward step needs on the device, besides the KV cache (CUDA only)."""
        runner = self.model_runner
        sched = self.config.scheduler_config
        num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * sched.max_model_len)
        lengths = [sched.max_model_len] * (num_tokens // sched.max_model_len)
        if num_tokens % sched.max_model_len:
            lengths.append(num_tokens % sched.max_model_len)
        blocks_each = [-(-n // runner.block_size) for n in lengths]
        runner.allocate_kv_cache(sum(blocks_each))
        seqs, first = [], 0
        for n, count in zip(lengths, blocks_each):
            seqs.append(SequenceInput([0] * n, 0, list(range(first, first + count)), "last"))
            first += count
        torch.cuda.reset_peak_memory_stats(self.device)
        runner.forward(seqs)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        runner.release_kv_cache()
        return peak

    def determine_num_available_blocks(self) -> int:
        cache = self.config.cache_config
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        per_block = self.model_runner.kv_cache_bytes_per_block()
        if self.device.type != "cuda":
            budget = cache.kv_cache_memory_bytes or cache.cpu_kv_cache_default_bytes
        elif cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        else:
            peak = self.profile()
            free, total = torch.cuda.mem_get_info(self.device)
            # Memory held outside this process's allocator (other processes, CUDA context).
            non_torch = total - free - torch.cuda.memory_reserved(self.device)
            budget = int(total * cache.gpu_memory_utilization) - peak - non_torch
        # More blocks than every sequence at full length could use only costs start-up time.
        sched = self.config.scheduler_config
        useful = sched.max_num_seqs * -(-sched.max_model_len // self.config.cache_config.block_size)
        num_blocks = min(budget // per_block, useful)
        if num_blocks < 1:
            raise RuntimeError(f"no memory left for the KV cache on {self.device}: budget {budget} bytes, "
                               f"one block needs {per_block} bytes; raise gpu_memory_utilization or "
                               f"kv_cache_memory_bytes, or lower max_num_batched_tokens")
        return num_blocks

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.allocate_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def check_health(self) -> None:
        if self.model_runner is None or self.model_runner.model is None:
            raise RuntimeError(f"worker rank={self.rank} local_rank={self.local_rank} has no model loaded")
