"""The Markdown renderer and the SSE parser of the Web UI, run in the browser on their own (no server).

Oracles: markdown-it-py (a CommonMark implementation) for the structure of rendered Markdown;
tag and attribute whitelists plus character counts for the safety of random hostile inputs; for the
SSE parser, the events the test itself encoded.
"""

from __future__ import annotations

import mimetypes
import random
from html.parser import HTMLParser
from urllib.parse import urlparse

import pytest

from novainfer.entrypoints.openai.webui import STATIC_DIR

ORIGIN = "http://webui.test"


@pytest.fixture(scope="module")
def page(browser):
    """A page on a made-up origin whose files are the UI's static files (ES modules need http)."""
    context = browser.new_context()

    def serve(route) -> None:
        path = urlparse(route.request.url).path
        if path == "/":
            route.fulfill(body="<!doctype html><title>modules</title>", content_type="text/html")
            return
        file = (STATIC_DIR / path.lstrip("/")).resolve()
        if not file.is_relative_to(STATIC_DIR) or not file.is_file():
            route.fulfill(status=404, body="not found")
            return
        route.fulfill(path=file, content_type=mimetypes.guess_type(file.name)[0] or "application/octet-stream")

    context.route(f"{ORIGIN}/**", serve)
    page = context.new_page()
    page.goto(f"{ORIGIN}/")
    yield page
    context.close()


def render(page, sources: list[str]) -> list[str]:
    return page.evaluate("""async (sources) => {
        const {renderMarkdown} = await import('/js/markdown.js');
        return sources.map(renderMarkdown);
    }""", sources)


# ---- structure, against CommonMark ------------------------------------------------------------------
class _Tree(HTMLParser):
    """HTML -> nested (tag, attrs, children) with the differences that do not matter removed: our
    code-block header, wrapper divs, <p> directly in <li> (tight vs loose lists), attributes other
    than href/start, and whitespace amounts."""

    VOID = {"hr", "br", "img", "input"}
    SAME = {"s": "del"}  # strikethrough: GitHub's spec writes <del>, markdown-it <s>
    KEEP_ATTRS = {"href", "start"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root: list = []
        self.stack: list[tuple[str, dict, list]] = []
        self.skip_depth = 0

    def _children(self) -> list:
        return self.stack[-1][2] if self.stack else self.root

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if self.skip_depth or "code-head" in (attrs.get("class") or "").split():
            self.skip_depth += tag not in self.VOID
            return
        node = (self.SAME.get(tag, tag), {k: v for k, v in attrs.items() if k in self.KEEP_ATTRS}, [])
        if tag in self.VOID:
            self._children().append(node)
        else:
            self.stack.append(node)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.handle_endtag(tag)

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if self.skip_depth:
            self.skip_depth -= 1
            return
        node = self.stack.pop()
        parent = self.stack[-1][0] if self.stack else None
        if node[0] == "div" or (node[0] == "p" and parent == "li"):
            self._children().extend([*node[2], " "])
        else:
            self._children().append(node)

    def handle_data(self, data):
        if not self.skip_depth:
            self._children().append(data)


def _normalize(nodes: list) -> list:
    out: list = []
    for node in nodes:
        if isinstance(node, str):
            if out and isinstance(out[-1], str):
                out[-1] += node
            else:
                out.append(node)
        else:
            out.append((node[0], node[1], _normalize(node[2])))
    return [" ".join(n.split()) if isinstance(n, str) else n for n in out if not isinstance(n, str) or n.strip()]


def tree(html: str) -> list:
    parser = _Tree()
    parser.feed(html)
    parser.close()
    return _normalize(parser.root)


COMMONMARK_CASES = [
    "# Title\n\nSome *emphasis* and **strong** text with `code`.",
    "## Steps\n\n1. First\n2. Second with **bold**\n3. Third",
    "- apple\n- banana\n  - nested one\n  - nested two\n- cherry",
    "```python\ndef f(x):\n    return x < 3 and x > 1\n```",
    "Text before\n\n```\nplain <b>code</b> & more\n```\n\nText after",
    "> a quote\n> on two lines",
    "A [link](https://example.com/a?b=1&c=2) here.",
    "| a | b |\n|---|:-:|\n| 1 | 2 |\n| x | `y` |",
    "***\n\nAfter a rule",
    "Use ~~old~~ new.",
    "Line one\nline two",
    "5. five\n6. six",
    "A paragraph\n- then a list",
    "<script>alert(1)</script> & \"quotes\" 'single'",
    "`a < b` and `c & d`",
    "snake_case_name and 2 * 3 * 4",
    "1. Step one:\n   ```bash\n   ls -la\n   ```\n2. Step two",
    "- a\n\n- b\n\n  second paragraph of b",
    "### Mixed *em **strong** em*\n\nend",
    "``code with ` tick``",
    "Escaped \\*not em\\* here",
]


def test_markdown_structure_matches_commonmark(page):
    from markdown_it import MarkdownIt

    oracle = MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])
    ours = render(page, COMMONMARK_CASES)
    for source, html in zip(COMMONMARK_CASES, ours):
        assert tree(html) == tree(oracle.render(source)), f"source: {source!r}\nours: {html}"


