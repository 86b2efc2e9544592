"""The vLLM arm of bench/peers.py: vLLM alone, skillcache on vLLM and the embedded engine, side by side.

    python bench/peers.py --vllm --json bench/out/peers-vllm.json            # or: python bench/peers_vllm.py ...
    python bench/peers_vllm.py --quick                                         # a short check

Each engine runs alone on the machine (started, measured, stopped, then the next), on the same token ids: the three
shipped skills of bench/peers.py in every order, a user turn after them, rendered by skillcache's PromptBuilder.
  vllm            vLLM's OpenAI server (CPU build, its fastest dtype here, prefix caching on), sent the ids directly
  skillcache-vllm skillcache (SKILLCACHE_ENGINE=vllm) in front of the same vLLM started with skillcache's connector:
                  vLLM compiles the blocks and computes the seams, the connector moves and rotates K/V
  embedded        skillcache on its own engine (make run)
Arms (greedy, streamed, client-side timing):
  a  first-time orders: each order once, on a fresh server (skillcache's refinement off: each order composed)
  b  repeated orders: each order primed twice, then sent with new turns (prefix hits on every engine)
  c  one stream of --stream-tokens tokens, tokens/s
  d  --concurrency streams of --stream-tokens at once, aggregate tokens/s
     (c and d read speed through ~10 minutes of this machine's drift and replies of unequal length:
     bench/vllm_streams.py runs them with both engines up, taking turns, every reply --tokens long)
Also recorded: vLLM's prompt_tokens_by_source counters over arm a (who computed what) and, per prompt of arm a, the
greedy text of each engine (first-token agreement with vLLM alone, which computes every token itself).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import tempfile
import time
from pathlib import Path

from common import write_json  # first: puts this checkout ahead of any installed copy on sys.path
import httpx
from peers_run import Peer, environment, quiesce
from peers_stats import summarize
from peers_work import PRIME_TURNS, SHORT_TURNS, SKILLS, TURNS, Prompts, send

from service.devserver import ROOT, ServiceProcess, free_port
from service.vllm.client import prompt_tokens_by_source
from service.vllm.launch import SERVED_NAME, VllmProcess, command, environment as vllm_env, fastest_dtype, model_dir

ENGINES = ("vllm", "skillcache-vllm", "embedded")
WARM_SKILL = "shipping-faq"


async def vllm_one(client: httpx.AsyncClient, ids: list[int], n: int, t_sched: float, salt: str | None = None,
                   extra: dict | None = None) -> dict:
    """One streamed completion of `ids` on vLLM alone, in the record shape of peers_work.send; `salt`: vLLM's
    cache_salt (its prefix cache is shared only between requests with the same one); `extra`: more body fields."""
    rec: dict = {"error": None, "ttft_s": None, "e2e_s": None, "text": "", "status": None}
    body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": n, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    if salt is not None:
        body["cache_salt"] = salt
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = f"http_{r.status_code}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                for ch in obj.get("choices") or []:
                    if rec["ttft_s"] is None:
                        rec["ttft_s"] = time.perf_counter() - t_sched
                    rec["text"] += ch.get("text") or ""
                if obj.get("usage"):
                    u = obj["usage"]
                    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    rec.update(prompt_tokens=u["prompt_tokens"], completion_tokens=u["completion_tokens"],
                               prompt_computed=u["prompt_tokens"] - cached)
        rec["e2e_s"] = time.perf_counter() - t_sched
    except httpx.HTTPError as e:
        rec["error"] = type(e).__name__
    return rec


async def one(peer: Peer, prompts: Prompts, spec: tuple, t_sched: float | None = None) -> dict:
    t_sched = t_sched if t_sched is not None else time.perf_counter()
    if peer.engine != "vllm":
        return await send(peer, prompts, spec, time.perf_counter() + 600, t_sched=t_sched)
    order, user, n = spec
    ids = prompts.ids(order, user)
    rec = await vllm_one(peer.client, ids, n, t_sched)
    rec.update(engine=peer.engine, order=list(order), user=user, n_ids=len(ids))
    return rec


async def gather(peer, prompts, specs) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    recs = await asyncio.gather(*(one(peer, prompts, s, t_sched=t0) for s in specs))
    return list(recs), max((t0 + r["e2e_s"] for r in recs if r.get("e2e_s")), default=t0) - t0


def sources(url: str) -> dict[str, float]:
    return prompt_tokens_by_source(httpx.get(f"{url}/metrics", timeout=10).text)


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


class Engine:
    """One engine's processes: started, used as a Peer, stopped."""

    def __init__(self, name: str, args, home: Path) -> None:
        self.name, self.args, self.home = name, args, home
        self.vllm: VllmProcess | None = None
        self.svc: ServiceProcess | None = None
        self.memory: list[dict] = []  # service_memory() at each stop: after arm a, after arms b-d

    def start(self, refine: bool) -> str:
        a = self.args
        if self.name != "embedded":
            spans = self.home / "spans" if self.name == "skillcache-vllm" else None
            cmd = command(model_dir(_settings()), free_port(), spans, dtype=a.dtype)
            self.vllm = VllmProcess(cmd, vllm_env(a.kv_cache_gib), self.home / f"{self.name}-vllm.log").start()
            self.vllm.wait_ready(900)
            if self.name == "vllm":
                return self.vllm.url
        threads = a.threads if self.vllm is None else a.sc_vllm_threads  # as make run-vllm runs it
        env = {"SKILLCACHE_SKILLS_DIR": str(self.home / "skills"), "SKILLCACHE_TORCH_THREADS": str(threads),
               "SKILLCACHE_REFINE_AFTER": "1" if refine else "0"}
        if self.vllm is not None:  # refinement on vLLM as shipped (after SKILLCACHE_VLLM_REFINE_AFTER uses), or off
            env.update(SKILLCACHE_ENGINE="vllm", SKILLCACHE_VLLM_URL=self.vllm.url, SKILLCACHE_VLLM_DTYPE=a.dtype,
                       SKILLCACHE_VLLM_SPANS_DIR=str(self.home / "spans"))
            if not refine:
                env["SKILLCACHE_VLLM_REFINE_AFTER"] = "0"
        self.svc = ServiceProcess(self.home / self.name, env, name=self.name, threads=threads).start()
        self.svc.wait_ready(900)
        return self.svc.url

    def pids(self) -> list[int]:
        """The servers' processes with their children: vLLM's engine core and worker do its computing, and
        skillcache's refinements run there, after the responses."""
        roots = [p.proc.pid for p in (self.vllm, self.svc) if p is not None and p.proc is not None]
        return [q for r in roots for q in descendants(r)]

    def service_memory(self) -> dict | None:
        """skillcache's own process (not vLLM's): resident MiB now and at its peak, after what it served."""
        if self.svc is None or self.svc.proc is None:
            return None
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{self.svc.proc.pid}/status").read_text().splitlines()
                      if ":" in line)
        mib = lambda k: round(int(fields[k].split()[0]) / 1024, 1)  # noqa: E731  (kB)
        return {"rss_mib": mib("VmRSS"), "peak_rss_mib": mib("VmHWM")}

    def stop(self) -> None:
        if (mem := self.service_memory()) is not None:
            self.memory.append(mem)
        for p in (self.svc, self.vllm):
            if p is not None:
                p.stop()
        self.svc = self.vllm = None


