// One result panel per mode: the reply as it streams, then what the done event reports (timings, where the
// prompt's tokens came from, each skill's path and seam, the erratum lines), or the service's typed error.

import { streamCompose } from "./api.js";
import { count, fillList, ms, showError } from "./dom.js";

function skillLine(s) {
  const seam = s.seam === null || s.seam === undefined ? "" : `, seam ${s.seam}`;
  return `${s.name} v${s.version}: ${s.path} (block from ${s.source}${seam})`;
}

function errataLines(edits) {
  const lines = [];
  for (const e of edits || []) {
    for (const line of e.lines || []) lines.push(line);
    if (e.fallback) lines.push(`(${e.skill}: ${e.requested} -> ${e.mode}: ${e.fallback})`);
    if (!e.lines && !e.fallback) lines.push(`${e.skill}: ${e.mode} on ${(e.fields || []).join(", ")}, no erratum line`);
  }
  return lines;
}

export class RunPanel {
  constructor(article) {
    this.article = article;
    this.mode = article.dataset.mode;
    this.status = article.querySelector(".status");
    article.append(document.getElementById("panel-body").content.cloneNode(true));
    this.q = (sel) => article.querySelector(sel);
  }

  reset() {
    this.article.dataset.state = "running";
    this.status.textContent = "streaming ...";
    this.q(".text").textContent = "";
    showError(this.q(".error"), null);
    for (const sel of [".first-token", ".ttft", ".prompt", ".reused", ".recomputed", ".completion", ".events"]) {
      this.q(sel).textContent = "";
    }
    fillList(this.q(".skills"), [], "-");
    fillList(this.q(".errata"), [], "-");
  }

  async run(body) {
    this.reset();
    this.result = null;
    const text = this.q(".text");
    try {
      const result = await streamCompose(body, (piece) => { text.textContent += piece; });
      this.show(result);
      this.result = result;
      this.article.dataset.state = "done";
      this.status.textContent = "done";
    } catch (err) {
      showError(this.q(".error"), err);
      this.article.dataset.state = "error";
      this.status.textContent = "error";
    }
  }

  show({ done, firstMs, totalMs, deltas }) {
    const u = done.usage;
    const t = done.timings;
    this.q(".first-token").textContent = `${ms(firstMs)} (to the first text, total ${ms(totalMs)})`;
    this.q(".ttft").textContent = `${ms(t.ttft_ms)} / ${ms(t.total_ms)}`;
    this.q(".prompt").textContent = count(u.prompt_tokens);
    this.q(".reused").textContent = `${count(u.composed_tokens)} / ${count(u.prefix_tokens)}`;
    this.q(".recomputed").textContent = count(u.recomputed_tokens);
    this.q(".completion").textContent = `${count(u.completion_tokens)} / ${done.finish_reason}`;
    this.q(".events").textContent = `${deltas} text events`;
    this.q(".events").dataset.deltas = String(deltas);
    this.article.classList.toggle("exact-prefix", u.prefix_tokens > 0);
    fillList(this.q(".skills"), done.skills.map(skillLine), "no skills");
    fillList(this.q(".errata"), errataLines(done.edits), "none");
  }
}

// Compose and full, one after the other (never at once: each would wait on the other's prefill chunks).
export class Runs {
  constructor() {
    this.panels = {
      compose: new RunPanel(document.getElementById("panel-compose")),
      full: new RunPanel(document.getElementById("panel-full")),
    };
    this.busy = false;
    this.summary = document.getElementById("comparison");
  }

  // After both modes ran on the same prompt: how much sooner the composed reply started, and what it reused.
  compare() {
    const comp = this.panels.compose.result;
    const full = this.panels.full.result;
    if (!comp || !full) return;
    const c = comp.done;
    const ratio = full.done.timings.ttft_ms / Math.max(c.timings.ttft_ms, 1e-3);
    const reused = c.usage.composed_tokens + c.usage.prefix_tokens;
    this.summary.textContent = `First token ${ratio.toFixed(1)}x sooner composed (${ms(c.timings.ttft_ms)} vs `
      + `${ms(full.done.timings.ttft_ms)} in full): ${count(reused)} of ${count(c.usage.prompt_tokens)} prompt `
      + `tokens reused, ${count(c.usage.recomputed_tokens)} computed.`;
    this.summary.hidden = false;
  }

  async run(modes, bodyFor, after) {
    if (this.busy) return;
    this.busy = true;
    document.body.classList.add("busy");
    this.summary.hidden = true;
    try {
      for (const mode of modes) await this.panels[mode].run(bodyFor(mode));
      if (modes.length === 2) this.compare();
    } finally {
      this.busy = false;
      document.body.classList.remove("busy");
      await after();
    }
  }
}
