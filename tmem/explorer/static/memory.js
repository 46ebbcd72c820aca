// A conversation's memory: the timeline of scenes (turns on demand), topics, items with their
// triggers, personas, and its quarantine records.

import { api } from "./api.js";
import { badge, chip, clear, day, dayTime, empty, h, idText, section, span, visible } from "./dom.js";

const ATTRIBUTES = ["situation", "object", "event", "emotion"];
const HORIZONS = ["personal_arc", "avoidance_habit", "goal_arc", "belief_in_action", "legacy_anchor"];

export function speakerClass(memo, speaker) {
  const i = memo.speakers.indexOf(speaker);
  return `spk spk-${i < 0 ? "x" : i % 4}`;
}

function turnList(memo, turns) {
  return h("ol", { class: "turns" }, turns.map((t) =>
    h("li", {},
      h("span", { class: "turn-meta mono" }, `${t.turn_id} \u00b7 ${dayTime(t.event_time)}`),
      h("span", { class: speakerClass(memo, t.speaker) }, visible(t.speaker)),
      h("span", { class: "turn-text" }, t.text))));
}

function kindBadge(kind) {
  return badge(kind, `kind-${kind}`, kind === "atomic" ? "one source scene" : "links several scenes of one topic");
}

export function renderTimeline(root, memo, open) {
  const byDay = new Map();
  for (const scene of memo.scenes) {
    const key = day(scene.start_time);
    if (!byDay.has(key)) byDay.set(key, []);
    byDay.get(key).push(scene);
  }
  if (!memo.scenes.length) return root.appendChild(empty("No scenes in this memory."));
  const items = new Map(memo.items.map((i) => [i.item_id, i]));
  const topics = new Map(memo.topics.map((t) => [t.topic_id, t]));
  const line = h("div", { class: "timeline" });
  for (const [date, scenes] of byDay) {
    line.appendChild(h("div", { class: "tl-day" }, h("span", {}, date)));
    for (const scene of scenes) line.appendChild(sceneCard(memo, scene, items, topics, open));
  }
  root.appendChild(line);
}

function sceneCard(memo, scene, items, topics, open) {
  const turnsBox = h("div", { class: "turns-box" });
  const button = h("button", { class: "btn small", type: "button" }, `Show ${scene.turn_count} turns`);
  let shown = false;
  button.addEventListener("click", async () => {
    if (shown) {
      clear(turnsBox);
      shown = false;
      button.textContent = `Show ${scene.turn_count} turns`;
      return;
    }
    button.disabled = true;
    button.textContent = "Loading\u2026";
    try {
      const out = await api.turns(memo.conversation.conversation_id, scene.scene_id);
      clear(turnsBox).appendChild(turnList(memo.conversation, out.turns));
      shown = true;
      button.textContent = "Hide turns";
    } catch (e) {
      clear(turnsBox).appendChild(h("p", { class: "error" }, e.message));
      button.textContent = `Show ${scene.turn_count} turns`;
    } finally {
      button.disabled = false;
    }
  });
  const triggers = ATTRIBUTES.filter((a) => scene.triggers[a]);
  const horizons = HORIZONS.filter((c) => scene.horizons[c]);
  return h("article", { class: "tl-scene", id: `scene-${memo.sceneIndex.get(scene.scene_id)}` },
    h("div", { class: "tl-dot" }),
    h("header", {},
      h("span", { class: "seq" }, `#${scene.seq + 1}`),
      h("h4", {}, scene.title),
      h("span", { class: "muted" }, span(scene.start_time, scene.end_time))),
    h("p", { class: "summary" }, scene.summary),
    h("div", { class: "meta-row" },
      scene.session_ids.map((s) => chip(s, "session")),
      scene.topic_ids.map((t) => h("a", { class: "chip topic-chip", href: "#", onclick: (ev) => {
        ev.preventDefault(); open("topics", t);
      } }, visible(topics.get(t)?.title ?? t))),
      h("span", { class: "muted" }, `${scene.item_ids.length} items`)),
    h("details", {},
      h("summary", {}, "Narrative, triggers and items"),
      h("p", { class: "narrative" }, scene.narrative),
      h("div", { class: "trig-grid" },
        h("div", {}, h("h5", {}, "Scene trigger"), triggers.length
          ? h("dl", {}, triggers.map((a) => [h("dt", {}, a), h("dd", {}, scene.triggers[a])]))
          : empty("none")),
        h("div", {}, h("h5", {}, "Horizon triggers"), horizons.length
          ? h("dl", {}, horizons.map((c) => [h("dt", {}, c.replaceAll("_", " ")), h("dd", {}, scene.horizons[c])]))
          : empty("none"))),
      scene.item_ids.length ? h("ul", { class: "plain" }, scene.item_ids.map((id) => {
        const item = items.get(id);
        return h("li", {}, item ? kindBadge(item.kind) : null, " ", item ? item.content : visible(id));
      })) : null),
    h("div", { class: "turn-actions" }, button, idText(scene.scene_id, "mono id faint")),
    turnsBox);
}

