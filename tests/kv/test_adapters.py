"""Family adapters: sliding window, per-layer RoPE, MLA, M-RoPE, NoPE layers, MoE; and what is refused.

The exactness tests of tests/kv/test_rotation.py run over every family in tiny.FAMILIES (re-rotated
block == block compiled at the offset on every layer, layer-0 K/V after compose, seam = whole block
== full prefill). Here: the adapter picks what we think it picks, controls that show a wrong choice
would fail, the sliding-window cache/mask behaviour, and the typed refusals.
"""

import types

import pytest
import torch
from transformers import AutoConfig, DynamicCache

from service.errors import UnsupportedModel
from service.kv.cache import new_cache
from service.kv.rope import NO_ROPE, KeyRotator
from service.runtime.adapters import ComplexRotary, LayerTypeRotary, MRopeRotary, build_rotator
from service.runtime.model import ModelRuntime
from service.runtime.loader import build_random_model
from service.runtime.prompt import PromptPlan, Segment
from tiny import SLIDING_WINDOW, random_ids, tiny_config, tiny_runtime, tiny_tokenizer

ATOL = 2e-4
SLIDING = ["gemma2", "gemma3", "mistral-sliding", "cohere2"]
MROPE = ["qwen2_vl", "qwen2_5_vl"]


def _at(rt, ids, start):
    cache = new_cache(rt.model.config)
    rt.forward(ids, start, cache)
    return cache


def _plan(*parts):
    """parts: ("text", ids) / ("skill", ids) in order."""
    segs, k = [], 0
    for kind, ids in parts:
        segs.append(Segment(kind, list(ids), skill_index=k if kind == "skill" else None))
        k += kind == "skill"
    return PromptPlan(segs)


@pytest.mark.parametrize("family,kind,slot,layer_rope", [
    ("llama", torch.nn.Module, "keys", [0, 0, 0]),
    ("gemma3", LayerTypeRotary, "keys", [1, 0, 1]),  # sorted kinds: full_attention, sliding_attention
    ("deepseek_v3", torch.nn.Module, "values", [0, 0, 0]),
    ("deepseek_v2", ComplexRotary, "values", [0, 0, 0]),
    ("qwen2_vl", MRopeRotary, "keys", [0, 0, 0]),
    ("qwen2_5_vl", MRopeRotary, "keys", [0, 0, 0]),
    ("smollm3", torch.nn.Module, "keys", [0, NO_ROPE, 0]),
    ("cohere2", torch.nn.Module, "keys", [0, NO_ROPE, 0]),
    ("qwen3_moe", torch.nn.Module, "keys", [0, 0, 0]),
    ("mixtral", torch.nn.Module, "keys", [0, 0, 0]),
])
def test_adapter_discovery(family, kind, slot, layer_rope):
    rot = tiny_runtime(family).rotator
    assert isinstance(rot.rotary_embs[0], kind) and rot.slot == slot and rot.layer_rope == layer_rope


def test_gemma3_local_and_global_rope_differ_and_matter():
    rt = tiny_runtime("gemma3")
    assert [r.layer_type for r in rt.rotator.rotary_embs] == ["full_attention", "sliding_attention"]
    assert rt.rotator.rope_types == ["default", "linear"]
    ids = random_ids(24, seed=20)
    block, direct = rt.compile_block(ids, anchor=[]), _at(rt, ids, 300)
    wrong = KeyRotator(rt.rotator.rotary_embs[:1], [0, 0, 0], rt.rotator.apply_rotary)  # global RoPE everywhere
    bad = wrong.rotate_layers(block.keys, 300)[0]  # layer 0 is a sliding (local RoPE) layer
    assert not torch.allclose(bad, direct.layers[0].keys, atol=1e-2)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_mla_moves_only_k_pe(family):
    """MLA caches keys = latent [1, 1, T, kv_lora_rank] (no RoPE), values = k_pe [1, 1, T, rope_dim]."""
    rt = tiny_runtime(family)
    cfg = rt.config
    ids = random_ids(20, seed=21)
    block, direct = rt.compile_block(ids, anchor=[]), _at(rt, ids, 250)
    assert block.keys[0].shape == (1, 1, 20, cfg.kv_lora_rank)
    assert block.values[0].shape == (1, 1, 20, cfg.qk_rope_head_dim)
    keys, values = rt.rotator.move_layers(block.keys, block.values, 250)
    for layer in range(block.n_layers):
        assert torch.equal(keys[layer], block.keys[layer])  # the latent is copied bit for bit
        torch.testing.assert_close(values[layer], direct.layers[layer].values, atol=ATOL, rtol=1e-4)
    assert not torch.allclose(block.values[0], direct.layers[0].values, atol=1e-2)  # control: it had to move


