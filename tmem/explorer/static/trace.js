// The query box and the drawing of the cascade's trace: per stage the candidates, their rank in
// each list, which channel reached each hit, the TrigRecall gate, and what went into the context
// with its tokens. "Follow" a scene or item to see, stage by stage, why it was or was not recalled.

import { api } from "./api.js";
import { badge, channel, chip, clear, day, empty, h, idText, num, score, span, styled, visible } from "./dom.js";

const STAGES = {
  topic_prefilter: ["1", "Topic prefilter", (c) =>
    `RRF of BM25 and dense over topics \u2192 top kT = ${c.k_topics}; the scenes of those topics form the pool P_S.`],
  scene_cue: ["2", "SceneCue", (c) =>
    `RRF of the cosine to each scene's dialogue, scene trigger and best horizon sentence, over all scenes \u2192 ` +
    `top k_cue = ${c.k_cue} (A_S). Not gated by the prefilter.`],
  scene_selection: ["3", "Scene selection", (c) =>
    `Over P_S \u222a A_S: BM25 and dense (within the pool) and the SceneCue ranking, fused by ${c.scene_fusion} ` +
    `\u2192 top kS = ${c.k_scenes}.`],
  trig_recall: ["4", "TrigRecall", (c) =>
    `Best cosine over each item's entity, bridge and joint trigger views; items past the gate (the default: ` +
    `z \u2265 ${c.trigger_gate_z} robust standard deviations above this query's median trigger score; the paper: ` +
    `cosine \u2265 ${c.trigger_gate}), at most R = ${c.trigger_cap} \u2192 A_I. Not gated by the scenes.`],
  item_selection: ["5", "Item selection", (c) =>
    `Over the items of the selected scenes \u222a A_I: BM25, dense and the TrigRecall ranking, fused by ` +
    `${c.item_fusion} \u2192 top kI = ${c.k_items}.`],
};
const ROWS_SHOWN = 12;
const ITEMS_SHOWN = 8;

export function renderQuery(root, memo, overview, state) {
  const conv = memo.conversation;
  const query = h("input", { class: "input grow", type: "search", name: "query", placeholder: "Ask the memory\u2026",
    value: state.lastQuery || "", autocomplete: "off", "aria-label": "query" });
  const speaker = h("select", { class: "input", name: "speaker", "aria-label": "speaker" },
    h("option", { value: "" }, "any speaker"), conv.speakers.map((s) => h("option", { value: s }, visible(s))));
  const preset = h("select", { class: "input", name: "preset", "aria-label": "preset" },
    overview.presets.map((p) => h("option", { value: p, selected: p === "default" }, p)));
  const lexical = h("input", { type: "checkbox", name: "lexical" });
  const budget = h("input", { class: "input num", type: "number", min: "0", step: "100", name: "budget",
    value: String(overview.defaults.context_token_budget), "aria-label": "token budget" });
  const run = h("button", { class: "btn primary", type: "submit" }, "Run the cascade");
  const out = h("div", { class: "explain" });
  const form = h("form", { class: "query-form", onsubmit: async (ev) => {
    ev.preventDefault();
    const text = query.value.trim();
    if (!text) return query.focus();
    state.lastQuery = text;
    run.disabled = true;
    clear(out).appendChild(h("p", { class: "muted" }, "Running the cascade\u2026"));
    try {
      const result = await api.explain({
        conversation_id: conv.conversation_id, query: text, speaker: speaker.value || null, preset: preset.value,
        embed: !lexical.checked, budget_tokens: budget.value === "" ? null : Number(budget.value),
      });
      state.follow = null;
      drawExplain(clear(out), result, memo, state);
    } catch (e) {
      clear(out).appendChild(h("p", { class: "error" }, e.message));
    } finally {
      run.disabled = false;
    }
  } },
  h("div", { class: "query-row" }, query, run),
  h("div", { class: "query-opts" },
    h("label", {}, "speaker ", speaker), h("label", {}, "preset ", preset),
    h("label", {}, "context budget ", budget, " tokens"), h("label", {}, lexical, " lexical only (no embedding)")));
  root.append(form, out);
  if (!state.lastQuery) out.appendChild(empty(
    "Run a query to see every stage of the cascade: the candidates, their rank in each list, the channel " +
    "that reached each hit, the TrigRecall gate and what went into the context."));
  query.focus();
}

