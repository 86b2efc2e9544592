"""The tools block for a chat template that cannot render tools itself (the embedded SmolLM2's plain ChatML).

It lists each function's JSON schema and the calling convention of the `fallback` format (service/tools/formats.py):
a JSON list of calls inside one `<tool_call>` tag, the shape of SmolLM2's function-calling training data. Tool
results come back to the model as user turns in `<tool_response>` tags, and its own past calls as it wrote them.
The text depends on the tools alone, so an agent that sends the same tools every turn gets the same block.
"""

from __future__ import annotations

import json

from service.tools.spec import Tool

FALLBACK_BLOCK = """# Tools

You can call functions to answer the user. These are the functions, one JSON schema per line:
<tools>
{tools}
</tools>

To call functions, reply with a JSON list of calls inside <tool_call></tool_call> tags and nothing else:
<tool_call>[{{"name": "function_name", "arguments": {{"parameter_name": "value"}}}}]</tool_call>
Use the names and parameters above. The results come back inside <tool_response></tool_response> tags. When no \
function is needed, or once you have the results, answer the user in plain text."""

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>"


def fallback_text(tools: list[Tool]) -> str:
    return FALLBACK_BLOCK.format(tools="\n".join(json.dumps(t.function(), ensure_ascii=False) for t in tools))


def tool_response(content: str) -> str:
    return RESPONSE_OPEN + content + RESPONSE_CLOSE
