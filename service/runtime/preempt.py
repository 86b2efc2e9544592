"""Background forwards that give way between two decoder layers.

A request that arrives while a background step (a 128-token chunk of a calibration, a shadow check or a
refinement: ~250-500 ms at 2.4k tokens of context on this CPU) runs used to wait for all of it, and under load the
live p90 first-token latency sat on those arrivals (docs/BENCHMARKS.md, "Background work under load"). Here a
background step runs in a greenlet on the model thread itself, and a pre-hook on every decoder layer parks it there
as soon as `should_yield()` says live work is waiting: the engine serves that work and resumes the parked forward
later, where it stopped, so an arrival waits for one layer (~10 ms), not a whole step.

Why a greenlet and not a second thread: torch's OpenMP runtime keeps one worker pool per thread that runs parallel
regions, and two pools on two cores put every region of the live decode behind a wake-up (threads.py); a greenlet
is the same OS thread, so both forwards use the model thread's pool. Interleaving is safe because a live forward
always runs to its end: whatever global state it sets (attention.kernel_attention's switch) is restored before the
parked forward continues, and each forward writes only its own cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import greenlet

log = logging.getLogger(__name__)
_PARKED = object()
_running: "Resumable | None" = None  # the background step the model thread is running now (None: live code)


def install(model) -> int:
    """A checkpoint before every decoder layer of `model` (the children of its `...layers` ModuleLists) that has
    none yet; returns how many it added. A model without layers found still works: its background steps run whole."""
    import torch  # when a model is bound: the API imports the serving engine without torch

    layers = [layer for name, module in model.named_modules()
              if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" for layer in module]
    n = 0
    for layer in layers:
        if not getattr(layer, "_skillcache_checkpoint", False):
            layer.register_forward_pre_hook(_checkpoint)
            layer._skillcache_checkpoint = True
            n += 1
    if not layers:
        log.warning("no decoder layers found: background steps will not give way mid-forward")
    return n


def _checkpoint(module, args) -> None:
    r = _running
    if r is not None and r.glet is greenlet.getcurrent() and r.should_yield():
        r.glet.parent.switch(_PARKED)


class Resumable:
    """fn() run in pieces on the calling thread: `run` returns when fn has returned or has parked at a layer
    checkpoint because `should_yield()` was true there; the next `run` continues it."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.glet = greenlet.greenlet(fn)
        self.should_yield: Callable[[], bool] = lambda: False

    @property
    def started(self) -> bool:
        return bool(self.glet)  # a greenlet is true while it has started and not finished

    def run(self, should_yield: Callable[[], bool]) -> tuple[bool, Any]:
        """(True, fn's value) once fn returned, (False, None) while it is parked; fn's exception propagates."""
        global _running
        self.should_yield, _running = should_yield, self
        try:
            out = self.glet.switch()
        finally:
            _running = None
        return (False, None) if out is _PARKED and not self.glet.dead else (True, out)

    def kill(self) -> None:
        """Unwind a parked fn (GreenletExit at its checkpoint; its `finally` blocks run) so it never resumes."""
        if self.started:
            self.glet.throw()
