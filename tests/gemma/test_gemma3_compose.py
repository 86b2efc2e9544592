"""Gemma-3-270M, a real checkpoint (18 layers: 5 sliding-window layers, window 512, per global layer; local and
global RoPE; a base model whose GGUF has no chat template, served with SKILLCACHE_CHAT_TEMPLATE=gemma): the
start-up self-check, exact composition with seam = whole block, blocks longer than the window placed past it,
and an erratum edit. The fidelity table is in test_gemma3_fidelity.py."""

import pytest
import torch

from gemma_model import WINDOW, compare, kl

from service.config import Settings

pytestmark = pytest.mark.slow

MSGS = [{"role": "system", "content": "You are a support agent for an online store."},
        {"role": "user", "content": "My order arrived 10 days ago, unused. Refund? Answer APPROVE or DENY."}]


def test_the_checkpoint_is_what_these_tests_claim(gemma_runtime):
    cfg = gemma_runtime.config
    assert cfg.model_type == "gemma3_text" and cfg.num_hidden_layers == 18
    assert cfg.sliding_window == WINDOW
    assert cfg.layer_types.count("sliding_attention") == 15 and cfg.layer_types[5] == "full_attention"
    local, full = cfg.rope_parameters["sliding_attention"], cfg.rope_parameters["full_attention"]
    assert local["rope_theta"] != full["rope_theta"]  # two RoPEs: 10k on local layers, 1M on global ones
    assert gemma_runtime.loaded.chat_template["source"] == "builtin"
    assert gemma_runtime.tokenizer.convert_ids_to_tokens(gemma_runtime.anchor) == ["<bos>", "<start_of_turn>",
                                                                                    "user", "\n"]


def test_selfcheck_passes(gemma_runtime):
    from service.runtime.selfcheck import run_selfcheck

    rep = run_selfcheck(gemma_runtime)
    print(f"self-check: max_abs_err={rep.max_abs_err:.2e} tolerance={rep.tolerance:.2e} {rep.elapsed_ms:.0f} ms")
    assert rep.ok, rep


def test_blocks_longer_than_the_window_past_it_compose_exactly_with_whole_seams(gemma_runtime, gemma_skills):
    """Three skills of 640-930 tokens: the second and third are longer than the window and start past it. With
    seam = whole block the composition is the full prefill; every layer, sliding ones too, holds every token."""
    rt = gemma_runtime
    names = ["refund-policy", "escalation-playbook", "account-security"]
    plan = rt.prompts.build(MSGS, [gemma_skills[n][0] for n in names])
    blocks = [gemma_skills[n][1] for n in names]
    offsets = plan.skill_offsets()
    assert all(o > WINDOW and b.n_tokens > WINDOW for o, b in zip(offsets[1:], blocks[1:])), offsets
    whole = rt.prefill(plan, blocks, mode="compose", seam_tokens=[b.n_tokens for b in blocks])
    full = rt.prefill(plan, blocks, mode="full")
    err = float((whole.logits - full.logits).abs().max())
    print(f"offsets={offsets} n={plan.n_tokens} whole-seam max |logit diff|={err:.2e} "
          f"(max |logit| {float(full.logits.abs().max()):.1f})")
    torch.testing.assert_close(whole.logits, full.logits, rtol=1e-4, atol=2e-4)
    assert [layer.keys.shape[-2] for layer in whole.cache.layers] == [plan.n_tokens] * len(whole.cache.layers)


def test_the_window_really_acts_past_it(gemma_runtime, gemma_skills):
    """Control for the test above: one skill and a question run past position 512, and without the window the same
    prompt gives other logits, so the sliding layers' mask is in play there."""
    rt = gemma_runtime
    ids, block = gemma_skills["refund-policy"]
    plan = rt.prompts.build(MSGS, [ids])
    assert plan.n_tokens > WINDOW + 100
    windowed = rt.prefill(plan, [block], mode="full").logits
    cfg = rt.model.config
    saved = cfg.sliding_window
    cfg.sliding_window = 1 << 20
    try:
        unwindowed = rt.prefill(plan, [block], mode="full").logits
    finally:
        cfg.sliding_window = saved
    diff = float((unwindowed - windowed).abs().max())
    print(f"n={plan.n_tokens}: max |logit diff| without the window {diff:.3f}")
    assert diff > 1e-2


def test_erratum_edit(gemma_runtime, gemma_skills):
    """The erratum line after a cached first skill: the composed prompt is its full prefill (append-only editing
    is exact), the line is really in the prompt and moves the distribution; after a moved skill it stays close."""
    rt = gemma_runtime
    line = Settings().erratum_template.format(field="order_status", value="shipped")
    ids, block = gemma_skills["refund-policy"]
    msgs = [MSGS[0], {"role": "user", "content": "A standard customer asks for a refund. APPROVE or DENY?"}]
    edited = rt.prompts.build(msgs, [ids], errata=[line])
    assert line in rt.tokenizer.decode(edited.ids)
    comp = rt.prefill(edited, [block], mode="compose", seam_tokens=4)
    full = rt.prefill(edited, [block], mode="full")
    assert comp.n_reused == len(ids)
    exact = kl(comp.logits, full.logits)
    plain = rt.prefill(rt.prompts.build(msgs, [ids]), [block], mode="full").logits
    shift = kl(full.logits, plain)
    print(f"erratum: compose vs full kl={exact:.1e}; KL(no erratum || erratum)={shift:.3f}")
    assert exact < 1e-5 and int(comp.logits.argmax()) == int(full.logits.argmax())
    assert shift > 1e-3
    style_ids, style_block = gemma_skills["style-guide"]
    moved = rt.prompts.build(msgs, [style_ids, ids], errata=[line])
    fid = compare(rt, moved, [style_block, block], seam_tokens=4)
    print(f"erratum after a moved skill: cos={fid['cosine']:.5f} kl={fid['kl']:.2e} top1={fid['top1']}")
    assert fid["cosine"] >= 0.99
