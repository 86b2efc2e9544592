"""Store throughput on a block shaped like the embedded model's (SmolLM2-135M: 30 layers, 3 KV heads, D=64).

    python bench/store.py --json OUT.json [--tokens 4096] [--dtype float32] [--repeats 3]

Reports put/get seconds and MB/s (median of N) for the memory, disk and Redis tiers, plus the
serialization alone. Redis: a private redis-server on a free port (skipped if not installed).
Disk reads are from the page cache right after the write (warm), as a hot replica would see them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # repo root

from service.kv.block import LAYOUT_VERSION, KVBlock  # noqa: E402
from service.store.base import BlockStore  # noqa: E402
from service.store.disk import DiskBlockStore  # noqa: E402
from service.store.key import BlockKey  # noqa: E402
from service.store.memory import MemoryBlockStore  # noqa: E402
from service.store.redis import RedisBlockStore  # noqa: E402
from service.store.serde import decode_block, encode_block  # noqa: E402
from tests.redis_server import RedisServer, redis_server_binary  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_block(tokens: int = 4096, layers: int = 30, kv_heads: int = 3, head_dim: int = 64,
               dtype: torch.dtype = torch.float32) -> KVBlock:
    """Random K/V, L x [1, kv_heads, tokens, head_dim]."""
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(1, kv_heads, tokens, head_dim, generator=g).to(dtype) for _ in range(layers)]
    values = [torch.randn(1, kv_heads, tokens, head_dim, generator=g).to(dtype) for _ in range(layers)]
    return KVBlock(keys=keys, values=values, token_ids=list(range(tokens)), model_fingerprint="bench-fp")


def _key(block: KVBlock) -> BlockKey:
    return BlockKey(block.model_fingerprint, LAYOUT_VERSION, "bench", "h" + str(block.n_tokens))


def _stats(put: list[float], get: list[float], nbytes: int) -> dict[str, float]:
    p, g = statistics.median(put), statistics.median(get)
    mb = nbytes / 1e6
    return {"put_s": p, "get_s": g, "put_mb_s": mb / p if p else float("inf"),
            "get_mb_s": mb / g if g else float("inf")}


async def _time_tier(store: BlockStore, block: KVBlock, repeats: int) -> dict[str, float]:
    key, put, get = _key(block), [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await store.put(key, block)
        put.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = await store.get(key)
        get.append(time.perf_counter() - t0)
        assert got is not None and torch.equal(got.keys[-1], block.keys[-1]), f"{store.name}: bad round trip"
    await store.delete(key)
    return _stats(put, get, block.size_bytes)


async def _measure(block: KVBlock, repeats: int, redis_url: str | None, chunk_bytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {"block_bytes": block.size_bytes, "n_layers": block.n_layers, "n_tokens": block.n_tokens,
                           "dtype": str(block.dtype).removeprefix("torch."), "repeats": repeats}
    enc, dec = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        data = encode_block(_key(block), block)
        enc.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        decode_block(data, _key(block))
        dec.append(time.perf_counter() - t0)
    out["serde"] = _stats(enc, dec, block.size_bytes) | {"payload_bytes": len(data)}
    del data
    out["memory"] = await _time_tier(MemoryBlockStore(2 * block.size_bytes), block, repeats)
    with tempfile.TemporaryDirectory(prefix="skillcache-bench-") as d:
        out["disk"] = await _time_tier(DiskBlockStore(Path(d)), block, repeats)
    if redis_url:
        store = RedisBlockStore(redis_url, chunk_bytes=chunk_bytes, op_timeout_s=30.0)
        try:
            out["redis"] = await _time_tier(store, block, repeats) | {"chunk_bytes": chunk_bytes}
        finally:
            await store.close()
    return out


def measure(block: KVBlock, repeats: int = 3, redis_url: str | None = None,
            chunk_bytes: int = 32 * 1024 * 1024) -> dict[str, Any]:
    """Timings for `block` on every tier. Starts a private redis-server unless `redis_url` is given."""
    if redis_url is not None or redis_server_binary() is None:
        return asyncio.run(_measure(block, repeats, redis_url, chunk_bytes))
    with RedisServer() as srv:
        return asyncio.run(_measure(block, repeats, srv.url, chunk_bytes))


def print_table(res: dict[str, Any]) -> None:
    print(f"block: {res['n_layers']} layers x {res['n_tokens']} tokens, {res['dtype']}, "
          f"{res['block_bytes'] / 1e6:.1f} MB, median of {res['repeats']}")
    print(f"{'tier':<8} {'put s':>8} {'put MB/s':>10} {'get s':>8} {'get MB/s':>10}")
    for tier in ("serde", "memory", "disk", "redis"):
        if tier in res:
            r = res[tier]
            label = "serde*" if tier == "serde" else tier
            print(f"{label:<8} {r['put_s']:>8.3f} {r['put_mb_s']:>10.0f} {r['get_s']:>8.3f} {r['get_mb_s']:>10.0f}")
    print("* serde: put = encode_block, get = decode_block (included in disk and redis figures)")


def measure_with_compose(args) -> dict[str, Any]:
    """A real ~N-token block compiled by the embedded model: store load time next to compose time."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import corpus_ids, load_runtime, timed

    rt = load_runtime("embedded", dtype=args.dtype if args.dtype != "float32" else "auto")
    ids = corpus_ids(rt, args.tokens)
    block = rt.compile_block(ids)
    res = measure(block, repeats=args.repeats, redis_url=args.redis_url, chunk_bytes=args.chunk_bytes)
    msgs = [{"role": "system", "content": "You are a helpful agent."}, {"role": "user", "content": "Summarise."}]
    plan = rt.prompts.build(msgs, [ids])
    compose_ms, _ = timed(lambda: rt.prefill(plan, [block], mode="compose", seam_tokens=4), rt.device, args.repeats)
    res["compose_ms"] = compose_ms
    print_table(res)
    print(f"compose (seam 4, block from memory) of the same block: {compose_ms:.1f} ms")
    for tier in ("memory", "disk", "redis"):
        if tier in res:
            get_ms = res[tier]["get_s"] * 1e3
            print(f"  {tier:<7} load {get_ms:8.1f} ms = {get_ms / compose_ms:5.2f}x compose time")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-bytes", type=int, default=32 * 1024 * 1024)
    ap.add_argument("--redis-url", help="use this Redis instead of starting one")
    ap.add_argument("--synthetic", action="store_true",
                    help="random tensors shaped like the embedded model instead of a real compiled block, "
                         "and no compose timing")
    args = ap.parse_args()
    if args.synthetic:
        block = make_block(tokens=args.tokens, dtype=DTYPES[args.dtype])
        res = measure(block, repeats=args.repeats, redis_url=args.redis_url, chunk_bytes=args.chunk_bytes)
        print_table(res)
    else:
        res = measure_with_compose(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
