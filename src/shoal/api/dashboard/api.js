// Requests to this node: the API key (kept in localStorage) as a Bearer token on each,
// a time limit on each, and errors that say what went wrong.

const KEY_STORAGE = "shoal.apiKey";
export const REQUEST_TIMEOUT_MS = 5000;

export class Unauthorized extends Error {}

export function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function saveApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

export function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// The message of an error body in any of shoal's dialects (OpenAI, Ollama, Anthropic).
export function errorMessage(status, text) {
  try {
    const body = JSON.parse(text);
    const error = body.error;
    if (typeof error === "string") return error;
    if (error && error.message) return error.message;
  } catch (_) { /* not JSON: fall through to the raw text */ }
  return `HTTP ${status}: ${text.slice(0, 200)}`;
}

// A thrown fetch error as a sentence: a timeout names its limit.
export function describeFailure(error, timeoutMs) {
  if (error instanceof Unauthorized) return error.message;
  if (error && (error.name === "TimeoutError" || error.name === "AbortError")) {
    return `no answer within ${timeoutMs / 1000} s`;
  }
  return `cannot reach the node (${error && error.message ? error.message : error})`;
}

// GET path within timeoutMs; resolves to the body (JSON or text), throws Unauthorized on 401
// and an Error with the server's message on any other failure but the statuses in allow
// (/health answers 503 with its body while a model loads).
export async function get(path, { json = true, timeoutMs = REQUEST_TIMEOUT_MS, allow = [] } = {}) {
  let response, text;
  try {
    response = await fetch(path, { headers: authHeaders(), signal: AbortSignal.timeout(timeoutMs) });
    text = await response.text();
  } catch (error) {
    throw new Error(`${path}: ${describeFailure(error, timeoutMs)}`);
  }
  if (response.status === 401) throw new Unauthorized(`${path}: ${errorMessage(401, text)}`);
  if (!response.ok && !allow.includes(response.status)) {
    throw new Error(`${path}: ${errorMessage(response.status, text)}`);
  }
  return json ? JSON.parse(text) : text;
}

// POST a JSON body to path; resolves to the JSON answer, throws as get() does. timeoutMs
// null waits as long as the node works (a pull: the node bounds each read of its source).
export async function post(path, body, { timeoutMs = REQUEST_TIMEOUT_MS } = {}) {
  let response, text;
  try {
    response = await fetch(path, {
      method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json", ...authHeaders() },
      signal: timeoutMs === null ? undefined : AbortSignal.timeout(timeoutMs),
    });
    text = await response.text();
  } catch (error) {
    throw new Error(`${path}: ${describeFailure(error, timeoutMs)}`);
  }
  if (response.status === 401) throw new Unauthorized(`${path}: ${errorMessage(401, text)}`);
  if (!response.ok) throw new Error(errorMessage(response.status, text));
  return JSON.parse(text);
}
