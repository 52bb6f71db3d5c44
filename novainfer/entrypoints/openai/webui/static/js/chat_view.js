// The message list of the open conversation: rendering, streaming updates, inline editing of user
// messages, copy buttons, and the debug panel of each answer.
//
// Each message body keeps the exact text it shows in `data-raw` (the Markdown source for answers).

import {copyText, el, icon, iconButton} from "./dom.js";
import {renderMarkdown} from "./markdown.js";

const NEAR_BOTTOM_PX = 96;

function formatNumber(value, digits = 0) {
  return typeof value === "number" && Number.isFinite(value)
    ? value.toLocaleString(undefined, {maximumFractionDigits: digits, minimumFractionDigits: digits}) : "—";
}

const FINISH_REASONS = {
  stop: "stop (end of answer or a stop sequence)",
  length: "length (max tokens reached)",
  abort: "abort (stopped)",
};

/** The rows of an answer's debug panel: [label, value]. */
function debugRows(debug) {
  return [
    ["Request id", debug.request_id ?? "—"],
    ["Model", debug.model ?? "—"],
    ["Time to first token", debug.ttft_ms === undefined ? "—" : `${formatNumber(debug.ttft_ms)} ms`],
    ["Speed", debug.tokens_per_s === undefined ? "—" : `${formatNumber(debug.tokens_per_s, 1)} tokens/s`],
    ["Prompt tokens", formatNumber(debug.prompt_tokens)],
    ["Cached prompt tokens", formatNumber(debug.cached_tokens)],
    ["Completion tokens", formatNumber(debug.completion_tokens)],
    ["Finish reason", FINISH_REASONS[debug.finish_reason] ?? debug.finish_reason ?? "—"],
    ["Total time", debug.elapsed_ms === undefined ? "—" : `${formatNumber(debug.elapsed_ms)} ms`],
  ];
}

/** The short line on an answer's debug toggle. */
function debugSummary(debug) {
  const parts = [];
  if (debug.completion_tokens !== undefined) parts.push(`${formatNumber(debug.completion_tokens)} tokens`);
  if (debug.tokens_per_s !== undefined) parts.push(`${formatNumber(debug.tokens_per_s, 1)} tok/s`);
  if (debug.finish_reason === "abort") parts.push("stopped");
  return parts.join(" · ") || "Details";
}

export class ChatView {
  /**
   * @param {{list: HTMLElement, scroller: HTMLElement, empty: HTMLElement}} elements
   * @param {{onEdit: (messageId: string, text: string) => void, onRegenerate: (messageId: string) => void,
   *          onOpenSettings: () => void, onToast: (text: string, kind?: string) => void}} actions
   */
  constructor(elements, actions) {
    this.list = elements.list;
    this.scroller = elements.scroller;
    this.empty = elements.empty;
    this.actions = actions;
    this.conversation = null;
    this.running = false;
    this.editingId = null;
    this.editDraft = null; // the editor's text, kept when the list is redrawn under it
    this.openDebug = new Set(); // ids of messages whose debug panel is open
    this.frame = null;
    this.dirty = new Set();
    this.list.addEventListener("click", (event) => this.onClick(event));
  }

  /** Shows `conversation` (or the empty state for null); `running`: an answer is being generated. */
  show(conversation, running) {
    const switched = conversation?.id !== this.conversation?.id;
    this.conversation = conversation;
    this.running = running;
    if (switched) this.stopEditing();
    const stick = switched || this.nearBottom();
    this.render();
    if (stick) this.scrollToBottom();
  }

  render() {
    const messages = this.conversation?.messages ?? [];
    this.empty.hidden = messages.length > 0;
    const lastAssistant = messages.findLastIndex((m) => m.role === "assistant");
    this.list.replaceChildren(...messages.map((m, i) => (m.role === "user"
      ? this.userMessage(m) : this.assistantMessage(m, i === lastAssistant))));
  }

