"""The linears of one decode step alone: float32 matmul against the packed kernel and torch's int4/int8 kernels.

    python bench/kernels.py --json bench/out/kernels.json

    python bench/kernels.py --rows 1 8 16 --before 0002ed5 --rounds 4   # beside an earlier commit's kernel

Every linear of the embedded model's shape (30 layers x q, k, v, o, gate, up, down, and the 49,152-row LM head),
each with its own random Q4_1 weight (so the weights come from memory, not cache, as in a real step), run once per
step for M rows of float32 input: float32 `x @ W^T`; service/runtime/packed.py's kernel on the blocks; with
--before REV, the kernel of commit REV, built here (a packed_blocks.cpp that takes this tree's layout, two Q4_1
levels a byte per output row: bd438ea on, but 379f011..46f6c2b, which tried panels, reverted in eef61e4); torch's
`_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm` with float32 activations (their float32 paths). Everything
runs on one thread that claims torch's threads (service/runtime/threads.py), as the serving engine runs the model,
and nothing runs torch on the main thread. The arms alternate --rounds times; reported: ms per step for each M in
--rows, the lowest of the rounds' medians of --repeats.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from common import kernel_of, write_json

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 + [(49152, 576)]


def weights(seed: int = 0):
    from service.runtime.packed import GROUP, recover_blocks

    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k in SHAPES:
        q = torch.randint(0, 16, (n, k // GROUP, GROUP), generator=g).float()
        q[..., 0], q[..., 1] = 0, 15  # as GGUF's quantizer makes them: a block's minimum is level 0, its maximum 15
        d = (torch.rand(n, k // GROUP, 1, generator=g) * 0.01).half().float()
        m = (-torch.rand(n, k // GROUP, 1, generator=g) * 0.05).half().float()
        w = (q * d + m).reshape(n, k)
        blocks = recover_blocks(w)
        assert blocks is not None and blocks[3] == "q4_1"
        i4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(n, k).to(torch.int32), 1)
        sz = torch.stack([d[..., 0].t(), (m + 8 * d)[..., 0].t()], dim=-1).contiguous()  # [K/G, N, 2]
        scale = w.abs().amax(1) / 127
        i8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        out.append((w, blocks, i4, sz, i8, scale))
    return out


def before_kernel(rev: str):
    """The packed kernel of commit `rev`, built here; it must take this tree's block layout (PackedLinear's buffers)."""
    return kernel_of(rev, "packed_blocks.cpp", "blocks_mm")


def through(ext, fn):
    """fn() with PackedLinear calling `ext`'s kernel: both arms pay the same Python per call."""
    from service.runtime import packed

    current = packed.extension
    packed.extension = lambda: ext
    try:
        return fn()
    finally:
        packed.extension = current


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    t = threading.Thread(target=run, name="model")  # as the serving engine: the model on a thread of its own
    t.start()
    t.join()


def run() -> None:
    from torch import nn

    from service.runtime.threads import claim

    claim()

    from service.runtime.packed import GROUP, PackedLinear

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--torch-kernels", action="store_true", help="also torch's int4/int8 kernels (slow)")
    ap.add_argument("--before", help="also the packed kernel of this commit (git rev), built here")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the arms this many times; the lowest counts")
    ap.add_argument("--json")
    args = ap.parse_args()
    ws = weights()
    before = before_kernel(args.before) if args.before else None
    packed = []
    for w, blocks, *_ in ws:
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight = nn.Parameter(w, requires_grad=False)
        packed.append(PackedLinear(lin, blocks, max_rows=max(args.rows)))
    rows = []
    with torch.inference_mode():
        for m in args.rows:
            xs = {k: torch.randn(m, k) for k in (576, 1536)}
            arms = {"float32_ms": lambda: [xs[w.shape[1]] @ w.t() for w, *_ in ws],
                    "packed_ms": lambda: [p(xs[p.in_features]) for p in packed]}
            if before is not None:
                arms["before_ms"] = lambda: through(before, lambda: [p(xs[p.in_features]) for p in packed])
            row = {"rows": m}
            for _ in range(args.rounds):
                for name, fn in arms.items():
                    row[name] = min(row.get(name, float("inf")), timed(fn, args.repeats))
            if args.torch_kernels:
                row["int4pack_ms"] = timed(lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(
                    xs[w.shape[1]], i4, GROUP, sz) for w, _, i4, sz, _, _ in ws], 1)
                row["int8pack_ms"] = timed(lambda: [torch._weight_int8pack_mm(xs[w.shape[1]], i8, s)
                                                    for w, _, _, _, i8, s in ws], 1)
            rows.append(row)
            print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    write_json(args.json, {"threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
