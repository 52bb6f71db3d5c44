// Incremental parsing of a server-sent events stream (the text/event-stream format).
//
// Network chunks may split the stream anywhere: inside a UTF-8 character, inside a line, between
// the CR and LF of a line break. `SSEParser.push(bytes)` returns the `data` of every event that
// completed with this chunk, in order; what is left waits for the next chunk.

export class SSEParser {
  constructor() {
    this.decoder = new TextDecoder("utf-8");
    this.buffer = "";
    this.data = [];
    this.skipLF = false; // the previous chunk ended with CR: an LF starting this one is that line's end
  }

  /** Feeds bytes (Uint8Array) or already-decoded text; returns the data of the completed events. */
  push(chunk) {
    let text = typeof chunk === "string" ? chunk : this.decoder.decode(chunk, {stream: true});
    if (this.skipLF && text.startsWith("\n")) text = text.slice(1);
    if (text) this.skipLF = text.endsWith("\r");
    this.buffer += text;
    const events = [];
    let start = 0;
    for (;;) {
      const end = this.lineEnd(start);
      if (end === -1) break;
      const line = this.buffer.slice(start, end);
      start = end + (this.buffer[end] === "\r" && this.buffer[end + 1] === "\n" ? 2 : 1);
      this.line(line, events);
    }
    this.buffer = this.buffer.slice(start);
    return events;
  }

  /** Ends the stream: a final event without its blank line is dropped, as the format says. */
  finish() {
    this.push(this.decoder.decode());
    this.buffer = "";
    this.data = [];
  }

  lineEnd(from) {
    const cr = this.buffer.indexOf("\r", from);
    const lf = this.buffer.indexOf("\n", from);
    if (cr === -1) return lf;
    if (lf === -1) return cr;
    return Math.min(cr, lf);
  }

  line(line, events) {
    if (line === "") {
      if (this.data.length) events.push(this.data.join("\n"));
      this.data = [];
      return;
    }
    if (line.startsWith(":")) return; // a comment (keep-alive)
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") this.data.push(value);
    // Other fields (event, id, retry) carry nothing for OpenAI streams.
  }
}
