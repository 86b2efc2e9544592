"""The connector's own logic, run inside vLLM's venv (tests/engines_vllm/test_connector.py runs this file there):
what it answers the scheduler, which slots it loads and saves, how it rotates, what it refuses, and reading K/V back
out of a paged cache (service/vllm/paged.py). vLLM's objects are stand-ins with the attributes the connector reads;
the cache writes are a plain one and the CPU backend's own (vllm._custom_ops.cpu_attn_reshape_and_cache)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import vllm.forward_context
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

from service.vllm import compat
from service.vllm.connector import SkillcacheConnector
from service.vllm.paged import LayoutError, learn
from service.vllm.spans import SpanStore
from service.vllm.transfer import Piece, Save, Transfer

BS, L, H, D = 16, 2, 2, 32
P = list(range(100, 160))  # the prompt: 60 tokens
TWO = Transfer((Piece("blk-a", 0, 20, 0), Piece("blk-b", 4, 24, 20)))  # blk-b's tokens move by 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def kv(t: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, t, H, D, generator=g).to(dtype), torch.randn(L, t, H, D, generator=g).to(dtype)


@pytest.fixture(scope="module")
def rotator():
    from transformers import LlamaConfig

    from service.runtime.adapters import rotator_for_config

    return rotator_for_config(LlamaConfig(vocab_size=300, hidden_size=H * D, intermediate_size=64, num_hidden_layers=L,
                                          num_attention_heads=H, num_key_value_heads=H, head_dim=D))


def connector(tmp_path, bs: int = BS, rot=None) -> SkillcacheConnector:
    c = SkillcacheConnector.__new__(SkillcacheConnector)
    c._setup(SpanStore(tmp_path, "m"), bs, lambda: rot)
    return c


@pytest.fixture
def records(tmp_path):
    s = SpanStore(tmp_path, "m")
    a, b = kv(20, 1), kv(20, 2)
    s.save("blk-a", 0, P[:20], *a)
    s.save("blk-b", 4, P[20:40], *b)
    return s, a, b


def request(rid: str, ids: list[int], t: Transfer | None = None, params=None):
    return SimpleNamespace(request_id=rid, prompt_token_ids=ids,
                           kv_transfer_params={"skillcache": t.to_dict()} if t is not None else params)


def groups(blocks) -> tuple[list[int], ...]:
    """A request's blocks per KV cache group: a list is one group, a tuple of lists one per group (HMA)."""
    return blocks if isinstance(blocks, tuple) else (blocks,)


def step(c, new=(), cached=(), resumed=()):
    """One scheduler step: new = [(req, blocks, computed, scheduled)], cached = [(req, new_blocks, computed, sched)]."""
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=groups(b), num_computed_tokens=n)
                            for r, b, n, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r.request_id for r, *_ in cached], resumed_req_ids=set(resumed),
                                              new_block_ids=[groups(b) if b is not None else None
                                                             for _, b, _, _ in cached],
                                              num_computed_tokens=[n for _, _, n, _ in cached]),
        num_scheduled_tokens={r.request_id: s for r, _, _, s in [*new, *cached]})
    return c.build_connector_meta(out)


