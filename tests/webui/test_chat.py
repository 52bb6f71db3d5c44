"""The chat Web UI in a real browser against a live ``novainfer serve`` (the tiny random model).

The oracle for answers is the official ``openai`` client asking the same server the same thing
greedily; for what reached the server, the request and SSE response the browser exchanged; for
cancellation, the server's Prometheus metrics. Failures the live server cannot produce on demand
(429, a dead server, hostile model output) are mocked with Playwright's request routing.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from tests.test_server_support import PACED_STEPS, metric_value, serve, sse_payloads
from tests.webui.chat_page import DESKTOP, PHONE
from tests.webui.held_stream import HeldStream

MODEL = "tiny"
COMPLETIONS = "**/v1/chat/completions"
SYSTEM = "You are a terse assistant."


@pytest.fixture(scope="module")
def server(model_dir):
    yield from serve([str(model_dir), "--served-model-name", MODEL, "--kv-cache-memory-bytes", str(16 << 20)],
                     env=PACED_STEPS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def greedy_answer(client, messages: list[dict[str, str]], max_tokens: int):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, top_p=1,
                                          max_tokens=max_tokens)


def metric(server, name: str, **labels: str) -> float:
    return metric_value(httpx.get(f"{server.base_url}/metrics").text, f"novainfer:{name}", model_name=MODEL, **labels)


def number(text: str) -> int:
    return int(text.replace(",", ""))


# Records every text a streaming answer shows, as it is redrawn in place.
RECORD_STREAM_STATES = """() => {
    window.__states = [];
    new MutationObserver((records) => {
        for (const r of records) {
            if (r.target.closest('.msg-assistant')) window.__states.push(r.target.dataset.raw);
        }
    }).observe(document.getElementById('message-list'),
               {subtree: true, attributes: true, attributeFilter: ['data-raw']});
}"""

# The answer's text as displayed, without the code-block headers the renderer adds.
VISIBLE_ANSWER_TEXT = """(article) => {
    const body = article.querySelector('.msg-body').cloneNode(true);
    body.querySelectorAll('.code-head').forEach((n) => n.remove());
    return body.textContent;
}"""


def without_markup(text: str) -> str:
    """Text with whitespace and everything Markdown may turn into structure removed."""
    return re.sub(r"[\s*_`#>~|\[\]()\\+\-.:\d]", "", text)


def test_streamed_answer_equals_the_api_greedy_answer(open_chat, client):
    chat = open_chat()
    chat.configure(system_prompt=SYSTEM, temperature=0, top_p=1, max_tokens=64)
    chat.page.evaluate(RECORD_STREAM_STATES)
    question = "Tell me about foxes."
    with chat.page.expect_response(lambda r: r.url.endswith("/v1/chat/completions")) as exchange:
        answer = chat.ask(question)

    expected = greedy_answer(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], 64)
    text = expected.choices[0].message.content
    assert answer.error is None and answer.raw == text
    stored = chat.stored()[0]["messages"]
    assert [(m["role"], m["content"]) for m in stored] == [("user", question), ("assistant", text)]
    visible = chat.answer_locator().evaluate(VISIBLE_ANSWER_TEXT)
    assert without_markup(visible) == without_markup(text)

    # It streamed: the text grew through partial states, only ever by appending.
    states = list(dict.fromkeys(chat.page.evaluate("window.__states")))
    assert len([s for s in states if s != text]) >= 2, states
    assert all(later.startswith(earlier) for earlier, later in zip(states, states[1:]))

    # What went over the wire: the settings, and the chunks the debug panel reports.
    request = exchange.value.request.post_data_json
    assert request["messages"] == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    assert (request["temperature"], request["top_p"], request["max_tokens"]) == (0, 1, 64)
    assert request["stream"] is True and request["stream_options"] == {"include_usage": True}
    chunks = [json.loads(p) for p in sse_payloads(exchange.value.text().splitlines()) if p != "[DONE]"]
    usage = chunks[-1]["usage"]
    finish = next(c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0].get(
        "finish_reason"))
    debug = chat.open_debug()
    assert debug["Request id"] == chunks[0]["id"]
    assert debug["Finish reason"].split()[0] == finish == expected.choices[0].finish_reason
    assert number(debug["Prompt tokens"]) == usage["prompt_tokens"] == expected.usage.prompt_tokens
    assert number(debug["Completion tokens"]) == usage["completion_tokens"] == expected.usage.completion_tokens
    assert number(debug["Cached prompt tokens"]) == usage["prompt_tokens_details"]["cached_tokens"]
    assert debug["Time to first token"].endswith(" ms") and debug["Speed"].endswith(" tokens/s")

    # Regenerating asks again: the same greedy text, a new request, and now a prefix-cache hit.
    chat.answer_locator().locator(".regenerate-btn").click()
    chat.wait_idle()
    assert [m.raw for m in chat.messages()] == [question, text]
    again = chat.open_debug()
    assert again["Request id"] != debug["Request id"] and number(again["Cached prompt tokens"]) > 0


def test_answer_without_streaming(open_chat, client):
    chat = open_chat()
    chat.configure(temperature=0, top_p=1, max_tokens=12, stream=False)
    with chat.page.expect_response(lambda r: r.url.endswith("/v1/chat/completions")) as exchange:
        answer = chat.ask("Say something.")
    expected = greedy_answer(client, [{"role": "user", "content": "Say something."}], 12)
    assert answer.error is None and answer.raw == expected.choices[0].message.content
    assert exchange.value.request.post_data_json["stream"] is False
    debug = chat.open_debug()
    assert debug["Request id"] == exchange.value.json()["id"] and debug["Time to first token"] == "—"
    assert number(debug["Completion tokens"]) == expected.usage.completion_tokens


def test_stop_ends_the_stream_and_the_server_aborts_the_request(open_chat, server):
    chat = open_chat()
    chat.configure(temperature=0, top_p=1, max_tokens=1900)
    chat.answer_until_max_tokens()
    aborted_before = metric(server, "request_success_total", finished_reason="abort")
    chat.send("Write a long story about a fox.")
    chat.page.wait_for_function("() => document.querySelector('.msg-assistant .msg-body')?.dataset.raw.length > 0")
    chat.stop()
    chat.wait_idle()
    stopped = chat.messages()[-1].raw
    time.sleep(1.0)
    assert chat.messages()[-1].raw == stopped and stopped
    assert chat.stored()[0]["messages"][-1]["content"] == stopped
    assert chat.open_debug()["Finish reason"] == "abort (stopped)"

    deadline = time.monotonic() + 30
    while metric(server, "request_success_total", finished_reason="abort") < aborted_before + 1:
        assert time.monotonic() < deadline, "the server never aborted the request"
        time.sleep(0.1)
    assert metric(server, "num_requests_running") == 0
    assert chat.messages()[-1].raw == stopped


def test_conversations_and_settings_survive_reload_and_never_mix(open_chat):
    chat = open_chat()
    settings = {"system_prompt": "Be kind.", "temperature": 0, "top_p": 0.9, "max_tokens": 6, "stream": True}
    chat.configure(**settings)
    alpha = chat.ask("alpha question")
    chat.new_chat()
    beta = chat.ask("beta question")
    assert alpha.error is None and beta.error is None

    chat.reload()
    assert sorted(chat.sidebar_titles()) == ["alpha question", "beta question"]
    assert [m.raw for m in chat.messages()] == ["beta question", beta.raw]  # the open one is reopened
    chat.select("alpha question")
    assert [m.raw for m in chat.messages()] == ["alpha question", alpha.raw]
    assert chat.settings_values() == {"system_prompt": "Be kind.", "temperature": "0", "top_p": "0.9",
                                      "max_tokens": "6", "api_key": "", "stream": True}

    # While alpha's answer streams, beta shows only its own messages; the answer is a stream this test
    # holds open and feeds, so it is still streaming whatever time the browser steps take.
    with HeldStream(MODEL) as held:
        chat.page.route(COMPLETIONS, lambda route: route.continue_(url=held.url))
        chat.send("alpha follow-up")
        held.push("Foxes ")
        chat.page.wait_for_function("() => document.querySelectorAll('.msg-assistant .msg-body')[1]"
                                    "?.dataset.raw === 'Foxes '")
        chat.select("beta question")
        for piece in ("are ", "quick ", "and "):
            held.push(piece)
            assert [m.raw for m in chat.messages()] == ["beta question", beta.raw]
        chat.page.wait_for_timeout(200)  # time for a misrouted piece to be drawn, which must not happen
        assert [m.raw for m in chat.messages()] == ["beta question", beta.raw]
        chat.select("alpha question")
        held.push("clever.")
        chat.page.wait_for_function("() => document.querySelectorAll('.msg-assistant .msg-body')[1]"
                                    "?.dataset.raw === 'Foxes are quick and clever.'")
        chat.stop()
        chat.wait_idle()
        assert held.disconnected.wait(30), "Stop did not close the stream"
        assert held.requests[0]["messages"][-1] == {"role": "user", "content": "alpha follow-up"}
    stored = chat.stored_by_title()
    assert [m["content"] for m in stored["beta question"]["messages"]] == ["beta question", beta.raw]
    assert [m["content"] for m in stored["alpha question"]["messages"]] == [
        "alpha question", alpha.raw, "alpha follow-up", "Foxes are quick and clever."]
    chat.reload()
    chat.select("alpha question")
    assert [m.raw for m in chat.messages()][-1] == "Foxes are quick and clever."


def test_edit_an_earlier_message_and_regenerate_from_there(open_chat, client):
    chat = open_chat()
    chat.configure(temperature=0, top_p=1, max_tokens=8)
    chat.ask("first question")
    chat.ask("second question")
    assert len(chat.messages()) == 4

    first = chat.page.locator("#message-list > article.msg-user").first
    first.hover()
    first.locator(".edit-btn").click()
    # The editor takes the focus (cursor at the end) at the next frame; filling before that would let
    # the cursor move between fill's select-all and its typing, and the text would be appended.
    chat.page.wait_for_function("() => document.activeElement?.classList.contains('edit-input')")
    chat.page.fill(".edit-input", "an edited question")
    chat.page.click(".save-edit-btn")
    # Saving replaces the later turns with a new answer: wait for that, then for the answer to end.
    chat.page.wait_for_function("() => { const m = document.querySelectorAll('#message-list > article.msg');"
                                "return m.length === 2 && m[0].querySelector('.msg-body').dataset.raw === "
                                "'an edited question'; }")
    chat.wait_idle()

    expected = greedy_answer(client, [{"role": "user", "content": "an edited question"}], 8).choices[0].message.content
    assert [(m.role, m.raw) for m in chat.messages()] == [("user", "an edited question"), ("assistant", expected)]
    assert [m["content"] for m in chat.stored()[0]["messages"]] == ["an edited question", expected]


@pytest.mark.parametrize("field, value, message", [
    ("temperature", "3", "Temperature must be in [0, 2], got 3"),
    ("top_p", "0", "Top-p must be in (0, 1], got 0"),
    ("max_tokens", "1.5", "Max tokens must be an integer in [1, 1000000], got 1.5"),
    ("max_tokens", "", "Max tokens must be a number, got ''"),
])
def test_invalid_settings_are_refused_naming_the_allowed_range(open_chat, field, value, message):
    chat = open_chat()
    before = chat.settings_values()
    chat.open_settings()
    chat.fill_settings(**{field: value})
    chat.page.click("#settings-save-btn")
    assert chat.page.inner_text("#settings-error") == message
    assert chat.page.is_visible("#settings-dialog")  # still open, to be corrected
    chat.page.click("#settings-cancel-btn")
    assert chat.settings_values() == before


def _chats_file(conversations: list[dict]) -> dict:
    return {"name": "chats.json", "mimeType": "application/json",
            "buffer": json.dumps({"format": "novainfer-chats", "version": 1, "conversations": conversations}).encode()}


IMPORTED = [
    {"title": "Cooking pasta", "messages": [{"role": "user", "content": "How long do I boil pasta?"},
                                            {"role": "assistant", "content": "About **10 minutes**."}]},
    {"title": "Rust lifetimes", "messages": [{"role": "user", "content": "What is a lifetime?"},
                                             {"role": "assistant", "content": "How long a reference is valid."}]},
    {"title": "Trip to Kyoto", "messages": [{"role": "user", "content": "What should I see?"},
                                            {"role": "assistant", "content": "The temples of Higashiyama."}]},
]


def test_conversations_import_search_rename_delete_export(open_chat):
    chat = open_chat()
    chat.page.set_input_files("#import-file", _chats_file(IMPORTED))
    chat.page.wait_for_selector("#toasts .toast:has-text('Imported 3 conversations')")
    assert sorted(chat.sidebar_titles()) == ["Cooking pasta", "Rust lifetimes", "Trip to Kyoto"]

    chat.page.fill("#search-input", "temples")  # matches a message, not a title
    assert chat.sidebar_titles() == ["Trip to Kyoto"]
    chat.page.fill("#search-input", "")

    row = chat.page.locator("#conversation-list .conversation", has_text="Rust lifetimes")
    row.hover()
    row.locator(".rename-btn").click()
    chat.page.fill(".rename-input", "Borrow checker")
    chat.page.press(".rename-input", "Enter")
    assert "Borrow checker" in chat.sidebar_titles() and "Borrow checker" in chat.stored_by_title()

    row = chat.page.locator("#conversation-list .conversation", has_text="Cooking pasta")
    row.hover()
    row.locator(".delete-btn").click()
    chat.page.click("#confirm-ok-btn")
    chat.page.wait_for_selector("#conversation-list .conversation:has-text('Cooking pasta')", state="detached")
    assert sorted(chat.sidebar_titles()) == ["Borrow checker", "Trip to Kyoto"]

    chat.select("Trip to Kyoto")
    assert [m.raw for m in chat.messages()] == ["What should I see?", "The temples of Higashiyama."]

    with chat.page.expect_download() as download:
        chat.page.click("#export-btn")
    exported = json.loads(open(download.value.path(), encoding="utf-8").read())
    by_title = {c["title"]: [(m["role"], m["content"]) for m in c["messages"]] for c in exported["conversations"]}
    assert by_title == {"Borrow checker": [(m["role"], m["content"]) for m in IMPORTED[1]["messages"]],
                        "Trip to Kyoto": [(m["role"], m["content"]) for m in IMPORTED[2]["messages"]]}

    # The export imports into another browser profile as it was.
    other = open_chat()
    other.page.set_input_files("#import-file", {"name": "export.json", "mimeType": "application/json",
                                                "buffer": json.dumps(exported).encode()})
    other.page.wait_for_selector("#toasts .toast:has-text('Imported 2 conversations')")
    assert {c["title"]: [(m["role"], m["content"]) for m in c["messages"]] for c in other.stored()} == by_title


@pytest.mark.parametrize("content, complaint", [
    (b"{not json", "not valid JSON"),
    (json.dumps({"conversations": [{"messages": [{"role": "tool", "content": "x"}]}]}).encode(),
     "conversations[0].messages[0].role"),
    (json.dumps({"chats": []}).encode(), '"conversations" array'),
])
def test_bad_import_files_are_refused_with_a_reason(open_chat, content, complaint):
    chat = open_chat()
    chat.page.set_input_files("#import-file", {"name": "bad.json", "mimeType": "application/json", "buffer": content})
    toast = chat.page.wait_for_selector("#toasts .toast-error")
    assert "Import failed" in toast.inner_text() and complaint in toast.inner_text()
    assert chat.stored() == [] and chat.sidebar_titles() == []


# ---- untrusted text ------------------------------------------------------------------------------------
def sse_body(text: str, pieces: int = 6, error: dict | None = None) -> str:
    """An SSE response streaming ``text`` in ``pieces`` chunks (then an error event, if given)."""
    size = max(1, -(-len(text) // pieces))
    base = {"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
    events = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    events += [{**base, "choices": [{"index": 0, "delta": {"content": text[i:i + size]}}]}
               for i in range(0, len(text), size)]
    if error is not None:
        return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n"
    events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    events.append({**base, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
                                                    "prompt_tokens_details": {"cached_tokens": 0}}})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


HOSTILE_ANSWER = ('Look: <img src=x onerror="window.__xss=1"> and <script>window.__xss=2</script> '
                  "and [click](javascript:window.__xss=3) and <svg onload=window.__xss=4></svg>\n\n"
                  "**bold** [safe](https://example.com/)")
HOSTILE_QUESTION = '<img src=x onerror="window.__xss=5"><script>window.__xss=6</script>'


def test_model_and_user_text_never_run_as_markup(open_chat):
    # Without the page's Content-Security-Policy: the escaping alone must keep this safe.
    chat = open_chat(bypass_csp=True)
    chat.page.route(COMPLETIONS, lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=sse_body(HOSTILE_ANSWER)))
    answer = chat.ask(HOSTILE_QUESTION)
    assert answer.raw == HOSTILE_ANSWER and answer.error is None

    for restored in (False, True):  # as streamed, then as restored from storage
        if restored:
            chat.reload()
        assert chat.page.evaluate("window.__xss") is None
        assert chat.page.locator("#message-list img, #message-list script, #message-list svg:not(.icon)").count() == 0
        visible = chat.page.inner_text("#message-list")
        for literal in ('<img src=x onerror="window.__xss=1">', "<script>window.__xss=2</script>",
                        "[click](javascript:window.__xss=3)", "<svg onload=window.__xss=4></svg>", HOSTILE_QUESTION):
            assert literal in visible
        links = chat.answer_locator().locator("a")
        assert links.count() == 1 and links.get_attribute("href") == "https://example.com/"
        assert set(links.get_attribute("rel").split()) >= {"noopener", "noreferrer"}
        assert chat.answer_locator().locator("strong").inner_text() == "bold"
        assert chat.sidebar_titles()[0].startswith("<img src=x")


# ---- errors ----------------------------------------------------------------------------------------------
def test_errors_are_shown_and_the_ui_recovers(open_chat):
    chat = open_chat()
    chat.configure(temperature=0, top_p=1, max_tokens=4)

    overloaded = {"error": {"message": "server overloaded: 9 sequences are waiting", "type": "rate_limit_error",
                            "param": None, "code": "queue_full"}}
    chat.page.route(COMPLETIONS, lambda route: route.fulfill(
        status=429, headers={"Retry-After": "7", "Content-Type": "application/json"}, body=json.dumps(overloaded)))
    error = chat.ask("first try").error
    assert "HTTP 429" in error and "server overloaded" in error and "Retry after 7 seconds" in error
    chat.page.unroute(COMPLETIONS)

    chat.page.route(COMPLETIONS, lambda route: route.abort("connectionrefused"))
    assert "Could not reach the server" in chat.ask("second try").error
    chat.page.unroute(COMPLETIONS)
    chat.answer_locator().locator(".regenerate-btn").click()  # "Retry"
    chat.wait_idle()
    assert chat.messages()[-1].error is None
    assert chat.open_debug()["Finish reason"].split()[0] in ("stop", "length")

    # A stream that fails midway keeps its text and says what happened.
    failure = {"error": {"message": "the engine failed while serving this request", "type": "server_error",
                         "param": None, "code": "engine_dead"}}
    chat.page.route(COMPLETIONS, lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=sse_body("partial text", error=failure)))
    broken = chat.ask("third try")
    assert broken.raw == "partial text" and "the engine failed" in broken.error
    chat.page.unroute(COMPLETIONS)

    # A real error of the server: max_tokens beyond the model's length is a 400 naming the field.
    chat.configure(max_tokens=100000)
    error = chat.ask("fourth try").error
    assert "HTTP 400" in error and "max_tokens" in error
    chat.configure(max_tokens=4)
    with chat.page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        final = chat.ask("fifth try")
    assert final.error is None and chat.open_debug()["Finish reason"].split()[0] in ("stop", "length")
    # Failed answers (an error and no text) are not sent back as turns of the dialogue.
    sent_messages = sent.value.post_data_json["messages"]
    assert [m["content"] for m in sent_messages if m["role"] == "user"] == [
        "first try", "second try", "third try", "fourth try", "fifth try"]
    history = chat.stored()[0]["messages"][:-1]
    assert len(history) == 9 and sum(1 for m in history if m.get("error") and not m["content"]) == 2
    assert sent_messages == [{"role": m["role"], "content": m["content"]} for m in history
                             if not (m.get("error") and not m["content"])]


# ---- layout and themes -------------------------------------------------------------------------------------
DEMO = [{"title": "Markdown tour", "messages": [
    {"role": "user", "content": "Show me what you can render, with a code sample."},
    {"role": "assistant", "content": (
        "## A quick tour\n\nAnswers are **Markdown**: *emphasis*, `inline code`, "
        "[links](https://example.com/) and lists:\n\n1. Paged KV cache\n2. Continuous batching\n"
        "   - chunked prefill\n   - preemption\n\n```python\nfrom novainfer import LLM\n\n"
        "llm = LLM(model=\"Qwen2-0.5B-Instruct\")\nprint(llm.generate(\"Hello\")[0].outputs[0].text)\n```\n\n"
        "| Metric | Value |\n|---|---:|\n| TTFT | 12 ms |\n| Decode | 380 tok/s |\n\n> Quotes look like this.")},
]}]


@pytest.mark.parametrize("scheme", ["light", "dark"])
@pytest.mark.parametrize("device, viewport", [("desktop", DESKTOP), ("phone", PHONE)])
def test_layout_and_theme_screenshots(open_chat, artifacts_dir, device, viewport, scheme):
    chat = open_chat(viewport=viewport, color_scheme=scheme)
    page = chat.page
    assert page.evaluate("document.documentElement.dataset.theme") == scheme  # follows the system by default
    page.set_input_files("#import-file", _chats_file(DEMO))
    page.wait_for_selector("#toasts .toast")
    chat.configure(temperature=0, top_p=1, max_tokens=24)
    if device == "phone":
        page.click("#open-sidebar-btn")
    chat.select("Markdown tour")
    answer = chat.ask("Thanks! And a short answer from the live model?")
    assert answer.error is None
    chat.open_debug()
    page.wait_for_selector("#toasts .toast", state="detached")
    page.screenshot(path=artifacts_dir / f"{device}-{scheme}.png", animations="disabled")

    sidebar = page.locator("#sidebar").bounding_box()
    if device == "phone":
        assert sidebar["x"] + sidebar["width"] <= 0  # collapsed off-screen
        page.click("#open-sidebar-btn")
        page.wait_for_timeout(300)  # the slide-in transition
        assert page.locator("#sidebar").bounding_box()["x"] == 0
        page.screenshot(path=artifacts_dir / f"{device}-sidebar-{scheme}.png", animations="disabled")
        page.click("#scrim", position={"x": viewport["width"] - 10, "y": 200})
        page.wait_for_timeout(300)
        assert page.locator("#sidebar").bounding_box()["x"] + sidebar["width"] <= 0
    else:
        assert sidebar["x"] == 0 and sidebar["width"] > 200
        # Nothing overflows the window sideways.
        assert page.evaluate("document.documentElement.scrollWidth") <= viewport["width"]
    assert page.evaluate("document.documentElement.scrollWidth") <= viewport["width"]

    chat.open_settings()
    page.screenshot(path=artifacts_dir / f"{device}-settings-{scheme}.png", animations="disabled")
    page.click("#settings-cancel-btn")

    # The toggle switches the theme, and the choice outlives a reload.
    other = "dark" if scheme == "light" else "light"
    page.click("#theme-btn")
    assert page.evaluate("document.documentElement.dataset.theme") == other
    chat.reload()
    assert page.evaluate("document.documentElement.dataset.theme") == other
