// A small Markdown renderer for model answers.
//
// Safety comes first: the whole source is HTML-escaped before any Markdown is recognised, so the
// only tags in the output are the ones this module writes itself, and every character of the
// source reaches the page as text. Markdown syntax never needs the characters & < > " ', except
// the blockquote marker, which is matched in its escaped form (&gt;). Link targets must be
// http(s) URLs; anything else stays plain text.
//
// Supported: paragraphs (line breaks kept), ATX headings, fenced code blocks (with a copy button),
// inline code, bold, italic, strikethrough, links and bare URLs, ordered and unordered lists (nested
// by indentation), blockquotes, horizontal rules and GitHub-style tables. An unclosed code fence
// runs to the end, which is what a half-streamed answer looks like.

const ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};

/** Escapes text for use in HTML content and in double-quoted attribute values. */
export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

/** The HTML for `source` (untrusted text). */
export function renderMarkdown(source) {
  const lines = escapeHtml(source.replace(/\r\n?/g, "\n")).split("\n");
  return renderBlocks(lines);
}

// ---- blocks ----------------------------------------------------------------------------------------
const FENCE_OPEN = /^( {0,3})(`{3,}|~{3,})([^`]*)$/;
const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}&gt; ?(.*)$/;
const LIST_ITEM = /^( *)([-*+]|\d{1,9}[.)])(?:([ \t]+)(.*))?$/;
const TABLE_DIVIDER = /^ *\|?(?: *:?-+:? *\|)* *:?-+:? *\|? *$/;
const LANGUAGE = /^[\w.+#-]{1,32}$/;

function isBlank(line) {
  return line.trim() === "";
}

/** Does `line` start a block other than a paragraph (so that it ends the paragraph before it)? */
function startsBlock(lines, i) {
  const line = lines[i];
  return FENCE_OPEN.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line)
    || isListItem(line) || isTableStart(lines, i);
}

function isListItem(line) {
  const m = LIST_ITEM.exec(line);
  return m !== null && m[4] !== undefined && m[4].trim() !== "";
}

function isTableStart(lines, i) {
  return i + 1 < lines.length && lines[i].includes("|") && lines[i + 1].includes("-")
    && TABLE_DIVIDER.test(lines[i + 1]) && splitRow(lines[i]).length === splitRow(lines[i + 1]).length;
}

function renderBlocks(lines) {
  let html = "";
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (isBlank(line)) {
      i++;
      continue;
    }
    let block;
    if (FENCE_OPEN.test(line)) block = codeBlock(lines, i);
    else if (RULE.test(line)) block = {html: "<hr>", end: i + 1};
    else if (HEADING.test(line)) block = heading(line, i);
    else if (QUOTE.test(line)) block = blockquote(lines, i);
    else if (isListItem(line)) block = list(lines, i);
    else if (isTableStart(lines, i)) block = table(lines, i);
    else block = paragraph(lines, i);
    html += block.html;
    i = block.end;
  }
  return html;
}

function codeBlock(lines, start) {
  const [, indent, fence, info] = FENCE_OPEN.exec(lines[start]);
  const close = new RegExp(`^ {0,3}${fence[0] === "`" ? "`" : "~"}{${fence.length},}[ \\t]*$`);
  const body = [];
  let i = start + 1;
  while (i < lines.length && !close.test(lines[i])) {
    // Content lines lose up to the opening fence's indentation, as in CommonMark.
    const line = lines[i];
    const strip = Math.min(indent.length, line.length - line.trimStart().length);
    body.push(line.slice(strip));
    i++;
  }
  // The info string is shown as it is (escaped like all text); its first word names the language.
  const label = info.trim();
  const language = label.split(/\s+/)[0];
  const head = `<div class="code-head"><span class="code-lang">${label}</span>`
    + `<button type="button" class="copy-code" aria-label="Copy code">Copy</button></div>`;
  const langClass = LANGUAGE.test(language) ? ` class="language-${language}"` : "";
  return {
    html: `<div class="code-block">${head}<pre><code${langClass}>${body.join("\n")}</code></pre></div>`,
    end: Math.min(i + 1, lines.length),
  };
}

function heading(line, i) {
  const [, hashes, text = ""] = HEADING.exec(line);
  const level = hashes.length;
  return {html: `<h${level}>${renderInline(text)}</h${level}>`, end: i + 1};
}

