"""A queue of long full prefills: N `mode=full` requests of bench/load.py's order scenario sent at once to a fresh
service per engine setting; when each got its first token and when all were done.

    python bench/saturate.py 6 default serial c1024 c1024b1024 c512 bigchunk

Each arm is `python -m service` (embedded model, shipped skills, background work off, as bench/load.py starts it)
with SKILLCACHE_PREFILL_CHUNK_TOKENS / SKILLCACHE_STEP_TOKEN_BUDGET / SKILLCACHE_MAX_RUNNING_SEQS as below. Prompts:
three shipped skills in the six orders in turn (~2.56k tokens), 16 greedy tokens, streaming, after one warm-up
request. Also printed: the engine's step count and decode tokens over the burst, from /metrics. The arms name the
settings they ran with when the default was 256 / 512 ("default" runs whatever the service's default is now).
"""
import asyncio
import itertools
import re
import sys
import time

import httpx

import load as L

ARMS = {"default": [], "serial": ["SKILLCACHE_MAX_RUNNING_SEQS=1"],
        "c256": ["SKILLCACHE_PREFILL_CHUNK_TOKENS=256", "SKILLCACHE_STEP_TOKEN_BUDGET=512"],
        "c1024": ["SKILLCACHE_PREFILL_CHUNK_TOKENS=1024", "SKILLCACHE_STEP_TOKEN_BUDGET=2048"],
        "c1024b1024": ["SKILLCACHE_PREFILL_CHUNK_TOKENS=1024", "SKILLCACHE_STEP_TOKEN_BUDGET=1024"],
        "c512": ["SKILLCACHE_PREFILL_CHUNK_TOKENS=512", "SKILLCACHE_STEP_TOKEN_BUDGET=1024"],
        "bigchunk": ["SKILLCACHE_PREFILL_CHUNK_TOKENS=4096", "SKILLCACHE_STEP_TOKEN_BUDGET=8192"]}
ORDERS = list(itertools.permutations(["refund-policy", "tool-specs", "style-guide"]))
_METRIC = re.compile(r'^(skillcache_(?:engine_step_seconds|decode_tokens_total|engine_batch_size)\w*)'
                     r'(\{[^}]*\})?\s+(\S+)$')


def metrics(url: str) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        m = _METRIC.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def body(i: int) -> dict:
    return {"max_tokens": 16, "temperature": 0.0, "stream": True, "seam_tokens": 4, "system": L.SYSTEM,
            "skills": list(ORDERS[i % 6]), "user": L.ORDER_QUESTIONS[i % len(L.ORDER_QUESTIONS)], "mode": "full"}


async def arm(name: str, env: list[str], n: int) -> None:
    svc = L.start_service(None, env, 0, False)
    svc.wait_ready()
    try:
        async with httpx.AsyncClient(base_url=svc.url, timeout=600) as c:
            await L.one(c, body(99), None, time.perf_counter())  # warm-up
            m0 = metrics(svc.url)
            t0 = time.perf_counter()
            recs = await asyncio.gather(*[L.one(c, body(i), None, t0) for i in range(n)])
            wall = time.perf_counter() - t0
            m1 = metrics(svc.url)
        d = {k: m1[k] - m0.get(k, 0) for k in m1 if k.endswith(("_sum", "_count", "_total"))}
        ttft = sorted(r["ttft_s"] for r in recs)
        e2e = sorted(r["e2e_s"] for r in recs)
        print(f"{name:9s} wall {wall:6.1f} s  thr {n / wall:.3f}/s  ttft {' '.join('%.1f' % x for x in ttft)}  "
              f"e2e {' '.join('%.1f' % x for x in e2e)}", flush=True)
        print("   ", {k: round(v, 2) for k, v in d.items()}, flush=True)
    finally:
        svc.stop()


async def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    for name in (sys.argv[2:] or ARMS):
        await arm(name, ARMS[name], n)


if __name__ == "__main__":
    asyncio.run(main())
