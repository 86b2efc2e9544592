"""The pure parts of bench/vllm_online.py: the policy and its per-conversation field values, the Poisson schedule,
vLLM's prefix-cache counters, per arm+rate statistics and the erratum-over-in-place table. No servers here."""

from __future__ import annotations

import math
import random
import re

POLICY_NAME = "online-policy"
POLICY_SKILLS = ["refund-policy", "tool-specs", "style-guide"]  # ~2.4k tokens; order_status near the top
FIELD = "order_status"
DEFAULT_VALUE = "delivered (scan 0000)"  # digits tokenize one by one: every "… (scan NNNN)" keeps the layout
STATUSES = ["delivered", "shipped", "returned", "lost", "pending", "processing"]
QUESTIONS = [
    "Order A-{i:05d}: the customer writes 'I changed my mind, I want my money back.' Decide: APPROVE or DENY.",
    "Order A-{i:05d}: the customer says the item arrived damaged and asks for a refund. APPROVE or DENY?",
    "Order A-{i:05d}: the customer asks to cancel and get a refund today. Answer APPROVE or DENY first.",
]
# vLLM 0.32 (vllm/v1/metrics/loggers.py): counters of prompt tokens looked up / found in its prefix cache, and the
# same for KV loaded through a connector (the spans skillcache's connector saved)
COUNTERS = {"queries": "vllm:prefix_cache_queries_total", "hits": "vllm:prefix_cache_hits_total",
            "ext_queries": "vllm:external_prefix_cache_queries_total",
            "ext_hits": "vllm:external_prefix_cache_hits_total"}
GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting"}


def policy(skills: dict[str, dict], names: list[str] = POLICY_SKILLS) -> dict:
    """One long policy skill from the shipped skills' bodies (parsed skill files), fields merged; order_status's
    default carries a scan number so that a new one keeps the token layout (in_place needs it)."""
    if names[0] != "refund-policy":
        raise SystemExit("the policy opens with refund-policy: its order_status is the field each conversation sets")
    fields = {k: v for name in names for k, v in skills[name]["fields"].items()}
    fields[FIELD] = DEFAULT_VALUE
    return {"name": POLICY_NAME, "description": "bench/vllm_online.py: a long policy with mutable fields",
            "text": "\n\n".join(skills[n]["text"] for n in names), "fields": fields}


def value(i: int, statuses: list[str]) -> str:
    """Conversation i's order_status: a new scan number each time (10,000 before one repeats)."""
    return f"{statuses[i % len(statuses)]} (scan {(7919 * i + 1) % 10000:04d})"


def same_layout(encode, text_of, statuses: list[str]) -> list[str]:
    """The statuses whose values tokenize like the default with only the value's tokens changed (`encode`: text ->
    ids; `text_of`: value -> the policy's text)."""
    base = encode(text_of(DEFAULT_VALUE))
    keep = []
    for s in statuses:
        ids = encode(text_of(value(1, [s])))
        if len(ids) == len(base) and sum(a != b for a, b in zip(ids, base)) <= 6:
            keep.append(s)
    return keep


