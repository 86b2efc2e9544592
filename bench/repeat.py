"""Exact on repeat, under load: does refinement keep up when requests come back to back?

    python bench/repeat.py --json bench/out/repeat.json

Each arm is a fresh `python -m service` (embedded model, shipped skills, shadow checks off) with one
SKILLCACHE_REFINE_AFTER; requests stream, greedy, 32 tokens, logprobs 1 (the first token's top-1), seam 4.
  orders  three shipped skills in four orders, five user turns each, sent back to back by one client: each
          composed request is followed by the same request with mode=full. Reported: from the third request of
          an order on, how many composed greedy texts equal the full recompute's; first-token top-1 agreement
          over every request; composed first-token latency p50/p90; the refinements run and the tokens they
          prefilled. --pause-s adds a pause after each order's first composed request (with REFINE_AFTER=1 the
          background prefill of the order then finishes before its second request).
  mix     the REFINE_AFTER choice on a mix: half the requests use one of four recurring orders, half a
          random order of three of six skills that never recurs; composed only. Cost: tokens prefilled by
          refinement; benefit: requests served from an exact prefix. One client, back to back.
Arms: --after (default 0, 1, 2) x --from-full (SKILLCACHE_REFINE_FROM_FULL, default on: a mode=full request
gives the prefix refinement wants; off: refinement is background work only). Loopback only; bounded by
--deadline-s.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from common import stream_compose
from service.devserver import ROOT, ServiceProcess

ORDER_SKILLS = ["refund-policy", "tool-specs", "style-guide"]
ALL_SKILLS = ORDER_SKILLS + ["shipping-faq", "account-security", "escalation-playbook"]
TURNS = ["Can I return an opened item?", "Which tool do I use to check an order?", "How should I greet the customer?",
         "The parcel is late. What do I say?", "Summarise the refund rules in two sentences."]


def start(after: int, from_full: str, chunk: int | None) -> ServiceProcess:
    env = {"SKILLCACHE_SKILLS_DIR": str(ROOT / "skills"), "SKILLCACHE_SHADOW_SAMPLE_RATE": "0",
           "SKILLCACHE_REFINE_AFTER": str(after), "SKILLCACHE_REFINE_FROM_FULL": str(from_full == "on").lower()}
    if chunk:
        env["SKILLCACHE_BACKGROUND_CHUNK_TOKENS"] = str(chunk)
    svc = ServiceProcess(Path(tempfile.mkdtemp(prefix=f"skillcache-repeat-{after}-")), env, threads=None).start()
    svc.wait_ready(600)
    return svc


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def ask_text(c: httpx.AsyncClient, skills: list[str], user: str, mode: str) -> dict:
    """Streamed (for the first-token time), then the text from the deltas."""
    r = await stream_compose(c, {"skills": skills, "user": user, "max_tokens": 32, "temperature": 0.0,
                                 "stream": True, "logprobs": 1, "seam_tokens": 4, "mode": mode})
    done = r["done"]
    return {"ttft_s": r["ttft_s"], "text": r["text"], "top1": done["logprobs"][0]["token"],
            "paths": [s["path"] for s in done["skills"]], "prefix_tokens": done["usage"]["prefix_tokens"]}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def orders(url: str, pause_s: float, deadline: float) -> dict:
    perms = list(itertools.permutations(ORDER_SKILLS))[:4]
    rows, seen = [], {o: 0 for o in perms}
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        for turn in TURNS:
            for order in perms:
                if time.perf_counter() > deadline:
                    break
                comp = await ask_text(c, list(order), turn, "compose")
                full = await ask_text(c, list(order), turn, "full")
                seen[order] += 1
                rows.append({"order": order, "n": seen[order], "equal": comp["text"] == full["text"],
                             "top1": comp["top1"] == full["top1"], "ttft_s": comp["ttft_s"],
                             "exact": comp["paths"] == ["prefix"] * 3, "full_ttft_s": full["ttft_s"]})
                if pause_s and seen[order] == 1:
                    await asyncio.sleep(pause_s)
        m = (await c.get("/metrics")).text
    later = [r for r in rows if r["n"] >= 3]
    second = [r for r in rows if r["n"] == 2]
    ttfts = [r["ttft_s"] for r in rows]
    return {"requests": len(rows), "later_equal": sum(r["equal"] for r in later), "later": len(later),
            "second_equal": sum(r["equal"] for r in second), "second_exact": sum(r["exact"] for r in second),
            "second": len(second), "top1_agree": sum(r["top1"] for r in rows),
            "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": pct(ttfts, 0.9),
            "refined": metric(m, "skillcache_refined_prefixes_total"),
            "refine_prefilled": metric(m, "skillcache_refine_tokens_total", '{kind="prefilled"}'),
            "refine_donated": metric(m, "skillcache_refine_tokens_total", '{kind="donated"}'), "rows": rows}


async def mix(url: str, n: int, seed: int, deadline: float) -> dict:
    rng = random.Random(seed)
    recurring = list(itertools.permutations(ORDER_SKILLS))[:4]
    rows = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        for i in range(n):
            if time.perf_counter() > deadline:
                break
            order = list(recurring[i % 4]) if i % 2 == 0 else rng.sample(ALL_SKILLS, 3)
            r = await ask_text(c, order, TURNS[i % len(TURNS)], "compose")
            rows.append({"recurring": i % 2 == 0, "exact_tokens": r["prefix_tokens"], "ttft_s": r["ttft_s"]})
        m = (await c.get("/metrics")).text
    ttfts = [r["ttft_s"] for r in rows]
    return {"requests": len(rows), "served_exact": sum(r["exact_tokens"] > 0 for r in rows),
            "refined": metric(m, "skillcache_refined_prefixes_total"),
            "refine_prefilled": metric(m, "skillcache_refine_tokens_total", '{kind="prefilled"}'),
            "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": pct(ttfts, 0.9)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--after", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--from-full", nargs="+", default=["on"], choices=["on", "off"],
                    help="SKILLCACHE_REFINE_FROM_FULL per arm: mode=full requests donate the prefix refinement wants")
    ap.add_argument("--background-chunk", type=int, help="SKILLCACHE_BACKGROUND_CHUNK_TOKENS (default: the service's)")
    ap.add_argument("--scenarios", nargs="+", default=["orders", "mix"], choices=["orders", "mix"])
    ap.add_argument("--pause-s", type=float, default=0.0)
    ap.add_argument("--mix-requests", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=3600)
    ap.add_argument("--json")
    args = ap.parse_args()
    deadline = time.perf_counter() + args.deadline_s
    out: dict = {"args": vars(args), "arms": {}}
    for after, from_full in itertools.product(args.after, args.from_full):
        if after == 0 and from_full == "off" and "on" in args.from_full:
            continue  # refinement off: donation changes nothing
        arm = f"after={after} from_full={from_full}"
        svc = start(after, from_full, args.background_chunk)
        try:
            res = {}
            if "orders" in args.scenarios:
                res["orders"] = asyncio.run(orders(svc.url, args.pause_s, deadline))
                o = res["orders"]
                print(f"{arm} orders: later {o['later_equal']}/{o['later']} equal, second "
                      f"{o['second_equal']}/{o['second']} equal ({o['second_exact']} exact), top-1 "
                      f"{o['top1_agree']}/{o['requests']}, TTFT p50 {o['ttft_p50_s'] * 1e3:.0f} ms p90 "
                      f"{o['ttft_p90_s'] * 1e3:.0f} ms, {o['refined']:.0f} refinements, "
                      f"{o['refine_prefilled']:.0f} tokens prefilled, {o['refine_donated']:.0f} donated", flush=True)
            if "mix" in args.scenarios:
                res["mix"] = asyncio.run(mix(svc.url, args.mix_requests, args.seed, deadline))
                x = res["mix"]
                print(f"{arm} mix: {x['served_exact']}/{x['requests']} served exact, {x['refined']:.0f} "
                      f"refinements, {x['refine_prefilled']:.0f} tokens prefilled, TTFT p90 "
                      f"{x['ttft_p90_s'] * 1e3:.0f} ms", flush=True)
            out["arms"][arm] = res
        finally:
            svc.stop()
            shutil.rmtree(svc.home, ignore_errors=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
