"""Streams on vLLM alone and on skillcache on vLLM, interleaved: bench/peers_vllm.py's arms c and d, both engines up
and taking turns, because this machine's speed drifts over minutes more than the gap being measured.

    python bench/vllm_streams.py --json bench/out/vllm-streams.json [--rounds 6] [--concurrency 8] [--tokens 64]

Why: bench/peers_vllm.py measures each engine alone, one after the other, ~10 minutes apart. The same vLLM server,
the same prompt, streamed 64 tokens, decoded at 33 tokens/s in one run and 27 in the next (vLLM alone, 2-core EPYC
VM), and within a run single streams ranged 25-36 tokens/s. A 0.9x target cannot be read through that. Here both
servers run side by side (vLLM alone: no connector; skillcache in front of a vLLM started with its connector), and only
one of them works at a time: a round of arm c (one stream) or arm d (--concurrency streams at once) on one engine, the
servers left to go quiet (their idle threads stop spinning), then the same round on the other; the engine that goes
first alternates. Every stream generates --tokens tokens (`ignore_eos` on both: replies of one length, so tokens/s
compares speed, not how soon each reply ended). Prompts as bench/peers_vllm.py's (three shipped skills, an order of
them, a turn), primed as there (each order seen twice, then settled).

Reported per engine and arm: tokens/s (c: tokens / the sum of the streams' times; d: tokens / wall time of the
round), first token p50, each stream's decode rate p50 (tokens after the first / time from the first token to the
stream's end), and the ratio skillcache / vLLM alone.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from common import write_json  # first: puts this checkout ahead of any installed copy on sys.path
import httpx
from peers_run import environment as bench_environment, quiesce
from load import one as skillcache_one
from peers_vllm import descendants, vllm_one
from peers_work import PRIME_TURNS, SHORT_TURNS, SKILLS, TURNS, Prompts

from service.devserver import ROOT, ServiceProcess, free_port
from service.vllm.launch import VllmProcess, command, environment, fastest_dtype, model_dir

ENGINES = ("vllm", "skillcache-vllm")


async def stream(client: httpx.AsyncClient, engine: str, prompts: Prompts, order, user: str, n: int) -> dict:
    """One streamed reply of exactly n tokens (`ignore_eos`), read as bench/peers_vllm.py reads each engine: first
    token, end, and the decode rate between them."""
    t0 = time.perf_counter()
    if engine == "vllm":
        rec = await vllm_one(client, prompts.ids(order, user), n, t0, extra={"ignore_eos": True})
        tokens = rec.get("completion_tokens")
    else:
        rec = await skillcache_one(client, {"skills": list(order), "user": user, "max_tokens": n, "temperature": 0.0,
                                            "stream": True, "ignore_eos": True}, None, t0)
        tokens = (rec.get("usage") or {}).get("completion_tokens")
    if rec["error"] is not None or tokens != n:
        raise RuntimeError(f"{engine}: {tokens} tokens streamed, {n} asked (ignore_eos); error {rec['error']}")
    return {"tokens": n, "ttft_s": rec["ttft_s"], "e2e_s": rec["e2e_s"],
            "decode_tok_s": (n - 1) / (rec["e2e_s"] - rec["ttft_s"]) if n > 1 else None}


def summary(rounds: list[tuple[list[dict], float]], concurrent: bool) -> dict:
    recs = [r for rs, _ in rounds for r in rs]
    tokens = sum(r["tokens"] for r in recs)
    span = lambda rs, wall: wall if concurrent else sum(r["e2e_s"] for r in rs)  # noqa: E731
    return {"tok_s": tokens / sum(span(rs, w) for rs, w in rounds), "tokens": tokens, "streams": len(recs),
            "ttft_ms_p50": 1e3 * statistics.median(r["ttft_s"] for r in recs),
            "decode_tok_s_p50": statistics.median(r["decode_tok_s"] for r in recs if r["decode_tok_s"]),
            "round_tok_s": [round(sum(r["tokens"] for r in rs) / span(rs, w), 1) for rs, w in rounds]}


async def run(args, urls: dict[str, str], pids: list[int], prompts: Prompts) -> dict:
    orders = list(itertools.permutations(SKILLS))[:args.orders]
    clients = {e: httpx.AsyncClient(base_url=u, timeout=600, limits=httpx.Limits(max_connections=64))
               for e, u in urls.items()}
    out: dict = {"c": {e: [] for e in ENGINES}, "d": {e: [] for e in ENGINES}}
    try:
        for e in ENGINES:  # primed as bench/peers_vllm.py's arms b-d: every order seen twice
            for t in PRIME_TURNS:
                for o in orders:
                    await stream(clients[e], e, prompts, o, t, 4)
        await quiesce(pids, args.settle_s)
        for i in range(args.rounds):
            for e in (ENGINES if i % 2 == 0 else ENGINES[::-1]):
                t0 = time.perf_counter()
                rec = await stream(clients[e], e, prompts, orders[0], TURNS[i % len(TURNS)], args.tokens)
                out["c"][e].append(([rec], time.perf_counter() - t0))
                await quiesce(pids, 10.0)
            for e in (ENGINES if i % 2 == 0 else ENGINES[::-1]):
                specs = [(orders[j % len(orders)], SHORT_TURNS[(i + j) % len(SHORT_TURNS)])
                         for j in range(args.concurrency)]
                t0 = time.perf_counter()
                recs = await asyncio.gather(*(stream(clients[e], e, prompts, o, u, args.tokens) for o, u in specs))
                out["d"][e].append((list(recs), time.perf_counter() - t0))
                await quiesce(pids, 10.0)
            print(f"round {i + 1}/{args.rounds} done", flush=True)
    finally:
        for c in clients.values():
            await c.aclose()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--orders", type=int, default=4)
    ap.add_argument("--dtype", default=fastest_dtype()[0])
    ap.add_argument("--settle-s", type=float, default=60, help="after priming: skillcache's calibrations")
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "vllm-streams.json"))
    args = ap.parse_args()
    from service.config import Settings

    home = Path(tempfile.mkdtemp(prefix="skillcache-streams-"))
    (home / "skills").mkdir()
    for name in SKILLS:
        shutil.copy(ROOT / "skills" / f"{name}.md", home / "skills")
    prompts = Prompts(list(SKILLS), "embedded", None)
    model = model_dir(Settings())
    alone = VllmProcess(command(model, free_port(), None, dtype=args.dtype), environment(), home / "alone.log")
    inside = VllmProcess(command(model, free_port(), home / "spans", dtype=args.dtype), environment(),
                         home / "inside.log")
    svc = None
    t_start = time.perf_counter()
    try:
        for v in (alone, inside):
            v.start().wait_ready(900)
        svc = ServiceProcess(home / "sc", {"SKILLCACHE_ENGINE": "vllm", "SKILLCACHE_VLLM_URL": inside.url,
                                           "SKILLCACHE_VLLM_DTYPE": args.dtype,
                                           "SKILLCACHE_VLLM_SPANS_DIR": str(home / "spans"),
                                           "SKILLCACHE_SKILLS_DIR": str(home / "skills"),
                                           "SKILLCACHE_TORCH_THREADS": "1"}, name="skillcache-vllm", threads=1).start()
        svc.wait_ready(900)
        pids = [q for p in (alone, inside, svc) for q in descendants(p.proc.pid)]
        got = asyncio.run(run(args, {"vllm": alone.url, "skillcache-vllm": svc.url}, pids, prompts))
    finally:
        if svc is not None:
            svc.stop()
        for v in (inside, alone):
            v.stop()
        shutil.rmtree(home, ignore_errors=True)
    out: dict = {"environment": bench_environment(), "args": vars(args), "dtype": args.dtype, "arms": {}}
    for arm in ("c", "d"):
        s = {e: summary(got[arm][e], arm == "d") for e in ENGINES}
        s["ratio_tok_s"] = s["skillcache-vllm"]["tok_s"] / s["vllm"]["tok_s"]
        out["arms"][arm] = s
        print(f"arm {arm}: tokens/s vLLM alone {s['vllm']['tok_s']:.1f} (rounds {s['vllm']['round_tok_s']}), "
              f"skillcache on vLLM {s['skillcache-vllm']['tok_s']:.1f} (rounds {s['skillcache-vllm']['round_tok_s']})"
              f" = {s['ratio_tok_s']:.2f}x; first token p50 {s['vllm']['ttft_ms_p50']:.0f} / "
              f"{s['skillcache-vllm']['ttft_ms_p50']:.0f} ms; decode p50 {s['vllm']['decode_tok_s_p50']:.1f} / "
              f"{s['skillcache-vllm']['decode_tok_s_p50']:.1f} tokens/s", flush=True)
    out["elapsed_s"] = time.perf_counter() - t_start
    write_json(args.json, out)


if __name__ == "__main__":
    main()
