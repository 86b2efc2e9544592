// The composer: which skills, in which order and version, the field values, the conversation; builds the
// /v1/compose body for either mode.

import { button } from "./dom.js";

const $ = (id) => document.getElementById(id);

export class Composer {
  constructor(registry) {
    this.registry = registry;
    this.chosen = []; // [{name, version (null: latest), versions, fields: {name: default}}]
    this.edited = new Map(); // field -> the value typed in its box
    this.list = $("chosen");
    this.fieldsBox = $("fields");
  }

  add(skill) {
    if (this.chosen.some((c) => c.name === skill.name)) return;
    this.chosen.push({ name: skill.name, version: null, versions: skill.versions || [], fields: skill.fields || {} });
    this.render();
  }

  // "name" or "name@3". A name the registry does not list is added as typed: the service says what is wrong.
  addByName(text) {
    const [name, version] = text.trim().split("@");
    if (!name) return;
    const known = this.registry.skills.get(name);
    this.add(known || { name });
    if (version) this.chosen.find((c) => c.name === name).version = Number(version) || version;
    this.render();
  }

  move(i, delta) {
    const j = i + delta;
    if (j < 0 || j >= this.chosen.length) return;
    [this.chosen[i], this.chosen[j]] = [this.chosen[j], this.chosen[i]];
    this.render();
  }

  remove(i) {
    this.chosen.splice(i, 1);
    this.render();
  }

  async pickVersion(item, value) {
    item.version = value ? Number(value) : null;
    const rec = item.version ? await this.registry.version(item.name, item.version).catch(() => null)
      : this.registry.skills.get(item.name);
    if (rec) item.fields = rec.fields || {};
    this.render();
  }

  versionSelect(item) {
    const select = document.createElement("select");
    select.className = "version";
    select.title = `version of ${item.name}`;
    for (const v of [null, ...item.versions]) {
      const opt = new Option(v === null ? "latest" : `v${v}`, v === null ? "" : String(v));
      opt.selected = v === item.version;
      select.append(opt);
    }
    select.addEventListener("change", () => this.pickVersion(item, select.value));
    return select;
  }

  render() {
    this.list.replaceChildren(...this.chosen.map((item, i) => {
      const li = document.createElement("li");
      li.dataset.skill = item.name;
      const name = document.createElement("span");
      name.className = "name";
      name.textContent = item.version && item.versions.length <= 1 ? `${item.name}@${item.version}` : item.name;
      li.append(name);
      if (item.versions.length > 1) li.append(this.versionSelect(item));
      li.append(button("↑", "earlier in the prompt", () => this.move(i, -1)),
        button("↓", "later in the prompt", () => this.move(i, 1)),
        button("×", "remove", () => this.remove(i)));
      return li;
    }));
    $("chosen-empty").hidden = this.chosen.length > 0;
    this.renderFields();
  }

  // The first declaring skill's default per field, in prompt order.
  defaults() {
    const out = new Map();
    for (const item of this.chosen) {
      for (const [field, value] of Object.entries(item.fields)) if (!out.has(field)) out.set(field, value);
    }
    return out;
  }

  renderFields() {
    const defaults = this.defaults();
    if (!defaults.size) {
      const p = document.createElement("p");
      p.className = "muted small";
      p.textContent = "The chosen skills declare no fields.";
      this.fieldsBox.replaceChildren(p);
      return;
    }
    this.fieldsBox.replaceChildren(...[...defaults].map(([field, def]) => {
      const label = document.createElement("label");
      label.className = "field";
      label.textContent = field;
      const input = document.createElement("input");
      input.dataset.field = field;
      input.value = this.edited.has(field) ? this.edited.get(field) : def;
      input.placeholder = def;
      input.title = `default: ${def}`;
      input.addEventListener("input", () => {
        this.edited.set(field, input.value);
        label.classList.toggle("changed", input.value !== def);
      });
      label.classList.toggle("changed", input.value !== def);
      label.append(input);
      return label;
    }));
  }

  body(mode) {
    const defaults = this.defaults();
    const fields = {};
    for (const [field, def] of defaults) {
      const value = this.edited.get(field);
      if (value !== undefined && value !== def) fields[field] = value;
    }
    const body = {
      skills: this.chosen.map((c) => (c.version ? { name: c.name, version: c.version } : c.name)),
      user: $("user").value,
      max_tokens: Number($("max-tokens").value) || 48,
      mode,
      edit_mode: $("edit-mode").value,
    };
    if (Object.keys(fields).length) body.fields = fields;
    const system = $("system").value.trim();
    if (system) body.system = system;
    return body;
  }
}
