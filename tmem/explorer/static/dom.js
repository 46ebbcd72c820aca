// DOM helpers. Every text reaches the page through text nodes (createTextNode / textContent) and
// every attribute through setAttribute: nothing is ever parsed as HTML, so a hostile id or
// memory text (quotes, <script>, NUL, bidi overrides) is shown, never run.

export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on") && typeof value === "function") el.addEventListener(key.slice(2), value);
    else if (key === "value") el.value = value;
    else if (key === "checked" || key === "disabled" || key === "open" || key === "selected") el[key] = Boolean(value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

// Ids can hold characters that render as nothing or rearrange the line (NUL, tabs, newlines,
// zero-width and bidi controls, edge spaces). Shown as named stand-ins (‹NUL›, ‹SP›, ‹U+202E›) so two ids that differ
// only there look different; the real id stays in JavaScript and is what the API receives.
const INVISIBLE = /[\u0000-\u001f\u007f-\u009f\u00ad\u061c\u115f\u1160\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff\ufff9-\ufffb]/g;

const NAMES = { 0: "NUL", 9: "TAB", 10: "LF", 13: "CR", 27: "ESC", 127: "DEL" };

export function visible(text) {
  const s = String(text);
  let out = s.replace(INVISIBLE, (c) => {
    const code = c.codePointAt(0);
    return `\u2039${NAMES[code] || "U+" + code.toString(16).toUpperCase().padStart(4, "0")}\u203a`;
  });
  out = out.replace(/^ +| +$/g, (m) => "\u2039SP\u203a".repeat(m.length));
  return out === "" ? "\u2039empty\u203a" : out;
}

export function idText(id, cls = "mono id") {
  const shown = visible(id);
  return h("span", { class: cls, title: shown !== id ? `shown with visible stand-ins: ${shown}` : null }, shown);
}

export function shortId(id, n = 10) {
  const shown = visible(id);
  return shown.length > n + 1 ? shown.slice(0, n) + "\u2026" : shown;
}

const DAY = new Intl.DateTimeFormat("en-GB", { day: "numeric", month: "short", year: "numeric", timeZone: "UTC" });
const TIME = new Intl.DateTimeFormat("en-GB", { hour: "2-digit", minute: "2-digit", timeZone: "UTC" });

export function day(iso) {
  return iso ? DAY.format(new Date(iso)) : "date unknown";
}

export function dayTime(iso) {
  if (!iso) return "date unknown";
  const d = new Date(iso);
  return `${DAY.format(d)}, ${TIME.format(d)}`;
}

export function span(startIso, endIso) {
  const a = day(startIso), b = day(endIso);
  if (a !== b) return `${a} \u2013 ${b}`;
  const ta = TIME.format(new Date(startIso)), tb = TIME.format(new Date(endIso));
  return ta === tb ? `${a}, ${ta}` : `${a}, ${ta}\u2013${tb}`;
}

export function ago(iso) {
  if (!iso) return "";
  const s = (Date.now() - new Date(iso).getTime()) / 1000;
  if (s < 0) return "";
  if (s < 90) return "just now";
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400 * 2) return `${Math.round(s / 3600)} h ago`;
  if (s < 86400 * 60) return `${Math.round(s / 86400)} d ago`;
  return `${Math.round(s / 86400 / 30)} months ago`;
}

export function num(n) {
  return Number(n).toLocaleString("en-US");
}

export function score(x, digits = 3) {
  return Number.isFinite(x) ? x.toFixed(digits) : "\u2014";
}

const CHANNEL_TITLES = {
  lexical: "BM25 over the weighted fields",
  dense: "cosine to the node's own vector",
  dialogue: "SceneCue: cosine to the scene's dialogue (dlg)",
  scene_trigger: "SceneCue: cosine to the scene trigger attributes (scn)",
  horizon: "SceneCue: best cosine over the horizon sentences (hor)",
  entity_bridge: "TrigRecall: best cosine over entity / bridge / joint trigger views",
  scene_cue: "the SceneCue ranking (RRF of dialogue, scene_trigger, horizon)",
};

export function channel(name, extra) {
  return h("span", { class: `chan chan-${name}`, title: CHANNEL_TITLES[name] || name },
    h("i", { class: "dot" }), name, extra !== undefined ? h("b", {}, extra) : null);
}

export function badge(text, cls = "", title) {
  return h("span", { class: `badge ${cls}`, title }, text);
}

export function chip(text, title) {
  return h("span", { class: "chip", title }, visible(text));
}

export function empty(text) {
  return h("p", { class: "empty" }, text);
}

export function section(title, ...children) {
  return h("section", { class: "card" }, h("h3", {}, title), ...children);
}

// Sizes through the CSSOM (allowed by the page's CSP, which forbids inline style attributes).
export function styled(el, props) {
  Object.assign(el.style, props);
  return el;
}
