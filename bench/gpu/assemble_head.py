"""Assemble a composed head into FlashAttention's paged cache layout, as the connector does on a GPU: check it, time it.

    python bench/gpu/assemble_head.py --model llama-3.1-8b --tokens 32768 --device cuda --json $OUT/assemble.json
    python bench/gpu/assemble_head.py --model llama-smoke --tokens 1024 --device cpu     # the same path, here

What the connector does per piece and layer (service/vllm/paged.py, write_piece: the code under test, not a copy):
keys re-rotated by the piece's move with the project's rotary code (service/kv/rope.py, KeyRotator, built from the
model's config alone: service/runtime/adapters.py, rotator_for_config), then the backend's cache write. vLLM's CUDA
build cannot be installed on the lent machine, so the write is FlashAttention's `reshape_and_cache_flash` as
torch indexing on its layout ([2, num_blocks, block_size, H_kv, D] per layer: keys then values); where vLLM is
importable its own op is used instead and named in the output.

The head: --blocks skill blocks of tokens/blocks tokens each, every block compiled once at the canonical place
(after a --base-token anchor) and moved to its place in the head; physical cache blocks in a shuffled order, as
vLLM's allocator hands them out. Check: for three layers, every slot's keys against RoPE applied directly at the
target positions to the same pre-RoPE keys (float32 reference; max abs error and cosine reported) and values equal.
Timing (median of --repeats, synchronised): the whole head from canonical K/V already on the device (a GPU tier),
and from pinned host memory (the record crossing PCIe first). Bytes moved per assembly: read K and V, write K and V.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from common import CONFIGS  # noqa: E402
from service.runtime.adapters import rotator_for_config  # noqa: E402
from service.vllm.paged import write_piece  # noqa: E402


def flash_write():
    """(write(k, v, cache, slots), name): the CUDA backend's cache write on cache [2, blocks, bs, H, D]."""
    try:
        from vllm import _custom_ops as ops  # only where vLLM's CUDA build is installed

        def vllm_write(k, v, cache, slots):
            ops.reshape_and_cache_flash(k, v, cache[0], cache[1], slots, "auto", _ONE, _ONE)

        return vllm_write, "vllm reshape_and_cache_flash"
    except Exception:  # noqa: BLE001 - no vLLM here: the same placement as torch indexing
        pass

    def torch_write(k, v, cache, slots):
        _, _, bs, h, d = cache.shape
        cache[0].view(-1, h, d).index_copy_(0, slots, k)
        cache[1].view(-1, h, d).index_copy_(0, slots, v)

    return torch_write, "torch index_copy_ on FlashAttention's layout"


_ONE = torch.tensor(1.0)


