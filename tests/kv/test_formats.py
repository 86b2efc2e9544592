"""The composition invariants on every CPU weight format: bfloat16, int8 (weight-only, bfloat16 products) and W8A8
(per-token activation scales) beside float32 (tests/kv/test_rotation.py runs them on every family in float32).
Composition is exact relative to
a full recompute on the same weights: re-rotated keys equal keys computed at the offset, layer-0 K/V after
composition equal the full prefill's, a seam covering the whole block is the full prefill."""

import pytest
import torch

from test_rotation import _compiled_at, _plan
from tiny import random_ids, tiny_runtime

# name -> (dtype, quantization, tolerance as a share of the tensor's largest magnitude). float32 agrees to ~1e-6 of
# it; bfloat16 carries ~0.4% per rounding (measured: up to 2% after three layers; int8's products are bfloat16
# too); w8a8 is exact until an upstream float32 rounding flips one activation's int8 rounding, one step being
# 1/127 of its row's largest value (~0.8%)
FORMATS = {"bfloat16": (torch.bfloat16, "none", 0.03), "int8": (torch.float32, "int8", 0.03),
           "w8a8": (torch.float32, "w8a8", 0.01)}
FAMILIES = ["llama", "qwen2", "gemma3"]
CASES = [(f, fmt) for f in FAMILIES for fmt in FORMATS]


def _rt(family, fmt):
    dtype, quant, tol = FORMATS[fmt]
    return tiny_runtime(family, dtype, quant), tol


def _close(a: torch.Tensor, b: torch.Tensor, rel: float, what: str) -> None:
    err, scale = float((a.float() - b.float()).abs().max()), float(b.float().abs().max())
    assert err <= rel * scale, f"{what}: max error {err:.3g} over {rel:.0%} of {scale:.3g}"


@pytest.mark.parametrize("family,fmt", CASES)
def test_rerotated_block_equals_block_compiled_at_offset(family, fmt):
    rt, tol = _rt(family, fmt)
    ids = random_ids(48, seed=1)
    block = rt.compile_block(ids, anchor=[])
    for offset in (37, 1500):
        direct = _compiled_at(rt, ids, offset)
        moved_k, moved_v = rt.rotator.move_layers(block.keys, block.values, offset)
        for layer, (k, v) in enumerate(direct):
            _close(moved_k[layer], k, tol, f"{fmt} K layer {layer}")
            _close(moved_v[layer], v, tol, f"{fmt} V layer {layer}")


@pytest.mark.parametrize("family,fmt", CASES)
def test_layer0_kv_after_compose_equals_full_prefill(family, fmt):
    rt, tol = _rt(family, fmt)
    skills = [random_ids(40, seed=3), random_ids(25, seed=4)]
    plan = _plan(random_ids(7, seed=5), skills, random_ids(2, seed=6), random_ids(9, seed=7))
    blocks = [rt.compile_block(s) for s in skills]
    comp = rt.prefill(plan, blocks, mode="compose", seam_tokens=2)
    full = rt.prefill(plan, blocks, mode="full")
    for off, s in zip(plan.skill_offsets(), skills):
        span = slice(off, off + len(s))
        for a, b in ((comp.cache.layers[0].keys, full.cache.layers[0].keys),
                     (comp.cache.layers[0].values, full.cache.layers[0].values)):
            _close(a[:, :, span], b[:, :, span], tol, f"{fmt} layer 0")


@pytest.mark.parametrize("family,fmt", CASES)
def test_seam_equal_to_whole_block_is_full_prefill(family, fmt):
    rt, tol = _rt(family, fmt)
    skills = [random_ids(30, seed=8), random_ids(20, seed=9)]
    plan = _plan(random_ids(5, seed=10), skills, random_ids(3, seed=11), random_ids(6, seed=12))
    blocks = [rt.compile_block(s) for s in skills]
    comp = rt.prefill(plan, blocks, mode="compose", seam_tokens=30)
    full = rt.prefill(plan, blocks, mode="full")
    assert comp.n_reused == 0
    _close(comp.logits, full.logits, tol, f"{fmt} logits")
    assert int(comp.logits.argmax()) == int(full.logits.argmax())
