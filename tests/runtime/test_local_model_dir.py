"""SKILLCACHE_MODEL as a local directory (what `save_pretrained` writes), loaded through build_runtime
exactly as the service does (SKILLCACHE_TORCH_THREADS is the serving engine's: tests/runtime/test_serving_engine.py)."""

import torch

from tiny import tiny_config, tiny_tokenizer

from service.config import Settings
from service.runtime import build_runtime
from service.runtime.loader import build_random_model


def test_local_directory_model_composes_like_full_recompute(tmp_path):
    src = build_random_model(tiny_config("qwen3"), tiny_tokenizer(), seed=3)
    model_dir = tmp_path / "my-model"
    src.model.save_pretrained(model_dir)
    src.tokenizer.save_pretrained(model_dir)

    rt = build_runtime(Settings(model=str(model_dir), device="cpu", home=tmp_path / "home", skills_dir=None))
    assert rt.loaded.name == str(model_dir)
    assert rt.loaded.source_files == [model_dir / "model.safetensors"]  # what the fingerprint hashes

    skill = rt.prompts.encode_content("Refunds are allowed within 30 days of delivery when the item is unused.")
    block = rt.compile_block(skill)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Refund?"}]
    plan = rt.prompts.build(msgs, [skill])
    whole = rt.prefill(plan, [block], mode="compose", seam_tokens=len(skill))  # seam = whole block: exact
    full = rt.prefill(plan, [block], mode="full")
    torch.testing.assert_close(whole.logits, full.logits, rtol=1e-4, atol=1e-4)
    moved = rt.prefill(plan, [block], mode="compose", seam_tokens=0)
    assert moved.n_reused == len(skill)
    # the weights of the directory, not some other checkpoint: same logits as the model it was saved from
    with torch.inference_mode():
        ids = torch.tensor([plan.ids])
        torch.testing.assert_close(rt.model(input_ids=ids).logits, src.model(input_ids=ids).logits)
