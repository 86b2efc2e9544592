"""Skills compiled after the template's opening (the anchor): the first skill of a composed prompt is
exactly what a full prefill computes, with no seam, on every family; later skills still move exactly."""

import pytest
import torch

from tiny import FAMILIES, tiny_runtime

SKILLS = ["Refunds are allowed within 30 days of delivery when the item is unused.",
          "Tool specs: search(query), lookup(order_id), refund(order_id, amount).",
          "Answer politely and briefly. Use the current value of every field."]


def _msgs(system: str | None = "You are a support agent.", user: str = "Can I get a refund?"):
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


@pytest.mark.parametrize("msgs", [
    _msgs(), _msgs(system=None),
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}],
], ids=["system", "no-system", "multi-turn"])
def test_anchor_is_what_precedes_the_first_skill(msgs):
    rt = tiny_runtime("llama")
    ids = [rt.prompts.encode_content(s) for s in SKILLS[:2]]
    plan = rt.prompts.build(msgs, ids, errata=["[STATE UPDATE] x has changed to 1."])
    assert rt.anchor and plan.ids[: len(rt.anchor)] == rt.anchor
    assert plan.skill_offsets()[0] == len(rt.anchor)  # skills lead the system turn
    text = rt.tokenizer.decode(plan.ids)
    assert text.index(SKILLS[1]) < text.index("[STATE UPDATE]")
    if msgs[0]["role"] == "system":
        assert text.index(SKILLS[1]) < text.index(msgs[0]["content"])  # then the request's own system text


@pytest.mark.parametrize("family", list(FAMILIES))
def test_first_skill_composes_exactly_without_seam(family):
    rt = tiny_runtime(family)
    ids = rt.prompts.encode_content(SKILLS[0])
    block = rt.compile_block(ids)
    assert block.base == len(rt.anchor)
    plan = rt.prompts.build(_msgs(), [ids], errata=["[STATE UPDATE] tier has changed to gold."])
    comp = rt.prefill(plan, [block], mode="compose", seam_tokens=0)
    full = rt.prefill(plan, [block], mode="full")
    assert comp.n_reused == len(ids)
    start = plan.skill_offsets()[0]
    for layer, (c, f) in enumerate(zip(comp.cache.layers, full.cache.layers)):  # every layer, [1, H, T, D]
        span = slice(start, start + len(ids))
        torch.testing.assert_close(c.keys[:, :, span], f.keys[:, :, span], atol=1e-5, rtol=1e-5, msg=f"K {layer}")
        torch.testing.assert_close(c.values[:, :, span], f.values[:, :, span], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(comp.logits, full.logits, atol=1e-4, rtol=1e-4)


def test_unanchored_first_skill_is_not_exact():
    """Control for the test above: the same block compiled alone differs from the full prefill."""
    rt = tiny_runtime("llama")
    ids = rt.prompts.encode_content(SKILLS[0])
    plan = rt.prompts.build(_msgs(), [ids])
    alone = rt.prefill(plan, [rt.compile_block(ids, anchor=[])], mode="compose", seam_tokens=0)
    full = rt.prefill(plan, [], mode="full")
    assert not torch.allclose(alone.logits, full.logits, atol=1e-3)


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi-partial", "yarn-scaling", "gemma3", "deepseek_v3"])
def test_anchored_block_moved_elsewhere_equals_anchored_compile_there(family):
    """Moving an anchored block by (offset - base) equals prefilling anchor + skill with the skill at offset:
    RoPE is relative, so only the distance to the anchor differs, and that is what the test changes."""
    rt = tiny_runtime(family)
    ids = rt.prompts.encode_content(SKILLS[1])
    block = rt.compile_block(ids)
    filler = rt.prompts.encode_content(SKILLS[2])
    shifted = rt.compile_block(ids, anchor=rt.anchor + filler)  # the skill at base + len(filler)
    moved_k, moved_v = rt.rotator.move_layers(block.keys, block.values, len(filler))
    # same positions, different context: layer 0 (no attention yet) must agree exactly; deeper layers differ
    torch.testing.assert_close(moved_k[0], shifted.keys[0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(moved_v[0], shifted.values[0], atol=2e-4, rtol=1e-4)
    assert shifted.base == block.base + len(filler)
