"""SkillcacheConnector: vLLM loads the composed head skillcache published for a request; vLLM computes the rest.

Loaded by vLLM (it imports this module; the service does not):

    --kv-transfer-config '{"kv_connector": "SkillcacheConnector",
                           "kv_connector_module_path": "service.vllm.connector", "kv_role": "kv_consumer",
                           "kv_connector_extra_config": {"heads_dir": "/dev/shm/skillcache-heads"}}'

The request carries its head's reference in `kv_transfer_params={"skillcache": HeadRef.to_dict()}` and a
`cache_salt` chosen by skillcache (approximate heads never share vLLM's prefix cache with exact requests:
service/vllm/salt.py). Prefix-only: tokens [0, n) come from the head, vLLM computes [n, prompt end).

Scheduler side: get_num_new_matched_tokens checks the record (service/vllm/heads.py: gen, model, layout, the
prompt's ids, the CRC of every chunk it will load) and answers n minus what vLLM already holds; anything that does
not check out answers 0, so vLLM computes those tokens itself. build_connector_meta turns the request's blocks into
slot ids. Worker side: start_load_kv writes each layer's K/V with the attention backend's own cache write
(`impl.do_kv_cache_update`: cpu_attn_reshape_and_cache on the CPU backend, reshape_and_cache_flash on CUDA's
FlashAttention, each packing its own layout), so one path serves both. On CUDA the record is copied host->device
per layer first (`.to(kv_cache.device)`); a pinned staging buffer would overlap it with compute (not done: the CPU
build is what this project runs). If the record changed between the check and the copy (its gen no longer
matches after the write), the request's blocks are reported as load errors and vLLM recomputes them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from service.vllm.heads import HeadError, HeadReader, HeadRef, Layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("skillcache.connector")
DEFAULT_HEADS_DIR = "/dev/shm/skillcache-heads"


@dataclass
class Load:
    ref: dict
    start: int  # tokens [start, n) of the head are written
    slots: list[int]  # one per token, start..n-1


@dataclass
class SkillcacheMeta(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    block_ids: dict[int, list[int]] = field(default_factory=dict)  # load index -> the request's blocks


def head_ref(request: "Request") -> HeadRef | None:
    params = getattr(request, "kv_transfer_params", None) or {}
    d = params.get("skillcache") if isinstance(params, dict) else None
    return HeadRef.from_dict(d) if d else None


def model_layout(vllm_config: "VllmConfig") -> Layout:
    mc = vllm_config.model_config
    dtype = str(vllm_config.cache_config.cache_dtype)
    dtype = str(mc.dtype).removeprefix("torch.") if dtype == "auto" else dtype
    return Layout(mc.get_num_layers(vllm_config.parallel_config), mc.get_total_num_kv_heads(), mc.get_head_size(),
                  dtype)


class SkillcacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        pc = vllm_config.parallel_config
        self._setup(HeadReader(Path(extra.get("heads_dir", DEFAULT_HEADS_DIR))), vllm_config.cache_config.block_size,
                    model_layout(vllm_config), getattr(pc, "rank", 0), pc.tensor_parallel_size)

    def _setup(self, reader: HeadReader, block_size: int, layout: Layout, tp_rank: int = 0, tp_size: int = 1) -> None:
        """The connector's own state (apart from vLLM's config: the tests build it with this alone)."""
        self.reader, self.block_size, self.layout = reader, block_size, layout
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._connector_metadata = None
        self._matched: dict[str, tuple[HeadRef, int]] = {}  # request id -> (head, first token to load)
        self._to_load: dict[str, tuple[HeadRef, int]] = {}  # allocated, waiting for build_connector_meta
        self._failed_blocks: set[int] = set()
        self.n_rejected = 0  # heads that did not check out (logged; skillcache counts them from usage)

    # ---- scheduler side --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        try:
            ref = head_ref(request)
            if ref is None or ref.n_tokens <= num_computed_tokens:
                return 0, False
            self.reader.open(ref, request.prompt_token_ids or [], self.layout, lo=num_computed_tokens)
        except HeadError as e:
            self.n_rejected += 1
            log.warning("skillcache head for %s not used (vLLM computes it): %s", request.request_id, e)
            return 0, False
        self._matched[request.request_id] = (ref, num_computed_tokens)
        return ref.n_tokens - num_computed_tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if matched is not None and num_external_tokens > 0:
            ref, _ = matched
            self._to_load[request.request_id] = (ref, ref.n_tokens - num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = SkillcacheMeta()
        blocks_of: dict[str, list[int]] = {r.req_id: r.block_ids[0] for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # resumed after preemption: new_block_ids holds all its blocks
            if req_id in self._to_load and req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                blocks_of[req_id] = cached.new_block_ids[i][0]
        for req_id in [r for r in self._to_load if r in blocks_of]:
            ref, start = self._to_load.pop(req_id)
            block_ids = blocks_of[req_id]
            bs = self.block_size
            slots = [block_ids[t // bs] * bs + t % bs for t in range(start, ref.n_tokens)]
            meta.block_ids[len(meta.loads)] = block_ids[start // bs:-(-ref.n_tokens // bs)]
            meta.loads.append(Load(ref.to_dict(), start, slots))
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        self._matched.pop(request.request_id, None)
        self._to_load.pop(request.request_id, None)
        return False, None

    # ---- worker side -----------------------------------------------------------------------
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SkillcacheMeta) or not meta.loads:
            return
        from vllm.model_executor.models.utils import extract_layer_index

        layers = [(name, layer) for name, layer in forward_context.no_compile_layers.items()
                  if getattr(layer, "kv_cache", None) is not None and hasattr(layer, "impl")]
        h_per_rank = self.layout.n_kv_heads // max(1, self.tp_size)
        heads = slice(self.tp_rank * h_per_rank, (self.tp_rank + 1) * h_per_rank)
        for i, load in enumerate(meta.loads):
            ref = HeadRef.from_dict(load.ref)
            try:
                m = self.reader.map_checked(ref, self.layout)
                for name, layer in layers:
                    cache = layer.kv_cache[0] if isinstance(layer.kv_cache, list) else layer.kv_cache
                    li = extract_layer_index(name)
                    dt, dev = cache.dtype, cache.device
                    k = m.keys[li, load.start:ref.n_tokens, heads].to(dev, dt)  # [T, H_kv/tp, D]
                    v = m.values[li, load.start:ref.n_tokens, heads].to(dev, dt)
                    slots = torch.tensor(load.slots, dtype=torch.int64, device=dev)
                    layer.impl.do_kv_cache_update(layer, k, v, cache, slots)
                self.reader.header(ref)  # still the same record after the copy
            except HeadError as e:
                log.warning("skillcache head changed while loading; vLLM recomputes its blocks: %s", e)
                self._failed_blocks.update(meta.block_ids.get(i, []))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
