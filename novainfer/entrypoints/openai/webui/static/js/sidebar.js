// The conversation list: grouped by day, filtered by the search box, with rename and delete.

import {el, iconButton} from "./dom.js";

const DAY_MS = 24 * 60 * 60 * 1000;

function groupName(time, now) {
  const startOfToday = new Date(now).setHours(0, 0, 0, 0);
  if (time >= startOfToday) return "Today";
  if (time >= startOfToday - DAY_MS) return "Yesterday";
  if (time >= startOfToday - 7 * DAY_MS) return "Previous 7 days";
  return "Older";
}

export class Sidebar {
  /**
   * @param {{list: HTMLElement, search: HTMLInputElement}} elements
   * @param {import("./store.js").ConversationStore} store
   * @param {{onSelect: (id: string) => void, onDelete: (id: string) => void}} actions
   */
  constructor(elements, store, actions) {
    this.list = elements.list;
    this.search = elements.search;
    this.store = store;
    this.actions = actions;
    this.activeId = null;
    this.running = new Set();
    this.renamingId = null;
    this.search.addEventListener("input", () => this.render());
  }

  /** Redraws the list; `activeId` is the open conversation, `running` the ids generating an answer. */
  update(activeId, running) {
    this.activeId = activeId;
    this.running = running;
    this.render();
  }

  render() {
    const query = this.search.value;
    const conversations = this.store.list(query);
    if (conversations.length === 0) {
      this.list.replaceChildren(el("p", {class: "conversation-empty"},
        query.trim() ? "No conversation matches." : "No conversations yet."));
      return;
    }
    const now = Date.now();
    const nodes = [];
    let group = null;
    for (const conversation of conversations) {
      const name = groupName(conversation.updated, now);
      if (name !== group) {
        group = name;
        nodes.push(el("h3", {class: "conversation-group"}, name));
      }
      nodes.push(this.item(conversation));
    }
    this.list.replaceChildren(...nodes);
  }

  item(conversation) {
    const active = conversation.id === this.activeId;
    const classes = ["conversation", active ? "active" : "", this.running.has(conversation.id) ? "running" : ""];
    const row = el("div", {class: classes.join(" ").trim(), dataset: {id: conversation.id}});
    if (conversation.id === this.renamingId) {
      row.append(this.renameInput(conversation));
      return row;
    }
    row.append(
      el("button", {type: "button", class: "conversation-open", title: conversation.title,
        "aria-current": active ? "page" : null, onclick: () => this.actions.onSelect(conversation.id)},
      el("span", {class: "conversation-dot", "aria-hidden": "true"}),
      el("span", {class: "conversation-title"}, conversation.title)),
      el("div", {class: "conversation-actions"},
        iconButton("edit", "Rename", () => this.startRenaming(conversation.id), "rename-btn"),
        iconButton("trash", "Delete", () => this.actions.onDelete(conversation.id), "delete-btn")));
    return row;
  }

  startRenaming(id) {
    this.renamingId = id;
    this.render();
  }

  renameInput(conversation) {
    const input = el("input", {type: "text", class: "rename-input", "aria-label": "Conversation title",
      maxlength: 200});
    input.value = conversation.title;
    let done = false;
    const finish = (save) => {
      if (done) return;
      done = true;
      this.renamingId = null;
      if (save) this.store.rename(conversation.id, input.value); // emits "change": the list redraws
      this.render();
    };
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.isComposing) {
        event.preventDefault();
        finish(true);
      } else if (event.key === "Escape") {
        finish(false);
      }
    });
    input.addEventListener("blur", () => finish(true));
    requestAnimationFrame(() => {
      input.focus();
      input.select();
    });
    return input;
  }
}
