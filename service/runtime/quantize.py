"""CPU weight formats: int8 linear layers with per-token activation scales (W8A8), for fast eager CPU forwards.

`quantize_linears(model)` swaps every nn.Linear of the decoder (attention, MLP and the LM head) for an
`Int8Linear`: weights int8 with one scale per output channel, activations quantized to int8 on the fly with one
scale per token (row), then `torch._int_mm` (int8 x int8 -> exact int32; VNNI on x86) and a rescale. Why per
token: torch's `quantize_dynamic` takes one activation scale over the whole input, so in a batched decode step a
row's result would depend on what else is in the batch (its scale is the batch's largest value). Per-token scales
keep each row's arithmetic its own: the int32 products are exact, the rescale is elementwise, and a request gets
the same output alone or in any batch (tests/runtime/test_quantize.py). Embeddings, norms and attention stay
float32. Quality against float32 and speed are measured in docs/BENCHMARKS.md ("CPU weight formats").
"""

from __future__ import annotations

import torch
from torch import nn

_EPS = 1e-8


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


def quantize_linears(model: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Replace every nn.Linear under `model` (except names containing one of `skip`) in place; returns the count."""
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and not any(s in name for s in skip)]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear(mod))
    return len(targets)
