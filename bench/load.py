"""Serving load test: open-loop Poisson arrivals (and a closed-loop unthrottled arm) against the HTTP API.

    python bench/load.py --json bench/out/load.json --png docs/img/load.png          # starts its own service
    python bench/load.py --url http://127.0.0.1:8000 --rates 0.5 1 --requests 12    # a running service
    python bench/load.py --requests 6 --rates 0.5 --concurrency 2 --server-threads 1  # quick check, shared CPU

Defaults (rates 0.2, 0.5, 1 req/s and closed loop with 4 clients, 12 requests per arm and rate) take
about 11-12 minutes with the embedded model on a quiet 2-core CPU (a ~2.5k-token full prefill costs
3-5 s there, so the in_place and full arms saturate at about 0.2-0.3 req/s); --deadline-s (900) bounds it.

Like the paper's serving benchmark (arXiv 2606.17107: vLLM, Qwen3-8B, Poisson arrivals), scaled to a CPU and the
embedded model:

  policy  a ~2.4k-token policy skill (refund-policy + tool-specs + style-guide, registered as one
          skill `bench-policy`) with the field `order_status` near the top; every request carries a
          UNIQUE order_status value.
            in_place  the value is written into the policy text itself, sent as the request's
                      `system` text with no skills: nothing can be reused, the whole prompt is
                      prefilled (--inplace-via skill instead registers the edited text as a new skill
                      version per request and composes it: the block is compiled on the request path)
            erratum   the byte-identical registered skill (its block cached) plus `fields`: the value
                      arrives as one appended erratum line
  order   three shipped skills, each request in another order (the 6 permutations in turn)
            full      mode="full": every prompt token prefilled
            compose   mode="compose": the blocks re-rotated into place, any order

Each request streams (`"stream": true`, greedy, --max-tokens 16). Client-side TTFT is the time from
the request's scheduled arrival to its first `delta` event (to the `done` event when nothing was
generated), e2e to `[DONE]`. Open loop: arrivals are scheduled from a seeded Poisson process,
independent of completions. Unthrottled: --concurrency clients, each sending its next request when
the last one ends. Per arm and rate: p50/p90/p99 TTFT and e2e, throughput (completed / wall time from
the first arrival to the last completion), errors by type, the skill hit rate from /metrics (blocks
served from a tier / all blocks served, `skillcache_skill_hits_total` as a delta over the arm; none
when the arm uses no skills), the prompt-token reuse ratio (sum reused_tokens / sum prompt_tokens) and
the exact share (sum prefix_tokens / sum prompt_tokens: refined skill sequences, service/compose/refine.py).
Rates run in the outer loop and arms in the inner one, so a --deadline-s cut drops the highest rates
of every arm alike. Loopback only.

Every request sends seam_tokens=--seam (4), so the composition is fixed. The service's fidelity guard
runs full prefills on the same single worker in the background (a seam calibration after each block
compile, shadow checks of 2% of compose requests), and so does prefix refinement (a repeated skill
sequence prefilled in full, then served exact); they stall whatever request arrives meanwhile. A
service started here runs with all of it off (SKILLCACHE_SEAM_AUTO=false, SKILLCACHE_SHADOW_SAMPLE_RATE=0,
SKILLCACHE_REFINE_AFTER=0) unless --guard; against --url the script waits (--settle-s) for the used skills'
calibrations and
reports, per arm, how many guard jobs ran (column bg).
On a shared CPU, run the service with --server-threads 1: oversubscribed OpenMP threads make the small
forwards of compose and decode 10-30x slower.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from service.devserver import ROOT, ServiceNotReady, ServiceProcess

LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
SYSTEM = "You are the order-support agent of an online store. Follow the policies below exactly."
POLICY_QUESTIONS = [
    "Order A-{i:05d}: the customer writes 'I changed my mind, I want my money back.' Decide: APPROVE or DENY.",
    "Order A-{i:05d}: the customer says the item arrived damaged and asks for a refund. APPROVE or DENY?",
    "Order A-{i:05d}: the customer asks to cancel and get a refund today. Answer APPROVE or DENY first.",
]
ORDER_QUESTIONS = [
    "Where is my parcel? My email is sam.lee@example.com and I don't have the order number.",
    "My order was delivered yesterday but I don't want it any more. Can I return it for a refund?",
    "How long does standard shipping to the UK take, and is it free?",
    "The tracking page has said 'label created' for four days. What is going on?",
]
STATUSES = ["shipped", "processing", "returned", "lost", "pending"]
POLICY_NAME = "bench-policy"
INPLACE_NAME = "bench-policy-inplace"
ARMS = {"policy": ["in_place", "erratum"], "order": ["full", "compose"]}


# ---- skills ---------------------------------------------------------------------------------
def load_skill(name: str) -> dict:
    from skillcache_client.skillfile import parse_skill_file

    return parse_skill_file(ROOT / "skills" / f"{name}.md")


def policy_skill(names: list[str]) -> dict:
    """The shipped skills' bodies joined into one long policy; their fields merged."""
    parts = [load_skill(n) for n in names]
    fields = {k: v for p in parts for k, v in p["fields"].items()}
    if "order_status" not in fields:
        raise SystemExit("--policy-skills must include a skill that declares order_status (refund-policy)")
    return {"name": POLICY_NAME, "text": "\n\n".join(p["text"] for p in parts), "fields": fields,
            "description": "load benchmark: " + " + ".join(names)}


