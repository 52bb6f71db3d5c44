"""LLMEngine: requests in, RequestOutputs out, one scheduling step at a time.

It is the front-end (tokenization, validation, n>1 fan-out, detokenization, stop strings,
RequestOutputs) joined to an engine core (scheduler, KV cache manager, executor) by messages
(``novainfer.core.messages``). The core runs in this process (:class:`EngineCore`) or, with
``multiprocess``, in an engine-core process of its own (:class:`SyncMPClient`), which then
generates while the caller does its own work between steps; the front-end's work
(detokenization, logprobs, outputs) then runs beside the core's steps instead of between them.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections import Counter
from collections.abc import Iterator, Sequence

import msgspec

from novainfer.config import EngineConfig
from novainfer.core.messages import EngineCoreOutputs, EngineCoreStats
from novainfer.engine.arg_utils import EngineArgs
from novainfer.engine.core import EngineCore, freeze_startup_objects
from novainfer.engine.output_processor import OutputProcessor
from novainfer.engine.processor import InputProcessor, PromptType
from novainfer.executor.abstract import Executor
from novainfer.outputs import RequestOutput
from novainfer.sampling_params import SamplingParams
from novainfer.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["EngineStats", "LLMEngine", "PromptType"]


class EngineStats(EngineCoreStats):
    """A snapshot for logs and metrics: the core's gauges and totals, plus the finished sequences the
    front-end counted (by finish reason); the step-kind tables are Counters."""

    finished_requests_total: dict[str, int] = {}

    @classmethod
    def from_core(cls, core: EngineCoreStats, finished_requests_total: Counter) -> EngineStats:
        fields = msgspec.structs.asdict(core)
        fields["steps_by_kind"] = Counter(core.steps_by_kind)
        fields["step_time_by_kind"] = Counter(core.step_time_by_kind)
        return cls(**fields, finished_requests_total=Counter(finished_requests_total))


class LLMEngine:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None,
                 log_stats_interval: float = 5.0, multiprocess: bool = False) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = get_tokenizer(self.model_config.tokenizer)
        self.multiprocess = multiprocess
        if multiprocess:
            from novainfer.engine.core_client import SyncMPClient

            if executor_class is not None:
                raise ValueError("executor_class cannot be given with multiprocess=True (the engine-core process "
                                 "picks its executor from the configuration)")
            self.engine_core = SyncMPClient(config, log_stats_interval)
        else:
            self.engine_core = EngineCore(config, executor_class, log_stats_interval)
        self.processor = InputProcessor(self.model_config, self.tokenizer, self.engine_core.info.kv_capacity)
        self.output_processor = OutputProcessor(self.tokenizer)
        freeze_startup_objects()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, multiprocess: bool = False) -> LLMEngine:
        return cls(args.create_engine_config(), log_stats_interval=args.log_stats_interval,
                   multiprocess=multiprocess)

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        return self.processor.eos_token_ids

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queues a request. Bad input raises (naming the field) and leaves the engine unchanged."""
        if self.output_processor.has(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids, params, children = self.processor.process(request_id, prompt, params, arrival_time)
        self.engine_core.add_requests(children)
        self.output_processor.add_request(request_id, text, token_ids, params.output_kind, children)

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Aborts requests (by the ids given to add_request); returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs, core_ids = [], []
        now = time.time()
        for parent_id in request_ids:
            core_ids += self.output_processor.abort(parent_id, now)
            output = self.output_processor.make_output(parent_id)
            if output is not None:
                outputs.append(output)
        if core_ids:
            self.engine_core.abort_requests(core_ids)
        return outputs

    @contextlib.contextmanager
    def final_texts_batched(self) -> Iterator[None]:
        """Within the block, final outputs (RequestOutputKind.FINAL_ONLY) without stop strings come
        back with their text empty; when it ends, their texts are decoded in a few batched calls
        and filled in (see OutputProcessor.batch_final_texts). For callers that hand outputs on only
        once every request finished, as ``LLM.generate`` does."""
        self.output_processor.batch_final_texts()
        try:
            yield
        finally:
            self.output_processor.decode_final_texts()

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one step of the core; returns the outputs of the requests that got tokens.

        With ``async_scheduling`` the core leaves each step running and returns the tokens of the
        step before. With ``multiprocess`` the core steps on its own; this returns its next step's.
        """
        return self.process_core_outputs(self.engine_core.step())

    def process_core_outputs(self, core_outputs: EngineCoreOutputs) -> list[RequestOutput]:
        outputs, to_abort = self.output_processor.process_outputs(core_outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)  # stop strings: the core stops generating them
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block; False (and nothing done) while requests hold blocks."""
        return self.engine_core.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        return EngineStats.from_core(self.engine_core.make_stats(), self.output_processor.finished_requests_total)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
        gc.unfreeze()  # the engine's cycles become collectable again
