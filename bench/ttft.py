"""First-token latency vs skill length: full prefill, prefix-cache hit (the physical floor), compose.

    python bench/ttft.py --json bench/out/ttft.json --png docs/img/ttft.png
    python bench/ttft.py --model llama-3.1-8b --device cuda --lengths 2048 8192 32768   # GPU, random weights

For each skill length L the prompt is [chat header + system][skill: L tokens][user turn + generation
prompt], token-identical across arms:
  full     - prefill every token (what a cache miss costs)
  floor    - the prefix [header..skill] already cached (as a prefix cache would hold it when the skill
             sits first): a copy of that KV plus the tail prefill. No method that moves KV can beat it.
  compose  - the skill block re-rotated into place with a seam of K tokens recomputed, plus the text
             around it (the skill's block comes from the memory tier; precompile excluded, as in the paper)
Reported: medians, speedups vs full, compose / floor, and compose's breakdown.
"""

from __future__ import annotations

import argparse
import copy

from common import corpus_ids, load_runtime, timed, write_json

USER = "Summarise the key rule above in one sentence."


def run(rt, lengths: list[int], seams: list[int], repeats: int) -> list[dict]:
    rows = []
    for n in lengths:
        ids = corpus_ids(rt, n)
        block = rt.compile_block(ids)
        msgs = [{"role": "system", "content": "You are a helpful agent."}, {"role": "user", "content": USER}]
        plan = rt.prompts.build(msgs, [ids])
        rt.check_length(plan.n_tokens, 1, "compose")
        full_ms, _ = timed(lambda: rt.prefill(plan, [block], mode="full"), rt.device, repeats)
        # floor: cache holding everything up to the end of the skill, copied, then the tail
        head = plan.skill_offsets()[0] + n
        prefix = rt.prefill(type(plan)([type(plan.segments[0])("text", plan.ids[:head])]), [], mode="full").cache
        tail = plan.ids[head:]

        def floor():
            cache = copy.deepcopy(prefix)
            return rt.forward(tail, head, cache)

        floor_ms, _ = timed(floor, rt.device, repeats)
        row = {"skill_tokens": n, "prompt_tokens": plan.n_tokens, "full_ms": full_ms, "floor_ms": floor_ms,
               "compose": {}}
        for k in seams:
            ms, res = timed(lambda: rt.prefill(plan, [block], mode="compose", seam_tokens=k), rt.device, repeats)
            row["compose"][k] = {"ms": ms, "speedup_vs_full": full_ms / ms, "x_floor": ms / floor_ms,
                                 "breakdown_ms": {k2: round(v, 2) for k2, v in res.timings_ms.items()}}
        rows.append(row)
        c = row["compose"][seams[0]]
        print(f"L={n:6d} full={full_ms:9.1f} ms floor={floor_ms:7.1f} ms compose(K={seams[0]})={c['ms']:7.1f} ms "
              f"speedup={c['speedup_vs_full']:6.1f}x compose/floor={c['x_floor']:.2f} {c['breakdown_ms']}",
              flush=True)
    return rows


def plot(rows: list[dict], seams: list[int], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["skill_tokens"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot(xs, [r["full_ms"] for r in rows], "o-", label="full prefill")
    ax[0].plot(xs, [r["floor_ms"] for r in rows], "s--", label="prefix-cache hit (floor)")
    for k in seams:
        ax[0].plot(xs, [r["compose"][k]["ms"] for r in rows], "^-", label=f"compose, seam {k}")
    ax[0].set(xscale="log", yscale="log", xlabel="skill tokens", ylabel="first-token latency (ms)", title=title)
    ax[0].legend(fontsize=8)
    ax[1].bar([str(x) for x in xs], [r["compose"][seams[0]]["speedup_vs_full"] for r in rows])
    ax[1].set(xlabel="skill tokens", ylabel="speedup vs full prefill (x)", title=f"compose (seam {seams[0]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096, 8000])
    ap.add_argument("--seams", type=int, nargs="+", default=[4, 0, 16, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args()
    rt = load_runtime(args.model, args.device, args.dtype)
    print(f"model={rt.loaded.name} device={rt.device} dtype={rt.loaded.dtype}", flush=True)
    rows = run(rt, args.lengths, args.seams, args.repeats)
    write_json(args.json, {"model": rt.loaded.name, "device": str(rt.device), "dtype": str(rt.loaded.dtype),
                           "seams": args.seams, "rows": rows})
    if args.png:
        from pathlib import Path

        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        plot(rows, args.seams, args.png, f"{rt.loaded.name} on {rt.device}")


if __name__ == "__main__":
    main()
