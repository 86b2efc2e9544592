"""The serving engine side by side: head-of-line blocking, throughput over concurrent streams, batched = serial.

    python bench/engine.py --baseline-src /tmp/skillcache-before --json bench/out/engine.json --png docs/img/engine.png

Each arm is a `python -m service` started here on loopback with the embedded model, the shipped skills, the guard's
background work off (every measured request is the arm's own) and torch's own thread count. All arms are up at once,
each idle but for its own rounds, and the rounds alternate between the arms, so a drift in the machine's speed falls
on every arm alike:
  batched  this tree, default settings (SKILLCACHE_MAX_RUNNING_SEQS 16)
  serial   this tree, SKILLCACHE_MAX_RUNNING_SEQS=1: one request at a time on the same engine
  unshared this tree, SKILLCACHE_SHARED_KV_READS=false: each decode row reads its own K/V, also where rows on the
           same skill hold the same (--arms picks among these three; batched and serial by default)
  before   --baseline-src: a checkout of the commit before the serving engine (the one-request worker)
Scenarios (all requests stream, greedy, client-side timing):
  hol         a 2-token request on tool-specs, idle, and arriving 1 s into another request's 200-token answer
  throughput  N concurrent 48-token streams (composes of one shipped skill, a different question each):
              completion tokens / wall time from the first send to the last [DONE], N in --streams; and the
              decode phase alone: each stream's tokens after its first / its time after its first, summed
  agree       16 mixed concurrent greedy requests (1-3 skills, several max_tokens): texts against the serial
              arm's, which runs them one at a time (batched rows differ from solo only at float rounding)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from load import one  # noqa: E402  (bench/ is sys.path[0] when run as a script)
from service.devserver import ROOT, ServiceProcess

QUIET = {"SKILLCACHE_SEAM_AUTO": "false", "SKILLCACHE_SHADOW_SAMPLE_RATE": "0", "SKILLCACHE_REFINE_AFTER": "0",
         "SKILLCACHE_SKILLS_DIR": str(ROOT / "skills")}
SHORT = {"skills": ["tool-specs"], "user": "Which tool looks up an order?", "max_tokens": 2}
LONG = {"skills": ["refund-policy"], "max_tokens": 200, "user": "Explain every rule of the refund policy in detail, "
        "with an example for each, and then summarise them."}
QUESTIONS = ["What should I do first?", "Summarise the most important rule.", "Give me three examples.",
             "What if the customer is angry?", "Explain it to a new colleague.", "What are the exceptions?",
             "Write a short reply to a customer.", "List the steps in order."]
SKILLS = ["refund-policy", "tool-specs", "style-guide", "shipping-faq", "account-security", "escalation-playbook"]


def start(name: str, root: Path, env: dict) -> ServiceProcess:
    svc = ServiceProcess(Path(tempfile.mkdtemp(prefix=f"skillcache-{name}-")), {**QUIET, **env}, name=name,
                         threads=None, root=root).start()
    svc.wait_ready(600)
    return svc


def body(**kw) -> dict:
    return {"temperature": 0.0, "stream": True, "seam_tokens": 4, **kw}


async def timed(client: httpx.AsyncClient, b: dict) -> dict:
    return await one(client, b, None, time.perf_counter())


async def hol(url: str, repeats: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        await timed(c, body(**SHORT))  # warm
        idle = [(await timed(c, body(**SHORT)))["ttft_s"] for _ in range(repeats)]
        loaded, long_tokens = [], []
        for _ in range(repeats):
            long = asyncio.create_task(timed(c, body(**LONG)))
            await asyncio.sleep(1.0)
            short = await timed(c, body(**SHORT))
            loaded.append(short["ttft_s"])
            rec = await long
            long_tokens.append(rec["usage"]["completion_tokens"])
            if rec["e2e_s"] < 1.0 + short["ttft_s"]:
                print(f"  note: the long answer ended before the short one started ({rec['e2e_s']:.2f} s)")
    i, lo = statistics.median(idle), statistics.median(loaded)
    return {"idle_ttft_ms": i * 1e3, "loaded_ttft_ms": lo * 1e3, "ratio": lo / i, "long_tokens": long_tokens}


async def throughput(url: str, n: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        await timed(c, body(skills=["style-guide"], user="warm up", max_tokens=4))
        t0 = time.perf_counter()
        recs = await asyncio.gather(*(one(c, body(skills=[SKILLS[i % 3]], user=QUESTIONS[i % len(QUESTIONS)],
                                                  max_tokens=48), None, t0) for i in range(n)))
        wall = time.perf_counter() - t0
    tokens = sum(r["usage"]["completion_tokens"] for r in recs if r.get("usage"))
    errors = [r["error"] for r in recs if r["error"]]
    # each stream's tokens after its first over the time after its first, summed: the decode phase alone
    decode = sum((r["usage"]["completion_tokens"] - 1) / (r["e2e_s"] - r["ttft_s"]) for r in recs
                 if r.get("usage") and r["ttft_s"] and r["e2e_s"] > r["ttft_s"])
    return {"streams": n, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "errors": errors,
            "decode_tokens_per_s": decode,
            "ttft_p50_ms": statistics.median(r["ttft_s"] for r in recs if r["ttft_s"]) * 1e3}


def mixed(i: int) -> dict:
    k = 1 + i % 3
    skills = [SKILLS[(i + j) % len(SKILLS)] for j in range(k)]
    return {"skills": skills, "user": QUESTIONS[i % len(QUESTIONS)], "max_tokens": [8, 16, 24, 32][i % 4]}


async def texts(url: str, n: int) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        reqs = [mixed(i) for i in range(n)]
        out = await asyncio.gather(*(c.post("/v1/compose", json={**r, "temperature": 0.0, "seam_tokens": 4})
                                     for r in reqs))
    return [r.json()["text"] for r in out]


def run(args) -> dict:
    arms = {"batched": (ROOT, {}), "serial": (ROOT, {"SKILLCACHE_MAX_RUNNING_SEQS": "1"}),
            "unshared": (ROOT, {"SKILLCACHE_SHARED_KV_READS": "false"})}
    arms = {k: arms[k] for k in args.arms}
    if args.baseline_src:  # its own converted-model cache: an older loader names (and prunes) conversions otherwise
        arms["before"] = (Path(args.baseline_src), {"SKILLCACHE_MODEL_CACHE": str(Path(args.baseline_src) / ".models")})
    results: dict = {"arms": {name: {} for name in arms}, "agree": None}
    texts_of: dict[str, list[str]] = {}
    svcs: dict[str, ServiceProcess] = {}
    try:  # every arm's service up at once, idle but for its own rounds: the rounds alternate between the arms
        for name, (root, env) in arms.items():
            print(f"== {name} ({root})", flush=True)
            svcs[name] = start(name, root, env)
        if "hol" in args.scenarios:
            for name, svc in svcs.items():
                res = results["arms"][name]["hol"] = asyncio.run(hol(svc.url, args.repeats))
                print(f"  {name}: head-of-line: idle {res['idle_ttft_ms']:.0f} ms, during a long answer "
                      f"{res['loaded_ttft_ms']:.0f} ms ({res['ratio']:.1f}x)", flush=True)
        if "throughput" in args.scenarios:
            for n in args.streams:
                for name, svc in svcs.items():
                    row = asyncio.run(throughput(svc.url, n))
                    results["arms"][name].setdefault("throughput", []).append(row)
                    print(f"  {name}: {n:2d} streams: {row['tokens_per_s']:6.1f} tokens/s ({row['tokens']} tokens "
                          f"in {row['wall_s']:.1f} s), decode phase {row['decode_tokens_per_s']:6.1f} tokens/s, "
                          f"first token p50 {row['ttft_p50_ms']:.0f} ms, errors {row['errors']}", flush=True)
        if "agree" in args.scenarios:
            for name in ("batched", "serial"):
                if name in svcs:
                    texts_of[name] = asyncio.run(texts(svcs[name].url, 16))
    finally:
        for svc in svcs.values():
            svc.stop()
            shutil.rmtree(svc.home, ignore_errors=True)
    serial_texts, batched_texts = texts_of.get("serial"), texts_of.get("batched")
    if serial_texts and batched_texts:
        diff = [i for i, (a, b) in enumerate(zip(serial_texts, batched_texts)) if a != b]
        results["agree"] = {"n": 16, "equal": 16 - len(diff), "differ": [
            {"request": mixed(i), "serial": serial_texts[i], "batched": batched_texts[i]} for i in diff]}
        print(f"== agree: {16 - len(diff)} of 16 batched greedy texts equal the serial engine's", flush=True)
    return results


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in results["arms"].items():
        by_n: dict[int, list[float]] = {}
        for r in res.get("throughput") or []:  # rounds of the same stream count: their mean
            by_n.setdefault(r["streams"], []).append(r["tokens_per_s"])
        if by_n:
            ns = sorted(by_n)
            a.plot(ns, [statistics.mean(by_n[n]) for n in ns], marker="o", label=name)
    a.set(xscale="log", xlabel="concurrent 48-token streams", ylabel="completion tokens / s", title="Throughput")
    a.set_xticks([r for r in (1, 2, 4, 8, 16)], labels=["1", "2", "4", "8", "16"])
    a.legend()
    names = [n for n, r in results["arms"].items() if "hol" in r]
    idle = [results["arms"][n]["hol"]["idle_ttft_ms"] for n in names]
    loaded = [results["arms"][n]["hol"]["loaded_ttft_ms"] for n in names]
    x = range(len(names))
    b.bar([i - 0.2 for i in x], idle, 0.4, label="idle")
    b.bar([i + 0.2 for i in x], loaded, 0.4, label="1 s into a 200-token answer")
    b.set(xticks=list(x), xticklabels=names, yscale="log", ylabel="first token (ms)", title="Head-of-line")
    b.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-src", help="a checkout of the commit to compare with (arm 'before')")
    ap.add_argument("--scenarios", nargs="+", default=["hol", "throughput", "agree"],
                    choices=["hol", "throughput", "agree"])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--arms", nargs="+", choices=["batched", "serial", "unshared"], default=["batched", "serial"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = run(args)
    results["elapsed_s"] = time.perf_counter() - t0
    results["args"] = vars(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.png:
        plot(results, args.png)


if __name__ == "__main__":
    main()
