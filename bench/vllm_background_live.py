"""A live request's first token on the vLLM engine while background work runs there: how long it waits; and what
a refining request costs.

    python bench/vllm_background_live.py --json bench/out/vllm-background-live.json

skillcache in front of vLLM (as make run-vllm starts them; vLLM in its fastest dtype), refinement after one use
(SKILLCACHE_VLLM_REFINE_AFTER=1). A live order (composed, then refined: its second request goes out exact) is sent:
  idle     back to back with nothing in the background (--live requests)
  during   --delay-s after a new skill of ~2.4k tokens (the three skills' texts under a new heading) was registered:
           its compile ahead (vLLM's prefill of the block, at background priority) has started (vLLM's
           running-request count is read just before the live request goes), then the live request, greedy, 16 tokens
  refining (first arm only) --refining new orders, each sent twice: composed, then the refining request (exact:
           vLLM computes the whole prompt at live priority); then vLLM alone (straight to the same server, a salt of
           its own) on the refining request's token ids; first tokens of each
Per --chunk arm (SKILLCACHE_VLLM_BACKGROUND_CHUNK: new tokens per background request; 0: one request).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import re
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from common import stream_compose, write_json
from peers_run import environment, quiesce
from peers_vllm import SKILLS, descendants
from peers_work import Prompts
from service.devserver import ROOT, ServiceProcess, free_port
from service.vllm.launch import SERVED_NAME, VllmProcess, command, environment as vllm_env, fastest_dtype, model_dir


async def vllm_ttft(url: str, ids: list[int], salt: str) -> float:
    """vLLM alone: the first token of `ids` (greedy, streamed) under a salt no other request used, in ms."""
    body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": 4, "temperature": 0.0, "stream": True,
            "cache_salt": salt}
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return (time.perf_counter() - t0) * 1e3
    raise RuntimeError("vLLM streamed no token")


def running(vllm_url: str) -> float:
    text = httpx.get(f"{vllm_url}/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", text,
                                                        re.M))


async def arm(chunk: int, args, home: Path, prompts: Prompts | None) -> dict:
    from service.config import Settings

    cmd = command(model_dir(Settings()), free_port(), home / "spans", dtype=args.dtype)
    vllm = VllmProcess(cmd, vllm_env(2), home / f"vllm-{chunk}.log").start()
    svc = None
    try:
        vllm.wait_ready(900)
        env = {"SKILLCACHE_SKILLS_DIR": str(home / "skills"), "SKILLCACHE_ENGINE": "vllm",
               "SKILLCACHE_VLLM_URL": vllm.url, "SKILLCACHE_VLLM_DTYPE": args.dtype,
               "SKILLCACHE_VLLM_SPANS_DIR": str(home / "spans"), "SKILLCACHE_VLLM_REFINE_AFTER": "1",
               "SKILLCACHE_VLLM_BACKGROUND_CHUNK": str(chunk), "SKILLCACHE_TORCH_THREADS": "1"}
        svc = ServiceProcess(home / f"sc-{chunk}", env, threads=1).start()
        svc.wait_ready(900)
        pids = [q for p in (vllm.proc.pid, svc.proc.pid) for q in descendants(p)]
        orders = list(itertools.permutations(SKILLS))
        live = list(orders[0])

        def body(order, user, n):
            return {"skills": list(order), "user": user, "max_tokens": n, "temperature": 0.0, "stream": True}

        async with httpx.AsyncClient(base_url=svc.url, timeout=600) as c:
            await quiesce(pids, args.settle_s)
            for i in range(3):  # composed, then refining (exact, whole prompt), then exact from vLLM's prefix cache
                await stream_compose(c, body(live, f"Warm-up {i}.", 2))
                await quiesce(pids, args.settle_s)
            idle = []
            for i in range(args.live):
                r = await stream_compose(c, body(live, f"Live question {i}: can I return it?", 16))
                idle.append(r["ttft_s"] * 1e3)
            big = "\n\n".join((ROOT / "skills" / f"{n}.md").read_text() for n in SKILLS)
            big = big.replace("{", "(").replace("}", ")")  # their fields' placeholders: plain text here
            during = []
            for i in range(args.new):  # a new skill: its compile ahead runs in the background
                reg = asyncio.create_task(c.post("/v1/skills", json={"name": f"big-{chunk}-{i}",
                                                                       "text": f"# Handbook, edition {i}\n\n{big}"}))
                await asyncio.sleep(args.delay_s)
                n_running = running(vllm.url)
                r = await stream_compose(c, body(live, f"Live during {i}: can I return it?", 16))
                during.append({"ttft_ms": r["ttft_s"] * 1e3, "vllm_running_before": n_running})
                reply = await reg
                assert reply.status_code in (200, 201), reply.text
                await quiesce(pids, args.settle_s)
            refining = {}
            if prompts is not None:  # the refining request against vLLM alone on the same ids, on the same server
                composed, refine, alone = [], [], []
                firsts = {live[0]}  # orders whose first skill no earlier exact request had: no prefix in common
                fresh = [o for o in orders if o[0] not in firsts and not firsts.add(o[0])]
                for i, order in enumerate(fresh[:args.refining]):
                    r = await stream_compose(c, body(order, f"New order {i}.", 4))
                    composed.append(r["ttft_s"] * 1e3)
                    await quiesce(pids, args.settle_s)
                    user = f"Again {i}: can I return it?"
                    r = await stream_compose(c, body(order, user, 4))  # the refining request
                    refine.append(r["ttft_s"] * 1e3)
                    await quiesce(pids, args.settle_s)
                    alone.append(await vllm_ttft(vllm.url, prompts.ids(order, user), f"alone-{uuid.uuid4()}"))
                    await quiesce(pids, args.settle_s)
                refining = {"composed_ttft_ms": composed, "refining_ttft_ms": refine, "vllm_alone_ttft_ms": alone}
                print(f"new orders: composed {[round(x) for x in composed]} ms; the refining request "
                      f"{[round(x) for x in refine]} ms; vLLM alone on its ids {[round(x) for x in alone]} ms",
                      flush=True)
        out = {"chunk": chunk, "idle_ttft_ms": idle, "during": during, "refining": refining,
               "idle_p50_ms": statistics.median(idle),
               "during_p50_ms": statistics.median(d["ttft_ms"] for d in during),
               "during_max_ms": max(d["ttft_ms"] for d in during)}
        print(f"chunk {chunk}: live first token idle p50 {out['idle_p50_ms']:.0f} ms; during a compile ahead p50 "
              f"{out['during_p50_ms']:.0f} ms, max {out['during_max_ms']:.0f} ms; vLLM running before: "
              f"{[d['vllm_running_before'] for d in during]}", flush=True)
        return out
    finally:
        if svc is not None:
            svc.stop()
        vllm.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 0])
    ap.add_argument("--live", type=int, default=5)
    ap.add_argument("--new", type=int, default=5, help="new skills registered, each followed by a live request")
    ap.add_argument("--delay-s", type=float, default=0.4, help="after a registration began: its compile runs")
    ap.add_argument("--refining", type=int, default=2, help="new orders whose refining request is timed (first arm; "
                    "at most one per first skill other than the live order's)")
    ap.add_argument("--settle-s", type=float, default=20)
    ap.add_argument("--dtype", default=fastest_dtype()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="skillcache-vllm-bg-live-"))
    (home / "skills").mkdir()
    for name in SKILLS:
        shutil.copy(ROOT / "skills" / f"{name}.md", home / "skills")
    prompts = Prompts(SKILLS) if args.refining else None  # token ids exactly as skillcache builds them
    t0 = time.perf_counter()
    out = {"environment": environment(), "args": vars(args),
           "arms": [asyncio.run(arm(ch, args, home, prompts if i == 0 else None)) for i, ch in enumerate(args.chunks)]}
    out["elapsed_s"] = time.perf_counter() - t0
    write_json(args.json, out)


if __name__ == "__main__":
    main()
