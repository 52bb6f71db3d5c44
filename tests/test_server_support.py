"""Helpers for the live-server tests: start ``novainfer serve`` on a free loopback port, stop it.

This module holds no tests itself; the ``test_server_*`` modules import from it.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``python -m novainfer.entrypoints.cli.main serve ARGS --port <free>`` as a context manager.

    ``start`` waits until ``/health`` answers 200 (or the process dies, or the timeout passes);
    ``stop`` always ends the process (SIGINT, then SIGKILL) and keeps its log for failures.
    """

    def __init__(self, args: list[str], startup_timeout: float = 120.0) -> None:
        self.args = list(args)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="novainfer-serve-", suffix=".log", delete=False)

    def start(self) -> ServerProcess:
        env = dict(os.environ)
        env.pop("NOVAINFER_API_KEY", None)  # only an explicit --api-key turns auth on in tests
        env["PYTHONUNBUFFERED"] = "1"
        cmd = [sys.executable, "-m", "novainfer.entrypoints.cli.main", "serve", *self.args,
               "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
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


def serve(args: list[str]) -> Iterator[ServerProcess]:
    """A module's ``server`` fixture is ``yield from serve(ARGS)``: the server runs until the module ends."""
    with ServerProcess(args) as proc:
        yield proc


def metric_value(metrics_text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus text format (labels must match exactly those given)."""
    for line in metrics_text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        match = re.match(r"^([^{\s]+)(?:\{([^}]*)\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return None


def sse_payloads(lines) -> list[str]:
    """The ``data:`` payloads of an SSE stream given as lines."""
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]
