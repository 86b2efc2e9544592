"""Background work under back-to-back load: does a new skill's calibration and a repeated order's refinement
complete while live requests keep the engine busy, and what does that cost them?

    python bench/background.py --json bench/out/background.json

Two arms, each a fresh `python -m service` (embedded model, shipped skills): **on** (the defaults: seam
calibration after each compile, 2% shadow checks, refinement of repeated skill orders) and **off**
(SKILLCACHE_SEAM_AUTO=false, SKILLCACHE_SHADOW_SAMPLE_RATE=0, SKILLCACHE_REFINE_AFTER=0). Once the shipped skills'
start-up calibrations have settled, --clients clients send composed requests back to back for --duration-s
(streaming, greedy, --max-tokens, seam 4 so the composition does not change when a calibration lands): every
third request the repeated order (refund-policy, tool-specs, style-guide), the others a seeded random order of
three of the six shipped skills. The engine is never idle for SKILLCACHE_BACKGROUND_IDLE_MS, so background work
runs only through its share of the busy time (SKILLCACHE_BACKGROUND_SHARE). --register-at-s into the load a new
skill is registered and compiled (a live request); its calibration is background work.

Reported per arm: live first-token latency p50/p90 over every request, and the p90 of each 30 s of the load (two
clients back to back fall into phases: for tens of seconds one's requests arrive during the other's prefill, and
the p90 is a prefill higher with or without background work; --think-ms, a random pause after each response,
makes the phase drift, and lets background work also run when both clients pause); how long the new skill's
calibration took (registration answered -> `GET /v1/skills/{name}` shows its calibration, polled every 0.25 s);
how long the repeated order's refinement took (the request that made it wanted -> the first request of the order served
from the exact prefix); the background share of the engine's busy time over the load; and where the CPU went over
the load: the service's CPU seconds by thread (bench/cpu.py; names from py-spy where installed) and this client's.

**alternate** (`--arms alternate`): one service as on (launched by bench/serve_switch.py, which adds a route that
pauses its background work), whose background work is paused and resumed every --switch-s of the load, on first.
Separate services differ in speed by 10-20% here whatever their settings (the box drifts, and two off arms of one
pooled run have read 33 and 40 ms a decode step), which a 25% criterion on a p90 cannot see through; within one
service both states share the process and the minutes. Reported by state: the first-token p50/p90 of the requests
sent and answered within one window, the engine's live time a request and the background share over its windows
(the share runs above the setting for a while after each resume: the scheduler's window remembers the paused
stretch as live time only). Work queued while paused waits, so calibration and refinement take about twice as long.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

import cpu
from common import stream_compose, write_json
from service.devserver import ROOT, ServiceProcess

REPEATED = ["refund-policy", "tool-specs", "style-guide"]
ALL_SKILLS = REPEATED + ["shipping-faq", "account-security", "escalation-playbook"]
TURNS = ["Can I return an opened item?", "Which tool do I use to check an order?", "How should I greet the customer?",
         "The parcel is late. What do I say?", "Summarise the refund rules in two sentences."]
NEW_SKILL = "bench-warranty"
OFF = {"SKILLCACHE_SEAM_AUTO": "false", "SKILLCACHE_SHADOW_SAMPLE_RATE": "0", "SKILLCACHE_REFINE_AFTER": "0"}


def counters(text: str) -> dict[str, float]:
    """Sums over labels of the counters this bench follows."""
    out = {"refined": 0.0, "busy_live": 0.0, "busy_background": 0.0}
    for line in text.splitlines():
        m = re.match(r'^(\w+)(\{[^}]*\})? (\S+)$', line)
        if not m:
            continue
        name, labels, v = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "skillcache_refined_prefixes_total":
            out["refined"] += v
        elif name == "skillcache_engine_busy_seconds_total":
            out["busy_live" if 'kind="live"' in labels else "busy_background"] += v
    return out


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(round(0.9 * (len(xs) - 1)))]


async def ask(c: httpx.AsyncClient, skills: list[str], user: str, max_tokens: int) -> dict:
    r = await stream_compose(c, {"skills": skills, "user": user, "max_tokens": max_tokens, "temperature": 0.0,
                                 "stream": True, "seam_tokens": 4})
    return {"t_end": r["t_end"], "ttft_s": r["ttft_s"], "prefix_tokens": r["done"]["usage"]["prefix_tokens"]}


async def settle(c: httpx.AsyncClient, limit_s: float = 300.0) -> None:
    """Until every shipped skill shows its calibration (the start-up calibrations, background work of their own)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        skills = (await c.get("/v1/skills")).json()["skills"]
        if all(sk.get("calibration") for sk in skills if sk["name"] in ALL_SKILLS and sk.get("compiled")):
            return
        await asyncio.sleep(0.5)


