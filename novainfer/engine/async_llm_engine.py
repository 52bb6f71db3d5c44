"""AsyncLLMEngine: the front-end of an engine core that runs its own loop, consumed from asyncio.

The core (scheduler, KV cache, model) runs in an engine-core process (the default: the server's
layout) or in a thread of this process (``multiprocess=False``: embedding, tests); either way it
is reached through :class:`~novainfer.engine.core_client.CoreClient`'s ZMQ sockets. Everything
else happens on the event loop: tokenization and validation (``InputProcessor``), detokenization,
stop strings and n>1 gathering (``OutputProcessor``). Adds and aborts made during one turn of the
event loop go to the core as one batch. The core's messages are read on the event loop itself,
when their socket turns readable: every step waiting is applied in one callback, which wakes each
request stream touched once. No thread of this process contends with the loop for the interpreter.

Adds are not sent before the turn ends, though a burst's turn admits hundreds of requests: a core
started on the first few would make their tokens while the loop is still admitting the rest, and
each of those streams would then wait the whole turn between two chunks (on a 500-request burst
with a stand-in core of 3.3 ms steps: TTFT mean 10% lower, ITL p99 twice as high).

If the core dies, every in-flight request fails with :class:`EngineDeadError`, new requests are
refused, and ``is_healthy`` turns false.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from novainfer.config import EngineConfig
from novainfer.core.messages import EngineCoreOutputs, EngineCoreRequest
from novainfer.engine.arg_utils import EngineArgs
from novainfer.engine.core import freeze_startup_objects
from novainfer.engine.core_client import CoreClient, CoreHandle, EngineDeadError
from novainfer.engine.core_proc import MIN_STEP_S_ENV, TEST_STALL_FILE_ENV
from novainfer.engine.llm_engine import EngineStats
from novainfer.engine.output_processor import OutputProcessor
from novainfer.engine.processor import InputProcessor, PromptType
from novainfer.outputs import RequestOutput
from novainfer.sampling_params import SamplingParams
from novainfer.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineLoad", "MIN_STEP_S_ENV", "RequestStream", "StreamGroup",
           "TEST_STALL_FILE_ENV"]

# How often the event loop looks whether the core still lives (a killed core sends nothing).
_LIVENESS_POLL_S = 0.1
# Adds go to the core at the end of the loop's turn, or once this many wait: a burst admitted in one
# turn (hundreds of requests) reaches the core in parts, and its first requests run while the API
# process still admits the others.
_ADDS_PER_MESSAGE = 32


@dataclass(frozen=True)
class EngineLoad:
    """What the engine has queued, for admission control."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_prompt_tokens: int = 0


