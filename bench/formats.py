"""CPU weight formats side by side: speed and quality against float32, and composition on each format.

    python bench/formats.py --json bench/out/formats.json

Formats (SKILLCACHE_DTYPE / SKILLCACHE_QUANTIZATION / SKILLCACHE_PACKED_DECODE): float32 (float32 matmuls
everywhere); packed (the default: float32, decode steps on the GGUF's own Q4_1/Q8_0 blocks,
service/runtime/packed.py); bfloat16; int8 (weight-only int8 linear layers,
bfloat16 products, float32 elsewhere: service/runtime/quantize.py); w8a8 (int8 weights and per-token int8
activations); each quantized one also with bfloat16 elsewhere (+bf16, K/V included). For each, in one process,
the embedded model:
  speed    a --prefill-tokens full prefill (one forward), and the decode step of the serving engine's batch
           (bench/decode.py's batched arm) at --contexts and --batch
  quality  part a of bench/fidelity.py (nine compositions of the shipped skills): each format's full prefill
           against float32's: first-token KL(float32 || format), top-1, and the greedy --greedy continuation
  compose  on each format's own weights, composed (seam --seam) against its own full prefill: cosine, KL, top-1
           (composition stays relative to a full recompute on the same weights)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import corpus_ids, load_runtime, write_json
from decode import _batched
from fidelity import COMPOSITIONS, QUESTIONS, SYSTEMS, greedy_ids, logit_stats, shipped_skills

FORMATS = {"float32": ("float32", None, False), "packed": ("float32", None, True),
           "bfloat16": ("bfloat16", None, False), "int8": ("float32", "int8", False),
           "int8+bf16": ("bfloat16", "int8", False), "w8a8": ("float32", "w8a8", False),
           "w8a8+bf16": ("bfloat16", "w8a8", False)}


def runtime(fmt: str):
    dtype, quant, packed = FORMATS[fmt]
    rt = load_runtime("embedded", "cpu", dtype, packed=packed)
    if quant:
        from service.runtime.quantize import quantize_linears

        quantize_linears(rt.model, quant)
    return rt


def prompts(rt) -> list:
    skills = shipped_skills(rt)
    out = []
    for names, sys_i, about in COMPOSITIONS:
        msgs = [{"role": "system", "content": SYSTEMS[sys_i]}, {"role": "user", "content": QUESTIONS[about]}]
        out.append((names, rt.prompts.build(msgs, [skills[n] for n in names])))
    return out


def speed(rt, args) -> dict:
    from service.runtime.prompt import PromptPlan, Segment

    plan = PromptPlan([Segment("text", corpus_ids(rt, args.prefill_tokens))])
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        rt.prefill(plan, [], mode="full")
        times.append(time.perf_counter() - t0)
    out = {"prefill_ms": min(times) * 1e3, "decode_ms": {}}
    for ctx in args.contexts:
        cids = corpus_ids(rt, ctx)
        for b in args.batch:
            out["decode_ms"][f"{ctx}x{b}"] = _batched(rt, cids, b, args.steps, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--prefill-tokens", type=int, default=2560)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2560])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--greedy", type=int, default=32)
    ap.add_argument("--seam", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ref: dict = {}
    rows = []
    with torch.inference_mode():
        for fmt in args.formats:
            rt = runtime(fmt)
            row = {"format": fmt, **speed(rt, args), "cases": []}
            for i, (names, plan) in enumerate(prompts(rt)):
                full = rt.prefill(plan, [], mode="full")
                greedy = greedy_ids(rt, full, args.greedy)
                blocks = [rt.compile_block(seg.ids) for seg in plan.segments if seg.kind == "skill"]
                comp = rt.prefill(plan, blocks, mode="compose", seam_tokens=args.seam)
                case = {"skills": names, "compose_vs_own_full": logit_stats(comp.logits, full.logits)}
                if fmt == "float32":
                    ref[i] = (full.logits.float(), greedy)
                elif i in ref:
                    case["vs_float32"] = {**logit_stats(full.logits, ref[i][0]), "greedy_equal": greedy == ref[i][1]}
                row["cases"].append(case)
            vs = [c["vs_float32"] for c in row["cases"] if "vs_float32" in c]
            own = [c["compose_vs_own_full"] for c in row["cases"]]
            row["summary"] = {
                "kl_vs_float32_mean": statistics.mean(v["kl"] for v in vs) if vs else 0.0,
                "top1_vs_float32": sum(v["top1"] for v in vs) if vs else len(own),
                "greedy_equal_vs_float32": sum(v["greedy_equal"] for v in vs) if vs else len(own),
                "compose_cosine_min": min(o["cosine"] for o in own), "compose_kl_mean": statistics.mean(
                    o["kl"] for o in own), "compose_top1": sum(o["top1"] for o in own), "n": len(own)}
            rows.append(row)
            s, d = row["summary"], row["decode_ms"]
            print(f"{fmt:10s} prefill {row['prefill_ms']:7.0f} ms  decode " +
                  "  ".join(f"{k}: {v:6.1f} ms" for k, v in d.items()) +
                  f"  | vs float32: KL {s['kl_vs_float32_mean']:.4f} top-1 {s['top1_vs_float32']}/{s['n']} greedy "
                  f"{s['greedy_equal_vs_float32']}/{s['n']} | compose vs own full: cos min "
                  f"{s['compose_cosine_min']:.5f} KL {s['compose_kl_mean']:.4f} top-1 {s['compose_top1']}/{s['n']}",
                  flush=True)
            del rt
    write_json(args.json, {"args": vars(args), "threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
