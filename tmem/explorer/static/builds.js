// Build runs, published snapshots and quarantined conversations, as the served snapshot records them.

import { api } from "./api.js";
import { ago, badge, dayTime, empty, h, idText, num, section, shortId } from "./dom.js";

function statusBadge(status) {
  return badge(status, `status-${status}`);
}

export async function renderBuilds(root, open) {
  const out = await api.runs();
  root.appendChild(h("p", { class: "note" }, out.note));
  if (!out.recorded) root.appendChild(empty("No build records in this snapshot."));
  else if (!out.runs.length) root.appendChild(empty("No build run recorded."));
  else {
    const rows = out.runs.map((r) => h("tr", {},
      h("td", {}, idText(r.run_id, "mono"), r.label ? h("div", { class: "muted" }, r.label) : null),
      h("td", {}, statusBadge(r.status), r.published_current ? badge("serving", "ok", "published the snapshot being served") : null,
        r.only_changed ? badge("changed only", "pool") : null),
      h("td", {}, dayTime(r.started_at), h("div", { class: "muted" }, ago(r.started_at))),
      h("td", { class: "numc" }, r.seconds === null ? "\u2014" : `${r.seconds.toFixed(1)} s`),
      h("td", { class: "numc" }, num(r.conversations_requested)),
      h("td", { class: "numc" }, num(r.llm_calls), h("div", { class: "muted" }, `${num(r.llm_cache_hits)} cached`)),
      h("td", { class: "numc" }, num(r.prompt_tokens), h("div", { class: "muted" }, `+ ${num(r.completion_tokens)}`)),
      h("td", { class: "wrap fails-cell" }, r.failures.length ? h("ul", { class: "plain fails" }, r.failures.map((f) => h("li", {},
        f.conversation_id !== null ? h("a", { href: "#", onclick: (ev) => { ev.preventDefault(); open(f.conversation_id); } },
          shortId(f.conversation_id, 18)) : null, " ", badge(f.error_type || "error", f.quarantined ? "warn" : "bad"),
        f.operation ? h("span", { class: "muted" }, ` ${f.operation}`) : null))) : h("span", { class: "muted" }, "none")),
      h("td", {}, r.snapshot_id ? h("span", { class: "mono", title: r.snapshot_id }, shortId(r.snapshot_id, 16))
        : h("span", { class: "muted" }, "\u2014"))));
    root.appendChild(section("Build runs", h("div", { class: "table-wrap" }, h("table", { class: "grid" },
      h("thead", {}, h("tr", {}, ["run", "status", "started (UTC)", "took", "conversations", "LLM calls",
        "tokens in + out", "failures", "snapshot"].map((t) => h("th", {}, t)))),
      h("tbody", {}, rows)))));
  }
  root.appendChild(section("Published snapshots", out.snapshots.length ? h("table", { class: "grid" },
    h("thead", {}, h("tr", {}, ["snapshot", "published (UTC)", "conversations", ""].map((t) => h("th", {}, t)))),
    h("tbody", {}, out.snapshots.map((s) => h("tr", {}, h("td", { class: "mono" }, s.snapshot_id),
      h("td", {}, dayTime(s.created_at), h("span", { class: "muted" }, ` \u00b7 ${ago(s.created_at)}`)),
      h("td", { class: "numc" }, num(s.conversations)), h("td", {}, s.current ? badge("served", "ok") : null)))))
    : empty("No snapshot.")));
}

export async function renderQuarantine(root, open) {
  const out = await api.quarantine();
  root.appendChild(h("p", { class: "note" }, out.note));
  if (!out.recorded) return root.appendChild(empty("No quarantine records in this snapshot."));
  if (!out.records.length) return root.appendChild(empty("No conversation was ever quarantined."));
  root.appendChild(section("Quarantined conversations", h("div", { class: "table-wrap" }, h("table", { class: "grid" },
    h("thead", {}, h("tr", {}, ["conversation", "state", "operation", "reason", "quarantined (UTC)", "run"].map((t) => h("th", {}, t)))),
    h("tbody", {}, out.records.map((q) => h("tr", {},
      h("td", { class: "wrap" }, h("a", { href: "#", onclick: (ev) => { ev.preventDefault(); open(q.conversation_id, "quarantine"); } },
        idText(q.conversation_id, "mono")), q.published ? null : h("div", { class: "muted" }, "no published memory")),
      h("td", {}, badge(q.state, `state-${q.state}`)),
      h("td", {}, q.operation, h("div", { class: "muted" }, q.error_type)),
      h("td", { class: "reason wrap" }, q.reason),
      h("td", {}, dayTime(q.quarantined_at)),
      h("td", {}, h("span", { class: "mono" }, shortId(q.run_id, 12))))))))));
}