async def load(url: str, pid: int, args, seed: int, calibrating: bool, switch_s: float | None = None) -> dict:
    """switch_s: the `alternate` arm, background work paused and resumed every switch_s of the load."""
    rng = random.Random(seed)
    rows: list[dict] = []
    events: dict = {}
    state = {"paused": False, "switches": 0}  # the alternate arm's background switch, as the clients see it
    windows: list[dict] = []  # the alternate arm's: {"paused", "m": counters at its start}, then one at the end
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        await ask(c, REPEATED[:1], "warm up", 4)
        if calibrating:
            await settle(c)
        m0 = counters((await c.get("/metrics")).text)
        cpu0, client0, t0 = cpu.snapshot(pid), time.process_time(), time.perf_counter()
        stop = t0 + args.duration_s  # from here: the on arm's settling above took 30-40 s of the load before
        spy = cpu.profile(pid, args.duration_s, f"{args.profile}/{'on' if calibrating else 'off'}.txt") \
            if args.profile else None
        seen = {"n": 0}

        async def client(k: int) -> None:
            i = k
            while time.perf_counter() < stop:
                repeated = i % 3 == 0
                order = list(REPEATED) if repeated else rng.sample(ALL_SKILLS, 3)
                paused, switches = state["paused"], state["switches"]
                r = await ask(c, order, TURNS[i % len(TURNS)], args.max_tokens)
                r.update(repeated=repeated, t=r["t_end"] - t0, paused=paused,
                         spans_switch=state["switches"] != switches)
                rows.append(r)
                if args.think_ms:  # a random pause: the clients' relative phase drifts instead of locking
                    await asyncio.sleep(rng.uniform(0, args.think_ms) / 1e3)
                if repeated:
                    seen["n"] += 1
                    if seen["n"] == args.refine_after and "wanted_at" not in events:
                        events["wanted_at"] = r["t_end"]
                    if r["prefix_tokens"] and "refined_served_at" not in events:
                        events["refined_served_at"] = r["t_end"]
                i += args.clients

        async def register() -> None:
            await asyncio.sleep(args.register_at_s)
            body = (ROOT / "skills" / "shipping-faq.md").read_text().split("---", 2)[2]  # after the front matter
            text = body.replace("{{", "").replace("}}", "").replace("shipping", "warranty")
            r = await c.post("/v1/skills", params={"compile": "true"}, json={"name": NEW_SKILL, "text": text})
            r.raise_for_status()
            events["registered_at"] = time.perf_counter()
            while time.perf_counter() < stop + (120 if calibrating else 0):  # off: no calibration to wait for
                if (await c.get(f"/v1/skills/{NEW_SKILL}")).json().get("calibration"):  # from the block's header
                    events["calibrated_at"] = time.perf_counter()
                    return
                await asyncio.sleep(0.25)

        async def switch() -> None:  # background on for the first window, then off, on, ...
            paused = False
            while time.perf_counter() < stop:
                await c.post("/bench/background", json={"paused": paused})
                windows.append({"paused": paused, "m": counters((await c.get("/metrics")).text)})
                state.update(paused=paused, switches=state["switches"] + 1)
                await asyncio.sleep(min(switch_s, max(0.0, stop - time.perf_counter())))
                paused = not paused
            windows.append({"paused": None, "m": counters((await c.get("/metrics")).text)})  # the load's end
            await c.post("/bench/background", json={"paused": False})  # the calibration may finish after it

        registering = asyncio.create_task(register())  # may wait past the load for the calibration
        await asyncio.gather(*[client(k) for k in range(args.clients)], *([switch()] if switch_s else []))
        m1 = counters((await c.get("/metrics")).text)
        wall, client_s, cpu1 = time.perf_counter() - t0, time.process_time() - client0, cpu.snapshot(pid)
        await registering
        if spy is not None:
            spy.wait()
    used = {"wall_s": wall, "client_s": client_s, **cpu.by_thread(cpu0, cpu1, cpu.thread_names(pid))}
    ttfts = [r["ttft_s"] for r in rows]
    busy_bg = m1["busy_background"] - m0["busy_background"]
    busy = busy_bg + m1["busy_live"] - m0["busy_live"]

    def took(a: str, b: str) -> float | None:
        return events[b] - events[a] if a in events and b in events else None

    by_30s = [[r["ttft_s"] for r in rows if w <= r["t"] < w + 30] for w in range(0, int(args.duration_s), 30)]
    return {**({"switched": switched(rows, windows)} if switch_s else {}),
            "requests": len(rows), "requests_per_s": len(rows) / wall, "live_engine_s_per_request":
            (busy - busy_bg) / max(1, len(rows)), "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": p90(ttfts),
            "ttft_p90_by_30s": [p90(w) if w else None for w in by_30s],
            "calibration_s": took("registered_at", "calibrated_at"),
            "refinement_s": took("wanted_at", "refined_served_at"),
            "repeated_exact": sum(1 for r in rows if r["repeated"] and r["prefix_tokens"]),
            "repeated": sum(1 for r in rows if r["repeated"]), "refined_prefixes": m1["refined"] - m0["refined"],
            "background_share": busy_bg / busy if busy else 0.0, "busy_s": busy, "busy_background_s": busy_bg,
            "cpu": used, "rows": rows}