function drawExplain(root, out, memo, state) {
  const inContext = new Map(out.context.units.map((u) => [`${u.kind}:${u.id}`, u]));
  const followBox = h("div", { class: "follow-box" });
  const stagesBox = h("div", { class: "stages" });
  const redraw = () => {
    clear(followBox).appendChild(followPanel(out, memo, state, inContext));
    clear(stagesBox);
    for (const stage of out.stages) stagesBox.appendChild(stageCard(stage, out, state, redraw));
    if (!out.stages.length) stagesBox.appendChild(empty("No stage ran (every layer switched off by the preset)."));
  };
  const follow = (kind, id) => { state.follow = { kind, id }; redraw(); followBox.scrollIntoView({ block: "nearest" }); };
  root.append(
    h("div", { class: "run-meta" },
      badge(out.mode, `mode-${out.mode}`, out.mode === "lexical" ? "BM25 only: no query vector" : "BM25 + dense + triggers"),
      h("span", {}, `preset ${out.preset}`), h("span", {}, `${score(out.took_ms, 1)} ms`),
      h("span", { class: "muted" }, "query tokens:"), out.query_tokens.map((t) => chip(t)),
      out.snapshot_id !== memo.snapshot_id ? badge("answered from a newer snapshot: Refresh to reload the memory", "warn") : null),
    recalled(out, memo, inContext, follow),
    contextPanel(out),
    h("div", { class: "follow-bar" }, h("label", {}, "Follow a memory through the stages ", followSelect(out, memo, state, follow))),
    followBox, stagesBox);
  redraw();
}

function recalled(out, memo, inContext, follow) {
  const ctx = (kind, id) => {
    const u = inContext.get(`${kind}:${id}`);
    if (!u) return null;
    const part = u.in_context && u.turns && u.turns_in_context < u.turns ? ` \u00b7 ${u.turns_in_context} of ${u.turns} turns` : "";
    return badge(u.in_context ? `in context${part} \u00b7 ${num(u.tokens)} tok` : `dropped (budget) \u00b7 ${num(u.tokens)} tok`,
      u.in_context ? "ok" : "warn");
  };
  const scenes = out.scenes.map((s, i) => h("li", { class: "hit", onclick: () => follow("scene", s.scene_id) },
    h("span", { class: "rank" }, i + 1),
    h("div", { class: "hit-body" }, h("div", { class: "hit-title" }, s.title),
      h("div", { class: "meta-row" }, h("span", { class: "date" }, span(s.start_time, s.end_time)),
        s.channels.map((c) => channel(c)), h("span", { class: "muted" }, `score ${score(s.score, 4)}`), ctx("scene", s.scene_id)))));
  const items = out.items.map((it, i) => h("li", { class: "hit", onclick: () => follow("item", it.item_id) },
    h("span", { class: "rank" }, i + 1),
    h("div", { class: "hit-body" }, h("div", { class: "hit-title clamp2", title: it.content }, it.content),
      h("div", { class: "meta-row" }, badge(it.kind, `kind-${it.kind}`), h("span", { class: "date" }, day(it.event_time)),
        it.channels.map((c) => channel(c)), h("span", { class: "muted" }, `score ${score(it.score, 4)}`), ctx("item", it.item_id)))));
  const persona = out.personas.length ? h("p", { class: "muted" }, `Personas appended (outside the budget): `,
    out.personas.map((p) => visible(p.speaker)).join(", "),
    out.persona_speaker ? (out.persona_matched ? " \u2014 the speaker's own" : " \u2014 the speaker did not match: all") : "") : null;
  return h("div", { class: "recalled" },
    h("section", { class: "card" }, h("h3", {}, `Recalled scenes (${out.scenes.length})`),
      scenes.length ? h("ol", { class: "hits" }, scenes) : empty("No scene recalled.")),
    h("section", { class: "card" }, h("h3", {}, `Recalled items (${out.items.length})`),
      items.length ? itemList(items) : empty("No item recalled."), persona));
}

// The first items, the rest a click away: fifteen facts would push the trace off the screen.
function itemList(items) {
  const list = h("ol", { class: "hits" }, items.slice(0, ITEMS_SHOWN));
  if (items.length <= ITEMS_SHOWN) return list;
  const more = h("button", { class: "btn small link", type: "button", onclick: () => {
    for (const li of items.slice(ITEMS_SHOWN)) list.appendChild(li);
    more.remove();
  } }, `Show all ${items.length} items`);
  return [list, more];
}

