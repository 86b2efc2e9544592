"""The paper's serving result on vLLM (issue 42): errata keep the prefix cache aligned under Poisson load.

    python bench/vllm_online.py --block-size 32 --json bench/out/vllm-online.json --png docs/img/vllm-online.png
        # ~45 min on 2 cores (bench/vllm_online.md)
    python bench/vllm_online.py --policy-skills refund-policy --rates 0.3 1.5 --duration-s 4 --min-arrivals 0 \
        --arms vllm/erratum sc-vllm/erratum                                                   # a quick check
    bash bench/gpu/online.sh [--dry-run]                                                      # shaped for a GPU

A ~2.4k-token policy (refund-policy + tool-specs + style-guide bodies, registered as one skill with their fields;
order_status near the top). Every conversation changes order_status to a value no other conversation uses. Arms:
  vllm/erratum               vLLM alone, token ids as skillcache lays them: the policy with its defaults, the erratum
                             line after it in the system turn (where skillcache puts it), the user turn
  vllm/in-place              vLLM alone: the policy with the new value written in
  sc-vllm/erratum            skillcache on vLLM, /v1/compose with `fields` (edit_mode erratum, the default)
  sc-vllm/in-place           skillcache on vLLM, edit_mode in_place, mode full: the new value in the prompt's ids and
                             vLLM computes every token it cannot reuse (the paper's in-place text)
  sc-vllm/in-place-composed  edit_mode in_place, mode compose: a head composed inside vLLM per conversation (the
                             block vLLM compiled, copied by its connector; the value's tokens computed by vLLM)
  embedded/erratum, embedded/in-place   the same two requests on skillcache's embedded engine (in-place: mode full)
vLLM alone uses a cache_salt of its own per arm and rate; skillcache runs with refinement (SKILLCACHE_REFINE_AFTER and,
on vLLM, SKILLCACHE_VLLM_REFINE_AFTER), seam calibration and shadow checks off (no background work on the clock). One
vLLM server (--dtype: by default the fastest here, service.vllm.launch.fastest_dtype; skillcache's connector, its spans
in a temporary folder) serves the vLLM arms; it is stopped before the embedded service starts. Per arm and rate, after
warm-up requests (not counted, not in the counters): Poisson arrivals for --duration-s (longer at a low rate, up to
--min-arrivals), then at most --drain-s to finish (what is left is cancelled and counted with the time it had waited),
then the servers idle again. Reported: vLLM's prefix-cache hit rate over the window (its prefix_cache_hits /
prefix_cache_queries counters, prompt tokens; hits are whole KV blocks: --block-size), streamed client-side TTFT
p50/p90/p99, completed requests/s, and the in-place / erratum ratios. Rates: --rates, else --factors times the in-place
capacity that a probe measures (1 / one in-place request's latency on vLLM alone).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from common import write_json  # first: puts this checkout ahead of any installed copy on sys.path
import httpx
import vllm_online_work as W
from vllm_online_run import idle, run_rate, send
from load import load_skill, register
from peers_run import environment
from peers_vllm import descendants

from service.devserver import ROOT, ServiceProcess, free_port
from service.vllm.launch import VLLM_PYTHON, VllmProcess, command, environment as vllm_env, fastest_dtype, model_dir

ARMS = ["vllm/erratum", "vllm/in-place", "sc-vllm/erratum", "sc-vllm/in-place", "sc-vllm/in-place-composed",
        "embedded/erratum", "embedded/in-place"]
PAIRS = [("vLLM alone", "vllm/erratum", "vllm/in-place"), ("skillcache on vLLM", "sc-vllm/erratum", "sc-vllm/in-place"),
         ("skillcache embedded", "embedded/erratum", "embedded/in-place")]


class Workload:
    def __init__(self, args) -> None:
        from transformers import AutoTokenizer

        from service.config import Settings
        from service.registry.skill import render
        from service.runtime.prompt import PromptBuilder

        self.args, self.template = args, Settings().erratum_template
        self.skill = W.policy({n: load_skill(n) for n in args.policy_skills}, args.policy_skills)
        tokenizer = AutoTokenizer.from_pretrained(model_dir(_settings(args)))  # a GGUF converted once, or a folder
        if args.chat_template:  # as the service sets it (SKILLCACHE_CHAT_TEMPLATE: a built-in name)
            from service.runtime.templates import BUILTIN_TEMPLATES

            tokenizer.chat_template = BUILTIN_TEMPLATES[args.chat_template][0]
        self.builder = PromptBuilder(tokenizer)
        text_of = lambda v: render(self.skill["text"], {**self.skill["fields"], W.FIELD: v})  # noqa: E731
        self.text_of = text_of
        self.statuses = W.same_layout(self.builder.encode_content, text_of, W.STATUSES)
        self.default_ids = self.builder.encode_content(text_of(W.DEFAULT_VALUE))
        self.n = 0  # conversations so far: each gets a value no other one has

    def next(self) -> tuple[int, str, str]:
        self.n += 1
        return self.n, W.value(self.n, self.statuses), W.QUESTIONS[self.n % len(W.QUESTIONS)].format(i=self.n)

    def ids(self, kind: str, val: str, user: str) -> list[int]:
        msgs = [{"role": "user", "content": user}]
        if kind == "erratum":
            return self.builder.build(msgs, [self.default_ids], [self.template.format(field=W.FIELD, value=val)]).ids
        return self.builder.build(msgs, [self.builder.encode_content(self.text_of(val))]).ids

    def body(self, arm: str, val: str, user: str) -> dict:
        b = {"skills": [W.POLICY_NAME], "user": user, "fields": {W.FIELD: val}, "max_tokens": self.args.max_tokens,
             "temperature": 0.0, "stream": True}
        if arm.endswith("/in-place"):
            b.update(edit_mode="in_place", mode="full")
        elif arm.endswith("/in-place-composed"):
            b.update(edit_mode="in_place")
        return b


async def run_arms(arms, url, vllm_url, pids, wl, rates, out, tag) -> None:
    for arm in arms:
        for k, rate in enumerate(rates):
            await idle(vllm_url, pids, wl.args.settle_s)
            target = vllm_url if arm.startswith("vllm/") else url
            recs, before = await run_rate(arm, target, wl, rate, f"{tag}-{arm.replace('/', '-')}-{k}",
                                          wl.args.seed + k, vllm_url)
            key = f"{rate:.4f}"
            a = wl.args
            s = out["results"].setdefault(arm, {})[key] = W.summarize(
                recs, rate, W.duration_for(rate, a.duration_s, a.min_arrivals, a.max_duration_s))
            if before is not None:
                await idle(vllm_url, [], 60)  # cancelled requests: their counters settle
                h = W.hit_rates(before, W.parse_metrics(httpx.get(f"{vllm_url}/metrics").text))
                out["hits"].setdefault(arm, {})[key] = h
            out["records"].setdefault(arm, {})[key] = [{k2: r.get(k2) for k2 in ("i", "ttft_s", "e2e_s", "error",
                                                                                  "waited_s", "t_offset", "usage")}
                                                       for r in recs]
            hr = out["hits"].get(arm, {}).get(key, {}).get("hit_rate")
            print(f"{arm:26s} rate {rate:6.2f}: {s['ok']}/{s['sent']} ok, cut {s['censored']}, TTFT p50/p90/p99 "
                  f"{W.fmt(s['ttft_p50'], '.0f')}/{W.fmt(s['ttft_p90'], '.0f')}/{W.fmt(s['ttft_p99'], '.0f')} ms, "
                  f"{W.fmt(s['completed_per_s'], '.2f')} done/s, prefix hits "
                  f"{'-' if hr is None else f'{100 * hr:.1f}%'} {s['errors'] or ''}", flush=True)


def probe_capacity(vllm_url: str, wl: Workload, n: int = 3) -> float:
    """1 / the median latency of one in-place request on vLLM alone (nothing reusable after the field)."""
    async def go() -> list[float]:
        async with httpx.AsyncClient(base_url=vllm_url, timeout=900) as c:
            out = []
            for _ in range(n):
                r = await send("vllm/in-place", vllm_url, c, wl, "probe", time.perf_counter())
                out.append(r["e2e_s"])
            return out
    return 1.0 / statistics.median(asyncio.run(go()))


def main(argv=None) -> None:
    import vllm_online_plot

    args = parse_args(argv)
    wl = Workload(args)
    home = Path(tempfile.mkdtemp(prefix="skillcache-vllm-online-"))
    (home / "skills").mkdir()
    tag = f"online-{int(time.time())}"
    out: dict = {"environment": environment(), "args": vars(args), "statuses": wl.statuses,
                 "policy_tokens": len(wl.default_ids), "results": {}, "hits": {}, "records": {}}
    print(f"policy {len(wl.default_ids)} tokens; statuses keeping the layout: {wl.statuses}", flush=True)
    t0 = time.perf_counter()
    vllm_arms = [a for a in args.arms if not a.startswith("embedded/")]
    emb_arms = [a for a in args.arms if a.startswith("embedded/")]
    block = ["--block-size", str(args.block_size)] if args.block_size else []
    vllm = VllmProcess(command(model_dir(_settings(args)), free_port(), home / "spans", Path(args.vllm_python),
                               args.dtype, extra=block + shlex.split(args.vllm_extra)), vllm_env(args.kv_cache_gib),
                       home / "vllm.log")
    services: list[ServiceProcess] = []  # stopped in any case
    try:
        if vllm_arms or not args.rates:
            vllm.start().wait_ready(900)
        if not args.rates:
            out["capacity_per_s"] = cap = probe_capacity(vllm.url, wl)
        rates = args.rates or [f * cap for f in args.factors]
        out["rates"] = rates
        print("rates (req/s):", [round(r, 3) for r in rates], flush=True)
        if vllm_arms:
            sc = start_service(home, "sc-vllm", args, {"threads": args.sc_vllm_threads, "SKILLCACHE_ENGINE": "vllm",
                                                       "SKILLCACHE_VLLM_URL": vllm.url,
                                                       "SKILLCACHE_VLLM_DTYPE": args.dtype,
                                                       "SKILLCACHE_VLLM_SPANS_DIR": str(home / "spans"),
                                                       "SKILLCACHE_VLLM_REFINE_AFTER": "0"}, wl,
                               services)
            pids = descendants(vllm.proc.pid) + descendants(sc.proc.pid)
            asyncio.run(run_arms(vllm_arms, sc.url, vllm.url, pids, wl, rates, out, tag))
            sc.stop()
        vllm.stop()
        if emb_arms:
            emb = start_service(home, "embedded", args, {"threads": args.threads}, wl, services)
            asyncio.run(run_arms(emb_arms, emb.url, None, descendants(emb.proc.pid), wl, rates, out, tag))
            emb.stop()
    finally:
        for svc in services:
            svc.stop()
        vllm.stop()
        shutil.rmtree(home, ignore_errors=True)
    out["ratios"] = W.ratios(out["results"], PAIRS)
    out["elapsed_s"] = time.perf_counter() - t0
    write_json(args.json, out)
    print("\n" + W.table(out["results"], out["hits"]) + "\n\n" + W.ratio_table(out["ratios"]))
    print("\n" + W.behind_table(out["results"]))
    if args.png:
        print(vllm_online_plot.plot(out, args.png))


def start_service(home: Path, name: str, args, extra: dict, wl: Workload, started: list) -> ServiceProcess:
    env = {"SKILLCACHE_SKILLS_DIR": str(home / "skills"), "SKILLCACHE_MODEL": args.model,
           "SKILLCACHE_REFINE_AFTER": "0", "SKILLCACHE_SEAM_AUTO": "false", "SKILLCACHE_SHADOW_SAMPLE_RATE": "0"}
    threads = extra.pop("threads")
    env.update(SKILLCACHE_TORCH_THREADS=str(threads), **extra)
    if args.chat_template:
        env["SKILLCACHE_CHAT_TEMPLATE"] = args.chat_template
    svc = ServiceProcess(home / name, env, name=name, threads=threads).start()
    started.append(svc)
    svc.wait_ready(900)
    with httpx.Client(base_url=svc.url, timeout=900) as c:
        info = register(c, wl.skill)
    if info.get("n_tokens") not in (None, len(wl.default_ids)):
        raise SystemExit(f"skillcache counts {info['n_tokens']} policy tokens, here {len(wl.default_ids)}")
    return svc


def _settings(args):
    from service.config import Settings

    return Settings(model=args.model)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", default=ARMS, choices=ARMS)
    ap.add_argument("--rates", nargs="+", type=float, default=None, help="req/s (default: --factors x capacity)")
    ap.add_argument("--factors", nargs="+", type=float, default=[0.5, 1.0, 3.0, 8.0],
                    help="rates as multiples of the in-place capacity the probe measures")
    ap.add_argument("--duration-s", type=float, default=40.0, help="Poisson arrivals per arm and rate")
    ap.add_argument("--min-arrivals", type=int, default=6, help="a low rate's arrivals last until about this many")
    ap.add_argument("--max-duration-s", type=float, default=100.0, help="... but at most this long")
    ap.add_argument("--drain-s", type=float, default=25.0, help="after the arrivals: at most this to finish")
    ap.add_argument("--warmup", type=int, default=2, help="requests before each arm and rate, not measured")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--policy-skills", nargs="+", default=W.POLICY_SKILLS,
                    help="shipped skills joined into the policy, refund-policy first (its order_status is the field)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--chat-template", default=None)
    ap.add_argument("--kv-cache-gib", type=int, default=4, help="vLLM's CPU KV space (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--dtype", default=fastest_dtype()[0],
                    help="vLLM's --dtype and SKILLCACHE_VLLM_DTYPE (default: the fastest here, bfloat16 on a GPU or a "
                    "CPU with bfloat16 instructions, float32 on other CPUs)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="vLLM's KV block (its prefix cache hits whole blocks); default vLLM's: 128 on CPU, 16 on GPU")
    ap.add_argument("--vllm-python", default=str(VLLM_PYTHON), help="a python with vLLM (GPU: its GPU build)")
    ap.add_argument("--vllm-extra", default="", help="more vLLM server arguments, e.g. --gpu-memory-utilization 0.5")
    ap.add_argument("--threads", type=int, default=2, help="the embedded engine's torch threads")
    ap.add_argument("--sc-vllm-threads", type=int, default=1,
                    help="skillcache's torch threads beside vLLM (it runs no forward pass per request there)")
    ap.add_argument("--settle-s", type=float, default=60.0, help="at most this for the servers to go idle")
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "vllm-online.json"))
    ap.add_argument("--png", default=None, help="e.g. docs/img/vllm-online.png")
    return ap.parse_args(argv)


if __name__ == "__main__":
    main()
