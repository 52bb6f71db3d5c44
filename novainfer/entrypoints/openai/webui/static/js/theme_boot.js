// Sets the theme before the first paint: the user's saved choice, else the system's preference.
// A classic script (not a module) so that it runs while the page is still being parsed.
(function () {
  "use strict";
  var saved = null;
  try {
    saved = window.localStorage.getItem("novainfer.theme");
  } catch (e) {
    saved = null; // storage can be disabled; the system preference still applies
  }
  var dark = window.matchMedia && window.matchMedia("(prefers-color-scheme: dark)").matches;
  var theme = saved === "light" || saved === "dark" ? saved : (dark ? "dark" : "light");
  document.documentElement.setAttribute("data-theme", theme);
})();
