"""A decode step's attention on a C++ kernel (decode_attention.cpp), for float32 sdpa models on the CPU.

At eight rows of ~2.5k tokens a decode step of the embedded model spent most of its time in attention, not in the
linears: torch's CPU sdpa over the K/V of one query token took ~3x the time of reading that K/V once (8 rows: ~75-90
ms of a ~140 ms step; docs/BENCHMARKS.md, "Decode attention"). The kernel reads every key and value once for the
query heads that share it, splits the columns into chunks so one row also spreads over the threads, and computes in
float32 (softmax with a ~1 ulp exp; closer to a float64 reference than sdpa here). A row's result depends only on
its own q, K, V and mask, never on the other rows of the batch (bitwise).

Only the decode batch's step uses it (service/runtime/serving/runner.py): for that forward the text config's
attention implementation is this module's, registered with transformers' AttentionInterface, and any call it does
not fit (more than one query token, soft-capping, sinks, another dtype or device) goes to transformers' sdpa as
before. Prefill, seams and reference forwards never see it. On by default (SKILLCACHE_DECODE_ATTENTION).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from service.runtime.native import extension

log = logging.getLogger(__name__)
NAME = "skillcache_decode"
_usable: bool | None = None  # the kernel built and agreed with sdpa here (checked once a process)


def decode_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             **kwargs):
    """transformers' attention signature: query [B, Hq, 1, Dk], key [B, Hkv, T, Dk], value [B, Hkv, T, Dv],
    attention_mask [B, 1, 1, T] bool (True = attend) or None -> ([B, 1, Hq, Dv], None)."""
    b, hq, q_len, dk = query.shape
    hkv, t = key.shape[1], key.shape[2]
    mask = attention_mask
    fits = (q_len == 1 and dropout == 0.0 and hq % hkv == 0 and hq // hkv <= 16 and max(dk, value.shape[-1]) <= 256
            and query.dtype == key.dtype == value.dtype == torch.float32 and query.device.type == "cpu"
            and key.stride(-1) == 1 and value.stride(-1) == 1
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1:3] == (1, 1)
                                  and mask.shape[-1] == t and mask.shape[0] in (1, b)))
            and not any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "sinks", "position_bias")))
    if not fits:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else dk ** -0.5
    q = query.reshape(b, hkv, hq // hkv, dk)  # kv head h serves query heads h*G..h*G+G-1, as repeat_kv
    rows = None if mask is None else mask[:, 0, 0, :].expand(b, t)  # [B, T]
    out = extension().decode_attention(q, key, value, rows, float(scale))  # [B, Hkv, G, Dv]
    return out.reshape(b, 1, hq, value.shape[-1]), None  # [B, 1, Hq, Dv]


AttentionInterface.register(NAME, decode_attention_forward)


def usable(model) -> bool:
    """Whether a decode step of `model` can run on the kernel: CPU, float32, sdpa, and the kernel builds here."""
    global _usable
    cfg = model.config.get_text_config(decoder=True)
    if model.device.type != "cpu" or model.dtype != torch.float32 or cfg._attn_implementation != "sdpa":
        return False
    if _usable is None:
        try:
            _check()
            _usable = True
        except Exception as e:  # noqa: BLE001 - no C++ compiler or ninja, an unsupported platform: torch's sdpa
            log.warning("decode attention kernel off: %s; decode steps use torch's sdpa", e)
            _usable = False
    return _usable


@contextmanager
def kernel_attention(config):
    """For one forward: `config`'s attention layers (the text config) run decode_attention_forward."""
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before


@torch.inference_mode()
def _check() -> None:
    """Build the kernel and check it against sdpa on rows of different lengths."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g) for shape in ((3, 8, 1, 32), (3, 2, 70, 32), (3, 2, 70, 32)))
    mask = (torch.arange(70)[None, :] < torch.tensor([70, 33, 1])[:, None])[:, None, None, :]  # [3, 1, 1, 70]

    class _Heads:
        num_key_value_groups = 4

    got, _ = decode_attention_forward(_Heads(), q, k, v, mask, scaling=0.2)
    want, _ = sdpa_attention_forward(_Heads(), q, k, v, mask, scaling=0.2)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise RuntimeError("the kernel differs from sdpa")