def test_code_blocks_links_and_streaming_fences(page):
    sources = ["```js\nconst a = '<b>' && 1;\n```", "see https://example.com/x_(y). and http://a.b?c=1&d=2,",
               "```py\nprint('half-streamed')", "[bad](javascript:alert(1)) [ok](https://ok.test/p)"]
    result = page.evaluate("""async (sources) => {
        const {renderMarkdown} = await import('/js/markdown.js');
        return sources.map((source) => {
            const doc = new DOMParser().parseFromString(renderMarkdown(source), 'text/html');
            return {
                code: [...doc.querySelectorAll('pre code')].map((c) => c.textContent),
                copy: doc.querySelectorAll('.code-block button.copy-code').length,
                links: [...doc.querySelectorAll('a')].map(
                    (a) => [a.getAttribute('href'), a.textContent, a.rel, a.target]),
                text: doc.body.textContent,
            };
        });
    }""", sources)
    block, autolinks, unclosed, links = result
    assert block["code"] == ["const a = '<b>' && 1;"] and block["copy"] == 1
    rel = "noopener noreferrer"
    assert autolinks["links"] == [["https://example.com/x_(y)", "https://example.com/x_(y)", rel, "_blank"],
                                  ["http://a.b?c=1&d=2", "http://a.b?c=1&d=2", rel, "_blank"]]
    assert unclosed["code"] == ["print('half-streamed')"]
    assert links["links"] == [["https://ok.test/p", "ok", rel, "_blank"]]
    assert "[bad](javascript:alert(1))" in links["text"]


# ---- safety, on random hostile inputs ----------------------------------------------------------------
HOSTILE_PIECES = [
    "<script>window.__xss=1</script>", "<img src=x onerror=window.__xss=1>", "javascript:window.__xss=1", "[x](",
    "](", ")", "(", "[", "]", "`", "```", "```js", "*", "**", "_", "~~", "#", "> ", "- ", "1. ", "|", "---", "\n",
    "\n\n", " ", "  ", "&amp;", "&lt;", '"', "'", "http://a.b/c?d=e&f=<g>", 'https://x.y/"onmouseover=alert(1)',
    '<a href="javascript:alert(1)">x</a>', "\\", "word", "中文", "&#x3C;script&#x3E;", "onerror=", "style=color:red",
    "<svg onload=window.__xss=1>", "\r\n", "\t", "](https://ok.test/)", "[ok](https://ok.test/\")",
]
ALLOWED_TAGS = {"p", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em", "del", "code", "pre", "ul", "ol", "li",
                "blockquote", "hr", "a", "div", "span", "button", "table", "thead", "tbody", "tr", "th", "td"}
ALLOWED_ATTRS = {"class", "href", "target", "rel", "start", "type", "aria-label"}


