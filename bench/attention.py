"""The attention kernel (service/runtime/attention.py) against transformers' sdpa, in process, side by side.

    python bench/attention.py --json bench/out/attention.json

The embedded model with packed decode, on one thread that claims torch's threads (as the serving engine runs it):
  step   a DecodeBatch decode step of B rows of --contexts tokens of real text (each row its own rotation of it),
         the kernel (SKILLCACHE_ATTENTION_KERNEL=true) vs sdpa (false); the greedy tokens of both arms are compared
  shared a DecodeBatch step of B rows in --groups groups, each group's rows on the same --contexts-token prefix (a
         skill many requests compose) and a 32-token text of their own: rows reading shared chunks of K/V from one
         row (the default) vs each its own; the logits of both arms are compared bitwise
  tail   a repeated order's tail: --tail tokens prefilled after a --prefix-token exact prefix copied into a fresh
         cache (a refined order's first token: copy + tail forward), sdpa's grouped-query path vs transformers'
  before (with --before REV) a DecodeBatch step of B rows in --groups groups as in `shared`, this tree's kernel vs
         commit REV's decode_attention.cpp built here; the logits of both arms are compared bitwise
The arms alternate within each of --repeats rounds; reported: the median ms of each arm and sdpa / kernel.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from common import corpus_ids, kernel_of, load_runtime, write_json


def _prefilled(rt, ids, rows: int) -> list:
    """Each row's prefilled cache (its own rotation of the text) and first token, made once for every arm."""
    from service.kv.cache import new_cache

    out = []
    for r in range(rows):
        cache = new_cache(rt.model.config)
        out.append((cache, int(rt.forward(ids[r:] + ids[:r], 0, cache).argmax())))
    return out


def _grouped(rt, ids, rows: int, groups: int, own: int = 32) -> list:
    """Like _prefilled, but row r's cache is its group's prefix (ids rotated per group, prefilled once per group) and
    then `own` tokens of its own."""
    from service.kv.cache import append_kv, block_from_cache, new_cache

    blocks = []
    for g in range(groups):
        cache = new_cache(rt.model.config)
        text = ids[97 * g:] + ids[:97 * g]
        rt.forward(text, 0, cache)
        blocks.append(block_from_cache(cache, text, rt.fingerprint))
    out = []
    for r in range(rows):
        block = blocks[r % groups]
        cache = new_cache(rt.model.config, reserve_tokens=block.n_tokens + own)
        append_kv(cache, block.keys, block.values)
        tail = ids[own * r + 5:own * (r + 1) + 5]
        out.append((cache, int(rt.forward(tail, block.n_tokens, cache).argmax())))
    return out


def _step_ms(rt, prefilled, kernel: bool, steps: int, share: bool = True) -> tuple[float, list]:
    from service.runtime.serving.runner import DecodeBatch

    batch = DecodeBatch(rt, kernel_attention=kernel, share_chunks=share)
    for cache, _ in prefilled:  # join copies the cache into the batch: the prefilled caches stay as they are
        batch.join(cache, cache.get_seq_length() + steps + 3)
    toks = [t for _, t in prefilled]
    times, logits = [], []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        step = batch.step(toks)
        toks = step.argmax(-1).tolist()
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t0)
        logits.append(step)
    return statistics.median(times) * 1e3, logits


