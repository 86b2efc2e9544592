// Wires the playground together: readiness and model, the API key, the registry, the composer, the runs.

import { apiKey, setApiKey } from "./api.js";
import { Composer } from "./composer.js";
import { Registry } from "./registry.js";
import { Runs } from "./runs.js";

const $ = (id) => document.getElementById(id);

function notReadyReason(r) {
  if (r.error) return r.error;
  if (!r.model_loaded) return "the model is loading";
  if (r.selfcheck && !r.selfcheck.ok) return "the start-up self-check failed (see /readyz)";
  if (!r.selfcheck) return "running the start-up self-check";
  if (r.definitions !== "ok") return `the skill definitions store is ${r.definitions}`;
  return "registering and compiling the shipped skills";
}

async function showReadiness() {
  const box = $("ready");
  try {
    const resp = await fetch("/readyz");
    const r = await resp.json();
    const tmpl = r.chat_template && r.chat_template.plain_text_fallback ? ", no chat template: plain text" : "";
    box.textContent = r.status === "ready"
      ? `ready: ${r.model} (fingerprint ${r.model_fingerprint}${tmpl})` : `not ready: ${notReadyReason(r)}`;
    box.className = r.status === "ready" ? "muted" : "error";
    return r.status === "ready";
  } catch (err) {
    box.textContent = `the service does not answer: ${err.message}`;
    box.className = "error";
    return false;
  }
}

function showKeyState() {
  $("key-state").textContent = apiKey() ? "a key is set for this tab" : "no key set";
}

async function main() {
  const registry = new Registry((skill) => composer.add(skill));
  const composer = new Composer(registry);
  const runs = new Runs();
  const refresh = () => registry.load();

  $("key").value = apiKey();
  showKeyState();
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    setApiKey($("key").value.trim());
    showKeyState();
    refresh();
  });
  $("forget-key").addEventListener("click", () => {
    setApiKey("");
    $("key").value = "";
    showKeyState();
    refresh();
  });
  $("refresh").addEventListener("click", refresh);
  $("add-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    composer.addByName($("add-name").value);
    $("add-name").value = "";
  });
  const bodyFor = (mode) => composer.body(mode);
  $("run-both").addEventListener("click", () => runs.run(["compose", "full"], bodyFor, refresh));
  $("run-compose").addEventListener("click", () => runs.run(["compose"], bodyFor, refresh));
  $("run-full").addEventListener("click", () => runs.run(["full"], bodyFor, refresh));

  composer.render();
  let ready = await showReadiness();
  await refresh(); // while not ready, this shows the service's not_ready error
  document.body.dataset.loaded = "1";
  while (!ready) { // the model is loading: look again every 2 s, and list the skills once it is ready
    await new Promise((resolve) => setTimeout(resolve, 2000));
    ready = await showReadiness();
    if (ready) await refresh();
  }
}

main();