function contextPanel(out) {
  const r = out.context.report;
  const pct = r.budget ? Math.min(100, (100 * r.tokens_used) / r.budget) : 0;
  return h("section", { class: "card context" },
    h("h3", {}, "Context handed to the answer model"),
    h("div", { class: "budget" }, h("div", { class: "budget-bar" }, styled(h("div", { class: "budget-used" }), { width: `${pct.toFixed(1)}%` })),
    h("span", {}, `${num(r.tokens_used)} of ${num(r.budget)} tokens for scenes and items`),
    h("span", { class: "muted" }, ` + ${num(r.persona_tokens)} persona = ${num(r.total_tokens)} total (estimated: 4 characters a token)`)),
    h("p", { class: "muted" }, `${r.scenes_kept} scenes (${r.scenes_partial} of them by their best-matching turns, ` +
      `${r.turns_kept} turns in all) and ${r.items_kept} items kept; ${r.scenes_dropped} scenes and ` +
      `${r.items_dropped} items left out by the budget.`),
    h("details", {}, h("summary", {}, "Show the context text"), h("pre", { class: "pre" }, out.context.text || "(empty)")));
}

function followSelect(out, memo, state, follow) {
  const sel = h("select", { class: "input", "aria-label": "follow" }, h("option", { value: "" }, "choose a scene or item\u2026"));
  const groups = [["Recalled scenes", out.scenes.map((s) => ["scene", s.scene_id, s.title])],
    ["Recalled items", out.items.map((i) => ["item", i.item_id, i.content])],
    ["All scenes", memo.scenes.map((s) => ["scene", s.scene_id, s.title])],
    ["All items", memo.items.map((i) => ["item", i.item_id, i.content])]];
  const options = [];
  for (const [label, rows] of groups) {
    if (!rows.length) continue;
    sel.appendChild(h("optgroup", { label }, rows.map(([kind, id, text]) => {
      options.push([kind, id]);
      const n = options.length - 1;
      const selected = state.follow && state.follow.kind === kind && state.follow.id === id;
      return h("option", { value: String(n), selected }, text.length > 90 ? text.slice(0, 90) + "\u2026" : text);
    })));
  }
  sel.addEventListener("change", () => { if (sel.value !== "") follow(...options[Number(sel.value)]); });
  return sel;
}

