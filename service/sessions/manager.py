"""Sessions: the paper's edit+compose agent. Turn 0 composes the skills into the system turn; each
later turn reuses the longest common cached prefix and prefills only the new tokens; changed fields
arrive as erratum lines (current value only) at the head of the user turn. Live session KV is bounded
(LRU by bytes, idle TTL); saved copies (saved.py) let another replica resume a session.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

from service.compose.tooluse import ToolsPrep
from service.errors import InvalidField, InvalidRequest, LimitExceeded, SessionBusy, SessionNotFound
from service.compose.pipeline import ComposeParams, ComposePipeline, Final, Mode, SkillRef
from service.runtime.params import Delta, Done, GenParams
from service.compose.turns import Turn
from service.compose.usage import count
from service.sessions.saved import SavedSessions, Session
from service.tools.conversation import link_results
from service.tools.events import tool_calls_of
from service.tools.spec import Tool, ToolChoice, ToolsParams, tools_params

log = logging.getLogger(__name__)


class SessionManager:
    def __init__(self, pipeline: ComposePipeline, memories=None) -> None:
        self.p = pipeline
        self.rt = pipeline.rt
        self.memories = memories  # MemoryRegistry: a session may float a memory before each user turn
        st = pipeline.settings
        self.max_bytes, self.ttl_s, self.max_per_ns = st.session_max_bytes, st.session_ttl_s, st.max_sessions
        self.live: OrderedDict[str, Session] = OrderedDict()  # LRU: most recent last
        self.saved = SavedSessions(pipeline, self.live)
        self.turns = pipeline.runner.session_turns(pipeline, memories)  # the engine keeps conversations its way
        self._loading: dict[tuple[str, str], asyncio.Task] = {}  # (namespace, id) -> its resume in progress

    # ---- lifecycle -------------------------------------------------------------------------
    async def create(self, ns: str, refs: list[SkillRef], system: str | None, fields: dict[str, str],
                     mode: Mode = "compose", seam_tokens: int | None = None, tools: ToolsParams | None = None,
                     memory: str | None = None, memory_seam_tokens: int | None = None) -> tuple[Session, dict]:
        """`tools`: offered on every turn; their block is composed into the head with the skills. `memory`: floated
        before every user turn, never part of the head."""
        if sum(s.namespace == ns for s in self.live.values()) >= self.max_per_ns:
            raise LimitExceeded(f"this tenant has {self.max_per_ns} live sessions (SKILLCACHE_MAX_SESSIONS); "
                                "delete some first")
        if not refs and not system and tools is None:  # an empty head has nothing to cache (no template renders it)
            raise InvalidRequest("a session needs at least one skill, a system message or tools")
        if memory is not None:  # it exists, and its blocks are compiled before the first turn
            await self.memories.resolve(ns, memory, memory_seam_tokens)
        head = [{"role": "system", "content": system}] if system else []
        # the head is prepared as /v1/compose prepares a request (fields as errata), ending after the system turn
        prep = await self.p.prepare(ComposeParams(skills=refs, messages=head, fields=fields,
                                                  gen=GenParams(max_tokens=1), mode=mode, seam_tokens=seam_tokens,
                                                  namespace=ns, tools=tools), head_only=True)
        records = prep.records
        s = Session(id=f"s-{secrets.token_hex(12)}", namespace=ns, system=system,
                    skills=[{"name": r.name, "version": r.version, "content_hash": r.content_hash} for r in records],
                    fields={**{f: v for r in records for f, v in r.fields.items()}, **fields},
                    skill_fields=[{f: fields.get(f, v) for f, v in r.fields.items()} for r in records],
                    base_errata=prep.errata, skill_ids=[b.token_ids for b in prep.blocks[:len(records)]],
                    tools=[t.openai() for t in tools.tools] if tools is not None else [],
                    memory=memory, memory_seam_tokens=memory_seam_tokens, mode=mode, seam_tokens=seam_tokens)
        plan = prep.plan
        usage = await self.turns.open(s, prep)
        s.ids = plan.ids
        self._admit(s)
        self.saved.save_later(s)
        return s, usage

    async def _head_blocks(self, s: Session, records, tb, t_index: int | None):
        """The session's head blocks (its skills', then the tools block), their calibrated seams, and the mode
        that runs (a degraded skill runs in full): as the pipeline finds them for /v1/compose."""
        ns = s.namespace
        blocks, _, _, picks = await self.p.skill_blocks(ns, records, [r.default_text for r in records], s.seam_tokens)
        if t_index is not None:
            kv, _, key = await self.p.tools_block(ns, list(tb.ids))
            blocks = [*blocks, kv]
            picks.append(self.p.guard.seam_for(str(key), kv, s.seam_tokens))
        mode = "full" if any(path == "full" for _, path in picks) else s.mode
        return blocks, [k or 0 for k, _ in picks], mode

    async def get(self, ns: str, sid: str) -> Session:
        if self.saved.is_deleted(sid):
            raise SessionNotFound(f"session {sid!r} not found")
        s = self.live.get(sid)
        if s is None:
            s = await self._resume(ns, sid)
        if s.namespace != ns:
            raise SessionNotFound(f"session {sid!r} not found")
        s.last_used = time.monotonic()
        self.live.move_to_end(s.id)
        return s

    async def delete(self, ns: str, sid: str) -> None:
        """Gone at once here (a turn still running finishes, but is neither kept nor saved), and in the store
        once this returns: a save of its creation or of a turn still queued or running cannot bring it back."""
        s = await self.get(ns, sid)
        self.live.pop(s.id, None)
        await self.saved.delete(s)

    # ---- turns -----------------------------------------------------------------------------
    async def turn(self, ns: str, sid: str, user: str | None, fields: dict[str, str], gen: GenParams,
                   tool_choice: ToolChoice | None = None, parallel: bool | None = None,
                   tool_results: list[dict] | None = None) -> AsyncIterator[Delta | Final]:
        """`tool_results`: [{"tool_call_id", "content"}] answering every call of the last reply, before `user`."""
        self.p.check_request([], gen.max_tokens)
        if user is None and not tool_results:
            raise InvalidRequest("user: required unless the turn brings tool_results")
        s = await self.get(ns, sid)
        if s.lock.locked():
            raise SessionBusy(f"session {sid!r} is already running a turn; wait for it to finish")
        await s.lock.acquire()
        try:
            unknown = sorted(set(fields) - set(s.fields))
            if unknown:
                raise InvalidField(f"unknown fields {unknown}; this session's skills declare {sorted(s.fields)}")
            params = tools_params([Tool.from_openai(t) for t in s.tools], tool_choice, parallel)
            changed = self._changed(s, fields)
            tmpl = self.p.settings.erratum_template
            errata = [tmpl.format(field=f, value=v) for f, v in changed.items()]
            results = [{"role": "tool", "content": r["content"], "tool_call_id": r["tool_call_id"]}
                       for r in tool_results or []]
            messages = s.messages + results
            link_results(messages, lambda i: f"tool_results.{i - len(s.messages)}", start=len(s.messages))
            if user is not None or errata:
                content = "\n".join(errata) + ("\n\n" + user if user is not None else "") if errata else user
                messages.append({"role": "user", "content": content})
            t0 = time.perf_counter()  # the turn's clock: finding the memory's blocks is part of its first token
            late = await self.memories.resolve(ns, s.memory, s.memory_seam_tokens) if s.memory else None
            tb = self.p.tool_prompt.block(params) if params is not None else None
            plan, t_index = self.p.tool_prompt.build(self._head(s) + messages, s.skill_ids, s.base_errata, tb,
                                                     late=late)
            tools = ToolsPrep.make(params, tb, t_index, self.p.tool_prompt.encode_template) if tb and params else None
            if tools is not None:
                self.p.tool_prompt.force(plan, tools.opening)
                gen = tools.gen(gen)
            ids = plan.ids
            self.rt.check_length(len(ids) + (tools.extra_tokens() if tools else 0), gen.max_tokens,
                                 "compose" if late else "full")

            async def head():  # the head's blocks as /v1/compose finds them (an engine that keeps no cache here)
                records = [await self.p.registry.get(ns, sk["name"], sk["version"]) for sk in s.skills]
                return await self._head_blocks(s, records, tb, t_index)

            def ended(done: Done, usage: dict, timings: dict, memory) -> Final:
                return self._ended(s, messages, fields, changed, errata, done, usage, timings, tools, memory)

            out = await self.turns.start(s, Turn(plan, gen, tools, late, t0, head, ended, s.lock.release))
            await anext(out)  # started: from here on, closing it (the response ending) releases the lock
        except BaseException:
            s.lock.release()
            raise
        return out

    def _ended(self, s: Session, messages, fields, changed, errata, done: Done, usage: dict, timings: dict, tools,
               memory) -> Final:
        """A turn has ended: the session takes its reply and fields, is kept and saved; the turn's Final."""
        s.messages = messages + [self._reply(done)]
        s.fields.update(fields)
        s.skill_fields = [{**said, **{f: v for f, v in fields.items() if f in said}}
                          for said in s.skill_fields]  # an erratum names no skill: all read it
        count(usage)
        edits = [{"mode": "erratum", "fields": sorted(changed), "lines": errata}] if changed else []
        if not self.saved.is_deleted(s.id):  # deleted during the turn: do not bring it back
            self._admit(s)
            self.saved.save_later(s)
        report = None if tools is None else {
            "format": tools.block.fmt.name, "native": tools.block.native, "n_tokens": len(tools.block.ids),
            "source": "session"}
        return Final(done, usage, timings, [{**sk, "source": "session"} for sk in s.skills], edits, report, memory)

    def _changed(self, s: Session, fields: dict[str, str]) -> dict[str, str]:
        """The given fields that some skill's block, or the last erratum line, says otherwise. As in /v1/compose,
        a value one skill's default already says is news to a skill that declares the field with another default."""
        said = s.skill_fields or [s.fields]  # a session saved before skill_fields: one value per field
        return {f: v for f, v in fields.items() if any(d.get(f, v) != v for d in said)}

    def _reply(self, done: Done) -> dict:
        """The assistant message later turns re-render. Its exact generated ids (those the cache holds) when they
        spell the returned text; otherwise (cut at a stop string, or special tokens the text leaves out) the text,
        re-tokenized as a client replaying the transcript would send it. The next turn then keeps the cache only
        up to where the two agree and prefills the rest, so the model never sees what the client did not."""
        calls = tool_calls_of(done)
        if calls:  # re-rendered from the calls: the template (or the fallback) writes them its way
            return {"role": "assistant", "content": done.text, "tool_calls": [c.openai() for c in calls]}
        ids = [t for t in done.token_ids if t not in self.rt.eos_ids]
        if self.rt.tokenizer.decode(ids) == done.text:
            return {"role": "assistant", "content": done.text, "ids": ids}
        return {"role": "assistant", "content": done.text}

    # ---- memory bound and resume ---------------------------------------------------
    def _head(self, s: Session) -> list[dict[str, str]]:
        return [{"role": "system", "content": s.system}] if s.system else []

    def bytes_held(self) -> int:
        from service.kv.cache import cache_bytes

        return sum(cache_bytes(x.cache) for x in self.live.values() if x.cache is not None)

    def _admit(self, s: Session) -> None:
        """Keep `s` live; drop idle (TTL) and least recently used sessions beyond the byte budget."""
        self.live[s.id] = s
        self.live.move_to_end(s.id)
        now = time.monotonic()
        for sid, other in list(self.live.items()):
            if other is not s and not other.lock.locked() and now - other.last_used > self.ttl_s:
                self.live.pop(sid)
        while self.bytes_held() > self.max_bytes and len(self.live) > 1:
            victim = next((x for x in self.live.values() if x is not s and not x.lock.locked()), None)
            if victim is None:
                break
            self.live.pop(victim.id)

    async def drain(self) -> None:
        await self.saved.drain()

    async def _resume(self, ns: str, sid: str) -> Session:
        """Concurrent requests for a session not in memory share one load, so one Session and its lock: each
        with its own copy, two turns would both run and the later save would drop the other's turn."""
        key = (ns, sid)
        load = self._loading.get(key)
        if load is None:
            load = self._loading[key] = asyncio.create_task(self.saved.load(ns, sid))
            load.add_done_callback(lambda _: self._loading.pop(key, None))
        s = await asyncio.shield(load)  # a caller that goes away does not cancel the others' load
        if self.saved.is_deleted(sid):  # deleted while it was read
            raise SessionNotFound(f"session {sid!r} not found")
        s = self.live.get(sid, s)  # a waiter before us may have admitted it already
        self._admit(s)
        return s
