// The chat application: wires the conversation store, the views and the generations together.

import {ApiError, listModels} from "./api.js";
import {ChatView} from "./chat_view.js";
import {confirmDialog, toast} from "./dialogs.js";
import {el, fillIcons, icon} from "./dom.js";
import {Generation, requestBody, requestMessages} from "./generation.js";
import {loadSettings, saveSettings} from "./settings.js";
import {SettingsDialog} from "./settings_dialog.js";
import {Sidebar} from "./sidebar.js";
import {ConversationStore, ImportError, newId} from "./store.js";
import {currentTheme, followSystemTheme, toggleTheme} from "./theme.js";

const ACTIVE_KEY = "novainfer.activeConversation";
const PHONE_QUERY = window.matchMedia("(max-width: 768px)");
const $ = (id) => document.getElementById(id);

class App {
  constructor() {
    this.store = new ConversationStore();
    this.settings = loadSettings();
    this.generations = new Map(); // conversation id -> its running Generation
    this.activeId = this.store.get(localStorage.getItem(ACTIVE_KEY) ?? "")?.id ?? null; // reopen the last one
    this.input = $("prompt-input");
    this.view = new ChatView({list: $("message-list"), scroller: $("messages"), empty: $("empty-state")}, {
      onEdit: (id, text) => this.editAndRegenerate(id, text),
      onRegenerate: (id) => this.regenerate(id),
      onOpenSettings: () => this.settingsDialog.open(this.settings),
      onToast: toast,
    });
    this.sidebar = new Sidebar({list: $("conversation-list"), search: $("search-input")}, this.store, {
      onSelect: (id) => this.select(id),
      onDelete: (id) => this.remove(id),
    });
    this.settingsDialog = new SettingsDialog((settings) => this.applySettings(settings));
    this.store.addEventListener("change", () => this.sidebar.update(this.activeId, this.runningIds()));
    this.store.addEventListener("error", () => toast("Could not save the conversations: the browser storage is full "
      + "or disabled. Export them, then delete old ones.", "error"));
    this.bindControls();
    fillIcons(document.body);
    this.showThemeIcon();
    this.refresh();
    this.loadModels();
    this.focusInput();
  }

  // ---- state -----------------------------------------------------------------------------------
  active() {
    return this.activeId ? this.store.get(this.activeId) : null;
  }

  runningIds() {
    return new Set(this.generations.keys());
  }

  setActive(id) {
    this.activeId = id;
    try {
      if (id) localStorage.setItem(ACTIVE_KEY, id);
      else localStorage.removeItem(ACTIVE_KEY);
    } catch {
      // Only the reopened conversation after a reload is lost.
    }
  }

  /** Redraws everything that depends on the open conversation. */
  refresh() {
    const conversation = this.active();
    const running = conversation !== null && this.generations.has(conversation.id);
    this.view.show(conversation, running);
    this.sidebar.update(this.activeId, this.runningIds());
    const title = conversation?.title ?? "New chat";
    $("conversation-title").textContent = title;
    document.title = conversation ? `${title} · NovaInfer` : "NovaInfer Chat";
    $("send-btn").hidden = running;
    $("stop-btn").hidden = !running;
    this.updateSendButton();
  }

  /** Puts the cursor in the message box, except on a phone, where that would pop up the keyboard. */
  focusInput() {
    if (!PHONE_QUERY.matches) this.input.focus();
  }

  updateSendButton() {
    $("send-btn").disabled = !this.input.value.trim();
  }

  // ---- generating ------------------------------------------------------------------------------
  send() {
    const text = this.input.value;
    if (!text.trim()) return;
    let conversation = this.active();
    if (conversation && this.generations.has(conversation.id)) return;
    if (!conversation) {
      conversation = this.store.create(text);
      this.setActive(conversation.id);
    }
    conversation.messages.push({id: newId(), role: "user", content: text});
    this.input.value = "";
    this.resizeInput();
    this.generate(conversation);
  }

  /** Starts an answer to the conversation as it stands. */
  generate(conversation) {
    const turns = conversation.messages.slice();
    const message = {id: newId(), role: "assistant", content: "", pending: true};
    conversation.messages.push(message);
    const body = requestBody(this.settings, requestMessages(this.settings.systemPrompt, turns));
    const generation = new Generation(message, body, {
      apiKey: this.settings.apiKey,
      stream: this.settings.stream,
      onUpdate: () => {
        if (!message.pending) return; // the end is handled below
        this.store.saveSoon();
        if (conversation.id === this.activeId) this.view.updateStreaming(message);
      },
    });
    this.generations.set(conversation.id, generation);
    this.store.changed(conversation);
    this.refresh();
    generation.run().then(() => {
      // An edit may have replaced this generation by a newer one: only the current one is removed.
      if (this.generations.get(conversation.id) === generation) this.generations.delete(conversation.id);
      this.store.changed(conversation);
      if (conversation.id === this.activeId) this.refresh();
      else this.sidebar.update(this.activeId, this.runningIds());
    });
  }

  stop() {
    this.generations.get(this.activeId)?.stop();
  }

  /** Replaces a user message and everything after it, then answers again. */
  editAndRegenerate(messageId, text) {
    const conversation = this.active();
    const index = conversation?.messages.findIndex((m) => m.id === messageId) ?? -1;
    if (index < 0) return;
    this.generations.get(conversation.id)?.stop();
    conversation.messages = conversation.messages.slice(0, index);
    conversation.messages.push({id: newId(), role: "user", content: text});
    this.generate(conversation);
  }

