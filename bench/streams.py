"""Decode speed as a client sees it, against a running service: one stream, then eight at once.

    python -m service --port 8011 &                         # the arm: any SKILLCACHE_* setting
    python bench/streams.py --url http://127.0.0.1:8011 --json bench/out/streams.json

The three shipped skills in one order (composed twice first and given --settle-s, so the order is refined, as a
repeated agent prompt is), then --single requests of --tokens greedy tokens one after another (decode tokens/s =
tokens after the first / time after the first token), then --rounds rounds of 8 requests at once with --batch-tokens
each (tokens/s = all tokens / wall time from the send to the last end). Each request has its own user turn.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx

from common import stream_compose, write_json

SKILLS = ["refund-policy", "tool-specs", "style-guide"]


def body(turn: int, n: int) -> dict:
    return {"skills": SKILLS, "user": f"Question {turn}: how do I get a refund for an order that arrived broken? "
            "Explain in detail.", "max_tokens": n, "temperature": 0, "stream": True}


async def run(args) -> dict:
    out = {"single": [], "eight": []}
    async with httpx.AsyncClient(base_url=args.url, timeout=600) as c:
        for i in range(2):
            await stream_compose(c, body(100 + i, 8))
        await asyncio.sleep(args.settle_s)
        for i in range(args.single):
            t0 = time.perf_counter()
            r = await stream_compose(c, body(i, args.tokens))
            n = r["done"]["usage"]["completion_tokens"]
            row = {"ttft_ms": r["ttft_s"] * 1e3, "tokens": n,
                   "decode_tokens_per_s": (n - 1) / (r["t_end"] - t0 - r["ttft_s"])}
            out["single"].append(row)
            print(f"one stream: first token {row['ttft_ms']:.0f} ms, {n} tokens, "
                  f"decode {row['decode_tokens_per_s']:.1f} tokens/s", flush=True)
        for rnd in range(args.rounds):
            t0 = time.perf_counter()
            rs = await asyncio.gather(*[stream_compose(c, body(10 + j + 8 * rnd, args.batch_tokens)) for j in range(8)])
            total, wall = sum(r["done"]["usage"]["completion_tokens"] for r in rs), max(r["t_end"] for r in rs) - t0
            out["eight"].append({"tokens": total, "wall_s": wall, "tokens_per_s": total / wall})
            print(f"8 streams: {total} tokens in {wall:.1f} s = {total / wall:.1f} tokens/s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--single", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-tokens", type=int, default=64)
    ap.add_argument("--settle-s", type=float, default=20.0, help="after the two warm-up compositions: refinement")
    ap.add_argument("--json")
    args = ap.parse_args()
    write_json(args.json, asyncio.run(run(args)))


if __name__ == "__main__":
    main()
