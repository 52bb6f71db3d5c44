"""LLMEngine: requests in, RequestOutputs out, one scheduling step at a time."""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from novainfer.config import EngineConfig
from novainfer.core.kv_cache_manager import KVCacheManager
from novainfer.core.sched.output import SchedulerOutput
from novainfer.core.sched.scheduler import Scheduler
from novainfer.engine.arg_utils import EngineArgs
from novainfer.engine.output_processor import OutputProcessor
from novainfer.engine.request import Request, RequestStatus
from novainfer.executor.abstract import Executor
from novainfer.outputs import RequestOutput
from novainfer.sampling_params import SamplingParams
from novainfer.tokenizer import get_tokenizer
from novainfer.worker.model_runner import ModelRunnerOutput

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int] | Mapping[str, Any]


@dataclass
class EngineStats:
    """A snapshot for logs and metrics: gauges of now and totals since start."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_steps: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    finished_requests_total: Counter = field(default_factory=Counter)  # by finish reason
    step_time_total: float = 0.0  # seconds in step()
    model_time_total: float = 0.0  # seconds of that inside the executor (forward + sampling)
    # Steps and their seconds in step() by what they computed: "decode" (one new token per request),
    # "prefill" (prompt tokens only) or "mixed" (both).
    steps_by_kind: Counter = field(default_factory=Counter)
    step_time_by_kind: Counter = field(default_factory=Counter)


class LLMEngine:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None,
                 log_stats_interval: float = 5.0) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = get_tokenizer(self.model_config.tokenizer)
        self.eos_token_ids = self.model_config.generation_eos_token_ids()
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in self.eos_token_ids:
            self.eos_token_ids.append(self.tokenizer.eos_token_id)
        executor_class = executor_class or Executor.get_class(config)
        self.executor = executor_class(config)
        try:
            num_blocks = self.executor.determine_num_available_blocks()
            self.executor.initialize_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()  # its workers (threads or processes) would outlive the failure
            raise
        cache = config.cache_config
        self.kv_cache_manager = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        # The step left running by the last step() call (async scheduling), and outputs of a step
        # fetched outside step() (see add_request), which the next step() returns.
        self._in_flight: SchedulerOutput | None = None
        self._early_outputs: list[RequestOutput] = []
        self.log_stats_interval = log_stats_interval
        self._last_log = (time.monotonic(), 0, 0)
        logger.info("engine ready: model=%s dtype=%s device=%s kv_blocks=%d x %d tokens, max_model_len=%d",
                    self.model_config.model, self.model_config.torch_dtype, config.device, num_blocks,
                    cache.block_size, self.model_config.max_model_len)
        # What start-up built (modules, weights, the tokenizer, imported libraries: millions of objects)
        # lives as long as the engine. Frozen, it is left out of the cyclic collector's full passes,
        # which otherwise pause a run for hundreds of milliseconds.
        gc.collect()
        gc.freeze()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config(), log_stats_interval=args.log_stats_interval)

    def get_tokenizer(self):
        return self.tokenizer

    # ---- requests ----------------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, Sequence):
            return None, list(prompt)
        raise TypeError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        vocab = self.model_config.vocab_size
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        bad = next((t for t in prompt_token_ids
                    if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab}), got {bad!r}")
        max_len = self.model_config.max_model_len
        if len(prompt_token_ids) > max_len:
            raise ValueError(f"prompt is {len(prompt_token_ids)} tokens long, longer than "
                             f"max_model_len={max_len}")
        capacity = self.kv_cache_manager.num_blocks * self.kv_cache_manager.block_size
        if len(prompt_token_ids) > capacity:
            raise ValueError(f"prompt is {len(prompt_token_ids)} tokens long but the KV cache holds only "
                             f"{capacity} tokens")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queues a request. Bad input raises (naming the field) and leaves the engine unchanged."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if self.output_processor.has(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        self.validate_prompt(token_ids)
        max_tokens = params.max_tokens or self.model_config.max_model_len - len(token_ids)
        children = []
        for index in range(params.n):
            child_params = params.clone()
            child_params.n = 1
            if params.seed is not None:
                child_params.seed = params.seed + index  # distinct but reproducible siblings
            child_params.update_from_generation_config(self.eos_token_ids)
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            children.append(Request(child_id, token_ids, child_params, max_tokens, arrival_time, text))
        if self._in_flight is not None and any(c.request_id in self._in_flight.num_scheduled_tokens
                                               for c in children):
            # The id was just freed by a request whose last step is still running: fetch that
            # step first, so that its token cannot be taken for this request's.
            self._early_outputs += self._fetch_in_flight()
        self.output_processor.add_request(request_id, text, children)
        for child in children:
            self.scheduler.add_request(child)

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Aborts requests (by the ids given to add_request); returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for parent_id in request_ids:
            child_ids = self.output_processor.child_ids(parent_id)
            if not child_ids:
                continue
            for request in self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED):
                self.stats.finished_requests_total["abort"] += 1
            outputs.append(self.output_processor.make_output(parent_id))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the outputs of the requests that got tokens.

        With ``async_scheduling`` the step is left running and the call returns the tokens of the
        step before, which the host fetches and processes while the device runs this one.
        """
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and self._in_flight is None:
            return self._take_early_outputs()
        pipelined = self._can_pipeline(scheduler_output)
        model_started = time.perf_counter()
        runner_outputs = self.executor.execute_model(scheduler_output, pipelined)
        model_time = time.perf_counter() - model_started
        self._in_flight = scheduler_output if pipelined else None
        outputs, num_generated = self._process_outputs(runner_outputs)
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            self._fetch_in_flight()  # its requests are all finished; leave the workers idle
        self._record_step(scheduler_output, num_generated, time.perf_counter() - started, model_time)
        return self._take_early_outputs() + outputs

    def _can_pipeline(self, scheduler_output: SchedulerOutput) -> bool:
        return self.scheduler.config.async_scheduling and not scheduler_output.is_empty

    def _fetch_in_flight(self) -> list[RequestOutput]:
        """Waits for the step in flight and processes its tokens."""
        self._in_flight = None
        empty = SchedulerOutput([], [], {}, 0)
        return self._process_outputs(self.executor.execute_model(empty))[0]

    def _take_early_outputs(self) -> list[RequestOutput]:
        outputs, self._early_outputs = self._early_outputs, []
        return outputs

    def _process_outputs(self, runner_outputs: list[ModelRunnerOutput]) -> tuple[list[RequestOutput], int]:
        """Adds sampled tokens to their requests (oldest step first), applies stop conditions and
        detokenizes; returns the outputs of the parents that changed and the number of tokens."""
        touched: dict[str, None] = {}
        num_generated = 0
        for runner_output in runner_outputs:
            logprobs = dict(zip(runner_output.req_ids, runner_output.logprobs or ()))
            updated = self.scheduler.update_from_output(runner_output.req_ids, runner_output.sampled_token_ids)
            num_generated += len(updated)
            for request in updated:
                status = self.scheduler.check_stop(request)
                status = self.output_processor.process_token(request, status, logprobs.get(request.request_id))
                if status is not None:
                    self.scheduler.finish_requests(request.request_id, status)
                    self.stats.finished_requests_total[request.get_finished_reason()] += 1
                if self.output_processor.wants_output(request.request_id, status is not None):
                    touched[self.output_processor.parent_of(request.request_id)] = None
        return [self.output_processor.make_output(pid) for pid in touched], num_generated

    def _record_step(self, scheduler_output, num_generated: int, step_time: float, model_time: float) -> None:
        s = self.stats
        s.num_steps += 1
        num_decode = sum(1 for r in scheduler_output.scheduled_cached_reqs
                         if scheduler_output.num_scheduled_tokens[r.req_id] == 1)
        num_prefill = scheduler_output.total_num_scheduled_tokens - num_decode
        s.prompt_tokens_total += num_prefill
        s.generation_tokens_total += num_generated
        s.step_time_total += step_time
        s.model_time_total += model_time
        kind = "decode" if num_prefill == 0 else "prefill" if num_decode == 0 else "mixed"
        s.steps_by_kind[kind] += 1
        s.step_time_by_kind[kind] += step_time
        sched = self.scheduler.make_stats()
        s.num_running_reqs, s.num_waiting_reqs, s.kv_cache_usage = (sched.num_running_reqs, sched.num_waiting_reqs,
                                                                    sched.kv_cache_usage)
        s.num_preemptions_total = sched.num_preemptions
        s.prefix_cache_queries_total, s.prefix_cache_hits_total = sched.prefix_cache_queries, sched.prefix_cache_hits
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step %d: batch=%d prefill_tokens=%d decode_tokens=%d running=%d waiting=%d "
                         "kv_usage=%.1f%% step_ms=%.2f model_ms=%.2f", s.num_steps,
                         len(scheduler_output.num_scheduled_tokens), num_prefill, num_decode, s.num_running_reqs,
                         s.num_waiting_reqs, 100 * s.kv_cache_usage, 1e3 * step_time, 1e3 * model_time)
        now = time.monotonic()
        last_time, last_prompt, last_gen = self._last_log
        if now - last_time >= self.log_stats_interval:
            elapsed = now - last_time
            logger.info("throughput: prompt %.1f tok/s, generation %.1f tok/s; running=%d waiting=%d "
                        "kv_usage=%.1f%% preemptions=%d", (s.prompt_tokens_total - last_prompt) / elapsed,
                        (s.generation_tokens_total - last_gen) / elapsed, s.num_running_reqs,
                        s.num_waiting_reqs, 100 * s.kv_cache_usage, s.num_preemptions_total)
            self._last_log = (now, s.prompt_tokens_total, s.generation_tokens_total)

    def get_stats(self) -> EngineStats:
        sched = self.scheduler.make_stats()
        s = self.stats
        s.num_running_reqs, s.num_waiting_reqs, s.kv_cache_usage = (sched.num_running_reqs, sched.num_waiting_reqs,
                                                                    sched.kv_cache_usage)
        return s

    def shutdown(self) -> None:
        self.executor.shutdown()
        gc.unfreeze()  # the engine's cycles become collectable again
