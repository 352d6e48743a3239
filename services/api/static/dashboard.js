// KPO-RL dashboard: lists runs, draws a run's stability charts from its metrics history and keeps
// them live from the run's server-sent events. Ticking two or more runs in the list overlays them
// on every chart, one colour per run (`?compare=ID,ID` in the address keeps the selection).
// Where the run's stability guard acted (its `guard.action` events, an alert's included) every
// chart has a vertical marker at the action's step, and a paused run says so until it resumes.
//
// Everything inserted into the page goes through textContent or attributes (never innerHTML), so
// run names and error messages are shown as text. The SSE stream is read with fetch and a stream
// reader, not EventSource, because EventSource cannot send the Authorization header.
"use strict";

(() => {
  const TOKEN_KEY = "kpo.apiToken";
  const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
  const HISTORY_PAGE = 10000; // the API's largest page of metrics records
  const RUNS_REFRESH_MS = 10000;
  const RETRY_MIN_MS = 1000;
  const RETRY_MAX_MS = 15000;
  const RUN_ID = /^run-[0-9a-f]{12}$/; // the store's run ids (services/store/base.py)
  // Each live run compared holds one event stream open, and a browser opens at most 6 HTTP/1.1
  // connections to a server: 4 streams leave room for the history and run-list requests.
  const MAX_COMPARE = 4;
  // One colour per compared run, in the order ticked; distinct for the common colour deficiencies.
  const RUN_COLORS = ["#1f6feb", "#e8590c", "#2b8a3e", "#ae3ec9"];

  // How the guard's actions (services/pipeline/pause.py, `guard.action`) are marked on the
  // charts: a dashed vertical line in the action's colour, topped by its shape (`glyph` is the
  // same shape in the legend).
  const MARK_STYLES = {
    rollback: { color: "#d32f2f", shape: "back", glyph: "\u25C0" },
    pause: { color: "#7b1fa2", shape: "pause", glyph: "\u2016" },
    cancel: { color: "#37474f", shape: "cross", glyph: "\u2715" },
    stop_unstable: { color: "#37474f", shape: "cross", glyph: "\u2715" },
    warn: { color: "#e08600", shape: "warn", glyph: "\u25B2" },
    checkpoint: { color: "#0277bd", shape: "diamond", glyph: "\u25C6" },
  };
  const OTHER_MARK = { color: "#6b7385", shape: "dot", glyph: "\u25CF" };
  // The events that tell of the guard (handleEvent); the others are metrics and status. An
  // alert's checkpoint or pause comes as the guard's action; its warn or cancel only as `alert`.
  const GUARD_EVENTS = new Set([
    "guard.action", "guard.paused", "guard.resumed", "guard.resume_refused", "resume", "alert",
  ]);
  const ALERT_MARKS = new Set(["warn", "cancel"]);

  // The estimators `algorithm.shadow` may list (services/metrics.py, SHADOW_ESTIMATORS), each
  // with its colour on the shadow charts.
  const SHADOW_ESTIMATORS = {
    token: "#1f6feb", sequence: "#2b8a3e", geometric: "#ae3ec9", kalman: "#c62828", cumulative: "#e8590c",
  };

  /** A chart of one quantity for the training estimator (record key `trainingKey`, solid) and
   *  each shadow estimator (`shadow_<name>_<key>`): shown only when a run has shadows, each
   *  shadow estimator only where it has values. */
  function shadowChart(id, title, trainingKey, key) {
    return { id, title, shadow: true, series: [
      { key: trainingKey, label: "training", color: "#212529", width: 2.2, main: true, training: true },
      ...Object.entries(SHADOW_ESTIMATORS).map(([name, color]) => (
        { key: `shadow_${name}_${key}`, label: name, color, width: 1.4, shadow: true })),
    ] };
  }

  // One entry per chart: the record keys it draws. `smooth` draws a trailing moving average.
  // When runs are compared each series takes its run's colour: the `main` one is drawn solid (its
  // latest value is in the legend), a dashed one stays dashed, any other is drawn faint.
  const CHARTS = [
    { id: "reward", title: "Reward", series: [
      { key: "reward_mean", label: "reward mean", color: "#9fb3c8", width: 1 },
      { key: "reward_mean", label: "moving average", color: "#1f6feb", width: 2.2, smooth: true, main: true },
    ] },
    { id: "entropy", title: "Entropy (nats)", series: [
      { key: "entropy", label: "entropy", color: "#8e24aa", width: 1.6, main: true },
    ] },
    { id: "clip", title: "Clip fraction", series: [
      { key: "clip_fraction", label: "clip fraction", color: "#ef6c00", width: 1.6, main: true },
    ] },
    { id: "staleness", title: "Staleness (policy versions)", series: [
      { key: "staleness_mean", label: "mean", color: "#00897b", width: 1.8, main: true },
      { key: "staleness_max", label: "max", color: "#80cbc4", width: 1.2, dash: [4, 3] },
    ] },
    { id: "switch", title: "Ratio switch frequency", series: [
      { key: "raw_switch_frequency", label: "raw", color: "#b0bec5", width: 1.2 },
      { key: "filtered_switch_frequency", label: "filtered", color: "#c62828", width: 1.8, main: true },
    ] },
    { id: "lfr", title: "Low-frequency ratio", series: [
      { key: "raw_low_frequency_ratio", label: "raw", color: "#b0bec5", width: 1.2 },
      { key: "filtered_low_frequency_ratio", label: "filtered", color: "#3949ab", width: 1.8, main: true },
    ] },
    // Only runs with tools record these: the chart stays hidden until a shown run has them.
    { id: "tools", title: "Tool calls", optional: true, series: [
      { key: "tool_calls_per_response", label: "calls per response", color: "#2e7d32", width: 1.8, main: true },
      { key: "tool_error_fraction", label: "error fraction", color: "#c62828", width: 1.2 },
      { key: "observation_token_fraction", label: "observation tokens", color: "#6d4c41", width: 1.2, dash: [4, 3] },
    ] },
    // The shadow estimators beside the training one (runs with `algorithm.shadow`).
    shadowChart("shadow-loss", "Policy loss by estimator", "policy_loss", "policy_loss"),
    shadowChart("shadow-clip", "Clip fraction by estimator", "clip_fraction", "clip_fraction"),
    shadowChart("shadow-switch", "Ratio switch frequency by estimator", "filtered_switch_frequency", "switch_frequency"),
  ];

  const $ = (id) => document.getElementById(id);
  // What the page shows: one run ("single", from the address's #RUN_ID), several overlaid
  // ("compare", from ?compare=) or nothing. Each shown run is a trace: its record, metrics and
  // stream position. `abort` stops every request and stream of the current view.
  const view = { mode: "none", traces: [], abort: null };
  let compareIds = [];
  let runsShown = [];
  let drawPending = false;

  class Unauthorized extends Error {}

  // --- DOM helpers -------------------------------------------------------------------------

  /** An element with text (escaped by construction: textContent) and attributes. */
  function el(tag, { text, cls, attrs } = {}, children = []) {
    const node = document.createElement(tag);
    if (text !== undefined) node.textContent = String(text);
    if (cls) node.className = cls;
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
    for (const child of children) node.append(child);
    return node;
  }

  function swatch(color, cls = "swatch") {
    const node = el("i", { cls });
    if (color) node.style.background = color; // CSSOM, which the style-src policy allows
    return node;
  }

  function fmt(value) {
    if (value === null || value === undefined || !Number.isFinite(value)) return "–";
    const abs = Math.abs(value);
    if (abs !== 0 && (abs < 1e-3 || abs >= 1e5)) return value.toExponential(2);
    return String(Number(value.toPrecision(3)));
  }

  function when(iso) {
    return iso ? new Date(iso).toLocaleString() : "–";
  }

  // --- the API -----------------------------------------------------------------------------

  /** fetch with the stored token; a 401 asks for a token, any other error throws its message. */
  async function api(path, options = {}) {
    const headers = new Headers(options.headers || {});
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers.set("Authorization", `Bearer ${token}`);
    const response = await fetch(path, { ...options, headers });
    if (response.status === 401) {
      askForToken(token ? "The server refused this token." : "");
      throw new Unauthorized("unauthorized");
    }
    if (!response.ok) {
      let message = `${response.status} ${response.statusText}`;
      try {
        message = (await response.json()).error.message || message;
      } catch (_) { /* not a JSON error body */ }
      throw Object.assign(new Error(message), { status: response.status });
    }
    return response;
  }

  /** JSON.parse that also reads the NaN and Infinity Python's json module writes for floats. */
  function parseJson(text) {
    try {
      return JSON.parse(text);
    } catch (error) {
      return JSON.parse(text.replace(/([:,[]\s*)-?(?:NaN|Infinity)(?=\s*[,}\]])/g, "$1null"));
    }
  }

  async function getJson(path, options) {
    return parseJson(await (await api(path, options)).text());
  }

  const runPath = (id) => `/v1/runs/${encodeURIComponent(id)}`;

  // --- token -------------------------------------------------------------------------------

  function askForToken(message) {
    $("token-form").hidden = false;
    $("token-message").textContent = message;
    $("token-input").focus();
  }

  function setUpToken() {
    $("token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const token = $("token-input").value.trim();
      if (!token) return;
      sessionStorage.setItem(TOKEN_KEY, token);
      $("token-input").value = "";
      $("token-form").hidden = true;
      $("forget-token").hidden = false;
      reload();
    });
    $("forget-token").hidden = !sessionStorage.getItem(TOKEN_KEY);
    $("forget-token").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      $("forget-token").hidden = true;
    });
  }

  // --- the run list ------------------------------------------------------------------------

  // The list gives run summaries (name, estimator, mode at the top, no spec); one run's record
  // has its whole spec. These read either.
  function runTitle(run) {
    return run.name || (run.spec && run.spec.name) || run.id;
  }

  function estimatorOf(run) {
    if (run && run.estimator) return run.estimator;
    const spec = (run && run.spec) || {};
    return (spec.algorithm && spec.algorithm.estimator && spec.algorithm.estimator.name) || null;
  }

  function modeOf(run) {
    if (run && run.mode) return run.mode;
    const spec = (run && run.spec) || {};
    return (spec.pipeline && spec.pipeline.mode) || null;
  }

  async function loadRuns() {
    if (!$("token-form").hidden) return; // waiting for a token: asking again would only fail
    try {
      const page = await getJson("/v1/runs?limit=100");
      renderRuns(page.runs);
      $("runs-message").textContent = page.runs.length ? "" :
        "No runs yet. Submit one with `kpo submit RUN.yaml`.";
    } catch (error) {
      if (!(error instanceof Unauthorized)) $("runs-message").textContent = error.message;
    }
  }

  function renderRuns(runs) {
    runsShown = runs;
    // The list is rebuilt every few seconds: a keyboard user's focus on a checkbox stays put.
    const focused = document.activeElement && document.activeElement.dataset
      ? document.activeElement.dataset.compareId : undefined;
    const single = view.mode === "single" ? view.traces[0].id : null;
    const items = runs.map((run) => {
      const mode = modeOf(run);
      const link = el("a", { attrs: { href: `#${encodeURIComponent(run.id)}`, "data-run-id": run.id } }, [
        el("div", { cls: "run-line" }, [
          el("span", { cls: "run-title", text: runTitle(run) }),
          el("span", { cls: `badge ${run.status}`, text: run.status }),
        ]),
        el("div", { cls: "run-sub", text: [run.id, estimatorOf(run), mode].filter(Boolean).join(" · ") }),
        el("div", { cls: "run-sub", text: when(run.created_at) }),
      ]);
      if (run.id === single) link.classList.add("selected");
      const box = el("input", { cls: "compare-box", attrs: {
        type: "checkbox", "data-compare-id": run.id, "aria-label": `Compare ${runTitle(run)} (${run.id})`,
      } });
      return el("li", {}, [box, link]);
    });
    $("run-list").replaceChildren(...items);
    renderCompareBoxes();
    if (focused) {
      const again = document.querySelector(`#run-list input[data-compare-id="${CSS.escape(focused)}"]`);
      if (again) again.focus();
    }
  }

  /** The checkboxes and the hint follow `compareIds`; past the limit, the others are disabled. */
  function renderCompareBoxes() {
    const full = compareIds.length >= MAX_COMPARE;
    for (const box of document.querySelectorAll("#run-list .compare-box")) {
      box.checked = compareIds.includes(box.dataset.compareId);
      box.disabled = full && !box.checked;
      box.title = box.disabled ? `At most ${MAX_COMPARE} runs are compared at a time` : "Compare";
      // A compared run's entry is marked in the colour its lines have on the charts.
      const index = compareIds.indexOf(box.dataset.compareId);
      const item = box.closest("li");
      item.classList.toggle("compared", index >= 0 && compareIds.length > 1);
      if (index >= 0) item.style.setProperty("--run-color", RUN_COLORS[index]);
    }
    $("compare-hint").textContent = compareIds.length === 0
      ? `Tick two to ${MAX_COMPARE} runs to compare them.`
      : compareIds.length === 1 ? "Tick another run to compare." : `Comparing ${compareIds.length} runs.`;
    $("compare-clear").hidden = compareIds.length === 0;
  }

  // --- what is shown -----------------------------------------------------------------------

  function compareFromUrl() {
    const raw = new URLSearchParams(location.search).get("compare") || "";
    const ids = raw.split(",").map((id) => id.trim()).filter((id) => RUN_ID.test(id));
    return [...new Set(ids)].slice(0, MAX_COMPARE);
  }

  /** Keep the selection in the address (so a reload or a shared link shows the same runs). */
  function setCompare(ids) {
    compareIds = ids;
    const params = new URLSearchParams(location.search);
    if (ids.length) params.set("compare", ids.join(","));
    else params.delete("compare");
    const query = params.toString().replace(/%2C/gi, ","); // run ids need no escaping
    history.replaceState(history.state, "", `${location.pathname}${query ? `?${query}` : ""}${location.hash}`);
    renderCompareBoxes();
  }

  function selectedFromHash() {
    return decodeURIComponent(location.hash.slice(1)) || null;
  }

  /** Start the view the address asks for, stopping the streams of the one before. */
  function show() {
    if (view.abort) view.abort.abort();
    const abort = new AbortController();
    const single = selectedFromHash();
    const ids = compareIds.length > 1 ? compareIds : single ? [single] : [];
    const mode = compareIds.length > 1 ? "compare" : single ? "single" : "none";
    const traces = ids.map((id, i) => ({
      id, color: RUN_COLORS[i], run: null, records: [], lastStep: -1, lastEventId: null,
      error: null, live: { on: false, text: "" }, marks: [], paused: null, streamStep: -1,
    }));
    Object.assign(view, { mode, traces, abort });
    $("no-run").hidden = mode !== "none";
    $("run").hidden = mode !== "single";
    $("compare").hidden = mode !== "compare";
    $("charts").hidden = mode === "none";
    for (const link of document.querySelectorAll("#run-list a")) {
      link.classList.toggle("selected", mode === "single" && link.dataset.runId === single);
    }
    if (mode === "none") return;
    if (mode === "single") {
      $("run-name").textContent = single;
      for (const id of ["run-status", "run-live", "run-error", "run-facts"]) $(id).replaceChildren();
      $("run-error").hidden = true;
    }
    buildCharts();
    renderView();
    for (const trace of traces) loadTrace(trace, abort.signal);
  }

  /** A run's record and history, then its live events until it finishes. */
  async function loadTrace(trace, signal) {
    try {
      trace.run = await getJson(runPath(trace.id), { signal });
      renderView();
      await loadHistory(trace, signal);
      if (TERMINAL.has(trace.run.status)) {
        setLive(trace, false, "finished");
        await replayGuard(trace, signal);
      } else {
        await follow(trace, signal);
      }
    } catch (error) {
      if (signal.aborted || error instanceof Unauthorized) return;
      trace.error = error.message;
      renderView();
    }
  }

  /** Every record after the last one held, page by page. */
  async function loadHistory(trace, signal) {
    for (;;) {
      const page = await getJson(
        `${runPath(trace.id)}/metrics?since_step=${trace.lastStep}&limit=${HISTORY_PAGE}`, { signal });
      page.records.forEach((record) => addRecord(trace, record));
      scheduleDraw();
      if (page.records.length < HISTORY_PAGE) return;
    }
  }

  function rewind(trace, step) {
    trace.records = trace.records.filter((record) => record.step <= step);
    trace.lastStep = Math.min(trace.lastStep, step);
    trace.streamStep = Math.min(trace.streamStep, step);
  }

  function addRecord(trace, record) {
    // The SSE stream may repeat records the history already gave; a step is kept once.
    if (typeof record.step !== "number" || record.step <= trace.lastStep) return;
    trace.records.push(record);
    trace.lastStep = record.step;
  }

  function renderView() {
    if (view.mode === "single") renderRun(view.traces[0]);
    else if (view.mode === "compare") renderCompare();
  }

  function renderRun(trace) {
    const run = trace.run;
    if (!run) {
      $("run-error").hidden = !trace.error;
      $("run-error").textContent = trace.error || "";
      return;
    }
    const spec = run.spec || {};
    const latest = trace.records[trace.records.length - 1] || {};
    const started = (run.transitions || []).find((t) => t.status === "running");
    const total = spec.pipeline && spec.pipeline.steps;
    const step = trace.lastStep;
    const facts = [
      ["id", run.id],
      ["created", when(run.created_at)],
      ["started", started ? when(started.at) : "–"],
      ["step", step >= 0 ? (total ? `${step} / ${total}` : step) : "–"],
      ["policy version", fmt(latest.policy_version)],
      ["estimator", estimatorOf(run) || "–"],
      ["mode", modeOf(run) || "–"],
      ["max staleness", spec.pipeline ? fmt(spec.pipeline.max_staleness) : "–"],
    ];
    const shadow = (spec.algorithm && spec.algorithm.shadow) || [];
    if (shadow.length) facts.push(["shadow estimators", shadow.join(", ")]);
    // Truncated training sampling biases every ratio unless replayed: a run that declared it,
    // or replays it, says so here.
    const offPolicy = (spec.algorithm && spec.algorithm.off_policy) || {};
    const generation = spec.generation || {};
    if (offPolicy.truncated_sampling === "allow") {
      facts.push([
        "truncated sampling",
        `allowed (top_p ${fmt(generation.top_p)}, top_k ${fmt(generation.top_k)})`,
      ]);
    } else if (offPolicy.truncated_sampling === "replay") {
      facts.push([
        "truncated sampling",
        `replayed (top_p ${fmt(generation.top_p)}, top_k ${fmt(generation.top_k)}, ` +
          `min_p ${fmt(generation.min_p || 0)})`,
      ]);
    }
    $("run-name").textContent = runTitle(run);
    $("run-status").textContent = run.status;
    $("run-status").className = `badge ${run.status}`;
    const paused = pausedText(trace);
    if (paused) facts.unshift(["guard", paused, "paused"]);
    $("run-facts").replaceChildren(...facts.map(([name, value, cls]) =>
      el("div", { cls }, [el("dt", { text: name }), el("dd", { text: value })])));
    const error = trace.error || run.error;
    $("run-error").hidden = !error;
    $("run-error").textContent = error || "";
    $("run-live").textContent = trace.live.text;
    $("run-live").classList.toggle("on", trace.live.on);
  }

  /** The compared runs' table: colour, name, id, estimator, status, step and stream state. */
  function renderCompare() {
    $("compare-title").textContent = `Comparing ${view.traces.length} runs`;
    $("compare-rows").replaceChildren(...view.traces.map((trace) => {
      const run = trace.run;
      const total = run && run.spec && run.spec.pipeline && run.spec.pipeline.steps;
      const step = trace.lastStep >= 0 ? (total ? `${trace.lastStep} / ${total}` : trace.lastStep) : "–";
      const live = el("td", { cls: `live${trace.live.on ? " on" : ""}`, text: trace.live.text });
      const status = run ? el("span", { cls: `badge ${run.status}`, text: run.status }) : "";
      const paused = pausedText(trace);
      const error = trace.error || (run && run.error);
      return el("tr", { attrs: { "data-run-id": trace.id } }, [
        el("td", {}, [swatch(trace.color)]),
        el("td", {}, [
          el("a", { cls: "run-title", text: run ? runTitle(run) : trace.id,
            attrs: { href: `#${encodeURIComponent(trace.id)}` } }),
          el("div", { cls: "run-sub", text: trace.id }),
          ...(error ? [el("div", { cls: "error", text: error })] : []),
        ]),
        el("td", { text: estimatorOf(run) || "–" }),
        el("td", {}, [status, ...(paused ? [el("div", { cls: "run-sub paused", text: paused })] : [])]),
        el("td", { cls: "num", text: step }),
        live,
      ]);
    }));
  }

  function setLive(trace, on, text) {
    trace.live = { on, text };
    renderView();
  }

  // --- live events -------------------------------------------------------------------------

  /** Follow the run's events until it finishes, reconnecting after the last event seen. */
  async function follow(trace, signal) {
    let delay = RETRY_MIN_MS;
    while (!signal.aborted) {
      try {
        const headers = { Accept: "text/event-stream" };
        if (trace.lastEventId) headers["Last-Event-ID"] = trace.lastEventId;
        const response = await api(`${runPath(trace.id)}/events`, { headers, signal });
        setLive(trace, true, "live");
        // Records stored while we were not connected (the stream may start after them).
        await loadHistory(trace, signal);
        delay = RETRY_MIN_MS;
        for await (const event of readEvents(response.body, trace)) handleEvent(trace, event, signal);
        if (TERMINAL.has(trace.run.status)) {
          setLive(trace, false, "finished");
          return;
        }
        setLive(trace, false, "reconnecting…");
      } catch (error) {
        if (signal.aborted || error instanceof Unauthorized) return;
        // 422: the server does not know our last event id (another store); start over.
        if (error.status === 422) trace.lastEventId = null;
        setLive(trace, false, `reconnecting… (${error.message})`);
      }
      await new Promise((resolve) => setTimeout(resolve, delay));
      delay = Math.min(2 * delay, RETRY_MAX_MS);
    }
  }

  /** A finished run's guard events. Its stream gives every event from the first, then ends;
   *  the metrics and status events it also gives are shown already. A stream that ended before
   *  the run's last event (after KPO_STREAM_LIFETIME_S) is read on from the last event it gave. */
  async function replayGuard(trace, signal) {
    for (;;) {
      const before = trace.lastEventId;
      try {
        const headers = { Accept: "text/event-stream" };
        if (before) headers["Last-Event-ID"] = before;
        const response = await api(`${runPath(trace.id)}/events`, { headers, signal });
        for await (const event of readEvents(response.body, trace)) {
          if (event.type === "metrics") trace.streamStep = stepOf(parseJson(event.data));
          else if (GUARD_EVENTS.has(event.type)) handleEvent(trace, event, signal);
        }
      } catch (_) {
        return; // the markers are extras: the charts stand without them
      }
      if (signal.aborted || trace.lastEventId === before) return;
    }
  }

  /** The events of a text/event-stream body, per the HTML standard's parsing rules. */
  async function* readEvents(body, trace) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let event = { id: null, type: "message", data: [] };
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buffer += value;
        // A chunk may end between the \r and \n of one line break: wait for the next chunk.
        const lines = buffer.split(/\r\n|\n|\r(?!$)/);
        buffer = lines.pop();
        for (const line of lines) {
          if (line === "") {
            if (event.id !== null) trace.lastEventId = event.id;
            if (event.data.length) yield { type: event.type, data: event.data.join("\n") };
            event = { id: null, type: "message", data: [] };
            continue;
          }
          if (line.startsWith(":")) continue; // a comment (the server's keep-alive ping)
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
          if (field === "data") event.data.push(text);
          else if (field === "event") event.type = text;
          else if (field === "id") event.id = text;
        }
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  function handleEvent(trace, event, signal) {
    if (event.type === "metrics") {
      const record = parseJson(event.data);
      trace.streamStep = stepOf(record);
      addRecord(trace, record);
      scheduleDraw();
    } else if (event.type === "metrics.rewound") {
      // The run resumed from its checkpoint of this step (a rollback, a driver restart): the
      // records after it are replaced by the steps trained again, which the stream gives next.
      const data = parseJson(event.data);
      if (data && typeof data.step === "number") {
        rewind(trace, data.step);
        scheduleDraw();
      }
    } else if (event.type === "status") {
      const data = parseJson(event.data);
      trace.run = { ...trace.run, status: data.status, error: data.error };
      renderView();
      loadRuns();
      refreshRun(trace, signal); // its transitions (when it started)
    } else if (GUARD_EVENTS.has(event.type)) {
      guardEvent(trace, event.type, parseJson(event.data) || {});
    }
  }

  const stepOf = (record) => (record && typeof record.step === "number" ? record.step : -1);

  /** What a guard event changes: a marker for each action, and the pause the run waits in (a
   *  `resume` is the operator's request, which the driver answers with `guard.resumed`). */
  function guardEvent(trace, kind, data) {
    if (kind === "guard.action" && typeof data.step === "number") {
      const action = String(data.action || "");
      const reason = data.reason ? String(data.reason) : "";
      addMark(trace, `${data.step} ${action} ${reason} ${data.alert || ""}`, {
        step: data.step, action, reason, text: `${action} at step ${data.step}: ${why(data)}`,
      });
      return;
    }
    if (kind === "alert") {
      // A warn or cancel alert is marked where the run was (its last record before the alert):
      // once per firing, as Alertmanager sends a firing alert again with each notification.
      if (data.status !== "firing" || !ALERT_MARKS.has(data.action) || trace.streamStep < 0) return;
      const reason = `alert ${data.alertname || "unnamed"}`;
      const summary = typeof data.summary === "string" && data.summary ? `: ${data.summary}` : "";
      addMark(trace, `alert ${data.fingerprint || data.alertname}@${data.starts_at}`, {
        step: trace.streamStep, action: data.action, reason,
        text: `${data.action} at step ${trace.streamStep}: ${reason}${summary}`,
      });
      return;
    }
    if (kind === "guard.paused") {
      const step = typeof data.step === "number" ? data.step : data.checkpoint;
      trace.paused = { step, message: why(data), note: "" };
    } else if (kind === "guard.resumed") {
      trace.paused = null;
    } else if (trace.paused && kind === "resume") {
      trace.paused.note = "resume requested";
    } else if (trace.paused && kind === "guard.resume_refused") {
      trace.paused.note = `resume refused: ${data.reason || "no reason given"}`;
    }
    renderView();
  }

  /** Why the guard acted: its message without the step and action it starts with (they are
   *  said already), and an alert's summary. */
  function why(data) {
    let text = String(data.message || "").replace(/^step -?\d+: /, "");
    if (data.action && text.startsWith(`${data.action}: `)) text = text.slice(String(data.action).length + 2);
    text = text || String(data.reason || "") || "no reason given";
    return typeof data.summary === "string" && data.summary ? `${text} (${data.summary})` : text;
  }

  /** A marker, unless one of the same `key` is there (a stream read again from its first event,
   *  or a restarted driver, repeats events). */
  function addMark(trace, key, mark) {
    if (trace.marks.some((other) => other.key === key)) return;
    trace.marks.push({ key, ...mark });
    scheduleDraw();
  }

  /** "paused at step N: why" while the run waits in the guard's pause, else null. */
  function pausedText(trace) {
    const paused = trace.paused;
    if (!paused || !trace.run || trace.run.status !== "running") return null;
    const note = paused.note ? ` (${paused.note})` : "";
    return `paused at step ${paused.step ?? "–"}: ${paused.message}${note}`;
  }

  async function refreshRun(trace, signal) {
    try {
      const run = await getJson(runPath(trace.id), { signal });
      if (!signal.aborted) {
        trace.run = run;
        renderView();
      }
    } catch (_) { /* the next status event or reload tries again */ }
  }

  // --- charts ------------------------------------------------------------------------------

  function buildCharts() {
    $("charts").replaceChildren(...CHARTS.map((chart) => el("figure", { cls: "chart", attrs: { id: `chart-${chart.id}` } }, [
      el("div", { cls: "chart-head" }, [
        el("h3", { text: chart.title }),
        el("span", { cls: "chart-step" }),
      ]),
      el("div", { cls: "legend" }),
      // The guard's markers lie over the canvas, one element each: its tooltip says what it was.
      el("div", { cls: "plot" }, [
        el("canvas", { attrs: { role: "img", "aria-label": chart.title } }),
        el("div", { cls: "marks" }),
      ]),
    ])));
  }

  function scheduleDraw() {
    if (drawPending) return;
    drawPending = true;
    requestAnimationFrame(() => {
      drawPending = false;
      renderView();
      for (const chart of CHARTS) drawChart(chart);
    });
  }

  /** The (step, value) points of one series of one run; non-finite values are left out. */
  function points(records, series) {
    const out = [];
    for (const record of records) {
      const value = record[series.key];
      if (typeof value === "number" && Number.isFinite(value)) out.push([record.step, value]);
    }
    return series.smooth ? movingAverage(out) : out;
  }

  /** Trailing mean over about a twentieth of the run (5 to 100 steps). */
  function movingAverage(pts) {
    const window = Math.max(5, Math.min(100, Math.round(pts.length / 20)));
    let sum = 0;
    return pts.map(([step, value], i) => {
      sum += value - (i >= window ? pts[i - window][1] : 0);
      return [step, sum / Math.min(i + 1, window)];
    });
  }

  /** How a series is drawn for one compared run: in the run's colour, solid, dashed or faint. */
  function compareStyle(series, color) {
    if (series.main) return { color, width: 2.2 };
    if (series.dash) return { color, width: 1.2, dash: series.dash };
    return { color, width: 1, alpha: 0.35 };
  }

  function drawChart(chart) {
    const figure = $(`chart-${chart.id}`);
    if (!figure || view.mode === "none") return;
    const canvas = figure.querySelector("canvas");
    const comparing = view.mode === "compare";
    // One line per series of each run shown, with the run it belongs to.
    const lines = view.traces.flatMap((trace) => chart.series.map((series) => ({
      trace, series, pts: points(trace.records, series),
      style: comparing ? compareStyle(series, trace.color) : series,
    })));
    const lastStep = Math.max(-1, ...view.traces.map((trace) => trace.lastStep));
    const marks = view.traces.flatMap((trace) => trace.marks.map((mark) => ({ ...mark, trace })));
    if (comparing) renderCompareLegend(figure, chart, lines);
    else renderLegend(figure, chart, lines);
    figure.querySelector(".legend").append(...markLegend(marks));
    figure.querySelector(".chart-step").textContent =
      lastStep < 0 ? "no data yet" : `${comparing ? "up to " : ""}step ${lastStep}`;
    const drawn = lines.filter((line) => line.pts.length);
    figure.hidden = (Boolean(chart.optional) && drawn.length === 0)
      || (Boolean(chart.shadow) && !drawn.some((line) => line.series.shadow));
    canvas.dataset.lastStep = String(lastStep);
    canvas.dataset.points = String(drawn.reduce((n, line) => n + line.pts.length, 0));
    canvas.dataset.lines = String(drawn.length);
    canvas.dataset.runs = [...new Set(drawn.map((line) => line.trace.id))].join(",");
    canvas.setAttribute("aria-label", comparing
      ? `${chart.title} of ${view.traces.map((trace) => trace.id).join(", ")}` : chart.title);
    canvas.dataset.marks = String(marks.length);
    renderMarks(figure, marks, plot(canvas, lines, marks), comparing);
  }

  const markStyle = (action) => MARK_STYLES[action] || OTHER_MARK;

  /** One legend entry per kind of action marked: its shape and colour, and how many. */
  function markLegend(marks) {
    const counts = new Map();
    for (const mark of marks) counts.set(mark.action, (counts.get(mark.action) || 0) + 1);
    return [...counts].map(([action, n]) => {
      const glyph = el("b", { cls: "mark-glyph", text: markStyle(action).glyph });
      glyph.style.color = markStyle(action).color;
      return el("span", { cls: "legend-mark", attrs: { "data-action": action } },
        [glyph, n > 1 ? `${action} ×${n}` : action]);
    });
  }

  /** The markers' elements over the canvas, at their steps (`at`: where plot drew, or null),
   *  each with its action, step and what happened as attributes and tooltip. */
  function renderMarks(figure, marks, at, comparing) {
    figure.querySelector(".marks").replaceChildren(...marks.map((mark) => {
      const text = comparing ? `${mark.trace.id}: ${mark.text}` : mark.text;
      const node = el("span", { cls: "mark", attrs: {
        "data-step": String(mark.step), "data-action": mark.action, "data-run-id": mark.trace.id,
        "data-reason": mark.reason, title: text, role: "img", "aria-label": text,
      } });
      node.hidden = !at;
      if (at) {
        node.style.left = `${at.x(mark.step) - 4}px`;
        node.style.top = `${at.box.top}px`;
        node.style.height = `${at.box.bottom - at.box.top}px`;
      }
      return node;
    }));
  }

  /** Whether a series is in its chart's legend: a shadow estimator only where it has values. */
  function listed(series, lines) {
    return !series.shadow || lines.some((line) => line.series === series && line.pts.length);
  }

  function renderLegend(figure, chart, lines) {
    const shown = lines.filter((line) => listed(line.series, lines));
    figure.querySelector(".legend").replaceChildren(...shown.map(({ trace, series, pts }) => {
      const last = pts[pts.length - 1];
      // The training estimator's line of a shadow chart is named after the run's estimator.
      const estimator = series.training ? estimatorOf(trace.run) : null;
      const label = estimator ? `${estimator} (training)` : series.label;
      return el("span", {}, [swatch(series.color), `${label} ${fmt(last && last[1])}`]);
    }));
  }

  /** One entry per run (its colour, id, estimator and latest value), then what each line style is. */
  function renderCompareLegend(figure, chart, lines) {
    const entries = lines.filter((line) => line.series.main).map(({ trace, pts }) => {
      const last = pts[pts.length - 1];
      const estimator = estimatorOf(trace.run);
      const name = `${trace.id}${estimator ? ` (${estimator})` : ""}`;
      return el("span", {
        cls: "legend-run",
        attrs: { "data-run-id": trace.id, "data-last-step": String(trace.lastStep),
          title: trace.run ? runTitle(trace.run) : trace.id },
      }, [swatch(trace.color), `${name} ${fmt(last && last[1])}`]);
    });
    const keyed = chart.series.filter((series) => listed(series, lines));
    const styles = keyed.length > 1 ? keyed.map((series) => el("span", { cls: "legend-key" }, [
      swatch(null, `swatch ${series.main ? "solid" : series.dash ? "dashed" : "faint"}`), series.label,
    ])) : [];
    figure.querySelector(".legend").replaceChildren(...entries, ...styles);
  }

  /** Draw the lines and the guard's markers; where they are drawn (the step scale and the plot's
   *  box), or null when there is nothing to draw. */
  function plot(canvas, lines, marks) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = "11px system-ui, sans-serif";
    const box = { left: 50, right: width - 10, top: 8, bottom: height - 22 };
    const flat = lines.flatMap((line) => line.pts);
    if (!flat.length) {
      ctx.fillStyle = "#6b7385";
      ctx.textAlign = "center";
      ctx.fillText("no data yet", width / 2, height / 2);
      return null;
    }
    // A marker past the last record drawn (its record is on its way) widens the steps shown.
    const x = scale([...flat.map((p) => p[0]), ...marks.map((mark) => mark.step)], box.left, box.right, true);
    const y = scale(flat.map((p) => p[1]), box.bottom, box.top, false);
    drawAxes(ctx, box, x, y);
    // Faint lines first, so that the solid ones of every run stay on top.
    const order = [...lines].sort((a, b) => (a.style.alpha ? 0 : 1) - (b.style.alpha ? 0 : 1));
    for (const line of order) drawLine(ctx, line.pts, x, y, line.style);
    for (const mark of marks) drawMark(ctx, box, x(mark.step), markStyle(mark.action));
    return { x, box };
  }

  /** A dashed vertical line at `px`, topped by the action's shape. */
  function drawMark(ctx, box, px, style) {
    const cx = Math.round(px) + 0.5;
    const cy = box.top + 5;
    ctx.strokeStyle = style.color;
    ctx.fillStyle = style.color;
    ctx.lineWidth = 1.2;
    ctx.setLineDash([3, 3]);
    ctx.beginPath();
    ctx.moveTo(cx, box.top + 10);
    ctx.lineTo(cx, box.bottom);
    ctx.stroke();
    ctx.setLineDash([]);
    ctx.lineWidth = 2;
    ctx.beginPath();
    if (style.shape === "back") { // rolled back: a triangle pointing to earlier steps
      ctx.moveTo(cx + 5, cy - 5);
      ctx.lineTo(cx - 5, cy);
      ctx.lineTo(cx + 5, cy + 5);
      ctx.fill();
    } else if (style.shape === "pause") { // two bars
      ctx.fillRect(cx - 4, cy - 5, 3, 10);
      ctx.fillRect(cx + 1, cy - 5, 3, 10);
    } else if (style.shape === "cross") {
      ctx.moveTo(cx - 4, cy - 4);
      ctx.lineTo(cx + 4, cy + 4);
      ctx.moveTo(cx + 4, cy - 4);
      ctx.lineTo(cx - 4, cy + 4);
      ctx.stroke();
    } else if (style.shape === "warn") { // a triangle pointing up
      ctx.moveTo(cx, cy - 5);
      ctx.lineTo(cx + 5, cy + 4);
      ctx.lineTo(cx - 5, cy + 4);
      ctx.fill();
    } else if (style.shape === "diamond") {
      ctx.moveTo(cx, cy - 5);
      ctx.lineTo(cx + 5, cy);
      ctx.lineTo(cx, cy + 5);
      ctx.lineTo(cx - 5, cy);
      ctx.fill();
    } else {
      ctx.arc(cx, cy, 4, 0, 2 * Math.PI);
      ctx.fill();
    }
  }

  /** A linear map from data to pixels over [lo, hi] widened to nice tick values. */
  function scale(values, from, to, integer) {
    let lo = Math.min(...values);
    let hi = Math.max(...values);
    if (lo === hi) {
      const pad = lo === 0 ? 1 : Math.abs(lo) * 0.1;
      lo -= integer ? 1 : pad;
      hi += integer ? 1 : pad;
    }
    const ticks = niceTicks(lo, hi, integer ? 6 : 5, integer);
    if (!integer) { // values get round limits; steps keep their own, so the line fills the width
      lo = Math.min(lo, ticks[0]);
      hi = Math.max(hi, ticks[ticks.length - 1]);
    }
    const map = (v) => from + ((v - lo) / (hi - lo)) * (to - from);
    map.ticks = ticks.filter((t) => t >= lo && t <= hi);
    return map;
  }

  function niceTicks(lo, hi, count, integer) {
    const raw = (hi - lo) / count;
    const magnitude = 10 ** Math.floor(Math.log10(raw));
    let step = [1, 2, 2.5, 5, 10].map((m) => m * magnitude).find((s) => s >= raw);
    if (integer) step = Math.max(1, Math.round(step));
    const ticks = [];
    for (let t = Math.floor(lo / step) * step; t <= hi + step * 1e-9; t += step) {
      ticks.push(Number(t.toPrecision(12)));
    }
    if (ticks[ticks.length - 1] < hi) ticks.push(ticks[ticks.length - 1] + step);
    return ticks;
  }

  function drawAxes(ctx, box, x, y) {
    ctx.strokeStyle = "#eceef2";
    ctx.fillStyle = "#6b7385";
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (const t of y.ticks) {
      const py = Math.round(y(t)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(box.left, py);
      ctx.lineTo(box.right, py);
      ctx.stroke();
      ctx.fillText(fmt(t), box.left - 6, py);
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (const t of x.ticks) ctx.fillText(String(t), x(t), box.bottom + 6);
    ctx.strokeStyle = "#c5cad3";
    ctx.beginPath();
    ctx.moveTo(box.left, box.bottom + 0.5);
    ctx.lineTo(box.right, box.bottom + 0.5);
    ctx.stroke();
  }

  function drawLine(ctx, pts, x, y, style) {
    if (!pts.length) return;
    ctx.strokeStyle = style.color;
    ctx.fillStyle = style.color;
    ctx.lineWidth = style.width;
    ctx.lineJoin = "round";
    ctx.globalAlpha = style.alpha || 1;
    ctx.setLineDash(style.dash || []);
    if (pts.length === 1) {
      ctx.beginPath();
      ctx.arc(x(pts[0][0]), y(pts[0][1]), 2.5, 0, 2 * Math.PI);
      ctx.fill();
    } else {
      ctx.beginPath();
      pts.forEach(([step, value], i) => (i ? ctx.lineTo : ctx.moveTo).call(ctx, x(step), y(value)));
      ctx.stroke();
    }
    ctx.setLineDash([]);
    ctx.globalAlpha = 1;
  }

  // --- start -------------------------------------------------------------------------------

  function reload() {
    loadRuns();
    show();
  }

  function setUpCompare() {
    compareIds = compareFromUrl();
    $("run-list").addEventListener("change", (event) => {
      const id = event.target.dataset && event.target.dataset.compareId;
      if (!id) return;
      const ids = compareIds.filter((other) => other !== id);
      if (event.target.checked && ids.length < MAX_COMPARE) ids.push(id);
      const wasComparing = compareIds.length > 1;
      setCompare(ids);
      // One tick alone leaves the single-run view as it is; the view changes when it compares.
      if (wasComparing || ids.length > 1) show();
    });
    // Opening one run (its link in the list or in the compare table) leaves the comparison.
    document.addEventListener("click", (event) => {
      const link = event.target.closest && event.target.closest("a[href^='#']");
      if (!link || compareIds.length < 2) return;
      setCompare([]);
      // The same address as now fires no hashchange: show the run here.
      if (link.getAttribute("href") === location.hash) show();
    });
    $("compare-clear").addEventListener("click", () => {
      const wasComparing = compareIds.length > 1;
      setCompare([]);
      if (wasComparing) show();
    });
  }

  function start() {
    setUpToken();
    setUpCompare();
    renderCompareBoxes();
    $("reload-runs").addEventListener("click", loadRuns);
    window.addEventListener("hashchange", show);
    window.addEventListener("resize", scheduleDraw);
    // Close the streams when the page goes away (Chrome would keep them open for a page kept in
    // its back/forward cache), and start again when such a page comes back.
    window.addEventListener("pagehide", () => view.abort && view.abort.abort());
    window.addEventListener("pageshow", (event) => event.persisted && reload());
    setInterval(loadRuns, RUNS_REFRESH_MS);
    reload();
  }

  start();
})();
