"""The figure of bench/vllm_online.py: p90 first token and completed requests/s against the arrival rate, per arm."""

from __future__ import annotations

from pathlib import Path


def plot(out: dict, png: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm, by_rate in out["results"].items():
        rows = sorted(by_rate.values(), key=lambda s: s["rate"])
        style = "-" if "erratum" in arm else "--"
        color = {"vllm": "tab:blue", "sc-vllm": "tab:orange", "embedded": "tab:green"}[arm.split("/")[0]]
        if arm.endswith("composed"):
            color = "tab:red"
        x = [s["rate"] for s in rows]
        a.plot(x, [s["ttft_p90"] for s in rows], style, marker="o", color=color, label=arm)
        b.plot(x, [s["completed_per_s"] for s in rows], style, marker="o", color=color, label=arm)
    rates = sorted({s["rate"] for by in out["results"].values() for s in by.values()})
    b.plot(rates, rates, ":", color="grey", label="offered")
    a.set(xscale="log", yscale="log", xlabel="arrival rate (req/s, Poisson)", ylabel="p90 time to first token (ms)",
          title="p90 first token (cut requests: time waited)")
    b.set(xscale="log", xlabel="arrival rate (req/s, Poisson)", ylabel="completed requests/s", title="throughput")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
    b.legend(fontsize=7)
    env = out.get("environment", {})
    fig.suptitle(f"One field changed per conversation, {out.get('policy_tokens')}-token policy: erratum vs in-place "
                 f"({env.get('cpu')}, {env.get('cores')} cores, {env.get('date')})", fontsize=9)
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    return f"wrote {png}"
