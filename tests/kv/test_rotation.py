"""Exactness of re-rotation and composition on tiny random-weight models of several families."""

import pytest
import torch

from service.errors import UnsupportedModel
from service.kv.cache import new_cache
from service.runtime.prompt import PromptPlan, Segment
from tiny import FAMILIES, random_ids, tiny_runtime

ATOL = 2e-4  # float32; angles at positions of a few thousand carry ~1e-4 rounding


def _compiled_at(rt, ids, start):
    """K/V of ids prefilled alone at positions start..start+N-1."""
    cache = new_cache(rt.model.config)
    rt.forward(ids, start, cache)
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("offset", [1, 37, 1500])
def test_rerotated_block_equals_block_compiled_at_offset(family, offset):
    rt = tiny_runtime(family)
    ids = random_ids(48, seed=1)
    block = rt.compile_block(ids, anchor=[])
    direct = _compiled_at(rt, ids, offset)
    moved_k, moved_v = rt.rotator.move_layers(block.keys, block.values, offset)  # MLA: k_pe sits in the V slot
    for layer, (k_direct, v_direct) in enumerate(direct):  # every layer: [1, H_kv, N, D]
        torch.testing.assert_close(moved_k[layer], k_direct, atol=ATOL, rtol=1e-4, msg=f"K layer {layer}")
        torch.testing.assert_close(moved_v[layer], v_direct, atol=ATOL, rtol=1e-4, msg=f"V layer {layer}")


@pytest.mark.parametrize("family", ["llama", "yarn-scaling"])
def test_rotation_without_moving_is_not_equal(family):
    """Control: the test above can fail — unrotated keys differ from keys at the offset."""
    rt = tiny_runtime(family)
    ids = random_ids(16, seed=2)
    block = rt.compile_block(ids, anchor=[])
    direct = _compiled_at(rt, ids, 100)
    assert not torch.allclose(block.keys[0], direct[0][0], atol=1e-2)


def _plan(prefix, skills, sep, tail):
    segs = [Segment("text", list(prefix))]
    for i, s in enumerate(skills):
        if i:
            segs.append(Segment("text", list(sep)))
        segs.append(Segment("skill", list(s), skill_index=i))
    segs.append(Segment("text", list(tail)))
    return PromptPlan(segs)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layer0_kv_after_compose_equals_full_prefill(family):
    rt = tiny_runtime(family)
    skills = [random_ids(40, seed=3), random_ids(25, seed=4)]
    plan = _plan(random_ids(7, seed=5), skills, random_ids(2, seed=6), random_ids(9, seed=7))
    blocks = [rt.compile_block(s) for s in skills]
    comp = rt.prefill(plan, blocks, mode="compose", seam_tokens=2)
    full = rt.prefill(plan, blocks, mode="full")
    k_c, v_c = comp.cache.layers[0].keys, comp.cache.layers[0].values  # [1, H_kv, T, D]
    k_f, v_f = full.cache.layers[0].keys, full.cache.layers[0].values
    assert k_c.shape == k_f.shape
    for off, s in zip(plan.skill_offsets(), skills):
        span = slice(off, off + len(s))
        torch.testing.assert_close(k_c[:, :, span], k_f[:, :, span], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(v_c[:, :, span], v_f[:, :, span], atol=ATOL, rtol=1e-4)
    assert comp.n_reused == (40 - 2) + (25 - 2)
    assert comp.n_recomputed == plan.n_tokens - comp.n_reused


@pytest.mark.parametrize("family", list(FAMILIES))
def test_seam_equal_to_whole_block_is_full_prefill(family):
    rt = tiny_runtime(family)
    skills = [random_ids(30, seed=8), random_ids(20, seed=9)]
    plan = _plan(random_ids(5, seed=10), skills, random_ids(3, seed=11), random_ids(6, seed=12))
    blocks = [rt.compile_block(s) for s in skills]
    comp = rt.prefill(plan, blocks, mode="compose", seam_tokens=30)
    full = rt.prefill(plan, blocks, mode="full")
    assert comp.n_reused == 0
    torch.testing.assert_close(comp.logits, full.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_no_skills_is_full_prefill(family):
    rt = tiny_runtime(family)
    plan = PromptPlan([Segment("text", random_ids(20, seed=13))])
    comp = rt.prefill(plan, [], mode="compose")
    full = rt.prefill(plan, [], mode="full")
    assert torch.equal(comp.logits, full.logits)


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 256},
    {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
     "original_max_position_embeddings": 256},
])
def test_length_dependent_rope_refused_beyond_exact_range(rope):
    from service.runtime.model import ModelRuntime
    from service.runtime.loader import build_random_model
    from tiny import tiny_config, tiny_tokenizer

    cfg = tiny_config("llama", rope_parameters=rope, max_position_embeddings=4096)
    cfg.original_max_position_embeddings = 256
    rt = ModelRuntime(build_random_model(cfg, tiny_tokenizer()), "fp")
    limit = 256
    rt.check_length(10, 10, mode="compose")  # inside the exact range: fine
    with pytest.raises(UnsupportedModel, match="changes its frequencies"):
        rt.check_length(limit - 5, 10, mode="compose")
    rt.check_length(limit - 5, 10, mode="full")  # full recompute is always allowed


def test_unknown_rope_type_refused():
    from service.kv.rope import KeyRotator

    class FakeRotary(torch.nn.Module):
        rope_type = "axial"
        inv_freq = torch.ones(4)

    with pytest.raises(UnsupportedModel, match="not supported"):
        KeyRotator([FakeRotary()], [0], lambda *a: a)
