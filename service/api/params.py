"""Request bodies -> the pipeline's parameters, in one place for every API: skill references, seam tokens, field
values, generation settings, tools and the memory all map here."""

from __future__ import annotations

from service.api.schemas.common import Composition, GenerationIn, SkillRefIn
from service.api.schemas.tools import NamedToolChoice, ToolChoiceIn, ToolIn
from service.compose.pipeline import ComposeParams, SkillRef
from service.runtime.params import GenParams
from service.tools.spec import Tool, ToolChoice, ToolsParams
from service.tools.spec import tools_params as make_params


def skill_refs(body: Composition) -> list[SkillRef]:
    return [SkillRef(s.name, s.version) if isinstance(s, SkillRefIn) else SkillRef(s) for s in body.skills]


def seam_tokens(body: Composition) -> int | None:
    """None: each block's calibrated seam ("auto", or omitted)."""
    return None if body.seam_tokens == "auto" else body.seam_tokens


def gen_params(body: GenerationIn, logprobs: int | None = None, max_tokens: int | None = None) -> GenParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return GenParams(max_tokens or body.max_tokens, body.temperature, body.top_p, body.seed, stop, logprobs,
                     ignore_eos=body.ignore_eos)


def tool_choice(choice: ToolChoiceIn | None) -> ToolChoice | None:
    if choice is None:
        return None
    return ToolChoice("named", choice.function.name) if isinstance(choice, NamedToolChoice) else ToolChoice(choice)


def tool_specs(tools: list[ToolIn] | None) -> list[Tool]:
    return [Tool(t.function.name, t.function.description, t.function.parameters) for t in tools or []]


def tools_params(tools: list[ToolIn] | None, choice: ToolChoiceIn | None, parallel: bool | None
                 ) -> ToolsParams | None:
    """The request's tools and choice (None when it offers none); 422 for a choice that cannot be honoured."""
    return make_params(tool_specs(tools), tool_choice(choice), parallel)


async def compose_params(body: Composition, messages: list[dict], gen: GenParams, ns: str, memories,
                         tools: ToolsParams | None = None, edit_mode: str = "erratum") -> ComposeParams:
    """One request's parameters: `messages` (the pipeline's OpenAI-shaped dicts) and `gen` come from the API's own
    shape; the composition part (skills, fields, mode, seam, memory) is read here. `memories`: the MemoryRegistry
    that resolves the body's memory (it floats after the system turn, before the user text)."""
    params = ComposeParams(skills=skill_refs(body), messages=messages, fields=dict(body.fields or {}), gen=gen,
                           mode=body.mode, seam_tokens=seam_tokens(body), edit_mode=edit_mode, namespace=ns,
                           tools=tools)
    if body.memory is not None:
        params.late = await memories.resolve(ns, body.memory, body.memory_seam_tokens)
    return params
