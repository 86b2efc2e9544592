"""skillcache in vLLM mode never reads a weight: tokenizer, config, RoPE and planner only; vLLM runs the model.

The service starts on the embedded model with SKILLCACHE_ENGINE=vllm while every way transformers and safetensors
read weights is made to fail; it must come up, register a skill and plan with its prompts. vLLM itself is not needed:
the engine points at a port nothing answers, so readiness says the engine is down and nothing else is missing.
"""

from __future__ import annotations

import time

import pytest
import safetensors
import safetensors.torch
import torch
from fastapi.testclient import TestClient
from transformers import PreTrainedModel

from embedded_model import embedded_settings
from service.devserver import free_port
from service.main import create_app
from service.vllm.launch import model_dir


def _refuse(*args, **kwargs):
    raise AssertionError("skillcache in vLLM mode read model weights")


@pytest.fixture
def weightless(monkeypatch):
    model_dir(embedded_settings())  # the GGUF's conversion (once, shared), before anything is watched
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(_refuse))
    monkeypatch.setattr(safetensors, "safe_open", _refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", _refuse)
    monkeypatch.setattr(torch, "load", _refuse)


def test_vllm_mode_starts_plans_and_holds_no_weights(weightless, tmp_path):
    base = embedded_settings()
    settings = embedded_settings(home=tmp_path, model_cache=base.models_dir, engine="vllm", skills_dir=None,
                                 vllm_url=f"http://127.0.0.1:{free_port()}", vllm_dtype="bfloat16")
    app = create_app(settings)
    with TestClient(app) as c:
        deadline = time.monotonic() + 120
        while (body := c.get("/readyz").json()).get("phase") not in (None, "ready") or \
                app.state.skillcache.pipeline is None:
            assert body.get("error") is None and time.monotonic() < deadline, body
            time.sleep(0.2)
        state = app.state.skillcache
        rt = state.runtime
        assert not rt.holds_weights
        assert {p.device.type for p in rt.loaded.model.parameters()} == {"meta"}  # the modules' shapes, no tensors
        ready = c.get("/readyz").json()
        assert ready["engine"].startswith("vllm: down") and ready["model_weights"] == "vllm"  # only vLLM is missing
        r = c.post("/v1/skills", json={"name": "returns", "text": "Items may be returned within 30 days."})
        assert r.status_code in (200, 201), r.text
        assert r.json()["n_tokens"] == len(rt.prompts.encode_content("Items may be returned within 30 days."))
        assert rt.fingerprint != ""  # the weight files' bytes, the config, tokenizer and vLLM's dtype
        assert "bfloat16" in str(rt.loaded.dtype)
