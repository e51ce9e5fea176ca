// Calls to the control plane with the admin token as a bearer. The token lives in
// sessionStorage: it survives a reload, not the tab.

const TOKEN_KEY = "tokenmill.adminToken";

export class NotAvailable extends Error {
  constructor(message, problem = null) {
    super(message);
    this.problem = problem; // the RFC 9457 body, when the server sent one
  }
}
export class Unauthorized extends Error {}
export class ApiError extends Error {
  constructor(status, problem) {
    super(problem?.detail || problem?.title || problem?.error?.message || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
}

export const token = {
  get: () => sessionStorage.getItem(TOKEN_KEY),
  set: (value) => sessionStorage.setItem(TOKEN_KEY, value),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};

async function parse(response) {
  const type = response.headers.get("content-type") || "";
  if (type.includes("json")) return response.json();
  return response.text();
}

// Sends a request; returns the parsed body. A missing endpoint (404/405/501 on a read)
// raises NotAvailable, so a view shows "not available" instead of breaking.
export async function api(path, { method = "GET", body, query, raw = false } = {}) {
  const url = new URL(path, location.origin);
  for (const [k, v] of Object.entries(query || {})) {
    if (v !== undefined && v !== null && v !== "") url.searchParams.set(k, v);
  }
  const headers = { Accept: "application/json" };
  const bearer = token.get();
  if (bearer) headers.Authorization = `Bearer ${bearer}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(url, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (err) {
    throw new NotAvailable(`control plane unreachable (${err.message})`);
  }
  if (response.status === 401) throw new Unauthorized("the admin token was refused");
  if (!response.ok) {
    const problem = await parse(response).catch(() => null);
    const missing = [404, 405, 501].includes(response.status) && method === "GET";
    if (missing) {
      const detail = typeof problem === "object" ? problem : null;
      throw new NotAvailable(detail?.detail || "not available", detail);
    }
    throw new ApiError(response.status, typeof problem === "object" ? problem : { detail: String(problem).slice(0, 200) });
  }
  if (raw) return response;
  if (response.status === 204) return null;
  return parse(response);
}

// Lists come back either bare or wrapped ({items: [...]}, {tenants: [...]}, ...).
export function items(body, ...names) {
  if (Array.isArray(body)) return body;
  for (const name of [...names, "items", "data", "results"]) {
    if (Array.isArray(body?.[name])) return body[name];
  }
  return [];
}
