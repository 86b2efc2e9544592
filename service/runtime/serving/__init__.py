"""The serving loop: an iteration-level scheduler over one model thread (batched decode, chunked prefill,
background work in a guaranteed share). scheduler.py decides, runner.py runs the decode batch, loop.py is the
thread, work.py what is scheduled and the request's handle."""

from service.runtime.serving.loop import EngineConfig, ServingLoop

__all__ = ["EngineConfig", "ServingLoop"]
