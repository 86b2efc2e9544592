"""Statistics, the side-by-side table and the plot of bench/peers.py (no torch, no servers)."""

from __future__ import annotations

from pathlib import Path

from load import pct

ENGINES = ("llama.cpp", "skillcache")
# what each arm's row measures (the table's first column)
ARM_LABELS = {
    "a": "a  first-time order",
    "b": "b  repeated order",
    "c": "c  one stream, long decode",
    "d": "d  concurrent streams",
    "e_idle": "e  short request, idle",
    "e_busy": "e  short during long decode",
}
# metric -> (what it is, higher is better)
METRICS = {"ttft_p50": ("first token p50 (ms)", False), "ttft_p90": ("first token p90 (ms)", False),
           "e2e_p50": ("end to end p50 (ms)", False), "e2e_p90": ("end to end p90 (ms)", False),
           "tok_s": ("tokens/s", True), "decode_tok_s": ("decode tokens/s p50", True)}

# the table's metrics per arm (default: first token, end to end, tokens/s). d: one stream's decode rate would
# flatter a serial engine (each stream decodes alone, after waiting), so its waits are shown instead
TABLE_METRICS = {"c": ["tok_s", "decode_tok_s"], "d": ["tok_s", "ttft_p50", "ttft_p90", "e2e_p90"],
                 "e_idle": ["ttft_p50", "ttft_p90", "e2e_p50"], "e_busy": ["ttft_p50", "ttft_p90", "e2e_p50"]}


def decode_rate(r: dict) -> float | None:
    """Tokens per second after the first one: the stream's decode speed."""
    n, span = r.get("completion_tokens") or 0, (r.get("e2e_s") or 0) - (r.get("ttft_s") or 0)
    return (n - 1) / span if n > 1 and span > 0 else None


def summarize(recs: list[dict], wall_s: float | None = None) -> dict:
    """One engine's requests of one arm. tok_s: completion tokens / wall time when the requests ran at once
    (wall_s: first send to last end), else / the sum of their e2e times (one after another)."""
    ok = [r for r in recs if r.get("error") is None]
    errors: dict[str, int] = {}
    for r in recs:
        if r.get("error") is not None:
            kind = str(r["error"]).split(":")[0]
            errors[kind] = errors.get(kind, 0) + 1
    ttft = [r["ttft_s"] * 1e3 for r in ok]
    e2e = [r["e2e_s"] * 1e3 for r in ok]
    tokens = sum(r["completion_tokens"] for r in ok)
    span = wall_s if wall_s is not None else sum(r["e2e_s"] for r in ok)
    rates = [x for x in (decode_rate(r) for r in ok) if x is not None]
    computed = [r["prompt_computed"] for r in ok if r.get("prompt_computed") is not None]
    return {
        "n": len(recs), "ok": len(ok), "errors": errors,
        "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90), "e2e_p50": pct(e2e, 50), "e2e_p90": pct(e2e, 90),
        "tok_s": tokens / span if ok and span else None, "decode_tok_s": pct(rates, 50),
        "completion_tokens_mean": tokens / len(ok) if ok else None,
        "prompt_tokens_mean": sum(r["prompt_tokens"] for r in ok) / len(ok) if ok else None,
        "prompt_computed_mean": sum(computed) / len(computed) if computed else None,  # not served from a cache
        "wall_s": wall_s,
    }


def ratios(llama: dict, sc: dict) -> dict:
    """llama.cpp / skillcache per metric (times: above 1 = skillcache faster; rates: above 1 = llama.cpp faster)."""
    out = {}
    for m in METRICS:
        a, b = llama.get(m), sc.get(m)
        out[m] = a / b if a is not None and b else None
    return out


def verdict(metric: str, ratio: float | None) -> str:
    """'skillcache 3.1x ahead' / '... behind' for one ratio."""
    if ratio is None or ratio <= 0:
        return "-"
    higher_better = METRICS[metric][1]
    sc_ahead = ratio < 1 if higher_better else ratio > 1
    factor = ratio if ratio >= 1 else 1 / ratio
    return f"{factor:.2f}x {'ahead' if sc_ahead else 'behind'}"


def agreement(pairs: list[tuple[dict, dict]]) -> dict:
    """Same greedy text from both engines for the same prompt (ok pairs only). Not a pass mark: llama.cpp runs the
    Q4_1 weights with its own kernels, skillcache the dequantized float32 ones, and a composed prompt is close to
    a full prefill, not equal to it."""
    ok = [(a, b) for a, b in pairs if a.get("error") is None and b.get("error") is None]
    same = sum(a["text"] == b["text"] for a, b in ok)
    first = sum(bool(a["text"]) and bool(b["text"]) and a["text"].split()[:1] == b["text"].split()[:1] for a, b in ok)
    return {"pairs": len(ok), "same_text": same, "same_first_word": first}


