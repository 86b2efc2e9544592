"""Packed decode (service/runtime/packed.py): block-quantized weights recovered bit for bit from float32, a fused
kernel for few rows that matches the float32 matmul at rounding level and does not depend on the row count, the
float32 matmul for long inputs, and a model that decodes as before."""

import copy
import platform

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from service.kv.cache import new_cache
from service.runtime import packed
from service.runtime.model import ModelRuntime
from service.runtime.packed import GROUP, PackedLinear, pack_linears, recover_blocks
from service.runtime.serving.runner import DecodeBatch
from tiny import random_ids, tiny_runtime


def _q4_1(w: torch.Tensor) -> torch.Tensor:
    """w rounded to GGUF Q4_1 blocks, decoded to float32 as the GGUF loader does (d * q + m, float16 d and m)."""
    g = w.detach().float().view(w.shape[0], -1, GROUP)
    m = g.amin(-1, keepdim=True).half().float()
    d = ((g.amax(-1, keepdim=True) - m) / 15).half().float()
    q = torch.round((g - m) / d).clamp(0, 15)
    return (q * d + m).view_as(w)


def _q8_0(w: torch.Tensor) -> torch.Tensor:
    g = w.detach().float().view(w.shape[0], -1, GROUP)
    d = (g.abs().amax(-1, keepdim=True) / 127).half().float()
    return (torch.round(g / d).clamp(-127, 127) * d).view_as(w)


@pytest.mark.parametrize("fmt", [_q4_1, _q8_0])
def test_blocks_are_recovered_bit_for_bit(fmt):
    torch.manual_seed(0)
    w = fmt(torch.randn(48, 4 * GROUP))
    q, d, m, kind = recover_blocks(w)
    assert kind == {_q4_1: "q4_1", _q8_0: "q8_0"}[fmt] and q.dtype == torch.int8 and d.dtype == torch.float16
    decoded = q.view(48, -1, GROUP).float() * d.float()[..., None] + m.float()[..., None]
    assert torch.equal(decoded.view_as(w), w)


def test_other_weights_are_not_blocks():
    torch.manual_seed(0)
    w = torch.randn(48, 4 * GROUP)
    assert recover_blocks(w) is None  # float32 values that are no block format
    assert recover_blocks(_q4_1(w).bfloat16()) is None  # not float32
    assert recover_blocks(torch.randn(48, GROUP + 3)) is None  # rows not a whole number of blocks
    almost = _q4_1(w)
    almost[3, 7] = torch.nextafter(almost[3, 7], torch.tensor(1.0))  # one value off by one ulp
    assert recover_blocks(almost) is None


def _linear(n=96, k=4 * GROUP, bias=False):
    torch.manual_seed(1)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(_q4_1(lin.weight))
    return lin


@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_match_float32_and_many_rows_are_the_matmul(bias):
    lin = _linear(bias=bias)
    p = PackedLinear(lin, recover_blocks(lin.weight), max_rows=8)
    torch.manual_seed(2)
    with torch.inference_mode():
        for shape in [(1, 1, lin.in_features), (2, 3, lin.in_features), (8, lin.in_features)]:
            x = torch.randn(*shape)
            got, want = p(x), lin(x)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        x = torch.randn(9, lin.in_features)
        assert torch.equal(p(x), lin(x))  # past max_rows: the float32 matmul itself


@pytest.mark.parametrize("n", [96, 97, 98])  # AVX2's tiles take 3 output rows: none, 1 or 2 left over
def test_a_row_does_not_depend_on_the_row_count(n):
    lin = _linear(n=n)
    p = PackedLinear(lin, recover_blocks(lin.weight), max_rows=8, step_rows=16)
    torch.manual_seed(3)
    x = torch.randn(16, 1, lin.in_features)  # a decode step of 16 rows
    with torch.inference_mode():
        whole = p(x)
        torch.testing.assert_close(whole, lin(x), rtol=1e-5, atol=1e-5)
        for rows in range(1, 16):  # every pass shape (AVX2: up to 3 rows in registers, tiles of 4 beyond)
            assert torch.equal(p(x[:rows].contiguous()), whole[:rows])


def test_only_a_decode_step_is_packed_past_max_rows():
    """Up to step_rows rows of one token each (a decode batch's step) run on the blocks; any other input of more
    than max_rows rows (a prefill chunk, a burst's tails) is the float32 matmul itself, as a prompt prefilled whole."""
    lin = _linear()
    p = PackedLinear(lin, recover_blocks(lin.weight), max_rows=8, step_rows=16)
    torch.manual_seed(5)
    with torch.inference_mode():
        step, tails = torch.randn(12, 1, lin.in_features), torch.randn(3, 4, lin.in_features)
        assert torch.equal(p(step)[5], p(step[5:6])[0])  # the kernel: a row as it is alone
        assert not torch.equal(p(step), lin(step))
        assert torch.equal(p(tails), lin(tails))
        past = torch.randn(17, 1, lin.in_features)
        assert torch.equal(p(past), lin(past))


@pytest.mark.parametrize("fmt", [_q4_1, _q8_0])
def test_the_kernel_multiplies_by_the_very_float32_weight(fmt):
    """Unit rows pick the weight's columns out: the kernel decodes each block (two levels a byte for Q4_1) to the
    float32 value the model was loaded with, bit for bit."""
    torch.manual_seed(4)
    lin = nn.Linear(4 * GROUP, 40, bias=False)
    with torch.no_grad():
        lin.weight.copy_(fmt(lin.weight))
    p = PackedLinear(lin, recover_blocks(lin.weight), max_rows=8)
    eye = torch.eye(lin.in_features)
    with torch.inference_mode():
        cols = torch.cat([p(eye[i:i + 8]) for i in range(0, lin.in_features, 8)])  # [K, N]
    assert torch.equal(cols.t(), lin.weight.detach())


