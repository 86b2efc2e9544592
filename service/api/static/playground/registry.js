// The registry table: GET /v1/skills, one row per skill with its block's state, and an "add" button per row.

import { getJSON } from "./api.js";
import { cell, showError } from "./dom.js";

function seamText(cal) {
  if (!cal) return "-";
  return cal.passed ? String(cal.seam) : `${cal.seam} (whole block)`;
}

function hitsCell(hits) {
  const tiers = Object.entries(hits || {}).sort();
  const total = tiers.reduce((n, [, v]) => n + v, 0);
  const td = cell(String(total));
  td.title = tiers.map(([tier, n]) => `${tier}: ${n}`).join(", ") || "not served by this process yet";
  td.className = "num hits";
  return td;
}

function row(skill, onAdd) {
  const tr = document.createElement("tr");
  tr.dataset.skill = skill.name;
  const add = document.createElement("button");
  add.type = "button";
  add.className = "add";
  add.textContent = "add";
  add.title = `add ${skill.name} to the composer`;
  add.addEventListener("click", () => onAdd(skill));
  const first = document.createElement("td");
  first.append(add);
  const versions = skill.versions.length > 1 ? ` (of ${skill.versions.join(", ")})` : "";
  const cal = skill.calibration;
  const seam = cell(seamText(cal), "seam");
  if (cal) seam.title = `calibrated: first-token cosine >= ${cal.cosine_min} on ${cal.n_probes} probes`;
  tr.append(
    first,
    cell(skill.name, "name"),
    cell(`v${skill.version}${versions}`, "version"),
    cell(String(skill.n_tokens), "num tokens"),
    cell(skill.compiled ? "yes" : "no", "compiled"),
    seam,
    cell(skill.degraded ? "DEGRADED" : "no", skill.degraded ? "degraded bad" : "degraded"),
    hitsCell(skill.hits),
    cell(skill.description || "", "description"),
  );
  return tr;
}

export class Registry {
  constructor(onAdd) {
    this.onAdd = onAdd;
    this.tbody = document.querySelector("#registry tbody");
    this.error = document.getElementById("registry-error");
    this.skills = new Map();
  }

  async load() {
    try {
      const { skills } = await getJSON("/v1/skills");
      this.skills = new Map(skills.map((s) => [s.name, s]));
      this.tbody.replaceChildren(...skills.map((s) => row(s, this.onAdd)));
      if (!skills.length) this.tbody.append(emptyRow());
      showError(this.error, null);
    } catch (err) {
      this.skills = new Map();
      this.tbody.replaceChildren();
      showError(this.error, err);
    }
  }

  // One version of a skill, for a version the listing does not carry (its fields may differ).
  async version(name, version) {
    return getJSON(`/v1/skills/${encodeURIComponent(name)}?version=${version}`);
  }
}

function emptyRow() {
  const tr = document.createElement("tr");
  const td = cell("No skills registered in this namespace.", "muted");
  td.colSpan = 9;
  tr.append(td);
  return tr;
}
