"""Decode step cost in process: the serving engine's batched decode vs one sequence on transformers' DynamicCache.

    python bench/decode.py --json bench/out/decode.json                       # embedded model, this CPU
    python bench/decode.py --model llama-3.1-8b --device cuda --batch 1 8 32  # GPU, random weights (bench/gpu)

For each context length and batch size B: B sequences of that context (real text, prefilled once, outside the
timing) decode --steps tokens (greedy, in steps after --warmup):
  dynamic  one sequence, `model(...)` on a DynamicCache (torch.cat of every layer's K/V each step): the
           engine before this change, B = 1 only
  batched  the serving engine's DecodeBatch (service/runtime/serving/runner.py): B rows in one forward, each at
           its own position, per-layer buffers written in place
Reported: ms per step (median), tokens/s (B / step), and the speedup over B = 1 of the same arm.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import corpus_ids, load_runtime, sync, write_json
from transformers import DynamicCache

import torch


def _dynamic(rt, ids: list[int], steps: int, warmup: int) -> float:
    cache = DynamicCache(config=rt.model.config)
    logits = rt.forward(ids, 0, cache)
    tok, pos, times = int(logits.argmax()), len(ids), []
    for i in range(warmup + steps):
        sync(rt.device)
        t0 = time.perf_counter()
        logits = rt.forward([tok], pos, cache)
        tok = int(logits.argmax())
        sync(rt.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        pos += 1
    return statistics.median(times) * 1e3


def _batched(rt, ids: list[int], b: int, steps: int, warmup: int) -> float:
    from service.kv.cache import new_cache
    from service.runtime.serving.runner import DecodeBatch

    batch = DecodeBatch(rt)
    toks = []
    for row in range(b):
        cache = new_cache(rt.model.config)
        row_ids = ids[row:] + ids[:row]  # different text per row, same length
        toks.append(int(rt.forward(row_ids, 0, cache).argmax()))
        batch.join(cache, len(ids) + warmup + steps + 1)
    times = []
    for i in range(warmup + steps):
        sync(rt.device)
        t0 = time.perf_counter()
        toks = batch.step(toks).argmax(-1).tolist()
        sync(rt.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2560])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rt = load_runtime(args.model, args.device, args.dtype)
    rows = []
    with torch.inference_mode():
        for ctx in args.contexts:
            ids = corpus_ids(rt, ctx)
            dyn = _dynamic(rt, ids, args.steps, args.warmup)
            rows.append({"context": ctx, "arm": "dynamic", "batch": 1, "ms_per_step": dyn, "tokens_per_s": 1e3 / dyn})
            print(f"context {ctx:6d}  dynamic  B= 1  {dyn:8.2f} ms/step  {1e3 / dyn:8.1f} tok/s", flush=True)
            base = None
            for b in args.batch:
                ms = _batched(rt, ids, b, args.steps, args.warmup)
                base = base or ms
                rows.append({"context": ctx, "arm": "batched", "batch": b, "ms_per_step": ms,
                             "tokens_per_s": b * 1e3 / ms, "x_tokens_per_s_vs_b1": b * base / ms})
                print(f"context {ctx:6d}  batched  B={b:2d}  {ms:8.2f} ms/step  {b * 1e3 / ms:8.1f} tok/s  "
                      f"({b * base / ms:.2f}x B=1)", flush=True)
    write_json(args.json, {"model": args.model, "device": str(rt.device), "dtype": str(rt.loaded.dtype),
                           "threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
