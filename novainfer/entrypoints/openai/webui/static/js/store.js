// Conversations, kept in localStorage, with export to and import from JSON files.
//
// A conversation is {id, title, created, updated, messages}; a message is
// {id, role: "user" | "assistant", content, debug?, error?}. The system prompt is a setting, sent
// before every conversation, and is not stored here.

const KEY = "novainfer.conversations";
const EXPORT_FORMAT = "novainfer-chats";
const EXPORT_VERSION = 1;
const TITLE_LENGTH = 48;

export function newId() {
  return crypto.randomUUID ? crypto.randomUUID()
    : `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 12)}`;
}

/** A title from the first words of a message. */
function titleFrom(text) {
  const flat = text.replace(/\s+/g, " ").trim();
  if (!flat) return "New chat";
  return flat.length > TITLE_LENGTH ? `${flat.slice(0, TITLE_LENGTH - 1).trimEnd()}…` : flat;
}

/** Raised for an import file that is not a valid export; the message says what is wrong and where. */
export class ImportError extends Error {
  constructor(message) {
    super(message);
    this.name = "ImportError";
  }
}

const DEBUG_FIELDS = {
  request_id: "string", model: "string", finish_reason: "string", ttft_ms: "number", tokens_per_s: "number",
  prompt_tokens: "number", cached_tokens: "number", completion_tokens: "number", elapsed_ms: "number",
};

function checkMessage(value, where) {
  if (!value || typeof value !== "object" || Array.isArray(value)) {
    throw new ImportError(`${where} must be an object`);
  }
  if (value.role !== "user" && value.role !== "assistant") {
    throw new ImportError(`${where}.role must be "user" or "assistant", got ${JSON.stringify(value.role)}`);
  }
  if (typeof value.content !== "string") {
    throw new ImportError(`${where}.content must be a string, got ${typeof value.content}`);
  }
  const message = {id: newId(), role: value.role, content: value.content};
  if (value.debug && typeof value.debug === "object") {
    message.debug = {};
    for (const [field, type] of Object.entries(DEBUG_FIELDS)) {
      if (typeof value.debug[field] === type) message.debug[field] = value.debug[field];
    }
  }
  if (value.error && typeof value.error === "object" && typeof value.error.message === "string") {
    message.error = {message: value.error.message};
    if (Number.isInteger(value.error.status)) message.error.status = value.error.status;
  }
  return message;
}

function checkConversation(value, where) {
  if (!value || typeof value !== "object" || Array.isArray(value)) {
    throw new ImportError(`${where} must be an object`);
  }
  if (!Array.isArray(value.messages)) throw new ImportError(`${where}.messages must be an array`);
  if (value.title !== undefined && typeof value.title !== "string") {
    throw new ImportError(`${where}.title must be a string, got ${typeof value.title}`);
  }
  const messages = value.messages.map((m, i) => checkMessage(m, `${where}.messages[${i}]`));
  const now = Date.now();
  const time = (t) => (typeof t === "number" && Number.isFinite(t) && t > 0 ? t : now);
  const firstUser = messages.find((m) => m.role === "user");
  return {
    id: typeof value.id === "string" && value.id ? value.id : newId(),
    title: value.title?.trim() || titleFrom(firstUser?.content ?? ""),
    created: time(value.created),
    updated: time(value.updated ?? value.created),
    messages,
  };
}

/** The conversations of an export file's text; throws ImportError naming the first problem. */
export function parseExport(text) {
  let data;
  try {
    data = JSON.parse(text);
  } catch (err) {
    throw new ImportError(`the file is not valid JSON (${err.message})`);
  }
  const list = Array.isArray(data) ? data : data?.conversations;
  if (!Array.isArray(list)) {
    throw new ImportError(`expected an export of this app: an object with a "conversations" array`);
  }
  if (!Array.isArray(data) && data.format !== undefined && data.format !== EXPORT_FORMAT) {
    throw new ImportError(`"format" must be "${EXPORT_FORMAT}", got ${JSON.stringify(data.format)}`);
  }
  return list.map((c, i) => checkConversation(c, `conversations[${i}]`));
}

export class ConversationStore extends EventTarget {
  constructor(storage = window.localStorage) {
    super();
    this.storage = storage;
    this.conversations = this.load();
    this.saveTimer = null;
  }

  load() {
    try {
      const list = parseExport(this.storage.getItem(KEY) || "[]");
      // A page closed mid-answer left an assistant message without an end; say so rather than hide it.
      for (const conversation of list) {
        for (const message of conversation.messages) {
          if (message.role === "assistant" && !message.content && !message.error && !message.debug) {
            message.error = {message: "The page was closed before this answer arrived."};
          }
        }
      }
      return list;
    } catch (err) {
      console.error("stored conversations are unreadable; starting empty", err);
      return [];
    }
  }

  /** Writes everything now. Returns false (and emits "error") if the browser refused. */
  save() {
    clearTimeout(this.saveTimer);
    this.saveTimer = null;
    try {
      this.storage.setItem(KEY, JSON.stringify(this.conversations, (key, value) =>
        (key === "pending" ? undefined : value)));
      return true;
    } catch (err) {
      this.dispatchEvent(new CustomEvent("error", {detail: err}));
      return false;
    }
  }

  /** Writes within a moment: for the many small changes of a streaming answer. */
  saveSoon() {
    if (this.saveTimer === null) this.saveTimer = setTimeout(() => this.save(), 500);
  }

  changed(conversation, {persist = true} = {}) {
    if (conversation) conversation.updated = Date.now();
    if (persist) this.save();
    this.dispatchEvent(new Event("change"));
  }

  get(id) {
    return this.conversations.find((c) => c.id === id) ?? null;
  }

  /** Most recently updated first; `query` filters on the title and the messages' text. */
  list(query = "") {
    const needle = query.trim().toLowerCase();
    const sorted = [...this.conversations].sort((a, b) => b.updated - a.updated);
    if (!needle) return sorted;
    return sorted.filter((c) => c.title.toLowerCase().includes(needle)
      || c.messages.some((m) => m.content.toLowerCase().includes(needle)));
  }

  create(firstText) {
    const now = Date.now();
    const conversation = {id: newId(), title: titleFrom(firstText), created: now, updated: now, messages: []};
    this.conversations.push(conversation);
    this.changed(conversation);
    return conversation;
  }

  rename(id, title) {
    const conversation = this.get(id);
    const trimmed = title.trim();
    if (!conversation || !trimmed || trimmed === conversation.title) return;
    conversation.title = trimmed;
    this.changed(conversation);
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    this.changed(null);
  }

  exportJSON() {
    const conversations = this.conversations.map(({id, title, created, updated, messages}) => ({
      id, title, created, updated,
      messages: messages.map(({role, content, debug, error}) => ({role, content, debug, error})),
    }));
    return JSON.stringify({format: EXPORT_FORMAT, version: EXPORT_VERSION, exported: new Date().toISOString(),
      conversations}, null, 2);
  }

  /** Adds the conversations of an export file; returns how many. Throws ImportError, adding nothing. */
  importJSON(text) {
    const imported = parseExport(text);
    const ids = new Set(this.conversations.map((c) => c.id));
    for (const conversation of imported) {
      if (ids.has(conversation.id)) conversation.id = newId(); // an import never overwrites
      ids.add(conversation.id);
      this.conversations.push(conversation);
    }
    this.changed(null);
    return imported.length;
  }
}