function blockquote(lines, start) {
  const inner = [];
  let i = start;
  while (i < lines.length && QUOTE.test(lines[i])) {
    inner.push(QUOTE.exec(lines[i])[1]);
    i++;
  }
  return {html: `<blockquote>${renderBlocks(inner)}</blockquote>`, end: i};
}

function leadingSpaces(line) {
  return line.length - line.trimStart().length;
}

function list(lines, start) {
  const first = LIST_ITEM.exec(lines[start]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const marker = ordered ? first[2].slice(-1) : first[2];
  const items = [];
  let item = null;
  let i = start;
  while (i < lines.length) {
    const line = lines[i];
    const m = isListItem(line) ? LIST_ITEM.exec(line) : null;
    if (m && m[1].length === indent) {
      const sameKind = ordered ? /\d/.test(m[2]) && m[2].endsWith(marker) : m[2] === marker;
      if (!sameKind) break;
      item = {lines: [m[4]], contentIndent: indent + m[2].length + Math.min(m[3].length, 4)};
      items.push(item);
      i++;
      continue;
    }
    if (isBlank(line)) {
      // A blank line stays inside the list only if the list (or this item) goes on after it.
      let next = i + 1;
      while (next < lines.length && isBlank(lines[next])) next++;
      if (next >= lines.length) break;
      const nextItem = isListItem(lines[next]) ? LIST_ITEM.exec(lines[next]) : null;
      if (leadingSpaces(lines[next]) <= indent && !(nextItem && nextItem[1].length === indent)) break;
      for (; i < next; i++) item.lines.push("");
      continue;
    }
    if (leadingSpaces(line) > indent) {
      item.lines.push(line.slice(Math.min(item.contentIndent, leadingSpaces(line))));
      i++;
      continue;
    }
    // An unindented line right after item text continues that text ("lazy" continuation).
    if (!isBlank(lines[i - 1]) && !startsBlock(lines, i)) {
      item.lines.push(line);
      i++;
      continue;
    }
    break;
  }
  const tag = ordered ? "ol" : "ul";
  const startNumber = ordered ? parseInt(first[2], 10) : 1;
  const startAttr = startNumber !== 1 ? ` start="${startNumber}"` : "";
  const body = items.map((it) => `<li>${renderBlocks(it.lines)}</li>`).join("");
  return {html: `<${tag}${startAttr}>${body}</${tag}>`, end: i};
}

/** The cells of a table row: split on unescaped pipes, outer pipes optional. */
function splitRow(line) {
  let row = line.trim();
  if (row.startsWith("|")) row = row.slice(1);
  if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
  return row.split(/(?<!\\)\|/).map((cell) => cell.trim());
}

function table(lines, start) {
  const header = splitRow(lines[start]);
  const aligns = splitRow(lines[start + 1]).map((cell) => {
    const left = cell.startsWith(":");
    const right = cell.endsWith(":");
    return left && right ? "center" : right ? "right" : left ? "left" : "";
  });
  const cell = (tag, text, col) => {
    const align = aligns[col] ? ` class="align-${aligns[col]}"` : "";
    return `<${tag}${align}>${renderInline(text.replace(/\\\|/g, "|"))}</${tag}>`;
  };
  let html = `<thead><tr>${header.map((text, col) => cell("th", text, col)).join("")}</tr></thead><tbody>`;
  let i = start + 2;
  while (i < lines.length && !isBlank(lines[i]) && lines[i].includes("|")) {
    const cells = splitRow(lines[i]);
    html += `<tr>${header.map((_, col) => cell("td", cells[col] ?? "", col)).join("")}</tr>`;
    i++;
  }
  return {html: `<div class="table-wrap"><table>${html}</tbody></table></div>`, end: i};
}

function paragraph(lines, start) {
  const text = [lines[start]];
  let i = start + 1;
  while (i < lines.length && !isBlank(lines[i]) && !startsBlock(lines, i)) {
    text.push(lines[i]);
    i++;
  }
  return {html: `<p>${renderInline(text.join("\n"))}</p>`, end: i};
}

// ---- inline ----------------------------------------------------------------------------------------
// `s` is already escaped. Each matcher returns {html, end} or null (then the character is text).
const PUNCTUATION_ESCAPE = /[\\`*_{}[\]()#+\-.!~|]/;
const URL_BODY = /^https?:\/\/(?:[^\s&<>"'`]|&amp;)+/i;
const WORD_CHAR = /[\p{L}\p{N}]/u;

