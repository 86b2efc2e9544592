"""Fixtures for the deployment tests; the helpers live in deploy_helpers.py (a unique module name)."""

from __future__ import annotations

import pytest

from deploy_helpers import HelmRenderer


@pytest.fixture(scope="session")
def helm_renderer() -> HelmRenderer:
    return HelmRenderer()


@pytest.fixture
def render(helm_renderer):
    if not helm_renderer.available:
        pytest.skip("no Helm renderer: install a `helm` binary or `pip install helm-python-sdk`")
    return helm_renderer.render
