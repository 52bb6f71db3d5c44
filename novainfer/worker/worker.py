"""A Worker owns one device: it joins its tensor-parallel group, loads its shard of the model,
sizes and holds its part of the KV cache, and runs steps.

Every rank runs every step on the same input; the tensor-parallel algorithm lives in the model's
layers only. Rank 0's result is the one the executor returns. Ranks that are threads of one
process (``uni``) get each step staged by the driver rank (:mod:`novainfer.worker.step_broadcast`);
ranks that are processes each stage it from the scheduler output.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from novainfer.config import EngineConfig
from novainfer.core.sched.output import SchedulerOutput
from novainfer.distributed import (
    ProcessGroup,
    ProcessGroupFactory,
    init_tensor_parallel_group,
    single_rank_group,
    tp_group_context,
)
from novainfer.sample import SamplerOutput
from novainfer.sample.rejection_sampler import warm_up_verification
from novainfer.worker.draft_proposer import CatchUp, DraftModelProposer
from novainfer.worker.host_memory import keep_freed_host_memory
from novainfer.worker.model_runner import ModelRunner, ModelRunnerOutput, SequenceInput
from novainfer.worker.step_broadcast import StepBroadcast

# Context of the warm-up's long decodes: more than one key tile of the decode kernel (128), so that
# they run in several splits (see _warm_up_compiled).
LONG_WARM_UP_CONTEXT = 256

logger = logging.getLogger(__name__)


@dataclass
class WorkerInfo:
    """Who a worker is, for the start-up log (seed 000 section 11.3: rank mapping at a glance)."""

    pid: int
    rank: int
    local_rank: int
    device: str


class Rank0Sampler(nn.Module):
    """Samples, then makes every rank keep rank 0's tokens (ranks that each sample, in ``mp``).

    Ranks compute identical logits, but random draws can differ between ranks (ranks that are
    threads of one process share the CPU generator); a rank that kept a different token would
    feed it back next step and corrupt the all-reduced activations of every rank.
    """

    def __init__(self, sampler: nn.Module, tp_group: ProcessGroup) -> None:
        super().__init__()
        self.sampler = sampler
        self.tp_group = tp_group

    def forward(self, *args, **kwargs) -> SamplerOutput:
        out = self.sampler(*args, **kwargs)
        self.tp_group.broadcast(out.sampled_token_ids, src=0)
        return out


class Worker:
    def __init__(self, config: EngineConfig, local_rank: int = 0, rank: int = 0,
                 distributed_init_method: str | None = None, is_driver_worker: bool = True,
                 follows_driver_steps: bool = False) -> None:
        """``follows_driver_steps``: the driver rank stages every step for all ranks (threads of one
        process); only it then keeps request state and samples."""
        self.config = config
        self.follows_driver_steps = follows_driver_steps
        self.local_rank = local_rank
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker
        self.device: torch.device | None = None
        self.tp_group: ProcessGroup = single_rank_group()
        self.model_runner: ModelRunner | None = None
        # Speculative decoding's draft model ("draft_model" method): its runner and proposer.
        self.draft_runner: ModelRunner | None = None
        self.drafter: DraftModelProposer | None = None
        self.num_steps = 0

    def execute_method(self, method: str | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs the method named ``method``, or ``method(self, *args, **kwargs)`` for a function
        (what an executor's ``collective_rpc`` runs on every rank)."""
        if isinstance(method, str):
            return getattr(self, method)(*args, **kwargs)
        return method(self, *args, **kwargs)

    def init_device(self) -> WorkerInfo:
        """Binds this rank's device (``tensor_parallel_device_ids[local_rank]``) and joins the TP group."""
        parallel = self.config.parallel_config
        device = self.config.device
        if device.type == "cuda":
            device = torch.device("cuda", parallel.tensor_parallel_device_ids[self.local_rank])
            torch.cuda.set_device(device)
        elif device.type == "cpu":
            keep_freed_host_memory()  # activations reuse freed host memory instead of mapping it anew each step
        self.device = device
        torch.manual_seed(self.config.model_config.seed)
        self.tp_group = init_tensor_parallel_group(parallel, self.rank, device, self.distributed_init_method or "")
        return WorkerInfo(os.getpid(), self.rank, self.local_rank, str(device))

    def load_model(self) -> None:
        """Builds and loads this rank's shard of the model (only its heads, KV heads and columns)."""
        with tp_group_context(self.tp_group, vocab_parallel=self.config.parallel_config.enable_vocab_parallel):
            self.model_runner = ModelRunner(self.config.model_config, self.config.cache_config, self.device)
            self.model_runner.load_model()
        if self.tp_group.world_size > 1 and not self.follows_driver_steps:
            self.model_runner.sampler = Rank0Sampler(self.model_runner.sampler, self.tp_group)
        draft_config = self.config.draft_model_config
        if draft_config is not None:
            self.draft_runner = ModelRunner(draft_config, self.config.cache_config, self.device)
            self.draft_runner.load_model()
            spec = self.config.speculative_config
            self.drafter = DraftModelProposer(self.draft_runner, spec.num_speculative_tokens,
                                              spec.disable_by_batch_size)

    def profile(self) -> int:
        """Peak bytes a full-budget forward step needs on the device, besides the KV cache, plus
        what the CUDA graphs will hold: their private pool keeps the activations of the largest
        captured step, apart from the memory eager steps reuse (CUDA only). A draft model's graphs
        have a pool of their own; its eager steps reuse the target's memory (a smaller model)."""
        sched = self.config.scheduler_config
        num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * sched.max_model_len)
        peak = self._peak_forward_bytes(num_tokens, self.model_runner)
        graph_tokens = min(num_tokens, self.config.model_config.max_cudagraph_capture_size)
        graph_pool = sum(self._peak_forward_bytes(graph_tokens, runner) - torch.cuda.memory_allocated(self.device)
                         for runner in self._runners() if runner.cuda_graphs_enabled)
        if self.drafter is not None and self.draft_runner.cuda_graphs_enabled:
            # A draft's chain graphs end in the LM head: the largest one's logits stay in its pool.
            draft = self.config.draft_model_config
            chain_seqs = self.drafter.chain_graphs(sched.max_num_seqs)["max_chain_seqs"]
            graph_pool += chain_seqs * draft.vocab_size * draft.torch_dtype.itemsize
        return peak + graph_pool

    def _prompt_step(self, num_tokens: int) -> tuple[list[SequenceInput], int]:
        """A step of ``num_tokens`` prompt tokens in sequences of at most ``max_model_len``, on KV blocks
        numbered from 0, and the number of blocks it needs."""
        max_len = self.config.scheduler_config.max_model_len
        lengths = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])
        return self._sequences([(n, 0) for n in lengths])

    def _sequences(self, shapes: list[tuple[int, int]]) -> tuple[list[SequenceInput], int]:
        """Sequences of ``(new tokens, tokens already cached)`` each, on KV blocks numbered from 0, and
        the number of blocks they need."""
        seqs, first = [], 0
        for num_new, context in shapes:
            count = -(-(context + num_new) // self.model_runner.block_size)
            seqs.append(SequenceInput([0] * num_new, context, list(range(first, first + count)), "last"))
            first += count
        return seqs, first

    def _peak_forward_bytes(self, num_tokens: int, runner: ModelRunner) -> int:
        """Peak bytes allocated while ``runner`` runs a step of ``num_tokens`` prompt tokens on a KV
        cache just large enough, which is then released."""
        seqs, num_blocks = self._prompt_step(num_tokens)
        runner.allocate_kv_cache(num_blocks)
        torch.cuda.reset_peak_memory_stats(self.device)
        runner.forward(seqs)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        runner.release_kv_cache()
        return peak

    def determine_num_available_blocks(self) -> int:
        """KV blocks this rank can hold; a block stores only this rank's KV heads (1/tp of them)."""
        cache = self.config.cache_config
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        # A block holds its tokens' K/V in the target's cache and, with a draft model, in the draft's.
        per_block = sum(runner.kv_cache_bytes_per_block() for runner in self._runners())
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

    def _runners(self) -> list[ModelRunner]:
        """The target's runner, then the draft model's if there is one."""
        return [self.model_runner] + ([self.draft_runner] if self.draft_runner is not None else [])

    def initialize_cache(self, num_blocks: int) -> None:
        sched = self.config.scheduler_config
        for runner in self._runners():
            runner.allocate_kv_cache(num_blocks)
            runner.reserve_step_buffers(sched.max_num_seqs, sched.max_num_batched_tokens)
            chains = self.drafter.chain_graphs(sched.max_num_seqs) if runner is self.draft_runner else {}
            runner.capture_model(sched.max_num_seqs, sched.max_num_batched_tokens, **chains)
        if self.drafter is not None:
            self.model_runner.draft_kv_blocks = np.zeros(num_blocks, dtype=bool)
        self._warm_up()

    def _warm_up(self) -> None:
        """Runs the largest eager step once, so that a workload's first large prefill does not pay for
        what a first use costs on a GPU: the allocator's growth (profiling returned its memory),
        library workspaces and kernel modules loaded on first launch. Its K/V go to free blocks,
        which every request writes before it reads (CUDA only: on CPU there is nothing to warm). Then
        every kernel variant that a step may need is compiled (see the attention backend's, the
        sampler's and the step buffers' ``warm_up``), and the LM heads run at every row count a step
        may sample (``ModelRunner.warm_up_head``). With compilation, every kind of step compiles first
        (:meth:`_warm_up_compiled`, on any device)."""
        runner = self.model_runner
        for each_runner in self._runners():
            if each_runner.model_config.compilation_level:
                self._warm_up_compiled(each_runner)
        if self.device.type != "cuda":
            return
        warmed = set()
        for layer in runner.model.attention_layers():
            key = (layer.num_heads, tuple(layer.k_cache.shape[1:]))
            if key not in warmed:
                warmed.add(key)
                runner.attn_backend.warm_up(layer.num_heads, layer.k_cache, layer.v_cache)
        runner.sampler.warm_up(runner.model_config.vocab_size, runner.model_config.torch_dtype, self.device)
        spec = self.config.speculative_config
        if spec is not None:
            warm_up_verification(spec.num_speculative_tokens, self.device)
        sched = self.config.scheduler_config
        # A step samples at most one row per sequence, or each draft and its bonus token.
        rows_per_seq = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        for each_runner in self._runners():
            each_runner.buffers.warm_up()
            each_runner.warm_up_head(min(sched.max_num_seqs * rows_per_seq, sched.max_num_batched_tokens))
        num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * sched.max_model_len)
        seqs, num_blocks = self._prompt_step(num_tokens)
        if num_blocks <= runner.num_blocks:
            runner.forward(seqs)
            torch.cuda.synchronize(self.device)

    def _warm_up_compiled(self, runner: ModelRunner) -> None:
        """Runs an eager step of each kind that a compiled forward keeps a graph for (see
        :mod:`novainfer.models.compile`), so that none compiles mid-run, stalling every request for tens
        of seconds: decodes of one sequence and of two, each with a short context (one decode split)
        and a long one (several), two prompts, and two prompts beside a long decode. The steps write
        K/V to free blocks only, as the other warm-up steps do."""
        long_context = min(self.config.scheduler_config.max_model_len - 1, LONG_WARM_UP_CONTEXT)
        steps = [[(1, context)] * num_seqs for num_seqs in (1, 2) for context in (1, long_context)]
        steps += [[(2, 0), (2, 0)], [(2, 0), (2, 0), (1, long_context)]]
        for step in steps:
            seqs, num_blocks = self._sequences(step)
            if num_blocks <= runner.num_blocks:
                runner.forward(seqs)

    def execute_model(self, scheduler_output: SchedulerOutput, step_broadcast: StepBroadcast | None = None,
                      pipelined: bool = False) -> list[ModelRunnerOutput] | None:
        """Runs one step; returns the outputs fetched meanwhile (see ``ModelRunner.execute_model``:
        with ``pipelined`` the step stays in flight until the next call). With ``step_broadcast``
        (ranks of one process), the driver stages the step and publishes it there, and the other
        ranks run what it published and return None."""
        started = time.perf_counter()
        runner = self.model_runner
        if step_broadcast is None:
            catch_ups = []  # the draft's catch-up, queued behind the step before its tokens are fetched
            on_launched = None if self.drafter is None else (
                lambda step: catch_ups.append(self.drafter.catch_up(runner, scheduler_output, step, not pipelined)))
            output = runner.execute_model(scheduler_output, pipelined=pipelined, on_launched=on_launched)
            if catch_ups:
                self._propose_drafts(catch_ups[0], output if not pipelined else [])
        elif self.is_driver_worker:
            try:
                output = runner.execute_model(scheduler_output, on_staged=step_broadcast.publish,
                                              pipelined=pipelined)
            except BaseException:
                step_broadcast.abandon()
                raise
        else:
            runner.run_staged(step_broadcast.wait())
            output = None
        self.num_steps += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("worker step %d: rank=%d num_tokens=%d step_ms=%.2f", self.num_steps, self.rank,
                         scheduler_output.total_num_scheduled_tokens, 1e3 * (time.perf_counter() - started))
        return output

    def _propose_drafts(self, catch_up: CatchUp | None, outputs: list[ModelRunnerOutput]) -> None:
        """Runs the draft model's proposal after a step and its catch-up and adds its drafts to the
        step's output, the last of ``outputs`` (none for a step left in flight: nothing is proposed
        after it). Without a catch-up (the draft computed nothing) there are no drafts."""
        sampled = outputs[-1] if outputs else None
        if catch_up is None:
            self.model_runner.device_drafts = None
            return
        drafts = self.drafter.propose(self.model_runner, catch_up, sampled.req_ids if sampled else [])
        self.model_runner.device_drafts = drafts
        if sampled is not None:
            sampled.num_draft_tokens = drafts.counts

    def check_health(self) -> None:
        if self.model_runner is None or self.model_runner.model is None:
            raise RuntimeError(f"worker rank={self.rank} local_rank={self.local_rank} has no model loaded")

    def shutdown(self) -> None:
        """Leaves the TP group and drops the model and its KV cache."""
        if self.tp_group.world_size > 1:
            ProcessGroupFactory.instance().destroy(self.tp_group)
            self.tp_group = single_rank_group()
        self.model_runner = self.draft_runner = self.drafter = None
