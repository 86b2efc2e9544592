"""AppState: builds and owns the stages for one process; the model loads in the background."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from service import metrics
from service.config import Settings
from service.errors import NotReady, ServiceError
from service.phases import Phases
from service.compose.pipeline import ComposePipeline
from service.memory.registry import build_memories
from service.registry.registry import SkillRegistry
from service.registry.skillfile import iter_skill_files, parse_skill_file
from service.runtime.serving import EngineConfig, ServingLoop
from service.sessions.manager import SessionManager
from service.store.factory import build_store

log = logging.getLogger(__name__)
DEFAULT_NAMESPACE = "default"


def _template_status(rt: Any | None) -> dict | None:
    """Which chat template prompts use; a plain-text fallback carries its warning (service/runtime/templates.py)."""
    if rt is None:
        return None
    from service.runtime.templates import describe_template

    return getattr(rt.loaded, "chat_template", None) or describe_template(rt.tokenizer, rt.loaded.name)


class AppState:
    def __init__(self, settings: Settings, runtime: Any | None = None) -> None:
        self.settings = settings
        self.runtime = runtime  # injected by tests; otherwise loaded in the background
        self.store, self.definitions = build_store(settings)
        self.engine = ServingLoop(EngineConfig.from_settings(settings))
        self.registry: SkillRegistry | None = None
        self.pipeline: ComposePipeline | None = None
        self.sessions: SessionManager | None = None
        self.memories = None  # MemoryRegistry (service/memory/), once the model is loaded
        self.selfcheck: dict | None = None
        self.load_error: str | None = None
        self.preload: dict[str, Any] = {}
        self.started_at = time.time()
        self._task: asyncio.Task | None = None
        self._ready = False  # model loaded, self-check passed, shipped skills registered
        self.phases = Phases()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._load())

    async def wait_ready(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    async def _load(self) -> None:
        try:
            if self.runtime is None:
                self.runtime = await self._build_runtime()
            rt = self.runtime
            if rt.holds_weights:  # the embedded engine: this process runs the model
                from service.runtime.selfcheck import run_selfcheck

                with self.phases("self-check"):
                    report = await self.engine.run(lambda cancelled: run_selfcheck(rt))
                self.selfcheck = report.to_dict()
                if not report.ok:
                    log.error("self-check failed: %s", self.selfcheck)
                    return
                await self.engine.run(lambda cancelled: self.engine.bind(rt))
            self.registry = SkillRegistry(
                self.definitions, lambda text: len(rt.prompts.encode_content(text)), rt.fingerprint,
                self.settings.max_skill_tokens, rt.max_positions,
            )
            self.pipeline = ComposePipeline(self.settings, rt, self.registry, self.store, self.engine)
            self.pipeline.use_engine(self._build_engine(self.pipeline))
            self.memories = build_memories(self.settings, rt, self.definitions, self.store, self.engine,
                                           self.pipeline.blocks)
            self.sessions = SessionManager(self.pipeline, self.memories)
            self.sessions.saved.start_sweeper()
            with self.phases("shipped skills: registering and compiling"):
                await self._preload_skills()
            self._ready = True
        except Exception as e:
            log.exception("startup failed")
            self.load_error = f"{type(e).__name__}: {e}"
        finally:
            self.phases.finish(self._ready)

    def _build_engine(self, pipeline: ComposePipeline):
        """What serves prepared requests: vLLM (SKILLCACHE_ENGINE=vllm) or this process's model."""
        if self.settings.engine == "vllm":
            from service.engines.vllm import VllmEngine

            return VllmEngine(self.settings, pipeline.rt)
        from service.engines.embedded import EmbeddedEngine

        return EmbeddedEngine(self.settings, pipeline.rt, self.engine, pipeline.store, pipeline.refiner, pipeline.guard,
                              pipeline.auto)

    async def _build_runtime(self):
        if self.settings.engine == "vllm":  # tokenizer, config, RoPE: vLLM runs the model, no weight is read here
            from service.runtime import build_spec
            from service.vllm.launch import resolve_dtype

            dtype = resolve_dtype(self.settings.vllm_dtype)
            return await asyncio.to_thread(build_spec, self.settings, dtype, self.phases)
        from service.runtime import build_runtime

        # on the engine's thread: it owns torch's threads, and what compiles at load compiles for them
        return await self.engine.run(lambda cancelled: build_runtime(self.settings, self.phases))

    async def _preload_skills(self) -> None:
        folder = self.settings.skills_dir
        if not folder or not Path(folder).is_dir():
            return
        for path in iter_skill_files(Path(folder)):
            try:
                spec = parse_skill_file(path)
                rec, _ = await self.registry.register(
                    DEFAULT_NAMESPACE, spec["name"], spec["text"], spec.get("description"), spec.get("fields"),
                )
                block, _ = await self.pipeline.block_for(DEFAULT_NAMESPACE, rec.default_text)  # embedded: compiled
                # on vLLM: compiled by vLLM once it answers, not on readiness's path
                self.pipeline.compile_skill_soon(DEFAULT_NAMESPACE, block)
                self.preload[rec.name] = {"version": rec.version, "n_tokens": rec.n_tokens}
            except (ServiceError, ValueError, OSError) as e:
                log.error("skill file %s not loaded: %s", path, e)
                self.preload[str(path)] = {"error": str(e)}

    @property
    def ready(self) -> bool:
        return self._ready

    def require_sessions(self) -> SessionManager:
        self.require_pipeline()
        return self.sessions

    def require_memories(self):
        self.require_pipeline()
        return self.memories

    def require_pipeline(self) -> ComposePipeline:
        if self.pipeline is None:
            raise NotReady(self.load_error or "the model is still loading; retry when /readyz says ready")
        return self.pipeline

    async def readiness(self) -> tuple[bool, dict]:
        tiers = await self.store.health()
        definitions_ok = await self.definitions.ping()
        rt = self.runtime
        details = {
            "model": getattr(getattr(rt, "loaded", None), "name", None),
            "model_fingerprint": getattr(rt, "fingerprint", None),
            "model_loaded": rt is not None,
            # where the weights are: this process (embedded engine) or vLLM's (this one reads tokenizer and config)
            "model_weights": None if rt is None else "this process" if rt.holds_weights else "vllm",
            "chat_template": _template_status(rt),
            "selfcheck": self.selfcheck,
            "store": tiers,
            "definitions": "ok" if definitions_ok else "down",
            "skills_preloaded": self.preload,
            "error": self.load_error,
            "engine": self.settings.engine,
            "phase": self.phases.current,  # while not ready: what the start-up is doing
            "startup_s": self.phases.took,
        }
        engine_ok = True
        if self.pipeline is not None:
            engine_ok = await self.pipeline.runner.health()
            metrics.ENGINE_UP.set(1 if engine_ok else 0)
            if not engine_ok:
                details["engine"] = f"{self.settings.engine}: down ({self.settings.vllm_url} does not answer /health)"
        # Redis down after it was up: known skills are served from the read-through cache
        # (store/definitions_cache.py), so stay in rotation rather than take every replica out at once.
        cached = not definitions_ok and getattr(self.definitions, "serves_when_down", False) \
            and getattr(self.definitions, "was_up", False)
        if cached:
            details["definitions"] = "down: serving cached definitions; registration and deletes fail until it is back"
        return self.ready and engine_ok and (definitions_ok or cached), details

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.sessions is not None:
            self.sessions.saved.stop_sweeper()
            await self.sessions.drain()
        if self.pipeline is not None:
            await self.pipeline.runner.close()
        self.engine.stop()
        await self.store.close()
        await self.definitions.close()
