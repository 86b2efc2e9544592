"""int8 K/V quantization math, and composing from int8-stored blocks on tiny models."""

import pytest
import torch

from service.kv.quant import Int8Scheme, dequantize, quantize, roundtrip_block, scale_shape, stored_bytes
from service.runtime.prompt import PromptPlan, Segment
from tiny import random_ids, tiny_runtime


@pytest.mark.parametrize("axis, shape", [("channel", (1, 2, 1, 8)), ("token", (1, 2, 20, 1))])
def test_quantize_shapes_and_error_bound(axis, shape):
    x = torch.randn(1, 2, 20, 8) * torch.linspace(0.1, 10, 8)  # [1, H, T, D], channels of very different size
    q, s = quantize(x, axis)
    assert q.dtype == torch.int8 and q.shape == x.shape and tuple(s.shape) == shape == scale_shape(x.shape, axis)
    assert int(q.abs().max()) <= 127
    err = (dequantize(q, s, torch.float32) - x).abs()
    assert torch.all(err <= s / 2 + 1e-6)  # round-to-nearest: at most half a step per element


def test_per_channel_suits_outlier_channels():
    """Keys with one large channel: per-channel scales keep the small channels, per-token ones do not."""
    x = torch.randn(1, 2, 64, 16)
    x[..., 3] *= 50
    rel = {a: float((dequantize(*quantize(x, a), torch.float32) - x)[..., :3].abs().mean())
           for a in ("channel", "token")}
    assert rel["channel"] < rel["token"] / 5


def test_zeros_and_dtype():
    z = torch.zeros(1, 1, 4, 4, dtype=torch.bfloat16)
    q, s = quantize(z, "token")
    assert torch.equal(dequantize(q, s, torch.bfloat16), z)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "gemma3"])
def test_compose_from_int8_blocks_stays_close(family):
    rt = tiny_runtime(family)
    skills = [random_ids(40, seed=40), random_ids(24, seed=41)]
    segs = [Segment("text", random_ids(6, seed=42)), Segment("skill", skills[0], skill_index=0),
            Segment("text", random_ids(2, seed=43)), Segment("skill", skills[1], skill_index=1),
            Segment("text", random_ids(5, seed=44))]
    plan = PromptPlan(segs)
    blocks = [rt.compile_block(s) for s in skills]
    exact = rt.prefill(plan, blocks, mode="compose", seam_tokens=2).logits
    for scheme in (Int8Scheme(), Int8Scheme("token", "token")):
        packed = rt.prefill(plan, [roundtrip_block(b, scheme) for b in blocks], mode="compose", seam_tokens=2).logits
        cos = torch.nn.functional.cosine_similarity(exact, packed, dim=0)
        assert cos > 0.999, (scheme, float(cos))
    assert stored_bytes(blocks[0], "int8") < stored_bytes(blocks[0]) / 3  # fp32 -> int8 + scales
