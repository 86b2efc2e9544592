"""`SKILLCACHE_MODEL=<the Gemma-3 GGUF> SKILLCACHE_CHAT_TEMPLATE=gemma python -m service` (what `make run` runs)
as a real process: it becomes ready with the override's template and composes the shipped skills."""

import shutil

import httpx
import pytest

from gemma_model import gemma_gguf

from service.devserver import ROOT, ServiceNotReady, ServiceProcess

pytestmark = pytest.mark.slow
SKILLS = ["refund-policy", "style-guide"]


def test_service_on_the_gemma_gguf_composes_shipped_skills(tmp_path, gemma_runtime):
    # gemma_runtime: the conversion exists in the caller's model cache, so this start is a load, not a conversion.
    # Two of the shipped skills are preloaded (compiling all six would add ~20 s of CPU for no other path).
    skills = tmp_path / "skills"
    skills.mkdir()
    for name in SKILLS:
        shutil.copy(ROOT / "skills" / f"{name}.md", skills)
    env = {"SKILLCACHE_MODEL": str(gemma_gguf()), "SKILLCACHE_CHAT_TEMPLATE": "gemma", "SKILLCACHE_DEVICE": "cpu",
           "SKILLCACHE_SKILLS_DIR": str(skills), "SKILLCACHE_SEAM_AUTO": "0"}
    with ServiceProcess(tmp_path / "home", env, threads=None) as svc:
        try:
            ready = svc.wait_ready(300).json()
        except ServiceNotReady as e:
            pytest.fail(str(e))
        assert ready["model"] == "gemma-3-270m-q4_k_m"
        assert ready["model_fingerprint"] == gemma_runtime.fingerprint  # same file, template, dtype: same blocks
        assert ready["chat_template"]["source"] == "builtin" and ready["chat_template"]["name"] == "gemma"
        assert not ready["chat_template"]["plain_text_fallback"] and ready["selfcheck"]["ok"]
        assert sorted(ready["skills_preloaded"]) == SKILLS
        assert all("error" not in v for v in ready["skills_preloaded"].values())
        body = {"skills": SKILLS, "max_tokens": 8,
                "user": "My order arrived 10 days ago, unused. Refund? Answer APPROVE or DENY."}
        r = httpx.post(f"{svc.url}/v1/compose", json=body, timeout=300)
        assert r.status_code == 200, r.text
        out = r.json()
        print(f"ready in {svc.ready_s:.1f} s; compose ttft {out['timings']['ttft_ms']:.0f} ms, usage {out['usage']}, "
              f"text {out['text']!r}")
        assert out["usage"]["reused_tokens"] > 1200 and out["skills"][0]["seam"] == 0
        assert out["usage"]["completion_tokens"] >= 1
        assert httpx.get(f"{svc.url}/v1/models").json()["data"][0]["id"] == "gemma-3-270m-q4_k_m"
    assert "chat template: builtin gemma" in svc.log_path.read_text()