def render(text: str, values: dict) -> str:
    from skillcache_client.skillfile import render as _render

    return _render(text, values)


# ---- the service ----------------------------------------------------------------------------
def start_service(model: str | None, extra_env: list[str], threads: int, guard: bool,
                  src: str | None = None) -> ServiceProcess:
    """`python -m service` on a free loopback port with a fresh home (the converted-model cache reused); `src`: the
    source tree to run (another commit's checkout, for a side-by-side comparison)."""
    env = {"SKILLCACHE_SKILLS_DIR": str(ROOT / "skills")}
    if model:
        env["SKILLCACHE_MODEL"] = model
    if not guard:  # no background fidelity work on the worker: every measured request is the arm's
        env["SKILLCACHE_SEAM_AUTO"] = "false"
        env["SKILLCACHE_SHADOW_SAMPLE_RATE"] = "0"
        env["SKILLCACHE_REFINE_AFTER"] = "0"  # the order scenario measures composition, not refined prefixes
    for kv in extra_env:
        k, _, v = kv.partition("=")
        env[k] = v
    return ServiceProcess(Path(tempfile.mkdtemp(prefix="skillcache-load-")), env, threads=threads or None,
                          root=Path(src) if src else ROOT).start()


_SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+([0-9.eE+-]+|NaN|[+-]Inf)$')


def scrape(client: httpx.Client) -> dict:
    """From /metrics: skill hits by tier, and the fidelity guard's background jobs (shadow checks,
    calibrations), each summed over any other labels."""
    hits: dict[str, float] = {}
    bg = {"shadow": 0.0, "calibrations": 0.0}
    for line in client.get("/metrics").text.splitlines():
        m = _SAMPLE_RE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "skillcache_skill_hits_total":
            tier = re.search(r'tier="([^"]*)"', labels)
            if tier:
                hits[tier.group(1)] = hits.get(tier.group(1), 0.0) + value
        elif name == "skillcache_shadow_checks_total":
            bg["shadow"] += value
        elif name == "skillcache_calibrations_total":
            bg["calibrations"] += value
    return {"hits": hits, **bg}


