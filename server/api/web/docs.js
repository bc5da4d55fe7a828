"use strict";
// Renders /openapi.json with no external code: schemas are shown as JSON with $refs resolved.
function resolve(schema, doc, seen) {
  if (schema === null || typeof schema !== "object") return schema;
  if (Array.isArray(schema)) return schema.map(s => resolve(s, doc, seen));
  if (schema.$ref) {
    const name = schema.$ref.split("/").pop();
    if (seen.has(name)) return {"$ref": name};
    const inner = new Set(seen); inner.add(name);
    return resolve(doc.components.schemas[name], doc, inner);
  }
  const out = {};
  for (const [k, v] of Object.entries(schema)) out[k] = resolve(v, doc, seen);
  return out;
}
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
function block(title, value) {
  const frag = document.createDocumentFragment();
  frag.append(el("h3", null, title), el("pre", null, JSON.stringify(value, null, 2)));
  return frag;
}
fetch("openapi.json").then(r => r.json()).then(doc => {
  document.getElementById("info").textContent =
    `${doc.info.title} ${doc.info.version}: ${doc.info.description}`;
  const ops = document.getElementById("ops");
  for (const [path, methods] of Object.entries(doc.paths)) {
    for (const [method, op] of Object.entries(methods)) {
      const d = el("details", "op");
      const s = el("summary");
      s.append(el("span", `method ${method}`, method), el("span", "path", path), el("span", null, op.summary),
               el("span", "auth", op.security ? "Authorization: Bearer" : "no credentials"));
      const body = el("div", "body");
      if (op.parameters) body.append(block("parameters", op.parameters));
      if (op.requestBody) {
        for (const [media, c] of Object.entries(op.requestBody.content))
          body.append(block(`request body (${media})`, resolve(c.schema, doc, new Set())));
      }
      for (const [status, resp] of Object.entries(op.responses)) {
        const media = resp.content ? Object.keys(resp.content) : [];
        if (status.startsWith("2") && resp.content) {
          for (const m of media) body.append(block(`${status} (${m})`, resolve(resp.content[m].schema, doc, new Set())));
        }
      }
      const errors = Object.entries(op.responses).filter(([s]) => !s.startsWith("2"))
        .map(([s, r]) => `${s}: ${r.description}`).join("\n");
      body.append(block("errors ({\"error\": {\"message\", \"type\", \"code\"}})", errors));
      d.append(s, body);
      ops.append(d);
    }
  }
}).catch(e => { document.getElementById("error").textContent = `could not load /openapi.json: ${e}`; });
