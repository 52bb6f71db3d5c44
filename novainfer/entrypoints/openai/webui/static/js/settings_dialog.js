// The settings dialog: edits every setting but the model (picked in the top bar).

import {DEFAULT_SETTINGS, SettingsError, validateSettings} from "./settings.js";

export class SettingsDialog {
  /** @param {(settings: object) => void} onSave called with the validated settings */
  constructor(onSave) {
    this.onSave = onSave;
    this.dialog = document.getElementById("settings-dialog");
    this.form = document.getElementById("settings-form");
    this.error = document.getElementById("settings-error");
    this.fields = {
      systemPrompt: document.getElementById("setting-system-prompt"),
      temperature: document.getElementById("setting-temperature"),
      topP: document.getElementById("setting-top-p"),
      maxTokens: document.getElementById("setting-max-tokens"),
      apiKey: document.getElementById("setting-api-key"),
      stream: document.getElementById("setting-stream"),
    };
    this.current = null;
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.save();
    });
    for (const id of ["settings-close-btn", "settings-cancel-btn"]) {
      document.getElementById(id).addEventListener("click", () => this.dialog.close());
    }
    document.getElementById("settings-reset-btn").addEventListener("click", () => {
      // The API key is not a preference: resetting the sampling settings keeps it.
      this.fill({...DEFAULT_SETTINGS, model: this.current.model, apiKey: this.fields.apiKey.value});
    });
  }

  open(settings) {
    this.current = settings;
    this.fill(settings);
    this.showError(null);
    this.dialog.showModal();
  }

  fill(settings) {
    const f = this.fields;
    f.systemPrompt.value = settings.systemPrompt;
    f.temperature.value = String(settings.temperature);
    f.topP.value = String(settings.topP);
    f.maxTokens.value = String(settings.maxTokens);
    f.apiKey.value = settings.apiKey;
    f.stream.checked = settings.stream;
  }

  save() {
    const f = this.fields;
    try {
      const settings = validateSettings({
        model: this.current.model, systemPrompt: f.systemPrompt.value, temperature: f.temperature.value,
        topP: f.topP.value, maxTokens: f.maxTokens.value, apiKey: f.apiKey.value, stream: f.stream.checked,
      });
      this.dialog.close();
      this.onSave(settings);
    } catch (err) {
      if (!(err instanceof SettingsError)) throw err;
      this.showError(err);
    }
  }

  showError(err) {
    for (const input of Object.values(this.fields)) input.removeAttribute("aria-invalid");
    this.error.hidden = err === null;
    this.error.textContent = err ? err.message : "";
    if (err) {
      const input = this.fields[err.field];
      input.setAttribute("aria-invalid", "true");
      input.focus();
    }
  }
}