def settle(client: httpx.Client, names: list[str], timeout_s: float) -> None:
    """Wait for the service's background seam calibrations of `names` (run when the worker is idle,
    they would otherwise stall measured requests): until each skill reports a calibration, or no
    calibration has finished for 20 s (calibration off), or timeout_s."""
    t0 = last_change = time.time()
    last = None
    while time.time() - t0 < timeout_s:
        cal = scrape(client)["calibrations"]
        if cal != last:
            last, last_change = cal, time.time()
        recs = [client.get(f"/v1/skills/{n}").json() for n in names]
        if not any("calibration" in r for r in recs):
            return  # a service without seam calibration
        if all(r.get("calibration") for r in recs):
            seams = ", ".join(f"{n}: seam {r['calibration']['seam']}" for n, r in zip(names, recs))
            print(f"calibrated ({seams})", flush=True)
            return
        if time.time() - last_change > 20:
            print("no seam calibration running (seam_auto off?): not waiting", flush=True)
            return
        time.sleep(2)
    print(f"warning: skills still not calibrated after {timeout_s:.0f} s; measuring anyway", flush=True)


def register(client: httpx.Client, skill: dict, compile_now: bool = True) -> dict:
    body = {k: skill[k] for k in ("name", "text", "description", "fields") if skill.get(k) is not None}
    r = client.post("/v1/skills", params={"compile": str(compile_now).lower()}, json=body, timeout=600)
    if r.status_code not in (200, 201):
        raise SystemExit(f"registering {skill['name']} failed: HTTP {r.status_code} {r.text[:500]}")
    return r.json()


# ---- requests -------------------------------------------------------------------------------
class Workload:
    """Builds the i-th request of an arm. Unique values carry the run tag, so no two requests
    (across arms and rates) write the same field value."""

    def __init__(self, args, policy: dict, tag: str) -> None:
        self.args, self.policy, self.tag = args, policy, tag
        self.orders = list(itertools.permutations(args.order_skills))

    def value(self, key: str, i: int) -> str:
        return f"{STATUSES[i % len(STATUSES)]} (carrier scan {self.tag}-{key}-{i:04d})"

    def request(self, arm: str, key: str, i: int) -> tuple[dict, dict | None]:
        """(the compose body, a skill to register first or None)."""
        base = {"max_tokens": self.args.max_tokens, "temperature": 0.0, "stream": True}
        if self.args.seam >= 0:
            base["seam_tokens"] = self.args.seam
        if arm in ("in_place", "erratum"):
            value = self.value(key, i)
            user = POLICY_QUESTIONS[i % len(POLICY_QUESTIONS)].format(i=i)
            if arm == "erratum":
                return {**base, "system": SYSTEM, "skills": [POLICY_NAME], "user": user,
                        "fields": {"order_status": value}, "edit_mode": "erratum"}, None
            text = render(self.policy["text"], {**self.policy["fields"], "order_status": value})
            if self.args.inplace_via == "skill":
                return {**base, "system": SYSTEM, "user": user}, {"name": INPLACE_NAME, "text": text}
            # the same layout as the composed prompt: system, "\n\n", the policy text
            return {**base, "system": SYSTEM + "\n\n" + text, "skills": [], "user": user}, None
        order = list(self.orders[i % len(self.orders)])
        return {**base, "system": SYSTEM, "skills": order, "user": ORDER_QUESTIONS[i % len(ORDER_QUESTIONS)],
                "mode": "full" if arm == "full" else "compose"}, None


