// Toasts (short notices) and the confirmation dialog.

import {el, icon} from "./dom.js";

const TOAST_MS = {info: 2500, error: 7000};

/** Shows a short notice; errors stay longer and are announced as alerts. */
export function toast(text, kind = "info") {
  const container = document.getElementById("toasts");
  const node = el("div", {class: `toast toast-${kind}`, role: kind === "error" ? "alert" : null},
    icon(kind === "error" ? "info" : "check"), el("span", {}, text));
  container.append(node);
  setTimeout(() => {
    node.classList.add("leaving");
    setTimeout(() => node.remove(), 200);
  }, TOAST_MS[kind] ?? TOAST_MS.info);
}

/** Asks a yes/no question in a modal dialog; resolves true if the user confirmed. */
export function confirmDialog(message, confirmLabel = "Delete") {
  const dialog = document.getElementById("confirm-dialog");
  document.getElementById("confirm-message").textContent = message;
  document.getElementById("confirm-ok-btn").textContent = confirmLabel;
  dialog.returnValue = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), {once: true});
    dialog.showModal();
  });
}
