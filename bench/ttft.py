"""First-token latency vs skill length: full prefill, prefix-cache hit (the physical floor), compose.

    python bench/ttft.py --json bench/out/ttft.json --png docs/img/ttft.png
    python bench/ttft.py --model llama-3.1-8b --device cuda --lengths 2048 8192 32768   # GPU, random weights

For each skill length L, two prompts, each token-identical across its arms:
  moved  [chat header][preamble skill, ~64 tokens][skill: L tokens][system text + user turn + generation prompt]
         the L-token block is re-rotated to its offset and its first K tokens (the seam) recomputed;
  first  [chat header][skill: L tokens][system text + user turn + generation prompt]
         the block sits where it was compiled (after the header), so it is copied as is.
Arms, per prompt:
  full     - prefill every token (what a cache miss costs)
  floor    - everything up to the end of the skill already cached (what a prefix cache holds when this
             exact prefix was served before): a copy of that KV plus the tail prefill. No method that
             moves KV can beat it.
  compose  - the blocks from the memory tier moved into place, the text around them prefilled
             (precompile excluded, as in the paper); seams swept on the moved prompt.
  refined  - (moved) what the service serves once the same skill sequence repeats (service/compose/refine.py):
             the prompt through the skill prefilled in full when idle (excluded) and copied as an exact
             prefix, then the tail prefilled. The floor's work through the service's own prefill path.
Reported: medians, speedups vs full, compose / floor, and compose's breakdown.
"""

from __future__ import annotations

import argparse
import copy

from common import corpus_ids, load_runtime, timed, write_json

SYSTEM = "You are a helpful agent."
USER = "Summarise the key rule above in one sentence."
PREAMBLE = ("Glossary. Order: a purchase with one order id. Customer: the person who placed it. Agent: you. "
            "Policy: the rules below. Ticket: one conversation about one order.")


def _floor(rt, plan, end: int, repeats: int) -> float:
    """Copy a cache holding plan.ids[:end] (prefilled once, outside the timing), then prefill the rest."""
    prefix = rt.prefill(type(plan)([type(plan.segments[0])("text", plan.ids[:end])]), [], mode="full").cache
    tail = plan.ids[end:]

    def floor():
        cache = copy.deepcopy(prefix)
        return rt.forward(tail, end, cache)

    return timed(floor, rt.device, repeats)[0]


def _refined_prefix(rt, plan):
    """The exact K/V of the prompt through its last skill, built as the service's idle worker builds it."""
    from service.runtime.steps import run_steps

    return run_steps(rt.exact_prefix_steps(plan.ids[:plan.skill_ends()[-1]]))


def run(rt, lengths: list[int], seams: list[int], repeats: int) -> list[dict]:
    rows = []
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    pre_ids = rt.prompts.encode_content(PREAMBLE)
    pre_block = rt.compile_block(pre_ids)
    for n in lengths:
        ids = corpus_ids(rt, n)
        block = rt.compile_block(ids)
        moved = rt.prompts.build(msgs, [pre_ids, ids])
        first = rt.prompts.build(msgs, [ids])
        rt.check_length(moved.n_tokens, 1, "compose")
        row = {"skill_tokens": n, "preamble_tokens": len(pre_ids), "prompt_tokens": moved.n_tokens,
               "offset": moved.skill_offsets()[1], "compose": {}}
        row["full_ms"], _ = timed(lambda: rt.prefill(moved, [], mode="full"), rt.device, repeats)
        row["floor_ms"] = _floor(rt, moved, moved.skill_offsets()[1] + n, repeats)
        for k in seams:
            ms, res = timed(lambda: rt.prefill(moved, [pre_block, block], mode="compose", seam_tokens=k),
                            rt.device, repeats)
            row["compose"][k] = {"ms": ms, "speedup_vs_full": row["full_ms"] / ms, "x_floor": ms / row["floor_ms"],
                                 "breakdown_ms": {k2: round(v, 2) for k2, v in res.timings_ms.items()}}
        exact = _refined_prefix(rt, moved)
        ms, _ = timed(lambda: rt.prefill(moved, [pre_block, block], mode="compose", prefix=exact), rt.device, repeats)
        row["refined"] = {"ms": ms, "speedup_vs_full": row["full_ms"] / ms, "x_floor": ms / row["floor_ms"]}
        f = row["first"] = {"prompt_tokens": first.n_tokens}
        f["full_ms"], _ = timed(lambda: rt.prefill(first, [], mode="full"), rt.device, repeats)
        f["floor_ms"] = _floor(rt, first, first.skill_offsets()[0] + n, repeats)
        f["compose_ms"], res = timed(lambda: rt.prefill(first, [block], mode="compose"), rt.device, repeats)
        f.update(speedup_vs_full=f["full_ms"] / f["compose_ms"], x_floor=f["compose_ms"] / f["floor_ms"],
                 breakdown_ms={k2: round(v, 2) for k2, v in res.timings_ms.items()})
        rows.append(row)
        c = row["compose"][seams[0]]
        print(f"L={n:6d} moved: full={row['full_ms']:9.1f} ms floor={row['floor_ms']:7.1f} ms "
              f"compose(K={seams[0]})={c['ms']:7.1f} ms speedup={c['speedup_vs_full']:6.1f}x "
              f"compose/floor={c['x_floor']:.2f} {c['breakdown_ms']}\n"
              f"         refined={row['refined']['ms']:7.1f} ms speedup={row['refined']['speedup_vs_full']:6.1f}x "
              f"refined/floor={row['refined']['x_floor']:.2f}\n"
              f"         first: full={f['full_ms']:9.1f} ms floor={f['floor_ms']:7.1f} ms "
              f"compose={f['compose_ms']:7.1f} ms speedup={f['speedup_vs_full']:6.1f}x "
              f"compose/floor={f['x_floor']:.2f} {f['breakdown_ms']}", flush=True)
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
        ax[0].plot(xs, [r["compose"][k]["ms"] for r in rows], "^-", label=f"compose (moved), seam {k}")
    ax[0].plot(xs, [r["first"]["compose_ms"] for r in rows], "v:", label="compose (skill first)")
    ax[0].set(xscale="log", yscale="log", xlabel="skill tokens", ylabel="first-token latency (ms)", title=title)
    ax[0].legend(fontsize=8)
    ax[1].bar([str(x) for x in xs], [r["compose"][seams[0]]["speedup_vs_full"] for r in rows])
    ax[1].set(xlabel="skill tokens", ylabel="speedup vs full prefill (x)", title=f"compose, moved (seam {seams[0]})")
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
