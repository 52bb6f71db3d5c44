"""Helpers for the live-server tests: start ``novainfer serve`` on a free loopback port, stop it.

This module holds no tests itself; the ``test_server_*`` modules import from it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path


from novainfer.entrypoints.openai.server_process import ServerProcess, free_port

REPO_ROOT = Path(__file__).resolve().parent.parent

__all__ = ["REPO_ROOT", "ServerProcess", "free_port", "metric_value", "serve"]


def serve(args: list[str], env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A module's ``server`` fixture is ``yield from serve(ARGS)``: the server runs until the module ends."""
    with ServerProcess(args, cwd=REPO_ROOT, env=env) as proc:
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
