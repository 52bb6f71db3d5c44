"""The test servers' launcher: a port that another process takes between ``free_port`` choosing it
and the server binding it costs a retry on a new port, never a failed test."""

from __future__ import annotations

import socket

import httpx

from novainfer.entrypoints.openai import server_process
from tests.test_server_support import REPO_ROOT
from tests.utils import tiny_model


def test_a_port_taken_before_the_server_binds_it_is_replaced(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        choices = iter([taken_port])
        real_free_port = server_process.free_port
        monkeypatch.setattr(server_process, "free_port", lambda: next(choices, None) or real_free_port())
        with server_process.ServerProcess([str(tiny_model())], cwd=REPO_ROOT) as proc:
            assert proc.port != taken_port
            assert "address already in use" in proc.log().lower()
            assert httpx.get(f"{proc.base_url}/health").status_code == 200
