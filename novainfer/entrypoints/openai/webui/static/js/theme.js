// Light and dark themes: the choice is saved; with none saved the page follows the system.

const KEY = "novainfer.theme";
const systemDark = window.matchMedia("(prefers-color-scheme: dark)");

/** @returns {"light" | "dark"} */
export function currentTheme() {
  return document.documentElement.dataset.theme === "dark" ? "dark" : "light";
}

function savedTheme() {
  try {
    const value = localStorage.getItem(KEY);
    return value === "light" || value === "dark" ? value : null;
  } catch {
    return null;
  }
}

/** Applies a theme and remembers it. */
function setTheme(theme) {
  document.documentElement.dataset.theme = theme;
  try {
    localStorage.setItem(KEY, theme);
  } catch {
    // Not saved (storage disabled or full): the theme still applies to this page.
  }
}

export function toggleTheme() {
  setTheme(currentTheme() === "dark" ? "light" : "dark");
}

/** Follows changes of the system theme while the user has not chosen one. */
export function followSystemTheme(onChange) {
  systemDark.addEventListener("change", (event) => {
    if (savedTheme() === null) {
      document.documentElement.dataset.theme = event.matches ? "dark" : "light";
      onChange();
    }
  });
}