def poisson_schedule(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process of `rate` per second over [0, duration_s); seeded."""
    rng, t, out = random.Random(seed), 0.0, []
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= duration_s:
            break
        out.append(t)
    return out


def duration_for(rate: float, base_s: float, min_arrivals: int, max_s: float) -> float:
    """Arrivals for base_s, longer at a low rate so that about min_arrivals arrive; at most max_s."""
    return max(base_s, min(max_s, min_arrivals / rate if rate > 0 else base_s))


def parse_metrics(text: str) -> dict[str, float]:
    """vLLM's /metrics: the counters and gauges above, summed over their label sets."""
    out = {k: 0.0 for k in (*COUNTERS, *GAUGES)}
    names = {v: k for k, v in {**COUNTERS, **GAUGES}.items()}
    for m in re.finditer(r"^([a-z_:]+)(?:\{[^}]*\})? ([0-9.e+-]+|nan)$", text, re.M):
        if m.group(1) in names and m.group(2) != "nan":
            out[names[m.group(1)]] += float(m.group(2))
    return out


def hit_rates(before: dict, after: dict) -> dict:
    """Prefix-cache hit rate over a window (hits / queries, in prompt tokens), vLLM's own cache and the connector's."""
    d = {k: after[k] - before[k] for k in COUNTERS}
    return {"queries": d["queries"], "hits": d["hits"],
            "hit_rate": d["hits"] / d["queries"] if d["queries"] else None,
            "ext_queries": d["ext_queries"], "ext_hits": d["ext_hits"],
            "ext_hit_rate": d["ext_hits"] / d["ext_queries"] if d["ext_queries"] else None}


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def summarize(recs: list[dict], rate: float, duration_s: float) -> dict:
    """One arm at one rate. A request cut at the deadline before its first token counts with the time it had waited
    (a lower bound: `censored`), so a saturated arm's percentiles are not flattered by dropping its slowest."""
    ok = [r for r in recs if r.get("error") is None and r.get("e2e_s") is not None]
    ttft = [r["ttft_s"] for r in recs if r.get("ttft_s") is not None]
    cut = [r["waited_s"] for r in recs if r.get("ttft_s") is None and r.get("waited_s") is not None]
    ends = [r["t_offset"] + r["e2e_s"] for r in ok]
    wall = max([duration_s, *ends])
    errors: dict[str, int] = {}
    for r in recs:
        if r.get("error") is not None:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    all_ttft = [1e3 * t for t in ttft + cut]
    return {"rate": rate, "sent": len(recs), "ok": len(ok), "censored": len(cut), "errors": errors,
            "ttft_p50": percentile(all_ttft, 50), "ttft_p90": percentile(all_ttft, 90),
            "ttft_p99": percentile(all_ttft, 99), "completed_per_s": len(ok) / wall if wall > 0 else None,
            "wall_s": wall, "offered_per_s": len(recs) / duration_s if duration_s else None}


def saturated(s: dict) -> bool:
    """Completed under 90% of what arrived, or a request cut before its first token."""
    return s["censored"] > 0 or s["ok"] < 0.9 * s["sent"]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def ratios(results: dict, pairs: list[tuple[str, str, str]]) -> list[dict]:
    """Per (label, erratum arm, in-place arm) and rate: in-place p90 / erratum p90 (how much lower the erratum's
    first token is), erratum completed/s / in-place's, and whether each arm saturated."""
    rows = []
    for label, err, inp in pairs:
        for key, e in results.get(err, {}).items():
            i = results.get(inp, {}).get(key)
            if i is None:
                continue
            rows.append({"engine": label, "rate": e["rate"], "p90_inplace_over_erratum": ratio(i["ttft_p90"],
                                                                                                 e["ttft_p90"]),
                         "p50_inplace_over_erratum": ratio(i["ttft_p50"], e["ttft_p50"]),
                         "throughput_erratum_over_inplace": ratio(e["completed_per_s"], i["completed_per_s"]),
                         "erratum_saturated": saturated(e), "inplace_saturated": saturated(i)})
    return rows


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(results: dict, hits: dict) -> str:
    """Markdown: one row per arm and rate."""
    lines = ["| arm | rate (req/s) | sent | ok | cut | prefix-cache hits | TTFT p50 (ms) | p90 | p99 | done/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm, by_rate in results.items():
        for key, s in by_rate.items():
            h = hits.get(arm, {}).get(key) or {}
            hr = h.get("hit_rate")
            lines.append(f"| {arm} | {s['rate']:.2f} | {s['sent']} | {s['ok']} | {s['censored']} | "
                         f"{fmt(None if hr is None else 100 * hr, '.1f')}{'%' if hr is not None else ''} | "
                         f"{fmt(s['ttft_p50'], '.0f')} | {fmt(s['ttft_p90'], '.0f')} | {fmt(s['ttft_p99'], '.0f')} | "
                         f"{fmt(s['completed_per_s'], '.2f')} |")
    return "\n".join(lines)


def ratio_table(rows: list[dict]) -> str:
    lines = ["| engine | rate (req/s) | p90 TTFT in-place / erratum | p50 in-place / erratum | "
             "done/s erratum / in-place | saturated (erratum, in-place) |", "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['rate']:.2f} | {fmt(r['p90_inplace_over_erratum'], '.1f')}x | "
                     f"{fmt(r['p50_inplace_over_erratum'], '.1f')}x | "
                     f"{fmt(r['throughput_erratum_over_inplace'], '.2f')}x"
                     f" | {'yes' if r['erratum_saturated'] else 'no'}, {'yes' if r['inplace_saturated'] else 'no'} |")
    return "\n".join(lines)


def behind_table(results: dict) -> str:
    """The embedded engine against skillcache on vLLM and vLLM alone, per request kind and rate: how many times higher
    its p90 first token is, and its completed/s as a share of theirs."""
    lines = ["| kind | rate (req/s) | embedded p90 / sc-vllm p90 | embedded p90 / vLLM-alone p90 | "
             "embedded done/s / sc-vllm's | embedded done/s / vLLM alone's |", "|---|---:|---:|---:|---:|---:|"]
    for kind in ("erratum", "in-place"):
        emb = results.get(f"embedded/{kind}", {})
        for key, e in emb.items():
            sc, v = results.get(f"sc-vllm/{kind}", {}).get(key), results.get(f"vllm/{kind}", {}).get(key)
            get = lambda s, k: s.get(k) if s else None  # noqa: E731
            lines.append(f"| {kind} | {e['rate']:.2f} | {fmt(ratio(e['ttft_p90'], get(sc, 'ttft_p90')), '.2f')}x | "
                         f"{fmt(ratio(e['ttft_p90'], get(v, 'ttft_p90')), '.2f')}x | "
                         f"{fmt(ratio(e['completed_per_s'], get(sc, 'completed_per_s')), '.2f')}x | "
                         f"{fmt(ratio(e['completed_per_s'], get(v, 'completed_per_s')), '.2f')}x |")
    return "\n".join(lines)
