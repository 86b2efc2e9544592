"""The head pool: what skillcache publishes is what the connector reads, and nothing else ever reads as a head."""

from __future__ import annotations

import pytest
import torch

from service.vllm.heads import (CHUNK_TOKENS, HEADER_BYTES, HeadError, HeadReader, HeadRef, HeadWriter, Layout,
                                _Mapped, record_bytes)

LAYOUT = Layout(n_layers=3, n_kv_heads=2, head_dim=8, dtype="float32")


def kv(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(1, 2, n + 5, 8, generator=g) for _ in range(3)]  # [1, H_kv, T, D], longer than the head
    values = [torch.randn(1, 2, n + 5, 8, generator=g) for _ in range(3)]
    return keys, values


@pytest.fixture
def pool(tmp_path):
    w = HeadWriter(tmp_path, 4 * record_bytes(LAYOUT, 300), "fp-a", LAYOUT, name="pool-test.bin")
    yield w, HeadReader(tmp_path, fingerprint="fp-a")
    w.close()


def test_round_trip_is_exact(pool):
    w, r = pool
    ids = list(range(10, 310))
    keys, values = kv(300)
    ref = w.publish(ids, keys, values, digest="d1")
    m = r.open(HeadRef.from_dict(ref.to_dict()), ids + [7, 8], LAYOUT)
    for layer in range(3):  # [N, H_kv, D] per layer, as vLLM's cache write takes it
        assert torch.equal(m.keys[layer], keys[layer][0, :, :300].transpose(0, 1))
        assert torch.equal(m.values[layer], values[layer][0, :, :300].transpose(0, 1))
    assert w.lookup("d1") == ref


def test_bfloat16_pool_holds_the_cast(tmp_path):
    lay = Layout(3, 2, 8, "bfloat16")
    w = HeadWriter(tmp_path, 2 * record_bytes(lay, 40), "fp", lay, name="p.bin")
    keys, values = kv(40)
    ref = w.publish(list(range(40)), keys, values)
    m = HeadReader(tmp_path).open(ref, list(range(41)), lay)
    assert m.keys.dtype == torch.bfloat16
    assert torch.equal(m.keys[1], keys[1][0, :, :40].transpose(0, 1).to(torch.bfloat16))
    w.close()


@pytest.mark.parametrize("prompt", [list(range(10, 310)),  # no token left for vLLM to compute
                                    [1] + list(range(11, 310)) + [5],  # another prompt
                                    list(range(10, 200))])  # shorter than the head
def test_a_head_is_only_for_its_prompt(pool, prompt):
    w, r = pool
    ref = w.publish(list(range(10, 310)), *kv(300))
    with pytest.raises(HeadError):
        r.open(ref, prompt, LAYOUT)


def test_corrupt_bytes_fail_their_chunk_only(pool):
    w, r = pool
    ids = list(range(300))
    ref = w.publish(ids, *kv(300))
    r.open(ref, ids + [1], LAYOUT)
    _Mapped(w.buf, ref.offset, LAYOUT, 300).values[2, 2 * CHUNK_TOKENS + 3, 1, 4] += 1.0  # a changed value, third chunk
    with pytest.raises(HeadError, match="CRC"):
        r.open(ref, ids + [1], LAYOUT)
    r.open(ref, ids + [1], LAYOUT, lo=0, hi=2 * CHUNK_TOKENS)  # a load of the first two chunks still checks out


@pytest.mark.parametrize("change", ["gen", "n_tokens", "pool", "offset"])
def test_a_reference_that_does_not_match_its_record_is_refused(pool, change):
    w, r = pool
    ref = w.publish(list(range(50)), *kv(50))
    bad = {"gen": ref.gen + 1, "n_tokens": 49, "pool": "../etc/passwd", "offset": ref.offset + HEADER_BYTES}
    with pytest.raises(HeadError):
        r.open(HeadRef.from_dict({**ref.to_dict(), change: bad[change]}), list(range(51)), LAYOUT)


def test_other_model_or_layout_is_refused(pool, tmp_path):
    w, _ = pool
    ref = w.publish(list(range(50)), *kv(50))
    with pytest.raises(HeadError, match="another model"):
        HeadReader(tmp_path, fingerprint="fp-b").open(ref, list(range(51)), LAYOUT)
    with pytest.raises(HeadError, match="layout"):
        HeadReader(tmp_path).open(ref, list(range(51)), Layout(3, 2, 8, "bfloat16"))


def test_ring_overwrites_only_released_records(pool):
    w, r = pool
    refs = [w.publish(list(range(300)), *kv(300, s), digest=f"d{s}") for s in range(4)]  # pool holds four
    assert all(refs)
    assert w.publish(list(range(300)), *kv(300)) is None  # all four in flight: no room, the caller sends none
    w.release(refs[0])
    new = w.publish(list(range(300)), *kv(300, 9), digest="d9")
    assert new is not None and new.offset == refs[0].offset
    with pytest.raises(HeadError, match="overwritten"):  # the old reference now reads as no record
        r.open(refs[0], list(range(301)), LAYOUT)
    assert w.lookup("d0") is None and w.lookup("d9") == new
    assert not w.acquire(refs[0]) and w.acquire(new)


def test_a_missing_pool_is_no_record(tmp_path):
    with pytest.raises(HeadError):
        HeadReader(tmp_path).open(HeadRef("pool-gone.bin", 0, 1, 5), list(range(6)), LAYOUT)
