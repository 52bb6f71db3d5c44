"""``novainfer serve --api-server-count N``: N API server processes in front of one engine core per model.

One API server process streams at most about one token per its CPU time per token (admission,
detokenization, SSE chunks, HTTP writes), so a fast engine outruns it. With N > 1 this process,
the supervisor, binds the listening socket, starts one engine-core process per model serving N
front-ends (a pair of sockets each), a session service, and N API server processes that accept
connections from the shared socket (the kernel spreads them). Each API server process admits,
tokenizes, detokenizes and streams its own requests. A client sees one server whichever process
it lands on:

- engine gauges and counters in ``/metrics`` come from the core; the server's own (latency
  histograms, rejections) are summed over the processes;
- sessions live in the supervisor's session service;
- admission bounds the core's waiting queue, as the core reports it, plus the requests each
  process admitted that the core has not seen yet; ``--max-concurrent-requests-per-client`` holds
  per API server process.

Supervision: an API server process that exits ends the whole server (with its exit code). An
engine core that dies is reaped here at once, and every API server reports it (503 on /health,
500-class errors for its requests), as with one API server. SIGINT/SIGTERM stop the API servers
(gracefully), then the engine cores, then everything else.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import shutil
import signal
import socket
import sys
import tempfile
import threading
from multiprocessing.process import BaseProcess
from pathlib import Path

from novainfer.engine.core_client import CoreHandle
from novainfer.engine.core_proc import start_core_process
from novainfer.entrypoints.openai.config import ServerConfig, SharedServing
from novainfer.entrypoints.openai.sessions import SessionService, start_session_service

logger = logging.getLogger(__name__)

# Loggers whose levels the API server processes take from this one (the CLI raises the server's own).
_LOGGERS = ("novainfer", "novainfer.entrypoints.openai", "novainfer.engine.async_llm_engine")
# After an API server's graceful shutdown, how long it may take to exit before SIGKILL, and how
# long an engine core gets after SIGTERM.
_EXIT_GRACE_S = 5.0


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """The socket every API server process accepts connections from (uvicorn's options)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _serve_one(config: ServerConfig, sock: socket.socket, levels: dict[str, int]) -> None:
    """An API server process: serves HTTP from the shared socket with the attached engine cores."""
    from novainfer.entrypoints.openai.api_server import run_server
    from novainfer.executor.multiproc_executor import configure_worker_logging, exit_with_parent

    exit_with_parent()
    configure_worker_logging(f"api server {config.shared.index}", levels["novainfer"])
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    sys.exit(run_server(config, sockets=[sock]))


class Supervisor:
    """Starts the processes of a served model set, waits on them, and stops them all."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.cores: dict[str, BaseProcess] = {}
        self.servers: list[BaseProcess] = []
        self.sessions: SessionService | None = None
        self._dir = tempfile.mkdtemp(prefix="novainfer-serve-")
        self._stop = threading.Event()

    def start(self, sock: socket.socket) -> None:
        self.sessions = start_session_service(self.config.max_sessions, self.config.session_ttl_s)
        handles = self._start_cores()
        metrics_dir, ready_dir = Path(self._dir) / "metrics", Path(self._dir) / "ready"
        metrics_dir.mkdir()
        ready_dir.mkdir()
        levels = {name: logging.getLogger(name).getEffectiveLevel() for name in _LOGGERS}
        context = multiprocessing.get_context("spawn")
        count = self.config.api_server_count
        for i in range(count):
            cores = {name: model_handles[i] for name, model_handles in handles.items()}
            shared = SharedServing(i, count, cores, str(metrics_dir), self.sessions.address, str(ready_dir))
            server = context.Process(target=_serve_one, name=f"novainfer-api-server-{i}", daemon=False,
                                     args=(dataclasses.replace(self.config, shared=shared), sock, levels))
            server.start()
            self.servers.append(server)

    def _start_cores(self) -> dict[str, list[CoreHandle]]:
        """One engine-core process per model, with a channel per API server: each API server's handles."""
        handles: dict[str, list[CoreHandle]] = {}
        for k, spec in enumerate(self.config.models):
            engine_config = spec.engine_args.create_engine_config()
            channels = [(f"ipc://{Path(self._dir) / f'core{k}-server{i}-in'}",
                         f"ipc://{Path(self._dir) / f'core{k}-server{i}-out'}")
                        for i in range(self.config.api_server_count)]
            core = start_core_process(engine_config, channels, spec.name, spec.engine_args.log_stats_interval)
            self.cores[spec.name] = core
            logger.info("engine core of model '%s' started (pid %d)", spec.name, core.pid)
            handles[spec.name] = [CoreHandle(engine_config, channel, core.pid) for channel in channels]
        return handles

    def request_stop(self, *_) -> None:
        self._stop.set()

    def wait(self) -> int:
        """Until a stop is requested (0) or an API server exits (its exit code, at least 1)."""
        waiting = {p.sentinel: p for p in [*self.servers, *self.cores.values()]}
        while not self._stop.is_set():
            ready = multiprocessing.connection.wait(list(waiting), timeout=0.5)
            if self._stop.is_set():  # Ctrl-C reaches the API servers too: they may be ending already
                break
            for sentinel in ready:
                process = waiting.pop(sentinel)
                process.join()  # reaped now: the API servers see a dead core's pid gone
                if process in self.servers:
                    logger.error("%s exited with code %s; stopping the server", process.name, process.exitcode)
                    return process.exitcode or 1
                logger.error("%s died (exit code %s); its model is reported dead", process.name, process.exitcode)
        return 0

    def stop(self) -> None:
        """API servers first (SIGTERM: uvicorn's graceful shutdown), then cores, then the rest."""
        _stop_all(self.servers, self.config.graceful_shutdown_s + _EXIT_GRACE_S)
        _stop_all(list(self.cores.values()), _EXIT_GRACE_S)
        if self.sessions is not None:
            self.sessions.shutdown()
        shutil.rmtree(self._dir, ignore_errors=True)


def _stop_all(processes: list[BaseProcess], grace_s: float) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(grace_s)
        if process.is_alive():
            logger.warning("%s did not stop within %g s; killing it", process.name, grace_s)
            process.kill()
            process.join()


def run_api_servers(config: ServerConfig) -> int:
    """Serves with ``config.api_server_count`` API server processes until interrupted; returns a
    process exit code."""
    sock = bind_listening_socket(config.host, config.port)
    supervisor = Supervisor(config)
    previous = {sig: signal.signal(sig, supervisor.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        supervisor.start(sock)
        logger.info("serving %s on http://%s:%d with %d API server processes (loading models in the background)",
                    ", ".join(s.name for s in config.models), config.host, config.port, config.api_server_count)
        return supervisor.wait()
    finally:
        supervisor.stop()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
