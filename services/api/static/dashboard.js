// KPO-RL dashboard: lists runs, draws a run's stability charts from its metrics history and keeps
// them live from the run's server-sent events.
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

  // One entry per chart: the record keys it draws. `smooth` draws a trailing moving average.
  const CHARTS = [
    { id: "reward", title: "Reward", series: [
      { key: "reward_mean", label: "reward mean", color: "#9fb3c8", width: 1 },
      { key: "reward_mean", label: "moving average", color: "#1f6feb", width: 2.2, smooth: true },
    ] },
    { id: "entropy", title: "Entropy (nats)", series: [
      { key: "entropy", label: "entropy", color: "#8e24aa", width: 1.6 },
    ] },
    { id: "clip", title: "Clip fraction", series: [
      { key: "clip_fraction", label: "clip fraction", color: "#ef6c00", width: 1.6 },
    ] },
    { id: "staleness", title: "Staleness (policy versions)", series: [
      { key: "staleness_mean", label: "mean", color: "#00897b", width: 1.8 },
      { key: "staleness_max", label: "max", color: "#80cbc4", width: 1.2, dash: [4, 3] },
    ] },
    { id: "switch", title: "Ratio switch frequency", series: [
      { key: "raw_switch_frequency", label: "raw", color: "#b0bec5", width: 1.2 },
      { key: "filtered_switch_frequency", label: "filtered", color: "#c62828", width: 1.8 },
    ] },
    { id: "lfr", title: "Low-frequency ratio", series: [
      { key: "raw_low_frequency_ratio", label: "raw", color: "#b0bec5", width: 1.2 },
      { key: "filtered_low_frequency_ratio", label: "filtered", color: "#3949ab", width: 1.8 },
    ] },
  ];

  const $ = (id) => document.getElementById(id);
  const state = { run: null, records: [], lastStep: -1, lastEventId: null, abort: null };
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

  function runTitle(run) {
    return (run.spec && run.spec.name) || run.id;
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
    const items = runs.map((run) => {
      const spec = run.spec || {};
      const estimator = spec.algorithm && spec.algorithm.estimator && spec.algorithm.estimator.name;
      const mode = spec.pipeline && spec.pipeline.mode;
      const link = el("a", { attrs: { href: `#${encodeURIComponent(run.id)}`, "data-run-id": run.id } }, [
        el("div", { cls: "run-line" }, [
          el("span", { cls: "run-title", text: runTitle(run) }),
          el("span", { cls: `badge ${run.status}`, text: run.status }),
        ]),
        el("div", { cls: "run-sub", text: [run.id, estimator, mode].filter(Boolean).join(" · ") }),
        el("div", { cls: "run-sub", text: when(run.created_at) }),
      ]);
      if (state.run && state.run.id === run.id) link.classList.add("selected");
      return el("li", {}, [link]);
    });
    $("run-list").replaceChildren(...items);
  }

  // --- one run -----------------------------------------------------------------------------

  async function selectRun(runId) {
    if (state.abort) state.abort.abort();
    const abort = new AbortController();
    Object.assign(state, { run: null, records: [], lastStep: -1, lastEventId: null, abort });
    $("no-run").hidden = Boolean(runId);
    $("run").hidden = !runId;
    if (!runId) return;
    $("run-name").textContent = runId;
    for (const id of ["run-status", "run-live", "run-error"]) $(id).textContent = "";
    $("run-error").hidden = true;
    buildCharts();
    for (const link of document.querySelectorAll("#run-list a")) {
      link.classList.toggle("selected", link.dataset.runId === runId);
    }
    try {
      state.run = await getJson(runPath(runId), { signal: abort.signal });
      renderRun();
      await loadHistory(runId, abort.signal);
      if (TERMINAL.has(state.run.status)) setLive(false, "finished");
      else follow(runId, abort.signal);
    } catch (error) {
      if (abort.signal.aborted || error instanceof Unauthorized) return;
      $("run-error").hidden = false;
      $("run-error").textContent = error.message;
    }
  }

  /** Every record after the last one held, page by page. */
  async function loadHistory(runId, signal) {
    for (;;) {
      const page = await getJson(
        `${runPath(runId)}/metrics?since_step=${state.lastStep}&limit=${HISTORY_PAGE}`, { signal });
      page.records.forEach(addRecord);
      scheduleDraw();
      if (page.records.length < HISTORY_PAGE) return;
    }
  }

  function addRecord(record) {
    // The SSE stream may repeat records the history already gave; a step is kept once.
    if (typeof record.step !== "number" || record.step <= state.lastStep) return;
    state.records.push(record);
    state.lastStep = record.step;
  }

  function renderRun() {
    const run = state.run;
    const spec = run.spec || {};
    const latest = state.records[state.records.length - 1] || {};
    const started = (run.transitions || []).find((t) => t.status === "running");
    const total = spec.pipeline && spec.pipeline.steps;
    const facts = [
      ["id", run.id],
      ["created", when(run.created_at)],
      ["started", started ? when(started.at) : "–"],
      ["step", state.lastStep >= 0 ? (total ? `${state.lastStep} / ${total}` : state.lastStep) : "–"],
      ["policy version", fmt(latest.policy_version)],
      ["estimator", (spec.algorithm && spec.algorithm.estimator && spec.algorithm.estimator.name) || "–"],
      ["mode", (spec.pipeline && spec.pipeline.mode) || "–"],
      ["max staleness", spec.pipeline ? fmt(spec.pipeline.max_staleness) : "–"],
    ];
    $("run-name").textContent = runTitle(run);
    $("run-status").textContent = run.status;
    $("run-status").className = `badge ${run.status}`;
    $("run-facts").replaceChildren(...facts.map(([name, value]) =>
      el("div", {}, [el("dt", { text: name }), el("dd", { text: value })])));
    $("run-error").hidden = !run.error;
    $("run-error").textContent = run.error || "";
  }

  function setLive(on, text) {
    $("run-live").textContent = text;
    $("run-live").classList.toggle("on", on);
  }

  // --- live events -------------------------------------------------------------------------

  /** Follow the run's events until it finishes, reconnecting after the last event seen. */
  async function follow(runId, signal) {
    let delay = RETRY_MIN_MS;
    while (!signal.aborted) {
      try {
        const headers = { Accept: "text/event-stream" };
        if (state.lastEventId) headers["Last-Event-ID"] = state.lastEventId;
        const response = await api(`${runPath(runId)}/events`, { headers, signal });
        setLive(true, "live");
        // Records stored while we were not connected (the stream may start after them).
        await loadHistory(runId, signal);
        delay = RETRY_MIN_MS;
        for await (const event of readEvents(response.body)) handleEvent(event);
        if (TERMINAL.has(state.run.status)) {
          setLive(false, "finished");
          return;
        }
        setLive(false, "reconnecting…");
      } catch (error) {
        if (signal.aborted || error instanceof Unauthorized) return;
        // 422: the server does not know our last event id (another store); start over.
        if (error.status === 422) state.lastEventId = null;
        setLive(false, `reconnecting… (${error.message})`);
      }
      await new Promise((resolve) => setTimeout(resolve, delay));
      delay = Math.min(2 * delay, RETRY_MAX_MS);
    }
  }

  /** The events of a text/event-stream body, per the HTML standard's parsing rules. */
  async function* readEvents(body) {
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
            if (event.id !== null) state.lastEventId = event.id;
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

  function handleEvent(event) {
    if (event.type === "metrics") {
      addRecord(parseJson(event.data));
      scheduleDraw();
    } else if (event.type === "status") {
      const data = parseJson(event.data);
      state.run = { ...state.run, status: data.status, error: data.error };
      renderRun();
      loadRuns();
      refreshRun(state.run.id, state.abort.signal); // its transitions (when it started)
    }
  }

  async function refreshRun(runId, signal) {
    try {
      const run = await getJson(runPath(runId), { signal });
      if (state.run && state.run.id === run.id) {
        state.run = run;
        renderRun();
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
      el("canvas", { attrs: { role: "img", "aria-label": chart.title } }),
    ])));
  }

  function scheduleDraw() {
    if (drawPending) return;
    drawPending = true;
    requestAnimationFrame(() => {
      drawPending = false;
      if (state.run) renderRun();
      for (const chart of CHARTS) drawChart(chart);
    });
  }

  /** The (step, value) points of one series; non-finite values are left out. */
  function points(series) {
    const out = [];
    for (const record of state.records) {
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

  function drawChart(chart) {
    const figure = $(`chart-${chart.id}`);
    if (!figure) return;
    const all = chart.series.map(points);
    const canvas = figure.querySelector("canvas");
    renderLegend(figure, chart, all);
    figure.querySelector(".chart-step").textContent =
      state.lastStep >= 0 ? `step ${state.lastStep}` : "no data yet";
    canvas.dataset.lastStep = String(state.lastStep);
    canvas.dataset.points = String(all.reduce((n, pts) => n + pts.length, 0));
    plot(canvas, chart.series, all);
  }

  function renderLegend(figure, chart, all) {
    figure.querySelector(".legend").replaceChildren(...chart.series.map((series, i) => {
      const swatch = el("i", { cls: "swatch" });
      swatch.style.background = series.color;
      const last = all[i][all[i].length - 1];
      return el("span", {}, [swatch, `${series.label} ${fmt(last && last[1])}`]);
    }));
  }

  function plot(canvas, seriesList, all) {
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
    const flat = all.flat();
    if (!flat.length) {
      ctx.fillStyle = "#6b7385";
      ctx.textAlign = "center";
      ctx.fillText("no data yet", width / 2, height / 2);
      return;
    }
    const x = scale(flat.map((p) => p[0]), box.left, box.right, true);
    const y = scale(flat.map((p) => p[1]), box.bottom, box.top, false);
    drawAxes(ctx, box, x, y);
    seriesList.forEach((series, i) => drawLine(ctx, all[i], x, y, series));
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

  function drawLine(ctx, pts, x, y, series) {
    ctx.strokeStyle = series.color;
    ctx.fillStyle = series.color;
    ctx.lineWidth = series.width;
    ctx.lineJoin = "round";
    ctx.setLineDash(series.dash || []);
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
  }

  // --- start -------------------------------------------------------------------------------

  function selectedFromHash() {
    return decodeURIComponent(location.hash.slice(1)) || null;
  }

  function reload() {
    loadRuns();
    selectRun(selectedFromHash());
  }

  function start() {
    setUpToken();
    $("reload-runs").addEventListener("click", loadRuns);
    window.addEventListener("hashchange", () => selectRun(selectedFromHash()));
    window.addEventListener("resize", scheduleDraw);
    // Close the stream when the page goes away (Chrome would keep it open for a page kept in
    // its back/forward cache), and start again when such a page comes back.
    window.addEventListener("pagehide", () => state.abort && state.abort.abort());
    window.addEventListener("pageshow", (event) => event.persisted && reload());
    setInterval(loadRuns, RUNS_REFRESH_MS);
    reload();
  }

  start();
})();
