// The explorer's shell: header, conversation list, routing (#/c/<id>/<tab>, #/builds, #/quarantine).

import { api, ApiError, setKey, storedKey, whenUnauthorized } from "./api.js";
import { renderBuilds, renderQuarantine } from "./builds.js";
import { ago, badge, channel, clear, dayTime, h, idText, num, visible } from "./dom.js";
import { renderConversationQuarantine, renderItems, renderPersonas, renderTimeline, renderTopics } from "./memory.js";
import { renderQuery } from "./trace.js";

const TABS = [["query", "Query & trace"], ["timeline", "Timeline"], ["topics", "Topics"], ["items", "Items"],
  ["personas", "Personas"], ["quarantine", "Quarantine"]];
const LISTED = 300;
const CHANNELS = [
  ["lexical", "BM25 over titles, summaries, narratives, item content and keywords"],
  ["dense", "cosine between the query and the node's own embedding"],
  ["dialogue", "SceneCue: cosine to the scene's raw dialogue"],
  ["scene_trigger", "SceneCue: cosine to the scene's situation / object / event / emotion"],
  ["horizon", "SceneCue: best cosine over the scene's forward-looking horizon sentences"],
  ["entity_bridge", "TrigRecall: best cosine over an item's entity and bridge triggers, gated by \u03c4"],
];

const app = {
  overview: null,
  route: { view: "home" },
  memo: null, // the open conversation's memory (ConversationOut + lookup maps)
  queries: new Map(), // per conversation id: the query box's state
  filter: "",
};

const $ = (id) => document.getElementById(id);

function routeHash(route) {
  try {
    if (route.view === "conversation") return `#/c/${encodeURIComponent(route.id)}/${route.tab || "query"}`;
  } catch (e) {
    console.warn("this id cannot be written into the address bar; opened without a link", e);
    return null;
  }
  return route.view === "home" ? "#/" : `#/${route.view}`;
}

