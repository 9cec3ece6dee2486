// lmqtt console: plain ES module, no build step, no CDN. Every value from the server is set as
// text (textContent), never as HTML: client ids, users and topics come from MQTT clients.
const $ = (id) => document.getElementById(id);
let me = null;
let timer = null;
let events = null;
let samples = [];
let fleetMode = false;     // more than one gateway: the cards show the fleet's totals (every 2 s)

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (k === "text") e.textContent = v;
    // through the CSSOM: the page's Content-Security-Policy refuses style attributes (no 'unsafe-inline')
    else if (k === "style") Object.assign(e.style, v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

async function api(path, opts = {}) {
  const headers = { "Accept": "application/json" };
  if (opts.body !== undefined) headers["Content-Type"] = "application/json";
  if (me && me.csrf && opts.method === "POST") headers["X-CSRF-Token"] = me.csrf;
  const r = await fetch(path, { method: opts.method || "GET", headers, credentials: "same-origin",
                                body: opts.body === undefined ? undefined : JSON.stringify(opts.body) });
  const data = await r.json().catch(() => ({}));
  if (r.status === 401) { showLogin(data.why); throw new Error("login required"); }
  if (!r.ok) throw new Error(data.error || `HTTP ${r.status}`);
  return data;
}

function fmt(n, digits = 0) {
  if (n === null || n === undefined) return "-";
  return Number(n).toLocaleString("en-US", { maximumFractionDigits: digits });
}
function ago(s) {
  if (s < 60) return `${Math.round(s)}s ago`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${Math.round(s % 60)}s ago`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m ago`;
}

function showLogin(why) {
  for (const p of document.querySelectorAll(".page")) p.hidden = true;
  $("login").hidden = false;
  $("nav").hidden = true;
  $("login-error").textContent = why || "";
  stopLive();
}

async function login(ev) {
  ev.preventDefault();
  try {
    const r = await fetch("/console/api/login", { method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ user: $("login-user").value, password: $("login-password").value }) });
    const data = await r.json();
    if (!r.ok) { $("login-error").textContent = data.error || `HTTP ${r.status}`; return; }
    me = data; $("login").hidden = true; $("nav").hidden = false; $("login-password").value = "";
    showWho(); route();
  } catch (e) { $("login-error").textContent = String(e.message || e); }
}

function showWho() {
  const w = $("who"); w.replaceChildren();
  if (!me) return;
  w.append(el("span", { id: "who-user", text: `${me.user} (${me.role})` }));
  if (me.login_required) w.append(el("button", { id: "logout", onclick: async () => {
    await api("/console/api/logout", { method: "POST" }).catch(() => {}); me = null; showLogin(""); } }, "Log out"));
}

function stopLive() {
  if (timer) { clearInterval(timer); timer = null; }
  if (events) { events.close(); events = null; }
}

// ---- overview -----------------------------------------------------------------------------
function line(svg, series, colors) {
  svg.replaceChildren();
  const W = 600, H = 140, pad = 4;
  const all = series.flat().filter((v) => v !== null && v !== undefined);
  const max = Math.max(1, ...all);
  const n = Math.max(2, ...series.map((s) => s.length));
  series.forEach((s, i) => {
    if (!s.length) return;
    const pts = s.map((v, j) => `${(j / (n - 1)) * W},${H - pad - ((v || 0) / max) * (H - 2 * pad)}`).join(" ");
    const p = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    p.setAttribute("points", pts); p.setAttribute("fill", "none");
    p.setAttribute("stroke", colors[i]); p.setAttribute("stroke-width", "2");
    p.setAttribute("vector-effect", "non-scaling-stroke");
    svg.append(p);
  });
  const t = document.createElementNS("http://www.w3.org/2000/svg", "text");
  t.setAttribute("x", "4"); t.setAttribute("y", "14"); t.setAttribute("fill", "#8aa0b4"); t.setAttribute("font-size", "12");
  t.textContent = `max ${fmt(max, 1)}`; svg.append(t);
}

