"""The int8 CPU weight formats (weight-only int8, and W8A8 with per-token activation scales): close to float32, and
a request's output does not depend on what else is in its batch (the control: torch's quantize_dynamic, one
activation scale per input, does leak)."""

import copy

import pytest
import torch
from torch import nn

from service.kv.cache import new_cache
from service.runtime.quantize import KINDS, quantize_linears
from service.runtime.serving.runner import DecodeBatch
from tiny import random_ids, tiny_runtime


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_int8_linear_is_close_to_float32(kind):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        want, got = lin(x), KINDS[kind](lin)(x)
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


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_int8_rows_are_independent_of_their_batch(kind):
    rt = tiny_runtime("llama", quantization=kind)
    prompts = [random_ids(n, seed=n) for n in (6, 31, 17)]
    alone, batched = _rows_alone_and_batched(rt, prompts, [5, 77, 301])
    for i, a in enumerate(alone):
        torch.testing.assert_close(batched[i], a, atol=1e-5, rtol=0)


def test_weight_only_rows_do_not_depend_on_the_row_count():
    """A prompt cut into other pieces (a composition's tail, prefill chunks) gets the same numbers: bitwise."""
    torch.manual_seed(0)
    lin = KINDS["int8"](nn.Linear(96, 80))
    x = torch.randn(70, 96)
    with torch.no_grad():
        whole = lin(x)
        for lo, hi in [(0, 1), (3, 11), (11, 70)]:
            assert torch.equal(lin(x[lo:hi]), whole[lo:hi])


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
    assert quantize_linears(model, "w8a8") == n and not any(isinstance(m, nn.Linear) for m in model.modules())


def test_w8a8_is_refused_on_an_x86_cpu_without_vnni(monkeypatch, tmp_path):
    """torch's int8 x int8 matmul is a slow loop without VNNI (~20x float32 on an AVX2-only EPYC): the service
    refuses the format there, before loading the model, and says what to set instead."""
    from service.config import Settings
    from service.runtime import build_runtime, quantize

    monkeypatch.setattr(quantize.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(quantize, "cpu_flags", lambda: "flags\t\t: fpu sse2 avx2 fma")
    why = quantize.w8a8_unfit()
    assert why and "VNNI" in why and "SKILLCACHE_QUANTIZATION=int8" in why
    settings = Settings(model=str(tmp_path / "no-such-model"), quantization="w8a8", home=tmp_path)
    with pytest.raises(RuntimeError, match="needs a CPU with VNNI"):  # not the missing model: nothing was loaded
        build_runtime(settings)
    for flag in quantize.VNNI:
        monkeypatch.setattr(quantize, "cpu_flags", lambda flag=flag: f"flags\t\t: fpu avx2 {flag} fma")
        assert quantize.w8a8_unfit() is None
    monkeypatch.setattr(quantize.platform, "machine", lambda: "aarch64")  # not measured there: not refused
    assert quantize.w8a8_unfit() is None


def test_bfloat16_on_an_x86_cpu_without_bfloat16_instructions_is_warned_about(monkeypatch, caplog):
    """No refusal (same numbers, and it runs), but a warning at start-up that says what is fast there: on an
    AVX2-only EPYC a bfloat16 prefill took 6.8x float32's, an int8 one (bfloat16 activations) 2.5x."""
    from service.runtime import build_runtime, quantize

    monkeypatch.setattr(quantize.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(quantize, "cpu_flags", lambda: "flags\t\t: fpu sse2 avx2 fma")
    why = quantize.bfloat16_slow()
    assert why and "avx512_bf16" in why and "SKILLCACHE_DTYPE=float32" in why
    for flag in quantize.BF16:
        monkeypatch.setattr(quantize, "cpu_flags", lambda flag=flag: f"flags\t\t: fpu avx512f {flag} fma")
        assert quantize.bfloat16_slow() is None
    monkeypatch.setattr(quantize, "cpu_flags", lambda: "flags\t\t: fpu sse2 avx2 fma")
    monkeypatch.setattr("service.runtime.loader.load_model", lambda *a, **k: (_ for _ in ()).throw(LookupError("stop")))
    from service.config import Settings

    for kw, setting in (({"dtype": "bfloat16"}, "SKILLCACHE_DTYPE=bfloat16"),
                        ({"quantization": "int8"}, "SKILLCACHE_QUANTIZATION=int8")):
        caplog.clear()
        with pytest.raises(LookupError):  # warned before the model loads
            build_runtime(Settings(model="embedded", device="cpu", **kw))
        assert any(setting in r.getMessage() and "no bfloat16 instructions" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with pytest.raises(LookupError):
        build_runtime(Settings(model="embedded", device="cpu"))
    assert not caplog.records  # float32: nothing to say