def switched(rows: list[dict], windows: list[dict]) -> dict:
    """The alternate arm by the switch's state: requests sent and answered within one window of it, their
    first-token p50/p90, and the engine's busy time (live a request, and the background share) over its windows."""
    out = {}
    for paused in (False, True):
        ttfts = [r["ttft_s"] for r in rows if r["paused"] == paused and not r["spans_switch"]]
        spans = [(w["m"], windows[i + 1]["m"]) for i, w in enumerate(windows[:-1]) if w["paused"] == paused]
        live = sum(b["busy_live"] - a["busy_live"] for a, b in spans)
        bg = sum(b["busy_background"] - a["busy_background"] for a, b in spans)
        n = sum(1 for r in rows if r["paused"] == paused)
        out["off" if paused else "on"] = {"windows": len(spans), "ttfts": ttfts, "answered": n, "live_s": live,
                                          "background_s": bg}
    return out


def by_switch(runs: list[dict]) -> dict:
    """The alternate arm's runs pooled by the switch's state; and the on windows' p90 against the off windows'."""
    out: dict = {}
    for state in ("on", "off"):
        parts = [r["switched"][state] for r in runs]
        ttfts = [t for p in parts for t in p["ttfts"]]
        live, bg = sum(p["live_s"] for p in parts), sum(p["background_s"] for p in parts)
        out[state] = {"windows": sum(p["windows"] for p in parts), "requests": len(ttfts),
                      "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": p90(ttfts),
                      "live_engine_s_per_request": live / max(1, sum(p["answered"] for p in parts)),
                      "background_share": bg / (live + bg) if live + bg else 0.0}
    out["p90_rise"] = out["on"]["ttft_p90_s"] / out["off"]["ttft_p90_s"] - 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", default=["off", "on"], choices=["off", "on", "alternate"],
                    help="run in this order; an arm named more than once is pooled over its runs (off on on off: a "
                    "drift of the machine's speed over the runs weighs on both arms alike); alternate: one service "
                    "as on, its background work paused and resumed every --switch-s of the load")
    ap.add_argument("--switch-s", type=float, default=20.0, help="the alternate arm's window")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--duration-s", type=float, default=90.0)
    ap.add_argument("--register-at-s", type=float, default=15.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--think-ms", type=float, default=0.0, help="each client pauses a random 0..this many ms after a "
                    "response (0: back to back)")
    ap.add_argument("--refine-after", type=int, default=1, help="the service's SKILLCACHE_REFINE_AFTER (on arm)")
    ap.add_argument("--server-env", nargs="*", default=[], metavar="KEY=VALUE", help="more env for the on arm")
    ap.add_argument("--profile", metavar="DIR", help="also sample the service's threads with py-spy over the load "
                    "(DIR/on.txt, DIR/off.txt, the arm's last run: py-spy's raw format, a line per stack and its "
                    "count)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.profile and cpu.py_spy() is None:
        ap.error("--profile samples with py-spy: pip install py-spy")
    out = {"args": vars(args), "runs": [], "arms": {}}
    for i, arm in enumerate(args.arms):
        env = {"SKILLCACHE_SKILLS_DIR": str(ROOT / "skills"), **(OFF if arm == "off" else {})}
        if arm != "off":
            env["SKILLCACHE_REFINE_AFTER"] = str(args.refine_after)
            env.update(kv.split("=", 1) for kv in args.server_env)
        command = [sys.executable, str(ROOT / "bench" / "serve_switch.py")] if arm == "alternate" else None
        svc = ServiceProcess(Path(tempfile.mkdtemp(prefix=f"skillcache-bg-{arm}-")), env, threads=None,
                             command=command).start()
        try:
            svc.wait_ready(600)
            res = asyncio.run(load(svc.url, svc.proc.pid, args, args.seed + args.arms[:i].count(arm),
                                   calibrating=arm != "off",  # an arm's k-th run: the other's k-th's orders
                                   switch_s=args.switch_s if arm == "alternate" else None))
            res["log_tail"] = svc.log_tail(20000)
        finally:
            svc.stop()
        out["runs"].append({"arm": arm, **res})
        cal, ref = res["calibration_s"], res["refinement_s"]
        print(f"{arm:3s}: {res['requests']} requests ({res['requests_per_s']:.2f}/s, live engine time "
              f"{res['live_engine_s_per_request'] * 1e3:.0f} ms each), TTFT p50 {res['ttft_p50_s'] * 1e3:.0f} ms, "
              f"p90 {res['ttft_p90_s'] * 1e3:.0f} ms; new skill calibrated after "
              f"{'-' if cal is None else f'{cal:.1f} s'}; repeated order refined after "
              f"{'-' if ref is None else f'{ref:.1f} s'} ({res['repeated_exact']}/{res['repeated']} served exact); "
              f"background share {res['background_share']:.1%}", flush=True)
        print("     TTFT p90 by 30 s of load: " + " ".join("-" if x is None else f"{x * 1e3:.0f}"
                                                       for x in res["ttft_p90_by_30s"]) + " ms", flush=True)
        u = res["cpu"]
        print(f"     CPU over the {u['wall_s']:.0f} s of load: service {u['total_s']:.1f} s ("
              + ", ".join(f"{k} {v:.1f}" for k, v in u["by_thread_s"].items())
              + f"), this client {u['client_s']:.1f} s; "
              f"engine busy {res['busy_s']:.1f} s, of it background {res['busy_background_s']:.1f} s; "
              f"{u['minor_faults'] / max(1, res['requests']):,.0f} page faults a request", flush=True)
    for arm in dict.fromkeys(args.arms):  # an arm run more than once (--arms off on on off): its runs pooled
        runs = [r for r in out["runs"] if r["arm"] == arm]
        ttfts = [row["ttft_s"] for r in runs for row in r["rows"]]
        wall, busy = sum(r["cpu"]["wall_s"] for r in runs), sum(r["busy_s"] for r in runs)
        bg, n = sum(r["busy_background_s"] for r in runs), sum(r["requests"] for r in runs)
        out["arms"][arm] = {"runs": len(runs), "requests": n, "requests_per_s": n / wall, "ttft_p50_s":
                            statistics.median(ttfts), "ttft_p90_s": p90(ttfts), "background_share": bg / busy,
                            "live_engine_s_per_request": (busy - bg) / n}
        a = out["arms"][arm]
        if len(runs) > 1:
            print(f"{arm:3s}, {len(runs)} runs pooled: {a['requests_per_s']:.2f} requests/s, live engine time "
                  f"{a['live_engine_s_per_request'] * 1e3:.0f} ms each, TTFT p50 {a['ttft_p50_s'] * 1e3:.0f} ms, p90 "
                  f"{a['ttft_p90_s'] * 1e3:.0f} ms, background share {a['background_share']:.1%}", flush=True)
    if "alternate" in out["arms"]:
        out["arms"]["alternate"]["by_switch"] = sw = by_switch([r for r in out["runs"] if r["arm"] == "alternate"])
        for state in ("on", "off"):
            a = sw[state]
            print(f"alternate, background {state:3s}: {a['windows']} windows, {a['requests']} requests within one, "
                  f"TTFT p50 {a['ttft_p50_s'] * 1e3:.0f} ms, p90 {a['ttft_p90_s'] * 1e3:.0f} ms; live engine time "
                  f"{a['live_engine_s_per_request'] * 1e3:.0f} ms a request, background share "
                  f"{a['background_share']:.1%}", flush=True)
        live = sw["on"]["live_engine_s_per_request"] / sw["off"]["live_engine_s_per_request"] - 1
        print(f"alternate, one service: live p90 first token {sw['p90_rise']:+.1%} with background work on, live "
              f"engine time a request {live:+.1%}", flush=True)
        if "off" in out["arms"]:  # --arms off alternate alternate off: are the on settings' services slower as such?
            off = out["arms"]["off"]
            sw["p90_rise_vs_off_services"] = rise = sw["on"]["ttft_p90_s"] / off["ttft_p90_s"] - 1
            live = sw["on"]["live_engine_s_per_request"] / off["live_engine_s_per_request"] - 1
            print(f"alternate's background-on windows vs the off services: live p90 first token {rise:+.1%}, live "
                  f"engine time a request {live:+.1%}", flush=True)
    if "on" in out["arms"] and "off" in out["arms"]:
        on, off = out["arms"]["on"], out["arms"]["off"]
        out["p90_rise"] = rise = on["ttft_p90_s"] / off["ttft_p90_s"] - 1
        print(f"background on vs off: live p90 first token {rise:+.1%}, requests/s "
              f"{on['requests_per_s'] / off['requests_per_s'] - 1:+.1%}, live engine time a request "
              f"{on['live_engine_s_per_request'] / off['live_engine_s_per_request'] - 1:+.1%}", flush=True)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