def _block_runtime() -> tuple[ModelRuntime, ModelRuntime]:
    """A tiny llama whose linears are Q4_1 (the LM head Q8_0), and a packed copy of it."""
    base = tiny_runtime("llama")
    loaded = copy.deepcopy(base.loaded)  # tiny runtimes are shared between tests
    with torch.no_grad():
        for name, mod in loaded.model.named_modules():
            if isinstance(mod, nn.Linear):
                mod.weight.copy_(_q8_0(mod.weight) if name.endswith("lm_head") else _q4_1(mod.weight))
    return ModelRuntime(loaded, base.fingerprint), ModelRuntime(copy.deepcopy(loaded), base.fingerprint)


def test_a_block_quantized_model_decodes_as_before():
    rt, fast = _block_runtime()
    counts = pack_linears(fast.model)
    n_linear = sum(isinstance(m, nn.Linear) for m in rt.model.modules())
    assert sum(counts.values()) == n_linear and counts.get("q4_1", 0) >= n_linear - 1
    assert not any(type(m) is nn.Linear for m in fast.model.modules())
    prompts = [random_ids(n, seed=n) for n in (6, 31, 17)]

    def decode(r):
        batch, toks, out = DecodeBatch(r), [], []
        for p in prompts:
            c = new_cache(r.model.config)
            toks.append(int(r.forward(p, 0, c).argmax()))
            batch.join(c, 64)
        for _ in range(6):
            logits = batch.step(toks)
            out.append(logits)
            toks = logits.argmax(-1).tolist()
        return out

    with torch.inference_mode():
        for want, got in zip(decode(rt), decode(fast)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        # a prefill chunk stays on the float32 matmul: the same K/V, bit for bit (its one row of logits: packed)
        c1, c2 = new_cache(rt.model.config), new_cache(fast.model.config)
        torch.testing.assert_close(fast.forward(prompts[1], 0, c2), rt.forward(prompts[1], 0, c1), rtol=1e-4, atol=1e-4)
        for a, b in zip(c1.layers, c2.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)



def test_a_batch_past_max_rows_decodes_each_row_as_alone():
    """A decode step of 12 rows (more than max_rows, within the kernel's step_rows) runs on the blocks: every row's
    logits are bitwise those it gets decoded alone, so a request's tokens do not depend on its batch."""
    _, fast = _block_runtime()
    pack_linears(fast.model)
    assert all(m.step_rows >= 12 for m in fast.model.modules() if isinstance(m, PackedLinear))
    prompts = [random_ids(5 + 3 * i, seed=40 + i) for i in range(12)]

    def decode(group):
        batch, toks, out = DecodeBatch(fast), [], []
        for p in group:
            c = new_cache(fast.model.config)
            toks.append(int(fast.forward(p, 0, c).argmax()))
            batch.join(c, 64, rows=len(group))
        for _ in range(3):
            logits = batch.step(toks)
            out.append(logits)
            toks = logits.argmax(-1).tolist()
        return torch.stack(out, 1)  # [B, steps, V]

    with torch.inference_mode():
        together = decode(prompts)
        for i in (0, 5, 11):
            assert torch.equal(together[i], decode(prompts[i:i + 1])[0])

def test_random_weights_are_left_alone():
    rt = tiny_runtime("llama")
    assert pack_linears(rt.model) == {}
    assert all(type(m) is not PackedLinear for m in rt.model.modules())


def test_no_compiler_leaves_the_model_on_float32(monkeypatch):
    _, fast = _block_runtime()

    def broken():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(packed, "extension", broken)
    assert pack_linears(fast.model) == {}
    assert all(type(m) is not PackedLinear for m in fast.model.modules())
    x = torch.randn(2, fast.model.config.hidden_size)
    lin = fast.model.model.layers[0].mlp.up_proj
    assert torch.equal(lin(x), F.linear(x, lin.weight))


def test_a_cpu_without_avx2_or_avx512_keeps_torchs_ops(monkeypatch, caplog):
    """The kernels' portable code is slower than torch's own ops: on a CPU with neither level no variant loads, it is
    said once, and packed decode (and the attention kernel) stay off."""
    from service.runtime import native

    monkeypatch.setattr(native, "_ext", None)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setattr(native, "cpu_flags", lambda: "flags : fpu sse sse2 sse4_2 avx")
    with caplog.at_level("WARNING"):
        for _ in range(2):
            with pytest.raises(native.KernelsUnavailable, match="neither AVX-512 nor AVX2"):
                native.extension()
        _, fast = _block_runtime()
        assert pack_linears(fast.model) == {}
    assert native._ext is None
    assert [r.getMessage() for r in caplog.records].count(
        f"kernels off, torch's own ops serve: {native._error}") == 1 and len(caplog.records) == 1


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the vector paths are x86-64's")
def test_this_build_has_a_vector_path():
    """Where the suite runs (x86-64 with AVX2 or AVX-512) the kernels run their vector code, not the portable one."""
    from service.runtime.native import extension

    assert extension().isa() in ("avx2", "avx512")
