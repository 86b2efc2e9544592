"""What chunked prefill costs: one long prompt prefilled in forwards of N tokens, for several N.

    python bench/chunks.py --json bench/out/chunks.json

A --tokens prompt of real text (the embedded model unless --model), prefilled onto one cache in pieces of each
--chunks size, as the serving engine does with SKILLCACHE_PREFILL_CHUNK_TOKENS (live) and
SKILLCACHE_BACKGROUND_CHUNK_TOKENS (background). Reported per size: the total time, the first and the last
piece (the last attends to the whole prompt) and the total against one forward.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import corpus_ids, load_runtime, write_json


def prefill(rt, ids: list[int], chunk: int) -> list[float]:
    from service.kv.cache import new_cache

    cache = new_cache(rt.model.config, reserve_tokens=len(ids))
    times = []
    with torch.inference_mode():
        for lo in range(0, len(ids), chunk):
            t0 = time.perf_counter()
            rt.forward(ids[lo:lo + chunk], lo, cache)
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--tokens", type=int, default=2560)
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 1024, 512, 256, 128, 32], help="0: one forward")
    ap.add_argument("--json")
    args = ap.parse_args()
    rt = load_runtime(args.model)
    ids = corpus_ids(rt, args.tokens)
    prefill(rt, ids, 256)  # warm-up
    rows = []
    for chunk in args.chunks:
        times = prefill(rt, ids, chunk or len(ids))
        rows.append({"chunk": chunk or len(ids), "total_s": sum(times), "first_ms": times[0] * 1e3,
                     "last_ms": times[-1] * 1e3, "forwards": len(times)})
    one = next((r["total_s"] for r in rows if r["chunk"] == len(ids)), None)
    for r in rows:
        r["vs_one_forward"] = r["total_s"] / one if one else None
        print(f"chunk {r['chunk']:5d}: {r['forwards']:3d} forwards, total {r['total_s']:6.2f} s"
              + (f" ({r['vs_one_forward']:.2f}x one forward)" if one else "")
              + f", first {r['first_ms']:6.0f} ms, last {r['last_ms']:6.0f} ms", flush=True)
    write_json(args.json, {"model": rt.loaded.name, "tokens": len(ids), "threads": torch.get_num_threads(),
                           "rows": rows})


if __name__ == "__main__":
    main()
