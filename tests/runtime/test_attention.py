"""The decode attention kernel (service/runtime/attention.py): sdpa's results, a row's numbers independent of its
batch, every call it does not fit left to sdpa, and the decode batch really running on it."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from service.kv.cache import new_cache
from service.runtime import attention
from service.runtime.serving.runner import DecodeBatch
from tiny import EAGER, FAMILIES, random_ids, tiny_runtime


class Heads:  # what the attention functions read from the module
    def __init__(self, groups: int) -> None:
        self.num_key_value_groups = groups


def _inputs(b, hkv, g, t, dk, dv, seed=0, cap_extra=9):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * g, 1, dk, generator=gen)
    kb = torch.randn(b, hkv, t + cap_extra, dk, generator=gen)  # views of a bigger buffer, as the decode batch's
    vb = torch.randn(b, hkv, t + cap_extra, dv, generator=gen)
    return q, kb[:, :, :t], vb[:, :, :t]


def _sdpa(q, k, v, mask, scale):
    return sdpa_attention_forward(Heads(q.shape[1] // k.shape[1]), q, k, v, mask, scaling=scale)[0]


@pytest.mark.parametrize("b,hkv,g,t,dk,dv", [
    (1, 3, 3, 2560, 64, 64),  # the embedded model's heads
    (4, 2, 4, 300, 16, 16), (3, 1, 7, 513, 128, 128), (2, 4, 1, 17, 32, 32),
    (2, 2, 2, 257, 24, 16),  # MLA: keys and values of different sizes, a head size no multiple of 16
    (2, 2, 5, 130, 20, 20),  # keys no multiple of 8: the general score code (AVX2 masked loads), heads 3 + 2 a key
    (2, 1, 12, 90, 64, 64),  # more than 8 query heads a key head: the general code
])
def test_it_gives_sdpas_attention(b, hkv, g, t, dk, dv):
    q, k, v = _inputs(b, hkv, g, t, dk, dv)
    cols = torch.arange(t)[None, :]
    ends = torch.randint(1, t + 1, (b,), generator=torch.Generator().manual_seed(1))[:, None]
    masks = {
        "none": None,
        "causal rows": (cols < ends)[:, None, None, :],
        "sliding": ((cols < ends) & (cols >= ends - 40))[:, None, None, :],
        "shared": (cols < t // 2 + 1)[:, None, None, :],  # one [1, 1, 1, T] mask for every row
    }
    for name, mask in masks.items():
        got, _ = attention.few_queries_attention(Heads(g), q, k, v, mask, scaling=0.17)
        want = _sdpa(q, k, v, mask, 0.17).reshape(got.shape)
        assert got.shape == (b, 1, hkv * g, dv)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5, msg=name)


def test_a_rows_numbers_do_not_depend_on_its_batch():
    q, k, v = _inputs(5, 3, 3, 700, 64, 64, seed=3)
    lengths = torch.tensor([700, 5, 256, 257, 600])
    mask = (torch.arange(700)[None, :] < lengths[:, None])[:, None, None, :]
    batch, _ = attention.few_queries_attention(Heads(3), q, k, v, mask, scaling=0.125)
    for r in range(5):
        n = int(lengths[r])  # alone, and with only its own columns: the same bits
        alone, _ = attention.few_queries_attention(Heads(3), q[r:r + 1], k[r:r + 1, :, :n], v[r:r + 1, :, :n],
                                                      mask[r:r + 1, ..., :n], scaling=0.125)
        assert torch.equal(alone, batch[r:r + 1])


def test_masked_columns_never_reach_the_output():
    q, k, v = _inputs(2, 1, 2, 64, 16, 16, seed=4)
    k, v = k.clone(), v.clone()
    k[:, :, 40:] = float("nan")  # padding that was never written
    v[:, :, 40:] = float("inf")
    mask = (torch.arange(64) < 40)[None, None, None, :].expand(2, 1, 1, 64)
    got, _ = attention.few_queries_attention(Heads(2), q, k, v, mask, scaling=0.25)
    want = _sdpa(q[..., :], k[:, :, :40], v[:, :, :40], None, 0.25).reshape(got.shape)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_calls_it_does_not_fit_go_to_sdpa(monkeypatch):
    def boom(*a, **kw):
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(attention, "extension", lambda: type("E", (), {"decode_attention": boom}))
    q, k, v = _inputs(2, 2, 2, 30, 16, 16)
    prefill = torch.randn(2, 4, 3, 16)  # three query tokens
    attention.few_queries_attention(Heads(2), prefill, k, v, None, scaling=0.25)
    attention.few_queries_attention(Heads(2), prefill, k, v, torch.ones(2, 1, 3, 30, dtype=torch.bool), scaling=0.25)
    attention.few_queries_attention(Heads(2), q.bfloat16(), k.bfloat16(), v.bfloat16(), None, scaling=0.25)
    attention.few_queries_attention(Heads(2), q, k, v, torch.zeros(2, 1, 1, 30), scaling=0.25)  # additive mask
    with pytest.raises(ValueError, match="softcap"):  # sdpa's own answer to soft-capping
        attention.few_queries_attention(Heads(2), q, k, v, None, scaling=0.25, softcap=30.0)


@pytest.mark.parametrize("q_len,t", [(30, 2421), (5, 90), (256, 700)])
def test_a_masked_prefill_gives_transformers_own_numbers(q_len, t):
    """More than one query token: sdpa's grouped-query path, bitwise what transformers' repeat_kv path gives."""
    q, k, v = _inputs(2, 3, 3, t, 64, 64, seed=5)
    q = torch.randn(2, 9, q_len, 64, generator=torch.Generator().manual_seed(6))
    causal = torch.arange(t)[None, :] <= (t - q_len + torch.arange(q_len))[:, None]  # [Q, T]
    mask = causal[None, None].expand(2, 1, q_len, t)
    got, _ = attention.few_queries_attention(Heads(3), q, k, v, mask, scaling=0.125)
    want, _ = sdpa_attention_forward(Heads(3), q, k, v, mask, scaling=0.125)
    assert torch.equal(got, want)


def test_only_float32_sdpa_models_on_the_cpu_use_it():
    assert attention.usable(tiny_runtime("llama").model)
    assert not attention.usable(tiny_runtime("gemma2").model)  # eager (soft-capping)
    assert not attention.usable(tiny_runtime("llama", dtype=torch.bfloat16).model)


def _spying(real, record):
    """An `extension` whose decode_attention calls record(args) first."""
    def spying():
        ext = real()

        class Spied:
            blocks_mm = ext.blocks_mm

            @staticmethod
            def decode_attention(*a):
                record(a)
                return ext.decode_attention(*a)
        return Spied
    return spying


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - EAGER))
def test_the_decode_batch_runs_its_steps_on_it(family, monkeypatch):
    """Every sdpa family's decode step goes through the kernel, once per layer, and gives the step sdpa gives."""
    rt = tiny_runtime(family)
    calls = []
    real = attention.extension
    counting = _spying(real, lambda a: calls.append(a[1].shape))

    assert rt.kernel_attention
    logits = {}
    for kernel in (True, False):
        batch = DecodeBatch(rt, kernel_attention=kernel)
        assert batch.kernel_attention is kernel
        for n in (7, 30):
            cache = new_cache(rt.model.config)
            rt.forward(random_ids(n, seed=n), 0, cache)
            batch.join(cache, n + 4)
        monkeypatch.setattr(attention, "extension", counting)
        logits[kernel] = batch.step([3, 4])
        monkeypatch.setattr(attention, "extension", real)
    assert len(calls) == rt.config.num_hidden_layers
    assert rt.config._attn_implementation == "sdpa"  # only for the step
    torch.testing.assert_close(logits[True], logits[False], atol=2e-4, rtol=1e-4)


