"""Automatic reuse for prompts that name no skills (issue 41): a repeated system prompt through every API, against a
registered-skill composition of the same text; its sections moved (another order, after another preamble), against
the same sections registered; and the cost when nothing repeats.

    python bench/auto.py --json bench/out/auto.json          # ~8 min on 2 cores, embedded model

Two embedded services side by side, started once: SKILLCACHE_AUTO_REUSE on and off (refinement, seam calibration
and shadow checks off on both: no background work on the clock but the sections' compiles). The system prompt is
the bodies of the shipped skills joined (--skills; ~2.2k tokens with the defaults, their fields at their defaults),
named nowhere. Each body opens with its top-level heading ("# SKILL: ..."), so with automatic reuse on each is a
section of its own (service/compose/sections.py): compiled in the background on first sight, composed wherever it
stands afterwards. The service with automatic reuse off has no sections.
  repeat    per API (/v1/compose `system`, /v1/chat/completions, /v1/responses `instructions`, /v1/messages
            `system`): the system prompt with a first user turn, then --turns new user turns. Reported: the share of
            the system prompt's tokens each repeat reports cached (compose: prefix_tokens; chat and responses:
            cached_tokens; messages: cache_read_input_tokens) and its first-token time (the service's own
            ttft_ms), against the same text registered as a skill and named in /v1/compose on the service with
            automatic reuse off (composed from the skill's block: the registered path), with like user turns.
  moved     the sections (the skills' bodies) moved. auto: on the service with automatic reuse on, the sections in
            their order once (first sight, not measured), then a wait (/metrics, at most 300 s) until
            skillcache_auto_blocks_total{outcome="compiled"} has grown by the sections not held yet (those the
            repeat arm's prompts had compiled are held already); then the arrangements: the sections rotated by 1,
            2, 3 places (as many as there are other first sections, at most 3), and in their order after each of
            two new preambles ("You are the support agent of Shop {k}. Be brief."), each as /v1/compose `system`
            with --moved-turns user turns, each turn composed and then the same body with mode=full (all the
            arrangement's composed turns first: a mode=full prompt is kept whole as an automatic head, which would
            serve the next composed turn exactly; each arrangement opens with another section or preamble, so no
            arrangement's head serves another's). registered: on the service with automatic reuse off, each
            section registered as a skill (moved-0, moved-1, ...) and named in /v1/compose `skills` in the same
            orders; a preamble registered too (registered skills lead the system turn, before any system text)
            and named first, so it opens the system turn as on the auto side (there it is text, exact as the first
            block is); the same turns, composed and in full.
            Reported per side: the cases whose first generated token (greedy, max_tokens=1: the response text) is
            the one mode=full gives, over all cases; the composed share (usage.composed_tokens / the sections'
            tokens) min and mean; first-token p50 of the composed requests.
  distinct  --distinct prompts in which nothing repeats, not even a section (a line "Session <nonce> <j>." after
            each section's heading: every section is new, and on the service with automatic reuse on each is
            compiled in the background for nothing, the worst case of a never-repeating stream), sent alternately
            to the service with automatic reuse on and the one with it off: first-token p50 and p90 (nearest rank)
            on / off.
Greedy, one output token, non-streamed; the ttft_ms each response reports (queue, store, prefill).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

from common import write_json  # first: puts this checkout ahead of any installed copy on sys.path
import httpx
from prometheus_client.parser import text_string_to_metric_families
from load import load_skill, register, render

from service.devserver import ServiceProcess

SKILLS = ["refund-policy", "tool-specs", "style-guide"]
TURNS = ["Can I return a blender I bought {i} days ago?", "How long does a refund take for order A-{i}?",
         "My parcel {i} never arrived. What now?", "Can I exchange item {i} for another colour?",
         "Is the return shipping free for order B-{i}?", "Who pays for a damaged item, case {i}?"]
PREAMBLE = "You are the support agent of Shop {k}. Be brief."


def sections_of(names: list[str]) -> list[str]:
    """The skills' rendered bodies, each opening with its heading ("# SKILL: ..."): the system prompt's sections."""
    parts = [load_skill(n) for n in names]
    return [render(p["text"], p["fields"]) for p in parts]


def system_text(names: list[str]) -> str:
    return "\n\n".join(sections_of(names))


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


def compiled(c: httpx.Client) -> float:
    """skillcache_auto_blocks_total{outcome="compiled"} from /metrics: the sections compiled since the start."""
    samples = (s for f in text_string_to_metric_families(c.get("/metrics").text) for s in f.samples)
    return sum(s.value for s in samples if s.name == "skillcache_auto_blocks_total"
               and s.labels.get("outcome") == "compiled")


def wait_compiled(c: httpx.Client, target: float, timeout_s: float) -> None:
    t0 = time.perf_counter()
    while (n := compiled(c)) < target:
        if time.perf_counter() - t0 > timeout_s:
            raise SystemExit(f"moved: {n:.0f} sections compiled after {timeout_s:.0f} s, waiting for {target:.0f}")
        time.sleep(1)


def arrangements(n: int) -> list[tuple[str, list[int], str | None]]:
    """(label, the sections' order, a preamble or None): rotated by 1, 2, 3 places (at most), then in their order
    after each of two new preambles. Each opens with another section or preamble."""
    out = [(f"rotated {k}", list(range(k, n)) + list(range(k)), None) for k in range(1, min(n, 4))]
    return out + [(f"after preamble {k}", list(range(n)), PREAMBLE.format(k=k)) for k in (1, 2)]


def arranged(c: httpx.Client, body: dict, turns: list[str]) -> list[dict]:
    """Each turn composed, then each in full (the composed ones first: a mode=full prompt is kept whole as an
    automatic head, which would serve a later composed turn exactly)."""
    comp = [post(c, "/v1/compose", {**body, "user": u, "max_tokens": 1}) for u in turns]
    full = [post(c, "/v1/compose", {**body, "user": u, "max_tokens": 1, "mode": "full"}) for u in turns]
    return [{"text": a["text"], "full_text": b["text"], "agree": a["text"] == b["text"],
             "composed_tokens": a["usage"]["composed_tokens"], "prefix_tokens": a["usage"]["prefix_tokens"],
             "blocks": [u["name"] for u in a["skills"] if u["path"] == "compose"],
             "ttft_ms": a["timings"]["ttft_ms"], "full_ttft_ms": b["timings"]["ttft_ms"]} for a, b in zip(comp, full)]


def moved_side(side: str, rows: list[dict], n_sections: int) -> dict:
    shares = [r["composed_tokens"] / n_sections for r in rows]
    cached = [(r["composed_tokens"] + r["prefix_tokens"]) / n_sections for r in rows]  # composed, or an exact head
    kinds = {k: [r["agree"] for r in rows if r["arrangement"].startswith(k)] for k in ("rotated", "after preamble")}
    out = {"agree": sum(r["agree"] for r in rows), "cases": len(rows), "composed_share_min": min(shares),
           "composed_share_mean": statistics.mean(shares), "cached_share_min": min(cached),
           "agree_by_kind": {k: [sum(v), len(v)] for k, v in kinds.items()},
           "ttft_ms_p50": statistics.median(r["ttft_ms"] for r in rows),
           "full_ttft_ms_p50": statistics.median(r["full_ttft_ms"] for r in rows), "rows": rows}
    by_kind = ", ".join(f"{k} {a}/{n}" for k, (a, n) in out["agree_by_kind"].items())
    print(f"moved {side:10s}: first token agrees with mode=full in {out['agree']}/{out['cases']} ({by_kind}), "
          f"composed {100 * out['composed_share_min']:.0f}% min / {100 * out['composed_share_mean']:.0f}% mean of the "
          f"sections' {n_sections} tokens (cached, composed or an exact head: {100 * out['cached_share_min']:.0f}% "
          f"min), ttft p50 {out['ttft_ms_p50']:.1f} ms (full {out['full_ttft_ms_p50']:.1f})", flush=True)
    return out


def moved_arm(on: httpx.Client, off: httpx.Client, sections: list[str], turns: int) -> dict:
    """The sections moved: composed automatically on the service with automatic reuse on, registered and named on
    the one with it off; each against the same body in mode=full."""
    names = [f"moved-{i}" for i in range(len(sections))]
    counts = [register(off, {"name": n, "text": t})["n_tokens"] for n, t in zip(names, sections)]
    before = compiled(on)
    first = post(on, "/v1/compose", {"system": "\n\n".join(sections), "user": TURNS[0].format(i="moved"),
                                     "max_tokens": 1})  # first sight (not measured)
    held = sum(u["name"].startswith("block-") for u in first["skills"])
    wait_compiled(on, before + len(sections) - held, 300)
    print(f"moved: {len(sections)} sections ({', '.join(map(str, counts))} tokens) compiled ({held} of them before "
          f"their first sight here: the repeat arm's prompts had them)", flush=True)
    rows: dict[str, list[dict]] = {"auto": [], "registered": []}
    plan = arrangements(len(sections))
    for a, (label, order, preamble) in enumerate(plan):
        us = [TURNS[1 + (a + j) % (len(TURNS) - 1)].format(i=f"moved {a}-{j}") for j in range(turns)]
        auto_system = "\n\n".join(([preamble] if preamble else []) + [sections[i] for i in order])
        lead = []
        if preamble:  # registered too, and named first: it opens the system turn as on the auto side
            lead = [f"moved-preamble-{a}"]
            register(off, {"name": lead[0], "text": preamble})
        reg = {"skills": lead + [names[i] for i in order]}
        for side, c, body in (("auto", on, {"system": auto_system}), ("registered", off, reg)):
            rows[side] += [{"arrangement": label, **r} for r in arranged(c, body, us)]
    out = {"section_tokens": counts, "held_before": held, "arrangements": [p[0] for p in plan]}
    return out | {side: moved_side(side, r, sum(counts)) for side, r in rows.items()}


def stamped(sections: list[str], nonce: str) -> str:
    """The sections, each with a line "Session <nonce> <j>." after its heading: no section was ever seen."""
    out = []
    for j, sec in enumerate(sections):
        head, _, rest = sec.partition("\n")
        out.append(f"{head}\nSession {nonce} {j}.\n{rest}")
    return "\n\n".join(out)


def nearest_rank(v: list[float], q: float) -> float:
    return sorted(v)[max(0, math.ceil(q * len(v)) - 1)]


def distinct_arm(on: httpx.Client, off: httpx.Client, sections: list[str], n: int) -> dict:
    t = {"on": [], "off": []}
    for i in range(n):
        system = stamped(sections, f"{time.time_ns()}-{i}")
        for name, c in (("on", on), ("off", off)) if i % 2 == 0 else (("off", off), ("on", on)):
            t[name].append(ask(c, "chat", system, TURNS[i % len(TURNS)].format(i=i))[0])
    p50 = {k: statistics.median(v) for k, v in t.items()}
    p90 = {k: nearest_rank(v, 0.9) for k, v in t.items()}
    print(f"distinct: ttft p50 on {p50['on']:.1f} ms, off {p50['off']:.1f} ms: on / off {p50['on'] / p50['off']:.3f}; "
          f"p90 on {p90['on']:.1f} ms, off {p90['off']:.1f} ms: on / off {p90['on'] / p90['off']:.3f}", flush=True)
    return {"ttft_ms": t, "p50_on": p50["on"], "p50_off": p50["off"], "on_over_off": p50["on"] / p50["off"],
            "p90_on": p90["on"], "p90_off": p90["off"], "p90_on_over_off": p90["on"] / p90["off"]}


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
    ap.add_argument("--moved-turns", type=int, default=3, help="user turns per arrangement of the moved arm")
    ap.add_argument("--distinct", type=int, default=12, help="never-repeating prompts per service")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per service (two run side by side)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sections = sections_of(args.skills)
    if len(sections) < 2:
        raise SystemExit("--skills: the moved arm needs at least two sections (skills)")
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
            out["moved"] = moved_arm(on, off, sections, args.moved_turns)
            out["distinct"] = distinct_arm(on, off, sections, args.distinct)
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
    print("\n| moved sections | first token as mode=full | rotated | after a preamble | composed of the sections "
          "(min / mean) | cached (min) | TTFT p50 (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for side in ("auto", "registered"):
        r = out["moved"][side]
        kinds = " | ".join(f"{a}/{n}" for a, n in r["agree_by_kind"].values())
        print(f"| {side} | {r['agree']}/{r['cases']} | {kinds} | {100 * r['composed_share_min']:.0f}% / "
              f"{100 * r['composed_share_mean']:.0f}% | {100 * r['cached_share_min']:.0f}% | {r['ttft_ms_p50']:.1f} |")
    d = out["distinct"]
    print("\n| distinct | on (ms) | off (ms) | on / off |")
    print("|---|---:|---:|---:|")
    for q in ("p50", "p90"):
        ratio = d["on_over_off"] if q == "p50" else d["p90_on_over_off"]
        print(f"| TTFT {q} | {d[f'{q}_on']:.1f} | {d[f'{q}_off']:.1f} | {ratio:.3f} |")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
