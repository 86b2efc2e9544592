"""What a typed reply costs per token: decode with and without a JSON schema, one stream and eight at once.

    python bench/structured.py --json bench/out/structured.json

One `python -m service` (embedded model, the shipped skills), then rounds that alternate the two arms on the same
prompts (a composed skill, a user turn, greedy, --tokens each): `free` (no format) and `typed` (response_format
json_schema: an object whose strings the model fills at length, so the reply runs to --tokens like the free one).
Decode tokens/s of one stream = tokens after the first / time after the first token; of eight = all tokens / wall
time from the send to the last end. Reported: the typed arm's decode rate as a ratio of the free arm's, per round
and the median (issue 51: at most 10% slower per token at 1 and 8 streams).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from common import sse_json, write_json
from peers_run import environment
from service.devserver import ROOT, ServiceProcess

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "steps", "tone"],
          "properties": {"answer": {"type": "string"}, "steps": {"type": "array", "items": {"type": "string"}},
                         "tone": {"enum": ["formal", "friendly"]}}}


def body(i: int, n: int, typed: bool) -> dict:
    out = {"messages": [{"role": "user", "content": f"Question {i}: how do I get a refund for an order that arrived "
                         "broken? Explain every step in detail."}],
           "skills": ["refund-policy"], "max_tokens": n, "temperature": 0, "stream": True,
           "stream_options": {"include_usage": True}}
    if typed:
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    return out


async def one(c: httpx.AsyncClient, payload: dict) -> dict:
    t0, first, n, text = time.perf_counter(), None, 0, []
    async for obj in sse_json(c, "/v1/chat/completions", payload):
        for ch in obj.get("choices") or []:
            if ch["delta"].get("content"):
                first = first or time.perf_counter()
                text.append(ch["delta"]["content"])
        if obj.get("usage"):
            n = obj["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"tokens": n, "ttft_s": (first or end) - t0, "end_s": end - t0, "text": "".join(text)}


async def run(url: str, args) -> dict:
    rounds = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        for i in range(2):  # warm: the skill's block, the engine's first batches
            await one(c, body(900 + i, 8, bool(i)))
        for rnd in range(args.rounds):
            row: dict = {}
            for arm in (("free", "typed") if rnd % 2 == 0 else ("typed", "free")):
                typed = arm == "typed"
                single = [await one(c, body(10 * rnd + k, args.tokens, typed)) for k in range(args.single)]
                rate = [(s["tokens"] - 1) / (s["end_s"] - s["ttft_s"]) for s in single if s["tokens"] > 1]
                t0 = time.perf_counter()
                eight = await asyncio.gather(*[one(c, body(100 + 8 * rnd + j, args.tokens, typed)) for j in range(8)])
                wall = time.perf_counter() - t0
                row[arm] = {"single_decode_tok_s": statistics.median(rate), "eight_tok_s":
                            sum(e["tokens"] for e in eight) / wall,
                            "tokens": [s["tokens"] for s in single] + [e["tokens"] for e in eight]}
                if typed:
                    row[arm]["valid_json"] = sum(_json(s["text"]) for s in single + eight)
            row["single_ratio"] = row["typed"]["single_decode_tok_s"] / row["free"]["single_decode_tok_s"]
            row["eight_ratio"] = row["typed"]["eight_tok_s"] / row["free"]["eight_tok_s"]
            print(f"round {rnd}: one stream {row['free']['single_decode_tok_s']:.1f} free / "
                  f"{row['typed']['single_decode_tok_s']:.1f} typed tokens/s ({row['single_ratio']:.3f}x); eight "
                  f"{row['free']['eight_tok_s']:.1f} / {row['typed']['eight_tok_s']:.1f} ({row['eight_ratio']:.3f}x)",
                  flush=True)
            rounds.append(row)
    return {"rounds": rounds, "single_ratio_median": statistics.median(r["single_ratio"] for r in rounds),
            "eight_ratio_median": statistics.median(r["eight_ratio"] for r in rounds)}


def _json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--single", type=int, default=3, help="one-stream requests per arm and round")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    env = {"SKILLCACHE_SKILLS_DIR": str(ROOT / "skills"), "SKILLCACHE_SHADOW_SAMPLE_RATE": "0"}
    svc = ServiceProcess(Path(tempfile.mkdtemp(prefix="skillcache-structured-")), env, threads=None).start()
    try:
        svc.wait_ready(600)
        out = {"environment": environment(), "args": vars(args), **asyncio.run(run(svc.url, args))}
    finally:
        svc.stop()
    print(f"median typed/free decode rate: one stream {out['single_ratio_median']:.3f}x, "
          f"eight streams {out['eight_ratio_median']:.3f}x")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