export function renderTopics(root, memo, focus, open) {
  if (!memo.topics.length) return root.appendChild(empty("No topics in this memory."));
  const scenes = new Map(memo.scenes.map((s) => [s.scene_id, s]));
  const grid = h("div", { class: "topic-grid" });
  for (const topic of memo.topics) {
    const card = h("article", { class: `topic${topic.topic_id === focus ? " focused" : ""}` },
      h("h4", {}, topic.title),
      h("div", { class: "chips" }, topic.keywords.map((k) => chip(k))),
      h("ol", { class: "plain scenes" }, topic.scene_ids.map((id) => {
        const s = scenes.get(id);
        return h("li", {}, h("a", { href: "#", onclick: (ev) => { ev.preventDefault(); open("timeline", id); } },
          s ? s.title : visible(id)), s ? h("span", { class: "muted" }, ` \u00b7 ${day(s.start_time)}`) : null);
      })),
      idText(topic.topic_id, "mono id faint"));
    grid.appendChild(card);
    if (topic.topic_id === focus) setTimeout(() => card.scrollIntoView({ block: "center" }), 0);
  }
  root.appendChild(grid);
}

export function renderItems(root, memo, open) {
  const scenes = new Map(memo.scenes.map((s) => [s.scene_id, s]));
  let kind = "all";
  const filter = h("input", { type: "search", placeholder: "Filter items, triggers\u2026", class: "input" });
  const list = h("div", { class: "item-list" });
  const kinds = h("div", { class: "seg" }, ["all", "atomic", "connected"].map((k) =>
    h("button", { type: "button", class: k === kind ? "on" : "", onclick: (ev) => {
      kind = k;
      for (const b of kinds.children) b.classList.toggle("on", b === ev.currentTarget);
      draw();
    } }, k)));
  function draw() {
    const words = filter.value.toLowerCase().split(/\s+/).filter(Boolean);
    clear(list);
    const shown = memo.items.filter((i) => (kind === "all" || i.kind === kind) && words.every((w) =>
      [i.content, ...i.entities, ...i.bridges.map((b) => b.situation + " " + b.rationale), ...i.keywords]
        .join(" ").toLowerCase().includes(w)));
    if (!shown.length) list.appendChild(empty("No item matches."));
    for (const item of shown) {
      list.appendChild(h("article", { class: "item" },
        h("header", {}, kindBadge(item.kind), h("span", { class: "date" }, day(item.event_time))),
        h("p", { class: "content" }, item.content),
        h("div", { class: "meta-row" }, h("span", { class: "muted" }, "from "), item.source_scene_ids.map((id) =>
          h("a", { class: "chip", href: "#", onclick: (ev) => { ev.preventDefault(); open("timeline", id); } },
            visible(scenes.get(id)?.title ?? id)))),
        item.entities.length ? h("div", { class: "trig" }, h("h5", {}, "Entity triggers"),
          h("div", { class: "chips" }, item.entities.map((e) => chip(e)))) : null,
        item.bridges.length ? h("div", { class: "trig" }, h("h5", {}, "Bridge triggers"),
          h("ul", { class: "plain bridges" }, item.bridges.map((b) =>
            h("li", {}, h("span", {}, b.situation), h("span", { class: "muted" }, ` \u2014 ${b.rationale}`))))) : null,
        idText(item.item_id, "mono id faint")));
    }
  }
  filter.addEventListener("input", draw);
  root.appendChild(h("div", { class: "toolbar" }, filter, kinds,
    h("span", { class: "muted" }, `${memo.items.length} items`)));
  root.appendChild(list);
  draw();
}

export function renderPersonas(root, memo) {
  if (!memo.personas.length) return root.appendChild(empty("No personas in this memory."));
  const grid = h("div", { class: "persona-grid" });
  for (const p of memo.personas) {
    const rows = [["Identity", p.identity], ["Preferences", p.preferences], ["Traits and attitudes", p.traits],
      ["Relations", p.relations]];
    grid.appendChild(h("article", { class: "persona" },
      h("h4", { class: speakerClass(memo.conversation, p.speaker) }, visible(p.speaker)),
      rows.map(([label, values]) => values.length
        ? [h("h5", {}, label), h("ul", { class: "plain" }, values.map((v) => h("li", {}, v)))] : null),
      p.timeline.length ? [h("h5", {}, "Timeline"), h("ul", { class: "plain" }, p.timeline.map((f) =>
        h("li", {}, f.since ? h("span", { class: "date" }, `since ${f.since} `) : null, f.fact)))] : null));
  }
  root.appendChild(grid);
}

export async function renderConversationQuarantine(root, conversationId) {
  const out = await api.conversationQuarantine(conversationId);
  if (!out.records.length) return root.appendChild(empty("No quarantine record for this conversation."));
  for (const q of out.records) {
    root.appendChild(section(`${q.operation} \u00b7 ${q.error_type}`,
      h("div", { class: "meta-row" }, badge(q.state, `state-${q.state}`), h("span", { class: "muted" },
        `quarantined ${dayTime(q.quarantined_at)} UTC by run `), idText(q.run_id),
        q.cleared_by_run ? h("span", { class: "muted" }, ` \u00b7 cleared by ${q.cleared_by_run}`) : null),
      h("p", {}, q.reason),
      h("p", { class: "muted" }, `input ${q.input_ref}${q.input_digest ? ` \u00b7 digest ${q.input_digest}` : ""}`),
      q.input_excerpt ? [h("h5", {}, "Input excerpt"), h("pre", { class: "pre" }, q.input_excerpt)] : null,
      q.raw_output ? [h("h5", {}, "Raw model output"), h("pre", { class: "pre" }, q.raw_output)] : null));
  }
}