  /** Redraws a streaming message's text at the next frame (many tokens may share one frame). */
  updateStreaming(message) {
    this.dirty.add(message);
    if (this.frame !== null) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = null;
      const stick = this.nearBottom();
      for (const m of this.dirty) {
        const body = this.list.querySelector(`[data-id="${m.id}"] .msg-body`);
        if (body) this.fillAssistantBody(body, m);
      }
      this.dirty.clear();
      if (stick) this.scrollToBottom();
    });
  }

  nearBottom() {
    const s = this.scroller;
    return s.scrollHeight - s.scrollTop - s.clientHeight < NEAR_BOTTOM_PX;
  }

  scrollToBottom() {
    this.scroller.scrollTop = this.scroller.scrollHeight;
  }

  // ---- messages --------------------------------------------------------------------------------
  userMessage(message) {
    if (message.id === this.editingId) return this.editor(message);
    const body = el("div", {class: "msg-body msg-text"}, message.content);
    body.dataset.raw = message.content;
    const actions = el("div", {class: "msg-actions"},
      iconButton("edit", "Edit and regenerate", () => this.startEditing(message.id), "edit-btn"),
      iconButton("copy", "Copy", () => this.copy(message.content), "copy-btn"));
    return el("article", {class: "msg msg-user", dataset: {id: message.id, role: "user"}}, body, actions);
  }

  editor(message) {
    const area = el("textarea", {class: "edit-input", rows: 3, "aria-label": "Edit message"});
    area.value = this.editDraft ?? message.content;
    area.addEventListener("input", () => { this.editDraft = area.value; });
    const save = () => {
      const text = area.value;
      if (!text.trim()) return;
      this.stopEditing();
      this.actions.onEdit(message.id, text);
    };
    const cancel = () => {
      this.stopEditing();
      this.render();
    };
    area.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        save();
      } else if (event.key === "Escape") {
        cancel();
      }
    });
    requestAnimationFrame(() => {
      area.focus();
      area.setSelectionRange(area.value.length, area.value.length);
    });
    return el("article", {class: "msg msg-user editing", dataset: {id: message.id, role: "user"}},
      el("div", {class: "edit-box"}, area,
        el("div", {class: "edit-actions"},
          el("span", {class: "edit-note"}, "Later messages will be replaced."),
          el("button", {type: "button", class: "btn", onclick: cancel}, "Cancel"),
          el("button", {type: "button", class: "btn btn-primary save-edit-btn", onclick: save}, "Save & regenerate"))));
  }

  startEditing(id) {
    this.editingId = id;
    this.editDraft = null;
    this.render();
  }

  stopEditing() {
    this.editingId = null;
    this.editDraft = null;
  }

  assistantMessage(message, isLast) {
    const body = el("div", {class: "msg-body markdown"});
    this.fillAssistantBody(body, message);
    const article = el("article", {class: "msg msg-assistant", dataset: {id: message.id, role: "assistant"}}, body);
    if (message.error) article.append(this.errorBox(message));
    if (message.pending) return article;

    const actions = el("div", {class: "msg-actions"});
    if (message.content) actions.append(iconButton("copy", "Copy", () => this.copy(message.content), "copy-btn"));
    if (isLast && !this.running) {
      actions.append(iconButton("refresh", message.error ? "Retry" : "Regenerate",
        () => this.actions.onRegenerate(message.id), "regenerate-btn"));
    }
    if (message.debug) {
      const panelId = `debug-${message.id}`;
      const open = this.openDebug.has(message.id);
      const panel = el("dl", {class: "msg-debug", id: panelId, hidden: !open},
        ...debugRows(message.debug).flatMap(([label, value]) => [el("dt", {}, label), el("dd", {}, String(value))]));
      const toggle = el("button", {type: "button", class: "debug-toggle", "aria-expanded": String(open),
        "aria-controls": panelId, title: "Request details"}, icon("info"), el("span", {}, debugSummary(message.debug)));
      toggle.addEventListener("click", () => {
        const nowOpen = panel.hidden;
        panel.hidden = !nowOpen;
        toggle.setAttribute("aria-expanded", String(nowOpen));
        if (nowOpen) {
          this.openDebug.add(message.id);
          panel.scrollIntoView({block: "nearest"});
        } else {
          this.openDebug.delete(message.id);
        }
      });
      actions.append(toggle);
      article.append(actions, panel);
    } else {
      article.append(actions);
    }
    return article;
  }

  fillAssistantBody(body, message) {
    body.dataset.raw = message.content;
    if (message.pending && !message.content) {
      body.replaceChildren(el("span", {class: "typing", "aria-label": "Waiting for the answer"},
        el("i"), el("i"), el("i")));
      return;
    }
    if (!message.pending && !message.content && !message.error) {
      body.replaceChildren(el("p", {class: "empty-answer"}, "(The model returned an empty answer.)"));
      return;
    }
    // Safe: renderMarkdown escapes all of the text before it adds any markup of its own.
    body.innerHTML = renderMarkdown(message.content);
    body.classList.toggle("streaming", Boolean(message.pending));
  }

  errorBox(message) {
    const box = el("div", {class: "msg-error"}, icon("info"), el("span", {}, message.error.message));
    if (message.error.status === 401) {
      box.append(el("button", {type: "button", class: "btn btn-small", onclick: () => this.actions.onOpenSettings()},
        "Open settings"));
    }
    return box;
  }

  // ---- copying ---------------------------------------------------------------------------------
  async copy(text, button = null) {
    try {
      await copyText(text);
      if (button) {
        button.textContent = "Copied";
        setTimeout(() => { button.textContent = "Copy"; }, 1500);
      } else {
        this.actions.onToast("Copied to the clipboard");
      }
    } catch (err) {
      this.actions.onToast(`Could not copy: ${err.message}`, "error");
    }
  }

  onClick(event) {
    const button = event.target.closest(".copy-code");
    if (!button) return;
    const code = button.closest(".code-block")?.querySelector("code");
    if (code) this.copy(code.textContent, button);
  }
}
