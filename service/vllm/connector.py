"""SkillcacheConnector: inside vLLM, it moves and rotates K/V; vLLM computes every token that is computed.

Loaded by vLLM (it imports this module; the service does not):

    --kv-transfer-config '{"kv_connector": "SkillcacheConnector",
                           "kv_connector_module_path": "service.vllm.connector", "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"spans_dir": "/dev/shm/skillcache-spans"}}'

A request names what to copy and what to keep in `kv_transfer_params={"skillcache": Transfer.to_dict()}`
(service/vllm/transfer.py): pieces of saved spans that tile its prompt's first n tokens, and a span of its own tokens
to save. skillcache plans them (service/engines/vllm.py); the connector checks and carries them out:

Scheduler side: get_num_new_matched_tokens answers the pieces' tokens beyond vLLM's own prefix hit, up to the first
piece whose record is missing or whose ids are not the prompt's (vLLM computes from there: prefix-only, nothing wrong
is loaded). build_connector_meta turns the request's blocks into slots (service/vllm/connector_meta.py), per KV cache
group: the connector declares SupportsHMA, so vLLM keeps its hybrid KV cache manager, and a sliding-window model
(Gemma-3) has groups that keep only their window; a load writes a group only where it keeps blocks, and a save is
read in parts, each in the step vLLM computes it, and written after its last.
Worker side: start_load_kv reads each piece's record (this rank's heads, service/vllm/spans.py), re-rotates its keys
by the piece's move with the project's rotary code (service/kv/rope.py, built from vLLM's model config), and writes
them with the attention backend's own cache write (`impl.do_kv_cache_update`), whatever layout it packs.
save_kv_layer reads the save span's slots back out of each layer's cache (service/vllm/paged.py learns the layout
from the same write) and wait_for_save writes the record. A record that fails its check while loading reports the
request's blocks as load errors: vLLM recomputes them (kv_load_failure_policy "recompute").
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from service.vllm import compat
from service.vllm.connector_meta import NULL, Load, Pending, SkillcacheMeta, plan_step, transfer_of
from service.vllm.paged import LayoutError, SlotIndex, learn, write_piece
from service.vllm.spans import SpanError, SpanStore, model_key, remote_tier
from service.vllm.transfer import Transfer, TransferError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.skillcache.connector")  # under vLLM's logger: its handler, level and format
DEFAULT_SPANS_DIR = "/dev/shm/skillcache-spans"
MAX_PARTIAL = 64  # spans read in part (a chunked prefill), awaiting their last part (worker side)
DEFAULT_MAX_BYTES = 1024**3  # a rank's records on disk; least recently used out first (steps of old orders, blocks)


class SkillcacheConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        dtype = str(vllm_config.cache_config.cache_dtype)
        dtype = str(mc.dtype).removeprefix("torch.") if dtype == "auto" else dtype
        key = model_key(str(mc.model), dtype, mc.get_num_layers(pc), mc.get_total_num_kv_heads(), mc.get_head_size())
        store = SpanStore(Path(extra.get("spans_dir", DEFAULT_SPANS_DIR)), key, _tp_rank(role, pc),
                          pc.tensor_parallel_size, int(extra.get("cache_bytes", 512 * 1024**2)),
                          int(extra.get("max_bytes", DEFAULT_MAX_BYTES)),
                          remote_tier(extra))
        self._setup(store, vllm_config.cache_config.block_size, lambda: _rotator(mc.hf_config))
        if role == KVConnectorRole.SCHEDULER:  # one line per server, not one per rank
            line = compat.outside(compat.installed())
            if line:
                log.warning("skillcache: %s", line)
        self.off = compat.api_problems(type(self))
        if self.off:
            log.warning("skillcache connector off, vLLM computes every token: %s", "; ".join(self.off))

    def _setup(self, store: SpanStore, block_size: int, rotator_fn) -> None:
        """The connector's own state (apart from vLLM's config: the tests build it with this alone)."""
        self.store, self.block_size = store, block_size
        self._rotator_fn, self._rotator = rotator_fn, None
        self._connector_metadata = None
        self._matched: dict[str, tuple[Transfer, int]] = {}  # request id -> (transfer, tokens it can supply)
        self._to_load: dict[str, tuple[Transfer, int, int]] = {}  # allocated: [start, end) to load
        self._saves: dict[str, Pending] = {}
        self._failed_blocks: set[int] = set()
        self._index: dict[tuple, SlotIndex] = {}  # learned cache layouts
        self._saving: dict[int, list] = {}  # save job -> per layer (index, k, v, tokens freed), this step
        self.n_rejected = 0
        self._group_of: dict[str, int] | None = None  # layer name -> KV cache group (worker side, learned once)
        self._parts: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}  # a span's parts read so far
        self.off: list[str] = []  # what of vLLM's API is not what the connector reads (service/vllm/compat.py)

    # ---- scheduler side --------------------------------------------------------------------
    def _available(self, t: Transfer, prompt: list[int]) -> int:
        """Tokens [0, n) the pieces can supply for `prompt`: up to the first piece that does not check out."""
        n = 0
        for p in t.load:
            try:
                if not self.store.exists(p.name):
                    raise SpanError(f"span {p.name!r} is not saved")
                pos, ids = self.store.header(p.name)
                if not (pos <= p.lo and p.hi <= pos + len(ids)) or ids[p.lo - pos:p.hi - pos] != prompt[p.at:p.end]:
                    raise SpanError(f"span {p.name!r} holds other tokens than the prompt's {p.at}..{p.end}")
            except SpanError as e:
                self.n_rejected += 1
                log.warning("skillcache: %s; vLLM computes from token %d", e, n)
                break
            n = p.end
        return min(n, len(prompt) - 1)  # vLLM computes at least the last prompt token

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        try:
            t = transfer_of(request)
        except TransferError as e:
            log.warning("skillcache transfer of %s ignored: %s", request.request_id, e)
            return 0, False
        if t is None or self.off:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        if t.save is not None and request.request_id not in self._saves and t.save.hi <= len(prompt):
            self._saves[request.request_id] = Pending(t.save.name, t.save.lo, t.save.hi, prompt[t.save.lo:t.save.hi])
        n = self._available(t, prompt) if t.n_load > num_computed_tokens else 0
        if n <= num_computed_tokens:
            return 0, False
        self._matched[request.request_id] = (t, n)
        return n - num_computed_tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if matched is not None and num_external_tokens > 0:
            t, n = matched
            self._to_load[request.request_id] = (t, n - num_external_tokens, n)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if self.off:
            return SkillcacheMeta()
        return plan_step(scheduler_output, self._to_load, self._saves, self.block_size)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        for d in (self._matched, self._to_load, self._saves):
            d.pop(request.request_id, None)  # type: ignore[attr-defined]
        return False, None

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict | None]:
        """SupportsHMA: vLLM keeps its hybrid KV cache manager on (sliding-window layers keep only their window)."""
        return self.request_finished(request, [])

    # ---- worker side -----------------------------------------------------------------------
    @property
    def rotator(self):
        if self._rotator is None:
            self._rotator = self._rotator_fn()
        return self._rotator

    def _group(self, name: str) -> int:
        """The KV cache group of a layer (vLLM's hybrid KV cache manager gives sliding-window layers their own)."""
        if self._group_of is None:
            cfg = getattr(self, "_kv_cache_config", None)
            groups = getattr(cfg, "kv_cache_groups", None) or []
            self._group_of = {n: g for g, group in enumerate(groups) for n in group.layer_names}
            log.info("skillcache connector: %d KV cache groups", max(1, len(groups)))
        return self._group_of.get(name, 0)

    def _layers(self, forward_context: "ForwardContext") -> list[tuple[int, int, Any]]:
        """(layer index, KV cache group, layer) of each attention layer with a cache."""
        from vllm.model_executor.models.utils import extract_layer_index

        return [(extract_layer_index(name), self._group(name), layer)
                for name, layer in forward_context.no_compile_layers.items()
                if getattr(layer, "kv_cache", None) is not None and hasattr(layer, "impl")]

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SkillcacheMeta) or not meta.loads:
            return
        layers = self._layers(forward_context)
        for load in meta.loads:
            try:
                self._load(load, layers)
            except (SpanError, ValueError, RuntimeError) as e:
                log.warning("skillcache spans did not load; vLLM recomputes their blocks: %s", e)
                self._failed_blocks.update(load.block_ids)

    def _load(self, load: Load, layers: list[tuple[int, int, Any]]) -> None:
        at = 0
        for p in load.pieces:
            span = self.store.load(p.name)
            a, b = p.lo - span.pos, p.hi - span.pos
            if a < 0 or b > len(span.ids):
                raise SpanError(f"span {p.name!r} does not hold positions {p.lo}..{p.hi}")
            slots_of = [torch.tensor(g[at:at + b - a], dtype=torch.int64) for g in load.slots]
            at += b - a
            for li, g, layer in layers:
                cache = layer.kv_cache[0] if isinstance(layer.kv_cache, list) else layer.kv_cache
                write = lambda k, v, c, s, layer=layer: layer.impl.do_kv_cache_update(layer, k, v, c, s)  # noqa: E731
                slots, k, v = slots_of[g], span.k[li, a:b], span.v[li, a:b]  # [T, H, D] this rank's heads
                kept = slots != NULL  # a sliding window's group keeps only the tokens in its window
                if not bool(kept.all()):
                    slots, k, v = slots[kept], k[kept], v[kept]
                if span.valid is not None and len(slots):  # the record lacks this layer's K/V before valid[li]
                    first = p.lo + int(kept.nonzero()[0, 0])
                    if first < span.valid[li]:
                        raise SpanError(f"span {p.name!r} holds layer {li} from position {span.valid[li]}, "
                                        f"not {first}")
                if len(slots):
                    write_piece(self.rotator, li, k, v, p.delta, cache, slots, write)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def _slot_index(self, layer: Any, cache: torch.Tensor) -> SlotIndex:
        n_heads, head_dim = int(layer.num_kv_heads), int(layer.head_size)
        key = (tuple(cache.shape), cache.dtype, str(getattr(layer, "isa", "")), type(layer.impl).__name__)
        if key not in self._index:
            write = lambda k, v, c, s: layer.impl.do_kv_cache_update(layer, k, v, c, s)  # noqa: E731
            cfg = getattr(self, "_kv_cache_config", None)  # [2, blocks, ...] on CUDA, [blocks, ...] on CPU
            num_blocks = int(getattr(cfg, "num_blocks", 0) or cache.shape[0])
            self._index[key] = learn(cache, num_blocks, self.block_size, n_heads, head_dim, write)
        return self._index[key]

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SkillcacheMeta) or not meta.saves:
            return
        from vllm.forward_context import get_forward_context
        from vllm.model_executor.models.utils import extract_layer_index

        layer = get_forward_context().no_compile_layers[layer_name]
        li, g = extract_layer_index(layer_name), self._group(layer_name)
        cache = kv_layer[0] if isinstance(kv_layer, list) else kv_layer
        try:
            index = self._slot_index(layer, cache)
        except LayoutError as e:
            log.warning("skillcache cannot read this cache back (nothing is saved): %s", e)
            return
        for j, job in enumerate(meta.saves):
            slots = job.slots[g]
            skip = next((i for i, s in enumerate(slots) if s != NULL), len(slots))  # freed behind a window
            got = self._saving.setdefault(j, [])
            if NULL in slots[skip:]:
                got.append((li, None, None, skip))  # not a window's prefix: this part cannot be read
                continue
            k, v = index.gather(cache, torch.tensor(slots[skip:], dtype=torch.int64, device=cache.device))
            if skip:  # zeros where the window freed them; the record says the layer holds its K/V from past them
                k = torch.cat([k.new_zeros((skip, *k.shape[1:])), k])
                v = torch.cat([v.new_zeros((skip, *v.shape[1:])), v])
            got.append((li, k.cpu(), v.cpu(), skip))

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        saving, self._saving = self._saving, {}
        if not isinstance(meta, SkillcacheMeta):
            return
        for j, got in saving.items():
            job = meta.saves[j]
            got.sort(key=lambda x: x[0])
            parts = self._parts.pop(job.name, []) if job.at > job.lo else []
            if any(k is None for _, k, _, _ in got):
                log.warning("skillcache span %r not saved: vLLM freed K/V of it before it was read", job.name)
                continue
            k = torch.stack([k for _, k, _, _ in got])  # [L, T_part, H, D]
            v = torch.stack([v for _, _, v, _ in got])
            parts.append((job.at, k, v, [skip for *_, skip in got]))
            if not job.last:
                self._parts[job.name] = parts
                while len(self._parts) > MAX_PARTIAL:  # a request that ended before its span did: dropped
                    self._parts.pop(next(iter(self._parts)))
                continue
            if parts[0][0] != job.lo or sum(p[1].shape[1] for p in parts) != len(job.ids) or \
                    any(any(p[3]) for p in parts[1:]):
                log.warning("skillcache span %r not saved: parts of it were not read", job.name)
                continue
            k = torch.cat([p[1] for p in parts], dim=1)  # [L, T, H, D]
            v = torch.cat([p[2] for p in parts], dim=1)
            try:
                self.store.save(job.name, job.lo, job.ids, k, v, [job.lo + skip for skip in parts[0][3]])
            except (SpanError, OSError) as e:  # a refused name, a full disk: nothing saved, vLLM goes on
                log.warning("skillcache span %r not saved: %s", job.name, e)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed


def _tp_rank(role: KVConnectorRole, pc: Any) -> int:
    """This worker's tensor-parallel rank: which K/V heads its cache holds and its records name (`.tp<size>r<rank>`).
    Each rank saves and loads its own heads; where vLLM has fewer K/V heads than ranks it replicates them (rank r holds
    head r // (size / heads)), and each rank saves its copy. The scheduler side reads rank 0's headers only."""
    if role != KVConnectorRole.WORKER:
        return 0
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _rotator(hf_config):
    from service.runtime.adapters import rotator_for_config

    return rotator_for_config(hf_config)
