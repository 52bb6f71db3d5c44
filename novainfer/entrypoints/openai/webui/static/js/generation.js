// One answer being generated: the request, the streamed text going into its message, the timings
// of its debug panel, stopping it, and turning failures into a readable error on the message.

import {createChatCompletion, streamChatCompletion} from "./api.js";

/** The chat messages sent for an answer: the system prompt, then the turns before it. Failed answers
 * (an error and no text) are left out: they were never part of the dialogue. */
export function requestMessages(systemPrompt, turns) {
  const messages = systemPrompt.trim() ? [{role: "system", content: systemPrompt}] : [];
  for (const turn of turns) {
    if (turn.role === "assistant" && !turn.content && turn.error) continue;
    messages.push({role: turn.role, content: turn.content});
  }
  return messages;
}

/** The request body for `settings` (the `stream` fields are added by the API call). */
export function requestBody(settings, messages) {
  const body = {messages, temperature: settings.temperature, top_p: settings.topP, max_tokens: settings.maxTokens};
  if (settings.model) body.model = settings.model;
  return body;
}

/** What the user reads for a failed request: {message, status}. */
function describeError(err) {
  const detail = err.message ? err.message.replace(/\.$/, "") : "unknown error";
  if (err.kind === "network") {
    return {message: "Could not reach the server. Check that it is running, then retry."};
  }
  if (err.kind === "stream") return {message: `The answer failed: ${detail}.`};
  if (err.status === 401) {
    return {message: `The server refused the API key (HTTP 401: ${detail}). Set the key in Settings, then retry.`,
      status: 401};
  }
  if (err.status === 429) {
    const wait = err.retryAfter !== undefined
      ? `Retry after ${err.retryAfter} second${err.retryAfter === 1 ? "" : "s"}.` : "Retry in a moment.";
    return {message: `The server is busy (HTTP 429: ${detail}). ${wait}`, status: 429};
  }
  // A server-side failure is in the server's log under the request id: show it.
  const reference = err.status >= 500 && err.requestId ? ` Request id: ${err.requestId}.` : "";
  return {message: `The server answered with an error (HTTP ${err.status}: ${detail}).${reference}`,
    status: err.status};
}

export class Generation {
  /**
   * @param {object} message the assistant message that receives the answer (its content grows)
   * @param {object} body the request body
   * @param {{apiKey: string, stream: boolean, onUpdate: () => void}} options
   */
  constructor(message, body, {apiKey, stream, onUpdate}) {
    this.message = message;
    this.body = body;
    this.apiKey = apiKey;
    this.stream = stream;
    this.onUpdate = onUpdate;
    this.controller = new AbortController();
    this.stopped = false;
    this.debug = {model: body.model};
  }

  /** Stops the answer: the connection is closed, so the server aborts the request; nothing more is added. */
  stop() {
    if (this.stopped) return;
    this.stopped = true;
    this.controller.abort();
  }

  /** Runs to the end (finished, stopped or failed); never rejects. */
  async run() {
    const message = this.message;
    message.pending = true;
    delete message.error;
    const started = performance.now();
    try {
      if (this.stream) await this.runStreamed(started);
      else await this.runOnce(started);
    } catch (err) {
      if (this.stopped) {
        this.debug.finish_reason = "abort";
      } else {
        console.warn("chat completion failed", err);
        message.error = describeError(err);
      }
    }
    this.debug.elapsed_ms = performance.now() - started;
    if (this.debug.request_id || this.debug.finish_reason) message.debug = this.debug;
    delete message.pending;
    this.onUpdate();
  }

  async runStreamed(started) {
    let first = null;
    let last = null;
    await streamChatCompletion(this.body, {
      apiKey: this.apiKey,
      signal: this.controller.signal,
      onChunk: (chunk) => {
        if (this.stopped) return; // a chunk already in flight when the user stopped
        if (chunk.id) this.debug.request_id = chunk.id;
        if (chunk.model) this.debug.model = chunk.model;
        const choice = chunk.choices?.[0];
        const delta = choice?.delta?.content;
        if (typeof delta === "string" && delta) {
          last = performance.now();
          if (first === null) {
            first = last;
            this.debug.ttft_ms = first - started;
          }
          this.message.content += delta;
          this.onUpdate();
        }
        if (choice?.finish_reason) this.debug.finish_reason = choice.finish_reason;
        if (chunk.usage) this.setUsage(chunk.usage);
      },
    });
    const tokens = this.debug.completion_tokens;
    if (tokens > 1 && last > first) this.debug.tokens_per_s = (tokens - 1) / ((last - first) / 1000);
  }

  async runOnce(started) {
    const response = await createChatCompletion(this.body, {apiKey: this.apiKey, signal: this.controller.signal});
    if (this.stopped) return;
    const choice = response.choices?.[0];
    this.debug.request_id = response.id;
    this.debug.model = response.model ?? this.debug.model;
    this.debug.finish_reason = choice?.finish_reason ?? undefined;
    this.message.content = choice?.message?.content ?? "";
    if (response.usage) this.setUsage(response.usage);
    const seconds = (performance.now() - started) / 1000;
    if (this.debug.completion_tokens > 0) this.debug.tokens_per_s = this.debug.completion_tokens / seconds;
  }

  setUsage(usage) {
    this.debug.prompt_tokens = usage.prompt_tokens;
    this.debug.completion_tokens = usage.completion_tokens;
    this.debug.cached_tokens = usage.prompt_tokens_details?.cached_tokens ?? 0;
  }
}
