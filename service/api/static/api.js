// The API as the dashboard reads it: the token kept in this tab, JSON reads, and the run's
// server-sent events read with fetch() (EventSource cannot send an Authorization header, and a
// token in a URL would end up in logs and history).

const TOKEN_KEY = "trainctl.token";

export function getToken() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function setToken(token) {
  sessionStorage.setItem(TOKEN_KEY, token);
}

export function forgetToken() {
  sessionStorage.removeItem(TOKEN_KEY);
}

// An answer other than 2xx, with the API's error shape: {"error": {"code", "message", "details"}}.
export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }

  get unauthorized() {
    return this.status === 401 || this.status === 403;
  }
}

async function errorOf(response) {
  let code = "http_" + response.status;
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error) {
      code = body.error.code || code;
      message = body.error.message || message;
    }
  } catch {
    // Not JSON (a proxy's page): the status line says enough.
  }
  return new ApiError(response.status, code, message);
}

function headers(extra = {}) {
  const token = getToken();
  return token ? { Authorization: `Bearer ${token}`, ...extra } : extra;
}

export function query(params) {
  const search = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    if (value !== undefined && value !== null) search.set(key, String(value));
  }
  const text = search.toString();
  return text ? `?${text}` : "";
}

export async function getJson(path, params = {}, { signal } = {}) {
  const response = await fetch(path + query(params), {
    headers: headers({ Accept: "application/json" }),
    cache: "no-store",
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

export function postJson(path, body = undefined) {
  return sendJson("POST", path, body);
}

export function patchJson(path, body) {
  return sendJson("PATCH", path, body);
}

async function sendJson(method, path, body) {
  const response = await fetch(path, {
    method,
    headers: headers({ Accept: "application/json", "Content-Type": "application/json" }),
    body: body === undefined ? undefined : JSON.stringify(body),
    cache: "no-store",
  });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

// Split a text/event-stream into events ({event, data, id}); comments (heartbeats) are
// dropped. Fed chunks as they arrive; calls onEvent for each complete event.
export class EventStreamParser {
  constructor(onEvent) {
    this.onEvent = onEvent;
    this.buffer = "";
    this.reset();
  }

  reset() {
    this.event = "";
    this.data = [];
    this.id = null;
  }

  feed(chunk) {
    this.buffer += chunk;
    // A line ends at \n, \r\n or \r; a trailing \r may be the first half of \r\n, so wait.
    const pattern = /\r\n|\n|\r(?!$)/;
    let match;
    while ((match = pattern.exec(this.buffer)) !== null) {
      const line = this.buffer.slice(0, match.index);
      this.buffer = this.buffer.slice(match.index + match[0].length);
      this.line(line);
    }
  }

  line(line) {
    if (line === "") {
      if (this.data.length) {
        this.onEvent({ event: this.event || "message", data: this.data.join("\n"), id: this.id });
      }
      this.reset();
      return;
    }
    if (line.startsWith(":")) return;
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") this.event = value;
    else if (field === "data") this.data.push(value);
    else if (field === "id") this.id = value;
  }
}

// Read the run's events until the run ends (an `end` event) or `signal` aborts, reconnecting
// after a dropped connection with what `cursor()` says the page already has. `on` maps event
// names to handlers (data parsed from JSON); `onState` hears "live", "reconnecting", "ended".
export async function followRunEvents(runId, { cursor, on, onState, onError, signal }) {
  let delay = 1000;
  while (!signal.aborted) {
    let ended = false;
    try {
      const response = await fetch(`/runs/${encodeURIComponent(runId)}/events` + query(cursor()), {
        headers: headers({ Accept: "text/event-stream" }),
        cache: "no-store",
        signal,
      });
      if (!response.ok) throw await errorOf(response);
      onState("live");
      delay = 1000;
      const parser = new EventStreamParser(({ event, data }) => {
        if (event === "end") ended = true;
        const handler = on[event];
        if (handler) handler(JSON.parse(data));
      });
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        parser.feed(value);
        if (ended) break;
      }
      if (ended) {
        reader.cancel().catch(() => {});
        onState("ended");
        return;
      }
    } catch (err) {
      if (signal.aborted) return;
      if (err instanceof ApiError) {
        // A refused token or a missing run does not get better by retrying.
        onError(err);
        onState("stopped");
        return;
      }
    }
    if (signal.aborted) return;
    onState("reconnecting");
    await new Promise((resolve) => setTimeout(resolve, delay));
    delay = Math.min(delay * 2, 15000);
  }
}