async def one(client: httpx.AsyncClient, body: dict, register_first: dict | None, t_sched: float,
              first_token: asyncio.Event | None = None) -> dict:
    """Send one request at once; times are measured from t_sched (its scheduled arrival). first_token, when
    given, is set as the first token arrives (bench/peers.py sends a request during another's decode)."""
    rec: dict = {"t_sched": t_sched, "status": None, "error": None, "ttft_s": None, "e2e_s": None,
                 "ttft_from_done": False, "text": ""}
    try:
        if register_first:  # in_place via skill: a new version of the edited policy, compiled on first use
            r = await client.post("/v1/skills", params={"compile": "false"}, json=register_first)
            if r.status_code not in (200, 201):
                rec.update(status=r.status_code, error=_error_type(r.text) or f"http_{r.status_code}")
                return rec
            body = {**body, "skills": [{"name": register_first["name"], "version": r.json()["version"]}]}
        async with client.stream("POST", "/v1/compose", json=body) as resp:
            rec["status"] = resp.status_code
            if resp.status_code != 200:
                rec["error"] = _error_type((await resp.aread()).decode(errors="replace")) or f"http_{resp.status_code}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                now = time.perf_counter()
                if ev["type"] == "delta":
                    rec["text"] += ev["text"]
                    if rec["ttft_s"] is None:
                        rec["ttft_s"] = now - t_sched
                elif ev["type"] == "done":
                    if rec["ttft_s"] is None:
                        rec["ttft_s"], rec["ttft_from_done"] = now - t_sched, True
                    rec["usage"], rec["timings"] = ev.get("usage"), ev.get("timings")
                    rec["sources"] = [s.get("source") for s in ev.get("skills") or []]
                elif ev["type"] == "error":
                    rec["error"] = (ev.get("error") or {}).get("type", "stream_error")
                if first_token is not None and rec["ttft_s"] is not None:
                    first_token.set()
            rec["e2e_s"] = time.perf_counter() - t_sched
            if rec["error"] is None and "usage" not in rec:
                rec["error"] = "no_done_event"
    except asyncio.CancelledError:
        rec["error"] = "deadline"
    except httpx.HTTPError as e:
        rec["error"] = type(e).__name__
    return rec


def _error_type(text: str) -> str | None:
    try:
        return json.loads(text)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return None


async def _bounded(coro, deadline: float) -> dict | None:
    """Run a request until the global deadline; past it the request is cancelled (recorded as such)."""
    task = asyncio.ensure_future(coro)
    try:
        return await asyncio.wait_for(asyncio.shield(task), timeout=max(0.0, deadline - time.perf_counter()))
    except asyncio.TimeoutError:
        task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            return None


async def open_loop(client, make, n: int, rate: float, rng: random.Random, deadline: float) -> tuple[list, float]:
    t0 = time.perf_counter()
    t, tasks = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        if t0 + t >= deadline:
            break
        await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
        body, reg = make(i)
        tasks.append(asyncio.create_task(_bounded(one(client, body, reg, t0 + t), deadline)))
    recs = await asyncio.gather(*tasks)
    return [r if r is not None else {"error": "deadline"} for r in recs], t0


async def closed_loop(client, make, n: int, concurrency: int, deadline: float) -> tuple[list, float]:
    t0 = time.perf_counter()
    counter = itertools.count()
    recs: list = []

    async def worker() -> None:
        while True:
            i = next(counter)
            if i >= n or time.perf_counter() >= deadline:
                return
            body, reg = make(i)
            r = await _bounded(one(client, body, reg, time.perf_counter()), deadline)
            recs.append(r if r is not None else {"error": "deadline"})

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return recs, t0


# ---- stats ----------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100)."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(scenario: str, arm: str, rate, recs: list[dict], t0: float, m0: dict, m1: dict,
              n_planned: int) -> dict:
    hits0, hits1 = m0["hits"], m1["hits"]
    ok = [r for r in recs if r.get("error") is None and r.get("e2e_s") is not None]
    errors: dict[str, int] = {}
    for r in recs:
        if r.get("error") is not None:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    ends = [r["t_sched"] + r["e2e_s"] for r in ok]
    wall = (max(ends) - t0) if ends else None
    ttft = [r["ttft_s"] for r in ok]
    e2e = [r["e2e_s"] for r in ok]
    server_ttft = [r["timings"]["ttft_ms"] / 1e3 for r in ok if r.get("timings")]
    delta = {k: hits1.get(k, 0.0) - hits0.get(k, 0.0) for k in set(hits0) | set(hits1)}
    delta = {k: v for k, v in delta.items() if v}
    total_hits = sum(delta.values())
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok)
    reused = sum(r["usage"]["reused_tokens"] for r in ok)
    prefix = sum(r["usage"].get("prefix_tokens", 0) for r in ok)  # from refined skill sequences (exact)
    return {
        "scenario": scenario, "arm": arm, "rate": rate, "planned": n_planned, "sent": len(recs), "ok": len(ok),
        "errors": errors, "wall_s": wall, "throughput_rps": (len(ok) / wall) if wall else None,
        "ttft_s": {p: pct(ttft, q) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))},
        "e2e_s": {p: pct(e2e, q) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))},
        "server_ttft_p50_s": pct(server_ttft, 50),
        "ttft_from_done": sum(r["ttft_from_done"] for r in ok),
        "skill_hits": delta,
        "hit_rate": ((total_hits - delta.get("compiled", 0.0)) / total_hits) if total_hits else None,
        "prompt_tokens_mean": prompt / len(ok) if ok else None, "reuse_ratio": reused / prompt if prompt else None,
        "prefix_ratio": prefix / prompt if prompt else None,
        # the service's fidelity guard working on the same worker during the arm (stalls requests)
        "shadow_checks": m1["shadow"] - m0["shadow"], "calibrations": m1["calibrations"] - m0["calibrations"],
    }


