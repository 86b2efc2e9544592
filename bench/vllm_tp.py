"""Tensor parallelism on vLLM with skillcache's connector: the same composed cases at TP=1 and at TP=N, greedy.

    flock /tmp/skillcache-heavy.lock python bench/vllm_tp.py --tp 3 --json bench/out/vllm-tp-smollm2.json
    flock /tmp/skillcache-heavy.lock python bench/vllm_tp.py --tp 2 --model <gemma-3-270m-q4_k_m.gguf> \
        --chat-template gemma --json bench/out/vllm-tp-gemma.json

For each TP size in turn (1, then N): one vLLM server (service.vllm.launch: --tensor-parallel-size N, the connector,
its spans in a fresh folder, VLLM_CPU_KVCACHE_SPACE from --kv-gib, the ranks' cores from launch.environment) and
skillcache in process on it (SKILLCACHE_ENGINE=vllm, the shipped skills of skills/, refinement off: every case
composed). Each shipped skill is composed alone once (vLLM compiles its block and every rank's connector saves its K/V
heads), then the cases run: the shipped skills in orders of two and three, each with a user turn, temperature 0,
--max-tokens tokens. Per case: the first token (and the text), skillcache's usage and the delta of vLLM's
`vllm:prompt_tokens_by_source_total` (external_kv_transfer: tokens the connector loaded; local_compute; local_cache_hit)
over the request. Then vLLM is stopped (its process group: every rank). The report compares the two runs case by
case: first token equal, text equal, and whether the TP=N run loaded at least the composed tokens through the
connector in every case (the heads were loaded, not computed). It also lists the records each rank saved, with their
K/V head counts (each rank's file holds its own shard; where the model has fewer K/V heads than ranks, vLLM
replicates them and each rank saves its copy).
"""

from __future__ import annotations

import argparse
import itertools
import random
import re
import shutil
import tempfile
import time
from pathlib import Path

from common import write_json  # first: puts this checkout ahead of any installed copy on sys.path
import httpx

from service.devserver import ROOT, free_port
from service.vllm.client import SOURCES, prompt_tokens_by_source
from service.vllm.launch import VllmProcess, command, environment, fastest_dtype, model_dir

from fidelity_vllm import SHIPPED, TURNS as FIDELITY_TURNS  # noqa: E402  (bench/ is on sys.path)

TURNS = FIDELITY_TURNS + ["My order arrived damaged. Who pays for the return shipping?",
                          "Summarize the rules you follow in one sentence."]


def make_cases(n: int, seed: int) -> list[tuple[tuple[str, ...], str]]:
    rng = random.Random(seed)
    orders = [o for k in (2, 3) for o in itertools.permutations(SHIPPED, k)]
    rng.shuffle(orders)
    return [(orders[i], TURNS[i % len(TURNS)]) for i in range(n)]


def sources(url: str) -> dict[str, float]:
    got = prompt_tokens_by_source(httpx.get(f"{url}/metrics", timeout=30).text)
    return {k: got[k] for k in SOURCES}


def delta(before: dict, after: dict) -> dict[str, int]:
    return {k: round(after[k] - before[k]) for k in before}


def records(spans: Path) -> dict:
    """The records the ranks saved: count per rank file suffix and the K/V heads of each rank's files."""
    from safetensors import safe_open

    out: dict[str, dict] = {}
    for path in sorted(spans.rglob("*.safetensors")):
        m = re.search(r"\.(tp\d+r\d+)\.safetensors$", path.name)
        if not m:
            continue
        with safe_open(str(path), framework="pt") as f:
            shape = list(f.get_slice("k").get_shape())  # [L, T, H, D]
        d = out.setdefault(m.group(1), {"records": 0, "kv_heads": set(), "head_dim": set()})
        d["records"] += 1
        d["kv_heads"].add(shape[2])
        d["head_dim"].add(shape[3])
    return {k: {"records": v["records"], "kv_heads": sorted(v["kv_heads"]), "head_dim": sorted(v["head_dim"])}
            for k, v in out.items()}