function showSample(s) {
  if (!fleetMode) {
    $("ov-connections").textContent = fmt(s.connections);
    $("ov-sessions").textContent = fmt(s.sessions);
    $("ov-sessions-dormant").textContent = s.sessions_dormant ? `${fmt(s.sessions_dormant)} dormant` : "";
    $("ov-in").textContent = fmt(s.msg_in_s, 1);
    $("ov-out").textContent = fmt(s.msg_out_s, 1);
  }
  $("ov-append").textContent = fmt(s.append_s, 1);
  $("ov-lag").textContent = s.dispatch_lag_ms === null ? "-" : `${fmt(s.dispatch_lag_ms, 2)} ms`;
  $("ov-proc").textContent = `${fmt(s.cpu_pct, 1)}% · ${fmt(s.rss_mb, 0)} MB`;
  $("ov-disk").textContent = `${fmt(s.data_mb, 1)} MB · ${fmt(s.disk_free_mb)} MB`;
  samples.push(s); if (samples.length > 3600) samples.shift();
  line($("chart-connections"), [samples.map((x) => x.connections)], ["#5ad19a"]);
  line($("chart-rates"), [samples.map((x) => x.msg_in_s), samples.map((x) => x.msg_out_s)], ["#4fb3ff", "#f7a84a"]);
  line($("chart-lag"), [samples.map((x) => x.dispatch_lag_ms)], ["#f7a84a"]);
  line($("chart-proc"), [samples.map((x) => x.cpu_pct)], ["#5ad19a"]);
}

function mb(bytes) { return bytes === null || bytes === undefined ? "-" : `${fmt(bytes / 1048576, 1)} MB`; }

function showFleet(ov) {
  const f = ov.fleet;
  fleetMode = f.members.length > 1;
  const t = f.totals;
  if (fleetMode) {
    $("ov-connections").textContent = fmt(t.connections);
    $("ov-sessions").textContent = fmt(t.sessions);
    $("ov-in").textContent = fmt(t.msg_in_s, 1);
    $("ov-out").textContent = fmt(t.msg_out_s, 1);
    $("ov-subscriptions").textContent = fmt(t.subscriptions);
  } else {
    $("ov-subscriptions").textContent = fmt(ov.subscriptions);
  }
  $("fl-count").textContent = `${f.members.length} gateway${f.members.length === 1 ? "" : "s"}` +
    (fleetMode ? " · the cards above add them up; the charts are this gateway's" : "");
  $("fl-error").textContent = f.error || "";
  $("fl-table").tBodies[0].replaceChildren(...f.members.map((m) => {
    const health = el("span", { class: m.ready ? "ok" : (m.ready === false ? "bad" : "muted"),
                                text: (m.ready ? "ready" : m.health || "-") });
    const live = m.connections !== undefined;
    return el("tr", { "data-gateway": m.gateway },
      el("td", { class: "gateway", text: m.gateway + (m.self ? " (this console)" : "") }), el("td", { class: "health" }, health),
      el("td", { text: m.mqtt || "-" }), el("td", { class: "num connections", text: live ? fmt(m.connections) : "-" }),
      el("td", { class: "num subscriptions", text: live ? fmt(m.subscriptions) : "-" }),
      el("td", { class: "num", text: live ? fmt(m.msg_in_s, 1) : "-" }), el("td", { class: "num", text: live ? fmt(m.msg_out_s, 1) : "-" }),
      el("td", { class: "num", text: live ? `${fmt(m.cpu_pct, 1)}% · ${fmt(m.rss_mb, 0)} MB` : "-" }),
      el("td", {}, m.url && !m.self ? el("a", { href: `${m.url}/console/`, text: m.url }) : (m.url || "")));
  }));
  const st = ov.store;
  // several store groups (docs/groups.md): one block per group; one store: the fixed block
  const many = Array.isArray(st.groups) && st.groups.length > 1;
  for (const id of ["st-error", "st-summary", "st-members", "st-tier"]) $(id).hidden = many;
  $("st-groups").hidden = !many;
  if (many) {
    $("st-where").textContent = `${st.groups.length} store groups`;
    $("st-groups").replaceChildren(...st.groups.map((g) => {
      const members = el("table", { class: "st-members" },
        el("thead", {}, el("tr", {}, ...["Node", "Role", "In sync", "Replication lag"].map((h) => el("th", { text: h })))),
        el("tbody"));
      const block = el("div", { class: "st-group", "data-group": g.group },
        el("h3", {}, `group ${g.group} `, el("span", { class: "muted", text: g.where })),
        el("p", { class: "error", text: g.error || "" }), el("p", { class: "st-summary" }), members,
        el("p", { class: "st-tier" }));
      showStore(g, block.querySelector(".st-summary"), members, block.querySelector(".st-tier"));
      return block;
    }));
    return;
  }
  $("st-where").textContent = st.where;
  $("st-error").textContent = st.error || "";
  showStore(st, $("st-summary"), $("st-members"), $("st-tier"));
}

