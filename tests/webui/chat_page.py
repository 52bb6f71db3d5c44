"""The chat UI as the tests drive it: what a user does (type, click) and what they see.

``raw`` texts come from the ``data-raw`` attribute of a message body: the exact text the message
holds, before Markdown rendering. ``stored()`` reads the conversations the page saved.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Generation on a busy 2-core machine can be slow; no wait here is a measurement.
TIMEOUT_MS = 90_000
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


@dataclass
class Message:
    role: str
    raw: str
    error: str | None


class ChatPage:
    def __init__(self, page) -> None:
        self.page = page
        self.page_errors: list[str] = []
        page.on("pageerror", lambda error: self.page_errors.append(str(error)))
        page.set_default_timeout(TIMEOUT_MS)

    # ---- navigation ------------------------------------------------------------------------------
    def open(self) -> None:
        self.page.goto("/")
        self.wait_ready()

    def reload(self) -> None:
        self.page.reload()
        self.wait_ready()

    def wait_ready(self) -> None:
        """The app has started once the model list request has ended (with models or without)."""
        self.page.wait_for_selector("#model-select option", state="attached")

    # ---- settings --------------------------------------------------------------------------------
    def open_settings(self) -> None:
        self.page.click("#settings-btn")
        self.page.wait_for_selector("#settings-dialog[open]")

    def configure(self, **fields: Any) -> None:
        """Sets settings through the dialog: system_prompt, temperature, top_p, max_tokens, api_key, stream."""
        self.open_settings()
        self.fill_settings(**fields)
        self.page.click("#settings-save-btn")
        self.page.wait_for_selector("#settings-dialog", state="hidden")

    def fill_settings(self, **fields: Any) -> None:
        inputs = {"system_prompt": "#setting-system-prompt", "temperature": "#setting-temperature",
                  "top_p": "#setting-top-p", "max_tokens": "#setting-max-tokens", "api_key": "#setting-api-key"}
        for name, value in fields.items():
            if name == "stream":
                self.page.set_checked("#setting-stream", bool(value))
            else:
                self.page.fill(inputs[name], str(value))

    def settings_values(self) -> dict[str, Any]:
        self.open_settings()
        values = {name: self.page.input_value(selector) for name, selector in (
            ("system_prompt", "#setting-system-prompt"), ("temperature", "#setting-temperature"),
            ("top_p", "#setting-top-p"), ("max_tokens", "#setting-max-tokens"), ("api_key", "#setting-api-key"))}
        values["stream"] = self.page.is_checked("#setting-stream")
        self.page.click("#settings-cancel-btn")
        return values

    # ---- chatting --------------------------------------------------------------------------------
    def send(self, text: str) -> None:
        self.page.fill("#prompt-input", text)
        self.page.press("#prompt-input", "Enter")

    def wait_idle(self) -> None:
        """Waits until the open conversation has no answer being generated."""
        self.page.wait_for_selector("#stop-btn", state="hidden")
        self.page.wait_for_selector("#send-btn", state="visible")

    def ask(self, text: str) -> Message:
        self.send(text)
        self.wait_idle()
        return self.messages()[-1]

    def stop(self) -> None:
        self.page.click("#stop-btn")

    def answer_until_max_tokens(self) -> None:
        """Adds ``ignore_eos`` to the page's chat requests: a random model's answer cannot end early
        (where it would end depends on the machine's floating-point rounding)."""
        def add_ignore_eos(route) -> None:
            route.continue_(post_data=json.dumps({**route.request.post_data_json, "ignore_eos": True}))

        self.page.route("**/v1/chat/completions", add_ignore_eos)

    def messages(self) -> list[Message]:
        rows = self.page.eval_on_selector_all("#message-list > article.msg", """nodes => nodes.map(n => ({
            role: n.dataset.role,
            raw: n.querySelector('.msg-body')?.dataset.raw ?? null,
            error: n.querySelector('.msg-error')?.innerText ?? null}))""")
        return [Message(**row) for row in rows]

    def answer_locator(self, index: int = -1):
        return self.page.locator("#message-list > article.msg-assistant").nth(index)

    def open_debug(self, index: int = -1) -> dict[str, str]:
        """Opens an answer's debug panel; returns its rows {label: value}."""
        answer = self.answer_locator(index)
        answer.locator(".debug-toggle").click()
        panel = answer.locator(".msg-debug")
        panel.wait_for(state="visible")
        labels = panel.locator("dt").all_inner_texts()
        values = panel.locator("dd").all_inner_texts()
        return dict(zip(labels, values))

    # ---- conversations ---------------------------------------------------------------------------
    def new_chat(self) -> None:
        self.page.click("#new-chat-btn")

    def sidebar_titles(self) -> list[str]:
        return self.page.locator("#conversation-list .conversation-title").all_inner_texts()

    def select(self, title: str) -> None:
        self.page.locator("#conversation-list .conversation-open", has_text=title).first.click()

    def stored(self) -> list[dict[str, Any]]:
        return json.loads(self.page.evaluate("localStorage.getItem('novainfer.conversations') || '[]'"))

    def stored_by_title(self) -> dict[str, dict[str, Any]]:
        return {c["title"]: c for c in self.stored()}

    def toast_texts(self) -> list[str]:
        return self.page.locator("#toasts .toast").all_inner_texts()
