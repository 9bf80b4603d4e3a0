// Renders the OpenAPI document as a list of operations, each with a small
// form that sends the request from the browser and shows the answer.
"use strict";
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const k of kids) e.append(k);
  return e;
}
async function send(method, pathInput, bodyInput, out) {
  const headers = {};
  const key = document.getElementById("key").value;
  if (key) headers["Authorization"] = "Bearer " + key;
  const init = { method: method.toUpperCase(), headers };
  if (bodyInput && bodyInput.value.trim()) {
    headers["Content-Type"] = "application/json";
    init.body = bodyInput.value;
  }
  try {
    const r = await fetch(pathInput.value, init);
    const text = await r.text();
    let shown = text;
    try { shown = JSON.stringify(JSON.parse(text), null, 2); } catch (_) {}
    out.textContent = r.status + " " + r.statusText + "\n\n" + shown;
  } catch (e) {
    out.textContent = String(e);
  }
}
async function main() {
  const doc = await (await fetch("/api/v1/openapi.json")).json();
  const groups = {};
  for (const [path, ops] of Object.entries(doc.paths)) {
    for (const [method, op] of Object.entries(ops)) {
      (groups[op.tags[0]] = groups[op.tags[0]] || []).push([method, path, op]);
    }
  }
  const root = document.getElementById("ops");
  root.textContent = "";
  for (const [tag, ops] of Object.entries(groups)) {
    root.append(el("h2", {}, tag));
    for (const [method, path, op] of ops) {
      const pathInput = el("input", { value: path });
      const body = op.requestBody ? el("textarea", { rows: "6", placeholder: "JSON body" }) : null;
      const out = el("pre", {});
      const button = el("button", { type: "button" }, "Send");
      button.addEventListener("click", () => send(method, pathInput, body, out));
      const form = el("div", {}, el("label", {}, "Path"), pathInput);
      if (body) form.append(el("label", {}, "Body"), body);
      form.append(button, out);
      root.append(el("details", {}, el("summary", {}, el("span", { class: "m" }, method.toUpperCase()), el("code", {}, path), " — " + op.summary), form));
    }
  }
}
main();