def test_random_hostile_text_only_yields_whitelisted_markup(page):
    rng = random.Random(1234)
    sources = ["".join(rng.choice(HOSTILE_PIECES) for _ in range(rng.randrange(1, 40))) for _ in range(400)]
    results = page.evaluate("""async (sources) => {
        const {renderMarkdown} = await import('/js/markdown.js');
        return sources.map((source) => {
            const doc = new DOMParser().parseFromString(renderMarkdown(source), 'text/html');
            const elements = [...doc.body.querySelectorAll('*')];
            return {
                tags: [...new Set(elements.map((e) => e.tagName.toLowerCase()))],
                attrs: [...new Set(elements.flatMap((e) => e.getAttributeNames()))],
                hrefs: elements.filter((e) => e.hasAttribute('href')).map((e) => e.getAttribute('href')),
                text: doc.body.textContent,
            };
        });
    }""", sources)
    for source, result in zip(sources, results):
        assert set(result["tags"]) <= ALLOWED_TAGS, source
        assert set(result["attrs"]) <= ALLOWED_ATTRS, source
        assert all(h.startswith(("http://", "https://")) and '"' not in h for h in result["hrefs"]), source
        # Markdown never consumes these characters: every one of them is shown as text.
        for char in "<\"'":
            assert result["text"].count(char) == source.count(char), (char, source)
    assert page.evaluate("window.__xss") is None


def test_plain_text_renders_as_itself(page):
    """Text without Markdown syntax shows exactly as written: HTML characters, runs of spaces, line breaks."""
    rng = random.Random(99)
    alphabet = list("abcdefghij XYZ,.;:!?<>&\"'/=%$@中文测试") + ["  ", "&lt;", "<b>", "</p>"]

    def line() -> str:
        # A leading letter keeps a line from starting with block syntax (a "> " quote marker).
        return "x" + "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))

    sources = ["\n".join(line() for _ in range(rng.randrange(1, 4))) for _ in range(200)]
    texts = page.evaluate("""async (sources) => {
        const {renderMarkdown} = await import('/js/markdown.js');
        return sources.map((s) => new DOMParser().parseFromString(renderMarkdown(s), 'text/html').body.textContent);
    }""", sources)
    for source, text in zip(sources, texts):
        assert text == source


# ---- SSE parsing -------------------------------------------------------------------------------------
def _sse_stream() -> tuple[bytes, list[str]]:
    events = ['{"id":"a","choices":[{"delta":{"content":"你好"}}]}', '{"text":"é 🌍 naïve"}',
              "multi\nline", "", '{"last":true}', "[DONE]"]
    wire = ": keep-alive comment\r\n\r\n"
    wire += f"data: {events[0]}\r\n\r\n"
    wire += f"data:{events[1]}\n\n"
    wire += "data: multi\rdata: line\r\r"
    wire += "event: ignored\ndata\n\n"  # a field without a colon: empty data
    wire += f"id: 7\ndata: {events[4]}\n\n"
    wire += "data: [DONE]\n\n"
    wire += "data: never completed"  # no blank line: dropped at the end
    return wire.encode(), events


def test_sse_parser_handles_any_split(page):
    wire, events = _sse_stream()
    rng = random.Random(7)
    splits = [[k] for k in range(1, len(wire))]
    splits += [sorted(rng.sample(range(1, len(wire)), rng.randrange(2, 30))) for _ in range(200)]
    outputs = page.evaluate("""async ([bytes, splits]) => {
        const {SSEParser} = await import('/js/sse.js');
        const data = new Uint8Array(bytes);
        return splits.map((cuts) => {
            const parser = new SSEParser();
            const events = [];
            let start = 0;
            for (const cut of [...cuts, data.length]) {
                events.push(...parser.push(data.slice(start, cut)));
                start = cut;
            }
            parser.finish();
            return events;
        });
    }""", [list(wire), splits])
    for cuts, got in zip(splits, outputs):
        assert got == events, cuts