// one store's counters, members and tier into the given elements
function showStore(st, summary, mt, tier) {
  if (st.stats) {
    const s = st.stats;
    summary.textContent = `log end ${fmt(s.max_offset)} B · dispatch lag ${fmt(s.dispatch_lag_bytes)} B · ` +
      `${fmt(s.segments)} segments · disk free ${mb(s.disk_free_bytes)}` + (s.disk_full ? ` · DISK FULL: ${s.disk_full_reason}` : "");
  } else summary.textContent = "";
  mt.hidden = !st.members;
  if (st.members) {
    mt.tBodies[0].replaceChildren(...st.members.map((m) => el("tr", { "data-node": m.node },
      el("td", { text: `node ${m.node}` + (m.address ? ` (${m.address})` : "") }), el("td", { class: "role", text: m.role }),
      el("td", { class: "insync", text: m.in_sync ? "yes" : "no" }), el("td", { class: "num", text: mb(m.lag_bytes) }))));
  }
  const tr = st.tier;
  tier.textContent = tr ? `tier ${tr.url}: ${tr.reachable ? "reachable" : "unreachable " + (tr.error || "")} · local ` +
    `${fmt(tr.local_segments)} segments (${mb(tr.local_bytes)}) · uploading ${fmt(tr.uploading_segments)} · in the tier ` +
    `${fmt(tr.tier_segments)} segments (${mb(tr.tier_stored_bytes)} stored of ${mb(tr.tier_raw_bytes)})` : "no tiered storage";
}

async function overview() {
  const [ov, hist] = await Promise.all([api("/console/api/overview"), api("/console/api/history")]);
  samples = hist.samples.slice(0, -1);
  showFleet(ov);
  showSample(ov.now);
  const g = ov.gateway;
  $("ov-gateway").textContent = `${g.mode} · MQTT ${g.mqtt} · pid ${g.pid} · flush ${g.flush_mode} · ` +
    (g.data_dir ? g.data_dir : `store ${g.store}`);
  events = new EventSource("/console/api/stream");
  events.onmessage = (m) => showSample(JSON.parse(m.data));
  timer = setInterval(async () => {
    const o = await api("/console/api/overview").catch(() => null);
    if (o) showFleet(o);
  }, 2000);
}

// ---- clients ------------------------------------------------------------------------------
async function disconnect(clientId, gateway, button) {
  button.disabled = true;
  try {
    await api("/console/api/clients/disconnect", { method: "POST", body: { client_id: clientId, gateway } });
    $("cl-message").textContent = "";
    await loadClients();
  } catch (e) {
    $("cl-message").textContent = `disconnect ${clientId}: ${e.message}`;
    button.disabled = false;
  }
}