class RequestStream:
    """The outputs of one request, in order, as an async iterator; ends after the final output.

    An output is built when the reader asks for it, not at every step: a reader that falls behind
    the engine (a busy event loop, a slow client) gets the tokens of several steps in one output,
    so serving cost per request follows the reader's pace instead of the engine's step rate.
    Several streams read together (a request's prompts) go through one :class:`StreamGroup`.

    Leaving the iteration early (``break``, cancellation, an exception in the consumer) aborts
    the request in the engine, so a vanished client never keeps generating.
    """

    def __init__(self, request_id: str, engine: AsyncLLMEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._ready = False  # the engine has something new for this request
        self._final: RequestOutput | BaseException | None = None  # handed over by an abort or a failure
        self._group: StreamGroup | None = None  # whose reader it wakes
        self._index = 0  # its place in the group
        self.finished = False

    def notify(self) -> None:
        """The engine has new outputs for this request (called on the event loop)."""
        if not self._ready:
            self._ready = True
            self._signal()

    def put_final(self, item: RequestOutput | BaseException) -> None:
        """Ends the stream with ``item`` (an aborted request's last output, or the error)."""
        self._final = item
        self._signal()

    def _signal(self) -> None:
        if self._group is not None:
            self._group.mark_ready(self._index)

    def has_news(self) -> bool:
        return self._ready or self._final is not None

    def take(self) -> RequestOutput | None:
        """What the reader gets now: the request's output since the last one, else the final item
        handed over (raised if it is an error); None if there is nothing."""
        output = self._engine.take_output(self.request_id) if self._ready else None
        self._ready = False
        if output is None:
            output, self._final = self._final, None
            if isinstance(output, BaseException):
                self.finished = True
                raise output
        if output is not None:
            self.finished = output.finished
        return output

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        async for batch in StreamGroup([self]).batches():
            for _, output in batch:
                yield output

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class StreamGroup:
    """Request streams read by one reader (a request's prompts, or a single stream).

    One waiter serves them all: the engine's step marks the streams it touched, and each wake-up of
    the reader yields, in one batch, what every marked stream has. So a reader costs one task
    resumption per step however many of its streams moved, and no task of its own per stream.
    Leaving the iteration early aborts every stream not finished.
    """

    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams = streams
        self._marked: list[int] = []  # streams with news, in the order they got it
        self._waiter: asyncio.Future[None] | None = None
        for index, stream in enumerate(streams):
            stream._group, stream._index = self, index
            if stream.has_news():  # came before the group existed
                self._marked.append(index)

    def mark_ready(self, index: int) -> None:
        self._marked.append(index)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def batches(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Lists of (index of the stream, output) as outputs arrive, until every stream finished;
        a stream's error is raised."""
        streams = self.streams
        try:
            # (A stream aborted meanwhile, e.g. by its request's clean-up, counts as finished.)
            while not all(stream.finished for stream in streams):
                if not self._marked:
                    self._waiter = asyncio.get_running_loop().create_future()
                    await self._waiter
                    self._waiter = None
                marked, self._marked = self._marked, []
                batch = []
                for index in (marked if len(marked) == 1 else dict.fromkeys(marked)):
                    stream = streams[index]
                    if stream.finished:
                        continue
                    output = stream.take()
                    if output is not None:
                        batch.append((index, output))
                if batch:
                    yield batch
        finally:
            for stream in streams:
                stream.abort()


class AsyncLLMEngine:
    """Serves an engine core to asyncio code; see the module docstring for the design. All methods
    but ``shutdown`` and the read-only properties are called from the event loop's thread."""

    def __init__(self, config: EngineConfig, name: str = "engine", log_stats_interval: float = 5.0,
                 multiprocess: bool = True, attached: CoreHandle | None = None) -> None:
        self.name = name
        self.model_config = config.model_config
        self.tokenizer = get_tokenizer(self.model_config.tokenizer)
        self.core = CoreClient(config, log_stats_interval, name, in_thread=not multiprocess, attached=attached)
        self.processor = InputProcessor(self.model_config, self.tokenizer, self.core.info.kv_capacity)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._liveness_timer: asyncio.TimerHandle | None = None
        self._pending_adds: list[EngineCoreRequest] = []
        self._pending_aborts: list[str] = []
        self._flush_scheduled = False
        self._dead_error: EngineDeadError | None = None
        self._stopped = False
        # When the core last reported a step (or got work while idle), for the stall watchdog.
        self._progress_time = time.monotonic()
        freeze_startup_objects()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, name: str = "engine", multiprocess: bool = True) -> AsyncLLMEngine:
        """Starts the engine core (loading the model) and waits until it is ready."""
        return cls(args.create_engine_config(), name=name, log_stats_interval=args.log_stats_interval,
                   multiprocess=multiprocess)

    @classmethod
    def attach(cls, core: CoreHandle, name: str = "engine") -> AsyncLLMEngine:
        """Serves a core started by another process (see ``CoreHandle``); waits until it is ready."""
        return cls(core.config, name=name, attached=core)

    @property
    def engine_core(self):
        """The EngineCore itself when it runs in this process (``multiprocess=False``), else None."""
        return self.core.engine_core

    # ---- lifecycle ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops the core (in-flight requests fail) and its workers."""
        if self._stopped:
            return
        self._stopped = True
        self._unbind_loop()
        self.core.shutdown()
        self._notify_dead(EngineDeadError(f"engine {self.name} is shut down"))

    @property
    def is_running(self) -> bool:
        return self._dead_error is None and self.core.is_alive()

    @property
    def is_healthy(self) -> bool:
        return self.is_running and not self._stopped

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead_error or self.core.dead_error

    def seconds_without_progress(self) -> float:
        """Seconds since the core last reported a step while it has work (0 when idle)."""
        if not self.output_processor.has_unfinished_requests():
            return 0.0
        return time.monotonic() - self._progress_time

    # ---- public API (event loop) ----------------------------------------------------------------
    def get_tokenizer(self):
        return self.tokenizer

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                          arrival_time: float | None = None, num_prompt_tokens: int = 0) -> RequestStream:
        """Queues a request; returns its output stream.

        Bad input raises here (ValueError/TypeError naming the field), before any output exists,
        so that a server can answer 400 instead of starting a stream.
        """
        self._raise_if_unavailable()
        self._bind_loop()
        if self.output_processor.has(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids, params, children = self.processor.process(request_id, prompt, params, arrival_time)
        if not self.output_processor.has_unfinished_requests():
            self._progress_time = time.monotonic()  # the watchdog counts from here
        self.output_processor.add_request(request_id, text, token_ids, params.output_kind, children)
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        self._pending_adds += children
        if len(self._pending_adds) >= _ADDS_PER_MESSAGE:
            self._send_pending()
        else:
            self._schedule_flush()
        return stream

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None, arrival_time: float | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """vLLM's ``generate``: yields the request's outputs until it finishes."""
        request_id = request_id or uuid.uuid4().hex
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        async for output in stream:
            yield output

    def abort(self, request_id: str) -> None:
        """Aborts a request (no-op if unknown or finished); the core frees its KV blocks."""
        if self._dead_error is not None or self._stopped:
            return
        core_ids = self.output_processor.abort(request_id, time.time())
        output = self.output_processor.make_output(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and output is not None:
            stream.put_final(output)
        if core_ids:
            self._pending_aborts += core_ids
            self._schedule_flush()

    def get_stats(self) -> EngineStats:
        """The core's stats of its latest step, with the front-end's finish counts."""
        return EngineStats.from_core(self.core.stats, self.output_processor.finished_requests_total)

    def get_load(self) -> EngineLoad:
        """Sequences running and waiting (not yet given a token), as the front-end sees them."""
        load = self.output_processor.load
        return EngineLoad(load.num_running, load.num_waiting, load.num_waiting_prompt_tokens)

    def _raise_if_unavailable(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self._stopped:
            raise EngineDeadError(f"engine {self.name} is shut down")

    # ---- to the core ----------------------------------------------------------------------------
    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None and self._loop.is_running():
            raise RuntimeError(f"engine {self.name} is already served by another event loop")
        self._unbind_loop()
        self._loop = loop
        loop.add_reader(self.core.output_fd, self._receive)
        self._liveness_timer = loop.call_later(_LIVENESS_POLL_S, self._check_alive)
        self._receive()  # what came while no loop listened: the descriptor will not signal it again

    def _unbind_loop(self) -> None:
        """Stops reading on the bound loop; from another thread while it runs, waits for it to."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if loop.is_running() and _running_loop() is not loop:
            done = threading.Event()

            def unbind() -> None:
                self._stop_reading(loop)
                done.set()

            self._call_soon(unbind)
            done.wait(1.0)
            return
        self._stop_reading(loop)

    def _stop_reading(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._liveness_timer is not None:
            self._liveness_timer.cancel()
        loop.remove_reader(self.core.output_fd)

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        self._send_pending()

    def _send_pending(self) -> None:
        """Sends the adds queued so far, then the aborts, each as one message."""
        adds, self._pending_adds = self._pending_adds, []
        aborts, self._pending_aborts = self._pending_aborts, []
        try:
            if adds:
                self.core.add_requests(adds)
            if aborts:
                self.core.abort_requests(aborts)
        except EngineDeadError as exc:
            self._on_dead(exc)

    # ---- from the core --------------------------------------------------------------------------
    def _receive(self) -> None:
        """Applies every message waiting from the core (the loop calls it when they come)."""
        if self._stopped or self._dead_error is not None:
            return
        batch = []
        try:
            while (outputs := self.core.get_output(0)) is not None:
                batch.append(outputs)
        except EngineDeadError as exc:
            self._on_outputs(batch)
            self._on_dead(exc)
            return
        if batch:
            self._on_outputs(batch)

    def _call_soon(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _check_alive(self) -> None:
        self._receive()  # a core that failed said why before it exited
        if self._stopped or self._dead_error is not None:
            return
        try:
            self.core.check_alive()
        except EngineDeadError as exc:
            self._on_dead(exc)
            return
        self._liveness_timer = self._loop.call_later(_LIVENESS_POLL_S, self._check_alive)

    def _on_outputs(self, batch: list[EngineCoreOutputs]) -> None:
        self._progress_time = time.monotonic()
        for core_outputs in batch:
            touched, to_abort = self.output_processor.apply_outputs(core_outputs)
            if to_abort:  # stop strings: the core stops generating them
                self._pending_aborts += to_abort
                self._schedule_flush()
            for request_id in touched:
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.notify()

    def take_output(self, request_id: str) -> RequestOutput | None:
        """The request's output since its stream last took one (None if there is none: it was
        aborted or failed); called by :class:`RequestStream` when its reader asks."""
        output = self.output_processor.make_output(request_id)
        if output is not None and output.finished:
            self._streams.pop(request_id, None)
        return output

    def _on_dead(self, error: EngineDeadError) -> None:
        if self._dead_error is None:
            self._dead_error = error
        self._notify_dead(self._dead_error)

    def _notify_dead(self, error: EngineDeadError) -> None:
        """Fails every in-flight request (on the loop, if there is one)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            if _running_loop() is not loop:
                self._call_soon(self._fail_streams, error)
                return
        self._fail_streams(error)

    def _fail_streams(self, error: EngineDeadError) -> None:
        streams, self._streams = self._streams, {}
        self.output_processor.fail_all()
        for stream in streams.values():
            stream.put_final(error)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
