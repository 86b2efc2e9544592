"""A request's tools on their way through the pipeline: the tools block fetched or compiled (memory tier), the
forced opening, the parser for the reply, and what the response says about the block."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from service.errors import LimitExceeded
from service.runtime.params import GenParams
from service.tools.choose import Candidate, candidates, choose_steps, max_tail
from service.tools.parser import ToolCallParser
from service.tools.render import ToolsBlock
from service.tools.spec import ToolsParams

if TYPE_CHECKING:
    from service.runtime.steps import PrefillResult


@dataclass
class ToolsPrep:
    params: ToolsParams
    block: ToolsBlock
    index: int | None  # the block's index among the request's blocks; None: the template did not render it as cut
    opening: str  # forced opening appended to the prompt ("" for auto)
    kv: object = None  # KVBlock, when index is not None
    source: str | None = None  # memory, disk, redis or compiled
    key: str | None = None
    options: list[Candidate] = field(default_factory=list)  # tool_choice required among several: scored names
    tail_ids: list[int] = field(default_factory=list)  # the chosen name's ids, appended after the prompt
    g: GenParams | None = None  # the request's GenParams (gen()): a chosen tool's schema is set on it

    @classmethod
    def make(cls, params: ToolsParams, block: ToolsBlock, index: int | None, encode) -> "ToolsPrep":
        prep = cls(params, block, index, block.fmt.forced_opening(params))
        if params.choice.mode == "required" and len(params.tools) > 1:
            prep.options = candidates(block.fmt, params, encode)
        return prep

    def steps(self, rt, steps):
        """The request's prefill steps, followed by the choice of the tool when `required` leaves it open."""
        return choose_steps(rt, steps, self.options, self.chosen) if self.options else steps

    def extra_tokens(self) -> int:
        """Prompt tokens the choice may append after the prompt."""
        return max_tail(self.options) if self.options else 0

    def chosen(self, c: Candidate) -> None:  # on the engine, before the first token
        self.opening += c.text
        self.tail_ids = c.name_ids + c.rest_ids
        if self.g is not None:  # the arguments are decoded under the chosen tool's schema
            self.g.json_schema = self._schema(c.name)

    def _schema(self, name: str | None) -> str | None:
        tool = self.params.get(name) if name is not None else None
        return json.dumps(tool.arguments_schema()) if tool is not None else None

    def parser(self) -> ToolCallParser | None:
        if self.params.choice.mode == "none":
            return None  # the tools are in the prompt, but the reply is text whatever it says
        return ToolCallParser(self.block.fmt, self.params, forced=self.opening)

    def gen(self, gen: GenParams) -> GenParams:
        """The request's GenParams with the format's stop strings; a forced call's arguments under its tool's schema
        (the tool named, or the one offered; among several, once chosen). A typed reply's schema gives way: the reply
        is the call."""
        extra = self.block.fmt.stop_strings(self.params.choice, self.params.parallel)
        self.g = replace(gen, stop=[*gen.stop, *(s for s in extra if s not in gen.stop)])
        choice = self.params.choice
        if choice.mode == "named":
            self.g.json_schema = self._schema(choice.name)
        elif choice.mode == "required":
            self.g.json_schema = self._schema(self.params.tools[0].name) if len(self.params.tools) == 1 else None
        return self.g

    def copied_fresh(self, pre: "PrefillResult", in_prefix: set[int]) -> int:
        """Block tokens copied into this prompt from a block compiled for this very request: they were computed
        for it, so usage counts them as recomputed, not cached (the block is cached from the next request on)."""
        if self.index is None or self.source != "compiled" or self.index in in_prefix or self.index not in pre.seams:
            return 0
        return len(self.block.ids) - pre.seams[self.index]

    def report(self, pre: "PrefillResult", in_prefix: set[int], mode: str) -> dict:
        path = "text" if self.index is None else "prefix" if self.index in in_prefix else mode
        return {"format": self.block.fmt.name, "native": self.block.native, "n_tokens": len(self.block.ids),
                "source": self.source, "path": path,
                "seam": pre.seams.get(self.index) if self.index is not None else None}


def check_block_size(block: ToolsBlock, max_tokens: int) -> None:
    if len(block.ids) > max_tokens:
        raise LimitExceeded(f"the tools render to {len(block.ids)} tokens; the limit is {max_tokens} "
                            "(SKILLCACHE_MAX_SKILL_TOKENS): offer fewer tools or shorter descriptions")