async function loadClients() {
  const q = $("cl-search").value;
  const d = await api(`/console/api/clients?q=${encodeURIComponent(q)}`);
  $("cl-count").textContent = `${d.shown} shown of ${d.total} connected` + (d.gateways > 1 ? ` on ${d.gateways} gateways` : "");
  $("cl-note").textContent = (d.unreachable || []).map((u) => `${u.gateway}: ${u.error}`).join("; ");
  const body = $("cl-table").tBodies[0];
  body.replaceChildren(...d.clients.map((c) => {
    const subs = el("td", { class: "subs" }, ...c.subscriptions.map((s) => el("span", { class: "tag", text: `${s.filter} q${s.qos}` })));
    const btn = el("button", { class: "danger disconnect", "data-client": c.client_id, "data-gateway": c.gateway }, "Disconnect");
    if (me && me.role !== "admin") { btn.disabled = true; btn.title = "needs the admin role"; }
    btn.addEventListener("click", () => disconnect(c.client_id, c.gateway, btn));
    return el("tr", { "data-client": c.client_id, "data-gateway": c.gateway },
      el("td", { class: "cid", text: c.client_id }), el("td", { text: c.username || "-" }),
      el("td", { text: c.address }), el("td", { text: c.protocol }), el("td", { class: "num", text: `${c.keepalive}s` }),
      subs, el("td", { class: "num inflight", text: fmt(c.inflight) }), el("td", { class: "num queued", text: fmt(c.queued) }),
      el("td", { text: ago(c.idle_s) }), el("td", { class: "gateway", text: c.gateway }), el("td", {}, btn));
  }));
}

async function clients() {
  await loadClients();
  timer = setInterval(() => loadClients().catch(() => {}), 2000);
}

// ---- sessions -----------------------------------------------------------------------------
async function loadSessions() {
  const d = await api("/console/api/sessions");
  $("se-note").textContent = d.available ? (d.truncated ? `first ${d.sessions.length} by client id` : "") : d.why;
  $("se-count").textContent = d.available ? `${d.sessions.length}` : "";
  const body = $("se-table").tBodies[0];
  const maxLag = Math.max(1, ...d.sessions.flatMap((s) => s.subscriptions.map((x) => x.lag || 0)));
  const rows = [];
  for (const s of d.sessions) {
    const off = s.offline_s === null || s.offline_s === undefined ? "" : ` ${ago(s.offline_s).replace(" ago", "")}`;
    const state = s.connected ? el("span", { class: "ok", text: "connected" + (s.gateway ? ` on ${s.gateway}` : "") })
      : el("span", { class: "state", text: (s.dormant ? "dormant, offline" : "offline") + off });
    const subs = s.subscriptions.length ? s.subscriptions : [null];
    subs.forEach((x, i) => {
      const bar = el("div", { class: "bar" }, el("div", { style: { width: `${x && x.lag ? Math.max(2, (x.lag / maxLag) * 100) : 0}%` } }));
      rows.push(el("tr", { "data-client": s.client_id, "data-filter": x ? x.filter : "" },
        el("td", { class: "cid", text: i ? "" : s.client_id }), el("td", {}, i ? "" : state),
        el("td", { text: x ? x.filter + (x.share_group ? ` ($share/${x.share_group})` : "") : "(no subscription)" }),
        el("td", { text: x ? x.qos : "" }),
        el("td", { class: "num committed", text: x ? fmt(x.committed_offset) : "" }),
        el("td", { class: "num end", text: x ? fmt(x.max_offset) : "" }),
        el("td", { class: "num lag", text: x ? fmt(x.lag) : "" }), el("td", {}, x ? bar : "")));
    });
  }
  body.replaceChildren(...rows);
}

async function sessions() {
  await loadSessions();
  timer = setInterval(() => loadSessions().catch(() => {}), 2000);
}

// ---- consumer groups ----------------------------------------------------------------------
async function loadGroups() {
  const d = await api("/console/api/groups");
  $("gr-note").textContent = d.why || "";      // over several store groups: the ones that could not answer
  $("gr-count").textContent = d.available ? `${d.groups.length}` : "";
  const rows = [];
  for (const g of d.groups) {
    const qs = g.queues.length ? g.queues : [null];
    qs.forEach((q, i) => {
      const name = q ? (q.filter !== undefined ? q.filter : `${q.topic}:${q.queue_id}`) : "(nothing committed)";
      const pop = q && q.pop ? `${fmt(q.pop.next)} / ${fmt(q.pop.inflight)} / ${fmt(q.pop.backlog)}` : "";
      rows.push(el("tr", { "data-group": g.group, "data-queue": q ? name : "" },
        el("td", { text: i ? "" : g.group }), el("td", { class: "queue", text: name + (q && q.store_group ? ` (store group ${q.store_group})` : "") }),
        el("td", { class: "num committed", text: q ? fmt(q.committed) : "" }), el("td", { class: "num end", text: q ? fmt(q.max_offset) : "" }),
        el("td", { class: "num lag", text: q ? fmt(q.lag) : "" }), el("td", { class: "num pop", text: pop }),
        el("td", { class: "num dead", text: i ? "" : fmt(g.dead_letters) })));
    });
  }
  $("gr-table").tBodies[0].replaceChildren(...rows);
}
async function groups() {
  await loadGroups();
  timer = setInterval(() => loadGroups().catch(() => {}), 2000);
}

