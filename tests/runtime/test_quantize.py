"""int8 weights with per-token activation scales: close to float32, and a request's output does not depend on what
else is in its batch (the control: torch's quantize_dynamic, one activation scale per input, does leak)."""

import copy

import torch
from torch import nn

from service.kv.cache import new_cache
from service.runtime.quantize import Int8Linear, quantize_linears
from service.runtime.serving.runner import DecodeBatch
from tiny import random_ids, tiny_runtime


def test_int8_linear_is_close_to_float32():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        want, got = lin(x), Int8Linear(lin)(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert float((got - want).abs().max()) <= 0.03 * float(want.abs().max())


def _rows_alone_and_batched(rt, prompts, tokens):
    """Logits of one decode step per prompt: each alone (a batch of one), then all rows in one batch."""
    def caches():
        out = []
        for p in prompts:
            c = new_cache(rt.model.config)
            rt.forward(p, 0, c)
            out.append(c)
        return out

    alone = []
    for c, t in zip(caches(), tokens):
        b = DecodeBatch(rt)
        b.join(c, 128)
        alone.append(b.step([t])[0])
    batch = DecodeBatch(rt)
    for c in caches():
        batch.join(c, 128)
    return alone, batch.step(tokens)


def test_int8_rows_are_independent_of_their_batch():
    rt = tiny_runtime("llama", quantization="int8")
    prompts = [random_ids(n, seed=n) for n in (6, 31, 17)]
    alone, batched = _rows_alone_and_batched(rt, prompts, [5, 77, 301])
    for i, a in enumerate(alone):
        torch.testing.assert_close(batched[i], a, atol=1e-5, rtol=0)


def test_control_per_tensor_dynamic_quantization_leaks_between_rows():
    base = tiny_runtime("llama")
    rt = copy.copy(base)
    rt.model = torch.ao.quantization.quantize_dynamic(copy.deepcopy(base.model), {nn.Linear}, dtype=torch.qint8)
    rt.loaded = copy.copy(base.loaded)
    prompts = [random_ids(n, seed=n) for n in (6, 31, 17)]
    alone, batched = _rows_alone_and_batched(rt, prompts, [5, 77, 301])
    assert max(float((batched[i] - a).abs().max()) for i, a in enumerate(alone)) > 1e-3


def test_quantize_linears_replaces_every_linear():
    model = copy.deepcopy(tiny_runtime("llama").model)
    n = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert quantize_linears(model) == n and not any(isinstance(m, nn.Linear) for m in model.modules())