function stageCard(stage, out, state, redraw) {
  const [n, title, describe] = STAGES[stage.stage];
  const followed = state.follow && state.follow.kind === stage.kind ? state.follow.id : null;
  const expanded = state.expanded && state.expanded.has(stage.stage);
  const rows = stage.candidates.filter((c, i) => expanded || i < ROWS_SHOWN || c.id === followed);
  const trig = stage.stage === "trig_recall";
  const head = h("tr", {}, h("th", { title: "kept by this stage" }, ""), h("th", {}, "#"), h("th", { class: "cand" }, stage.kind),
    trig ? ["con", "brg", "joint"].map((v) => h("th", { class: "numc", title: `cosine to the ${v} view` }, v)) : null,
    trig ? h("th", { class: "gatec" }, `best vs \u03c4 = ${out.gate ? out.gate.tau : ""}`) : null,
    stage.lists.map((l) => h("th", { class: "numc" }, channel(l), h("div", { class: "lim" }, `reaches \u2264 ${stage.limits[l] ?? "?"}`))),
    trig ? null : h("th", { class: "numc", title: `fused score (${stage.fusion})` }, stage.fusion),
    stage.stage.endsWith("selection") ? h("th", {}, "entered via") : null,
    stage.stage === "topic_prefilter" || trig ? null : h("th", {}, "reached by"),
    stage.stage === "scene_cue" || trig ? h("th", {}, trig ? "best view" : "best horizon") : null);
  const body = rows.map((c) => h("tr", { class: `${c.selected ? "kept" : ""}${c.id === followed ? " followed" : ""}` },
    h("td", { class: "mark" }, c.selected ? "\u2713" : ""),
    h("td", { class: "pos" }, stage.candidates.indexOf(c) + 1),
    h("td", { class: "cand" }, h("div", { class: "label" }, c.label || visible(c.id)), idText(c.id, "mono id faint")),
    trig ? ["con", "brg", "joint"].map((v) => h("td", { class: "numc" }, score(c.scores[v]))) : null,
    trig ? h("td", { class: "gatec" }, gateBar(c.scores.max, out.gate)) : null,
    stage.lists.map((l) => rankCell(c, l, stage.limits[l])),
    trig ? null : h("td", { class: "numc mono" }, score(c.fused, 4)),
    stage.stage.endsWith("selection") ? h("td", {}, c.pools.map((p) => badge(p.replaceAll("_", " "), "pool"))) : null,
    stage.stage === "topic_prefilter" || trig ? null : h("td", { class: "chans" }, c.channels.map((ch) => channel(ch))),
    stage.stage === "scene_cue" || trig ? h("td", { class: "detail", title: c.detail || null },
      h("div", { class: "clamp" }, c.detail)) : null));
  const more = stage.candidates.length > ROWS_SHOWN ? h("button", { class: "btn small link", type: "button", onclick: () => {
    state.expanded = state.expanded || new Set();
    if (expanded) state.expanded.delete(stage.stage); else state.expanded.add(stage.stage);
    redraw();
  } }, expanded ? "Show fewer" : `Show all ${stage.candidates.length} candidates`) : null;
  return h("section", { class: "card stage", dataset: { stage: stage.stage } },
    h("header", {}, h("span", { class: "stage-n" }, n), h("h3", {}, title),
      h("span", { class: "chip" }, `${stage.candidates.length} candidates`),
      h("span", { class: "chip" }, `pool ${num(stage.pool_size)}`), h("span", { class: "chip" }, `kept ${stage.selected.length} / ${stage.keep}`),
      stage.note ? h("span", { class: "chip gate" }, stage.note) : null),
    h("p", { class: "muted" }, describe(out.config)),
    trig && out.gate ? h("p", { class: "gate-line" }, `${out.gate.passed} of the ${out.gate.listed} nearest items reached \u03c4 = ${score(out.gate.tau)}` +
      (out.gate.rule === "robust_z" ? ` (robust z \u2265 ${out.gate.z} over this query's trigger cosines)` : " (fixed cosine)") +
      (out.gate.best !== null ? `; the best trigger cosine is ${score(out.gate.best)}` : "") +
      (out.gate.passed === 0 ? " \u2014 the gate let nothing through." : ".")) : null,
    stage.candidates.length ? h("div", { class: "table-wrap" }, h("table", { class: "trace" }, h("thead", {}, head), h("tbody", {}, body)))
      : empty("No candidate."), more);
}

function rankCell(c, list, limit) {
  const rank = c.ranks[list];
  if (rank === undefined) return h("td", { class: "numc absent", title: "absent from this list" }, "\u2014");
  const s = c.scores[list];
  return h("td", { class: `numc rank${rank <= limit ? " reach" : ""} r-${list}`,
    title: s !== undefined ? `rank ${rank}, score ${score(s, 4)}` : `rank ${rank}` }, h("span", { class: "rk" }, rank),
    s !== undefined ? h("span", { class: "sc" }, score(s, 3)) : null);
}

function gateBar(value, gate) {
  if (!Number.isFinite(value)) return h("span", { class: "muted" }, "no trigger");
  const pos = (x) => `${Math.max(0, Math.min(100, x * 100)).toFixed(1)}`;  // cosine 0..1 (negatives at 0)
  const passed = gate && value >= gate.tau;
  return h("div", { class: "gate-cell" },
    h("div", { class: "gate-bar" }, styled(h("div", { class: `gate-fill${passed ? " pass" : ""}` }), { width: `${pos(value)}%` }),
      gate ? styled(h("div", { class: "gate-tau", title: `\u03c4 = ${gate.tau}` }), { left: `${pos(gate.tau)}%` }) : null),
    h("span", { class: "mono" }, score(value)));
}

function stageOf(out, name) {
  return out.stages.find((s) => s.stage === name) || null;
}

function step(ok, title, text) {
  return h("li", { class: ok === true ? "ok" : ok === false ? "no" : "na" },
    h("span", { class: "step-mark" }, ok === true ? "\u2713" : ok === false ? "\u2717" : "\u2013"), h("b", {}, title), " ", text);
}

function ranksText(c) {
  const parts = Object.entries(c.ranks).map(([l, r]) => `${l} #${r}`);
  return parts.length ? parts.join(", ") : "in no list";
}

