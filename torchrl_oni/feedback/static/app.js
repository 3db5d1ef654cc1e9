// The ONI labelling page. Plain JavaScript, no build step, no external resources.
// Every string that comes from the game goes into the page with textContent, never innerHTML.
"use strict";

(function () {
  const TOKEN_KEY = "oni-label-token";
  const CAPTION_KEYS = { p: "progress", n: "not_progress", s: "skip" };
  const PAIR_KEYS = { ArrowLeft: "left", a: "left", ArrowRight: "right", d: "right", "=": "equal", e: "equal", s: "skip" };
  const LABEL_NAMES = { 1: "progress", 0: "not progress" };
  const SVG = "http://www.w3.org/2000/svg";

  const ui = {
    mode: "captions",
    captions: [],
    pairs: [],
    state: null,
    busy: false,
    showLLM: false,
    screens: new Map(), // caption id -> screen JSON (or null when none was kept)
    pollTimer: null,
  };

  // ---------------------------------------------------------------- token and requests
  function readToken() {
    const params = new URLSearchParams(window.location.search);
    const fromUrl = params.get("token");
    if (fromUrl) {
      sessionStorage.setItem(TOKEN_KEY, fromUrl);
      // keep the token out of the address bar, the history and screenshots
      window.history.replaceState(null, "", window.location.pathname);
    }
    return sessionStorage.getItem(TOKEN_KEY);
  }
  const token = readToken();

  async function api(path, body) {
    const headers = {};
    if (token) headers["X-ONI-Token"] = token;
    const options = { headers: headers, cache: "no-store" };
    if (body !== undefined) {
      options.method = "POST";
      headers["Content-Type"] = "application/json";
      options.body = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(path, options);
    } catch (err) {
      throw new Error("the server does not answer (" + err.message + ")");
    }
    let data = null;
    try {
      data = await response.json();
    } catch (err) {
      data = null;
    }
    if (!response.ok) {
      throw new Error((data && data.error) || ("HTTP " + response.status));
    }
    return data;
  }

  function $(id) {
    return document.getElementById(id);
  }

  function setStatus(text) {
    $("status").textContent = text || "";
  }

  // ---------------------------------------------------------------- rendering
  function plural(n, word) {
    return n + " " + word + (n === 1 ? "" : "s");
  }

  function renderScreen(pre, screen) {
    const lines = [];
    if (screen) {
      for (let r = 0; r < screen.rows.length; r++) {
        const text = screen.rows[r];
        const colors = screen.colors[r];
        let start = 0;
        for (let c = 1; c <= text.length; c++) {
          if (c === text.length || colors[c] !== colors[start]) {
            const span = document.createElement("span");
            const color = Math.max(0, Math.min(15, colors[start] | 0));
            span.className = "c" + color;
            span.textContent = text.slice(start, c);
            lines.push(span);
            start = c;
          }
        }
        if (r + 1 < screen.rows.length) lines.push(document.createTextNode("\n"));
      }
    }
    pre.replaceChildren.apply(pre, lines);
  }

  async function showScreen(pre, item, note) {
    renderScreen(pre, null);
    if (note) note.textContent = item && item.screen ? "" : "No game screen was kept for this message.";
    if (!item || !item.screen) return;
    let screen = ui.screens.get(item.id);
    if (screen === undefined) {
      try {
        screen = await api("/api/screen?id=" + encodeURIComponent(item.id));
      } catch (err) {
        screen = null;
      }
      ui.screens.set(item.id, screen);
    }
    const current = ui.mode === "captions" ? ui.captions[0] : ui.pairs[0];
    const stillShown = current && (current.id === item.id ||
      (current.left && (current.left.id === item.id || current.right.id === item.id)));
    if (stillShown) renderScreen(pre, screen);
  }

  function describeLLM(llm, pair) {
    if (!llm) return "none yet";
    let what;
    if (pair) {
      what = llm.preference === 0 ? "left" : llm.preference === 1 ? "right" : llm.preference === 0.5 ? "equal" : String(llm.preference);
    } else {
      what = LABEL_NAMES[llm.label] || String(llm.label);
    }
    return what + (llm.by ? " (" + llm.by + ")" : "");
  }

  function drawAgreement(agreement) {
    const box = $("agreement-plot");
    const cap = (agreement && agreement.caption) || { compared: 0, agree: 0, series: [] };
    const pair = (agreement && agreement.pair) || { compared: 0, agree: 0, series: [] };
    const parts = [];
    if (cap.compared) parts.push("captions " + Math.round(100 * cap.agree / cap.compared) + "% of " + cap.compared);
    if (pair.compared) parts.push("pairs " + Math.round(100 * pair.agree / pair.compared) + "% of " + pair.compared);
    $("agreement-text").textContent = parts.length ? "Agree: " + parts.join(", ") + "." : "No label compared yet.";
    const W = 280, H = 120, L = 30, R = 8, T = 8, B = 20;
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("class", "plot");
    svg.setAttribute("width", W);
    svg.setAttribute("height", H);
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-label", "agreement with the LLM over labels compared");
    const maxN = Math.max(2, cap.compared, pair.compared);
    const x = (n) => L + (W - L - R) * (n - 1) / (maxN - 1);
    const y = (rate) => T + (H - T - B) * (1 - rate);
    function line(x1, y1, x2, y2) {
      const el = document.createElementNS(SVG, "line");
      el.setAttribute("x1", x1); el.setAttribute("y1", y1); el.setAttribute("x2", x2); el.setAttribute("y2", y2);
      el.setAttribute("class", "axis");
      svg.appendChild(el);
    }
    function label(text, tx, ty, anchor) {
      const el = document.createElementNS(SVG, "text");
      el.setAttribute("x", tx); el.setAttribute("y", ty);
      el.setAttribute("text-anchor", anchor || "end");
      el.textContent = text;
      svg.appendChild(el);
    }
    line(L, y(0), W - R, y(0));
    line(L, y(0), L, y(1));
    label("100%", L - 3, y(1) + 4);
    label("50%", L - 3, y(0.5) + 4);
    label("0%", L - 3, y(0) + 4);
    label("labels compared: " + Math.max(cap.compared, pair.compared), W - R, H - 5);
    for (const [series, cls] of [[cap.series, "line-caption"], [pair.series, "line-pair"]]) {
      if (!series.length) continue;
      const poly = document.createElementNS(SVG, "polyline");
      const points = series.length === 1 ? [series[0], series[0]] : series;
      poly.setAttribute("points", points.map((p, i) => (series.length === 1 ? x(1) + i * 4 : x(p[0])) + "," + y(p[1])).join(" "));
      poly.setAttribute("class", cls);
      svg.appendChild(poly);
    }
    box.replaceChildren(svg);
  }

  function renderState() {
    const s = ui.state;
    if (!s) return;
    $("counter").textContent = plural(s.given, "label") + " given";
    $("order-note").textContent = (s.first ? "(" + plural(s.first, "flagged caption") + " first, then " : "(") +
      (s.order === "disagree" ? "ordered by reward-model disagreement)" : "most seen first)");
    $("store-text").textContent =
      s.store.size + " captions, " + s.store.labelled + " labelled (" + s.human_total.captions + " by people); " +
      s.waiting.captions + " waiting for a person; " + s.store.pairs + " pairs, " + s.waiting.pairs + " waiting." +
      (s.save_error ? " Saving failed: " + s.save_error : "");
    $("btn-undo").disabled = !s.can_undo;
    $("btn-pair-undo").disabled = !s.can_undo;
    drawAgreement(s.agreement);
  }

  function renderItems() {
    const captions = ui.mode === "captions";
    $("captions-view").hidden = !captions;
    $("pairs-view").hidden = captions;
    document.body.dataset.mode = ui.mode;
    $("mode-captions").setAttribute("aria-pressed", String(captions));
    $("mode-pairs").setAttribute("aria-pressed", String(!captions));
    const queue = captions ? ui.captions : ui.pairs;
    const item = queue[0];
    $("empty").hidden = Boolean(item);
    for (const b of document.querySelectorAll("button.answer")) {
      if (b.id !== "btn-undo" && b.id !== "btn-pair-undo") b.disabled = !item;
    }
    const upcoming = $("upcoming");
    upcoming.replaceChildren.apply(upcoming, queue.slice(1, 6).map((it) => {
      const li = document.createElement("li");
      li.textContent = captions ? it.text : it.left.text + "  |  " + it.right.text;
      return li;
    }));
    $("toggle-llm").textContent = ui.showLLM ? "hide" : "show";
    $("toggle-llm").setAttribute("aria-pressed", String(ui.showLLM));
    if (captions) {
      $("message").textContent = item ? item.text : "";
      $("seen").textContent = item ? "seen " + plural(item.times_seen, "time") + (item.note ? "; " + item.note : "") : "";
      $("llm").textContent = item ? describeLLM(item.llm, false) : "";
      $("llm").hidden = !ui.showLLM;
      showScreen($("screen"), item, $("screen-note"));
    } else {
      for (const side of ["left", "right"]) {
        const it = item ? item[side] : null;
        $(side + "-message").textContent = it ? it.text : "";
        $(side + "-seen").textContent = it ? "seen " + plural(it.times_seen, "time") : "";
        showScreen($(side + "-screen"), it, null);
      }
      $("pair-llm").textContent = item ? describeLLM(item.llm, true) : "";
      $("pair-llm").hidden = !ui.showLLM;
    }
  }

  // ---------------------------------------------------------------- actions
  async function refresh() {
    clearTimeout(ui.pollTimer);
    const kind = ui.mode;
    const [state, queue] = await Promise.all([api("/api/state"), api("/api/queue?kind=" + kind + "&limit=20")]);
    ui.state = state;
    ui[kind] = queue.items;
    renderState();
    renderItems();
    document.body.dataset.ready = "1";
    if (!queue.items.length) ui.pollTimer = setTimeout(() => run(refresh), 4000);
  }

  async function run(task) {
    if (ui.busy) return;
    ui.busy = true;
    document.body.dataset.busy = "1";
    try {
      await task();
      setStatus("");
    } catch (err) {
      setStatus(err.message);
    } finally {
      ui.busy = false;
      document.body.dataset.busy = "0";
    }
  }

  function answer(value) {
    const item = (ui.mode === "captions" ? ui.captions : ui.pairs)[0];
    if (!item) return;
    const path = ui.mode === "captions" ? "/api/label" : "/api/prefer";
    run(async () => {
      ui.state = await api(path, { id: item.id, answer: value });
      await refresh();
    });
  }

  function undo() {
    run(async () => {
      await api("/api/undo", {});
      await refresh();
    });
  }

  function setMode(mode) {
    if (mode === ui.mode) return;
    ui.mode = mode;
    renderItems();
    run(refresh);
  }

  function toggleLLM() {
    ui.showLLM = !ui.showLLM;
    renderItems();
  }

  document.addEventListener("keydown", (event) => {
    if (event.target && /^(INPUT|TEXTAREA|SELECT)$/.test(event.target.tagName)) return;
    if ((event.ctrlKey || event.metaKey) && event.key === "z") {
      event.preventDefault();
      undo();
      return;
    }
    if (event.ctrlKey || event.metaKey || event.altKey) return;
    const key = event.key;
    if (key === "u") undo();
    else if (key === "l") toggleLLM();
    else if (key === "c") setMode("captions");
    else if (key === "v") setMode("pairs");
    else if (ui.mode === "captions" && CAPTION_KEYS[key]) answer(CAPTION_KEYS[key]);
    else if (ui.mode === "pairs" && PAIR_KEYS[key]) answer(PAIR_KEYS[key]);
    else return;
    event.preventDefault();
  });

  function bind(id, fn) {
    $(id).addEventListener("click", fn);
  }
  bind("btn-progress", () => answer("progress"));
  bind("btn-not-progress", () => answer("not_progress"));
  bind("btn-skip", () => answer("skip"));
  bind("btn-undo", undo);
  bind("btn-left", () => answer("left"));
  bind("btn-right", () => answer("right"));
  bind("btn-equal", () => answer("equal"));
  bind("btn-pair-skip", () => answer("skip"));
  bind("btn-pair-undo", undo);
  bind("toggle-llm", toggleLLM);
  bind("mode-captions", () => setMode("captions"));
  bind("mode-pairs", () => setMode("pairs"));

  run(refresh);
})();