def rope_at(rotator, k0: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
    """Pre-RoPE keys k0 [T, H, D] rotated to `positions` [T] directly (the model's own rotary and apply): float32."""
    rotary = rotator.rotary_embs[rotator.layer_rope[layer]]
    dummy = torch.zeros(1, device=k0.device, dtype=torch.float32)
    cos, sin = rotary(dummy, position_ids=positions[None].to(k0.device))  # [1, T, D]
    kk = k0.float().transpose(0, 1)[None]  # [1, H, T, D]
    _, out = rotator.apply_rotary(kk[:, :1, :1], kk, cos, sin)
    return out[0].transpose(0, 1)  # [T, H, D]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(CONFIGS))
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--blocks", type=int, default=8, help="skill blocks the head is made of")
    ap.add_argument("--base", type=int, default=32, help="anchor tokens before every block at compile")
    ap.add_argument("--block-size", type=int, default=16, help="vLLM's cache block (16: CUDA's default)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev, dt = torch.device(args.device), getattr(torch, args.dtype)
    model_type, kw = CONFIGS[args.model]
    cfg = AutoConfig.for_model(model_type, **kw)
    n_layers, h = cfg.num_hidden_layers, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rotator = rotator_for_config(cfg)
    for emb in rotator.rotary_embs:
        emb.to(dev)
    write, write_name = flash_write()
    per = args.tokens // args.blocks
    n_head = args.base + per * args.blocks
    bs = args.block_size
    n_blocks = -(-n_head // bs) + 1
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(n_blocks, generator=g)  # logical block -> physical block
    pos = torch.arange(args.base, n_head)  # the head's moved tokens (the anchor is vLLM's own prefix)
    slots = (table[pos // bs] * bs + pos % bs).to(dev)  # [T]
    canon_pos = torch.arange(args.base, args.base + per)
    print(f"{args.model}: {n_layers} layers, {h} KV heads of {d}, {args.dtype}; head {n_head} tokens = anchor "
          f"{args.base} + {args.blocks} blocks of {per}; cache [2, {n_blocks}, {bs}, {h}, {d}] per layer on {dev}; "
          f"write: {write_name}", flush=True)
    # canonical records: per layer, each block's post-RoPE keys at the canonical positions, and its values
    k0 = [torch.randn(args.blocks, per, h, d, generator=g).to(dev, dt) for _ in range(n_layers)]  # pre-RoPE
    canon_k = [torch.stack([rope_at(rotator, k0[li][b], canon_pos, li).to(dt) for b in range(args.blocks)])
               for li in range(n_layers)]  # [blocks, per, H, D]
    canon_v = [torch.randn(args.blocks, per, h, d, generator=g).to(dev, dt) for _ in range(n_layers)]
    caches = [torch.zeros(2, n_blocks, bs, h, d, device=dev, dtype=dt) for _ in range(n_layers)]

    def assemble(ks, vs) -> None:
        for li in range(n_layers):
            for b in range(args.blocks):
                delta = b * per  # block b sits per * b tokens after its canonical place
                write_piece(rotator, li, ks[li][b], vs[li][b], delta, caches[li], slots[b * per:(b + 1) * per], write)

    assemble(canon_k, canon_v)  # warm-up, and the result checked
    sync(dev)
    check = {}
    for li in sorted({0, n_layers // 2, n_layers - 1}):
        got_k = caches[li][0].view(-1, h, d)[slots].float()
        got_v = caches[li][1].view(-1, h, d)[slots]
        ref_k = torch.cat([rope_at(rotator, k0[li][b], canon_pos + b * per, li) for b in range(args.blocks)])
        err = (got_k - ref_k).abs().max().item()
        cos = torch.nn.functional.cosine_similarity(got_k.reshape(-1, d), ref_k.reshape(-1, d), dim=-1).min().item()
        direct = (ref_k.to(dt).float() - ref_k).abs().max().item()  # the reference's own rounding to the dtype
        check[li] = {"max_abs_err": err, "min_cosine": cos, "reference_rounding": direct,
                     "values_equal": bool(torch.equal(got_v, canon_v[li].reshape(-1, h, d)))}
        print(f"layer {li}: keys max abs err {err:.4g} (the reference's own {args.dtype} rounding {direct:.4g}), "
              f"min cosine {cos:.6f}; values equal {check[li]['values_equal']}", flush=True)
    ok = all(c["values_equal"] and c["min_cosine"] > 0.999 for c in check.values())

    def timed(ks, vs, from_host: bool) -> float:
        times = []
        for _ in range(args.repeats):
            sync(dev)
            t0 = time.perf_counter()
            if from_host:
                ks_d = [k.to(dev, non_blocking=True) for k in ks]
                vs_d = [v.to(dev, non_blocking=True) for v in vs]
                assemble(ks_d, vs_d)
            else:
                assemble(ks, vs)
            sync(dev)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    on_device = timed(canon_k, canon_v, False)
    pin = dev.type == "cuda"
    host_k = [k.cpu().pin_memory() if pin else k.cpu() for k in canon_k]
    host_v = [v.cpu().pin_memory() if pin else v.cpu() for v in canon_v]
    from_host = timed(host_k, host_v, True)
    moved = 4 * n_layers * (n_head - args.base) * h * d * torch.finfo(dt).bits // 8  # read K, V; write K, V
    out = {"model": args.model, "device": str(dev), "gpu": torch.cuda.get_device_name() if pin else None,
           "dtype": args.dtype, "n_head": n_head, "blocks": args.blocks, "block_size": bs, "write": write_name,
           "check": check, "ok": ok, "assemble_ms_on_device": on_device, "assemble_ms_from_pinned_host": from_host,
           "bytes_moved": moved, "device_gb_s": moved / on_device / 1e6}
    print(f"assemble {n_head - args.base} tokens x {n_layers} layers: {on_device:.2f} ms from device memory "
          f"({out['device_gb_s']:.0f} GB/s of {moved / 1e9:.2f} GB read+written), {from_host:.2f} ms from pinned "
          f"host memory; check {'ok' if ok else 'FAILED'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