function followPanel(out, memo, state, inContext) {
  if (!state.follow) return h("div", {});
  const { kind, id } = state.follow;
  const obj = kind === "scene" ? memo.scenes.find((s) => s.scene_id === id) : memo.items.find((i) => i.item_id === id);
  const steps = kind === "scene" ? scenePath(out, memo, obj, id) : itemPath(out, memo, obj, id);
  const u = inContext.get(`${kind}:${id}`);
  const returned = (kind === "scene" ? out.scenes.map((s) => s.scene_id) : out.items.map((i) => i.item_id)).indexOf(id);
  steps.push(step(returned >= 0, "Result", returned >= 0
    ? `returned at #${returned + 1}` + (u ? (u.in_context ? `, in the context (${num(u.tokens)} tokens)` : ", but dropped from the context by the budget") : "")
    : "not returned"));
  return h("section", { class: "card follow" }, h("h3", {}, `Why ${kind} \u201c`, obj ? (kind === "scene" ? obj.title : obj.content) : visible(id),
    `\u201d was ${returned >= 0 ? "" : "not "}recalled`), h("ol", { class: "path" }, steps));
}

function scenePath(out, memo, scene, id) {
  const steps = [];
  const tp = stageOf(out, "topic_prefilter");
  const topics = new Map(memo.topics.map((t) => [t.topic_id, t]));
  if (!tp) steps.push(step(null, "Topic prefilter", "off: every scene is in the pool"));
  else {
    const own = scene ? scene.topic_ids : [];
    const hit = own.filter((t) => tp.selected.includes(t));
    steps.push(step(hit.length > 0, "Topic prefilter", hit.length
      ? `in P_S through ${hit.map((t) => `\u201c${topics.get(t)?.title ?? t}\u201d`).join(", ")}`
      : own.length ? `not in P_S: none of its topics (${own.map((t) => topics.get(t)?.title ?? t).join(", ")}) made the top kT`
        : "not in P_S: it belongs to no topic"));
  }
  const cue = stageOf(out, "scene_cue");
  const cc = cue && cue.candidates.find((c) => c.id === id);
  steps.push(!cue ? step(null, "SceneCue", "did not run (lexical mode, or k_cue = 0)")
    : step(Boolean(cc && cc.selected), "SceneCue", cc ? `${ranksText(cc)} \u2192 ${cc.selected ? "in A_S" : "outside the top k_cue"}` : "no SceneCue score"));
  const sel = stageOf(out, "scene_selection");
  const sc = sel && sel.candidates.find((c) => c.id === id);
  steps.push(!sel ? step(null, "Scene selection", "scene layer off")
    : step(Boolean(sc && sc.selected), "Scene selection", sc
      ? `entered via ${sc.pools.join(" + ") || "?"}; ${ranksText(sc)}; fused ${score(sc.fused, 4)} \u2192 ${sc.selected ? "kept" : "not in the top kS"}`
      : "not a candidate: neither in P_S nor in A_S, or in no rank list (no lexical match in lexical mode)"));
  return steps;
}

function itemPath(out, memo, item, id) {
  const steps = [];
  const trig = stageOf(out, "trig_recall");
  const tc = trig && trig.candidates.find((c) => c.id === id);
  steps.push(!trig ? step(null, "TrigRecall", "did not run (lexical mode, or item triggers off)")
    : step(Boolean(tc && tc.selected), "TrigRecall", tc
      ? `best trigger cosine ${score(tc.scores.max)} (${tc.detail || "?"}) vs \u03c4 = ${out.gate.tau} \u2192 ` +
        (tc.selected ? "in A_I" : "entity_bridge" in tc.ranks ? "passed the gate but over the cap R" : "below the gate")
      : "not among the nearest items by trigger cosine"));
  const sel = stageOf(out, "item_selection");
  const ic = sel && sel.candidates.find((c) => c.id === id);
  const chosen = new Set(out.scenes.map((s) => s.scene_id));
  const sources = item ? item.source_scene_ids : [];
  const via = sources.filter((s) => chosen.has(s));
  steps.push(!sel ? step(null, "Item selection", "item channel off")
    : step(Boolean(ic && ic.selected), "Item selection", ic
      ? `entered via ${ic.pools.join(" + ") || "?"}; ${ranksText(ic)}; fused ${score(ic.fused, 4)} \u2192 ${ic.selected ? "kept" : "not in the top kI"}`
      : via.length ? "its scene was selected, but it is in no rank list (no lexical match in lexical mode)"
        : "not a candidate: none of its source scenes was selected and its triggers did not pass the gate"));
  return steps;
}