def _with_kernel(ext, fn):
    """fn() with the attention calling `ext`'s decode_attention (None: this tree's)."""
    from service.runtime import attention

    current = attention.extension
    if ext is not None:
        attention.extension = lambda: ext
    try:
        return fn()
    finally:
        attention.extension = current


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
    out = {"step": [], "shared": [], "tail": None}
    with torch.inference_mode():
        for ctx in args.contexts if "step" in args.parts else []:
            ids = corpus_ids(rt, ctx)
            for rows in args.rows:
                prefilled = _prefilled(rt, ids, rows)
                arms = {True: [], False: []}
                same = True
                for _ in range(args.repeats):
                    got = {k: _step_ms(rt, prefilled, k, args.steps) for k in (True, False)}
                    for k, (ms, _) in got.items():
                        arms[k].append(ms)
                    same &= all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(got[True][1], got[False][1]))
                k, s = statistics.median(arms[True]), statistics.median(arms[False])
                out["step"].append({"context": ctx, "rows": rows, "kernel_ms": k, "sdpa_ms": s, "x": s / k,
                                    "same_greedy": same})
                print(f"step  {ctx:5d} tokens x {rows} rows: kernel {k:6.1f} ms, sdpa {s:6.1f} ms ({s / k:.2f}x), "
                      f"same greedy tokens: {same}", flush=True)
        for ctx in args.contexts if "shared" in args.parts else []:
            ids = corpus_ids(rt, ctx)
            for rows in args.rows:
                prefilled = _grouped(rt, ids, rows, args.groups)
                arms = {True: [], False: []}
                same = True
                for _ in range(args.repeats):
                    got = {k: _step_ms(rt, prefilled, True, args.steps, share=k) for k in (True, False)}
                    for k, (ms, _) in got.items():
                        arms[k].append(ms)
                    same &= all(torch.equal(a, b) for a, b in zip(got[True][1], got[False][1]))
                on, off = statistics.median(arms[True]), statistics.median(arms[False])
                out["shared"].append({"context": ctx, "rows": rows, "groups": args.groups, "shared_ms": on,
                                      "own_ms": off, "x": off / on, "same_logits": same})
                print(f"shared {ctx:5d} tokens x {rows} rows in {args.groups} groups: shared {on:6.1f} ms, own "
                      f"{off:6.1f} ms ({off / on:.2f}x), same logits (bitwise): {same}", flush=True)
        if args.before and "before" in args.parts:
            before = kernel_of(args.before, "decode_attention.cpp", "decode_attention")
            out["before"] = []
            for ctx in args.contexts:
                ids = corpus_ids(rt, ctx)
                for rows in args.rows:
                    prefilled = _grouped(rt, ids, rows, args.groups)
                    arms = {"this": [], "before": []}
                    same = True
                    for _ in range(args.repeats):
                        got = {k: _with_kernel(before if k == "before" else None,
                                               lambda: _step_ms(rt, prefilled, True, args.steps)) for k in arms}
                        for k, (ms, _) in got.items():
                            arms[k].append(ms)
                        same &= all(torch.equal(a, b) for a, b in zip(got["this"][1], got["before"][1]))
                    this, old = statistics.median(arms["this"]), statistics.median(arms["before"])
                    out["before"].append({"context": ctx, "rows": rows, "groups": args.groups, "this_ms": this,
                                          "before_ms": old, "x": old / this, "same_logits": same})
                    print(f"before {ctx:5d} tokens x {rows} rows in {args.groups} groups: this tree {this:6.1f} ms, "
                          f"{args.before} {old:6.1f} ms ({old / this:.2f}x), same logits (bitwise): {same}", flush=True)
        if "tail" not in args.parts:
            return out
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
    ap.add_argument("--parts", nargs="+", choices=["step", "shared", "tail", "before"],
                    default=["step", "shared", "tail"])
    ap.add_argument("--groups", type=int, default=3, help="shared: prefixes the rows are spread over")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefix", type=int, default=2391)
    ap.add_argument("--tail", type=int, default=30)
    ap.add_argument("--before", help="part `before`: the decode_attention.cpp of this commit (git rev), built here")
    ap.add_argument("--json")
    args = ap.parse_args()
    box = {}
    t = threading.Thread(target=lambda: box.update(run(args)), name="model")  # nothing runs torch on the main thread
    t.start()
    t.join()
    write_json(args.json, {"model": "embedded", **box})


if __name__ == "__main__":
    main()