  /** Answers again in place of an answer (the last one). */
  regenerate(messageId) {
    const conversation = this.active();
    const index = conversation?.messages.findIndex((m) => m.id === messageId) ?? -1;
    if (index < 0 || this.generations.has(conversation.id)) return;
    conversation.messages = conversation.messages.slice(0, index);
    this.generate(conversation);
  }

  // ---- conversations ---------------------------------------------------------------------------
  select(id) {
    this.setActive(id);
    this.closeSidebar();
    this.refresh();
    this.focusInput();
  }

  newChat() {
    this.setActive(null);
    this.closeSidebar();
    this.refresh();
    this.focusInput();
  }

  async remove(id) {
    const conversation = this.store.get(id);
    if (!conversation || !await confirmDialog(`Delete “${conversation.title}”? This cannot be undone.`)) return;
    this.generations.get(id)?.stop();
    this.store.remove(id);
    if (id === this.activeId) this.setActive(null);
    this.refresh();
  }

  exportAll() {
    const blob = new Blob([this.store.exportJSON()], {type: "application/json"});
    const url = URL.createObjectURL(blob);
    const link = el("a", {href: url, download: `novainfer-chats-${new Date().toISOString().slice(0, 10)}.json`});
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  }

  async importFile(file) {
    try {
      const count = this.store.importJSON(await file.text());
      toast(`Imported ${count} conversation${count === 1 ? "" : "s"}`);
    } catch (err) {
      const reason = err instanceof ImportError ? err.message : `the file could not be read (${err.message})`;
      toast(`Import failed: ${reason}`, "error");
    }
  }

  // ---- settings and models ---------------------------------------------------------------------
  applySettings(settings) {
    const keyChanged = settings.apiKey !== this.settings.apiKey;
    this.settings = settings;
    if (!saveSettings(settings)) toast("Could not save the settings: the browser storage is disabled.", "error");
    if (keyChanged) this.loadModels();
  }

  async loadModels() {
    const select = $("model-select");
    let models = [];
    let problem = null;
    try {
      models = await listModels(this.settings.apiKey);
    } catch (err) {
      problem = err instanceof ApiError && err.status === 401
        ? "The server needs an API key: set it in Settings." : `Could not load the models (${err.message}).`;
    }
    const ids = models.map((m) => m.id);
    if (ids.length && !ids.includes(this.settings.model)) {
      this.settings = {...this.settings, model: ids[0]};
      saveSettings(this.settings);
    }
    const options = ids.length ? ids : [this.settings.model];
    select.replaceChildren(...options.map((id) => el("option", {value: id}, id || "Default model")));
    select.value = this.settings.model;
    select.title = problem ?? "Model";
    if (problem) toast(problem, "error");
  }

  // ---- controls --------------------------------------------------------------------------------
  resizeInput() {
    this.input.style.height = "auto";
    this.input.style.height = `${Math.min(this.input.scrollHeight, 240)}px`;
    this.updateSendButton();
  }

  openSidebar() {
    document.body.classList.add("sidebar-open");
    $("scrim").hidden = false;
  }

  closeSidebar() {
    document.body.classList.remove("sidebar-open");
    $("scrim").hidden = true;
  }

  showThemeIcon() {
    const dark = currentTheme() === "dark";
    const button = $("theme-btn");
    button.replaceChildren(icon(dark ? "sun" : "moon"));
    button.setAttribute("aria-label", dark ? "Switch to the light theme" : "Switch to the dark theme");
  }

  bindControls() {
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    this.input.addEventListener("input", () => this.resizeInput());
    this.input.addEventListener("keydown", (event) => {
      // Enter sends, Shift+Enter is a new line; Enter that ends an IME composition only commits it.
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing && event.keyCode !== 229) {
        event.preventDefault();
        this.send();
      }
    });
    $("stop-btn").addEventListener("click", () => this.stop());
    $("new-chat-btn").addEventListener("click", () => this.newChat());
    $("settings-btn").addEventListener("click", () => this.settingsDialog.open(this.settings));
    $("theme-btn").addEventListener("click", () => {
      toggleTheme();
      this.showThemeIcon();
    });
    followSystemTheme(() => this.showThemeIcon());
    $("model-select").addEventListener("change", (event) => {
      this.settings = {...this.settings, model: event.target.value};
      saveSettings(this.settings);
    });
    $("export-btn").addEventListener("click", () => this.exportAll());
    $("import-btn").addEventListener("click", () => $("import-file").click());
    $("import-file").addEventListener("change", async (event) => {
      const [file] = event.target.files;
      event.target.value = ""; // choosing the same file again must fire "change" again
      if (file) await this.importFile(file);
    });
    $("open-sidebar-btn").addEventListener("click", () => this.openSidebar());
    $("close-sidebar-btn").addEventListener("click", () => this.closeSidebar());
    $("scrim").addEventListener("click", () => this.closeSidebar());
    PHONE_QUERY.addEventListener("change", () => this.closeSidebar());
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && document.body.classList.contains("sidebar-open")) this.closeSidebar();
    });
    // A streaming answer is saved at intervals; the last part is written when the page goes away.
    window.addEventListener("pagehide", () => this.store.save());
  }
}

new App();
