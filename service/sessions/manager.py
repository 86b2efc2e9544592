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

from service import metrics
from service.compose.edits import check_fields, plan_edit
from service.errors import InvalidField, InvalidRequest, LimitExceeded, SessionBusy, SessionNotFound
from service.compose.pipeline import ComposePipeline, Final, SkillRef
from service.runtime.late import late_turn_steps
from service.runtime.params import Delta, Done, GenParams
from service.sessions.saved import SavedSessions, Session

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
        self._loading: dict[tuple[str, str], asyncio.Task] = {}  # (namespace, id) -> its resume in progress

    # ---- lifecycle -------------------------------------------------------------------------
    async def create(self, ns: str, refs: list[SkillRef], system: str | None, fields: dict[str, str],
                     mode: str = "compose", seam_tokens: int | None = None, memory: str | None = None,
                     memory_seam_tokens: int | None = None) -> tuple[Session, dict]:
        if sum(s.namespace == ns for s in self.live.values()) >= self.max_per_ns:
            raise LimitExceeded(f"this tenant has {self.max_per_ns} live sessions (SKILLCACHE_MAX_SESSIONS); "
                                "delete some first")
        if not refs and not system:  # an empty head has nothing to cache (and no template renders it)
            raise InvalidRequest("a session needs at least one skill or a system message")
        self.p.check_request(refs, 1)
        records = [await self.p.registry.get(ns, r.name, r.version) for r in refs]
        if len({r.name for r in records}) != len(records):
            raise InvalidRequest("a skill may appear only once per session")
        check_fields(records, fields)
        if memory is not None:  # it exists, and its blocks are compiled before the first turn
            await self.memories.resolve(ns, memory, memory_seam_tokens)
        tmpl = self.p.settings.erratum_template
        edits = [plan_edit(self.rt.prompts, r, fields, "erratum", tmpl) for r in records]
        blocks = [(await self.p.block_for(ns, r.default_text))[0] for r in records]
        s = Session(id=f"s-{secrets.token_hex(12)}", namespace=ns, system=system,
                    skills=[{"name": r.name, "version": r.version, "content_hash": r.content_hash} for r in records],
                    fields={**{f: v for r in records for f, v in r.fields.items()}, **fields},
                    skill_fields=[{f: fields.get(f, v) for f, v in r.fields.items()} for r in records],
                    base_errata=[line for e in edits for line in e.errata], skill_ids=[b.token_ids for b in blocks],
                    memory=memory, memory_seam_tokens=memory_seam_tokens)
        plan = self.rt.prompts.build(self._head(s), s.skill_ids, s.base_errata,
                                     add_generation_prompt=False)
        self.rt.check_length(plan.n_tokens, 1, "full" if mode == "full" else "compose")
        picks = [self.p.guard.seam_for(str(self.p.registry.block_key(ns, r.default_text)), b, seam_tokens)
                 for r, b in zip(records, blocks)]  # calibrated seams; a degraded skill runs in full
        mode = "full" if any(path == "full" for _, path in picks) else mode
        seam = [k or 0 for k, _ in picks]
        prefix = await self.p.refiner.lookup(ns, plan) if mode == "compose" else None
        pre = await self.p.engine.run_steps(self.rt.prefill_steps(
            plan, blocks, mode=mode, seam_tokens=seam, prefix=prefix, chunk=self.p.settings.prefill_chunk_tokens))
        if mode == "compose":
            self.p.refiner.note(ns, plan, pre.n_prefix)
        s.cache, s.ids = pre.cache, plan.ids
        self._admit(s)
        self.saved.save_later(s)
        return s, {"prompt_tokens": pre.n_prompt, "reused_tokens": pre.n_reused + pre.n_prefix,
                   "recomputed_tokens": pre.n_recomputed}

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
    async def turn(self, ns: str, sid: str, user: str, fields: dict[str, str], gen: GenParams
                   ) -> AsyncIterator[Delta | Final]:
        self.p.check_request([], gen.max_tokens)
        s = await self.get(ns, sid)
        if s.lock.locked():
            raise SessionBusy(f"session {sid!r} is already running a turn; wait for it to finish")
        await s.lock.acquire()
        try:
            unknown = sorted(set(fields) - set(s.fields))
            if unknown:
                raise InvalidField(f"unknown fields {unknown}; this session's skills declare {sorted(s.fields)}")
            changed = self._changed(s, fields)
            tmpl = self.p.settings.erratum_template
            errata = [tmpl.format(field=f, value=v) for f, v in changed.items()]
            content = "\n".join(errata) + "\n\n" + user if errata else user
            messages = s.messages + [{"role": "user", "content": content}]
            t0 = time.perf_counter()  # the turn's clock: finding the memory's blocks is part of its first token
            late = await self.memories.resolve(ns, s.memory, s.memory_seam_tokens) if s.memory else None
            plan = self.rt.prompts.build(self._head(s) + messages, s.skill_ids, s.base_errata,
                                         late_ids=late and late.ids, late_lines=late and late.lines)
            ids = plan.ids
            self.rt.check_length(len(ids), gen.max_tokens, "compose" if late else "full")
            events = await self._run_turn(s, ids, gen, (plan, late) if late else None, t0)
            out = self._finish(s, messages, fields, changed, errata, events)
            await anext(out)  # started: from here on, closing it (the response ending) releases the lock
        except BaseException:
            s.lock.release()
            raise
        return out

    async def _run_turn(self, s: Session, ids: list[int], gen: GenParams, late=None, t0: float | None = None):
        """`late`: (plan, LateMemory) when the session floats a memory before the user turn."""
        t0 = time.perf_counter() if t0 is None else t0
        box: dict = {"ids": ids, "late": late, "store_ms": (time.perf_counter() - t0) * 1e3}
        cached_ids, s.ids = s.ids, []  # until the turn ends, the cache is trusted for no ids: it is being extended

        def on_prefilled(pre) -> None:  # on the engine
            box.update(ttft_ms=(time.perf_counter() - t0) * 1e3, reused=pre.n_reused + pre.n_prefix,
                       recomputed=pre.n_recomputed, composed=pre.n_reused if late else 0, seams=pre.seams)

        chunk = self.p.settings.prefill_chunk_tokens
        if late is not None:
            steps = late_turn_steps(self.rt, s.cache, cached_ids, late[0], late[1].blocks, late[1].seams, chunk)
        else:
            steps = self.rt.extend_steps(s.cache, cached_ids, ids, chunk=chunk)
        job = self.p.engine.submit_sequence(steps, gen, len(ids), keep_cache=True, on_prefilled=on_prefilled)
        stream = job.stream()
        first = await anext(stream)
        return first, stream, box, t0, job

    async def _finish(self, s: Session, messages, fields, changed, errata, events) -> AsyncIterator[Delta | Final]:
        item, stream, box, t0, job = events
        try:
            yield None  # turn() starts us here: an async generator closed before it started runs no `finally`
            while True:
                if isinstance(item, Done):
                    # the cache holds every forwarded token: the last sampled one may not be
                    s.cache = job.cache
                    ids = box["ids"] + item.token_ids
                    if box["late"] is not None:  # the memory leaves the conversation's cache: floated again next turn
                        ids = await self.memories.leave(s.cache, ids, box["late"][0].late_span)
                    s.ids = ids[: s.cache.get_seq_length()]
                    s.messages = messages + [self._reply(item)]
                    s.fields.update(fields)
                    s.skill_fields = [{**said, **{f: v for f, v in fields.items() if f in said}}
                                      for said in s.skill_fields]  # an erratum names no skill: all read it
                    usage = {"prompt_tokens": box["reused"] + box["recomputed"], "reused_tokens": box["reused"],
                             "composed_tokens": box["composed"], "prefix_tokens": box["reused"] - box["composed"],
                             "recomputed_tokens": box["recomputed"], "completion_tokens": len(item.token_ids)}
                    metrics.TOKENS.labels("prefix").inc(box["reused"] - box["composed"])
                    metrics.TOKENS.labels("composed").inc(box["composed"])
                    metrics.TOKENS.labels("recomputed").inc(box["recomputed"])
                    timings = {"ttft_ms": round(box["ttft_ms"], 2), "compose_ms": round(box["ttft_ms"], 2),
                               "store_ms": round(box["store_ms"], 2),
                               "total_ms": round((time.perf_counter() - t0) * 1e3, 2)}
                    edits = [{"mode": "erratum", "fields": sorted(changed), "lines": errata}] if changed else []
                    if not self.saved.is_deleted(s.id):  # deleted during the turn: do not bring it back
                        self._admit(s)
                        self.saved.save_later(s)
                    memory = box["late"][1].report(box["seams"], len(s.skill_ids)) if box["late"] else None
                    yield Final(item, usage, timings, [{**sk, "source": "session"} for sk in s.skills], edits, memory)
                    return
                yield item
                item = await anext(stream)
        finally:
            s.lock.release()
            await stream.aclose()  # a client gone mid-reply: stop generating now

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
