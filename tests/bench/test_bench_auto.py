"""bench/auto.py (issue 41: automatic reuse for prompts that name no skills) at a tiny load: two embedded services
(automatic reuse on and off), one shipped skill's text as the system prompt, one repeat per API, two distinct
prompts. The repeats must report the system prompt cached through every API."""

import json
import subprocess
import sys

import pytest

from embedded_model import ROOT

pytestmark = pytest.mark.slow


def test_script_reports_the_repeated_system_prompt_cached_through_every_api(tmp_path):
    out = tmp_path / "auto.json"
    p = subprocess.run([sys.executable, "bench/auto.py", "--skills", "style-guide", "--turns", "1", "--distinct", "2",
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["n_system_tokens"] > 300
    for api in ("compose", "chat", "responses", "messages"):
        assert d["repeat"][api]["cached_share_min"] >= 0.9, (api, d["repeat"][api])
    assert d["repeat"]["registered"]["cached_share_min"] >= 0.9  # composed from the registered block
    assert len(d["distinct"]["ttft_ms"]["on"]) == len(d["distinct"]["ttft_ms"]["off"]) == 2
    assert "| chat |" in p.stdout
