// The explorer's data API client. When the server sets TMEM_API_KEY, the key is typed once into
// the key dialog, kept in this tab's sessionStorage (gone when the tab closes) and sent as an
// `Authorization: Bearer` header. It never goes into a URL, a cookie or the page.

const KEY = "tmem.explorer.apiKey";
const BASE = "api/";

export class ApiError extends Error {
  constructor(status, detail) {
    super(typeof detail === "string" ? detail : `HTTP ${status}`);
    this.status = status;
    this.detail = detail;
  }
}

let memoryKey = "";

export function storedKey() {
  try {
    return sessionStorage.getItem(KEY) || "";
  } catch (e) {
    console.warn("sessionStorage unavailable; the key lasts until reload", e);
    return memoryKey;
  }
}

export function setKey(key) {
  memoryKey = key;
  try {
    if (key) sessionStorage.setItem(KEY, key);
    else sessionStorage.removeItem(KEY);
  } catch (e) {
    console.warn("sessionStorage unavailable; the key lasts until reload", e);
  }
}

let onUnauthorized = null;

// `handler()` returns a promise that resolves once the user has entered a key (or rejects).
export function whenUnauthorized(handler) {
  onUnauthorized = handler;
}

async function call(method, path, body) {
  let response;
  for (;;) {  // a 401 asks for the key (again, if the stored one was refused) until it works or is cancelled
    const headers = { Accept: "application/json" };
    const key = storedKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    response = await fetch(BASE + path, {
      method, headers, body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store", credentials: "omit", referrerPolicy: "no-referrer",
    });
    if (response.status !== 401 || !onUnauthorized) break;
    await onUnauthorized(Boolean(key));
  }
  let payload = null;
  const text = await response.text();
  if (text) {
    try {
      payload = JSON.parse(text);
    } catch (e) {
      throw new ApiError(response.status, `the server answered ${response.status} with a non-JSON body`);
    }
  }
  if (!response.ok) {
    const detail = payload && payload.detail !== undefined ? payload.detail : `HTTP ${response.status}`;
    throw new ApiError(response.status, describe(response.status, detail));
  }
  return payload;
}

function describe(status, detail) {
  if (Array.isArray(detail)) {
    return "invalid request: " + detail.map((d) => `${(d.loc || []).slice(1).join(".")} ${d.msg}`).join("; ");
  }
  if (status === 401) return "missing or invalid API key";
  return String(detail);
}

export const api = {
  overview: () => call("GET", "overview"),
  runs: () => call("GET", "runs"),
  quarantine: () => call("GET", "quarantine"),
  conversation: (conversationId) => call("POST", "conversation", { conversation_id: conversationId }),
  turns: (conversationId, sceneId) => call("POST", "turns", { conversation_id: conversationId, scene_id: sceneId }),
  explain: (request) => call("POST", "explain", request),
  conversationQuarantine: (conversationId) =>
    call("POST", "conversation/quarantine", { conversation_id: conversationId }),
};