def _fmt(v, spec: str = "8.0f") -> str:
    width = int(spec.split(".")[0])
    return f"{'-':>{width}s}" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    """Markdown: one line per arm and metric pair, llama.cpp | skillcache | ratio | verdict."""
    out = ["| arm | metric | llama.cpp | skillcache | llama.cpp / skillcache | skillcache |",
           "| --- | --- | ---: | ---: | ---: | --- |"]
    for row in rows:
        metrics = TABLE_METRICS.get(row["arm"], ["ttft_p50", "ttft_p90", "e2e_p50", "tok_s"])
        for m in metrics:
            a, b = row["llama.cpp"].get(m), row["skillcache"].get(m)
            if a is None and b is None:
                continue
            spec = "8.1f" if m.endswith("tok_s") else "8.0f"
            r = row["ratio"].get(m)
            out.append(f"| {ARM_LABELS[row['arm']]} | {METRICS[m][0]} | {_fmt(a, spec).strip()} | "
                       f"{_fmt(b, spec).strip()} | {_fmt(r, '6.2f').strip()} | {verdict(m, r)} |")
    return "\n".join(out)


def detail(rows: list[dict]) -> str:
    """Per arm and engine: requests, errors, tokens, and how much of the prompt each computed."""
    out = [f"{'arm':7s} {'engine':10s} {'ok/n':>6s} {'errors':18s} {'prompt':>6s} {'computed':>8s} {'gen':>5s}"]
    for row in rows:
        for eng in ENGINES:
            s = row[eng]
            err = ",".join(f"{k}={v}" for k, v in s["errors"].items()) or "-"
            out.append(f"{row['arm']:7s} {eng:10s} {str(s['ok']) + '/' + str(s['n']):>6s} {err:18s} "
                       f"{_fmt(s['prompt_tokens_mean'], '6.0f')} {_fmt(s['prompt_computed_mean'], '8.0f')} "
                       f"{_fmt(s['completion_tokens_mean'], '5.1f')}")
    return "\n".join(out)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("first token, p50 (bar) and p90 (tick), ms", ["a", "b", "e_idle", "e_busy"], "ttft_p50", "ttft_p90"),
              ("end to end, p50 (bar) and p90 (tick), ms", ["a", "b", "e_idle", "e_busy"], "e2e_p50", "e2e_p90"),
              ("tokens/s (c: one stream's decode, d: all streams)", ["c", "d"], None, None)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    colors = {"llama.cpp": "#4c72b0", "skillcache": "#dd8452"}
    by_arm = {r["arm"]: r for r in rows}
    for ax, (label, arms, m50, m90) in zip(axes, panels):
        arms = [a for a in arms if a in by_arm]
        for j, eng in enumerate(ENGINES):
            xs = [i + (j - 0.5) * 0.38 for i in range(len(arms))]
            if m50:
                ys = [by_arm[a][eng].get(m50) or 0 for a in arms]
                ax.bar(xs, ys, 0.38, color=colors[eng], label=eng)
                ax.plot(xs, [by_arm[a][eng].get(m90) or 0 for a in arms], "k_", markersize=14)
            else:
                key = {"c": "decode_tok_s", "d": "tok_s"}
                ys = [by_arm[a][eng].get(key[a]) or 0 for a in arms]
                ax.bar(xs, ys, 0.38, color=colors[eng], label=eng)
            for x, y in zip(xs, ys):
                ax.annotate(f"{y:.0f}" if m50 else f"{y:.1f}", (x, y), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(arms)), [ARM_LABELS[a] for a in arms], rotation=18, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
        if m50:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out: dict, png: str | None) -> None:
    """Print a run's tables (from bench/peers.py's JSON as well) and draw its plot."""
    rows = out["rows"]
    print("\n" + detail(rows) + "\n\n" + table(rows))
    for r in rows:
        a = r["agreement"]
        if a["pairs"]:
            print(f"arm {r['arm']}: same greedy text {a['same_text']}/{a['pairs']}, same first word "
                  f"{a['same_first_word']}/{a['pairs']}")
    env = out["environment"]
    print(f"\n{env['date']}, commit {env['commit']}{' (dirty)' if env['dirty'] else ''}, {env['cpu']}, "
          f"{env['cores']} cores, {out['args']['threads']} thread(s) per engine, load average "
          f"{env['loadavg_start']} -> {env.get('loadavg_end')}; elapsed {out['elapsed_s']:.0f} s", flush=True)
    if png and rows:
        plot(rows, png, f"llama.cpp llama-server vs skillcache: SmolLM2-135M-Instruct, {env['cores']} cores, "
                        f"{out['args']['threads']} thread(s) each, {env['date']}, commit {env['commit']}")
