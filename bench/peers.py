"""Peer benchmark: skillcache against llama.cpp's `llama-server`, side by side on this machine.

    python bench/peers.py --json bench/out/peers.json --png docs/img/peers.png   # builds llama-server once
    python bench/peers.py --quick --arms a b                                       # a short check
    python bench/peers.py --engines skillcache --quick --arms a                    # no llama.cpp (the smoke test)
    python bench/peers.py --vllm                 # the vLLM arm instead: vLLM alone, skillcache on vLLM, embedded

The same model (the embedded SmolLM2-135M-Instruct: llama.cpp serves its Q4_1 GGUF, skillcache the same weights
dequantized to float32) and token-identical prompts: 3 shipped skills in the system turn, in --orders orders,
with --turns user turns each, rendered by skillcache's own PromptBuilder and the embedded tokenizer and sent to
llama-server's /completion as token ids (its tokens_evaluated must equal the ids sent, and skillcache's
prompt_tokens too, else the request counts as an error). Greedy, streaming, client-side timing.

  a  first-time orders: llama.cpp with cache_prompt off (every prompt token computed); skillcache with refinement
     off (SKILLCACHE_REFINE_AFTER=0: the blocks composed, as for an order never seen before)
  b  repeated orders (each primed twice first, then cycled): llama.cpp -np 1 with its default host prompt cache
     and --cache-reuse 256; skillcache as it is (an order composed twice is refined in the background)
  c  one stream's decode speed over --decode-tokens
  d  --concurrency streams at once (llama-server -np N), aggregate tokens/s over --stream-tokens each
  e  a short request sent while another request is in its long decode (first token vs the same request idle)

Before each engine's part of an arm the script waits until every server it started is idle (CPU), so one
engine's background work never lands on the other's clock. Loopback only; every server started is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

from common import write_json  # first: puts this checkout ahead of any installed copy on sys.path
import httpx
from load import LOOPBACK
from peers_llama import LLAMA_CPP_PYTHON, LlamaServer, ensure_llama_server
from peers_run import Peer, environment, loadavg, quiesce
from peers_stats import ENGINES, agreement, ratios, report, summarize
from peers_work import (LONG_TURNS, PRIME_TURNS, SHORT_TURNS, SKILLS, TURNS, WARM_TURN, Prompts, all_at_once,
                        one_by_one, send, short_during_long, skillcache_peer, start_service)

from service.devserver import ROOT
from service.runtime.loader import embedded_gguf_path


def row(arm: str, recs: dict[str, list[dict]], walls: dict | None = None) -> dict:
    s = {eng: summarize(recs.get(eng, []), (walls or {}).get(eng)) for eng in ENGINES}
    pairs = list(zip(recs.get("llama.cpp", []), recs.get("skillcache", [])))
    return {"arm": arm, **s, "ratio": ratios(s["llama.cpp"], s["skillcache"]), "agreement": agreement(pairs),
            "records": recs}


async def idle_wait(args, deadline: float) -> float:
    """Until every server this run started is idle: at most --settle-s, and not past the deadline."""
    return await quiesce(args.all_pids, max(0.0, min(args.settle_s, deadline - time.perf_counter())))


async def first_or_repeated(args, peer, prompts, deadline, first_time: bool) -> list[dict]:
    """a / b: every order with every turn, the order changing with every request."""
    specs = [(o, t, args.max_tokens) for t in TURNS[:args.turns] for o in args.order_list]
    # a: llama.cpp computes every prompt token (skillcache's refinement is off in that phase)
    cache_prompt = not (first_time and peer.engine == "llama.cpp")
    recs = await one_by_one(peer, prompts, specs, deadline, cache_prompt=cache_prompt)
    for r in recs if not cache_prompt else []:
        if r["error"] is None and r.get("prompt_n") != r["n_ids"]:
            r["error"] = f"cache_hit: llama.cpp computed {r.get('prompt_n')} of {r['n_ids']} prompt tokens"
    return recs


async def long_decode(args, peer, prompts, deadline) -> list[dict]:
    """c: long generations, one at a time (a repeated order, a new turn)."""
    specs = [(args.order_list[0], LONG_TURNS[i % len(LONG_TURNS)], args.decode_tokens)
             for i in range(args.long_requests)]
    return await one_by_one(peer, prompts, specs, deadline)


async def concurrent(args, peer, prompts, deadline) -> tuple[list[dict], float | None]:
    """d: a round to warm every slot (llama.cpp keeps K/V per slot), then the measured round on new turns."""
    orders = [args.order_list[i % len(args.order_list)] for i in range(args.concurrency)]
    per = len(args.order_list)
    await all_at_once(peer, prompts, [(o, PRIME_TURNS[i // per % len(PRIME_TURNS)], args.stream_tokens)
                                      for i, o in enumerate(orders)], deadline)
    await idle_wait(args, deadline)
    return await all_at_once(peer, prompts, [(o, TURNS[i % len(TURNS)], args.stream_tokens)
                                             for i, o in enumerate(orders)], deadline)


async def short_while_busy(args, peer, prompts, deadline) -> tuple[list[dict], list[dict], list[dict]]:
    """e: short requests idle, then others each during another request's long decode: (busy, idle, the long ones).
    Turns no request used before (llama.cpp would serve a whole repeated prompt from its cache)."""
    orders, n = args.order_list, args.max_tokens
    idle = await one_by_one(peer, prompts, [(orders[i % len(orders)], SHORT_TURNS[2 * i % len(SHORT_TURNS)], n)
                                            for i in range(args.e_repeats)], deadline)
    busy, longs = [], []
    for i in range(args.e_repeats):
        await idle_wait(args, deadline)
        long_spec = (orders[(i + 1) % len(orders)], LONG_TURNS[i % len(LONG_TURNS)], args.decode_tokens)
        short_spec = (orders[i % len(orders)], SHORT_TURNS[(2 * i + 1) % len(SHORT_TURNS)], n)
        short, long = await short_during_long(peer, prompts, long_spec, short_spec, args.e_delay_s, deadline)
        busy.append(short)
        longs.append(long)
    return busy, idle, longs


async def run_arm(arm: str, args, peers: dict, prompts: Prompts, deadline: float) -> list[dict]:
    """Every engine's part of one arm, each after all servers went idle. Returns the arm's table rows."""
    recs: dict[str, list] = {}
    walls: dict[str, float | None] = {}
    idle: dict[str, list] = {}
    longs: dict[str, list] = {}
    for eng, peer in peers.items():
        await idle_wait(args, deadline)
        if arm in "ab":
            recs[eng] = await first_or_repeated(args, peer, prompts, deadline, first_time=arm == "a")
        elif arm == "c":
            recs[eng] = await long_decode(args, peer, prompts, deadline)
        elif arm == "d":
            recs[eng], walls[eng] = await concurrent(args, peer, prompts, deadline)
        else:
            recs[eng], idle[eng], longs[eng] = await short_while_busy(args, peer, prompts, deadline)
        print(f"  {arm} {eng}: {sum(r['error'] is None for r in recs[eng])}/{len(recs[eng])} ok", flush=True)
    if arm != "e":
        return [row(arm, recs, walls)]
    return [row("e_idle", idle), {**row("e_busy", recs), "long_requests": longs}]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", default=list("abcde"), choices=list("abcde"))
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--quick", action="store_true", help="2 orders x 2 turns, shorter decodes, 4 streams, 1 repeat")
    ap.add_argument("--orders", type=int, default=4, help="skill orders (of the 6 permutations)")
    ap.add_argument("--turns", type=int, default=5, help=f"user turns per order (at most {len(TURNS)})")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=128, help="arms c and e: the long generation")
    ap.add_argument("--long-requests", type=int, default=3, help="arm c: long generations")
    ap.add_argument("--concurrency", type=int, default=8, help="arm d: streams at once (llama-server -np)")
    ap.add_argument("--stream-tokens", type=int, default=64, help="arm d: tokens per stream")
    ap.add_argument("--e-repeats", type=int, default=3)
    ap.add_argument("--e-delay-s", type=float, default=0.5,
                    help="arm e: the short request is sent this long after the long one's first token")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="CPU threads of both engines")
    ap.add_argument("--url", help="a running skillcache (loopback) instead of starting one; arm a then runs on it "
                                  "as it is (prefix_tokens in the JSON show refined hits)")
    ap.add_argument("--server-env", nargs="*", default=[], metavar="KEY=VALUE", help="for the started skillcache")
    ap.add_argument("--llama-version", default=LLAMA_CPP_PYTHON, help="llama-cpp-python sdist to build from")
    ap.add_argument("--build-jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--build-only", action="store_true", help="build (or find) llama-server and stop")
    ap.add_argument("--deadline-s", type=float, default=1800, help="bound on the measured part")
    ap.add_argument("--settle-s", type=float, default=600, help="bound on each wait for idle servers")
    ap.add_argument("--timeout-s", type=float, default=300, help="per-request read timeout")
    ap.add_argument("--keep-home", action="store_true", help="keep the temporary home (server logs)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "peers.json"))
    ap.add_argument("--png")
    ap.add_argument("--report", metavar="JSON", help="print the tables of (and plot) an earlier run's JSON; no run")
    args = ap.parse_args(argv)
    if args.quick:
        args.orders, args.turns, args.decode_tokens, args.long_requests = 2, 2, 32, 1
        args.concurrency, args.stream_tokens, args.e_repeats = 4, 16, 1
    args.order_list = list(itertools.permutations(SKILLS))[:max(1, min(args.orders, 6))]
    args.turns = max(1, min(args.turns, len(TURNS)))
    return args


STARTED: list = []  # every server this run started: main() stops them all, however the run ends


async def prime(peers: list[Peer], prompts: Prompts, orders, n: int, deadline: float) -> None:
    """Each order seen twice by every engine (skillcache refines a sequence composed twice, llama.cpp keeps it)."""
    for peer in peers:
        await one_by_one(peer, prompts, [(o, t, n) for t in PRIME_TURNS for o in orders], deadline)


async def measure(args, prompts: Prompts, build: tuple | None, stack: AsyncExitStack) -> dict:
    meta: dict = {"environment": environment()}
    home = Path(tempfile.mkdtemp(prefix="skillcache-peers-"))
    if not args.keep_home:
        stack.callback(shutil.rmtree, home, True)
    (home / "skills").mkdir()
    for name in SKILLS:  # preloaded by the started service: only what the benchmark uses
        shutil.copy(ROOT / "skills" / f"{name}.md", home / "skills")
    timeout = httpx.Timeout(connect=10.0, read=args.timeout_s, write=30.0, pool=args.timeout_s)

    def track(srv):  # stopped as the run unwinds (before its home is removed), and by main() in any case
        STARTED.append(srv)
        stack.callback(srv.stop)
        return srv

    def client(url: str) -> httpx.AsyncClient:
        c = httpx.AsyncClient(base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=64))
        stack.push_async_callback(c.aclose)
        return c

    llama: dict[str, Peer] = {}  # "one": -np 1 for arms a-c, "many": -np N for d and e
    if build is not None:
        binary, meta["llama_build"] = build
        turns = TURNS + LONG_TURNS + PRIME_TURNS + SHORT_TURNS
        longest = max(len(prompts.ids(o, t)) for o in args.order_list for t in turns)
        per_slot = -(-(longest + max(args.decode_tokens, args.stream_tokens, args.max_tokens) + 64) // 256) * 256
        servers = {}
        if set(args.arms) & set("abc"):
            servers["one"] = LlamaServer(binary, embedded_gguf_path(), home / "llama-np1.log", parallel=1,
                                         ctx=per_slot, threads=args.threads)
        if set(args.arms) & set("de"):
            servers["many"] = LlamaServer(binary, embedded_gguf_path(), home / "llama-npN.log",
                                          parallel=args.concurrency, ctx=per_slot * args.concurrency,
                                          threads=args.threads)
        for srv in servers.values():
            track(srv).start()
        for key, srv in servers.items():
            meta.setdefault("llama_servers", {})[key] = {**srv.wait_ready(), "args": srv.cmd[1:]}
            llama[key] = Peer("llama.cpp", client(srv.url), srv.proc.pid)
    phases = [(arms, refine) for arms, refine in (([a for a in "a" if a in args.arms], False),
                                                  ([a for a in "bcde" if a in args.arms], True)) if arms]
    rows: list[dict] = []
    deadline = time.perf_counter() + args.deadline_s
    for arms, refine in phases:
        sc = None
        if "skillcache" in args.engines:
            svc = None if args.url else track(start_service(home, args.threads, refine, args.server_env))
            sc = await skillcache_peer(args, svc, prompts, client, meta)
        pids = [p.pid for p in [*llama.values(), sc] if p is not None and p.pid]
        args.all_pids = pids
        await quiesce(pids, args.settle_s)  # skillcache's seam calibrations of freshly compiled skills
        if arms == ["a"]:  # warm-up, not measured
            for peer in [p for p in (llama.get("one"), sc) if p]:
                await send(peer, prompts, (args.order_list[0], WARM_TURN, 4), deadline, cache_prompt=False)
        else:
            await prime([p for p in (*llama.values(), sc) if p], prompts, args.order_list, args.max_tokens, deadline)
        for arm in arms:
            if time.perf_counter() >= deadline:
                print(f"deadline reached: arm {arm} skipped", flush=True)
                continue
            peers = {"llama.cpp": llama.get("many" if arm in "de" else "one"), "skillcache": sc}
            print(f"arm {arm} ...", flush=True)
            rows += await run_arm(arm, args, {k: v for k, v in peers.items() if v}, prompts, deadline)
        if sc is not None and sc.pid:
            svc.stop()  # the next phase starts its own (same home: the compiled, calibrated blocks from disk)
    meta["environment"]["loadavg_end"] = loadavg()
    return {**meta, "rows": rows}


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main() -> None:
    if "--vllm" in sys.argv[1:]:  # the vLLM arm: vLLM alone, skillcache on vLLM, the embedded engine (peers_vllm.py)
        from peers_vllm import main as vllm_main

        return vllm_main([a for a in sys.argv[1:] if a != "--vllm"])
    args = parse_args()
    if args.url and httpx.URL(args.url).host not in LOOPBACK:
        raise SystemExit(f"--url must be a loopback address (got {args.url})")
    if args.report:
        return report(json.loads(Path(args.report).read_text()), args.png)
    signal.signal(signal.SIGTERM, _interrupt)  # a TERM stops the build like Ctrl-C (its process group is killed)
    t0 = time.perf_counter()
    build = ensure_llama_server(args.llama_version, args.build_jobs) if "llama.cpp" in args.engines else None
    if args.build_only:
        return print(build[0] if build else "no llama.cpp engine", json.dumps(build[1] if build else {}, indent=2))
    prompts = Prompts(SKILLS)

    async def go():
        # in the loop a TERM cancels the run like Ctrl-C does (asyncio.run), and unwinds it
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
        async with AsyncExitStack() as stack:
            return await measure(args, prompts, build, stack)

    try:
        out = asyncio.run(go())
    except (KeyboardInterrupt, asyncio.CancelledError):
        raise SystemExit("interrupted") from None
    finally:
        for srv in STARTED:
            srv.stop()
    out.update(args={k: v for k, v in vars(args).items() if k not in ("all_pids",)}, elapsed_s=time.perf_counter() - t0,
               skill_tokens={n: len(v) for n, v in prompts.skill_ids.items()})
    write_json(args.json, out)
    report(out, args.png)

if __name__ == "__main__":
    main()
