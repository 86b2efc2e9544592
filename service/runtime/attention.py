"""Attention for forwards of few query tokens, for float32 sdpa models on the CPU: decode steps and short prefills.

Decode steps: at eight rows of ~2.5k tokens a step of the embedded model spent most of its time in attention, not in
the linears: torch's CPU sdpa over the K/V of one query token took ~3x the time of reading that K/V once (8 rows:
~75-90 ms of a ~140 ms step; docs/BENCHMARKS.md, "Decode attention"). decode_attention.cpp reads every key and value
once for the query heads that share it, splits the columns into chunks so one row also spreads over the threads,
and computes in float32 (softmax with a ~1 ulp exp; closer to a float64 reference than sdpa here). A row's result
depends only on its own q, K, V and mask, never on the other rows of the batch (bitwise).

Masked prefills (a repeated order's ~30-token tail over a 2.4k-token prefix, seams, session turns): transformers
takes sdpa's grouped-query path on the CPU only without a mask, and otherwise copies K/V once per query head
(repeat_kv: 3x the embedded model's K/V per layer per forward). Here they run sdpa's grouped-query path with the
mask: the same numbers, bitwise, in ~1/3 of the attention time.

A decode batch's rows that hold the same K/V in whole chunks (the same skills, service/kv/batch.py) pass the kernel
which row to read each chunk from (`kernel_attention(..., shared=...)`): the same numbers, bitwise, each shared chunk
read from memory once a step for all of them.

The runtime's forwards and the decode batch's steps run under `kernel_attention`: for that forward the text config's
attention implementation is this module's (registered with transformers' AttentionInterface, its masks sdpa's), and
anything it does not fit (soft-capping, sinks, another dtype or device) goes to transformers' sdpa as before. On by
default (SKILLCACHE_ATTENTION_KERNEL).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from service.runtime.native import KernelsUnavailable, extension

log = logging.getLogger(__name__)
NAME = "skillcache_few_queries"
_usable: bool | None = None  # the kernel built and agreed with sdpa here (checked once a process)


@dataclass
class Shared:
    """Where a decode step's rows read each chunk of K/V from: `sources` [B, C] int64 (BatchKV.sources), valid for
    the buffers whose storages are `storages` (a layer's K/V read from anywhere else reads its own rows)."""
    sources: "torch.Tensor"
    chunk: int
    storages: frozenset[int]


_shared: Shared | None = None  # the forward now running under kernel_attention(..., shared=...)


def few_queries_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention signature: query [B, Hq, Q, Dk], key [B, Hkv, T, Dk], value [B, Hkv, T, Dv],
    attention_mask [B, 1, Q, T] bool (True = attend) or None -> ([B, Q, Hq, Dv], None)."""
    b, hq, q_len, dk = query.shape
    hkv, t, dv = key.shape[1], key.shape[2], value.shape[-1]
    mask = attention_mask
    plain = (dropout == 0.0 and hq % hkv == 0 and query.device.type == "cpu"
             and not any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "sinks", "position_bias")))
    bool_mask = (mask is not None and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
                 and mask.shape[2] == q_len and mask.shape[3] == t and mask.shape[0] in (1, b))
    if plain and q_len == 1 and (mask is None or bool_mask) and max(dk, dv) <= 256 and hq // hkv <= 16 \
            and query.dtype == key.dtype == value.dtype == torch.float32 and key.stride(-1) == value.stride(-1) == 1:
        scale = scaling if scaling is not None else dk ** -0.5
        q = query.reshape(b, hkv, hq // hkv, dk)  # kv head h serves query heads h*G..h*G+G-1, as repeat_kv
        rows = None if mask is None else mask[:, 0, 0, :].expand(b, t)  # [B, T]
        src = _shared if _shared is not None and _shared.sources.shape[0] == b and all(
            x.untyped_storage().data_ptr() in _shared.storages for x in (key, value)) else None
        out = extension().decode_attention(q, key, value, rows, float(scale), src.sources if src else None,
                                           src.chunk if src else 0)  # [B, Hkv, G, Dv]
        return out.reshape(b, 1, hq, dv), None  # [B, 1, Hq, Dv]
    if plain and q_len > 1 and bool_mask and hq != hkv:
        # sdpa's grouped-query path, which transformers takes on the CPU only without a mask: the same numbers as
        # its repeat_kv path (bitwise, tests/runtime/test_attention.py) without copying K/V per query head
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                               enable_gqa=True)  # [B, Hq, Q, Dv]
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


AttentionInterface.register(NAME, few_queries_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # a forward under it builds sdpa's masks (bool, True = attend)


def usable(model) -> bool:
    """Whether `model`'s forwards can run under kernel_attention: CPU, float32, sdpa, and the kernels serve here."""
    global _usable
    cfg = model.config.get_text_config(decoder=True)
    if model.device.type != "cpu" or model.dtype != torch.float32 or cfg._attn_implementation != "sdpa":
        return False
    if _usable is None:
        try:
            _check()
            _usable = True
        except KernelsUnavailable:  # said once by native.py: torch's sdpa
            _usable = False
        except Exception as e:  # noqa: BLE001 - the kernel disagreed with sdpa here: torch's sdpa
            log.warning("attention kernel off: %s; forwards use transformers' sdpa", e)
            _usable = False
    return _usable


@contextmanager
def kernel_attention(config, on: bool = True, shared: Shared | None = None):
    """For one forward: `config`'s attention layers (the text config) run few_queries_attention (on=False: as they
    are); `shared`: a decode step's rows read shared chunks of the batch's buffers from one row."""
    global _shared
    if not on:
        yield
        return
    before = config._attn_implementation
    config._attn_implementation, _shared = NAME, shared
    try:
        yield
    finally:
        config._attn_implementation, _shared = before, None


@torch.inference_mode()
def _check() -> None:
    """Build the kernel and check it against sdpa on rows of different lengths."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 2, 70, 32, generator=g), torch.randn(3, 2, 70, 32, generator=g)
    cols, ends = torch.arange(70), torch.tensor([70, 33, 5])

    class _Heads:
        num_key_value_groups = 4

    for q_len in (1, 5):  # a decode step; a short prefill, causal
        q = torch.randn(3, 8, q_len, 32, generator=g)
        mask = cols[None, None, :] < (ends[:, None] - q_len + 1 + torch.arange(q_len))[:, :, None]  # [3, Q, 70]
        got, _ = few_queries_attention(_Heads(), q, k, v, mask[:, None], scaling=0.2)
        want, _ = sdpa_attention_forward(_Heads(), q, k, v, mask[:, None], scaling=0.2)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise RuntimeError(f"the kernel differs from sdpa ({q_len} query tokens)")