def fmt(v, scale: float = 1.0, spec: str = "8.2f") -> str:
    return f"{'-':>{spec.split('.')[0]}s}" if v is None else format(v * scale, spec)


HEADER = (f"{'scenario':8s} {'arm':9s} {'rate':>6s} {'ok/sent':>7s} {'err':>4s} {'TTFT p50':>8s} {'p90':>8s} "
          f"{'p99':>8s} {'e2e p50':>8s} {'p90':>8s} {'p99':>8s} {'srvTTFT':>8s} {'thr r/s':>8s} {'hit':>5s} "
          f"{'reuse':>5s} {'exact':>5s} {'prompt':>6s} {'bg':>3s}")


def row_line(s: dict) -> str:
    rate = s["rate"] if isinstance(s["rate"], str) else f"{s['rate']:g}"
    return (f"{s['scenario']:8s} {s['arm']:9s} {rate:>6s} {str(s['ok']) + '/' + str(s['sent']):>7s} "
            f"{sum(s['errors'].values()):4d} "
            + " ".join(fmt(s["ttft_s"][p]) for p in ("p50", "p90", "p99")) + " "
            + " ".join(fmt(s["e2e_s"][p]) for p in ("p50", "p90", "p99")) + " "
            + f"{fmt(s['server_ttft_p50_s'])} {fmt(s['throughput_rps'], 1, '8.3f')} {fmt(s['hit_rate'], 1, '5.2f')} "
            f"{fmt(s['reuse_ratio'], 1, '5.2f')} {fmt(s['prefix_ratio'], 1, '5.2f')} "
            f"{fmt(s['prompt_tokens_mean'], 1, '6.0f')} "
            f"{int(s['shadow_checks'] + s['calibrations']):3d}")