function renderInline(s, allowLinks = true) {
  let html = "";
  let text = 0; // start of the pending plain text
  let i = 0;
  while (i < s.length) {
    const c = s[i];
    let match = null;
    if (c === "\\" && PUNCTUATION_ESCAPE.test(s[i + 1] ?? "")) match = {html: s[i + 1], end: i + 2};
    else if (c === "`") match = codeSpan(s, i);
    else if (c === "*" || c === "_" || c === "~") match = emphasis(s, i, allowLinks);
    else if (allowLinks && c === "[") match = link(s, i);
    else if (allowLinks && (c === "h" || c === "H")) match = autolink(s, i);
    if (match === null) {
      i++;
      continue;
    }
    html += s.slice(text, i) + match.html;
    i = text = match.end;
  }
  return html + s.slice(text);
}

function codeSpan(s, i) {
  let n = 1;
  while (s[i + n] === "`") n++;
  const ticks = "`".repeat(n);
  let close = s.indexOf(ticks, i + n);
  // The closing run must have exactly n backticks.
  while (close !== -1 && s[close + n] === "`") {
    let end = close;
    while (s[end] === "`") end++;
    close = s.indexOf(ticks, end);
  }
  if (close === -1) return {html: ticks, end: i + n}; // an unmatched run is literal text
  let code = s.slice(i + n, close);
  if (code.length > 2 && code.startsWith(" ") && code.endsWith(" ") && code.trim()) code = code.slice(1, -1);
  return {html: `<code>${code}</code>`, end: close + n};
}

function emphasis(s, i, allowLinks) {
  const c = s[i];
  const double = s[i + 1] === c;
  if (c === "~" && !double) return null;
  const run = double ? c + c : c;
  const open = i + run.length;
  if (open >= s.length || /\s/.test(s[open])) return null;
  if (c === "_" && i > 0 && WORD_CHAR.test(s[i - 1])) return null; // snake_case is not emphasis
  for (let j = s.indexOf(run, open + 1); j !== -1; j = s.indexOf(run, j + 1)) {
    if (/\s/.test(s[j - 1])) continue;
    if (!double && (s[j + 1] === c || s[j - 1] === c)) continue; // part of a double run
    if (c === "_" && WORD_CHAR.test(s[j + run.length] ?? "")) continue;
    const tag = c === "~" ? "del" : double ? "strong" : "em";
    return {html: `<${tag}>${renderInline(s.slice(open, j), allowLinks)}</${tag}>`, end: j + run.length};
  }
  return null;
}

/** Index just past the bracket that closes the one at `i` (`open`/`close` are single characters). */
function matching(s, i, open, close) {
  let depth = 0;
  for (let j = i; j < s.length; j++) {
    if (s[j] === "\\") j++;
    else if (s[j] === open) depth++;
    else if (s[j] === close && --depth === 0) return j + 1;
    else if (s[j] === "\n" && s[j + 1] === "\n") return -1;
  }
  return -1;
}

function link(s, i) {
  const labelEnd = matching(s, i, "[", "]");
  if (labelEnd === -1 || s[labelEnd] !== "(") return null;
  const targetEnd = matching(s, labelEnd, "(", ")");
  if (targetEnd === -1) return null;
  const label = s.slice(i + 1, labelEnd - 1);
  const target = s.slice(labelEnd + 1, targetEnd - 1).trim().split(/\s+/)[0] ?? "";
  const url = URL_BODY.exec(target);
  if (!url || url[0] !== target || !label.trim()) return null; // not an http(s) link: stays text
  return {html: anchor(target, renderInline(label, false)), end: targetEnd};
}

function autolink(s, i) {
  if (i > 0 && (WORD_CHAR.test(s[i - 1]) || s[i - 1] === "/")) return null;
  const match = URL_BODY.exec(s.slice(i, i + 2048));
  if (!match) return null;
  let url = match[0];
  // Trailing punctuation belongs to the sentence, a closing parenthesis only if unbalanced.
  for (;;) {
    const last = url[url.length - 1];
    if (".,;:!?*_~".includes(last)) url = url.slice(0, -1);
    else if (last === ")" && url.split("(").length < url.split(")").length) url = url.slice(0, -1);
    else if (url.endsWith("&amp;")) url = url.slice(0, -5);
    else break;
  }
  if (!/^https?:\/\/./i.test(url)) return null;
  return {html: anchor(url, url), end: i + url.length};
}

function anchor(href, labelHtml) {
  return `<a href="${href}" target="_blank" rel="noopener noreferrer">${labelHtml}</a>`;
}
