// Generation settings: defaults, validation, and persistence in localStorage.

const KEY = "novainfer.settings";

/**
 * @typedef {{model: string, systemPrompt: string, temperature: number, topP: number, maxTokens: number,
 *            apiKey: string, stream: boolean}} Settings
 */

/** @type {Settings} */
export const DEFAULT_SETTINGS = Object.freeze({
  model: "", // "" = the server's default (its first served model)
  systemPrompt: "",
  temperature: 0.8,
  topP: 0.95,
  maxTokens: 512,
  apiKey: "",
  stream: true,
});

const MAX_TOKENS_LIMIT = 1_000_000;

/** Thrown for an invalid setting; names the field, the value and the allowed range. */
export class SettingsError extends Error {
  constructor(field, message) {
    super(message);
    this.name = "SettingsError";
    this.field = field;
  }
}

function number(field, label, value) {
  const n = typeof value === "string" ? (value.trim() === "" ? NaN : Number(value)) : value;
  if (typeof n !== "number" || !Number.isFinite(n)) {
    throw new SettingsError(field, `${label} must be a number, got '${value}'`);
  }
  return n;
}

/** Checks and normalises settings (numbers may come as form strings); throws SettingsError. */
export function validateSettings(input) {
  const temperature = number("temperature", "Temperature", input.temperature);
  if (temperature < 0 || temperature > 2) {
    throw new SettingsError("temperature", `Temperature must be in [0, 2], got ${temperature}`);
  }
  const topP = number("topP", "Top-p", input.topP);
  if (!(topP > 0 && topP <= 1)) throw new SettingsError("topP", `Top-p must be in (0, 1], got ${topP}`);
  const maxTokens = number("maxTokens", "Max tokens", input.maxTokens);
  if (!Number.isInteger(maxTokens) || maxTokens < 1 || maxTokens > MAX_TOKENS_LIMIT) {
    throw new SettingsError("maxTokens", `Max tokens must be an integer in [1, ${MAX_TOKENS_LIMIT}], got ${maxTokens}`);
  }
  return {
    model: String(input.model ?? ""),
    systemPrompt: String(input.systemPrompt ?? ""),
    temperature,
    topP,
    maxTokens,
    apiKey: String(input.apiKey ?? "").trim(),
    stream: Boolean(input.stream),
  };
}

/** The saved settings, with defaults for anything missing or no longer valid. */
export function loadSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(KEY) || "{}") || {};
  } catch {
    saved = {};
  }
  const merged = {...DEFAULT_SETTINGS};
  for (const field of Object.keys(DEFAULT_SETTINGS)) {
    if (!(field in saved)) continue;
    try {
      merged[field] = validateSettings({...DEFAULT_SETTINGS, [field]: saved[field]})[field];
    } catch {
      // An invalid saved value (an older version, a hand edit) falls back to its default.
    }
  }
  return merged;
}

/** Saves settings; returns false if the browser refused (storage disabled or full). */
export function saveSettings(settings) {
  try {
    localStorage.setItem(KEY, JSON.stringify(settings));
    return true;
  } catch {
    return false;
  }
}
