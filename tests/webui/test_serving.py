"""How the server serves the Web UI (no browser, no model loaded): the page at /, every asset it
needs under /webui/, none of it behind the API key, the switch that turns it off, and packaging."""

from __future__ import annotations

import fnmatch
import re

import pytest
from fastapi.testclient import TestClient

from novainfer.engine.arg_utils import EngineArgs
from novainfer.entrypoints.cli.main import build_parser
from novainfer.entrypoints.cli.serve import server_config_from
from novainfer.entrypoints.openai.api_server import build_app
from novainfer.entrypoints.openai.config import ServerConfig
from novainfer.entrypoints.openai.served_models import ModelSpec
from novainfer.entrypoints.openai.webui import STATIC_DIR, WEBUI_DIR
from tests.test_server_support import REPO_ROOT

API_KEY = "ui-test-key"


def client(**config) -> TestClient:
    # Not entered as a context manager: the app's lifespan (which loads the model) never runs.
    return TestClient(build_app(ServerConfig(models=[ModelSpec("tiny", EngineArgs())], **config)),
                      base_url="http://localhost")


def asset_urls(html: str) -> list[str]:
    return re.findall(r'(?:src|href)="(webui/[^"]+)"', html)


def module_imports(js: str) -> list[str]:
    return re.findall(r'^import [^;]* from "\./([\w.]+)";$', js, flags=re.MULTILINE)


def test_page_and_every_asset_load_without_the_api_key():
    http = client(api_keys=[API_KEY])
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert http.head("/").status_code == 200

    pending, seen = [f"/{url}" for url in asset_urls(page.text)], set()
    assert "/webui/js/app.js" in pending
    while pending:  # the page's assets, then every module imported by a module
        url = pending.pop()
        if url in seen:
            continue
        seen.add(url)
        response = http.get(url)
        assert response.status_code == 200, url
        if url.endswith(".js"):
            assert "javascript" in response.headers["content-type"], url
            pending += [f"/webui/js/{name}" for name in module_imports(response.text)]
    assert {f"/webui/js/{p.name}" for p in (STATIC_DIR / "js").glob("*.js")} <= seen, "a module nothing loads"

    # The API itself still needs the key.
    assert http.get("/v1/models").status_code == 401


def test_package_files_are_not_served():
    http = client()
    for path in ("/webui/__init__.py", "/webui/../__init__.py", "/webui/%2e%2e/__init__.py", "/index.html"):
        assert http.get(path).status_code == 404, path


def test_no_webui_switch():
    assert server_config_from(build_parser().parse_args(["serve", "--no-webui"])).webui is False
    http = client(webui=False)
    for path in ("/", "/webui/js/app.js"):
        response = http.get(path)
        assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    assert server_config_from(build_parser().parse_args(["serve"])).webui is True


def test_every_ui_file_is_package_data():
    """A file the package data globs miss would be absent from an installed (non-editable) package."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python >= 3.11")
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["novainfer.entrypoints.openai.webui"]
    files = [p.relative_to(WEBUI_DIR).as_posix() for p in WEBUI_DIR.rglob("*")
             if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert files and all(any(fnmatch.fnmatch(f, pattern) for pattern in patterns) for f in files), files
