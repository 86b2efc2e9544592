"""CPU weight formats: the decoder's linear layers (attention, MLP, LM head) in int8, for fast eager CPU forwards.

`quantize_linears(model, kind)` swaps every nn.Linear for one of:
- `int8` (`Int8WeightLinear`): weights int8 with one scale per output channel, activations in bfloat16,
  `torch._weight_int8pack_mm`: it reads a quarter of float32's weight bytes, so a decode step (few rows, bound
  by memory) gets 2-4x faster linears; a prefill chunk (many rows, bound by compute) runs about as fast as
  float32. The kernel computes each row alike whatever the row count (bitwise), but the bfloat16 activations
  round: a float32 difference of 1e-6 upstream (attention over a prompt cut into other pieces) can flip a
  rounding, so a composition matches its full recompute to bfloat16's level, not float32's. Close to
  bfloat16 in quality.
- `w8a8` (`Int8Linear`): activations quantized too, one scale per token (row), then `torch._int_mm` (int8 x int8
  -> exact int32; VNNI on x86) and a rescale. Faster for many rows, further from float32. Only where the CPU has
  VNNI (`w8a8_unfit`): without it torch's int8 matmul is a slow loop (an AMD EPYC Zen 3, AVX2 only: an
  [800, 576] x [576, 1536] product 1.75 s against float32's 0.09 s), and the service refuses the format.
Why per token and not torch's `quantize_dynamic`: that takes one activation scale over the whole input, so in a
batched decode step a row's result would depend on what else is in the batch (its scale is the batch's largest
value). Here each row's arithmetic is its own, and a request gets the same output alone or in any batch
(tests/runtime/test_quantize.py). Embeddings, norms and attention stay in the model's dtype. Quality against
float32 and speed: docs/BENCHMARKS.md ("CPU weight formats").
"""

from __future__ import annotations

import platform

import torch
from torch import nn

from service.runtime.native import cpu_flags

_EPS = 1e-8
VNNI = ("avx512_vnni", "avx_vnni", "amx_int8")  # x86 flags of an int8 dot-product instruction


def w8a8_unfit() -> str | None:
    """Why `w8a8` must not run on this CPU (what to set instead), or None: an x86-64 CPU without VNNI."""
    if platform.machine() not in ("x86_64", "AMD64") or any(f in cpu_flags().split() for f in VNNI):
        return None
    return ("SKILLCACHE_QUANTIZATION=w8a8 needs a CPU with VNNI (avx512_vnni, avx_vnni or amx_int8 among its flags): "
            "without it torch's int8 matmul is ~20x slower than float32; use SKILLCACHE_QUANTIZATION=int8 (int8 "
            "weights, bfloat16 products) or none")


BF16 = ("avx512_bf16", "amx_bf16")  # x86 flags of a bfloat16 dot-product instruction


def bfloat16_slow() -> str | None:
    """Why bfloat16 products (SKILLCACHE_DTYPE=bfloat16, and int8's activations) are slow on this CPU, or None: an
    x86-64 CPU without bfloat16 instructions, where oneDNN converts every operand."""
    if platform.machine() not in ("x86_64", "AMD64") or any(f in cpu_flags().split() for f in BF16):
        return None
    return ("this CPU has no bfloat16 instructions (avx512_bf16 or amx_bf16 among its flags), so bfloat16 products "
            "run slowly (an AVX2-only EPYC, a 700-token prefill of the embedded model: float32 1.3 s, int8 3.3 s, "
            "bfloat16 8.8 s); SKILLCACHE_DTYPE=float32 with SKILLCACHE_QUANTIZATION=none is the fast format here")


class Int8Linear(nn.Module):
    """y = x W^T + b with W int8 per output channel and x int8 per token; x, y float32 `[..., K] -> [..., N]`."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [N, K]
        scale = w.abs().amax(dim=1).clamp(min=_EPS) / 127.0  # [N]
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("qweight_t", q.t().contiguous())  # [K, N], the layout _int_mm takes
        self.register_buffer("wscale", scale)  # [N]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1]).float()  # [T, K]
        xscale = x2.abs().amax(dim=1, keepdim=True).clamp(min=_EPS) / 127.0  # [T, 1]: one scale per token
        xq = torch.round(x2 / xscale).clamp(-127, 127).to(torch.int8)
        acc = torch._int_mm(xq, self.qweight_t)  # [T, N] int32, exact
        y = acc.float() * xscale * self.wscale
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-token activations"


class Int8WeightLinear(nn.Module):
    """y = x W^T + b with W int8 per output channel and x, y in bfloat16 inside `[..., K] -> [..., N]` (returned in
    x's dtype)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [N, K]
        scale = w.abs().amax(dim=1).clamp(min=_EPS) / 127.0  # [N]
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))  # [N, K]
        self.register_buffer("wscale", scale.to(torch.bfloat16))  # [N]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(torch.bfloat16),
                                                                  requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)  # [T, K]
        y = torch._weight_int8pack_mm(x2, self.qweight, self.wscale)  # [T, N]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(dtype)


KINDS = {"int8": Int8WeightLinear, "w8a8": Int8Linear}


def quantize_linears(model: nn.Module, kind: str = "int8", skip: tuple[str, ...] = ()) -> int:
    """Replace every nn.Linear under `model` (except names containing one of `skip`) in place with the `kind` of
    int8 linear; returns the count."""
    cls = KINDS[kind]
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and not any(s in name for s in skip)]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, cls(mod))
    return len(targets)
