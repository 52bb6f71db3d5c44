"""The Web UI against a server that has an API key and a per-client limit of one request at a time:
real 401s until the key is set, and a real 429 (with Retry-After) from a second concurrent answer."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.test_server_support import PACED_STEPS, metric_value, serve

API_KEY = "webui-secret"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(model_dir):
    yield from serve([str(model_dir), "--served-model-name", MODEL, "--api-key", API_KEY,
                      "--max-concurrent-requests-per-client", "1", "--retry-after", "3",
                      "--kv-cache-memory-bytes", str(16 << 20)], env=PACED_STEPS)


def test_page_loads_without_the_key_and_the_api_refuses_until_it_is_set(open_chat):
    chat = open_chat()  # the page and its assets came without a key
    page = chat.page
    assert page.locator("#model-select option").all_inner_texts() == ["Default model"]
    assert "API key" in page.locator("#toasts .toast-error").first.inner_text()

    refused = chat.ask("hello")
    assert "HTTP 401" in refused.error and "Settings" in refused.error
    assert page.is_enabled("#prompt-input") and page.is_visible("#send-btn")

    chat.answer_locator().locator(".msg-error button", has_text="Open settings").click()
    page.wait_for_selector("#settings-dialog[open]")
    chat.fill_settings(api_key=API_KEY, temperature=0, top_p=1, max_tokens=6)
    page.click("#settings-save-btn")
    page.wait_for_selector(f"#model-select option[value='{MODEL}']", state="attached")

    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        chat.answer_locator().locator(".regenerate-btn").click()
        chat.wait_idle()
    assert sent.value.headers["authorization"] == f"Bearer {API_KEY}"
    assert sent.value.post_data_json["model"] == MODEL
    answer = chat.messages()[-1]
    assert answer.error is None and chat.open_debug()["Finish reason"].split()[0] in ("stop", "length")

    chat.reload()  # the key is a setting: it is kept
    assert page.locator("#model-select option").all_inner_texts() == [MODEL]


def aborted(server) -> float:
    return metric_value(httpx.get(f"{server.base_url}/metrics").text, "novainfer:request_success_total",
                        model_name=MODEL, finished_reason="abort")


def test_a_second_concurrent_answer_gets_the_servers_429(open_chat, server):
    chat = open_chat()
    aborted_before = aborted(server)
    chat.configure(api_key=API_KEY, temperature=0, top_p=1, max_tokens=1900)
    chat.answer_until_max_tokens()
    chat.send("Write a long story about a fox.")
    chat.page.wait_for_function("() => document.querySelector('.msg-assistant .msg-body')?.dataset.raw.length > 0")

    chat.new_chat()
    chat.configure(max_tokens=6)
    busy = chat.ask("a quick question")
    assert "HTTP 429" in busy.error and "Retry after 3 seconds" in busy.error

    chat.select("Write a long story about a fox.")
    chat.stop()
    chat.wait_idle()
    deadline = time.monotonic() + 30  # the server has let go of the stopped request
    while aborted(server) < aborted_before + 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    chat.select("a quick question")
    chat.answer_locator().locator(".regenerate-btn").click()
    chat.wait_idle()
    assert chat.messages()[-1].error is None