// ---- topics and retained -------------------------------------------------------------------
async function loadTopics() {
  const d = await api("/console/api/topics");
  $("tp-count").textContent = d.available ? `${d.count}` : (d.why || "(unavailable)");
  $("tp-table").tBodies[0].replaceChildren(...d.topics.map((t) => el("tr", { "data-topic": t.topic },
    el("td", { class: "topic", text: t.topic }), el("td", { class: "num stored", text: fmt(t.stored) }),
    el("td", { class: "num rate", text: t.rate === null ? "-" : fmt(t.rate, 1) }))));
}
async function loadRetained(ev) {
  if (ev) ev.preventDefault();
  try {
    const d = await api(`/console/api/retained?filter=${encodeURIComponent($("rt-filter").value || "#")}`);
    $("rt-error").textContent = "";
    $("rt-count").textContent = `${d.messages.length}${d.truncated ? "+" : ""}`;
    $("rt-table").tBodies[0].replaceChildren(...d.messages.map((m) => el("tr", { "data-topic": m.topic },
      el("td", { class: "topic", text: m.topic }), el("td", { text: m.qos }), el("td", { class: "num", text: fmt(m.size) }),
      el("td", { class: "payload", text: (m.binary ? "[hex] " : "") + m.payload + (m.truncated ? " …" : "") }))));
  } catch (e) {
    $("rt-error").textContent = e.message; $("rt-table").tBodies[0].replaceChildren(); $("rt-count").textContent = "";
  }
}
async function topics() {
  await Promise.all([loadTopics(), loadRetained()]);
  timer = setInterval(() => loadTopics().catch(() => {}), 2000);
}

// ---- tracer -------------------------------------------------------------------------------
let trace = null;
let traced = 0;
function stopTrace() {
  if (trace) { trace.close(); trace = null; }
  $("tr-start").disabled = false; $("tr-stop").disabled = true;
}
function startTrace(ev) {
  ev.preventDefault();
  stopTrace();
  const back = Number($("tr-since").value);
  const since = back ? Date.now() - back : Date.now();
  const flt = $("tr-filter").value;
  $("tr-error").textContent = ""; traced = 0; $("tr-count").textContent = "";
  $("tr-table").tBodies[0].replaceChildren();
  const url = `/console/api/trace?filter=${encodeURIComponent(flt)}&since=${since}`;
  // an EventSource hides the refusal's body: ask once with fetch for a clear message
  fetch(url, { headers: { "Accept": "application/json" } }).then(async (r) => {
    if (!r.ok) { const d = await r.json().catch(() => ({})); $("tr-error").textContent = d.error || `HTTP ${r.status}`; stopTrace(); return; }
    r.body.cancel();
    trace = new EventSource(url);
    $("tr-start").disabled = true; $("tr-stop").disabled = false;
    trace.addEventListener("trace_error", (m) => { $("tr-error").textContent = JSON.parse(m.data); });
    trace.onmessage = (m) => {
      $("tr-error").textContent = "";
      const body = $("tr-table").tBodies[0];
      for (const x of JSON.parse(m.data)) {
        traced += 1;
        const props = [];
        if (x.content_type) props.push(`content-type=${x.content_type}`);
        if (x.response_topic) props.push(`response-topic=${x.response_topic}`);
        if (x.message_expiry_interval !== null) props.push(`expiry=${x.message_expiry_interval}s`);
        for (const [k, v] of x.user_properties) props.push(`${k}=${v}`);
        body.prepend(el("tr", { "data-topic": x.topic },
          el("td", { text: new Date(x.store_ts).toISOString().replace("T", " ").replace("Z", "") }),
          el("td", { class: "topic", text: x.topic }), el("td", { text: x.qos }), el("td", { text: x.retain ? "yes" : "" }),
          el("td", { text: x.client_id || "-" }), el("td", { class: "props", text: props.join(" ") }),
          el("td", { class: "payload", text: (x.binary ? "[hex] " : "") + x.payload + (x.truncated ? " …" : "") })));
        while (body.rows.length > 500) body.deleteRow(body.rows.length - 1);
      }
      $("tr-count").textContent = `${traced} message${traced === 1 ? "" : "s"}`;
    };
  }).catch((e) => { $("tr-error").textContent = String(e.message || e); });
}
async function tracer() { /* the form starts a trace; leaving the page stops it (route) */ }

