"""Packed decode: a decode step's linears read the weights in the block format they were quantized in.

A GGUF model's weights arrive quantized (the embedded SmolLM2: Q4_1 for every linear, Q8_0 for the tied embedding
and LM head) and are loaded as the float32 values those blocks decode to. A decode step of a few rows is bound by
reading the weights: 537 MB of float32 per step on the embedded model, ~45 ms of a ~66 ms step on this CPU
(docs/BENCHMARKS.md, "Packed decode"). The blocks hold the same values in about a quarter of the bytes.

`pack_linears` recovers each linear's blocks from its float32 weight, 32 values a block along the input dimension:
Q4_1 `w = d * q + m` (q in 0..15, d and m float16: m is the block's minimum, d its range / 15) or Q8_0 `w = d * q`
(q in -127..127, d = the block's largest magnitude / 127), and keeps them only where they decode back to the very
same float32 weight, bit for bit. Any other weight (a float16 or bfloat16 checkpoint, random test weights) stays as
it is. A packed linear runs a decode step (one token a row) of up to `step_rows` rows, and any input of at most
`max_rows` rows (a seam), through packed_blocks.cpp (each block decoded in registers and multiplied into every row,
float32, the weight never written out); longer inputs (prefill chunks, a burst's tails) go through the float32 matmul
as before, so a prompt's K/V come from the same matmuls whether it is prefilled whole or as a tail. The arithmetic
stays float32 on the same weights, so this is the same model; the kernel sums in another order than the BLAS, so its
outputs differ from the matmul's at rounding level (~1e-6 relative, like a chunked prefill), and a row's result does
not depend on how many rows the step has, up to `step_rows` (bitwise, tests/runtime/test_packed.py): a request
decodes the same tokens alone or in a batch of 16.

On by default (SKILLCACHE_PACKED_DECODE). A C++ extension rather than torch.compile: a compiled call went through
dynamo's per-call path, ~80 us on the main thread and ~140-180 us from the serving engine's, 211 calls a step, which
ate the gain; this kernel is one plain call. Measured in docs/BENCHMARKS.md, "Packed decode".
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from service.runtime.native import KernelsUnavailable, extension

log = logging.getLogger(__name__)
GROUP = 32  # values per block (GGUF's Q4_0/Q4_1/Q8_0)
MAX_ROWS = 8  # any input of more rows but a decode step: the float32 matmul
# a decode step's rows, by the kernel's vector path: packed up to here, the float32 matmul past it. The linears of one
# step of the embedded model (bench/kernels.py; docs/BENCHMARKS.md, "Packed decode"): AVX2's tiles 34 / 60 / 107 /
# 173 / 201 ms at 8 / 16 / 32 / 48 / 64 rows, the float32 matmul 90 / 107 / 172 / 206 / 214 (an AMD EPYC); AVX-512's
# passes of 8 rows 45 / 79 / 106 ms at 16 / 25 / 32 rows, the float32 matmul 58 / 60 / 65 (an Intel Xeon)
STEP_ROWS = {"avx2": 48, "avx512": 16}


def recover_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str] | None:
    """(q int8 [N, K], d, m float16 [N, K/G], kind) that decode to exactly `w` [N, K] float32, or None."""
    if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % GROUP:
        return None
    g = w.detach().view(w.shape[0], -1, GROUP)  # [N, K/G, G]
    lo = g.amin(-1, keepdim=True)
    d = ((g.amax(-1, keepdim=True) - lo) / 15).half()
    q = _levels(g - lo, d, 0, 15)
    if torch.equal(q * d.float() + lo, g) and torch.equal(lo.half().float(), lo):  # Q4_1
        return _pack(q, d, lo.half(), w.shape, "q4_1")
    d = (g.abs().amax(-1, keepdim=True) / 127).half()
    q = _levels(g, d, -127, 127)
    if torch.equal(q * d.float(), g):  # Q8_0 (m = 0 adds nothing: d * q + 0.0 == d * q)
        return _pack(q, d, torch.zeros_like(d), w.shape, "q8_0")
    return None


def _levels(x: torch.Tensor, d: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    df = d.float()
    return torch.where(df > 0, torch.round(x / torch.where(df > 0, df, 1.0)), 0.0).clamp(lo, hi)


def _pack(q, d, m, shape, kind):
    n, k = shape
    return q.to(torch.int8).reshape(n, k), d.reshape(n, k // GROUP), m.reshape(n, k // GROUP), kind


class PackedLinear(nn.Module):
    """nn.Linear whose few-row inputs run on the weight's blocks; `weight` is the original float32 parameter (shared:
    a tied LM head keeps the embedding's)."""

    def __init__(self, linear: nn.Linear, blocks, max_rows: int = MAX_ROWS, step_rows: int = MAX_ROWS) -> None:
        super().__init__()
        q, d, m, self.kind = blocks
        self.weight, self.bias = linear.weight, linear.bias
        self.q4 = self.kind == "q4_1"
        if self.q4:  # two levels a byte: byte j of a block holds value j and value j + G/2 (GGUF's layout)
            g = q.view(q.shape[0], -1, 2, GROUP // 2).to(torch.uint8)  # [N, K/G, 2, G/2]
            q = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(q.shape[0], -1)
        self.register_buffer("q", q, persistent=False)  # [N, K/2] uint8 (q4_1) or [N, K] int8 (q8_0)
        self.register_buffer("d", d.float(), persistent=False)  # [N, K/G] float32 (exactly the float16 scales)
        self.register_buffer("m", m.float(), persistent=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.max_rows, self.step_rows = max_rows, max(step_rows, max_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., T, K] -> [..., T, N]; T == 1 (a decode step, [B, 1, K]) packed up to step_rows rows."""
        rows = x.numel() // self.in_features
        step = x.dim() >= 2 and x.shape[-2] == 1
        if rows > (self.step_rows if step else self.max_rows) or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        y = extension().blocks_mm(x.reshape(rows, self.in_features), self.q, self.d, self.m, self.q4)  # [M, N]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} blocks "
                f"<= {self.max_rows} rows, decode steps <= {self.step_rows}")


def pack_linears(model: nn.Module, max_rows: int = MAX_ROWS) -> dict[str, int]:
    """Replace every nn.Linear whose weight is exactly a Q4_1 / Q8_0 block format with a PackedLinear, compile and
    check the kernel; counts by kind ({} when nothing was packed, or no kernels serve here:
    service/runtime/native.py)."""
    found = [(name, mod, recover_blocks(mod.weight)) for name, mod in model.named_modules()
             if isinstance(mod, nn.Linear) and mod.weight.device.type == "cpu"]
    if not any(blocks is not None for *_, blocks in found):
        return {}
    try:
        step_rows = STEP_ROWS.get(extension().isa(), max_rows)
        packed = [(name, PackedLinear(mod, blocks, max_rows, step_rows)) for name, mod, blocks in found
                  if blocks is not None]
        _warm({(p.kind, p.q.shape): p for _, p in packed}.values())
    except KernelsUnavailable:  # said once by native.py: float32 matmuls
        return {}
    except Exception as e:  # noqa: BLE001 - the kernel disagreed with the float32 matmul here: float32 matmuls
        log.warning("packed decode off: %s; decode steps use float32 matmuls", e)
        return {}
    originals = dict(model.named_modules())
    for name, p in packed:
        parent_name, _, child = name.rpartition(".")
        setattr(originals[parent_name] if parent_name else model, child, p)
    counts: dict[str, int] = {}
    for _, p in packed:
        counts[p.kind] = counts.get(p.kind, 0) + 1
    return counts


@torch.inference_mode()
def _warm(linears) -> None:
    """Build the kernel, and check it against the float32 matmul on each weight shape: decode steps of one row, of a
    few (3: in registers on AVX2) and of more (5: AVX2's tiles)."""
    for p in linears:
        for rows in (1, 3, 5):
            x = torch.randn(rows, 1, p.in_features)
            got, want = p(x), F.linear(x, p.weight, p.bias)
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()) + 1e-6):
                raise RuntimeError(f"the packed kernel differs from the float32 matmul on {tuple(p.q.shape)}")