def compose(c, skills, user: str, max_tokens: int) -> dict:
    r = c.post("/v1/compose", json={"skills": list(skills), "user": user, "max_tokens": max_tokens,
                                    "temperature": 0.0, "logprobs": 1})
    if r.status_code != 200:
        raise RuntimeError(f"compose {skills}: {r.status_code} {r.text[:500]}")
    return r.json()


def run(tp: int, args, folder: Path, work: Path, cases, python: Path | None = None, after=None) -> dict:
    """One vLLM server at TP=tp (from `python`'s venv; default SKILLCACHE_VLLM_VENV's) and the cases through
    skillcache on it; `after(url)`, if given, runs against the server before it stops (its result: out["after"])."""
    from fastapi.testclient import TestClient

    from service.config import Settings
    from service.main import create_app

    home = work / f"tp{tp}"
    spans = home / "spans"
    log = home / "vllm.log"
    env = environment(kv_cache_gib=args.kv_gib, tp=tp)
    cmd = command(folder, free_port(), spans, dtype=args.dtype, tp=tp, **({"python": python} if python else {}))
    proc = VllmProcess(cmd, env, log)
    out: dict = {"tp": tp, "omp_bind": env.get("VLLM_CPU_OMP_THREADS_BIND"), "omp_threads": env.get("OMP_NUM_THREADS"),
                 "cases": []}
    t0 = time.perf_counter()
    try:
        proc.start().wait_ready(args.ready_timeout)
        out["vllm_ready_s"] = round(time.perf_counter() - t0, 1)
        print(f"TP={tp}: vLLM ready in {out['vllm_ready_s']} s (bind {out['omp_bind']})", flush=True)
        settings = Settings(model=args.model, chat_template=args.chat_template, home=home / "sc",
                            model_cache=Settings(model=args.model).models_dir, store="disk",
                            skills_dir=ROOT / "skills", engine="vllm", vllm_url=proc.url, vllm_dtype=args.dtype,
                            vllm_refine_after=0, refine_after=0, seam_auto=False, shadow_sample_rate=0.0,
                            auto_reuse=False, torch_threads=1)
        with TestClient(create_app(settings)) as c:
            deadline = time.monotonic() + args.ready_timeout
            while c.get("/readyz").status_code != 200:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"skillcache not ready: {c.get('/readyz').json()}")
                time.sleep(0.5)
            t1 = time.perf_counter()
            for skill in SHIPPED:  # each block compiled once by vLLM (every rank saves its heads)
                compose(c, [skill], "Hello?", 1)
            out["compile_s"] = round(time.perf_counter() - t1, 1)
            for i, (order, user) in enumerate(cases):
                before = sources(proc.url)
                t = time.perf_counter()
                d = compose(c, order, user, args.max_tokens)
                ms = (time.perf_counter() - t) * 1000
                moved = delta(before, sources(proc.url))
                u = d["usage"]
                lp = d.get("logprobs") or []
                first = lp[0]["token"] if lp else d["text"][:1]
                out["cases"].append({"order": list(order), "user": user, "first": first, "text": d["text"],
                                     "usage": {k: u.get(k) for k in ("prompt_tokens", "composed_tokens",
                                                                     "recomputed_tokens", "prefix_tokens")},
                                     "sources": moved, "ms": round(ms)})
                print(f"TP={tp} {i + 1:2d} first {first!r:14} composed {u.get('composed_tokens')}/"
                      f"{u.get('prompt_tokens')} loaded {moved['external_kv_transfer']} computed "
                      f"{moved['local_compute']} hit {moved['local_cache_hit']} ({ms:.0f} ms)", flush=True)
        if after is not None:
            out["after"] = after(proc.url)
        out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    finally:
        proc.stop()
        if proc.proc is not None and proc.proc.returncode not in (None, 0, -15):
            print(log.read_text(errors="replace")[-3000:])
    text = log.read_text(errors="replace") if log.exists() else ""
    out["connector_warnings"] = {k: text.count(k) for k in ("did not load", "cannot read this cache back",
                                                            "not saved", "vLLM computes from token",
                                                            "connector off", "outside the range")}
    # vLLM turns its hybrid KV cache manager off for a connector without SupportsHMA (Gemma-3's sliding windows)
    out["hybrid_kv_cache_manager_off"] = "Turning off hybrid kv cache manager" in text
    out["records"] = records(spans)
    out["totals"] = {k: sum(c["sources"][k] for c in out["cases"]) for k in SOURCES}
    out["composed_total"] = sum(c["usage"]["composed_tokens"] or 0 for c in out["cases"])
    out["loaded_all_composed"] = sum(c["sources"]["external_kv_transfer"] >= (c["usage"]["composed_tokens"] or 0) > 0
                                     for c in out["cases"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=3, help="the TP size compared with TP=1")
    ap.add_argument("--cases", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="embedded", help="SKILLCACHE_MODEL (a .gguf: converted once)")
    ap.add_argument("--chat-template", default=None, help="SKILLCACHE_CHAT_TEMPLATE (gemma for Gemma-3-270M)")
    ap.add_argument("--dtype", default=fastest_dtype()[0], help="vLLM's --dtype (default: the fastest here)")
    ap.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (GiB, per rank)")
    ap.add_argument("--ready-timeout", type=float, default=1200.0)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    from service.config import Settings

    folder = model_dir(Settings(model=args.model))
    cases = make_cases(args.cases, args.seed)
    work = Path(tempfile.mkdtemp(prefix="skillcache-vllm-tp-"))
    out: dict = {"model": args.model, "model_dir": str(folder), "chat_template": args.chat_template,
                 "dtype": args.dtype, "max_tokens": args.max_tokens, "kv_gib": args.kv_gib, "runs": {}}
    try:
        for tp in (1, args.tp):
            out["runs"][f"tp{tp}"] = run(tp, args, folder, work, cases)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    a, b = out["runs"]["tp1"]["cases"], out["runs"][f"tp{args.tp}"]["cases"]
    out["comparison"] = [{"order": x["order"], "user": x["user"], "tp1": x["first"], f"tp{args.tp}": y["first"],
                          "first_equal": x["first"] == y["first"], "text_equal": x["text"] == y["text"]}
                         for x, y in zip(a, b)]
    n = len(out["comparison"])
    out["first_equal"] = sum(c["first_equal"] for c in out["comparison"])
    out["text_equal"] = sum(c["text_equal"] for c in out["comparison"])
    out["accepted"] = n > 0 and out["first_equal"] >= n - 2
    write_json(args.json, out)
    for c in out["comparison"]:
        if not c["first_equal"]:
            print(f"differs: {c['order']} {c['user']!r}: TP=1 {c['tp1']!r}, TP={args.tp} {c[f'tp{args.tp}']!r}")
    for tp in (1, args.tp):
        r = out["runs"][f"tp{tp}"]
        print(f"TP={tp}: loaded {r['totals']['external_kv_transfer']} tokens through the connector, computed "
              f"{r['totals']['local_compute']}, prefix hits {r['totals']['local_cache_hit']}; composed "
              f"{r['composed_total']}; cases loading all their composed tokens {r['loaded_all_composed']}/{n}; "
              f"records {r['records']}; warnings {r['connector_warnings']}")
    print(f"first token equal TP=1 vs TP={args.tp}: {out['first_equal']}/{n} (text of {args.max_tokens} tokens equal "
          f"{out['text_equal']}/{n}); accepted (>= {n - 2}): {out['accepted']}")


if __name__ == "__main__":
    main()