def test_switched_off_the_runtime_neither_builds_nor_uses_it(monkeypatch):
    from service.runtime.model import ModelRuntime
    from service.runtime.loader import build_random_model
    from tiny import tiny_config, tiny_tokenizer

    def no_build(model):
        raise AssertionError("the kernel was built or checked with the setting off")

    monkeypatch.setattr(attention, "usable", no_build)
    cfg = tiny_config("llama")
    cfg._attn_implementation = "sdpa"
    rt = ModelRuntime(build_random_model(cfg, tiny_tokenizer()), "fp", kernel_attention=False)
    assert rt.kernel_attention is False and DecodeBatch(rt).kernel_attention is False


@pytest.mark.parametrize("dk", [64, 32])  # keys of 64 hold the query heads in registers; others the general code
def test_rows_read_shared_chunks_from_their_source_row(dk):
    """sources[b, c]: row b reads chunk c of K/V from that row. Where the source holds the same numbers the output is
    bitwise the one without sources; where it holds others, only that row's output changes (the read moved)."""
    ext = attention.extension()
    chunk, t = 256, 600
    q, k, v = _inputs(3, 2, 3, t, dk, dk, seed=5)
    q = q.reshape(3, 2, 3, dk)
    k, v = k.clone(), v.clone()
    k[1, :, :2 * chunk], v[1, :, :2 * chunk] = k[0, :, :2 * chunk], v[0, :, :2 * chunk]  # rows 0, 1 alike there
    mask = torch.ones(3, t, dtype=torch.bool)
    mask[2, 500:] = False
    alone = ext.decode_attention(q, k, v, mask, 0.125, None, 0)
    shared = ext.decode_attention(q, k, v, mask, 0.125, torch.tensor([[0, 0], [0, 0], [2, 2]]), chunk)
    assert torch.equal(shared, alone)
    moved = ext.decode_attention(q, k, v, mask, 0.125, torch.tensor([[0, 0], [1, 1], [2, 0]]), chunk)
    assert torch.equal(moved[:2], alone[:2]) and not torch.allclose(moved[2], alone[2])
    with pytest.raises(RuntimeError, match="rows of this batch"):
        ext.decode_attention(q, k, v, mask, 0.125, torch.tensor([[0, 0], [0, 3], [2, 2]]), chunk)
    with pytest.raises(RuntimeError, match="chunks of 256"):
        ext.decode_attention(q, k, v, mask, 0.125, torch.tensor([[0, 0], [0, 0], [2, 2]]), 128)