function parseHash() {
  const hash = location.hash.replace(/^#\/?/, "");
  if (hash === "builds" || hash === "quarantine") return { view: hash };
  const m = /^c\/([^/]*)(?:\/([a-z]+))?$/.exec(hash);
  if (m) {
    try {
      return { view: "conversation", id: decodeURIComponent(m[1]), tab: m[2] || "query" };
    } catch (e) {
      return { view: "error", message: "This link's conversation id is not valid percent-encoding." };
    }
  }
  return { view: "home" };
}

export function navigate(route) {
  const hash = routeHash(route);
  if (hash !== null && hash !== location.hash) {
    app.pendingRoute = route;
    location.hash = hash;  // hashchange renders
  } else {
    app.route = route;
    render();
  }
}

const openConversation = (id, tab = "query", focus = null) => navigate({ view: "conversation", id, tab, focus });

let keyPromise = null;  // one dialog for all the requests that met a 401 at once

function keyDialog(wasSet) {
  if (keyPromise) return keyPromise;
  const dialog = $("key-dialog");
  const input = $("key-input");
  $("key-message").textContent = wasSet
    ? "The server refused the stored key. Enter the current TMEM_API_KEY."
    : "This server requires its API key (TMEM_API_KEY) for the memory's data.";
  input.value = "";
  keyPromise = new Promise((resolve, reject) => {
    const done = () => {
      dialog.removeEventListener("close", done);
      if (dialog.returnValue === "ok" && input.value) {
        setKey(input.value);
        input.value = "";
        drawKeyState();
        resolve();
      } else reject(new ApiError(401, "missing or invalid API key"));
    };
    dialog.addEventListener("close", done);
    dialog.returnValue = "";
    dialog.showModal();
    input.focus();
  }).finally(() => { keyPromise = null; });
  return keyPromise;
}

function drawKeyState() {
  const has = Boolean(storedKey());
  $("key-button").textContent = has ? "API key \u2713" : "API key";
  $("key-forget").hidden = !has;
}

async function loadOverview() {
  app.overview = await api.overview();
  const s = app.overview.snapshot;
  clear($("snapshot")).append(h("span", { class: "muted" }, "snapshot "), h("span", { class: "mono" }, s.snapshot_id),
    h("span", { class: "muted" }, ` \u00b7 published ${ago(s.created_at)}`));
  const active = app.overview.quarantine_active;
  $("nav-quarantine").textContent = active ? `Quarantine (${active})` : "Quarantine";
  drawList();
}

function waiting(c) {
  return c.pending_turns + c.unbuilt_turns;
}

function waitingBadge(c) {
  const n = waiting(c);
  return n ? badge(`${num(n)} turn${n === 1 ? "" : "s"} waiting for the next build`, "wait",
    `${c.pending_turns} posted by a live assistant, ${c.unbuilt_turns} ingested after this build`) : null;
}

function drawList() {
  if (!app.overview) return;
  const list = clear($("conv-list"));
  const all = app.overview.conversations;
  const words = app.filter.toLowerCase().split(/\s+/).filter(Boolean);
  const shown = all.filter((c) => words.every((w) => (c.conversation_id + " " + c.speakers.join(" ")).toLowerCase().includes(w)));
  $("conv-count").textContent = `${num(all.length)} conversations`;
  for (const c of shown.slice(0, LISTED)) {
    const current = app.route.view === "conversation" && app.route.id === c.conversation_id;
    list.appendChild(h("li", {}, h("a", { href: "#", class: current ? "current" : "", onclick: (ev) => {
      ev.preventDefault(); openConversation(c.conversation_id);
    } },
    h("div", { class: "conv-id" }, idText(c.conversation_id, "mono")),
    h("div", { class: "muted small" }, c.speakers.map(visible).join(" & ")),
    h("div", { class: "small" }, `${num(c.scenes)} scenes \u00b7 ${num(c.items)} items \u00b7 ${num(c.turns)} turns`),
    h("div", { class: "muted small" }, `built ${ago(c.built_at)}`),
    c.quarantined ? badge("quarantined", "bad") : null, waitingBadge(c))));
  }
  if (shown.length > LISTED) list.appendChild(h("li", { class: "muted small more" }, `\u2026 ${num(shown.length - LISTED)} more: refine the filter`));
  if (!shown.length) list.appendChild(h("li", { class: "muted small more" }, "No conversation matches."));
}

function drawHome(main) {
  const cs = app.overview.conversations;
  const sum = (k) => cs.reduce((a, c) => a + c[k], 0);
  main.append(h("h2", {}, "Memory explorer"),
    h("p", { class: "lead" }, "Read-only view of the published memory: open a conversation to browse its scenes, topics, " +
      "items, triggers and personas, and run the retrieval cascade to see why a memory was or was not recalled."),
    h("div", { class: "stats" }, [["conversations", cs.length], ["turns", sum("turns")], ["scenes", sum("scenes")],
      ["topics", sum("topics")], ["items", sum("items")], ["waiting turns", cs.reduce((a, c) => a + waiting(c), 0)]]
      .map(([label, n]) => h("div", { class: "stat" }, h("b", {}, num(n)), h("span", {}, label)))),
    h("section", { class: "card" }, h("h3", {}, "Channels"), h("dl", { class: "legend" },
      CHANNELS.map(([name, text]) => [h("dt", {}, channel(name)), h("dd", {}, text)]))));
}

async function drawConversation(main, route) {
  const qid = route.id;
  if (!app.memo || app.memo.conversation.conversation_id !== qid || app.memo.snapshot_id !== app.overview.snapshot.snapshot_id) {
    main.appendChild(h("p", { class: "muted" }, "Loading the conversation\u2026"));
    let memo;
    try {
      memo = await api.conversation(qid);
    } catch (e) {
      if (!(e instanceof ApiError && e.status === 404 && route.tab === "quarantine")) throw e;
      // quarantined before its first build: no memory to show, but its records
      clear(main).append(h("header", { class: "conv-head" }, h("div", { class: "conv-title" },
        h("h2", {}, idText(qid, "mono")), badge("no published memory", "bad"))));
      return renderConversationQuarantine(main, qid);
    }
    memo.sceneIndex = new Map(memo.scenes.map((s, i) => [s.scene_id, i]));
    app.memo = memo;
    clear(main);
  }
  const memo = app.memo;
  const c = memo.conversation;
  if (!app.queries.has(qid)) app.queries.set(qid, {});
  main.appendChild(h("header", { class: "conv-head" },
    h("div", { class: "conv-title" }, h("h2", {}, idText(c.conversation_id, "mono")), c.quarantined ? badge("quarantined", "bad",
      "its latest build was quarantined: this is its earlier memory") : null, waitingBadge(c)),
    h("div", { class: "muted" }, `${c.speakers.map(visible).join(" & ")} \u00b7 ${num(c.sessions)} sessions \u00b7 `,
      `${dayTime(c.first_turn_at)} \u2013 ${dayTime(c.last_turn_at)} (UTC)`),
    h("div", { class: "muted" }, `built ${dayTime(c.built_at)} UTC (${ago(c.built_at)}) by run `, idText(c.run_id),
      ` \u00b7 build ${c.build_id}`),
    h("div", { class: "stats small-stats" }, [["turns", c.turns], ["scenes", c.scenes], ["topics", c.topics],
      ["atomic items", c.atomic_items], ["connected items", c.connected_items], ["entity triggers", c.entity_triggers],
      ["bridge triggers", c.bridge_triggers], ["scene triggers", c.scene_triggers], ["horizon triggers", c.horizon_triggers],
      ["personas", c.personas]].map(([label, n]) => h("div", { class: "stat" }, h("b", {}, num(n)), h("span", {}, label))))));
  const tabs = h("nav", { class: "tabs" }, TABS.map(([key, label]) => h("a", { href: "#", class: key === route.tab ? "on" : "",
    onclick: (ev) => { ev.preventDefault(); openConversation(qid, key); } }, label)));
  const body = h("div", { class: "tab-body" });
  main.append(tabs, body);
  const open = (tab, focus) => openConversation(qid, tab, focus);
  if (route.tab === "timeline") {
    renderTimeline(body, memo, open);
    if (route.focus !== null && memo.sceneIndex.has(route.focus)) {
      const el = document.getElementById(`scene-${memo.sceneIndex.get(route.focus)}`);
      if (el) { el.classList.add("focused"); setTimeout(() => el.scrollIntoView({ block: "center" }), 0); }
    }
  } else if (route.tab === "topics") renderTopics(body, memo, route.focus, open);
  else if (route.tab === "items") renderItems(body, memo, open);
  else if (route.tab === "personas") renderPersonas(body, memo);
  else if (route.tab === "quarantine") await renderConversationQuarantine(body, qid);
  else renderQuery(body, memo, app.overview, app.queries.get(qid));
}

async function render() {
  const main = clear($("main"));
  const route = app.route;
  drawList();
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("on", a.dataset.view === route.view);
  try {
    if (!app.overview) await loadOverview();
    if (route.view === "error") main.appendChild(h("p", { class: "error" }, route.message));
    else if (route.view === "builds") { main.appendChild(h("h2", {}, "Builds")); await renderBuilds(main, openConversation); }
    else if (route.view === "quarantine") { main.appendChild(h("h2", {}, "Quarantine")); await renderQuarantine(main, openConversation); }
    else if (route.view === "conversation") await drawConversation(main, route);
    else drawHome(main);
  } catch (e) {
    clear(main).appendChild(failure(e, route));
  }
}

function failure(e, route) {
  if (!(e instanceof ApiError)) {
    console.error(e);
    return h("p", { class: "error" }, `The page failed: ${e.message}`);
  }
  if (e.status === 503) return h("div", { class: "card" }, h("h3", {}, "Nothing published yet"),
    h("p", {}, "Build the memory first (tmem build); the explorer follows the newest published snapshot."));
  if (e.status === 404 && route.view === "conversation") return h("div", { class: "card" },
    h("h3", {}, "No published memory for this conversation"), h("p", {}, "The id must match exactly: "), idText(route.id));
  if (e.status === 401) return h("div", { class: "card" }, h("h3", {}, "API key needed"),
    h("p", {}, "This server requires TMEM_API_KEY. "), h("button", { class: "btn", type: "button", onclick: () => askKey() }, "Enter the key"));
  return h("p", { class: "error" }, e.message);
}

async function askKey() {
  try {
    await keyDialog(Boolean(storedKey()));
  } catch (e) {
    return;  // cancelled: the page keeps showing what it could load
  }
  app.overview = null;
  render();
}

function start() {
  whenUnauthorized(keyDialog);
  window.addEventListener("hashchange", () => {
    const parsed = parseHash();
    const pending = app.pendingRoute;
    app.pendingRoute = null;
    // keep the focus of an in-page jump, which the hash does not carry
    app.route = pending && routeHash(pending) === location.hash ? pending : parsed;
    render();
  });
  $("conv-filter").addEventListener("input", (ev) => { app.filter = ev.target.value; if (app.overview) drawList(); });
  $("open-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const id = $("open-id").value;  // exactly as typed: ids may carry spaces at either end
    if (id) openConversation(id);
  });
  $("key-button").addEventListener("click", askKey);
  $("key-cancel").addEventListener("click", () => $("key-dialog").close("cancel"));
  $("key-forget").addEventListener("click", () => { setKey(""); drawKeyState(); app.overview = null; app.memo = null; render(); });
  $("refresh").addEventListener("click", () => { app.overview = null; app.memo = null; render(); });
  for (const a of document.querySelectorAll("#nav a")) {
    a.addEventListener("click", (ev) => { ev.preventDefault(); navigate({ view: a.dataset.view }); });
  }
  drawKeyState();
  app.route = parseHash();
  render();
}

start();