def test_deepseek_v3_without_interleave_is_exact_too():
    cfg = tiny_config("deepseek_v3", rope_interleave=False)
    rt = ModelRuntime(build_random_model(cfg, tiny_tokenizer()), "fp")
    ids = random_ids(20, seed=22)
    block, direct = rt.compile_block(ids, anchor=[]), _at(rt, ids, 77)
    _, values = rt.rotator.move_layers(block.keys, block.values, 77)
    for layer in range(block.n_layers):
        torch.testing.assert_close(values[layer], direct.layers[layer].values, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("family", MROPE)
def test_mrope_text_block_equals_explicit_3d_positions(family):
    """A text block moved by delta equals the block run with 3-D position ids (t = h = w = offset + i)."""
    rt = tiny_runtime(family)
    ids, offset = random_ids(20, seed=23), 90
    block = rt.compile_block(ids, anchor=[])
    cache = new_cache(rt.model.config)
    pos3 = torch.arange(offset, offset + 20).view(1, 1, -1).expand(3, 1, -1)  # [3, B, T]
    with torch.inference_mode():
        rt.model(input_ids=torch.tensor([ids]), position_ids=pos3, cache=cache, use_cache=True, logits_to_keep=1)
    moved = rt.rotator.rotate_layers(block.keys, offset)
    for layer in range(block.n_layers):
        torch.testing.assert_close(moved[layer], cache.layers[layer].keys, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("family", MROPE)
def test_mrope_image_block_refused(family):
    rt = tiny_runtime(family)
    skill = random_ids(10, seed=24) + [rt.model.config.image_token_id] + random_ids(5, seed=25)
    plan = _plan(("text", random_ids(4, seed=26)), ("skill", skill), ("text", random_ids(3, seed=27)))
    with pytest.raises(UnsupportedModel, match="M-RoPE") as e:
        rt.prefill(plan, [rt.compile_block(skill, anchor=[])], mode="compose", seam_tokens=2)
    assert e.value.status == 422 and e.value.error_type == "unsupported_model"


# ---- sliding window ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", SLIDING)
def test_cache_keeps_every_token_and_mask_enforces_window(family):
    rt = tiny_runtime(family)
    assert all(type(layer).__name__ == "GrowLayer" for layer in new_cache(rt.model.config).layers)  # full per-token
    ids = random_ids(3 * SLIDING_WINDOW, seed=30)  # [48]
    x = torch.tensor([ids])
    with torch.inference_mode():
        ref = rt.model(input_ids=x, use_cache=False).logits[0, -1]  # no cache: the model's own sliding mask
        full = new_cache(rt.model.config)  # ours: every token kept; first 40 then 8 more on top
        rt.forward(ids[:40], 0, full)
        ours = rt.forward(ids[40:], 40, full)
        hf = DynamicCache(config=rt.model.config)  # transformers' window-truncating cache
        rt.model(input_ids=x[:, :40], cache=hf, use_cache=True)
        theirs = rt.model(input_ids=x[:, 40:], cache=hf, use_cache=True).logits[0, -1]
    assert all(layer.keys.shape[-2] == 48 for layer in full.layers)
    assert any(layer.keys.shape[-2] < 48 for layer in hf.layers)  # theirs dropped tokens
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(theirs, ref, atol=1e-4, rtol=1e-4)
    # control: the window really changes the result, so the equality above means the mask enforced it
    cfg = tiny_config(family, sliding_window=4096)
    cfg._attn_implementation = rt.model.config._attn_implementation
    wide = build_random_model(cfg, tiny_tokenizer(), seed=0).model
    with torch.inference_mode():
        assert not torch.allclose(wide(input_ids=x, use_cache=False).logits[0, -1], ref, atol=1e-3)


@pytest.mark.parametrize("family", SLIDING)
def test_compose_longer_than_window(family):
    """Blocks of 2-3 windows, placed past the window: seam = whole block is the full prefill, and the
    composed cache holds every prompt token on every layer; with a short seam layer 0 is still exact."""
    rt = tiny_runtime(family)
    s1, s2 = random_ids(2 * SLIDING_WINDOW + 5, seed=31), random_ids(3 * SLIDING_WINDOW, seed=32)
    plan = _plan(("text", random_ids(SLIDING_WINDOW + 3, seed=33)), ("skill", s1), ("text", random_ids(2, seed=34)),
                 ("skill", s2), ("text", random_ids(5, seed=35)))
    blocks = [rt.compile_block(s1, anchor=[]), rt.compile_block(s2, anchor=[])]
    full = rt.prefill(plan, blocks, mode="full")
    whole = rt.prefill(plan, blocks, mode="compose", seam_tokens=len(s2))
    torch.testing.assert_close(whole.logits, full.logits, atol=1e-4, rtol=1e-4)
    comp = rt.prefill(plan, blocks, mode="compose", seam_tokens=2)
    assert comp.n_reused == len(s1) + len(s2) - 4
    for cache in (full.cache, whole.cache, comp.cache):
        assert [layer.keys.shape[-2] for layer in cache.layers] == [plan.n_tokens] * rt.config.num_hidden_layers
    k_c, k_f = comp.cache.layers[0].keys, full.cache.layers[0].keys  # [1, H_kv, T, D]
    torch.testing.assert_close(k_c, k_f, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(comp.cache.layers[0].values, full.cache.layers[0].values, atol=ATOL, rtol=1e-4)


# ---- refusals ------------------------------------------------------------------------------------
def _fake(model_type="llama", rotary=None, **cfg_kw):
    cfg = AutoConfig.for_model(model_type, num_hidden_layers=2, **cfg_kw)
    decoder = types.SimpleNamespace(rotary_emb=rotary)
    return types.SimpleNamespace(config=cfg, get_decoder=lambda: decoder)


def test_model_without_rope_refused():
    cfg = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=512)
    with pytest.raises(UnsupportedModel, match="no rotary embedding"):
        ModelRuntime(build_random_model(cfg, tiny_tokenizer()), "fp")


@pytest.mark.parametrize("model, match", [
    (lambda: _fake(layer_types=["full_attention", "linear_attention"]), "no per-token KV"),
    (lambda: _fake(layer_types=["chunked_attention", "full_attention"], attention_chunk_size=8), "chunked"),
    (lambda: _fake("llama4"), "llama4"),
    (lambda: _fake(rotary=types.SimpleNamespace(rope_type="default")), "no inv_freq"),
])
def test_unsupported_variants_refused(model, match):
    with pytest.raises(UnsupportedModel, match=match):
        build_rotator(model())


def test_rot_start_rotates_only_the_tail():
    """A layout with [k_nope | k_pe] in one tensor (rot_start = nope dims): only the tail moves."""
    rot = tiny_runtime("llama").rotator
    tail_only = KeyRotator(rot.rotary_embs, [0], rot.apply_rotary, rot_start=8)
    k = torch.randn(1, 2, 5, 8 + 16)  # [1, H, T, nope 8 + rope 16]
    moved = tail_only.rotate(k, 40, 0)
    assert torch.equal(moved[..., :8], k[..., :8])
    torch.testing.assert_close(moved[..., 8:], rot.rotate(k[..., 8:].contiguous(), 40, 0))