def test_decode_rows_on_the_same_prefix_read_it_once_and_get_the_same_logits(monkeypatch):
    """Rows composed on the same 300-token prefix: the step passes the kernel sources, and its logits are bitwise
    those of the rows each reading their own copy."""
    from service.kv.cache import append_kv

    rt = tiny_runtime("llama")
    prefix = new_cache(rt.model.config)
    rt.forward(random_ids(300, seed=1), 0, prefix)
    seen = []
    monkeypatch.setattr(attention, "extension",
                        _spying(attention.extension, lambda a: seen.append(None if a[5] is None else a[5].tolist())))
    logits = {}
    for share in (True, False):
        batch = DecodeBatch(rt, share_chunks=share)
        for n in (5, 12):
            cache = new_cache(rt.model.config)
            append_kv(cache, [lay.keys for lay in prefix.layers], [lay.values for lay in prefix.layers])
            rt.forward(random_ids(n, seed=n), 300, cache)
            batch.join(cache, 300 + n + 4)
        solo = new_cache(rt.model.config)
        rt.forward(random_ids(280, seed=2), 0, solo)
        batch.join(solo, 290)
        logits[share] = [batch.step([3, 4, 5]), batch.step([6, 7, 8])]
    assert seen[0] == [[0], [0], [2]]  # rows 0 and 1 share the first chunk; the third row reads its own
    assert all(s is None for s in seen[-2 * rt.config.num_hidden_layers:])
    for a, b in zip(logits[True], logits[False]):
        assert torch.equal(a, b)
