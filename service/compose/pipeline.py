"""The request's way through: registry -> store -> kv/runtime (on the serving engine) -> events for the API.

Everything that can fail (validation, unknown skill, fields, compile, store, length) happens in
`prepare`, before a response starts; `start` then waits for the first event so prefill errors too
become ordinary error responses instead of broken streams.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from service import metrics
from service.config import Settings
from service.compose.auto import AutoHeads
from service.compose.autoblocks import AutoBlocks
from service.compose.edits import SkillEdit, check_fields, plan_edit
from service.errors import InvalidRequest, LimitExceeded
from service.compose.guard import FidelityGuard
from service.compose.refine import PrefixRefiner
from service.compose.usage import count, timings_of, usage_of
from service.compose.tooluse import ToolsPrep, check_block_size
from service.kv.layout import LAYOUT_VERSION
from service.registry.registry import SkillRegistry
from service.registry.skill import SkillRecord, TextBlock
from service.runtime.params import Delta, Done, GenParams
from service.store.key import BlockKey
from service.tools.render import ToolPrompt
from service.tools.spec import ToolsParams

if TYPE_CHECKING:
    from service.store.blocks import Blocks
    from service.compose.engine import Engine
    from service.compose.autoblocks import SystemParts
    from service.kv.block import KVBlock
    from service.memory.registry import LateMemory
    from service.runtime.prompt import PromptPlan
    from service.store.tiered import TieredStore
    from service.runtime.model import ModelRuntime
    from service.runtime.steps import PrefillResult
    from service.runtime.serving import ServingLoop


log = logging.getLogger(__name__)
Mode = Literal["compose", "full"]


@dataclass
class SkillRef:
    name: str
    version: int | None = None


@dataclass
class ComposeParams:
    skills: list[SkillRef]
    messages: list[dict[str, str]]  # OpenAI-style, optional leading system message
    fields: dict[str, str] = field(default_factory=dict)
    gen: GenParams = field(default_factory=GenParams)
    mode: Mode = "compose"
    seam_tokens: int | None = None
    edit_mode: str = "erratum"
    namespace: str = "default"
    tools: ToolsParams | None = None
    late: "LateMemory | None" = None  # blocks placed late, at the head of the user turn: a memory (service/memory/)
    blocks: list[str] = field(default_factory=list)  # unregistered blocks by text, after the skills (TextBlock)


@dataclass
class Prepared:
    params: ComposeParams
    records: list[SkillRecord]
    blocks: list
    sources: list[str]
    edits: list[dict]
    plan: "PromptPlan"
    t_start: float
    store_ms: float
    keys: list[str]  # per skill: its registered text's block key, for the fidelity guard (also for variants)
    seams: list[int]  # per skill
    paths: list[str]  # per skill: "compose" or "full" (degraded after a failed shadow check)
    mode: Mode  # what actually runs
    prefix: "KVBlock | None" = None  # an exact prefix of the plan (refined skill sequence), or None
    tools: ToolsPrep | None = None
    errata: list[str] = field(default_factory=list)  # the erratum lines after the skills (their field edits)
    scheduled_tokens: int = 0  # tokens of system-prompt sections this request queued for compiling (cache writes)


@dataclass
class Final:
    """The last event of a request: what the API reports besides the text."""

    done: Done
    usage: dict
    timings: dict
    skills: list[dict]
    edits: list[dict]
    tools: dict | None = None  # the tools block: format, n_tokens, source, path, seam
    memory: dict | None = None  # the late blocks' report (LateMemory.report), when the request had them
    scheduled_tokens: int = 0  # tokens of automatic blocks this request queued for compiling (Prepared)
    head_tokens: int | None = None  # the prompt's head (template opening, blocks, system text); after it, the
    # conversation, where no block lies (None: not known, a session's turn)


class ComposePipeline:
    def __init__(self, settings: Settings, runtime: ModelRuntime, registry: SkillRegistry,
                 store: "TieredStore", engine: "ServingLoop") -> None:
        self.settings = settings
        self.rt = runtime
        self.registry = registry
        self.store = store
        self.engine = engine
        self.guard = FidelityGuard(settings, runtime, engine, store)
        self.refiner = PrefixRefiner(settings.refine_after, settings.background_chunk_tokens, runtime, store,
                                     self.guard, settings.refine_from_full)
        self.tool_prompt = ToolPrompt(runtime.prompts)
        self.auto = AutoHeads(settings, runtime.fingerprint)  # automatic exact heads (embedded engine)
        self.sections = AutoBlocks(settings, runtime, registry, self.guard)  # system-prompt sections
        self.runner: "Engine"  # what serves prepared requests: given by use_engine (AppState) before the first
        # request
        self.blocks: "Blocks"  # where blocks come from: the runner's (use_engine)

    def use_engine(self, runner: "Engine") -> None:
        """Run prepared requests on `runner` (service/engines/); its checks compute the guard's calibrations and
        shadow checks."""
        self.runner = runner
        runner.guard, self.guard.checks = self.guard, runner.checks
        self.blocks = self.sections.blocks = runner.blocks

    async def block_for(self, namespace: str, text: str, variant: bool = False):
        """The block of exactly `text` (from a tier, or compiled once on the engine) and where it came from.

        variant: a one-off text (a recompile edit's field values), kept in the memory tier only and not
        calibrated; registered skills' blocks go to every tier and are calibrated once."""
        key = self.registry.block_key(namespace, text)
        block, source = await self.blocks.get(key, lambda: self.rt.prompts.encode_content(text), ephemeral=variant)
        if not variant:
            self.guard.schedule_calibration(key, block)  # no-op once the block is calibrated
        return block, source

    async def compile_skill(self, namespace: str, text: str) -> None:
        """A registered skill's block made ready before its first use: compiled here into the store's tiers, or, on an
        engine that keeps its own blocks, by that engine at background priority (an engine that is down: on first
        use instead)."""
        block, _ = await self.block_for(namespace, text)
        await self.blocks.ahead(namespace, block)

    def compile_skill_soon(self, namespace: str, block, wait_s: float = 600.0) -> None:
        """`block` (from block_for) made ready on the engine in the background once the engine answers (start-up:
        vLLM may come up after skillcache)."""

        async def run() -> None:
            deadline = time.monotonic() + wait_s
            while not await self.runner.health():
                if time.monotonic() > deadline:
                    log.warning("the engine did not answer within %.0f s: shipped skills compile on first use", wait_s)
                    return
                await asyncio.sleep(2.0)
            await self.blocks.ahead(namespace, block)

        self.guard.spawn(run())

    async def tools_block(self, namespace: str, ids: list[int]):
        """The block of a request's tools (its ids: rendered and tokenized by ToolPrompt), its source and key. No
        record owns it, so nothing would delete it: like a recompile variant it lives in the memory tier only,
        least recently used first out; it is calibrated like a skill's (the calibration stays in memory too)."""
        digest = hashlib.sha256(b"".join(i.to_bytes(4, "little") for i in ids)).hexdigest()[:32]
        key = BlockKey(self.rt.fingerprint, LAYOUT_VERSION, namespace, f"tools-{digest}")
        block, source = await self.blocks.get(key, lambda: list(ids), ephemeral=True)
        self.guard.schedule_calibration(key, block, ephemeral=True)
        return block, source, key

    def check_request(self, skills: list, max_tokens: int) -> None:
        if len(skills) > self.settings.max_skills_per_request:
            raise LimitExceeded(
                f"{len(skills)} skills requested; the limit is {self.settings.max_skills_per_request} "
                "(SKILLCACHE_MAX_SKILLS_PER_REQUEST)"
            )
        if max_tokens > self.settings.max_tokens_cap:
            raise LimitExceeded(
                f"max_tokens {max_tokens} exceeds the cap {self.settings.max_tokens_cap} (SKILLCACHE_MAX_TOKENS_CAP)"
            )

    async def prepare(self, p: ComposeParams, head_only: bool = False) -> Prepared:
        """Everything a request needs before it runs. `head_only`: the prompt ends after the system turn and its
        blocks, with no generation prompt (a session's head: service/sessions/)."""
        t0 = time.perf_counter()
        self.check_request(p.skills + p.blocks, p.gen.max_tokens)
        records = [await self.registry.get(p.namespace, s.name, s.version) for s in p.skills]
        marked = [TextBlock.of(p.namespace, text) for text in p.blocks]
        if len({r.name for r in records + marked}) != len(records) + len(marked):
            raise InvalidRequest("a skill (or block of text) may appear only once per request")
        auto = not head_only and self.sections.enabled
        if not auto:  # with automatic blocks, the marked ones are composed when held, as sections are
            records += marked
        check_fields(records, p.fields)
        edits = [plan_edit(self.rt.prompts, r, p.fields, p.edit_mode, self.settings.erratum_template) for r in records]
        blocks, sources, keys, seams = await self.skill_blocks(p.namespace, records, [e.text for e in edits],
                                                               p.seam_tokens)
        parts = await self._sections(p, records, blocks, sources, keys, seams, edits) if auto else None
        store_s = time.perf_counter() - t0
        skill_ids = [e.ids or b.token_ids for e, b in zip(edits, blocks)]
        errata = [line for e in edits for line in e.errata]
        tb = self.tool_prompt.block(p.tools) if p.tools is not None and p.tools.tools else None
        if tb is not None:
            check_block_size(tb, self.settings.max_skill_tokens)
        plan, t_index = self.tool_prompt.build(p.messages, skill_ids, errata, tb, not head_only, late=p.late,
                                               system_parts=parts.parts if parts is not None else None)
        for seg in plan.segments:
            # the tools and late blocks are never edited
            if seg.kind == "skill" and seg.skill_index is not None and seg.skill_index < len(edits):
                seg.recompute = list(edits[seg.skill_index].recompute)
        tools = None
        if tb is not None:
            t1 = time.perf_counter()
            tools = await self._add_tools(p, tb, t_index, plan, blocks, keys, seams)
            store_s += time.perf_counter() - t1
        if p.late is not None:  # a memory: its blocks follow the skills' (and the tools block), with their own seams
            blocks.extend(p.late.blocks)
            seams.extend((k, "compose") for k in p.late.seams)
        store_ms = store_s * 1e3
        metrics.STAGE.labels("store").observe(store_ms / 1e3)
        mode: Mode = "full" if p.mode == "full" or any(path == "full" for _, path in seams) else "compose"
        self.rt.check_length(plan.n_tokens + (tools.extra_tokens() if tools else 0), p.gen.max_tokens, mode)
        prefix = await self.refiner.lookup(p.namespace, plan) if mode == "compose" else None
        report = [{"skill": r.name, **item} for r, e in zip(records, edits) for item in e.report]
        return Prepared(p, records, blocks, sources, report, plan, t0, store_ms, keys,
                        [seam if seam is not None else 0 for seam, _ in seams], [path for _, path in seams], mode,
                        prefix, tools, errata, parts.scheduled_tokens if parts is not None else 0)

    async def _sections(self, p: ComposeParams, records: list, blocks: list, sources: list, keys: list, seams: list,
                        edits: list) -> "SystemParts":
        """The marked blocks (cache_control) and the system text's sections as automatic blocks
        (service/compose/autoblocks.py): those held join the request's blocks (the lists grow), the others are text
        this time and compiled in the background."""
        system = p.messages[0]["content"] if p.messages and p.messages[0]["role"] == "system" else None
        room = self.settings.max_skills_per_request - len(records)
        parts = await self.sections.resolve(p.namespace, p.blocks, system or "", [r.name for r in records], room,
                                            p.mode == "compose", p.seam_tokens)
        records += parts.records
        blocks += parts.blocks
        sources += ["memory"] * len(parts.blocks)
        keys += parts.keys
        seams += parts.seams
        edits += [SkillEdit(text=r.text) for r in parts.records]
        return parts

    async def skill_blocks(self, namespace: str, records: list[SkillRecord], texts: list[str],
                           seam_tokens: int | None) -> tuple[list, list[str], list[str], list[tuple]]:
        """Per skill: the block of `texts[i]` (its registered text, or a recompile's variant), where it came from,
        the key its fidelity checks use (always its registered text's), and its (seam, path) from the guard."""
        blocks, sources, keys, seams = [], [], [], []
        for rec, text in zip(records, texts):
            block, source = await self.block_for(namespace, text, variant=text != rec.default_text)
            key = str(self.registry.block_key(namespace, rec.default_text))  # a variant's checks are its skill's
            blocks.append(block)
            sources.append(source)
            keys.append(key)
            seams.append(self.guard.seam_for(key, block, seam_tokens))
        return blocks, sources, keys, seams

    async def _add_tools(self, p: ComposeParams, tb, t_index: int | None, plan, blocks: list, keys: list,
                         seams: list) -> ToolsPrep:
        """The forced opening and stop strings of the tool choice; the tools block (fetched, or compiled once) as one
        more block after the skills' (blocks, keys, seams grow by one)."""
        assert p.tools is not None  # a tools block was built from them
        tools = ToolsPrep.make(p.tools, tb, t_index, self.tool_prompt.encode_template)
        self.tool_prompt.force(plan, tools.opening)
        p.gen = tools.gen(p.gen)
        if t_index is not None:
            tools.kv, tools.source, key = await self.tools_block(p.namespace, list(tb.ids))
            tools.key = str(key)
            blocks.append(tools.kv)
            keys.append(tools.key)
            seams.append(self.guard.seam_for(tools.key, tools.kv, p.seam_tokens))
        return tools

    async def start(self, prep: Prepared) -> AsyncIterator[Delta | Final]:
        """Run the prepared request on the engine (service/engines/) and wait for its first event; returns the event
        stream. Errors before the first token (prefill, an engine that is down) raise here, before any byte is sent."""
        return await self.runner.start(prep, self.finish)

    def finish(self, prep: Prepared, done: Done, pre: "PrefillResult", ttft_ms: float) -> Final:
        """The last event of a request, from what its engine reports (pre: its prefill's counts and timings)."""
        mode = prep.mode
        total_ms = (time.perf_counter() - prep.t_start) * 1e3
        metrics.TTFT.labels(mode).observe(ttft_ms / 1e3)
        metrics.STAGE.labels("prefill").observe(pre.timings_ms["prefill_ms"] / 1e3)
        metrics.STAGE.labels("decode").observe((total_ms - ttft_ms) / 1e3)
        segs = [seg for seg in prep.plan.segments if seg.kind == "skill"]
        in_prefix = {seg.skill_index for seg, end in zip(segs, prep.plan.skill_ends())
                     if end <= pre.n_prefix and seg.skill_index is not None}
        fresh = prep.tools.copied_fresh(pre, in_prefix) if prep.tools is not None else 0
        composed, recomputed = pre.n_reused - fresh, pre.n_recomputed + fresh
        usage = usage_of(pre.n_prompt, composed, pre.n_prefix, pre.n_auto, recomputed, len(done.token_ids))
        count(usage)
        timings = timings_of(ttft_ms, pre.timings_ms["prefill_ms"], prep.store_ms, total_ms)
        skills = [  # seam: what was recomputed (0 for a first skill copied as is); None unless composed
            {"name": r.name, "version": r.version, "content_hash": r.content_hash, "source": s,
             "path": "prefix" if i in in_prefix else mode if path == "compose" else path,
             "seam": pre.seams.get(i)}
            for i, (r, s, path) in enumerate(zip(prep.records, prep.sources, prep.paths))
        ]
        tools = prep.tools.report(pre, in_prefix, mode) if prep.tools is not None else None
        late = prep.params.late  # its blocks are the last ones
        memory = late.report(pre.seams, len(prep.blocks) - len(late.blocks)) if late is not None else None
        return Final(done, usage, timings, skills, prep.edits, tools, memory, prep.scheduled_tokens,
                     prep.plan.head_end)

