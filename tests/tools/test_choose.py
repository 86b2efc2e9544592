"""tool_choice required among several tools: the name with the highest likelihood under the model is chosen (checked
against full prefills of each candidate), the request's cache then holds exactly the prompt and the chosen opening."""

from __future__ import annotations

import torch

from service.runtime.steps import run_steps
from service.tools.choose import candidates, choose_steps
from service.tools.render import ToolPrompt
from service.tools.spec import Tool, ToolChoice, ToolsParams
from tiny import tiny_runtime

TOOLS = [Tool("get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}},
                                    "required": ["city"]}),
         Tool("get_time", None, {"type": "object", "properties": {}}),
         Tool("search", None, None)]


def _logprob(rt, prompt: list[int], ids: list[int]) -> float:
    """log p(ids | prompt) from one forward of prompt + ids from scratch (no cache)."""
    with torch.inference_mode():
        logits = rt.model(input_ids=torch.tensor([prompt + ids])).logits[0].float()  # [T, V]
    lps = torch.log_softmax(logits[len(prompt) - 1:-1], -1)  # the positions that predict ids
    return float(lps[torch.arange(len(ids)), torch.tensor(ids)].sum())


def _plan(ids):
    from service.runtime.prompt import PromptPlan, Segment

    return PromptPlan([Segment("text", list(ids))])


def test_the_most_likely_offered_name_is_chosen_and_the_cache_holds_it():
    rt = tiny_runtime("llama")
    tp = ToolPrompt(rt.prompts)
    params = ToolsParams(TOOLS, ToolChoice("required"))
    block = tp.block(params)
    plan, _ = tp.build([{"role": "user", "content": "weather?"}], [], [], block)
    head = block.fmt.forced_opening(params)
    assert head.endswith('{"name": "')
    tp.force(plan, head)
    options = candidates(block.fmt, params, tp.encode_template)
    assert [o.text.split('"')[0] for o in options] == ["get_weather", "get_time", "search"]
    assert options[0].text == 'get_weather", "arguments": '
    expected = [_logprob(rt, plan.ids, o.name_ids) for o in options]
    chosen = []
    steps = rt.prefill_steps(plan, [], mode="full")
    pre = run_steps(choose_steps(rt, steps, options, chosen.append))
    assert chosen == [options[max(range(3), key=expected.__getitem__)]]
    tail = chosen[0].name_ids + chosen[0].rest_ids
    assert pre.n_prompt == plan.n_tokens + len(tail) and pre.cache.get_seq_length() == pre.n_prompt
    full = rt.prefill(_plan(plan.ids + tail), [], mode="full")
    assert torch.allclose(pre.logits, full.logits, atol=1e-4)  # as if the opening had been in the prompt
