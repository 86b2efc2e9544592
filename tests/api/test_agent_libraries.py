"""Typed answers through the agent libraries users call, unchanged, at their current releases (tests/agent_libs.py),
on the embedded engine with a tiny random-weight model and sampling on: without the grammar such a model writes
anything, so each library getting its pydantic model back means the reply parsed and validated. The vLLM engine runs
the same calls in tests/engines_vllm/test_vllm_e2e.py."""

from __future__ import annotations

import pytest
from pydantic import ConfigDict

from agent_libs import LIBRARIES
from appclient import make_client
from test_structured_outputs import Weather


class Report(Weather):
    """No other keys: a library that sends pydantic's own schema (instructor) leaves extra properties open, and a
    random model would add keys until max_tokens where a real one stops."""

    model_config = ConfigDict(extra="forbid")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with make_client(tmp_path_factory.mktemp("agent-libs")) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        assert c.post("/v1/skills", json={"name": "policy", "text": "Answer about the weather."}).status_code \
            in (200, 201)
        yield c


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("library", sorted(LIBRARIES))
def test_the_library_gets_its_model_back(client, library, seed):
    extra = {"skills": ["policy"]} if seed else None  # composed skills or none: the constraint acts on decode only
    out = LIBRARIES[library](client, Report, "Weather?", max_tokens=200, seed=seed, extra=extra)
    assert isinstance(out, Report), out
