// The OpenAI API of this server, as the page uses it: GET /v1/models and POST /v1/chat/completions
// (streamed over SSE or not). URLs are relative to the page, so a proxy may serve both under a prefix.

import {SSEParser} from "./sse.js";

/** A failed API call, with what the UI needs to explain it. */
export class ApiError extends Error {
  /**
   * @param {string} message
   * @param {{kind: "http"|"network"|"stream", status?: number, type?: string, code?: string,
   *          param?: string, requestId?: string, retryAfter?: number}} details
   */
  constructor(message, details) {
    super(message);
    this.name = "ApiError";
    Object.assign(this, details);
  }
}

function headers(apiKey, json = false) {
  const h = {Accept: json ? "application/json" : "application/json, text/event-stream"};
  if (json) h["Content-Type"] = "application/json";
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

/** Retry-After in seconds (the header is either seconds or an HTTP date), or undefined. */
function retryAfterSeconds(value) {
  if (!value) return undefined;
  if (/^\d+$/.test(value.trim())) return parseInt(value, 10);
  const date = Date.parse(value);
  return Number.isNaN(date) ? undefined : Math.max(0, Math.ceil((date - Date.now()) / 1000));
}

/** The ApiError for an OpenAI error body `{"error": {message, type, param, code}}` (or any other body). */
function errorFromBody(body, status, response) {
  const error = body && typeof body === "object" && body.error && typeof body.error === "object" ? body.error : {};
  const message = typeof error.message === "string" && error.message
    ? error.message
    : `the server answered HTTP ${status}${response?.statusText ? ` ${response.statusText}` : ""}`;
  return new ApiError(message, {
    kind: status ? "http" : "stream",
    status,
    type: error.type ?? undefined,
    code: error.code ?? undefined,
    param: error.param ?? undefined,
    requestId: error.request_id ?? response?.headers.get("X-Request-Id") ?? undefined,
    retryAfter: response ? retryAfterSeconds(response.headers.get("Retry-After")) : undefined,
  });
}

async function send(url, init) {
  let response;
  try {
    response = await fetch(url, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError("could not reach the server", {kind: "network"});
  }
  if (!response.ok) {
    let body = null;
    try {
      body = await response.json();
    } catch {
      // Not JSON (a proxy's error page): the status says enough.
    }
    throw errorFromBody(body, response.status, response);
  }
  return response;
}

/** The served models: `[{id, max_model_len}]`. */
export async function listModels(apiKey) {
  const response = await send("v1/models", {headers: headers(apiKey)});
  const body = await response.json();
  return Array.isArray(body.data) ? body.data.filter((m) => typeof m.id === "string") : [];
}

/** A non-streamed chat completion: the response body. */
export async function createChatCompletion(body, {apiKey, signal}) {
  const response = await send("v1/chat/completions", {
    method: "POST", headers: headers(apiKey, true), body: JSON.stringify({...body, stream: false}), signal,
  });
  return response.json();
}

/**
 * A streamed chat completion: calls `onChunk(chunk)` for every chunk object, in order, and
 * resolves after `data: [DONE]`. Rejects with an ApiError (HTTP error, network error, an error
 * event in the stream, or a stream cut short), or with the AbortError of `signal`.
 */
export async function streamChatCompletion(body, {apiKey, signal, onChunk}) {
  const response = await send("v1/chat/completions", {
    method: "POST", headers: headers(apiKey, true),
    body: JSON.stringify({...body, stream: true, stream_options: {include_usage: true}}), signal,
  });
  const reader = response.body.getReader();
  const parser = new SSEParser();
  let done = false;
  try {
    for (;;) {
      let chunk;
      try {
        chunk = await reader.read();
      } catch (err) {
        if (err.name === "AbortError" || signal?.aborted) throw err;
        throw new ApiError("the connection was lost before the answer was complete", {kind: "stream"});
      }
      if (chunk.done) break;
      for (const data of parser.push(chunk.value)) {
        if (data === "[DONE]") {
          done = true; // the server closes the stream right after this
          return;
        }
        let payload;
        try {
          payload = JSON.parse(data);
        } catch {
          throw new ApiError("the server sent a malformed stream chunk", {kind: "stream"});
        }
        if (payload && payload.error) throw errorFromBody(payload, 0, null);
        onChunk(payload);
      }
    }
    parser.finish();
    throw new ApiError("the stream ended before the answer was complete", {kind: "stream"});
  } finally {
    if (!done) reader.cancel().catch(() => {}); // stopped reading early: release the connection
  }
}
