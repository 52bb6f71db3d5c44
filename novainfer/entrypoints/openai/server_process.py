"""Running ``novainfer serve`` in a subprocess on a free loopback port (for tests and benchmarks)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _proc_stats() -> dict[int, list[str]]:
    """The fields after the command name of every process's ``/proc/PID/stat`` (Linux)."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stats[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # it ended meanwhile
    return stats


def process_tree_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of process ``pid`` and of every process below it, by pid
    (read from /proc; empty where there is none)."""
    stats = _proc_stats()
    tree, frontier = {pid}, {pid}
    while frontier:
        frontier = {child for child, fields in stats.items() if int(fields[1]) in frontier} - tree
        tree |= frontier
    ticks = os.sysconf("SC_CLK_TCK")
    return {p: (int(stats[p][11]) + int(stats[p][12])) / ticks for p in tree if p in stats}


class _PortTaken(Exception):
    """The server could not bind its port: another process took it after ``free_port`` chose it."""


class ServerProcess:
    """``python -m novainfer.entrypoints.cli.main serve ARGS --port <free>`` as a context manager.

    ``start`` waits until ``/health`` answers 200 (or the process dies, or the timeout passes);
    ``stop`` always ends the process (SIGINT, then SIGKILL) and keeps its log for failures.
    """

    def __init__(self, args: list[str], startup_timeout: float = 120.0,
                 cwd: Path | None = None, env: dict[str, str] | None = None, log_level: str | None = None) -> None:
        self.args = list(args)
        self.log_level = log_level
        self.extra_env = dict(env or {})
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self._log_start = 0  # where the output of the latest launch begins in the log
        self._log = tempfile.NamedTemporaryFile(prefix="novainfer-serve-", suffix=".log", delete=False)

    def start(self, attempts: int = 3) -> ServerProcess:
        """Starts the server; a port taken by another process between choosing and binding it is
        replaced by a new free port, up to ``attempts`` times."""
        for attempt in range(attempts):
            if attempt:
                self.port = free_port()
                self.base_url = f"http://127.0.0.1:{self.port}"
            self._launch()
            try:
                return self._wait_healthy()
            except _PortTaken:
                continue
        raise RuntimeError(f"no free port after {attempts} attempts:\n{self.log()}")

    def _launch(self) -> None:
        env = dict(os.environ)
        env.pop("NOVAINFER_API_KEY", None)  # only an explicit --api-key turns auth on in tests
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.extra_env)
        level = ["--log-level", self.log_level] if self.log_level else []
        cmd = [sys.executable, "-m", "novainfer.entrypoints.cli.main", *level, "serve", *self.args,
               "--host", "127.0.0.1", "--port", str(self.port)]
        self._log_start = Path(self._log.name).stat().st_size
        self.proc = subprocess.Popen(cmd, cwd=self.cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def _wait_healthy(self) -> ServerProcess:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.flush()
                output = Path(self._log.name).read_bytes()[self._log_start:].decode(errors="replace")
                if "address already in use" in output.lower():
                    raise _PortTaken()
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {self.startup_timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
