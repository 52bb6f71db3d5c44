"""EngineCore: the scheduler, the KV cache manager and the executor behind a message boundary.

It takes :class:`EngineCoreRequest` s and aborts, and returns one :class:`EngineCoreOutputs` per
step. It knows nothing of text, ``n`` > 1 or RequestOutputs (that is the front-end's, see
``llm_engine``): the same object runs inside the caller's process or in an engine-core process of
its own (``core_proc``).

Async scheduling (pipelining) is owned here: a step may be left running on the device while the
next one is scheduled, and the steps in flight form a queue whose tokens later calls collect,
oldest first.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from collections.abc import Iterable

import msgspec

from novainfer.config import EngineConfig
from novainfer.core.kv_cache_manager import KVCacheManager
from novainfer.core.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineCoreStats
from novainfer.core.sched.output import DEVICE_DRAFT_TOKEN, CachedRequestData, SchedulerOutput
from novainfer.core.sched.request import Request, RequestStatus
from novainfer.core.sched.scheduler import Scheduler, SchedulerStats
from novainfer.executor.abstract import Executor
from novainfer.outputs import join_rows
from novainfer.spec_decode.ngram_proposer import NgramProposer
from novainfer.worker.model_runner import ModelRunnerOutput

logger = logging.getLogger(__name__)


def freeze_startup_objects() -> None:
    """Leaves what start-up built out of the cyclic collector's full passes.

    Modules, weights, the tokenizer and imported libraries (millions of objects) live as long as the
    engine; left in the collector's care, every full pass walks them all and pauses a run for hundreds
    of milliseconds. ``gc.unfreeze()`` hands them back.
    """
    gc.collect()
    gc.freeze()


class EngineCoreInfo(msgspec.Struct, array_like=True):
    """What the front-end needs to know of a started core to validate requests."""

    num_blocks: int
    block_size: int

    @property
    def kv_capacity(self) -> int:
        return self.num_blocks * self.block_size


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None,
                 log_stats_interval: float = 5.0) -> None:
        self.config = config
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
        self.info = EngineCoreInfo(num_blocks, cache.block_size)
        self.stats = EngineCoreStats()
        # The steps left running on the device, oldest first (async scheduling), and outputs of
        # steps collected outside step() (see add_requests), which the next step() returns.
        self._in_flight: deque[SchedulerOutput] = deque()
        self._early_outputs: list[EngineCoreOutput] = []
        spec = config.speculative_config  # n-gram drafts keep each request's tokens between steps
        self._ngram_proposer = NgramProposer(spec) if spec is not None and spec.method == "ngram" else None
        self.log_stats_interval = log_stats_interval
        # When the last throughput line was logged, and the totals then.
        self._last_log = (time.monotonic(), 0, 0, self.scheduler.make_stats())
        model_config = config.model_config
        logger.info("engine ready: model=%s dtype=%s device=%s kv_blocks=%d x %d tokens, max_model_len=%d",
                    model_config.model, model_config.torch_dtype, config.device, num_blocks, cache.block_size,
                    model_config.max_model_len)

    # ---- requests ----------------------------------------------------------------------------
    def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        requests = list(requests)
        for r in requests:
            if r.request_id in self.scheduler.requests:
                raise ValueError(f"request_id {r.request_id!r} is already in use")
        if any(r.request_id in so.num_scheduled_tokens for so in self._in_flight for r in requests):
            # The id was just freed by a request whose last step is still running: collect that
            # step first, so that its token cannot be taken for this request's.
            self._early_outputs += self._collect_in_flight()
        for r in requests:
            self.scheduler.add_request(Request(r.request_id, r.prompt_token_ids, r.sampling_params, r.max_tokens,
                                               r.arrival_time))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Ends requests (unknown or finished ids are ignored) and frees their KV blocks."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block; False (and nothing done) while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def has_work(self) -> bool:
        """Whether step() would do anything: requests to run, or tokens of steps to collect."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight) or bool(self._early_outputs)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Schedules and runs one step; returns the tokens it produced (one output per request).

        With ``async_scheduling`` the step is left running and the call returns the tokens of the
        step before, which the host collects while the device runs this one.
        """
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not self._in_flight:
            return self._outputs(self._take_early_outputs())
        pipelined = self._can_pipeline(scheduler_output)
        model_started = time.perf_counter()
        runner_outputs = self.executor.execute_model(scheduler_output, pipelined)
        model_time = time.perf_counter() - model_started
        self._in_flight.clear()  # the call returned the tokens of every step that was in flight
        if pipelined:
            self._in_flight.append(scheduler_output)
        outputs = self._update_from_runner(runner_outputs)
        if self.config.speculative_config is not None:
            self._propose_drafts(runner_outputs)
        if self._in_flight and not self.scheduler.has_unfinished_requests():
            outputs += self._collect_in_flight()  # its requests are all finished; leave the workers idle
        self._record_step(scheduler_output, time.perf_counter() - started, model_time)
        return self._outputs(_merge(self._take_early_outputs() + outputs))

    def _can_pipeline(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether the step may be left running while the next is scheduled. With speculation only
        a step without drafts: a verification's accepted count decides the next step's positions.
        The n-gram drafts of the step after a step left running are looked up one token early
        (see :meth:`_propose_drafts`); a draft model proposes from each step's tokens, so with one
        only steps while more requests run than ``disable_by_batch_size`` (nothing is proposed)."""
        if not self.scheduler.config.async_scheduling or scheduler_output.is_empty:
            return False
        spec = self.config.speculative_config
        if spec is not None and spec.method == "draft_model" and (
                spec.disable_by_batch_size is None or len(self.scheduler.running) <= spec.disable_by_batch_size):
            return False
        return not scheduler_output.scheduled_spec_decode_tokens

    def _update_from_runner(self, runner_outputs) -> list[EngineCoreOutput]:
        """Applies the tokens of the steps the executor finished, oldest first, and counts them (here:
        a step collected early, in ``add_requests``, is generated too)."""
        outputs = []
        for runner_output in runner_outputs:
            outputs += self.scheduler.update_from_output(runner_output.req_ids, runner_output.sampled_token_ids,
                                                         runner_output.logprobs, runner_output.logprobs_rows,
                                                         runner_output.num_verified_drafts)
        self.stats.generation_tokens_total += sum(len(output.new_token_ids) for output in outputs)
        return outputs

    def _propose_drafts(self, runner_outputs: list[ModelRunnerOutput]) -> None:
        """Speculative decoding: drafts for the next step of every running request that decodes,
        from one batched n-gram lookup over their tokens, or those the draft model proposed in the
        step just run. A request gets at most as many drafts as it may still emit tokens after
        the next one (``max_tokens``, the context limit), so that no accepted token lies past its
        end.

        A request whose newest token a step left running is still sampling gets the drafts that
        follow the lookup's guess of that token: if the guess is wrong, the verification rejects
        them (it checks every draft against the target), so steps without drafts are never held
        back to wait for their tokens."""
        spec = self.config.speculative_config
        sched = self.scheduler
        for request in sched.running:
            request.spec_token_ids = []
        if spec.disable_by_batch_size is not None and len(sched.running) > spec.disable_by_batch_size:
            return
        decoding = [r for r in sched.running if r.num_computed_tokens == r.num_tokens_with_placeholders - 1]
        if not decoding:
            return
        if spec.method == "ngram":
            proposals = self._ngram_proposer.propose([r.request_id for r in decoding],
                                                     [r.all_token_ids for r in decoding],
                                                     [r.num_output_placeholders for r in decoding])
        else:
            # Their values stay on the device, where the step that verifies them reads them.
            by_id = {rid: count for output in runner_outputs if output.num_draft_tokens is not None
                     for rid, count in zip(output.req_ids, output.num_draft_tokens)}
            proposals = [[DEVICE_DRAFT_TOKEN] * by_id.get(r.request_id, 0) for r in decoding]
        for request, drafts in zip(decoding, proposals):
            in_flight = request.num_output_placeholders
            room = request.max_num_tokens - request.num_tokens - in_flight - 1
            request.spec_token_ids = drafts[:max(room, 0)]

    def _collect_in_flight(self) -> list[EngineCoreOutput]:
        """Waits for the steps in flight and applies their tokens."""
        self._in_flight.clear()
        return self._update_from_runner(self.executor.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0)))

    def _take_early_outputs(self) -> list[EngineCoreOutput]:
        outputs, self._early_outputs = self._early_outputs, []
        return outputs

    def _outputs(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        return EngineCoreOutputs.from_outputs(outputs, self.make_stats(), time.time())

    def make_stats(self) -> EngineCoreStats:
        """A snapshot of the stats (the core keeps updating its own)."""
        s = self.stats
        sched = self.scheduler.make_stats()
        s.num_running_reqs, s.num_waiting_reqs, s.kv_cache_usage = (sched.num_running_reqs, sched.num_waiting_reqs,
                                                                    sched.kv_cache_usage)
        s.num_preemptions_total = sched.num_preemptions
        s.prefix_cache_queries_total, s.prefix_cache_hits_total = sched.prefix_cache_queries, sched.prefix_cache_hits
        s.spec_decode_num_drafts_total = sched.spec_decode_num_drafts
        s.spec_decode_num_draft_tokens_total = sched.spec_decode_num_draft_tokens
        s.spec_decode_num_accepted_tokens_total = sched.spec_decode_num_accepted_tokens
        per_pos = sched.spec_decode_num_accepted_tokens_per_pos
        spec = self.config.speculative_config
        if spec is not None:  # every position that can be drafted, accepted or not
            per_pos += [0] * (spec.num_speculative_tokens - len(per_pos))
        s.spec_decode_num_accepted_tokens_per_pos_total = per_pos
        return msgspec.structs.replace(s, steps_by_kind=dict(s.steps_by_kind),
                                       step_time_by_kind=dict(s.step_time_by_kind))

    def _record_step(self, scheduler_output: SchedulerOutput, step_time: float, model_time: float) -> None:
        s = self.stats
        s.num_steps += 1
        num_decode = _num_decode_tokens(scheduler_output)
        num_prefill = scheduler_output.total_num_scheduled_tokens - num_decode
        s.prompt_tokens_total += num_prefill
        s.step_time_total += step_time
        s.model_time_total += model_time
        kind = "decode" if num_prefill == 0 else "prefill" if num_decode == 0 else "mixed"
        s.steps_by_kind[kind] = s.steps_by_kind.get(kind, 0) + 1
        s.step_time_by_kind[kind] = s.step_time_by_kind.get(kind, 0.0) + step_time
        if logger.isEnabledFor(logging.DEBUG):
            sched = self.scheduler
            logger.debug("step %d: batch=%d prefill_tokens=%d decode_tokens=%d running=%d waiting=%d "
                         "kv_usage=%.1f%% step_ms=%.2f model_ms=%.2f", s.num_steps,
                         len(scheduler_output.num_scheduled_tokens), num_prefill, num_decode, len(sched.running),
                         len(sched.waiting), 100 * self.kv_cache_manager.usage, 1e3 * step_time, 1e3 * model_time)
        now = time.monotonic()
        last_time, last_prompt, last_gen, last_sched = self._last_log
        if now - last_time >= self.log_stats_interval:
            elapsed = now - last_time
            sched = self.scheduler.make_stats()
            logger.info("throughput: prompt %.1f tok/s, generation %.1f tok/s; running=%d waiting=%d "
                        "kv_usage=%.1f%% preemptions=%d", (s.prompt_tokens_total - last_prompt) / elapsed,
                        (s.generation_tokens_total - last_gen) / elapsed, sched.num_running_reqs,
                        sched.num_waiting_reqs, 100 * sched.kv_cache_usage, sched.num_preemptions)
            if self.config.speculative_config is not None:
                _log_spec_decode(sched, last_sched)
            self._last_log = (now, s.prompt_tokens_total, s.generation_tokens_total, sched)

    def shutdown(self) -> None:
        self.executor.shutdown()


def _num_decode_tokens(scheduler_output: SchedulerOutput) -> int:
    """The step's tokens of decodes: those of the requests the workers hold that it schedules for their
    last token, and a speculative decode's drafts."""
    num_scheduled = scheduler_output.num_scheduled_tokens
    req_ids = scheduler_output.scheduled_cached_reqs.req_ids
    # Decodes without drafts: one token each, counted in C (every request of every step is here).
    num_decode = list(map(num_scheduled.__getitem__, req_ids)).count(1)
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    if spec_tokens:  # a request with drafts is scheduled for more than one token: not counted yet
        cached = set(req_ids)
        num_decode += sum(num_scheduled[rid] for rid, drafts in spec_tokens.items()
                          if rid in cached and num_scheduled[rid] == 1 + len(drafts))
    return num_decode


def _log_spec_decode(now: SchedulerStats, before: SchedulerStats) -> None:
    """Speculative decoding since the last line: acceptance rate (accepted / drafted tokens), mean
    accepted length (tokens a request got per step with drafts: its accepted drafts and one more)
    and the acceptance rate at each draft position."""
    drafts = now.spec_decode_num_drafts - before.spec_decode_num_drafts
    if drafts == 0:
        return
    draft_tokens = now.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = now.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    earlier = before.spec_decode_num_accepted_tokens_per_pos
    per_pos = [(n - (earlier[i] if i < len(earlier) else 0)) / drafts
               for i, n in enumerate(now.spec_decode_num_accepted_tokens_per_pos)]
    logger.info("speculative decoding: acceptance rate %.1f%%, mean accepted length %.2f; drafts=%d "
                "draft_tokens=%d accepted_tokens=%d; per-position acceptance rate [%s]", 100 * accepted / draft_tokens,
                1 + accepted / drafts, drafts, draft_tokens, accepted, ", ".join(f"{r:.2f}" for r in per_pos))


def _merge(outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """One output per request: a request that got tokens from two steps (one collected from flight,
    one just run) gets them in one output, oldest first."""
    # Nearly every step has one output per request already: a set of their ids tells so at a third
    # of the cost of the merge's loop.
    if len(outputs) < 2 or len({output.request_id for output in outputs}) == len(outputs):
        return outputs
    merged: dict[str, EngineCoreOutput] = {}
    for output in outputs:
        first = merged.get(output.request_id)
        if first is None:
            merged[output.request_id] = output
            continue
        if first.new_logprobs is not None and output.new_logprobs is not None:
            joined = join_rows((*first.new_logprobs, len(first.new_token_ids)),
                               (*output.new_logprobs, len(output.new_token_ids)))
            first.new_logprobs = (joined, 0)
        first.new_token_ids += output.new_token_ids
        first.finish_reason, first.stop_reason = output.finish_reason, output.stop_reason
    return list(merged.values())