// ---- access: users and ACL rules managed live -------------------------------------------------
async function changeSecurity(body) {
  try {
    await api("/console/api/security", { method: "POST", body });
    $("ac-error").textContent = "";
  } catch (e) { $("ac-error").textContent = e.message; }
  await loadAccess();
}
async function loadAccess() {
  const d = await api("/console/api/security");
  const admin = me && me.role === "admin";
  $("ac-version").textContent = `version ${d.version}`;
  $("ac-note").textContent = d.enabled ? "Kept in the store; gateways started with --live-security apply a change at once."
    : "This gateway runs without --live-security: what is kept here applies to gateways that have it.";
  for (const f of document.querySelectorAll(".admin-only")) f.hidden = !admin;
  $("ac-users").tBodies[0].replaceChildren(...d.users.map((u) => el("tr", { "data-user": u.user },
    el("td", { class: "user", text: u.user }), el("td", { text: u.updated_ms ? new Date(u.updated_ms).toISOString() : "-" }),
    el("td", {}, admin ? el("button", { class: "remove", onclick: () => changeSecurity({ op: "user_remove", user: u.user }) }, "Remove") : ""))));
  $("ac-rules").tBodies[0].replaceChildren(...d.rules.map((r, i) => el("tr", { "data-rule": r },
    el("td", { class: "num", text: i + 1 }), el("td", { class: "rule", text: r }),
    el("td", {}, admin ? el("button", { class: "remove", onclick: () => changeSecurity({ op: "rule_remove", index: i + 1 }) }, "Remove") : ""))));
  $("ac-default").textContent = d.default || "none (the ACL file, else allow)";
  $("ac-default-select").value = d.default || "";
}
async function access() { await loadAccess(); }

// ---- routing ------------------------------------------------------------------------------
const pages = { overview, clients, sessions, groups, topics, tracer, access };

async function route() {
  stopLive(); stopTrace();
  const name = (location.hash || "#overview").slice(1);
  const page = pages[name] ? name : "overview";
  for (const p of document.querySelectorAll(".page")) p.hidden = p.id !== `page-${page}`;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.page === page);
  try { await pages[page](); document.body.dataset.ready = page; } catch (e) { /* 401: the login form shows */ }
}

async function start() {
  $("login-form").addEventListener("submit", login);
  $("tr-form").addEventListener("submit", startTrace);
  $("rt-form").addEventListener("submit", loadRetained);
  $("tr-stop").addEventListener("click", stopTrace);
  $("ac-user-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    changeSecurity({ op: "user_set", user: $("ac-user").value, password: $("ac-password").value });
    $("ac-password").value = "";
  });
  $("ac-rule-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    changeSecurity({ op: "rule_add", rule: $("ac-rule").value, position: $("ac-position").value || null });
  });
  $("ac-default-select").addEventListener("change", () => changeSecurity({ op: "default", value: $("ac-default-select").value || null }));
  let t = null;
  $("cl-search").addEventListener("input", () => { clearTimeout(t); t = setTimeout(() => loadClients().catch(() => {}), 200); });
  window.addEventListener("hashchange", route);
  try { me = await api("/console/api/me"); } catch (e) { return; }
  showWho();
  route();
}

start();
