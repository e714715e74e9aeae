// The Training stability view: draws what /api/... returns (ballast.ui.summary). Text from records is
// only ever set as textContent, never as HTML. The page's Content-Security-Policy allows no inline
// script or style: the config comes as a JSON data element, styles are set through the CSSOM.
(function () {
  "use strict";
  const config = JSON.parse(document.getElementById("ballast-config").textContent);
  const app = document.getElementById("app");

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === "class") node.className = v;
      else if (k === "style") node.style.cssText = v; // a style attribute would be inline style, refused by the CSP
      else node.setAttribute(k, v);
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }
  const fmt = {
    pct: (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %"),
    s: (v) => {
      if (v === null || v === undefined) return "–";
      if (v < 120) return v.toFixed(1) + " s";
      if (v < 7200) return (v / 60).toFixed(1) + " min";
      return (v / 3600).toFixed(1) + " h";
    },
    n: (v, d) => (v === null || v === undefined ? "–" : Number(v).toFixed(d === undefined ? 0 : d)),
  };
  function card(label, value, id) {
    return el("div", { class: "card" }, el("div", { class: "value", id: id }, value), el("div", { class: "label" }, label));
  }
  function table(id, head, rows) {
    return el("table", { id: id }, el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))),
      el("tbody", {}, rows.map((r) => el("tr", {}, r.map((c) => (c instanceof Node && c.tagName === "TD" ? c : el("td", {}, c)))))));
  }
  async function load(url) {
    const resp = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    const body = await resp.json().catch(() => ({}));
    if (!resp.ok) throw new Error(body.detail || resp.status + " " + resp.statusText);
    return body;
  }
  function chart(title, xs, series, opts) {
    const box = el("div", { class: "chart", "data-chart": title });
    const data = [xs, ...series.map((s) => s.values)];
    const spec = {
      title: title, width: 460, height: 220,
      scales: { x: { time: !!(opts && opts.time) }, y: { distr: opts && opts.log ? 3 : 1 } },
      series: [{ label: opts && opts.xlabel ? opts.xlabel : "step" }, ...series.map((s) => ({
        label: s.label, stroke: s.color || "#2b6cb0", width: s.points ? 0 : s.faint ? 0.5 : 1.5, spanGaps: true,
        points: s.points ? { show: true, size: 8, stroke: s.color, fill: s.color } : { show: false },
      }))],
    };
    // A band between two series (their indexes in `series`, from 1): the history's per-bucket min and max.
    if (opts && opts.band) spec.bands = [{ series: opts.band, fill: "rgba(43,108,176,0.15)" }];
    // eslint-disable-next-line no-undef
    new uPlot(spec, data, box);
    return box;
  }

  function runPage(d) {
    const r = d.recovery;
    const parts = [el("h1", {}, d.dag_id + " / " + d.run_id), el("p", { class: "muted", id: "status" }, d.status)];
    const states = d.records.states, problems = d.records.problems;
    const notOk = Object.entries(states).filter(([k, v]) => v !== "ok" && !(v === "missing" && d.status === "finished" && k === "train/heartbeat"));
    if (notOk.length) {
      parts.push(el("div", { class: "notice", id: "record-states" }, "Records: ",
        notOk.map(([k, v]) => el("span", { "data-record": k, "data-state": v }, k + " " + v + (problems[k] ? " (" + problems[k] + ")" : "") + "; "))));
    }
    const p = d.progress;
    parts.push(el("div", { class: "cards" },
      card("effective training time", r ? fmt.pct(r.effective_ratio) : "–", "ratio"),
      card("training wall time", r ? fmt.s(r.wall_seconds) : "–", "wall"),
      card("time lost", r ? fmt.s(r.lost_seconds + r.retry_wait_seconds) : "–", "lost"),
      card("tries", r ? r.tries : "–", "tries-count"),
      card("steps", fmt.n(p.step) + (p.total ? " / " + p.total : ""), "steps"),
      card("samples/s", fmt.n(p.samples_per_second, 1), "sps"),
      d.status === "finished" ? null : card("ETA", fmt.s(p.eta_seconds), "eta"),
      card("current try", fmt.n(p.current_try), "current-try")));
    const sp = d.stage_progress || [];
    if (sp.length) {
      const amount = (q, unit) => unit === "bytes" ? (q / 1e6).toFixed(1) + " MB" : fmt.n(q) + " " + unit;
      parts.push(el("h2", {}, "Stages at work"), table("stage-progress", ["stage", "work", "done", "rate", "ETA", "updated"],
        sp.map((g) => [g.stage, g.what, amount(g.done, g.unit) + " of " + amount(g.total, g.unit) + (g.finished ? " (done)" : ""),
          amount(g.rate_per_second, g.unit) + "/s", g.finished ? "–" : fmt.s(g.eta_seconds), fmt.s(g.age_seconds) + " ago"])));
    }
    if (r) {
      const causes = Object.entries(r.lost_by_cause);
      parts.push(el("h2", {}, "Time lost, and why"),
        table("lost-by-cause", ["cause", "seconds"], causes.map(([k, v]) => [k, v.toFixed(1)])));
      const classes = Object.entries(r.failures_by_class);
      parts.push(el("h2", {}, "Failures by class"), classes.length
        ? table("failures-by-class", ["class", "failed tries", "time lost (s)"], classes.map(([k, v]) => [k, v, (r.lost_by_class[k] || 0).toFixed(1)]))
        : el("p", { class: "muted", id: "failures-by-class" }, "No failed try." + (r.group_restarts ? " " + r.group_restarts + " in-try group restart(s)." : "")));
    }
    parts.push(el("h2", {}, "Tries"), table("tries", ["try", "outcome", "class", "host", "steps", "resumed from", "lost (s)", "what the next try changed", "reason"],
      d.tries.map((t) => [t.try, el("td", { class: t.outcome === "success" ? "ok" : t.outcome === "failed" ? "bad" : "" }, t.outcome),
        t.failure_class || "", t.host || "", fmt.n(t.step_reached), t.resumed_step === null ? "scratch" : "step " + t.resumed_step,
        t.lost_seconds.toFixed(1), (t.adaptation_next || []).join("; "), el("td", { class: "reason" }, t.reason || "")])));
    const c = d.checkpoints;
    parts.push(el("h2", {}, "Checkpoints"), el("p", { id: "checkpoints" },
      el("span", { "data-count": c.committed.length, id: "committed" }, c.committed.length + " committed"), ", ",
      el("span", { "data-count": c.verified.length, id: "verified" }, c.verified.length + " verified"), ", ",
      el("span", { "data-count": c.quarantined.length, id: "quarantined", class: c.quarantined.length ? "bad" : "" }, c.quarantined.length + " quarantined"),
      c.quarantined.length ? " (" + c.quarantined.join(", ") + ")" : ""));
    const cv = d.curves;
    const charts = el("div", { class: "charts", id: "charts" });
    const hist = cv.history;
    parts.push(el("h2", {}, "Training curves"), el("p", { class: "muted", id: "curves-note" }, cv.shown + " points for " + cv.points + " logged steps" +
      (hist ? " (before step " + hist.tail_from + ": " + hist.buckets + " spans of " + hist.span + " steps, mean with min and max)" : "") +
      (cv.spikes.length ? "; " + cv.spikes.length + " anomaly(ies) marked" : "") +
      (cv.resumes.length ? "; " + cv.resumes.length + " resume(s) marked" : "")), charts);
    const st = d.step_time;
    if (st) {
      const colors = { data: "#dd6b20", compute: "#2b6cb0", communication: "#805ad5" };
      parts.push(el("h2", {}, "Where step time goes (median of logged steps)"),
        el("div", { class: "bar", id: "step-split" }, Object.entries(st.share).map(([k, v]) => el("span", { style: "width:" + (100 * (v || 0)).toFixed(1) + "%;background:" + colors[k], title: k }))),
        el("p", { class: "legend" }, Object.entries(st.median_seconds).map(([k, v]) => el("span", { "data-part": k }, k + " " + (1000 * v).toFixed(2) + " ms (" + fmt.pct(st.share[k]) + ")"))));
    }
    const w = d.warm_up;
    if (w) {
      parts.push(el("h2", {}, "Cache warm-up"), table("warm-up", ["phase", "files", "fetched", "bytes", "seconds"],
        w.phases.map((ph) => [ph.name, ph.files, ph.downloaded, ph.bytes, ph.seconds.toFixed(3)])),
        el("p", { class: "muted" }, w.pending_phases ? w.pending_phases + " later phase(s) warmed beside training (" + w.planned.slice(w.phases.length).join(", ") + ")" : "all phases warmed before training"));
    }
    const v = d.validation;
    if (v) {
      parts.push(el("h2", {}, "Validation"), el("p", { id: "validation" },
        el("span", { class: v.passed ? "ok" : "bad" }, v.passed ? "passed" : "failed"), " " + v.expectations + " expectations on " + v.rows + " rows",
        v.failures.length ? " (" + v.failures.length + " failed)" : "", v.data_docs ? el("span", {}, " · ", el("a", { href: config.docs, target: "_blank", id: "data-docs" }, "Data Docs")) : ""));
    }
    const m = d.model;
    parts.push(el("h2", {}, "Published model"), m ? el("p", { id: "model" },
      (m.published ? "published " : "kept ") + m.version + ": " + m.metric + " " + Number(m.value).toFixed(4) +
      (m.reason ? " (" + m.reason + ")" : ""), el("br"),
      el("span", { class: "muted" }, "lineage: dataset " + (m.dataset || "?") + ", raw input " + (m.input_fingerprint || "?").slice(0, 12) +
        (m.warm_started_from ? ", warm-started from " + m.warm_started_from : ""))) : el("p", { class: "muted", id: "model" }, "not published (yet)"));
    app.replaceChildren(...parts);
    if (cv.step.length) {
      // Anomalies at their own steps (a step between two logged ones gets a point of its own); a loss
      // spike is orders of magnitude above the curve: a log scale keeps both readable.
      const at = new Map(cv.spikes.map((s) => [s.step, s.loss]));
      const resumed = new Set(cv.resumes);
      const xs = [...new Set([...cv.step, ...cv.spikes.map((s) => s.step), ...cv.resumes])].sort((a, b) => a - b);
      const index = new Map(cv.step.map((s, i) => [s, i]));
      const pick = (values) => xs.map((s) => (index.has(s) ? values[index.get(s)] : null));
      const near = (s) => { // the loss at the logged step nearest to s (binary search: the steps are sorted)
        let lo = 0, hi = cv.step.length - 1;
        while (hi - lo > 1) { const mid = (lo + hi) >> 1; if (cv.step[mid] < s) lo = mid; else hi = mid; }
        const best = [lo, hi].filter((i) => cv.loss[i] !== null).sort((a, b) => Math.abs(cv.step[a] - s) - Math.abs(cv.step[b] - s));
        return best.length ? cv.loss[best[0]] : null;
      };
      const marks = xs.map((s) => (at.has(s) ? (at.get(s) ?? near(s)) : null));
      const resumes = xs.map((s) => (resumed.has(s) ? near(s) : null));
      const band = cv.history ? [{ label: "loss max", values: pick(cv.band.loss.max), color: "#90b4e0", faint: true },
        { label: "loss min", values: pick(cv.band.loss.min), color: "#90b4e0", faint: true }] : [];
      charts.append(chart("loss", xs, [{ label: "loss", values: pick(cv.loss) },
        { label: "anomaly", values: marks, color: "#c0392b", points: true },
        { label: "resume", values: resumes, color: "#d69e2e", points: true }, ...band],
        { log: cv.spikes.some((s) => s.loss !== null), band: band.length ? [4, 5] : null }));
      const gband = cv.history ? [{ label: "max", values: cv.band.grad_norm.max, color: "#9ae6b4", faint: true },
        { label: "min", values: cv.band.grad_norm.min, color: "#9ae6b4", faint: true }] : [];
      charts.append(chart("gradient norm", cv.step, [{ label: "grad norm", values: cv.grad_norm, color: "#2f855a" }, ...gband],
        { band: gband.length ? [2, 3] : null }));
      if (cv.learning_rate.some((x) => x !== null)) charts.append(chart("learning rate", cv.step, [{ label: "lr", values: cv.learning_rate, color: "#805ad5" }]));
      if (cv.loss_scale.some((x) => x !== null)) charts.append(chart("loss scale", cv.step, [{ label: "loss scale", values: cv.loss_scale, color: "#dd6b20" }], { log: true }));
      const vc = d.validation_curve;
      if (vc && vc.epoch.length) charts.append(chart("validation " + vc.metric, vc.epoch, [{ label: vc.metric, values: vc.values, points: true, color: "#2b6cb0" }], { xlabel: "epoch" }));
    } else {
      charts.append(el("p", { class: "muted" }, "No training steps logged yet."));
    }
  }

  function pipelinePage(d) {
    const rows = d.runs.slice().reverse();
    const parts = [el("h1", {}, d.dag_id), el("div", { class: "cards" },
      card(d.total_runs > d.runs.length ? "newest runs of " + d.total_runs : "runs", d.runs.length, "runs-count"), card("effective training time (all runs)", fmt.pct(d.effective_ratio), "ratio"),
      card("mean time between failures", fmt.s(d.mtbf_seconds), "mtbf"))];
    const classes = Object.entries(d.failures_by_class);
    parts.push(el("h2", {}, "Failures by class"), classes.length ? table("failures-by-class", ["class", "failed tries"], classes) : el("p", { class: "muted" }, "No failed try."));
    const charts = el("div", { class: "charts", id: "charts" });
    parts.push(el("h2", {}, "Across runs"), charts);
    parts.push(el("h2", {}, "Runs"), table("runs", ["run", "ratio", "tries", "failures", "wall"], rows.map((r) => [
      el("td", {}, el("a", { href: config.runs.replace("~RUN~", encodeURIComponent(r.run)) }, r.run)),
      r.state === "ok" ? fmt.pct(r.ratio) : r.state || "no attempts", r.tries ?? "", Object.entries(r.failures || {}).map(([k, v]) => k + " " + v).join(", "),
      fmt.s(r.wall_seconds)])));
    app.replaceChildren(...parts);
    const timed = d.runs.filter((r) => r.state === "ok" && r.started);
    if (timed.length) {
      charts.append(chart("effective ratio per run", timed.map((r) => r.started), [{ label: "ratio", values: timed.map((r) => r.ratio), points: true, color: "#2b6cb0" }], { time: true, xlabel: "started" }));
      const names = [...new Set(timed.flatMap((r) => Object.keys(r.failures || {})))];
      const palette = ["#c0392b", "#dd6b20", "#805ad5", "#2f855a", "#b7791f", "#4a5568"];
      if (names.length) charts.append(chart("failures by class over time", timed.map((r) => r.started),
        names.map((n, i) => ({ label: n, values: timed.map((r) => (r.failures || {})[n] || 0), points: true, color: palette[i % palette.length] })), { time: true, xlabel: "started" }));
    }
  }

  function overview(d) {
    app.replaceChildren(el("h1", {}, "Ballast pipelines"), d.pipelines.length
      ? table("pipelines", ["pipeline", "DAG", "storage"], d.pipelines.map((p) => [
        el("td", {}, el("a", { href: config.pipeline.replace("~DAG~", encodeURIComponent(p.dag_id)) }, p.name)), p.dag_id, p.storage]))
      : el("p", { class: "muted" }, "No pipeline you can read."));
  }

  const draw = { run: runPage, pipeline: pipelinePage, overview: overview }[config.kind];
  load(config.api).then((d) => { draw(d); app.dataset.state = "rendered"; })
    .catch((e) => { app.replaceChildren(el("h1", {}, "Training stability"), el("p", { class: "bad", id: "error" }, String(e.message || e))); app.dataset.state = "error"; });
})();
