"""The engine core's busy loop behind ZMQ sockets, in a process of its own (``novainfer serve``,
``LLM(..., multiprocess=True)``) or in a thread of the caller (embedding, tests).

The loop drains the input socket (batches of adds and aborts) between steps, runs a step whenever
the core has work, and sends each step's outputs as one message. It stops on :class:`Shutdown`,
on SIGTERM (process only), or when a step raises: then it sends :class:`CoreFailed` first, so the
front-end fails its requests with the cause instead of waiting.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback

import zmq

from novainfer.config import EngineConfig
from novainfer.core.messages import EngineCoreOutputs
from novainfer.engine.core import EngineCore, freeze_startup_objects
from novainfer.engine.serial import AbortRequests, AddRequests, CoreFailed, CoreReady, InputDecoder, \
    PrefixCacheReset, ResetPrefixCache, Shutdown, StepOutputs, core_message_encoder

logger = logging.getLogger(__name__)

# How long the idle loop waits on its input socket before looking again (it wakes on any message).
_IDLE_POLL_MS = 500
# How long it waits when requests exist but nothing could be scheduled (e.g. KV cache full).
_STALL_POLL_MS = 2
# Test-only hooks, read from the environment when the core starts; never set them otherwise.
# The least time a step takes (the loop sleeps out the rest), so that a browser test can act
# while an answer is still streaming however fast the machine is:
MIN_STEP_S_ENV = "NOVAINFER_TEST_MIN_STEP_S"
# While the file named here exists, the loop waits before each step, as a hung device would, so
# that tests can watch the watchdog notice:
TEST_STALL_FILE_ENV = "NOVAINFER_TEST_STALL_FILE"


class EngineCoreLoop:
    """Serves one core to one or more front-ends, each joined by its own pair of sockets
    (``novainfer serve --api-server-count N``: one pair per API server process). A request's
    outputs go to the front-end that added it; every front-end gets every step's stats."""

    def __init__(self, core: EngineCore, channels: list[tuple[zmq.Socket, zmq.Socket]]) -> None:
        self.core = core
        self.inputs = [channel[0] for channel in channels]
        self.outputs = [channel[1] for channel in channels]
        self.decoder = InputDecoder()
        self.poller = zmq.Poller()
        for input_socket in self.inputs:
            self.poller.register(input_socket, zmq.POLLIN)
        # With several front-ends: which one added each unfinished request.
        self._front_end_of: dict[str, int] = {}
        self.failure: BaseException | None = None  # what ended the loop, if a step raised
        self._stall_file = os.environ.get(TEST_STALL_FILE_ENV)
        self._min_step_s = float(os.environ.get(MIN_STEP_S_ENV) or 0.0)

    def send(self, message, front_end: int | None = None) -> None:
        """Sends ``message`` to one front-end, or to every one."""
        frame = core_message_encoder.encode(message)
        for output in self.outputs if front_end is None else [self.outputs[front_end]]:
            output.send(frame, copy=False)

    def send_step(self, outputs: EngineCoreOutputs) -> None:
        """One message per front-end: the outputs of its own requests, and the step's stats."""
        if len(self.outputs) == 1:
            self.send(StepOutputs(outputs))
            return
        owner = self._front_end_of
        # None: aborted by its front-end, which no longer waits for it.
        owners = list(map(owner.get, outputs.request_ids))
        for i in outputs.finished:
            owner.pop(outputs.request_ids[i], None)
        for front_end in range(len(self.outputs)):
            keep = [i for i, of in enumerate(owners) if of == front_end]
            self.send(StepOutputs(outputs.subset(keep)), front_end)

    def run(self) -> None:
        """Serves until Shutdown; a failure is sent as CoreFailed, then raised."""
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - reported to the front-end, then re-raised
            if isinstance(exc, SystemExit) and not exc.code:
                return  # SIGTERM: a requested stop
            self.failure = exc
            logger.exception("engine core: loop died")
            self.send(CoreFailed(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
            raise

    def _run(self) -> None:
        core = self.core
        while True:
            received = self._receive(0 if core.has_work() else _IDLE_POLL_MS)
            if received is None:
                return
            if not core.has_work():
                if received:  # gauges see added and aborted requests before a long step
                    self.send(StepOutputs(EngineCoreOutputs(stats=core.make_stats(), timestamp=time.time())))
                continue
            self._wait_while_test_stalled()
            steps_before = core.stats.num_steps
            started = time.monotonic()
            outputs = core.step()
            if self._min_step_s:
                time.sleep(max(0.0, started + self._min_step_s - time.monotonic()))
            self.send_step(outputs)
            if core.stats.num_steps == steps_before and not outputs.request_ids:
                # Nothing could be scheduled (e.g. the KV cache is full): wait a little, not spin.
                if self._receive(_STALL_POLL_MS) is None:
                    return

    def _receive(self, timeout_ms: int) -> int | None:
        """Handles every message waiting (waiting up to ``timeout_ms`` for the first); returns how
        many, or None on Shutdown."""
        count = 0
        if not self.poller.poll(timeout_ms):
            return 0
        for front_end, input_socket in enumerate(self.inputs):
            while True:
                try:
                    frame = input_socket.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                count += 1
                if not self._handle(self.decoder.decode(frame.buffer), front_end):
                    return None
        return count

    def _handle(self, message: AddRequests | AbortRequests | ResetPrefixCache | Shutdown, front_end: int) -> bool:
        """Applies one message from ``front_end``; False for Shutdown."""
        if isinstance(message, AddRequests):
            self.core.add_requests(message.requests)
            if len(self.inputs) > 1:
                self._front_end_of.update((r.request_id, front_end) for r in message.requests)
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids)
            for request_id in message.request_ids:
                self._front_end_of.pop(request_id, None)
        elif isinstance(message, ResetPrefixCache):
            self.send(PrefixCacheReset(self.core.reset_prefix_cache()), front_end)
        elif isinstance(message, Shutdown):
            return False
        return True

    def _wait_while_test_stalled(self) -> None:
        while self._stall_file is not None and os.path.exists(self._stall_file):
            time.sleep(0.05)


Channel = tuple[str, str]  # the (input, output) addresses a front-end binds


def connect(context: zmq.Context, channels: list[Channel]) -> list[tuple[zmq.Socket, zmq.Socket]]:
    """The core's ends of each front-end's two sockets (the front-ends bind them; a front-end that
    binds later still gets what was sent before: a connecting socket queues it)."""
    sockets = []
    for input_address, output_address in channels:
        input_socket = context.socket(zmq.PULL)
        input_socket.connect(input_address)
        output_socket = context.socket(zmq.PUSH)
        output_socket.setsockopt(zmq.LINGER, 2000)
        output_socket.connect(output_address)
        sockets.append((input_socket, output_socket))
    return sockets


def _close(sockets: list[tuple[zmq.Socket, zmq.Socket]], output_linger_ms: int | None) -> None:
    for input_socket, output_socket in sockets:
        input_socket.close(linger=0)
        output_socket.close(linger=output_linger_ms)


def run_engine_core(config: EngineConfig, channels: list[Channel], log_level: int,
                    log_stats_interval: float) -> None:
    """The engine-core process: builds the core, says it is ready, serves until told to stop."""
    from novainfer.executor.multiproc_executor import configure_worker_logging, exit_with_parent

    exit_with_parent()
    # Ctrl-C in a terminal reaches every process of the group: the server stops this one itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    configure_worker_logging("engine core", log_level)
    context = zmq.Context()
    sockets = connect(context, channels)
    try:
        try:
            core = EngineCore(config, log_stats_interval=log_stats_interval)
        except BaseException as exc:
            logger.exception("engine core: start-up failed")
            failed = core_message_encoder.encode(CoreFailed(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
            for _, output_socket in sockets:
                output_socket.send(failed)
            raise SystemExit(1) from None
        freeze_startup_objects()
        loop = EngineCoreLoop(core, sockets)
        loop.send(CoreReady(core.info))
        try:
            loop.run()
        finally:
            core.shutdown()
    finally:
        _close(sockets, None)
        context.term()


def start_core_process(config: EngineConfig, channels: list[Channel], name: str,
                       log_stats_interval: float) -> multiprocessing.process.BaseProcess:
    """Spawns an engine-core process serving the front-ends of ``channels``. Not a daemon: the
    core's own ``mp`` workers are its children; whoever starts it stops it."""
    log_level = logging.getLogger("novainfer").getEffectiveLevel()
    process = multiprocessing.get_context("spawn").Process(
        target=run_engine_core, name=f"novainfer-core-{name}", daemon=False,
        args=(config, channels, log_level, log_stats_interval))
    process.start()
    return process


def start_core_thread(core: EngineCore, channel: Channel, name: str) -> tuple[threading.Thread, EngineCoreLoop]:
    """Runs the loop of an already built core in a daemon thread of this process (with a ZMQ
    context of its own, so that the caller's can be closed even if this thread hangs)."""
    context = zmq.Context()
    sockets = connect(context, [channel])
    loop = EngineCoreLoop(core, sockets)
    loop.send(CoreReady(core.info))

    def run() -> None:
        try:
            loop.run()
        except BaseException:  # noqa: BLE001 - already logged and sent by the loop
            pass
        finally:
            _close(sockets, 0)
            context.term()

    thread = threading.Thread(target=run, name=f"novainfer-engine-{name}", daemon=True)
    thread.start()
    return thread, loop
