"""The attention kernel (service/runtime/attention.py) against transformers' sdpa, in process, side by side.

    python bench/attention.py --json bench/out/attention.json

The embedded model with packed decode, on one thread that claims torch's threads (as the serving engine runs it):
  step   a DecodeBatch decode step of B rows of --contexts tokens of real text (each row its own rotation of it),
         the kernel (SKILLCACHE_ATTENTION_KERNEL=true) vs sdpa (false); the greedy tokens of both arms are compared
  tail   a repeated order's tail: --tail tokens prefilled after a --prefix-token exact prefix copied into a fresh
         cache (a refined order's first token: copy + tail forward), sdpa's grouped-query path vs transformers'
The arms alternate within each of --repeats rounds; reported: the median ms of each arm and sdpa / kernel.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from common import corpus_ids, load_runtime, write_json


def _prefilled(rt, ids, rows: int) -> list:
    """Each row's prefilled cache (its own rotation of the text) and first token, made once for every arm."""
    from service.kv.cache import new_cache

    out = []
    for r in range(rows):
        cache = new_cache(rt.model.config)
        out.append((cache, int(rt.forward(ids[r:] + ids[:r], 0, cache).argmax())))
    return out


def _step_ms(rt, prefilled, kernel: bool, steps: int) -> tuple[float, list]:
    from service.runtime.serving.runner import DecodeBatch

    batch = DecodeBatch(rt, kernel_attention=kernel)
    for cache, _ in prefilled:  # join copies the cache into the batch: the prefilled caches stay as they are
        batch.join(cache, cache.get_seq_length() + steps + 3)
    toks = [t for _, t in prefilled]
    times, greedy = [], []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        toks = batch.step(toks).argmax(-1).tolist()
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t0)
        greedy.append(toks)
    return statistics.median(times) * 1e3, greedy


def _tail_ms(rt, block, tail: list[int], kernel: bool) -> float:
    from service.kv.cache import append_kv, new_cache

    rt.kernel_attention = kernel
    t0 = time.perf_counter()
    cache = new_cache(rt.model.config, reserve_tokens=block.n_tokens + len(tail) + 16)
    append_kv(cache, block.keys, block.values)
    rt.forward(tail, block.n_tokens, cache)
    return (time.perf_counter() - t0) * 1e3


def run(args) -> dict:
    import torch

    from service.kv.cache import block_from_cache, new_cache
    from service.runtime.threads import claim

    claim(0)
    rt = load_runtime("embedded", "cpu", "float32", packed=True)
    assert rt.kernel_attention, "the kernel did not build here"
    out = {"step": [], "tail": None}
    with torch.inference_mode():
        for ctx in args.contexts:
            ids = corpus_ids(rt, ctx)
            for rows in args.rows:
                prefilled = _prefilled(rt, ids, rows)
                arms = {True: [], False: []}
                same = True
                for _ in range(args.repeats):
                    got = {k: _step_ms(rt, prefilled, k, args.steps) for k in (True, False)}
                    for k, (ms, _) in got.items():
                        arms[k].append(ms)
                    same &= got[True][1] == got[False][1]
                k, s = statistics.median(arms[True]), statistics.median(arms[False])
                out["step"].append({"context": ctx, "rows": rows, "kernel_ms": k, "sdpa_ms": s, "x": s / k,
                                    "same_greedy": same})
                print(f"step  {ctx:5d} tokens x {rows} rows: kernel {k:6.1f} ms, sdpa {s:6.1f} ms ({s / k:.2f}x), "
                      f"same greedy tokens: {same}", flush=True)
        ids = corpus_ids(rt, args.prefix + args.tail)
        pre = new_cache(rt.model.config)
        rt.forward(ids[:args.prefix], 0, pre)
        block = block_from_cache(pre, ids[:args.prefix], rt.fingerprint)
        arms = {True: [], False: []}
        for _ in range(args.repeats * 4):
            for k in (True, False):
                arms[k].append(_tail_ms(rt, block, ids[args.prefix:], k))
        k, s = statistics.median(arms[True]), statistics.median(arms[False])
        out["tail"] = {"prefix": args.prefix, "tail": args.tail, "kernel_ms": k, "sdpa_ms": s, "x": s / k}
        print(f"tail  {args.tail} tokens after a {args.prefix}-token prefix: grouped-query {k:6.1f} ms, "
              f"repeat_kv {s:6.1f} ms ({s / k:.2f}x)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2560])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefix", type=int, default=2391)
    ap.add_argument("--tail", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    box = {}
    t = threading.Thread(target=lambda: box.update(run(args)), name="model")  # nothing runs torch on the main thread
    t.start()
    t.join()
    write_json(args.json, {"model": "embedded", **box})


if __name__ == "__main__":
    main()
