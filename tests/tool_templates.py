"""Tiny tokenizers whose chat templates render `tools` themselves, for the native path (the embedded SmolLM2's
plain ChatML has no tools support): Qwen2.5's template (Hermes-style <tool_call> tags) and a Llama-3.1-style one
(JSON calls, tools in the system turn after a header line)."""

from __future__ import annotations

import copy
import functools

import torch

from service.runtime.model import ModelRuntime
from service.runtime.fingerprint import model_fingerprint
from service.runtime.loader import build_random_model
from tiny import tiny_config, tiny_tokenizer

# Qwen2.5-Instruct's chat template, as shipped
QWEN25 = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)

# Llama-3.1-style: a header line and the tools go into the system turn (two insertions), calls are bare JSON
LLAMA31_LIKE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "<|im_start|>system\n{%- if tools %}Environment: ipython\n{%- endif %}Cutting Knowledge Date: December 2023\n\n"
    "{%- if tools %}Given the following functions, respond with a JSON for a function call with its proper "
    "arguments. Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and "
    "its value}. Do not use variables.\n\n{%- for t in tools %}{{ t | tojson(indent=4) }}\n\n{%- endfor %}{%- endif %}"
    "{{ system }}<|im_end|>\n"
    "{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"parameters\": "
    "{{ c.function.arguments | tojson }}}{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>ipython\n{{ m.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@functools.lru_cache(maxsize=None)
def tools_tokenizer(template: str = QWEN25):
    tok = copy.deepcopy(tiny_tokenizer())
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # added, not special: as in Qwen2.5's vocabulary
    tok.chat_template = template
    return tok


@functools.lru_cache(maxsize=None)
def tools_runtime(template: str = QWEN25) -> ModelRuntime:
    cfg = tiny_config("qwen2")
    cfg._attn_implementation = "sdpa"
    loaded = build_random_model(cfg, tools_tokenizer(template), seed=0, dtype=torch.float32)
    return ModelRuntime(loaded, model_fingerprint(loaded.model, loaded.tokenizer, [], torch.float32))
