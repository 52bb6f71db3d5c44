// Building DOM nodes. Text always goes in through textContent, never as markup.

const SVG_NS = "http://www.w3.org/2000/svg";

// Outline icons on a 24x24 grid, drawn with one stroked path each ("fill:" paths are filled).
const ICONS = {
  "arrow-up": "M12 19V5M5.5 11.5 12 5l6.5 6.5",
  check: "M5 12.5l4.5 4.5L19 7.5",
  copy: "M9 9h10.5v10.5H9zM15 9V4.5H4.5V15H9",
  download: "M12 4v11M7 10.5l5 5 5-5M5 20h14",
  edit: "M4 20h4L19.5 8.5a2.1 2.1 0 0 0-4-4L4 16zM14 6l4 4",
  info: "M12 3a9 9 0 1 0 0 18 9 9 0 0 0 0-18zM12 11v5.5M12 7.5v.5",
  logo: "M7 18V6l10 12V6",
  menu: "M4 6.5h16M4 12h16M4 17.5h16",
  moon: "M20 14.5A8.5 8.5 0 1 1 9.5 4a6.8 6.8 0 0 0 10.5 10.5z",
  plus: "M12 5v14M5 12h14",
  refresh: "M19.5 12a7.5 7.5 0 1 1-2.2-5.3M19.5 4.5v4.5H15",
  search: "M10.5 4a6.5 6.5 0 1 0 0 13 6.5 6.5 0 0 0 0-13zM20 20l-4.8-4.8",
  sliders: "M4 7h8M16 7h4M14 5v4M4 12h3M11 12h9M9 10v4M4 17h10M18 17h2M16 15v4",
  stop: "fill:M7 7h10v10H7z",
  sun: "M12 8a4 4 0 1 0 0 8 4 4 0 0 0 0-8zM12 2.5v2M12 19.5v2M2.5 12h2M19.5 12h2"
    + "M4.6 4.6 6 6M18 18l1.4 1.4M4.6 19.4 6 18M18 6l1.4-1.4",
  trash: "M4.5 7h15M10 7V4.5h4V7M6.5 7l1 12.5h9l1-12.5M10 11v5M14 11v5",
  upload: "M12 15.5V4.5M7 9l5-5 5 5M5 20h14",
  x: "M6 6l12 12M18 6 6 18",
};

/** An inline SVG icon (decorative: hidden from assistive technology). */
export function icon(name) {
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("viewBox", "0 0 24 24");
  svg.setAttribute("aria-hidden", "true");
  svg.classList.add("icon");
  const data = ICONS[name];
  if (data === undefined) throw new Error(`unknown icon '${name}'`);
  const path = document.createElementNS(SVG_NS, "path");
  const filled = data.startsWith("fill:");
  path.setAttribute("d", filled ? data.slice(5) : data);
  svg.classList.add(filled ? "icon-filled" : "icon-stroked");
  svg.append(path);
  return svg;
}

/** Replaces every `<span data-icon="name">` placeholder under `root` by its icon. */
export function fillIcons(root) {
  for (const slot of root.querySelectorAll("[data-icon]")) {
    slot.replaceChildren(icon(slot.dataset.icon));
  }
}

/**
 * `el("button", {class: "btn", type: "button", onclick: fn}, "text", childNode)`.
 * Attributes named on* are listeners; strings among the children become text nodes.
 */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  node.append(...children.filter((child) => child !== null && child !== undefined && child !== false));
  return node;
}

/** A small icon button with an accessible label. */
export function iconButton(name, label, onclick, extraClass = "") {
  return el("button", {type: "button", class: `icon-btn small ${extraClass}`.trim(), "aria-label": label,
    title: label, onclick}, icon(name));
}

/** Writes text to the clipboard; falls back to a hidden textarea where the Clipboard API is missing
 * (it only exists on secure origins, and a server on a LAN address is not one). */
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = el("textarea", {class: "clipboard-proxy", readonly: true});
  area.value = text;
  document.body.append(area);
  area.select();
  try {
    if (!document.execCommand("copy")) throw new Error("the browser refused to copy");
  } finally {
    area.remove();
  }
}
