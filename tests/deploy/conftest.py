"""Fixtures for the deployment tests; the helpers live in deploy_helpers.py (a unique module name)."""

from __future__ import annotations

import pytest

from deploy_helpers import HelmRenderer
from deploy_helpers import missing


@pytest.fixture(scope="session")
def helm_renderer() -> HelmRenderer:
    return HelmRenderer()


NO_AUTH = {"config": {"SKILLCACHE_ALLOW_NO_AUTH": "1"}}


@pytest.fixture
def render(helm_renderer):
    """helm_renderer.render, with config.SKILLCACHE_ALLOW_NO_AUTH "1" added when the values configure no API keys
    (without either the chart refuses to render: tests/deploy/test_deploy_helm.py, test_no_keys_fails)."""
    if not helm_renderer.available:
        missing("no Helm renderer: install a `helm` binary or `pip install helm-python-sdk`")

    def render(values: dict | None = None):
        values = dict(values or {})
        keys = values.get("apiKeys", {})
        if not keys.get("existingSecret") and not keys.get("keys"):
            values["config"] = {**NO_AUTH["config"], **values.get("config", {})}
        return helm_renderer.render(values)

    return render
