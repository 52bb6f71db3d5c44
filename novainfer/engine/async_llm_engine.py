"""AsyncLLMEngine: an LLMEngine driven by one background thread, consumed from asyncio.

The engine is not thread-safe, so exactly one thread (the *engine thread*) ever touches it. The
event loop talks to that thread through a command queue (add, abort, stop) that the thread drains
between steps; results travel back through one ``asyncio.Queue`` per request, fed with
``loop.call_soon_threadsafe``. A model step therefore never runs on, nor blocks, the event loop.

If a step raises, the engine is *dead*: every in-flight request fails with
:class:`EngineDeadError`, new requests are refused, and ``is_healthy`` turns false.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from novainfer.engine.arg_utils import EngineArgs
from novainfer.engine.llm_engine import EngineStats, LLMEngine, PromptType
from novainfer.outputs import RequestOutput
from novainfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long the idle engine thread sleeps on its command queue before checking again.
_IDLE_POLL_S = 0.5
# How long it waits when requests exist but nothing could be scheduled (e.g. KV cache full).
_STALL_POLL_S = 0.002
# Test-only hooks, read from the environment when the engine starts; never set them otherwise.
# The least time a step takes (the thread sleeps out the rest), so that a browser test can act
# while an answer is still streaming however fast the machine is:
MIN_STEP_S_ENV = "NOVAINFER_TEST_MIN_STEP_S"
# While the file named here exists, the engine thread waits before each step, as a hung device
# would, so that tests can watch the watchdog notice:
TEST_STALL_FILE_ENV = "NOVAINFER_TEST_STALL_FILE"


class EngineDeadError(RuntimeError):
    """The engine loop crashed (or was shut down); no request can be served by it any more."""


@dataclass(frozen=True)
class EngineLoad:
    """What the engine has queued, for admission control: pending adds count as waiting."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_prompt_tokens: int = 0


# ---- commands from the event loop to the engine thread -------------------------------------------
@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    arrival_time: float | None
    stream: RequestStream
    future: asyncio.Future
    num_prompt_tokens: int  # as counted by the caller, for the pending-load bookkeeping
    num_seqs: int


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stop:
    pass