def slots(blocks: list[int], lo: int, hi: int, bs: int = BS) -> list[int]:
    return [blocks[i // bs] * bs + i % bs for i in range(lo, hi)]


# ---- scheduler side ---------------------------------------------------------------------------


def test_the_pieces_tokens_beyond_the_computed_ones_are_answered(tmp_path, records):
    c, r = connector(tmp_path), request("r", P, TWO)
    assert c.get_num_new_matched_tokens(r, 0) == (40, False)
    assert c.get_num_new_matched_tokens(r, 16) == (24, False)  # vLLM's prefix cache holds one block already
    assert c.get_num_new_matched_tokens(r, 40) == (0, False)
    assert c.get_num_new_matched_tokens(r, 48) == (0, False)
    assert c.get_num_new_matched_tokens(request("w", P[:40], TWO), 0) == (39, False)  # never the whole prompt
    assert c.get_num_new_matched_tokens(request("x", P[:41], TWO), 0) == (40, False)


@pytest.mark.parametrize("case, n", [("first missing", 0), ("second missing", 20), ("first other ids", 0),
                                     ("second other ids", 20), ("second cut", 20), ("beyond the record", 20)])
def test_the_answer_stops_at_the_first_piece_that_does_not_check_out(tmp_path, records, case, n):
    s, *_ = records
    ids, t = list(P), TWO
    if case.endswith("missing"):
        s.path("blk-a" if case.startswith("first") else "blk-b").unlink()
    elif case.endswith("other ids"):
        ids[3 if case.startswith("first") else 30] = 7
    elif case == "second cut":
        s.path("blk-b").write_bytes(s.path("blk-b").read_bytes()[:-20])
    else:
        t = Transfer((TWO.load[0], Piece("blk-b", 4, 30, 20)))  # the record holds positions 4..23 only
    assert connector(tmp_path).get_num_new_matched_tokens(request("r", ids, t), 0) == (n, False)


@pytest.mark.parametrize("params", [None, {}, {"other": 1}, {"skillcache": None}, {"skillcache": "garbage"},
                                    {"skillcache": {"load": [["blk-a", 0, 20, 3]]}},
                                    {"skillcache": {"load": [["blk-a", 0, 10, 0], ["blk-b", 4, 24, 20]]}},
                                    {"skillcache": {"load": [["blk-a", 0, 20]]}}, {"skillcache": {"save": ["s", 1]}},
                                    {"skillcache": {"load": 5}}, "not a dict"])
def test_no_or_bad_transfer_params_are_no_match_and_nothing_to_do(tmp_path, records, params):
    c, r = connector(tmp_path), request("r", P, params=params)
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    c.update_state_after_alloc(r, None, 0)
    meta = step(c, new=[(r, [1, 2, 3, 4], 0, 60)])
    assert meta.loads == [] and meta.saves == []


# ---- build_connector_meta ---------------------------------------------------------------------------


@pytest.mark.parametrize("computed, pieces, block_ids", [
    (16, [Piece("blk-a", 16, 20, 16), Piece("blk-b", 4, 24, 20)], [3, 9]),
    (32, [Piece("blk-b", 16, 24, 32)], [9]),
])
def test_a_load_maps_its_tokens_into_the_requests_blocks(tmp_path, records, computed, pieces, block_ids):
    c, r = connector(tmp_path), request("r", P, TWO)
    c.get_num_new_matched_tokens(r, computed)
    c.update_state_after_alloc(r, None, 40 - computed)
    meta = step(c, new=[(r, [7, 3, 9, 4], 40, 20)])
    (load,) = meta.loads
    assert load.pieces == pieces and load.block_ids == block_ids
    assert load.slots == [slots([7, 3, 9, 4], computed, 40)]  # one KV cache group
    assert step(c, cached=[(r, None, 60, 1)]).loads == []  # loaded once
    c.get_num_new_matched_tokens(r2 := request("r2", P, TWO), 0)
    c.update_state_after_alloc(r2, None, 0)  # vLLM took none of them
    assert step(c, new=[(r2, [1, 2, 5, 6], 0, 60)]).loads == []


def test_a_save_is_read_as_vllm_computes_it_and_written_after_its_last_token(tmp_path):
    c, r = connector(tmp_path), request("r", P[:40], Transfer(save=Save("s", 10, 40)))
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    (first,) = step(c, new=[(r, [2, 5], 0, 20)]).saves  # a chunked prefill: tokens 0..19 this step
    assert (first.name, first.lo, first.ids, first.at, first.last) == ("s", 10, P[10:40], 10, False)
    assert first.slots == [slots([2, 5], 10, 20)]
    (job,) = step(c, cached=[(r, [8], 20, 20)]).saves  # the second chunk brings block 8 and completes the span
    assert (job.at, job.last) == (20, True) and job.slots == [slots([2, 5, 8], 20, 40)]
    assert step(c, cached=[(r, None, 40, 1)]).saves == []  # saved once


def test_a_resumed_request_saves_from_its_new_blocks(tmp_path):
    c, r = connector(tmp_path), request("r", P[:40], Transfer(save=Save("s", 0, 40)))
    c.get_num_new_matched_tokens(r, 0)
    (first,) = step(c, new=[(r, [2, 5], 0, 20)]).saves
    assert first.slots == [slots([2, 5], 0, 20)]
    (job,) = step(c, cached=[(r, [6, 1, 4], 20, 20)], resumed=["r"]).saves  # preempted: all its blocks anew
    assert (job.at, job.last) == (20, True) and job.slots == [slots([6, 1, 4], 20, 40)]


def test_request_finished_clears_the_requests_load_and_save(tmp_path, records):
    c, r = connector(tmp_path), request("r", P, Transfer(TWO.load, Save("s", 40, 50)))
    assert c.get_num_new_matched_tokens(r, 0) == (40, False)
    c.update_state_after_alloc(r, None, 40)
    assert c.request_finished(r, [7, 3, 9, 4]) == (False, None)
    meta = step(c, new=[(r, [7, 3, 9, 4], 40, 20)])
    assert meta.loads == [] and meta.saves == []


# ---- worker side --------------------------------------------------------------------------------


class PlainLayer:
    """An attention layer as the worker sees it; its backend's write is a plain [blocks, k|v, bs, H, D] layout."""

    def __init__(self, blocks: int = 10, bs: int = BS, heads: int = H) -> None:
        self.kv_cache, self.impl = torch.zeros(blocks, 2, bs, heads, D), self
        self.num_kv_heads, self.head_size = heads, D
        self.written: list = []

    def do_kv_cache_update(self, layer, k, v, cache, slot_mapping) -> None:  # [T, H, D] x2, [T]
        self.written.append((k.clone(), v.clone(), slot_mapping.tolist()))
        bs = cache.shape[2]
        cache[slot_mapping // bs, 0, slot_mapping % bs] = k
        cache[slot_mapping // bs, 1, slot_mapping % bs] = v


def test_the_load_writes_each_layer_with_keys_re_rotated_by_the_pieces_move(tmp_path, records, rotator):
    _, (ka, va), (kb, vb) = records
    c, r = connector(tmp_path, rot=rotator), request("r", P, TWO)
    layers = {NAMES[1]: PlainLayer(), NAMES[0]: PlainLayer()}  # the layer index is read from the name
    assert c.get_num_new_matched_tokens(r, 0) == (40, False)
    c.update_state_after_alloc(r, None, 40)
    c.bind_connector_metadata(step(c, new=[(r, [7, 3, 9, 4], 40, 20)]))
    c.start_load_kv(SimpleNamespace(no_compile_layers=layers))
    for name, layer in layers.items():
        li = int(name.split(".")[2])
        (k0, v0, s0), (k1, v1, s1) = layer.written
        assert torch.equal(k0, ka[li]) and torch.equal(v0, va[li]) and s0 == slots([7, 3, 9, 4], 0, 20)
        moved = rotator.rotate(kb[li].transpose(0, 1)[None], 16, li)[0].transpose(0, 1)
        assert torch.equal(k1, moved) and not torch.allclose(k1, kb[li], atol=1e-3)
        assert torch.equal(v1, vb[li]) and s1 == slots([7, 3, 9, 4], 20, 40)
    assert c.get_block_ids_with_load_errors() == set()


@pytest.mark.parametrize("damage", ["flip a byte", "cut", "other tensors"])
def test_a_record_that_fails_its_check_at_load_reports_the_loads_blocks(tmp_path, records, damage):
    s, _, b = records
    c, r = connector(tmp_path), request("r", P, TWO)
    assert c.get_num_new_matched_tokens(r, 0) == (40, False)  # checked here, damaged before the worker reads it
    path, raw = s.path("blk-b"), bytearray(s.path("blk-b").read_bytes())
    if damage == "flip a byte":
        raw[-5] ^= 0x10
        path.write_bytes(bytes(raw))
    elif damage == "cut":
        path.write_bytes(bytes(raw[: len(raw) // 2]))
    else:
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        save_file({"k": b[0] + 1, "v": b[1]}, str(path), metadata=meta)
    c.update_state_after_alloc(r, None, 40)
    c.bind_connector_metadata(step(c, new=[(r, [7, 3, 9, 4], 40, 20)]))
    c.start_load_kv(SimpleNamespace(no_compile_layers={NAMES[0]: PlainLayer()}))
    assert c.get_block_ids_with_load_errors() == {7, 3, 9}  # vLLM recomputes them
    assert c.get_block_ids_with_load_errors() == set()


# ---- save round trip and reading the paged cache back ----------------------------------------------

ISAS = [(isa, dt) for isa in ("vec", "vec16", "amx") for dt in (torch.float32, torch.bfloat16)]


class CpuLayer:
    """A layer on vLLM's CPU backend: its cache [blocks, H, bs, 2D] and the backend's own do_kv_cache_update."""

    def __init__(self, isa: str, dtype, blocks: int = 6, bs: int = 32, heads: int = H, dim: int = D) -> None:
        self.kv_cache = torch.zeros(blocks, heads, bs, 2 * dim, dtype=dtype)
        self.isa, self._k_scale_float, self._v_scale_float = isa, 1.0, 1.0
        self.num_kv_heads, self.head_size = heads, dim
        self.impl = CPUAttentionBackendImpl.__new__(CPUAttentionBackendImpl)
        self.impl.attn_type, self.impl.kv_cache_dtype = AttentionType.DECODER, "auto"


def save_round_trip(tmp_path, monkeypatch, layers, bs: int, blocks: list[int], dtype=torch.float32):
    c, r = connector(tmp_path, bs=bs), request("r", P, Transfer(save=Save("s", 8, 60)))
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    meta = step(c, new=[(r, blocks, 0, 60)])
    k, v = kv(60, 7, dtype)
    for li, name in enumerate(NAMES):  # what vLLM's forward writes, layer by layer
        layer = layers[name]
        layer.impl.do_kv_cache_update(layer, k[li], v[li], layer.kv_cache, torch.tensor(slots(blocks, 0, 60, bs)))
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: SimpleNamespace(no_compile_layers=layers))
    c.bind_connector_metadata(meta)
    for name in reversed(NAMES):
        c.save_kv_layer(name, layers[name].kv_cache, None)
    c.wait_for_save()
    span = SpanStore(tmp_path, "m").load("s")
    assert (span.pos, span.ids) == (8, P[8:60]) and span.k.dtype == dtype
    assert torch.equal(span.k, k[:, 8:]) and torch.equal(span.v, v[:, 8:])


def test_a_save_reads_its_slots_back_from_a_plain_layout(tmp_path, monkeypatch):
    save_round_trip(tmp_path, monkeypatch, {n: PlainLayer() for n in NAMES}, BS, [3, 1, 6, 8])


def test_a_save_under_a_refused_name_is_skipped_and_the_steps_other_saves_are_written(tmp_path, monkeypatch):
    c, layers = connector(tmp_path), {n: PlainLayer() for n in NAMES}
    bad, good = (request(r, P, Transfer(save=Save(name, 0, 16))) for r, name in (("a", "../evil"), ("b", "ok")))
    for r in (bad, good):
        c.get_num_new_matched_tokens(r, 0)
    meta = step(c, new=[(bad, [1], 0, 16), (good, [2], 0, 16)])
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: SimpleNamespace(no_compile_layers=layers))
    c.bind_connector_metadata(meta)
    for name in NAMES:
        c.save_kv_layer(name, layers[name].kv_cache, None)
    c.wait_for_save()  # does not raise: a request's parameters cannot stop vLLM's worker
    assert SpanStore(tmp_path, "m").load("ok").ids == P[:16] and not (tmp_path / "evil.tp1r0.safetensors").exists()


@pytest.mark.parametrize("isa, dtype", ISAS)
def test_a_save_reads_its_slots_back_from_the_cpu_backends_cache(tmp_path, monkeypatch, isa, dtype):
    save_round_trip(tmp_path, monkeypatch, {n: CpuLayer(isa, dtype) for n in NAMES}, 32, [4, 1], dtype)


def check_gather(cache, index, write, bs: int, dtype) -> None:
    n, (_, heads, dim) = cache.shape[index.block_dim] * bs, index.keys.shape
    g = torch.Generator().manual_seed(3)
    order = torch.randperm(n, generator=g)
    k, v = torch.randn(n, heads, dim, generator=g).to(dtype), torch.randn(n, heads, dim, generator=g).to(dtype)
    write(k, v, cache, order)  # token i of k/v into slot order[i]
    some = torch.randperm(n, generator=g)[: n // 2]
    gk, gv = index.gather(cache, order[some])
    assert torch.equal(gk, k[some]) and torch.equal(gv, v[some])


@pytest.mark.parametrize("isa, dtype", ISAS)
def test_the_learned_layout_is_exact_for_the_cpu_write(isa, dtype):
    layer = CpuLayer(isa, dtype, blocks=5)
    write = lambda k, v, c, s: layer.impl.do_kv_cache_update(layer, k, v, c, s)  # noqa: E731
    index = learn(layer.kv_cache, 5, 32, H, D, write)
    assert index.block_dim == 0
    check_gather(layer.kv_cache, index, write, 32, dtype)


def flash_write(k, v, cache, s):  # [2, blocks, bs, H, D], as CUDA's FlashAttention keeps it
    cache[0].view(-1, *cache.shape[-2:])[s] = k
    cache[1].view(-1, *cache.shape[-2:])[s] = v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_learned_layout_is_exact_for_a_flash_attention_like_layout(dtype):
    cache = torch.zeros(2, 7, BS, H, D, dtype=dtype)
    index = learn(cache, 7, BS, H, D, flash_write)
    assert index.block_dim == 1
    check_gather(cache, index, flash_write, BS, dtype)


drop_half = lambda k, v, c, s: flash_write(k[:len(s) // 2], v[:len(s) // 2], c, s[:len(s) // 2])  # noqa: E731
one_head = lambda k, v, c, s: flash_write(k[:, :1].expand_as(k), v[:, :1].expand_as(v), c, s)  # noqa: E731


@pytest.mark.parametrize("dtype, write", [(torch.float8_e4m3fn, flash_write), (torch.int8, flash_write),
                                          (torch.float32, drop_half), (torch.float32, one_head)])  # one_head: collide
def test_a_layout_that_cannot_be_learned_is_a_layout_error(dtype, write):
    with pytest.raises(LayoutError):
        learn(torch.zeros(2, 7, BS, H, D, dtype=dtype), 7, BS, H, D, write)


@pytest.mark.parametrize("isa, dtype", [("vec", torch.bfloat16), ("amx", torch.bfloat16), ("vec", torch.float32)])
def test_a_head_dim_of_256_is_learned_exactly(isa, dtype):  # Gemma-3's: codes up to 256, exact in bfloat16
    layer = CpuLayer(isa, dtype, blocks=3, bs=32, heads=1, dim=256)
    write = lambda k, v, c, s: layer.impl.do_kv_cache_update(layer, k, v, c, s)  # noqa: E731
    index = learn(layer.kv_cache, 3, 32, 1, 256, write)
    check_gather(layer.kv_cache, index, write, 32, dtype)
    cache = torch.zeros(2, 3, 32, 1, 256, dtype=dtype)
    check_gather(cache, learn(cache, 3, 32, 1, 256, flash_write), flash_write, 32, dtype)


# ---- tensor parallelism: each rank saves and loads its own K/V heads ------------------------------------------------


def test_the_scheduler_side_is_rank_0_and_a_worker_its_tensor_parallel_rank(monkeypatch):
    import vllm.distributed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from service.vllm.connector import _tp_rank

    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda: 2)
    assert _tp_rank(KVConnectorRole.SCHEDULER, SimpleNamespace(rank=5)) == 0  # it reads rank 0's headers only
    assert _tp_rank(KVConnectorRole.WORKER, SimpleNamespace(rank=5)) == 2


@pytest.mark.parametrize("kv_heads", [2, 1])  # 2: a head per rank (split); 1: vLLM replicates it on both ranks
def test_tp_ranks_save_and_load_their_own_heads_and_the_scheduler_wants_every_ranks_record(tmp_path, monkeypatch,
                                                                                             rotator, kv_heads):
    tp = 2
    head_of = lambda rank: rank * kv_heads // tp  # noqa: E731 - vLLM's: rank r holds head r // (tp / kv_heads)
    full = {"blk-a": kv(20, 1), "blk-b": kv(20, 2)}  # the whole model's K/V ([L, T, 2, D]), sliced per rank
    ids = {"blk-a": (0, P[:20]), "blk-b": (4, P[20:40])}
    sched = SkillcacheConnector.__new__(SkillcacheConnector)
    sched._setup(SpanStore(tmp_path, "m", 0, tp), BS, lambda: rotator)

    def worker(rank: int) -> SkillcacheConnector:
        c = SkillcacheConnector.__new__(SkillcacheConnector)
        c._setup(SpanStore(tmp_path, "m", rank, tp), BS, lambda: rotator)
        return c

    def compile_on(rank: int, name: str) -> None:  # a compile step: vLLM writes this rank's heads, the rank saves
        pos, span_ids = ids[name]
        prompt = [0] * pos + span_ids
        c, r = worker(rank), request(f"c-{name}", prompt, Transfer(save=Save(name, pos, pos + 20)))
        c.get_num_new_matched_tokens(r, 0)
        meta = step(c, new=[(r, [5, 2], 0, len(prompt))])
        layers = {n: PlainLayer(heads=1) for n in NAMES}
        h = head_of(rank)
        k, v = full[name]
        for li, n in enumerate(NAMES):
            at = torch.tensor(slots([5, 2], pos, pos + 20))
            layers[n].do_kv_cache_update(layers[n], k[li, :, h:h + 1], v[li, :, h:h + 1], layers[n].kv_cache, at)
        monkeypatch.setattr(vllm.forward_context, "get_forward_context",
                            lambda: SimpleNamespace(no_compile_layers=layers))
        c.bind_connector_metadata(meta)
        for n in NAMES:
            c.save_kv_layer(n, layers[n].kv_cache, None)
        c.wait_for_save()
        assert SpanStore(tmp_path, "m", rank, tp).path(name).name == f"{name}.tp2r{rank}.safetensors"

    r = request("r", P, TWO)
    for name in ("blk-a", "blk-b"):
        compile_on(0, name)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)  # rank 1's records are missing: nothing promised
    for name in ("blk-a", "blk-b"):
        compile_on(1, name)
    assert sched.get_num_new_matched_tokens(r, 0) == (40, False)
    sched.update_state_after_alloc(r, None, 40)
    meta = step(sched, new=[(r, [7, 3, 9, 4], 40, 20)])  # the scheduler's metadata goes to every rank alike
    (ka, va), (kb, vb) = full["blk-a"], full["blk-b"]
    for rank in range(tp):
        c, h = worker(rank), head_of(rank)
        layers = {n: PlainLayer(heads=1) for n in NAMES}
        c.bind_connector_metadata(meta)
        c.start_load_kv(SimpleNamespace(no_compile_layers=layers))
        assert c.get_block_ids_with_load_errors() == set()
        for li, n in enumerate(NAMES):
            (k0, v0, s0), (k1, v1, s1) = layers[n].written
            assert torch.equal(k0, ka[li, :, h:h + 1]) and torch.equal(v0, va[li, :, h:h + 1])
            moved = rotator.rotate(kb[li].transpose(0, 1)[None], 16, li)[0].transpose(0, 1)[:, h:h + 1]
            assert torch.allclose(k1, moved, atol=1e-6) and torch.equal(v1, vb[li, :, h:h + 1])
            assert s0 == slots([7, 3, 9, 4], 0, 20) and s1 == slots([7, 3, 9, 4], 20, 40)


# ---- the vLLM release (service/vllm/compat.py): run in each tested release's venv by make test-vllm-matrix ---------
def test_this_vllm_is_a_tested_release_and_has_what_the_connector_reads():
    assert compat.outside(compat.installed()) is None, compat.installed()
    assert compat.api_problems(SkillcacheConnector) == []


@pytest.mark.parametrize("version, named", [("0.29.2", True), ("0.33.0rc1", True), ("1.0.0", True), ("", True),
                                            ("0.31.0", False), ("0.32.0+cpu", False), ("v0.30.0", False)])
def test_an_untested_release_is_named_in_one_line_with_the_tested_range(version, named):
    line = compat.outside(version)
    assert (line is not None) == named
    if named:
        assert f"{compat.TESTED[0]} to {compat.TESTED[-1]}" in line and "\n" not in line


def test_a_scheduler_field_gone_turns_the_connector_off(tmp_path, records, monkeypatch):
    from vllm.v1.core.sched import output

    @dataclasses.dataclass
    class CachedRequestData:  # a release whose cached requests no longer say which were resumed
        req_ids: list
        new_block_ids: list
        num_computed_tokens: list

    monkeypatch.setattr(output, "CachedRequestData", CachedRequestData)
    problems = compat.api_problems(SkillcacheConnector)
    assert problems == ["CachedRequestData.resumed_req_ids is gone"]
    c = connector(tmp_path)
    c.off = problems
    r = request("r", P, Transfer(TWO.load, Save("s", 0, 40)))
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)  # vLLM computes every token, saves nothing
    meta = step(c, new=[(r, list(range(4)), 0, 60)])
    assert meta.loads == [] and meta.saves == []


def test_a_changed_cache_write_turns_the_connector_off(monkeypatch):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping, scale):
        raise AssertionError("not called")

    monkeypatch.setattr(CPUAttentionBackendImpl, "do_kv_cache_update", do_kv_cache_update)
    assert [p for p in compat.api_problems(SkillcacheConnector) if "do_kv_cache_update" in p]


def test_an_abstract_method_a_release_adds_is_named():
    class Later(SkillcacheConnector):
        pass

    Later.__abstractmethods__ = frozenset({"get_new_hook"})
    assert compat.api_problems(Later) == ["KVConnectorBase_V1.get_new_hook is abstract and not implemented"]


def test_the_base_hooks_later_releases_add_keep_their_defaults(tmp_path):
    """get_mem_pool_context (0.31), get_external_cache_hit_sources (0.32): the connector inherits them; where this
    release has them they answer the base's defaults (no custom memory pool; every loaded token one source)."""
    c = connector(tmp_path)
    if hasattr(c, "get_mem_pool_context"):
        assert c.get_mem_pool_context() is None
    if hasattr(c, "get_external_cache_hit_sources"):
        got = c.get_external_cache_hit_sources(request("r", P, TWO), 40)
        assert sum(got.values()) == 40 and len(got) == 1


# ---- vLLM's hybrid KV cache manager (SupportsHMA): a KV cache group per attention kind, sliding windows keep only
# their window (vLLM's null block 0 stands for the rest) -------------------------------------------------------------
def two_groups(c):
    """NAMES[0] in group 0 (full attention), NAMES[1] in group 1 (a sliding window)."""
    c._kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=[NAMES[0]]),
                                                          SimpleNamespace(layer_names=[NAMES[1]])])
    return c


def test_the_connector_keeps_vllms_hybrid_kv_cache_manager_on(tmp_path, records):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    c, r = connector(tmp_path), request("r", P, Transfer(TWO.load, Save("s", 40, 50)))
    assert isinstance(c, SupportsHMA)
    assert c.get_num_new_matched_tokens(r, 0) == (40, False)
    c.update_state_after_alloc(r, None, 40)
    assert c.request_finished_all_groups(r, ([7, 3, 9, 4], [0, 0, 9, 4])) == (False, None)
    meta = step(c, new=[(r, [7, 3, 9, 4], 40, 20)])
    assert meta.loads == [] and meta.saves == []


def test_a_load_writes_a_sliding_windows_group_only_where_it_keeps_blocks(tmp_path, records, rotator):
    _, (ka, va), (kb, vb) = records
    c, r = two_groups(connector(tmp_path, rot=rotator)), request("r", P, TWO)
    layers = {NAMES[0]: PlainLayer(), NAMES[1]: PlainLayer()}
    assert c.get_num_new_matched_tokens(r, 0) == (40, False)
    c.update_state_after_alloc(r, None, 40)
    meta = step(c, new=[(r, ([7, 3, 9, 4], [0, 5, 6, 8]), 40, 20)])  # group 1 keeps no block for tokens 0..15
    (load,) = meta.loads
    assert load.slots == [slots([7, 3, 9, 4], 0, 40), [-1] * 16 + slots([0, 5, 6, 8], 16, 40)]
    assert load.block_ids == [7, 3, 9, 5, 6]  # null block 0 is nobody's
    c.bind_connector_metadata(meta)
    c.start_load_kv(SimpleNamespace(no_compile_layers=layers))
    (k0, _, s0), _ = layers[NAMES[0]].written  # full attention: every token
    assert torch.equal(k0, ka[0]) and s0 == slots([7, 3, 9, 4], 0, 20)
    (k1, v1, s1), (k2, v2, s2) = layers[NAMES[1]].written  # the window: blk-a's tokens 16..19, then all of blk-b
    assert torch.equal(k1, ka[1, 16:20]) and torch.equal(v1, va[1, 16:20]) and s1 == slots([0, 5, 6, 8], 16, 20)
    moved = rotator.rotate(kb[1].transpose(0, 1)[None], 16, 1)[0].transpose(0, 1)
    assert torch.equal(k2, moved) and torch.equal(v2, vb[1]) and s2 == slots([0, 5, 6, 8], 20, 40)
    assert c.get_block_ids_with_load_errors() == set()


def test_a_span_is_saved_whole_though_a_sliding_window_freed_its_first_blocks_in_between(tmp_path, monkeypatch):
    """A chunked prefill: tokens 0..31 in one step, 32..59 in the next; by then the sliding window's group has
    freed block 3 (null). Each part was read in the step that computed it, so the record holds every token."""
    c = two_groups(connector(tmp_path))
    r = request("r", P, Transfer(save=Save("s", 0, 60)))
    layers = {n: PlainLayer() for n in NAMES}
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: SimpleNamespace(no_compile_layers=layers))
    k, v = kv(60, 11)
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)

    def run(meta, lo: int, hi: int, blocks) -> None:  # vLLM's forward writes tokens [lo, hi), then the connector
        for li, name in enumerate(NAMES):
            layer = layers[name]
            at = torch.tensor(slots(blocks[li], lo, hi))
            layer.do_kv_cache_update(layer, k[li, lo:hi], v[li, lo:hi], layer.kv_cache, at)
        c.bind_connector_metadata(meta)
        for name in NAMES:
            c.save_kv_layer(name, layers[name].kv_cache, None)
        c.wait_for_save()

    run(step(c, new=[(r, ([3, 1], [3, 1]), 0, 32)]), 0, 32, ([3, 1], [3, 1]))
    assert not SpanStore(tmp_path, "m").exists("s")  # not written before its last part
    layers[NAMES[1]].kv_cache[3] = 0  # the window moved on: group 1's block 3 is freed (and may be reused)
    run(step(c, cached=[(r, ([6, 8], [6, 8]), 32, 28)]), 32, 60, ([3, 1, 6, 8], [0, 1, 6, 8]))
    span = SpanStore(tmp_path, "m").load("s")
    assert span.ids == P and torch.equal(span.k, k) and torch.equal(span.v, v)


