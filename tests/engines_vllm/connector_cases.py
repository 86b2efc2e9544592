"""The connector's own logic, run inside vLLM's venv (tests/vllm/test_connector.py runs this file there):
what it answers the scheduler, which slots it writes, and what it refuses. vLLM's objects are stand-ins with the
attributes the connector reads; the real path (vLLM's CPU cache write) is tests/vllm/test_vllm_e2e.py's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from service.vllm.connector import SkillcacheConnector
from service.vllm.heads import HeadReader, HeadWriter, Layout, _Mapped, record_bytes

LAYOUT = Layout(n_layers=2, n_kv_heads=2, head_dim=4, dtype="float32")
BS = 16  # vLLM's block size here


def kv(n: int):
    g = torch.Generator().manual_seed(n)
    return ([torch.randn(1, 2, n, 4, generator=g) for _ in range(2)],
            [torch.randn(1, 2, n, 4, generator=g) for _ in range(2)])


@pytest.fixture
def setup(tmp_path):
    w = HeadWriter(tmp_path, 4 * record_bytes(LAYOUT, 64), "fp", LAYOUT, name="pool-t.bin")
    c = SkillcacheConnector.__new__(SkillcacheConnector)
    c._setup(HeadReader(tmp_path), BS, LAYOUT)
    yield w, c
    w.close()


def request(rid: str, ids: list[int], ref=None):
    return SimpleNamespace(request_id=rid, prompt_token_ids=ids,
                           kv_transfer_params={"skillcache": ref.to_dict()} if ref else None)


def schedule(c, req, blocks: list[int]):
    out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=(blocks,))],
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[]))
    return c.build_connector_meta(out)


def test_answers_the_head_beyond_the_local_hit_and_maps_its_slots(setup):
    w, c = setup
    ids = list(range(100, 150))  # a 40-token head, then 10 tokens for vLLM
    ref = w.publish(ids[:40], *kv(40))
    req = request("r1", ids, ref)
    assert c.get_num_new_matched_tokens(req, 0) == (40, False)
    assert c.get_num_new_matched_tokens(req, 32) == (8, False)  # vLLM's prefix cache holds two blocks already
    c.update_state_after_alloc(req, None, 8)
    meta = schedule(c, req, [7, 3, 9, 4])
    (load,) = meta.loads
    assert load.start == 32 and load.slots == [9 * BS + t for t in range(8)]  # tokens 32..39 sit in the third block
    assert meta.block_ids[0] == [9]


@pytest.mark.parametrize("case", ["no params", "head covers the prompt", "other prompt", "overwritten", "nothing new"])
def test_anything_that_does_not_check_out_is_no_match(setup, case):
    w, c = setup
    ids = list(range(50))
    ref = w.publish(ids[:40], *kv(40))
    req = {"no params": request("r", ids),
           "head covers the prompt": request("r", ids[:40], ref),
           "other prompt": request("r", [9] + ids[1:], ref),
           "overwritten": request("r", ids, type(ref)(ref.pool, ref.offset, ref.gen + 1, ref.n_tokens)),
           "nothing new": request("r", ids, ref)}[case]
    assert c.get_num_new_matched_tokens(req, 48 if case == "nothing new" else 0) == (0, False)
    assert schedule(c, req, [1, 2, 3, 4]).loads == []


class Layer:
    """An attention layer as start_load_kv sees it: its cache and its backend's cache write."""

    def __init__(self) -> None:
        self.kv_cache = torch.zeros(8, BS, 2, 4)  # [blocks, block_size, H_kv, D]: a plain layout for the check
        self.impl = self
        self.written: list = []

    def do_kv_cache_update(self, layer, k, v, cache, slots) -> None:  # [T, H_kv, D] x2, [T]
        self.written.append((k.clone(), v.clone(), slots.tolist()))


def test_the_worker_writes_each_layer_with_the_backends_own_write(setup):
    w, c = setup
    ids = list(range(60))
    keys, values = kv(40)
    ref = w.publish(ids[:40], keys, values)
    req = request("r", ids, ref)
    c.get_num_new_matched_tokens(req, 16)
    c.update_state_after_alloc(req, None, 24)
    meta = schedule(c, req, [5, 6, 2, 1])
    layers = {f"model.layers.{i}.self_attn.attn": Layer() for i in range(2)}
    c.bind_connector_metadata(meta)
    c.start_load_kv(SimpleNamespace(no_compile_layers=layers))
    for i, layer in enumerate(layers.values()):
        (k, v, slots), = layer.written
        assert torch.equal(k, keys[i][0, :, 16:40].transpose(0, 1))  # [T, H_kv, D]
        assert torch.equal(v, values[i][0, :, 16:40].transpose(0, 1))
        assert slots == [6 * BS + t for t in range(16)] + [2 * BS + t for t in range(8)]
    assert c.get_block_ids_with_load_errors() == set()


def test_a_record_overwritten_before_the_copy_is_reported_as_load_errors(setup):
    w, c = setup
    ids = list(range(60))
    ref = w.publish(ids[:40], *kv(40))
    req = request("r", ids, ref)
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, None, 40)
    meta = schedule(c, req, [5, 6, 2, 1])
    w.buf[ref.offset:ref.offset + 8] = b"garbage!"  # another head landed here between the check and the load
    c.bind_connector_metadata(meta)
    c.start_load_kv(SimpleNamespace(no_compile_layers={"model.layers.0.self_attn.attn": Layer()}))
    assert c.get_block_ids_with_load_errors() == {5, 6, 2}  # vLLM recomputes these blocks
    assert _Mapped  # the format module is the one both sides use
