"""bench/auto.py (issue 41: automatic reuse for prompts that name no skills) at a tiny load: two embedded services
(automatic reuse on and off), the two shortest shipped skills' texts as the system prompt (two sections), one repeat
per API, one turn per arrangement of the moved sections, two distinct prompts. The repeats must report the system
prompt cached through every API; the moved sections must be composed on the automatic side, and both sides report
their first-token agreement with mode=full (not asserted: a smoke run's few cases decide nothing)."""

import json
import subprocess
import sys

import pytest

from embedded_model import ROOT

pytestmark = pytest.mark.slow


def test_script_reports_the_repeated_system_prompt_cached_through_every_api(tmp_path):
    out = tmp_path / "auto.json"
    p = subprocess.run([sys.executable, "bench/auto.py", "--skills", "style-guide", "shipping-faq", "--turns", "1",
                        "--moved-turns", "1", "--distinct", "2", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["n_system_tokens"] > 300
    for api in ("compose", "chat", "responses", "messages"):
        assert d["repeat"][api]["cached_share_min"] >= 0.9, (api, d["repeat"][api])
    assert d["repeat"]["registered"]["cached_share_min"] >= 0.9  # composed from the registered block
    assert len(d["distinct"]["ttft_ms"]["on"]) == len(d["distinct"]["ttft_ms"]["off"]) == 2
    assert "| chat |" in p.stdout
    moved = d["moved"]
    assert moved["auto"]["composed_share_min"] > 0.5, moved["auto"]  # the sections composed where they now stand
    for side in ("auto", "registered"):
        assert isinstance(moved[side]["agree"], int) and moved[side]["cases"] == len(moved["arrangements"]) >= 3
        assert 0 <= moved[side]["agree"] <= moved[side]["cases"]
    assert "| auto |" in p.stdout and "| registered |" in p.stdout
    assert d["distinct"]["p90_on"] >= d["distinct"]["p50_on"] > 0