def print_tables(rows: list[dict]) -> None:
    print("\nTTFT / e2e in seconds (client side, from the scheduled arrival); srvTTFT = the server's ttft_ms p50;\n"
          "hit = skill blocks from a tier / all; reuse = reused / prompt tokens; exact = prompt tokens from refined\n"
          "skill sequences; bg = the service's shadow checks and seam calibrations during the arm "
          "(they hold the worker)")
    print(HEADER)
    for s in rows:
        print(row_line(s))
    for scen, (a, b) in ARMS.items():  # the paper's ratios: baseline arm / cached arm
        for rate in dict.fromkeys(r["rate"] for r in rows):
            x = next((r for r in rows if r["scenario"] == scen and r["arm"] == a and r["rate"] == rate), None)
            y = next((r for r in rows if r["scenario"] == scen and r["arm"] == b and r["rate"] == rate), None)
            if x and y and x["ttft_s"]["p90"] and y["ttft_s"]["p90"] and x["throughput_rps"] and y["throughput_rps"]:
                ratio = x["ttft_s"]["p90"] / y["ttft_s"]["p90"]
                print(f"{scen:8s} rate {rate!s:>11s}: p90 TTFT {a}/{b} = {ratio:6.1f}x, "
                      f"throughput {b}/{a} = {y['throughput_rps'] / x['throughput_rps']:5.2f}x")


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(r["rate"] for r in rows))
    x = {r: i for i, r in enumerate(rates)}
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"in_place": "o-", "erratum": "s-", "full": "^--", "compose": "v--"}
    for scen, arms in ARMS.items():
        for arm in arms:
            rs = [r for r in rows if r["scenario"] == scen and r["arm"] == arm]
            pts = [(x[r["rate"]], r["ttft_s"]["p90"]) for r in rs if r["ttft_s"]["p90"] is not None]
            if pts:
                ax[0].plot(*zip(*pts), styles[arm], label=f"{scen}: {arm}")
            pts = [(x[r["rate"]], r["throughput_rps"]) for r in rs if r["throughput_rps"] is not None]
            if pts:
                ax[1].plot(*zip(*pts), styles[arm], label=f"{scen}: {arm}")
    labels = [f"{r:g}" if not isinstance(r, str) else r for r in rates]
    ax[0].set(yscale="log", xticks=range(len(rates)), xticklabels=labels, xlabel="offered load (req/s)",
              ylabel="p90 TTFT, client side (s)", title="p90 time to first token")
    ax[1].set(xticks=range(len(rates)), xticklabels=labels, xlabel="offered load (req/s)",
              ylabel="completed requests / s", title="throughput")
    for a in ax:
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# ---- main -----------------------------------------------------------------------------------
async def run_all(args, url: str, policy: dict, deadline: float) -> list[dict]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sync = httpx.Client(base_url=url, headers=headers, timeout=600)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    timeout = httpx.Timeout(connect=10.0, read=args.timeout_s, write=30.0, pool=args.timeout_s)
    tag = f"{random.Random().getrandbits(24):06x}"
    work = Workload(args, policy, tag)
    arms = [(scen, arm) for scen in args.scenarios for arm in ARMS[scen]]
    rates: list = list(args.rates) + (["unthrottled"] if args.unthrottled else [])
    rows: list[dict] = []
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout) as client:
        # warm-up: one request per arm (not measured): blocks compiled and in memory, code paths warm
        for scen, arm in arms:
            body, reg = work.request(arm, "warm", 0)
            r = await one(client, body, reg, time.perf_counter())
            print(f"warm-up {scen}/{arm}: {r['error'] or 'ok'} e2e={fmt(r['e2e_s'], 1, '.2f')} s "
                  f"prompt={(r.get('usage') or {}).get('prompt_tokens')} sources={r.get('sources')}", flush=True)
            if r["error"]:
                raise SystemExit(f"warm-up request failed ({r['error']}); is the service healthy?")
        used = ([POLICY_NAME] if "policy" in args.scenarios else []) + \
            (list(args.order_skills) if "order" in args.scenarios else [])
        if args.url or args.guard:  # a service started here without the guard calibrates nothing
            await asyncio.to_thread(settle, sync, used, args.settle_s)
        for ri, rate in enumerate(rates):
            for scen, arm in arms:
                if time.perf_counter() >= deadline:
                    print(f"deadline reached: skipping {scen}/{arm} at {rate}", flush=True)
                    continue
                key = f"r{ri}"
                rng = random.Random(args.seed * 1000 + ri)  # both arms of a rate see the same arrival times
                m0 = scrape(sync)

                def make(i, arm=arm, key=key):
                    return work.request(arm, key, i)

                if rate == "unthrottled":
                    recs, t0 = await closed_loop(client, make, args.requests, args.concurrency, deadline)
                else:
                    recs, t0 = await open_loop(client, make, args.requests, rate, rng, deadline)
                s = summarize(scen, arm, rate if rate != "unthrottled" else f"closed{args.concurrency}",
                              recs, t0, m0, scrape(sync), args.requests)
                s["records"] = recs
                rows.append(s)
                print(row_line(s), flush=True)
    if args.inplace_via == "skill" and "policy" in args.scenarios:
        sync.delete(f"/v1/skills/{INPLACE_NAME}")  # the per-request versions and their blocks
    sync.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running service (loopback only); default: start one (--start)")
    ap.add_argument("--start", action="store_true", help="start `python -m service` on a free port (the default)")
    ap.add_argument("--model", help="SKILLCACHE_MODEL for the started service (default: its own default)")
    ap.add_argument("--src", help="run the started service from this source tree (e.g. a checkout of an older commit)")
    ap.add_argument("--server-env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="env for the started service (it does not inherit SKILLCACHE_* from this shell)")
    ap.add_argument("--server-threads", type=int, default=0,
                    help="OMP_NUM_THREADS for the started service (0: inherit). On a shared CPU use 1: "
                         "oversubscribed OpenMP threads make composes and decode steps much slower")
    ap.add_argument("--guard", action="store_true",
                    help="keep the started service's background work (seam calibration after each compile, 2%% "
                         "shadow checks, prefix refinement): full prefills on the same worker. Default: off")
    ap.add_argument("--seam", type=int, default=4,
                    help="seam_tokens sent with every request (-1: omit, the service's calibrated/default seam)")
    ap.add_argument("--settle-s", type=float, default=600,
                    help="wait up to this long for background seam calibrations before measuring")
    ap.add_argument("--keep-home", action="store_true", help="keep the started service's temporary home (and log)")
    ap.add_argument("--api-key", default=os.environ.get("SKILLCACHE_API_KEY"), help="Bearer key (admin, to register)")
    ap.add_argument("--scenarios", nargs="+", default=["policy", "order"], choices=list(ARMS))
    ap.add_argument("--rates", type=float, nargs="*", default=[0.2, 0.5, 1.0], help="open-loop arrival rates (req/s)")
    ap.add_argument("--unthrottled", action=argparse.BooleanOptionalAction, default=True,
                    help="also a closed-loop arm with --concurrency clients")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=12, help="requests per arm and rate")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--deadline-s", type=float, default=900, help="global bound on the measured part of the run")
    ap.add_argument("--timeout-s", type=float, default=300, help="per-request read timeout")
    ap.add_argument("--policy-skills", nargs="+", default=["refund-policy", "tool-specs", "style-guide"])
    ap.add_argument("--order-skills", nargs="+", default=["refund-policy", "shipping-faq", "tool-specs"])
    ap.add_argument("--inplace-via", choices=["system", "skill"], default="system")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args()

    t_start = time.perf_counter()
    service = None
    if args.url:
        host = httpx.URL(args.url).host
        if host not in LOOPBACK:
            raise SystemExit(f"--url must be a loopback address (got {host!r})")
        url = args.url.rstrip("/")
    else:
        service = start_service(args.model, args.server_env, args.server_threads, args.guard, args.src)
        print(f"starting the service on {service.url} (home {service.home})", flush=True)
    try:
        if service:
            try:
                service.wait_ready(600)
            except ServiceNotReady as e:
                raise SystemExit(str(e)) from None
            url = service.url
            print(f"ready after {time.perf_counter() - t_start:.0f} s", flush=True)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        with httpx.Client(base_url=url, headers=headers, timeout=600) as c:
            ready = c.get("/readyz").json()
            policy = policy_skill(args.policy_skills)
            rec = register(c, policy) if "policy" in args.scenarios else None
            for name in args.order_skills if "order" in args.scenarios else []:
                register(c, {**load_skill(name)})
        if rec:
            print(f"{POLICY_NAME}: {rec['n_tokens']} tokens, version {rec['version']}, fields {rec['fields']}",
                  flush=True)
        deadline = time.perf_counter() + args.deadline_s
        rows = asyncio.run(run_all(args, url, policy, deadline))
    finally:
        if service:
            service.stop()
            if not args.keep_home:
                shutil.rmtree(service.home, ignore_errors=True)
    print_tables(rows)
    elapsed = time.perf_counter() - t_start
    print(f"\nelapsed {elapsed:.0f} s", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "model": ready.get("model"), "url": url if not service else "started", "args": vars(args),
            "policy_tokens": rec["n_tokens"] if rec else None, "elapsed_s": elapsed, "rows": rows}, indent=2))
    if args.png:
        plot(rows, args.png, f"skillcache load test: {ready.get('model')}, max_tokens {args.max_tokens}")


if __name__ == "__main__":
    main()
