// The rota board: plain script, no build step, nothing from other sites.
//
// It reads the REST API of the replica that served it, as the signed-in
// user (a session cookie; changes carry the session's CSRF token), draws
// the GPUs on one canvas (one listener, however many GPUs), and follows
// the event stream: each event is applied or the part it touches is
// fetched again (coalesced), never the whole board.
"use strict";

(function () {
  const MAX_EVENTS_KEPT = 2000; // events remembered for job pages
  const MAX_EVENTS_SHOWN = 200; // rows in the events list
  const MAX_LATENCIES = 500; // latency samples kept for readers
  const NODE_PAGE = 10000; // nodes per request (the API's largest page)
  const JOB_PAGE = 500; // jobs per request (the API's largest page)
  const MAX_JOB_PAGES = 200; // 100,000 active jobs at most
  const NODES_REFETCH_MS = 300; // node events are coalesced this long
  const TABLES_REFETCH_MS = 500; // quota/queue events likewise (and job starts and ends: quota use)
  const IDLE_REFETCH_MS = 1000; // idle jobs, after job events
  const MAX_IDLE_SHOWN = 200; // rows in the idle list
  const LOG_TAIL_BYTES = 64 * 1024; // the log shown is its last 64 KiB
  const RECONNECT_MS = 2000; // after the stream closes
  const GAP = 1; // between GPU cells, CSS pixels
  // GPU cell size, CSS pixels: larger while few GPUs are shown.
  const cellSize = (gpus) => (gpus <= 1024 ? 14 : 8);
  let CELL = 8;
  const KINDS = [
    "job_submitted", "job_placed", "job_started", "job_stopping", "job_preempted", "job_requeued",
    "job_finished", "job_failed", "job_cancelled", "node_registered", "node_up", "node_down",
    "node_drained", "node_undrained", "node_fenced", "node_readmitted", "quota_changed", "queue_changed",
    "job_idle_flagged",
  ];
  // Job events that change a group's GPUs in use, so its quota figures.
  const QUOTA_KINDS = new Set([
    "job_placed", "job_preempted", "job_requeued", "job_finished", "job_failed", "job_cancelled",
  ]);
  const ENDED = new Set(["succeeded", "failed", "cancelled"]);

  const $ = (id) => document.getElementById(id);
  const board = {
    session: null,
    cluster: null,
    nodes: [], // as /v1/nodes gives them
    jobs: new Map(), // id -> job (active ones, and those fetched)
    events: [], // recent, oldest first
    lastIndex: 0,
    source: null,
    layout: null, // boxes for hit tests
    latency: [], // {job_id, kind, list_ms, grid_ms, since_commit_ms}
    firstRenderMs: null,
    loadStartedAt: 0,
    pendingJobFetch: new Map(), // id -> {kind, at, time_ms}
    timers: {},
    violations: [], // what the Content-Security-Policy refused (should stay empty)
  };
  // For people debugging in the console, and for the end-to-end test.
  window.rotaBoard = board;
  document.addEventListener("securitypolicyviolation", (e) => {
    if (board.violations.length < 100) board.violations.push(`${e.violatedDirective}: ${e.blockedURI}`);
  });

  // ------------------------------------------------------------------ API

  class Unauthenticated extends Error {}

  async function api(path, options) {
    const init = Object.assign({ credentials: "same-origin", headers: {} }, options || {});
    const method = (init.method || "GET").toUpperCase();
    if (method !== "GET" && method !== "HEAD" && board.session) {
      init.headers["X-CSRF-Token"] = board.session.csrf_token;
    }
    const response = await fetch(path, init);
    if (response.status === 401) {
      let detail = "";
      try { detail = (await response.json()).detail || ""; } catch (_) { /* not a problem body */ }
      throw new Unauthenticated(detail);
    }
    return response;
  }

  async function json(path, options) {
    const response = await api(path, options);
    const body = await response.json();
    if (!response.ok) {
      throw new Error(`${path}: ${response.status} ${body.detail || ""}`);
    }
    return body;
  }

  // -------------------------------------------------------------- session

  async function start() {
    window.addEventListener("hashchange", route);
    $("sign-in-form").addEventListener("submit", (e) => { e.preventDefault(); signIn($("token").value); });
    $("sign-in-cert").addEventListener("click", () => signIn(""));
    $("sign-out").addEventListener("click", signOut);
    $("log-refresh").addEventListener("click", () => loadLog(currentJobId()));
    $("log-rank").addEventListener("change", () => loadLog(currentJobId()));
    $("log-stream").addEventListener("change", () => loadLog(currentJobId()));
    setUpGrid();
    try {
      board.session = await json("/ui/session");
      await enter();
    } catch (error) {
      showSignIn(error instanceof Unauthenticated ? "" : String(error));
    }
  }

  async function signIn(token) {
    $("sign-in-error").textContent = "";
    const body = new URLSearchParams();
    if (token) body.set("token", token.trim());
    try {
      const response = await fetch("/ui/session", { method: "POST", credentials: "same-origin", body });
      const answer = await response.json();
      if (!response.ok) {
        $("sign-in-error").textContent = answer.detail || `sign-in failed (${response.status})`;
        return;
      }
      board.session = answer;
      $("token").value = "";
      await enter();
    } catch (error) {
      $("sign-in-error").textContent = String(error);
    }
  }

  async function signOut() {
    try { await api("/ui/session", { method: "DELETE" }); } catch (_) { /* signed out either way */ }
    leave("Signed out.");
  }

  function leave(why) {
    if (board.source) board.source.close();
    board.source = null;
    board.session = null;
    showSignIn(why);
  }

  function showSignIn(why) {
    $("sign-in").hidden = false;
    $("board").hidden = true;
    $("job-page").hidden = true;
    $("sign-out").hidden = true;
    $("who").textContent = "";
    $("sign-in-why").textContent = why || "";
  }

  async function enter() {
    const s = board.session;
    $("sign-in").hidden = true;
    $("sign-out").hidden = false;
    $("who").textContent = `${s.user || "(insecure)"}${s.role ? " · " + s.role : ""} · replica ${s.replica_id}`;
    board.loadStartedAt = performance.now();
    try {
      await loadAll();
    } catch (error) {
      if (error instanceof Unauthenticated) return leave(error.message);
      throw error;
    }
    openEvents(board.lastIndex);
    route();
  }

  // ----------------------------------------------------------- snapshots

  async function loadAll() {
    // The index first: what is fetched after is at least this new, and
    // the stream resumes after it (events replayed twice apply twice, harmlessly).
    board.cluster = await json("/v1/cluster");
    board.lastIndex = board.cluster.applied_index;
    showCluster();
    const [nodes, jobs] = await Promise.all([fetchNodes(), fetchActiveJobs()]);
    board.nodes = nodes;
    board.jobs = new Map(jobs.map((j) => [j.id, j]));
    drawGrid();
    if (board.firstRenderMs === null) board.firstRenderMs = performance.now() - board.loadStartedAt;
    renderQueues();
    await Promise.all([loadTables(), loadIdle()]);
    loadReport();
  }

  // The month (UTC) a report covers: this one.
  function reportMonth() {
    return new Date().toISOString().slice(0, 7);
  }

  // The chart is an image this replica draws (`/v1/report?format=svg`):
  // same origin, so the policy allows it, and an SVG shown as an image
  // runs no script and loads nothing. A browser shows an image URL it has
  // loaded once as it was, so the chart is the month's as of sign-in (or
  // the last full reload of the board).
  function loadReport() {
    const month = reportMonth();
    const img = $("report-chart");
    $("report-month").textContent = month;
    img.onload = () => { $("report-error").textContent = ""; img.hidden = false; board.reportLoaded = month; };
    img.onerror = () => { img.hidden = true; $("report-error").textContent = `the report of ${month} could not be drawn`; };
    img.src = `/v1/report?format=svg&month=${month}`;
  }

  // Jobs flagged idle, as `rota jobs --idle` lists them.
  async function loadIdle() {
    const answer = await json(`/v1/jobs?idle=true&limit=${JOB_PAGE}`);
    board.idle = answer.jobs;
    renderIdle();
  }

  function renderIdle() {
    const jobs = board.idle || [];
    const gpus = jobs.reduce((n, j) => n + j.spec.replicas * j.spec.gpus_per_replica, 0);
    $("idle-summary").textContent = jobs.length ? `${jobs.length} jobs, ${gpus} GPUs` : "";
    if (!jobs.length) {
      const none = document.createElement("p");
      none.className = "muted";
      none.textContent = "No job is flagged idle.";
      $("idle").replaceChildren(none);
      return;
    }
    const [t, body] = table(["job", "user", "group", "queue", "GPUs", "idle since", "idle for", "idle GPU-hours"], [4, 6, 7]);
    const now = Date.now();
    for (const job of jobs.slice(0, MAX_IDLE_SHOWN)) {
      const row = jobRow(body, job);
      cell(row, job.spec.queue);
      cell(row, String(job.spec.replicas * job.spec.gpus_per_replica), "num");
      cell(row, when(job.idle_since_ms));
      cell(row, job.idle_since_ms ? duration(now - job.idle_since_ms) : "", "num");
      cell(row, (job.idle_gpu_ms / 3600000).toFixed(2), "num");
    }
    $("idle").replaceChildren(t);
  }

  function duration(ms) {
    const minutes = Math.max(0, Math.floor(ms / 60000));
    return minutes < 120 ? `${minutes} min` : `${(minutes / 60).toFixed(1)} h`;
  }

  function showCluster() {
    const c = board.cluster;
    $("cluster-line").textContent = `cluster ${c.cluster_id.slice(0, 8)} · leader ${c.leader_id} · term ${c.term} · ${c.version}`;
  }

  async function fetchNodes() {
    const all = [];
    let cursor = "";
    for (let page = 0; page < 100; page++) {
      const answer = await json(`/v1/nodes?limit=${NODE_PAGE}${cursor ? "&cursor=" + encodeURIComponent(cursor) : ""}`);
      all.push(...answer.nodes);
      if (!answer.next_cursor) break;
      cursor = answer.next_cursor;
    }
    return all;
  }

  async function fetchJobs(state) {
    const all = [];
    let cursor = "";
    for (let page = 0; page < MAX_JOB_PAGES; page++) {
      const answer = await json(`/v1/jobs?state=${state}&limit=${JOB_PAGE}${cursor ? "&cursor=" + cursor : ""}`);
      all.push(...answer.jobs);
      if (!answer.next_cursor) break;
      cursor = answer.next_cursor;
    }
    return all;
  }

  async function fetchActiveJobs() {
    const lists = await Promise.all(["pending", "running", "stopping"].map(fetchJobs));
    return lists.flat();
  }

  async function loadTables() {
    const [queues, quotas] = await Promise.all([json("/v1/queues"), json("/v1/quotas")]);
    board.queues = queues.queues;
    board.quotas = quotas.quotas;
    renderQueues();
    renderQuotas();
  }

  // ---------------------------------------------------------------- events

  function openEvents(since) {
    if (board.source) board.source.close();
    // The browser sends Last-Event-ID itself when it reconnects; the
    // server takes it over `since`.
    const source = new EventSource(`/v1/events?since=${since}`, { withCredentials: true });
    board.source = source;
    $("events-state").textContent = "connecting";
    source.onopen = () => { $("events-state").textContent = "live"; };
    for (const kind of KINDS) {
      source.addEventListener(kind, (message) => onEvent(JSON.parse(message.data), message.lastEventId));
    }
    // Entries passed with none of our events: resume after them.
    source.addEventListener("progress", (message) => {
      board.lastIndex = Math.max(board.lastIndex, Number(message.lastEventId) || 0);
    });
    source.addEventListener("compacted", () => {
      // The events since our index are gone: take a new snapshot.
      source.close();
      resync();
    });
    source.addEventListener("error", (message) => {
      if (message.data) {
        // The server cut the stream (a reader too slow): resume from the last index.
        source.close();
        setTimeout(() => openEvents(board.lastIndex), RECONNECT_MS);
        return;
      }
      if (source.readyState === EventSource.CLOSED) {
        $("events-state").textContent = "closed";
        setTimeout(checkSessionThenReopen, RECONNECT_MS);
      } else {
        $("events-state").textContent = "reconnecting";
      }
    });
  }

  async function checkSessionThenReopen() {
    if (!board.session) return;
    try {
      board.session = await json("/ui/session");
      openEvents(board.lastIndex);
    } catch (error) {
      if (error instanceof Unauthenticated) {
        leave("Your session is not valid on this replica (it may have restarted, or the session expired): sign in again.");
      } else {
        setTimeout(checkSessionThenReopen, RECONNECT_MS);
      }
    }
  }

  async function resync() {
    try {
      await loadAll();
      openEvents(board.lastIndex);
    } catch (error) {
      if (error instanceof Unauthenticated) leave(error.message);
      else setTimeout(resync, RECONNECT_MS);
    }
  }

  function onEvent(event, lastEventId) {
    const at = performance.now();
    if (lastEventId) board.lastIndex = Math.max(board.lastIndex, Number(lastEventId) || 0);
    board.events.push(event);
    if (board.events.length > MAX_EVENTS_KEPT) board.events.splice(0, board.events.length - MAX_EVENTS_KEPT);
    scheduleEventsList(event, at);
    if (event.topic === "jobs" && event.job_id) {
      applyJobEvent(event, at);
      if (QUOTA_KINDS.has(event.kind)) later("tables", TABLES_REFETCH_MS, () => loadTables().catch(reportError));
      if (event.kind === "job_idle_flagged" || ENDED.has(event.state) || (board.idle || []).some((j) => j.id === event.job_id)) {
        later("idle", IDLE_REFETCH_MS, () => loadIdle().catch(reportError));
      }
    } else if (event.topic === "nodes") {
      later("nodes", NODES_REFETCH_MS, refetchNodes);
    } else if (event.topic === "quotas" || event.topic === "queues") {
      later("tables", TABLES_REFETCH_MS, () => loadTables().catch(reportError));
    }
  }

  function later(name, delayMs, work) {
    if (board.timers[name]) return;
    board.timers[name] = setTimeout(() => { board.timers[name] = null; work(); }, delayMs);
  }

  async function refetchNodes() {
    try {
      board.nodes = await fetchNodes();
      requestDraw();
    } catch (error) {
      reportError(error);
    }
  }

  // A job event: its state is known at once (the list and queues follow);
  // its GPUs come with the job, fetched once however many of its events
  // arrive before the fetch returns.
  function applyJobEvent(event, at) {
    const known = board.jobs.get(event.job_id);
    if (known) {
      known.state = event.state || known.state;
      if (event.reason) known.reason = event.reason;
    }
    if (ENDED.has(event.state) || event.state === "pending") {
      // Its GPUs are free again (or will be: the node list says when).
      releaseGpus(event.job_id);
    }
    const waiting = board.pendingJobFetch.get(event.job_id);
    if (waiting) {
      // A fetch is out: it may predate this event, so fetch once more after it.
      waiting.kinds.push(event.kind);
      Object.assign(waiting, { at, time_ms: event.time_ms, stale: true });
      return;
    }
    board.pendingJobFetch.set(event.job_id, { kinds: [event.kind], at, time_ms: event.time_ms, stale: false });
    fetchJob(event.job_id);
  }

  async function fetchJob(id) {
    let job = null;
    try {
      job = await json(`/v1/jobs/${id}`);
    } catch (error) {
      reportError(error);
    }
    const waiting = board.pendingJobFetch.get(id);
    if (waiting && waiting.stale && job) {
      waiting.stale = false;
      fetchJob(id);
      return;
    }
    board.pendingJobFetch.delete(id);
    if (job) {
      board.jobs.set(id, job);
      if (job.state === "running" || job.state === "stopping") claimGpus(job);
      else releaseGpus(id);
      requestDraw((drawnAt) => {
        if (waiting) {
          // From the arrival of the last event this fetch answers.
          recordLatency(id, waiting.kinds, { grid_ms: drawnAt - waiting.at, grid_since_commit_ms: Date.now() - waiting.time_ms });
        }
      });
    }
    later("queues", 50, renderQueues);
    if (currentJobId() === id && job) showJob(job);
  }

  function claimGpus(job) {
    const byNode = new Map();
    for (const a of job.allocations || []) byNode.set(a.node, new Set(a.gpus));
    for (const node of board.nodes) {
      const mine = byNode.get(node.name);
      if (!mine) continue;
      for (const gpu of node.gpus) if (mine.has(gpu.index)) gpu.job_id = job.id;
    }
  }

  function releaseGpus(id) {
    let changed = false;
    for (const node of board.nodes) {
      for (const gpu of node.gpus) {
        if (gpu.job_id === id) { gpu.job_id = 0; changed = true; }
      }
    }
    if (changed) requestDraw();
  }

  // Grid changes are drawn once per frame, however many came.
  let drawCallbacks = null;
  function requestDraw(then) {
    if (drawCallbacks) {
      if (then) drawCallbacks.push(then);
      return;
    }
    drawCallbacks = then ? [then] : [];
    requestAnimationFrame(() => {
      const callbacks = drawCallbacks;
      drawCallbacks = null;
      drawGrid();
      const drawnAt = performance.now();
      for (const callback of callbacks) callback(drawnAt);
    });
  }

  function recordLatency(jobId, kinds, figures) {
    let sample = board.latency.find((s) => s.job_id === jobId && s.kinds.join() === kinds.join());
    if (!sample) {
      sample = { job_id: jobId, kinds: kinds.slice() };
      board.latency.push(sample);
      if (board.latency.length > MAX_LATENCIES) board.latency.shift();
    }
    Object.assign(sample, figures);
  }

  // The events list is redrawn once per frame, however many events came.
  let listQueue = [];
  function scheduleEventsList(event, at) {
    listQueue.push({ event, at });
    if (listQueue.length > 1) return;
    requestAnimationFrame(() => {
      const batch = listQueue;
      listQueue = [];
      const list = $("events");
      const rows = document.createDocumentFragment();
      for (let i = batch.length - 1; i >= 0; i--) rows.appendChild(eventRow(batch[i].event, true));
      for (const old of list.querySelectorAll("li.fresh")) old.classList.remove("fresh");
      list.insertBefore(rows, list.firstChild);
      while (list.childElementCount > MAX_EVENTS_SHOWN) list.lastChild.remove();
      const shownAt = performance.now();
      for (const { event, at } of batch) {
        if (event.job_id) {
          recordLatency(event.job_id, [event.kind], { list_ms: shownAt - at, list_since_commit_ms: Date.now() - event.time_ms });
        }
      }
    });
  }

  function eventRow(event, fresh) {
    const li = document.createElement("li");
    if (fresh) li.className = "fresh";
    li.dataset.kind = event.kind;
    li.dataset.job = event.job_id || "";
    const time = new Date(event.time_ms).toLocaleTimeString();
    const what = event.job_id ? `job ${event.job_id}` : event.node || event.group || event.queue;
    li.textContent = `${time} #${event.index} ${event.kind} ${what}${event.reason ? " — " + event.reason : ""}`;
    if (event.job_id) li.addEventListener("click", () => { location.hash = `#job/${event.job_id}`; });
    return li;
  }

  function reportError(error) {
    if (error instanceof Unauthenticated) leave(error.message);
    else console.warn("rota board:", error);
  }

  // ------------------------------------------------------------------ grid

  // A stable colour per group name.
  function groupColour(group) {
    let hash = 0;
    for (const ch of group) hash = (hash * 31 + ch.codePointAt(0)) >>> 0;
    return `hsl(${hash % 360}, 62%, ${42 + (hash >> 9) % 16}%)`;
  }

  const COLOURS = {
    free: "#e3e9ee",
    drained: "#b9c0c7",
    down: "#2b3137",
    fenced: "#d93f3f",
    hidden: "#8f98a1",
  };

  // What a GPU cell shows: [colour, label for the legend and tooltip].
  function cellLook(node, gpu) {
    if (node.state === "down") return [COLOURS.down, "node down"];
    if (gpu.fence || !gpu.healthy) return [COLOURS.fenced, "fenced / unhealthy"];
    if (gpu.job_id) {
      const job = board.jobs.get(gpu.job_id);
      if (job && job.spec && job.spec.group) return [groupColour(job.spec.group), job.spec.group];
      return [COLOURS.hidden, "busy (job not listed)"];
    }
    if (node.state === "draining") return [COLOURS.drained, "free, node draining"];
    return [COLOURS.free, "free"];
  }

  function setUpGrid() {
    const canvas = $("grid");
    canvas.addEventListener("mousemove", (e) => showTip(hit(e)));
    canvas.addEventListener("mouseleave", () => { $("tip").hidden = true; });
    canvas.addEventListener("click", (e) => {
      const found = hit(e);
      if (found && found.gpu && found.gpu.job_id) location.hash = `#job/${found.gpu.job_id}`;
    });
    window.addEventListener("resize", () => later("resize", 100, () => requestDraw()));
  }

  // One pass: lay out racks -> leaves -> nodes -> GPUs, paint each cell.
  function drawGrid() {
    const canvas = $("grid");
    const width = Math.max(320, canvas.parentElement.clientWidth || 1000);
    CELL = cellSize(board.nodes.reduce((n, node) => n + node.gpus.length, 0));
    const nodes = board.nodes.slice().sort((a, b) =>
      a.rack.localeCompare(b.rack) || a.leaf.localeCompare(b.leaf) || a.name.localeCompare(b.name));
    // Layout first (heights), then paint.
    const boxes = [];
    const labels = [];
    let x = 0;
    let y = 0;
    let rack = null;
    let leaf = null;
    const lineHeight = CELL + 4;
    for (const node of nodes) {
      const nodeWidth = Math.max(1, node.gpus.length) * (CELL + GAP) + 4;
      if (node.rack !== rack) {
        if (rack !== null) y += lineHeight + 6;
        labels.push({ x: 0, y: y + 10, text: node.rack ? `rack ${node.rack}` : "(no rack)", bold: true });
        y += 14;
        x = 0;
        rack = node.rack;
        leaf = null;
      }
      if (node.leaf !== leaf) {
        if (leaf !== null) { y += lineHeight + 2; }
        labels.push({ x: 0, y: y + CELL, text: node.leaf || "(no leaf)", bold: false });
        x = 64;
        leaf = node.leaf;
      }
      if (x + nodeWidth > width) { x = 64; y += lineHeight; }
      boxes.push({ x, y, w: nodeWidth, h: CELL, node });
      x += nodeWidth + 3;
    }
    const height = y + lineHeight + 4;
    const ratio = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    canvas.style.height = `${height}px`;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = "#68737d";
    for (const label of labels) {
      ctx.font = label.bold ? "bold 11px system-ui, sans-serif" : "11px system-ui, sans-serif";
      ctx.fillText(label.text, label.x, label.y);
    }
    const legend = new Map();
    let gpus = 0;
    let busy = 0;
    for (const box of boxes) {
      const node = box.node;
      box.node.gpus.forEach((gpu, i) => {
        const [colour, label] = cellLook(node, gpu);
        legend.set(label, colour);
        gpus += 1;
        if (gpu.job_id) busy += 1;
        ctx.fillStyle = colour;
        const cx = box.x + 2 + i * (CELL + GAP);
        ctx.fillRect(cx, box.y, CELL, CELL);
        // Utilization, where the API reports it: darker = busier.
        if (typeof gpu.utilization_percent === "number") {
          ctx.fillStyle = `rgba(0,0,0,${(gpu.utilization_percent / 100) * 0.45})`;
          ctx.fillRect(cx, box.y + CELL / 2, CELL, CELL / 2);
        }
      });
      if (node.state === "draining") {
        ctx.strokeStyle = "#e08a00";
        ctx.setLineDash([2, 2]);
        ctx.strokeRect(box.x + 0.5, box.y - 1.5, box.w - 1, box.h + 3);
        ctx.setLineDash([]);
        legend.set("node draining (outline)", "#e08a00");
      }
    }
    board.layout = boxes;
    board.drawn = { nodes: nodes.length, gpus, busy, at: performance.now() };
    $("grid-summary").textContent = `${nodes.length} nodes · ${gpus} GPUs · ${busy} busy`;
    renderLegend(legend);
  }

  function renderLegend(legend) {
    const order = ["free", "free, node draining", "node draining (outline)", "fenced / unhealthy", "node down", "busy (job not listed)"];
    const entries = [...legend.entries()].sort((a, b) => {
      const ia = order.indexOf(a[0]);
      const ib = order.indexOf(b[0]);
      return (ia < 0 ? 99 : ia) - (ib < 0 ? 99 : ib) || a[0].localeCompare(b[0]);
    });
    const fragment = document.createDocumentFragment();
    for (const [label, colour] of entries) {
      const item = document.createElement("span");
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = colour;
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(order.includes(label) ? label : `group ${label}`));
      fragment.appendChild(item);
    }
    const note = document.createElement("span");
    note.className = "muted";
    note.textContent = "utilization: shaded where reported";
    fragment.appendChild(note);
    $("legend").replaceChildren(fragment);
  }

  function hit(e) {
    if (!board.layout) return null;
    const rect = $("grid").getBoundingClientRect();
    const x = e.clientX - rect.left;
    const y = e.clientY - rect.top;
    for (const box of board.layout) {
      if (y >= box.y && y < box.y + box.h && x >= box.x && x < box.x + box.w) {
        const i = Math.floor((x - box.x - 2) / (CELL + GAP));
        return { node: box.node, gpu: box.node.gpus[i] || null, x, y };
      }
    }
    return null;
  }

  function showTip(found) {
    const tip = $("tip");
    if (!found) { tip.hidden = true; return; }
    const { node, gpu } = found;
    const lines = [`${node.name} (${node.rack}/${node.leaf}) ${node.state}`];
    if (gpu) {
      lines.push(`GPU ${gpu.index} ${gpu.model}${gpu.fence ? " fenced: " + gpu.fence : ""}${gpu.healthy ? "" : " unhealthy"}`);
      if (gpu.job_id) {
        const job = board.jobs.get(gpu.job_id);
        lines.push(`job ${gpu.job_id}${job ? ` ${job.owner} ${job.spec.group}/${job.spec.queue}` : ""} (click)`);
      } else {
        lines.push("free");
      }
    }
    tip.textContent = lines.join("\n");
    tip.style.left = `${found.x + 12}px`;
    tip.style.top = `${found.y + 12}px`;
    tip.hidden = false;
  }

  // ---------------------------------------------------------------- tables

  // A table row for a job: its id linking to its page, its owner and group.
  function jobRow(body, job) {
    const row = body.insertRow();
    row.dataset.job = job.id;
    const link = document.createElement("a");
    link.href = `#job/${job.id}`;
    link.textContent = job.id;
    row.insertCell().appendChild(link);
    cell(row, job.owner);
    cell(row, job.spec.group);
    return row;
  }

  function cell(row, text, className) {
    const td = document.createElement("td");
    td.textContent = text;
    if (className) td.className = className;
    row.appendChild(td);
    return td;
  }

  function table(headers, numeric) {
    const t = document.createElement("table");
    const head = t.createTHead().insertRow();
    headers.forEach((h, i) => {
      const th = document.createElement("th");
      th.textContent = h;
      if (numeric && numeric.includes(i)) th.className = "num";
      head.appendChild(th);
    });
    return [t, t.createTBody()];
  }

  function when(ms) {
    if (!ms) return "";
    const d = new Date(ms);
    return d.toLocaleString();
  }

  function renderQueues() {
    const pending = [...board.jobs.values()].filter((j) => j.state === "pending");
    const byQueue = new Map();
    for (const q of board.queues || []) byQueue.set(q.name, []);
    for (const job of pending) {
      const queue = job.spec.queue;
      if (!byQueue.has(queue)) byQueue.set(queue, []);
      byQueue.get(queue).push(job);
    }
    const fragment = document.createDocumentFragment();
    for (const [queue, jobs] of byQueue) {
      const h = document.createElement("h3");
      const info = (board.queues || []).find((q) => q.name === queue);
      h.textContent = `${queue} — ${jobs.length} pending${info ? ` · weight ${info.weight}` : ""}`;
      fragment.appendChild(h);
      if (!jobs.length) continue;
      jobs.sort((a, b) => a.id - b.id);
      const [t, body] = table(["job", "user", "group", "GPUs", "reason", "estimated start"], [3]);
      for (const job of jobs.slice(0, 200)) {
        const row = jobRow(body, job);
        cell(row, String(job.spec.replicas * job.spec.gpus_per_replica), "num");
        cell(row, job.reason || job.reason_code || "");
        cell(row, job.estimated_start_ms ? when(job.estimated_start_ms) : "unknown");
      }
      fragment.appendChild(t);
      if (jobs.length > 200) {
        const more = document.createElement("p");
        more.className = "muted";
        more.textContent = `and ${jobs.length - 200} more`;
        fragment.appendChild(more);
      }
    }
    $("queues").replaceChildren(fragment);
  }

  function renderQuotas() {
    // Lent: the group's guaranteed GPUs other groups hold now. Limit: the
    // most it may hold (its guarantee plus its borrow limit; none: no cap).
    const [t, body] = table(["group", "used", "borrowed", "lent", "guarantee", "limit"], [1, 2, 3, 4, 5]);
    for (const q of board.quotas || []) {
      const row = body.insertRow();
      row.dataset.group = q.group;
      cell(row, q.group);
      cell(row, String(q.used), "num");
      cell(row, String(q.borrowed), "num");
      cell(row, String(q.lent), "num");
      cell(row, String(q.gpus), "num");
      cell(row, q.borrow_limit === undefined || q.borrow_limit === null ? "none" : String(q.gpus + q.borrow_limit), "num");
    }
    if (!(board.quotas || []).length) {
      const none = document.createElement("p");
      none.className = "muted";
      none.textContent = "No quotas set.";
      $("quotas").replaceChildren(none);
      return;
    }
    $("quotas").replaceChildren(t);
  }

  // ------------------------------------------------------------- job page

  function currentJobId() {
    const m = /^#job\/(\d+)$/.exec(location.hash);
    return m ? Number(m[1]) : null;
  }

  async function route() {
    if (!board.session) return;
    const id = currentJobId();
    $("board").hidden = id !== null;
    $("job-page").hidden = id === null;
    if (id === null) { drawGrid(); return; }
    try {
      const job = await json(`/v1/jobs/${id}`);
      showJob(job);
      loadLog(id);
    } catch (error) {
      if (error instanceof Unauthenticated) return leave(error.message);
      $("job-id").textContent = id;
      $("job-facts").replaceChildren(document.createTextNode(String(error)));
    }
  }

  function showJob(job) {
    $("job-id").textContent = job.id;
    $("job-state").textContent = job.state;
    const facts = [
      ["name", job.spec.name],
      ["owner", job.owner],
      ["group / queue", `${job.spec.group} / ${job.spec.queue}`],
      ["shape", `${job.spec.replicas} × ${job.spec.gpus_per_replica} GPUs`],
      ["reason", [job.reason, job.reason_code, job.reason_detail].filter(Boolean).join(" · ")],
      ["estimated start", job.estimated_start_ms ? when(job.estimated_start_ms) : ""],
      ["attempts", String(job.attempts)],
      ["master", job.master_addr ? `${job.master_addr}:${job.master_port}` : ""],
      ["command", (job.spec.command || []).join(" ")],
      ["env", Object.entries(job.spec.env || {}).map(([k, v]) => `${k}=${v}`).join(" ")],
      ["exit code", job.exit_code === null || job.exit_code === undefined ? "" : String(job.exit_code)],
    ];
    const dl = document.createDocumentFragment();
    for (const [name, value] of facts) {
      const dt = document.createElement("dt");
      dt.textContent = name;
      const dd = document.createElement("dd");
      dd.textContent = value || "—";
      dd.id = `job-${name.replace(/[^a-z]+/g, "-")}`;
      dl.appendChild(dt);
      dl.appendChild(dd);
    }
    $("job-facts").replaceChildren(dl);
    const body = $("job-ranks").tBodies[0];
    const rows = document.createDocumentFragment();
    const ranks = document.createDocumentFragment();
    for (const a of job.allocations || []) {
      const row = document.createElement("tr");
      cell(row, String(a.rank));
      cell(row, a.node);
      cell(row, a.gpus.join(","));
      cell(row, a.state);
      cell(row, a.exit_code === null || a.exit_code === undefined ? "" : String(a.exit_code));
      rows.appendChild(row);
      const option = document.createElement("option");
      option.value = a.rank;
      option.textContent = `rank ${a.rank}`;
      ranks.appendChild(option);
    }
    body.replaceChildren(rows);
    const select = $("log-rank");
    const chosen = select.value;
    if (!ranks.childElementCount) {
      const option = document.createElement("option");
      option.value = "0";
      option.textContent = "rank 0";
      ranks.appendChild(option);
    }
    select.replaceChildren(ranks);
    if (chosen) select.value = chosen;
    const history = document.createDocumentFragment();
    const add = (ms, text) => {
      const li = document.createElement("li");
      li.textContent = `${when(ms)} ${text}`;
      history.appendChild(li);
    };
    if (job.submitted_at_ms) add(job.submitted_at_ms, "submitted");
    if (job.started_at_ms) add(job.started_at_ms, "started");
    for (const e of board.events) {
      if (e.job_id === job.id) add(e.time_ms, `#${e.index} ${e.kind}${e.state ? " → " + e.state : ""}${e.reason ? " — " + e.reason : ""}`);
    }
    if (job.finished_at_ms) add(job.finished_at_ms, `ended ${job.state}`);
    $("job-history").replaceChildren(history);
  }

  // The log's last LOG_TAIL_BYTES, read as it streams.
  let logReader = null;
  async function loadLog(id) {
    if (id === null) return;
    if (logReader) { try { logReader.cancel(); } catch (_) { /* already done */ } }
    const rank = $("log-rank").value || "0";
    const stream = $("log-stream").value;
    const out = $("job-log");
    out.textContent = "loading…";
    try {
      const response = await api(`/v1/jobs/${id}/logs?rank=${rank}&stream=${stream}`);
      if (!response.ok) {
        const problem = await response.json();
        out.textContent = `(${problem.detail || response.status})`;
        return;
      }
      const reader = response.body.getReader();
      logReader = reader;
      const decoder = new TextDecoder();
      let tail = "";
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        tail += decoder.decode(value, { stream: true });
        if (tail.length > LOG_TAIL_BYTES) tail = tail.slice(tail.length - LOG_TAIL_BYTES);
      }
      out.textContent = tail || "(empty)";
    } catch (error) {
      if (error instanceof Unauthenticated) return leave(error.message);
      out.textContent = `(${error})`;
    }
  }

  board.drawGrid = drawGrid;
  document.addEventListener("DOMContentLoaded", () => { start().catch(reportError); });
})();
