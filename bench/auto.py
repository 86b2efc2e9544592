"""Automatic reuse for prompts that name no skills (issue 41): a repeated system prompt through every API, against a
registered-skill composition of the same text, and the cost when nothing repeats.

    python bench/auto.py --json bench/out/auto.json          # ~3 min on 2 cores, embedded model

Two embedded services side by side, started once: SKILLCACHE_AUTO_REUSE on and off (refinement, seam calibration
and shadow checks off on both: no background work on the clock). The system prompt is the bodies of the shipped
skills joined (--skills; ~2.2k tokens with the defaults, their fields at their defaults), named nowhere.
  repeat    per API (/v1/compose `system`, /v1/chat/completions, /v1/responses `instructions`, /v1/messages
            `system`): the system prompt with a first user turn, then --turns new user turns. Reported: the share of
            the system prompt's tokens each repeat reports cached (compose: prefix_tokens; chat and responses:
            cached_tokens; messages: cache_read_input_tokens) and its first-token time (the service's own
            ttft_ms), against the same text registered as a skill and named in /v1/compose on the service with
            automatic reuse off (composed from the skill's block: the registered path), with like user turns.
  distinct  --distinct prompts that never repeat (a nonce opens each system prompt), sent alternately to the
            service with automatic reuse on and the one with it off: first-token p50 on / off.
Greedy, one output token, non-streamed; the ttft_ms each response reports (queue, store, prefill).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import write_json  # first: puts this checkout ahead of any installed copy on sys.path
import httpx
from load import load_skill, register, render

from service.devserver import ServiceProcess

SKILLS = ["refund-policy", "tool-specs", "style-guide"]
TURNS = ["Can I return a blender I bought {i} days ago?", "How long does a refund take for order A-{i}?",
         "My parcel {i} never arrived. What now?", "Can I exchange item {i} for another colour?",
         "Is the return shipping free for order B-{i}?", "Who pays for a damaged item, case {i}?"]


def system_text(names: list[str]) -> str:
    parts = [load_skill(n) for n in names]
    return "\n\n".join(render(p["text"], p["fields"]) for p in parts)


def ask(c: httpx.Client, api: str, system: str, user: str) -> tuple[float, int]:
    """(ttft_ms, tokens reported cached) of one request through `api`, greedy, one output token."""
    if api == "compose":
        d = post(c, "/v1/compose", {"system": system, "user": user, "max_tokens": 1})
        return d["timings"]["ttft_ms"], d["usage"]["reused_tokens"]
    if api == "registered":
        d = post(c, "/v1/compose", {"skills": ["auto-bench-policy"], "user": user, "max_tokens": 1})
        return d["timings"]["ttft_ms"], d["usage"]["reused_tokens"]
    if api == "chat":
        d = post(c, "/v1/chat/completions", {"model": "x", "max_tokens": 1, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": user}]})
        return d["skillcache"]["timings"]["ttft_ms"], d["usage"]["prompt_tokens_details"]["cached_tokens"]
    if api == "responses":
        d = post(c, "/v1/responses", {"model": "x", "instructions": system, "input": user, "max_output_tokens": 1})
        return d["skillcache"]["timings"]["ttft_ms"], d["usage"]["input_tokens_details"]["cached_tokens"]
    d = post(c, "/v1/messages", {"model": "x", "max_tokens": 1, "system": system,
                                 "messages": [{"role": "user", "content": user}]})
    return d["skillcache"]["timings"]["ttft_ms"], d["usage"]["cache_read_input_tokens"]


def post(c: httpx.Client, path: str, body: dict) -> dict:
    r = c.post(path, json={**body, "temperature": 0.0})
    if r.status_code != 200:
        raise SystemExit(f"{path}: HTTP {r.status_code} {r.text[:400]}")
    return r.json()


def n_tokens(c: httpx.Client, text: str) -> int:
    return register(c, {"name": "auto-bench-policy", "text": text})["n_tokens"]


def repeat_arm(on: httpx.Client, off: httpx.Client, system: str, n_system: int, turns: int) -> dict:
    """Each API on the service with automatic reuse on; the registered skill on the one with it off (the registered
    path alone: composed from the skill's block)."""
    out = {}
    for k, api in enumerate(["registered", "compose", "chat", "responses", "messages"]):
        c = off if api == "registered" else on
        salt = f"{api} {k}"  # each API its own user turns: nothing of one API's prompts is another's
        ask(c, api, system, TURNS[0].format(i=salt))  # first sight (not measured)
        rows = [ask(c, api, system, TURNS[1 + j % (len(TURNS) - 1)].format(i=f"{salt}-{j}")) for j in range(turns)]
        ttfts, cached = [r[0] for r in rows], [r[1] for r in rows]
        out[api] = {"ttft_ms_p50": statistics.median(ttfts), "ttft_ms": ttfts, "cached": cached,
                    "cached_share_min": min(cached) / n_system}
        print(f"repeat {api:10s}: ttft p50 {out[api]['ttft_ms_p50']:7.1f} ms, cached {min(cached)}-{max(cached)} "
              f"of the system prompt's {n_system} tokens ({100 * min(cached) / n_system:.0f}% at least)", flush=True)
    reg = out["registered"]["ttft_ms_p50"]
    for api in ("compose", "chat", "responses", "messages"):
        out[api]["ttft_over_registered"] = out[api]["ttft_ms_p50"] / reg
    return out


def distinct_arm(on: httpx.Client, off: httpx.Client, system: str, n: int) -> dict:
    t = {"on": [], "off": []}
    for i in range(n):
        nonce = f"Session {time.time_ns()} {i}.\n\n"  # opens the prompt: no head of it was ever seen
        for name, c in (("on", on), ("off", off)) if i % 2 == 0 else (("off", off), ("on", on)):
            t[name].append(ask(c, "chat", nonce + system, TURNS[i % len(TURNS)].format(i=i))[0])
    p50 = {k: statistics.median(v) for k, v in t.items()}
    print(f"distinct: ttft p50 on {p50['on']:.1f} ms, off {p50['off']:.1f} ms: on / off {p50['on'] / p50['off']:.3f}",
          flush=True)
    return {"ttft_ms": t, "p50_on": p50["on"], "p50_off": p50["off"], "on_over_off": p50["on"] / p50["off"]}


def service(auto: bool, threads: int) -> ServiceProcess:
    env = {"SKILLCACHE_SKILLS_DIR": "", "SKILLCACHE_AUTO_REUSE": str(auto).lower(), "SKILLCACHE_REFINE_AFTER": "0",
           "SKILLCACHE_SEAM_AUTO": "false", "SKILLCACHE_SHADOW_SAMPLE_RATE": "0",
           "SKILLCACHE_TORCH_THREADS": str(threads)}
    return ServiceProcess(Path(tempfile.mkdtemp(prefix="skillcache-auto-")), env, name=f"auto-{auto}",
                          threads=threads).start()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skills", nargs="+", default=SKILLS, help="shipped skills whose bodies make the system prompt")
    ap.add_argument("--turns", type=int, default=5, help="repeats per API after the first sight")
    ap.add_argument("--distinct", type=int, default=8, help="never-repeating prompts per service")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per service (two run side by side)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    system = system_text(args.skills)
    t0 = time.perf_counter()
    svcs = [service(True, args.threads), service(False, args.threads)]
    try:
        for s in svcs:
            s.wait_ready(900)
        with httpx.Client(base_url=svcs[0].url, timeout=900) as on, httpx.Client(base_url=svcs[1].url,
                                                                                timeout=900) as off:
            n_system = n_tokens(on, system)
            n_tokens(off, system)
            print(f"system prompt: {n_system} tokens ({', '.join(args.skills)})", flush=True)
            out = {"n_system_tokens": n_system, "args": vars(args), "repeat": repeat_arm(on, off, system, n_system,
                                                                                         args.turns)}
            out["distinct"] = distinct_arm(on, off, system, args.distinct)
    finally:
        for s in svcs:
            s.stop()
    out["elapsed_s"] = time.perf_counter() - t0
    print("\n| API | repeat TTFT p50 (ms) | over registered | cached of the system prompt (min) |")
    print("|---|---:|---:|---:|")
    for api, r in out["repeat"].items():
        over = r.get("ttft_over_registered")
        print(f"| {api} | {r['ttft_ms_p50']:.1f} | {'-' if over is None else f'{over:.2f}x'} | "
              f"{100 * r['cached_share_min']:.0f}% |")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
