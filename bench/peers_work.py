"""The workload of bench/peers.py: token-identical prompts for both engines, requests on either one, and the
skillcache service under test."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
from load import _bounded, load_skill, one as skillcache_one, register
from peers_llama import llama_one
from peers_run import Peer

from service.devserver import ServiceProcess, caller_home
from service.registry.skill import render

SKILLS = ["refund-policy", "tool-specs", "style-guide"]
TURNS = [
    "Order A-10482 arrived two days ago and the customer wants a refund because they changed their mind.",
    "Which tool do I call to look up the status of order A-20931, and with which arguments?",
    "A gold-tier customer asks whether opened headphones can be returned. Answer in our house style.",
    "The parcel for order A-33017 is marked lost by the carrier. What do I tell the customer?",
    "Summarise in two sentences what I may and may not promise a customer about refunds.",
]
PRIME_TURNS = ["Hello, I have a question about my order.", "Can you help me with a return?"]
LONG_TURNS = ["Write a detailed, step-by-step guide for a new support agent on handling refund requests.",
              "Explain every tool you can call, one paragraph each, with an example call for each.",
              "Draft a long, friendly email that explains our whole return policy to a customer."]
SHORT_TURNS = ["Is a refund possible for an order that was never shipped?", "What is our tone of voice, in one line?",
               "Can a customer return a gift without the receipt?", "Which tool cancels an order?",
               "How long does a refund take to arrive?", "May I offer a discount code to an angry customer?"]
WARM_TURN = "Good morning."


class Prompts:
    """Token ids exactly as skillcache builds them: the chat template, the skills joined in the system turn."""

    def __init__(self, skills: list[str], model: str = "embedded", chat_template: str | None = None) -> None:
        from transformers import AutoTokenizer

        from service.runtime.gguf import convert_gguf
        from service.runtime.loader import gguf_source
        from service.runtime.prompt import PromptBuilder

        models = Path(os.environ.get("SKILLCACHE_MODEL_CACHE") or caller_home() / "models")
        converted = convert_gguf(gguf_source(model), models, caller_home() / "fingerprints.json")
        tokenizer = AutoTokenizer.from_pretrained(converted)
        if chat_template:  # as the service sets it (SKILLCACHE_CHAT_TEMPLATE: a built-in name)
            from service.runtime.templates import BUILTIN_TEMPLATES

            tokenizer.chat_template = BUILTIN_TEMPLATES[chat_template][0]
        self.builder = PromptBuilder(tokenizer)
        specs = {n: load_skill(n) for n in skills}
        self.skill_ids = {n: self.builder.encode_content(render(s["text"], s["fields"])) for n, s in specs.items()}

    def ids(self, order: tuple[str, ...], user: str) -> list[int]:
        return self.builder.build([{"role": "user", "content": user}], [self.skill_ids[n] for n in order]).ids


async def send(peer: Peer, prompts: Prompts, spec: tuple, deadline: float, t_sched: float | None = None,
               cache_prompt: bool = True, first_token: asyncio.Event | None = None) -> dict:
    """One streamed request, spec = (order, user, max_tokens), on either engine; one record shape for both.
    first_token: set when its first token arrives."""
    order, user, n = spec
    ids = prompts.ids(order, user)
    t_sched = t_sched if t_sched is not None else time.perf_counter()
    if peer.engine == "llama.cpp":
        coro = llama_one(peer.client, ids, n, t_sched, cache_prompt, first_token)
    else:
        body = {"skills": list(order), "user": user, "max_tokens": n, "temperature": 0.0, "stream": True}
        coro = skillcache_one(peer.client, body, None, t_sched, first_token)
    rec = await _bounded(coro, deadline) or {"error": "deadline"}
    rec.update(engine=peer.engine, order=list(order), user=user, t_sched=t_sched, n_ids=len(ids))
    if peer.engine == "llama.cpp":
        rec["prompt_computed"] = rec.get("prompt_n")
    elif rec.get("usage"):
        u = rec["usage"]
        rec.update(prompt_tokens=u["prompt_tokens"], completion_tokens=u["completion_tokens"],
                   prefix_tokens=u.get("prefix_tokens", 0), prompt_computed=u["prompt_tokens"] - u["reused_tokens"])
        if rec["error"] is None and u["prompt_tokens"] != len(ids):
            rec["error"] = f"prompt_mismatch: rendered {len(ids)} ids, skillcache built {u['prompt_tokens']}"
    return rec


async def one_by_one(peer, prompts, specs, deadline, **kw) -> list[dict]:
    return [await send(peer, prompts, s, deadline, **kw) for s in specs]


async def all_at_once(peer, prompts, specs, deadline) -> tuple[list[dict], float | None]:
    t0 = time.perf_counter()
    recs = await asyncio.gather(*(send(peer, prompts, s, deadline, t_sched=t0) for s in specs))
    ends = [t0 + r["e2e_s"] for r in recs if r.get("e2e_s") is not None]
    return list(recs), (max(ends) - t0) if ends else None


async def short_during_long(peer, prompts, long_spec, short_spec, delay_s, deadline) -> tuple[dict, dict]:
    """The short request is sent delay_s after the long one's first token; it counts only if the long one was
    still decoding then."""
    t0 = time.perf_counter()
    first = asyncio.Event()
    long_task = asyncio.create_task(send(peer, prompts, long_spec, deadline, t_sched=t0, first_token=first))
    waiter = asyncio.create_task(first.wait())
    await asyncio.wait([waiter, long_task], return_when=asyncio.FIRST_COMPLETED)  # the first token, or no stream
    waiter.cancel()
    await asyncio.sleep(delay_s)
    t1 = time.perf_counter()
    short = await send(peer, prompts, short_spec, deadline, t_sched=t1)
    long = await long_task
    decoding = long.get("ttft_s") is not None and long.get("e2e_s") is not None and \
        t0 + long["ttft_s"] < t1 < t0 + long["e2e_s"]
    if short["error"] is None and not decoding:
        short["error"] = "no_overlap: the long request was not decoding when the short one was sent"
    short["sent_after_long_s"] = t1 - t0
    return short, long


def start_service(home: Path, threads: int, refine: bool, extra_env: list[str]) -> ServiceProcess:
    env = {"SKILLCACHE_SKILLS_DIR": str(home / "skills"), "SKILLCACHE_TORCH_THREADS": str(threads)}
    if not refine:
        env["SKILLCACHE_REFINE_AFTER"] = "0"
    env.update(kv.split("=", 1) for kv in extra_env)
    svc = ServiceProcess(home, env, name=f"skillcache (refinement {'on' if refine else 'off'})", threads=threads)
    print(f"starting {svc.name} on {svc.url}", flush=True)
    return svc.start()


async def skillcache_peer(args, svc: ServiceProcess | None, prompts: Prompts, client, meta: dict) -> Peer:
    """The started (or --url) service once ready, its skills checked against the rendering here."""
    url = svc.url if svc is not None else args.url.rstrip("/")
    c = client(url)
    t0 = time.monotonic()
    while svc is not None and (await _ready(c)) is False:  # polled here, so Ctrl-C or TERM cancel the wait
        if svc.proc.poll() is not None or time.monotonic() - t0 > 600:
            raise SystemExit(f"{svc.name} did not get ready\n{svc.log_tail()}")
        await asyncio.sleep(0.2)
    meta.setdefault("skillcache", []).append({k: v for k, v in (await c.get("/readyz")).json().items()
                                              if k in ("model", "model_fingerprint", "skills_preloaded")})
    if svc is None:
        with httpx.Client(base_url=url, timeout=600) as sync:
            for name in SKILLS:
                register(sync, load_skill(name))
    for name in SKILLS:  # the service's own token count of each skill
        n = (await c.get(f"/v1/skills/{name}")).json()["n_tokens"]
        if n != len(prompts.skill_ids[name]):
            raise SystemExit(f"{name}: skillcache counts {n} tokens, the rendering here {len(prompts.skill_ids[name])}")
    return Peer("skillcache", c, svc.proc.pid if svc is not None else None)


async def _ready(c: httpx.AsyncClient) -> bool:
    try:
        return (await c.get("/readyz")).status_code == 200
    except httpx.TransportError:
        return False