def _settings():
    from service.config import Settings

    return Settings()


async def run_engine(name: str, args, home: Path, prompts: Prompts) -> dict:
    """Both phases of one engine: arm a on a fresh server (refinement off), then b-d on another (refinement on)."""
    out: dict = {"arms": {}}
    eng = Engine(name, args, home)
    timeout = httpx.Timeout(connect=10.0, read=600.0, write=30.0, pool=600.0)
    try:
        if "a" in args.arms:
            url = eng.start(refine=False)
            async with httpx.AsyncClient(base_url=url, timeout=timeout) as c:
                peer = Peer(name, c)
                await quiesce(eng.pids(), args.settle_s)  # skillcache's calibrations of the compiled skills
                # warm-up on a skill no measured prompt starts with: nothing of it is a prefix vLLM alone could reuse
                await one(peer, prompts, ((WARM_SKILL,), "Good morning.", 2))
                await quiesce(eng.pids(), args.settle_s)
                vurl = eng.vllm.url if eng.vllm else None
                before = sources(vurl) if vurl else {}
                recs = [await one(peer, prompts, (o, TURNS[i % len(TURNS)], args.max_tokens))
                        for i, o in enumerate(args.order_list)]
                if vurl:
                    after = sources(vurl)
                    out["vllm_sources_a"] = {k: after[k] - before.get(k, 0.0) for k in after}
                out["arms"]["a"] = {"summary": summarize(recs), "records": recs}
            eng.stop()
        rest = [a for a in "bcd" if a in args.arms]
        if rest:
            url = eng.start(refine=True)
            async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=64)) as c:
                peer = Peer(name, c)
                await quiesce(eng.pids(), args.settle_s)
                for t in PRIME_TURNS:  # every order seen twice (skillcache refines in the background after one)
                    for o in args.order_list:
                        await one(peer, prompts, (o, t, 4))
                await quiesce(eng.pids(), args.settle_s)
                if "b" in rest:
                    recs = [await one(peer, prompts, (o, t, args.max_tokens))
                            for t in SHORT_TURNS[:args.turns] for o in args.order_list]
                    out["arms"]["b"] = {"summary": summarize(recs), "records": recs}
                    await quiesce(eng.pids(), args.settle_s)
                if "c" in rest:
                    recs = [await one(peer, prompts, (args.order_list[0], TURNS[i % len(TURNS)], args.stream_tokens))
                            for i in range(args.repeats)]
                    out["arms"]["c"] = {"summary": summarize(recs), "records": recs}
                    await quiesce(eng.pids(), args.settle_s)
                if "d" in rest:
                    specs = [(args.order_list[i % len(args.order_list)], TURNS[i % len(TURNS)], args.stream_tokens)
                             for i in range(args.concurrency)]
                    await gather(peer, prompts, specs)  # warm: every slot and order once
                    await quiesce(eng.pids(), args.settle_s)
                    specs = [(o, SHORT_TURNS[i % len(SHORT_TURNS)], n) for i, (o, _, n) in enumerate(specs)]
                    recs, wall = await gather(peer, prompts, specs)
                    out["arms"]["d"] = {"summary": summarize(recs, wall), "records": recs}
    finally:
        eng.stop()
        if eng.memory:
            out["service_memory"] = eng.memory
    return out


