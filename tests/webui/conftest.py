"""Fixtures of the browser tests: Playwright driving a system Chromium (Debian's ``chromium`` package).

Playwright's own browser downloads are never used: the browser is found on this machine
(``$NOVAINFER_CHROMIUM``, else ``chromium``, ``chromium-browser`` or ``google-chrome`` on PATH) and
the tests skip, saying so, when there is none. Screenshots go to ``$NOVAINFER_TEST_ARTIFACTS``
(default ``tests/webui/artifacts/``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.webui.chat_page import DESKTOP, ChatPage

CHROMIUM_ENV = "NOVAINFER_CHROMIUM"
ARTIFACTS_ENV = "NOVAINFER_TEST_ARTIFACTS"
_CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    explicit = os.environ.get(CHROMIUM_ENV)
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return next((path for path in map(shutil.which, _CHROMIUM_NAMES) if path), None)


@pytest.fixture(scope="session")
def chromium_path() -> str:
    pytest.importorskip("playwright.sync_api",
                        reason="the Python package 'playwright' is missing (scripts/install.sh test installs it)")
    path = find_chromium()
    if path is None:
        pytest.skip(f"no Chromium found (${CHROMIUM_ENV}, or {', '.join(_CHROMIUM_NAMES)} on PATH); "
                    "scripts/install.sh test installs Debian's chromium")
    return path


@pytest.fixture(scope="module")
def browser(chromium_path: str):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, args=["--no-sandbox"], headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    path = Path(os.environ.get(ARTIFACTS_ENV) or Path(__file__).parent / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def open_chat(browser, server) -> Iterator[Callable[..., ChatPage]]:
    """``open_chat(**context_options)``: the UI of the module's ``server`` in a fresh browser profile
    (empty storage). Fails the test if the page raised an uncaught error."""
    pages: list[ChatPage] = []

    def open_one(viewport: dict[str, int] = DESKTOP, **context_options) -> ChatPage:
        context = browser.new_context(base_url=server.base_url, viewport=viewport, **context_options)
        chat = ChatPage(context.new_page())
        pages.append(chat)
        chat.open()
        return chat

    yield open_one
    errors = [error for chat in pages for error in chat.page_errors]
    for chat in pages:
        chat.page.context.close()
    assert not errors, f"uncaught errors in the page: {errors}"
