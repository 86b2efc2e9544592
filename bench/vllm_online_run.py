"""The request side of bench/vllm_online.py: one streamed request on vLLM alone or through skillcache, one arm at one
Poisson rate (warm-up, arrivals, a bounded drain), and waiting for the servers to go idle."""

from __future__ import annotations

import asyncio
import time

import httpx
import vllm_online_work as W
from load import one as skillcache_one
import peers_vllm
from peers_run import quiesce


async def vllm_one(client: httpx.AsyncClient, ids: list[int], n: int, salt: str, t_sched: float) -> dict:
    rec = await peers_vllm.vllm_one(client, ids, n, t_sched, salt=salt)
    rec["usage"] = {"prompt_tokens": rec.get("prompt_tokens")}
    return rec


async def send(arm: str, url: str, client: httpx.AsyncClient, wl, salt: str, t_sched: float) -> dict:
    i, val, user = wl.next()
    ids = wl.ids("erratum" if arm.endswith("erratum") else "in-place", val, user)
    if arm.startswith("vllm/"):
        rec = await vllm_one(client, ids, wl.args.max_tokens, salt, t_sched)
    else:
        rec = await skillcache_one(client, wl.body(arm, val, user), None, t_sched)
        rec.pop("t_sched", None)
        if rec.get("error") is None and arm.endswith("in-place") and rec.get("usage", {}).get("composed_tokens"):
            rec["error"] = "in_place_composed"  # mode full must compose nothing
    n = (rec.get("usage") or {}).get("prompt_tokens")
    if rec.get("error") is None and n is not None and n != len(ids):  # e.g. an in_place edit fell back to an erratum
        rec["error"] = f"prompt_mismatch: {n} tokens, {len(ids)} rendered here"
    rec.update(i=i, value=val)
    return rec


async def run_rate(arm: str, url: str, wl, rate: float, salt: str, seed: int, metrics_url: str | None = None
                   ) -> tuple[list[dict], dict | None]:
    """The warm-up, then vLLM's counters (metrics_url), then the measured arrivals: (records, counters before)."""
    a = wl.args
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
    timeout = httpx.Timeout(connect=30.0, read=900.0, write=60.0, pool=900.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as c:
        for _ in range(a.warmup if "erratum" in arm else min(a.warmup, 1)):  # in-place: nothing to warm but code
            r = await send(arm, url, c, wl, salt, time.perf_counter())
            if r["error"]:
                print(f"warning: {arm}: a warm-up request failed: {r['error']}", flush=True)
        before = W.parse_metrics((await c.get(f"{metrics_url}/metrics")).text) if metrics_url else None
        duration = W.duration_for(rate, a.duration_s, a.min_arrivals, a.max_duration_s)
        offsets = W.poisson_schedule(rate, duration, seed)
        t0 = time.perf_counter()
        deadline = t0 + duration + a.drain_s

        async def at(off: float) -> dict:
            await asyncio.sleep(max(0.0, t0 + off - time.perf_counter()))
            task = asyncio.ensure_future(send(arm, url, c, wl, salt, t0 + off))
            try:
                rec = await asyncio.wait_for(task, timeout=max(0.0, deadline - time.perf_counter()))
            except asyncio.TimeoutError:
                rec = {"error": "deadline", "ttft_s": None, "e2e_s": None}
            if rec.get("error") == "deadline" or rec.get("ttft_s") is None:
                rec["waited_s"] = min(deadline, time.perf_counter()) - (t0 + off)
            rec["t_offset"] = off
            return rec

        return list(await asyncio.gather(*(at(o) for o in offsets))), before


async def idle(vllm_url: str | None, pids: list[int], max_s: float) -> None:
    """vLLM has no request running or waiting (cancelled ones aborted), and the servers' CPU is idle."""
    t0 = time.monotonic()
    while vllm_url and time.monotonic() - t0 < max_s:
        m = W.parse_metrics(httpx.get(f"{vllm_url}/metrics", timeout=10).text)
        if m["running"] + m["waiting"] == 0:
            break
        await asyncio.sleep(0.5)
    await quiesce(pids, max(1.0, max_s - (time.monotonic() - t0)))