def agreement(runs: dict) -> dict:
    """Per engine, over arm a's prompts: the same first word / the same whole text as vLLM alone."""
    base = {tuple(r["order"]): r for r in runs.get("vllm", {}).get("arms", {}).get("a", {}).get("records", [])}
    out = {}
    for eng, run in runs.items():
        recs = [r for r in run.get("arms", {}).get("a", {}).get("records", []) if r.get("error") is None]
        pairs = [(base[tuple(r["order"])], r) for r in recs if tuple(r["order"]) in base]
        pairs = [(a, b) for a, b in pairs if a.get("error") is None]
        out[eng] = {"pairs": len(pairs),
                    "first_word": sum(a["text"].split()[:1] == b["text"].split()[:1] for a, b in pairs),
                    "text": sum(a["text"] == b["text"] for a, b in pairs)}
    return out


def table(runs: dict) -> str:
    lines = [f"{'arm':4s} {'engine':16s} {'ok':>5s} {'TTFT p50':>9s} {'TTFT p90':>9s} {'tok/s':>7s} {'computed':>9s}"]
    for arm in "abcd":
        for eng in ENGINES:
            s = runs.get(eng, {}).get("arms", {}).get(arm, {}).get("summary")
            if s is None:
                continue
            f = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
            lines.append(f"{arm:4s} {eng:16s} {str(s['ok']) + '/' + str(s['n']):>5s} {f(s['ttft_p50'], '9.0f')} "
                         f"{f(s['ttft_p90'], '9.0f')} {f(s['tok_s'], '7.1f')} {f(s['prompt_computed_mean'], '9.0f')}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--arms", nargs="+", default=list("abcd"), choices=list("abcd"))
    ap.add_argument("--quick", action="store_true", help="2 orders, 2 turns, 4 streams of 16 tokens")
    ap.add_argument("--orders", type=int, default=6, help="skill orders (of the 6 permutations)")
    ap.add_argument("--turns", type=int, default=3, help="arm b: new turns per order")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=6, help="arm c: one-stream requests")
    ap.add_argument("--dtype", default=fastest_dtype()[0], help="vLLM's --dtype (default: the fastest on this machine)")
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="vLLM's cores and the embedded engine's threads")
    ap.add_argument("--sc-vllm-threads", type=int, default=1,
                    help="skillcache's torch threads beside vLLM (make run-vllm's default; docs/OPERATIONS.md)")
    ap.add_argument("--settle-s", type=float, default=300)
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "peers-vllm.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.orders, args.turns, args.concurrency, args.stream_tokens, args.repeats = 2, 2, 4, 16, 1
    args.order_list = list(itertools.permutations(SKILLS))[:max(1, min(args.orders, 6))]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    prompts = Prompts(SKILLS + [WARM_SKILL])
    home = Path(tempfile.mkdtemp(prefix="skillcache-peers-vllm-"))
    (home / "skills").mkdir()
    for name in SKILLS + [WARM_SKILL]:
        shutil.copy(ROOT / "skills" / f"{name}.md", home / "skills")
    t0 = time.perf_counter()
    out = {"environment": environment(), "args": {k: v for k, v in vars(args).items() if k != "order_list"},
           "skill_tokens": {n: len(v) for n, v in prompts.skill_ids.items() if n in SKILLS}, "runs": {}}
    try:
        for eng in args.engines:
            print(f"engine {eng} ...", flush=True)
            out["runs"][eng] = asyncio.run(run_engine(eng, args, home, prompts))
            print(table(out["runs"]), flush=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    out["agreement"] = agreement(out["runs"])
    out["elapsed_s"] = time.perf_counter() - t0
    write_json(args.json, out)
    print("\n" + table(out["runs"]))
    print("agreement with vLLM alone (arm a):", json.dumps(out["agreement"]))
    for eng, run in out["runs"].items():
        if "vllm_sources_a" in run:
            print(f"vLLM prompt tokens by source, arm a, {eng}:",
                  {k: round(v) for k, v in run["vllm_sources_a"].items()})
    for eng, run in out["runs"].items():
        if "service_memory" in run:
            print(f"skillcache's process after serving ({eng}): {run['service_memory']}")
    print("p50 TTFT ratios, vllm / skillcache-vllm: " + ", ".join(
        f"{arm} {pct_ratio(out['runs'], arm)}" for arm in "ab"))


def pct_ratio(runs: dict, arm: str) -> str:
    a = runs.get("vllm", {}).get("arms", {}).get(arm, {}).get("summary", {}).get("ttft_p50")
    b = runs.get("skillcache-vllm", {}).get("arms", {}).get(arm, {}).get("summary", {}).get("ttft_p50")
    return f"{a / b:.2f}x" if a and b else "-"


if __name__ == "__main__":
    main()
