"""The model fingerprint covers what changes K/V, and prompts keep their skills under any chat template."""

import copy

import torch

from service.runtime.fingerprint import model_fingerprint, tokenizer_digest
from service.runtime.prompt import PromptBuilder
from tiny import build_random_model, tiny_config, tiny_tokenizer

# The first Phi-3-mini template: it renders user and assistant turns and silently skips a system message.
PHI3_NO_SYSTEM = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '<|im_start|>user\\n' + message['content'] + '<|im_end|>\\n<|im_start|>assistant\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
)


def _fp(cfg, tok=None):
    loaded = build_random_model(cfg, tok or tiny_tokenizer(), seed=0, dtype=torch.float32)
    return model_fingerprint(loaded.model, loaded.tokenizer, [], torch.float32)


def test_config_fields_that_change_kv_change_the_fingerprint():
    """Same weights, one config field different: rms_norm_eps moves every layer's K/V (it was not hashed)."""
    base = _fp(tiny_config("llama"))
    assert _fp(tiny_config("llama")) == base  # stable
    assert _fp(tiny_config("llama", rms_norm_eps=1e-3)) != base


def test_named_chat_templates_are_hashed_not_a_crash():
    tok = copy.deepcopy(tiny_tokenizer())
    tok.chat_template = {"default": tiny_tokenizer().chat_template, "tool_use": "{{ messages }}"}
    first = tokenizer_digest(tok)  # was AttributeError: 'dict' object has no attribute 'encode'
    tok.chat_template = {**tok.chat_template, "tool_use": "{{ messages[0] }}"}
    assert tokenizer_digest(tok) != first


def test_a_template_that_drops_the_system_turn_still_carries_the_skills():
    tok = copy.deepcopy(tiny_tokenizer())
    tok.chat_template = PHI3_NO_SYSTEM
    prompts = PromptBuilder(tok)
    skill = prompts.encode_content("Refunds are allowed within 30 days.")
    plan = prompts.build([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Refund?"}], [skill])
    kinds = [seg.kind for seg in plan.segments]
    assert kinds.count("skill") == 1, kinds  # it was dropped with the system turn: no skill, no error
    assert "Be brief." in tok.decode(plan.ids)