def _resolve(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Completes ``future`` on its own loop (call through ``call_soon_threadsafe``)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class RequestStream:
    """The outputs of one request, in order, as an async iterator; ends after the final output.

    Leaving the iteration early (``break``, cancellation, an exception in the consumer) aborts
    the request in the engine, so a vanished client never keeps generating.
    """

    def __init__(self, request_id: str, engine: AsyncLLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    # Called from the engine thread.
    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                if item.finished:
                    self.finished = True
                yield item
        finally:
            if not self.finished:
                self.finished = True
                self._engine.abort(self.request_id)

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncLLMEngine:
    """Serves an :class:`LLMEngine` to asyncio code; see the module docstring for the design."""

    def __init__(self, engine: LLMEngine, name: str = "engine", start: bool = True) -> None:
        self.engine = engine
        self.name = name
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._lock = threading.Lock()  # guards the fields below
        self._dead_error: EngineDeadError | None = None
        self._stopped = False
        self._pending_adds = 0
        self._pending_tokens = 0
        self._load = EngineLoad()
        self._stats = copy.deepcopy(engine.get_stats())
        self._thread: threading.Thread | None = None
        # Progress, written by the engine thread only: whether it has work, and when it last
        # finished a step (or got work while idle).
        self._busy = False
        self._progress_time = time.monotonic()
        self._stall_file = os.environ.get(TEST_STALL_FILE_ENV)
        self._min_step_s = float(os.environ.get(MIN_STEP_S_ENV) or 0.0)
        if start:
            self.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, name: str = "engine", start: bool = True) -> AsyncLLMEngine:
        """Builds (loads) the engine in the calling thread, then starts its loop."""
        return cls(LLMEngine.from_engine_args(args), name=name, start=start)

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"novainfer-engine-{self.name}", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the loop (in-flight requests fail) and releases the executor."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._commands.put(_Stop())
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        try:
            self.engine.shutdown()
        except Exception:  # shutting down must not raise
            logger.exception("engine %s: executor shutdown failed", self.name)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead_error is None

    @property
    def is_healthy(self) -> bool:
        return self.is_running and not self._stopped

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead_error

    def seconds_without_progress(self) -> float:
        """Seconds since the engine last finished a step while it has work (0 when idle)."""
        return time.monotonic() - self._progress_time if self._busy else 0.0

    # ---- public API (event loop) ----------------------------------------------------------------
    def get_tokenizer(self):
        return self.engine.get_tokenizer()

    @property
    def model_config(self):
        return self.engine.model_config

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                          arrival_time: float | None = None, num_prompt_tokens: int = 0) -> RequestStream:
        """Queues a request; returns its output stream once the engine accepted it.

        Bad input raises here (ValueError/TypeError from the engine's validation), before any
        output exists, so that a server can answer 400 instead of starting a stream.
        """
        params = params if params is not None else SamplingParams()
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self, loop)
        future = loop.create_future()
        num_seqs = getattr(params, "n", 1) if isinstance(params, SamplingParams) else 1
        command = _Add(request_id, prompt, params, arrival_time, stream, future, num_prompt_tokens, num_seqs)
        with self._lock:
            self._raise_if_unavailable()
            self._pending_adds += num_seqs
            self._pending_tokens += num_prompt_tokens
            self._commands.put(command)
        try:
            await future
        except asyncio.CancelledError:
            # The caller went away while the engine was adding: make sure nothing keeps running.
            self.abort(request_id)
            raise
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
        """Aborts a request (no-op if unknown or finished); its KV blocks are freed by the loop."""
        with self._lock:
            if self._dead_error is not None or self._stopped:
                return
            self._commands.put(_Abort(request_id))

    def get_stats(self) -> EngineStats:
        """A snapshot of the engine's stats, refreshed by the engine thread after every step."""
        with self._lock:
            return self._stats

    def get_load(self) -> EngineLoad:
        """Running and waiting requests now, counting adds not yet seen by the engine thread."""
        with self._lock:
            load = self._load
            return dataclasses.replace(load, num_waiting=load.num_waiting + self._pending_adds,
                                       num_waiting_prompt_tokens=load.num_waiting_prompt_tokens
                                       + self._pending_tokens)

    def _raise_if_unavailable(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        if self._stopped:
            raise EngineDeadError(f"engine {self.name} is shut down")

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        logger.debug("engine %s: loop started", self.name)
        try:
            while True:
                if not self._process_commands(block=not self.engine.has_unfinished_requests()):
                    break
                self._publish()  # gauges see added and aborted requests before a long step
                if not self.engine.has_unfinished_requests():
                    self._busy = False
                    continue
                if not self._busy:
                    self._progress_time, self._busy = time.monotonic(), True
                self._wait_while_test_stalled()
                steps_before = self.engine.stats.num_steps
                started = time.monotonic()
                outputs = self.engine.step()
                if self._min_step_s:
                    time.sleep(max(0.0, started + self._min_step_s - time.monotonic()))
                if self.engine.stats.num_steps != steps_before:
                    self._progress_time = time.monotonic()
                self._publish()  # before dispatching: whoever sees an output sees the stats of its step
                self._dispatch(outputs)
                if self.engine.stats.num_steps == steps_before:
                    # Nothing could be scheduled (e.g. the KV cache is full): wait a little, not spin.
                    if not self._process_commands(block=True, timeout=_STALL_POLL_S):
                        break
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine, never silently
            logger.exception("engine %s: loop died", self.name)
            self._die(exc)
            return
        self._die(None)
        logger.debug("engine %s: loop stopped", self.name)

    def _wait_while_test_stalled(self) -> None:
        while self._stall_file is not None and os.path.exists(self._stall_file) and not self._stopped:
            time.sleep(0.05)

    def _process_commands(self, block: bool, timeout: float = _IDLE_POLL_S) -> bool:
        """Runs queued commands (waiting for one when ``block``); False once asked to stop."""
        try:
            command = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Add):
                self._do_add(command)
            elif isinstance(command, _Abort):
                self._do_abort(command.request_id)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _do_add(self, command: _Add) -> None:
        loop = command.future.get_loop()
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params, command.arrival_time)
        except Exception as exc:  # validation errors belong to the caller, not to the engine
            error = exc
        else:
            error = None
            self._streams[command.request_id] = command.stream
        with self._lock:
            # Move the request from "pending" to "waiting in the engine" in one go, so that admission
            # control never sees it in neither (the exact figures are recomputed after the next step).
            self._pending_adds -= command.num_seqs
            self._pending_tokens -= command.num_prompt_tokens
            if error is None:
                load = self._load
                self._load = EngineLoad(load.num_running, load.num_waiting + command.num_seqs,
                                        load.num_waiting_prompt_tokens + command.num_prompt_tokens)
        try:
            loop.call_soon_threadsafe(_resolve, command.future, None, error)
        except RuntimeError:  # loop closed: the caller is gone
            if error is None:
                self._do_abort(command.request_id)

    def _do_abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        outputs = self.engine.abort_request(request_id)
        if stream is not None:
            for output in outputs:
                stream.put_threadsafe(output)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.put_threadsafe(output)

    def _publish(self) -> None:
        """Copies stats and queue load where the event loop can read them."""
        stats = copy.copy(self.engine.get_stats())
        stats.finished_requests_total = copy.copy(stats.finished_requests_total)
        waiting = self.engine.scheduler.waiting
        waiting_tokens = sum(r.num_tokens - r.num_computed_tokens for r in waiting) if waiting else 0
        load = EngineLoad(stats.num_running_reqs, len(waiting), waiting_tokens)
        with self._lock:
            self._stats = stats
            self._load = load

    def _die(self, exc: BaseException | None) -> None:
        """Fails every in-flight and queued request; marks the engine dead."""
        if exc is None:
            error = EngineDeadError(f"engine {self.name} is shut down")
        else:
            error = EngineDeadError(f"engine {self.name} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        with self._lock:
            if self._dead_error is None:
                self._dead_error = error
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            self._pending_adds = self._pending_tokens = 0
        for command in pending:
            if isinstance(command, _Add):
                try:
                    command.future.get_loop().call_soon_threadsafe(_resolve, command.future, None, error)
                except RuntimeError:
                    pass
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put_threadsafe(error)
