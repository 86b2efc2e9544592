"""Startup self-check: re-rotation on the loaded model must reproduce a direct computation."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from service.kv.cache import new_cache
from service.runtime.model import ModelRuntime


@dataclass
class SelfCheckReport:
    ok: bool
    max_abs_err: float | None  # moved K and V vs K and V computed at the offset, every layer (None: not measured)
    tolerance: float
    offset: int
    n_tokens: int
    rope_types: list[str]
    elapsed_ms: float
    error: str | None = None

    def to_dict(self) -> dict:
        """JSON-safe (/readyz shows it): an error that is not a finite number is None."""
        d = asdict(self)
        if d["max_abs_err"] is not None and not math.isfinite(d["max_abs_err"]):
            d["max_abs_err"] = None
        return d


def run_selfcheck(rt: ModelRuntime, n_tokens: int = 16, offset: int = 777) -> SelfCheckReport:
    """Compile a short block at 0, move it to `offset`, compare with the block computed at `offset`.

    RoPE is relative, so an isolated block's hidden states do not depend on where it starts: the
    two must agree at every layer up to float rounding. Tolerance scales with the dtype and the
    keys' magnitude.
    """
    t0 = time.perf_counter()
    offset = min(offset, (rt.max_positions or 4096) - n_tokens - 1)
    vocab = min(int(rt.config.vocab_size), len(rt.tokenizer))
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(100, max(101, vocab - 1), (n_tokens,), generator=g).tolist()
    try:
        block = rt.compile_block(ids, anchor=[])  # alone at 0..N-1
        cache = new_cache(rt.model.config)
        rt.forward(ids, offset, cache)
        moved_k, moved_v = rt.rotator.move_layers(block.keys, block.values, offset)  # MLA moves the value slot
        err, scale = 0.0, 0.0
        for layer, (k, v) in enumerate(zip(moved_k, moved_v)):
            for got, direct in ((k, cache.layers[layer].keys), (v, cache.layers[layer].values)):  # [1, H, N, D]
                err = max(err, float((got.float() - direct.float()).abs().max()))
                scale = max(scale, float(direct.float().abs().max()))
        eps = 1e-4 if block.dtype == torch.float32 else 4e-2
        tol = eps * max(1.0, scale)
        ok = err <= tol
        return SelfCheckReport(ok, err, tol, offset, n_tokens, rt.rotator.rope_types,
                               (time.perf_counter() - t0) * 1e3, None if ok else "re-rotation mismatch")
    except Exception as e:  # a failed check must not crash startup: the service reports not-ready
        return SelfCheckReport(False, None, 0.0, offset, n_tokens, rt.rotator.rope_types,
                               (time.perf_counter() - t0) * 1e3, f"{type(e).__name__}: {e}")
