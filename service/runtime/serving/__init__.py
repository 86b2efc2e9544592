"""The serving engine: an iteration-level scheduler over one model thread (batched decode, chunked prefill,
background work in a guaranteed share). scheduler.py decides, runner.py runs the decode batch, engine.py is the
thread, work.py what is scheduled and the request's handle."""

from service.runtime.serving.engine import EngineConfig, ServingEngine

__all__ = ["EngineConfig", "ServingEngine"]
