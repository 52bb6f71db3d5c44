"""The chat Web UI: static files (HTML, CSS, JavaScript modules) served by the OpenAI-compatible server.

``/`` is the page; its assets are under ``/webui/``. Neither needs the API key: the page asks the
user for it and sends it with every API call.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response
from starlette.types import Scope

WEBUI_DIR = Path(__file__).resolve().parent
INDEX_HTML = WEBUI_DIR / "index.html"
STATIC_DIR = WEBUI_DIR / "static"
ASSETS_PATH = "/webui"

# The UI escapes every text it shows; this policy is the second line of defence: no inline script,
# no inline event handler, no style attribute in markup, and no origin but this server.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
                           "frame-ancestors 'none'")
_PAGE_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
                 "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


class _RevalidatedStaticFiles(StaticFiles):
    """Static files that the browser revalidates on every load, so that an upgraded server never
    runs a mix of old and new modules."""

    def file_response(self, full_path: os.PathLike[str], stat_result: os.stat_result, scope: Scope,
                      status_code: int = 200) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response


def mount_webui(app: FastAPI) -> None:
    """Serves the page at ``/`` and its assets under ``/webui/``."""

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def webui_index() -> FileResponse:
        return FileResponse(INDEX_HTML, media_type="text/html", headers=_PAGE_HEADERS)

    app.mount(ASSETS_PATH, _RevalidatedStaticFiles(directory=STATIC_DIR), name="webui")


__all__ = ["CONTENT_SECURITY_POLICY", "STATIC_DIR", "WEBUI_DIR", "mount_webui"]