def test_a_span_behind_a_long_prefix_hit_keeps_what_the_window_kept_and_a_load_needing_more_fails(tmp_path,
                                                                                                  monkeypatch):
    """A block compiled in chunks: its last request hits 32 tokens in vLLM's prefix cache, of which the sliding
    window's group kept none (null blocks). The record holds layer 1 from position 32 on (zeros before, said in the
    record); a later load that would write layer 1 at position 20 fails (vLLM recomputes), one from 32 on loads."""
    c = two_groups(connector(tmp_path))
    layers = {n: PlainLayer() for n in NAMES}
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: SimpleNamespace(no_compile_layers=layers))
    k, v = kv(40, 5)
    for li, name in enumerate(NAMES):  # what vLLM computed: the hit (blocks 2, 5) and this step's tokens (block 8)
        layers[name].do_kv_cache_update(layers[name], k[li], v[li], layers[name].kv_cache,
                                        torch.tensor(slots([2, 5, 8], 0, 40)))
    r = request("r", P[:40], Transfer(save=Save("s", 0, 40)))
    c.get_num_new_matched_tokens(r, 32)
    meta = step(c, new=[(r, ([2, 5, 8], [0, 0, 8]), 32, 8)])
    (job,) = meta.saves
    assert job.slots == [slots([2, 5, 8], 0, 40), [-1] * 32 + slots([2, 5, 8], 32, 40)]
    c.bind_connector_metadata(meta)
    for name in NAMES:
        c.save_kv_layer(name, layers[name].kv_cache, None)
    c.wait_for_save()
    span = SpanStore(tmp_path, "m").load("s")
    assert span.valid == (0, 32)
    assert torch.equal(span.k[0], k[0]) and torch.equal(span.k[1, 32:], k[1, 32:]) and not span.k[1, :32].any()

    def load(block_ids, lo: int) -> set[int]:
        t = Transfer((Piece("s", 0, 40, 0),))  # vLLM's own prefix cache holds [0, lo)
        rq = request("q", P[:40] + [7], t)
        assert c.get_num_new_matched_tokens(rq, lo) == (40 - lo, False)
        c.update_state_after_alloc(rq, None, 40 - lo)
        c.bind_connector_metadata(step(c, new=[(rq, block_ids, 40, 1)]))
        c.start_load_kv(SimpleNamespace(no_compile_layers={n: PlainLayer() for n in NAMES}))
        return c.get_block_ids_with_load_errors()

    assert load(([1, 3, 4, 6], [0, 3, 4, 6]), 16) == {3, 4}  # layer 1 at 20: not in the record, vLLM recomputes
    assert load(([1, 3, 4, 6], [0, 0, 4, 6]), 32) == set()  # layer 1 from 32 on: in the record
