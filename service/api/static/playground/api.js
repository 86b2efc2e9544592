// The page's calls to the skillcache API: the API key (session storage only), typed errors, and
// /v1/compose as server-sent events read from the fetch body (fetch + ReadableStream: EventSource cannot POST).

const KEY_ITEM = "skillcache.apiKey";

export function apiKey() {
  return sessionStorage.getItem(KEY_ITEM) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_ITEM, key);
  else sessionStorage.removeItem(KEY_ITEM);
}

// An error answer of the service: {"error": {"type", "message"}} with its HTTP status, or an error event
// inside a stream that had already started (status 200).
export class ApiError extends Error {
  constructor(status, type, message) {
    super(message);
    this.status = status;
    this.type = type;
  }
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = apiKey();
  if (key) h["Authorization"] = `Bearer ${key}`;
  return h;
}

async function errorOf(resp) {
  let body = null;
  try {
    body = await resp.json();
  } catch {
    // not JSON: a proxy's page, say
  }
  const err = body && body.error;
  return new ApiError(resp.status, (err && err.type) || "http_error", (err && err.message) || resp.statusText);
}

export async function getJSON(path) {
  const resp = await fetch(path, { headers: headers(false) });
  if (!resp.ok) throw await errorOf(resp);
  return resp.json();
}

// The frames of a text/event-stream body: each `data:` payload parsed as JSON, "[DONE]" as the string.
export async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = frame.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data === "[DONE]" ? data : JSON.parse(data);
    }
  }
}

// POST /v1/compose with "stream": true. `onDelta(text)` gets each piece as it arrives. Resolves to the done
// event plus what the browser measured: the time to the first delta and to the end, and the delta count.
export async function streamCompose(body, onDelta) {
  const t0 = performance.now();
  const resp = await fetch("/v1/compose", {
    method: "POST", headers: headers(true), body: JSON.stringify({ ...body, stream: true }),
  });
  if (!resp.ok) throw await errorOf(resp);
  let firstMs = null;
  let deltas = 0;
  let done = null;
  for await (const ev of sseData(resp.body)) {
    if (ev === "[DONE]") break;
    if (ev.type === "delta") {
      if (firstMs === null) firstMs = performance.now() - t0;
      deltas += 1;
      onDelta(ev.text);
    } else if (ev.type === "done") {
      done = ev;
    } else if (ev.type === "error") {
      throw new ApiError(resp.status, ev.error.type, ev.error.message);
    }
  }
  if (done === null) throw new ApiError(resp.status, "stream_ended", "the stream ended without a done event");
  return { done, firstMs, totalMs: performance.now() - t0, deltas };
}
