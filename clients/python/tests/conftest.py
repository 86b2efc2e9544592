"""Fixtures for the client tests; they run from the repository root's pytest too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
CLIENT_ROOT = TESTS_DIR.parent
SKILLS_DIR = CLIENT_ROOT.parents[1] / "skills"
for p in (str(CLIENT_ROOT), str(TESTS_DIR)):  # the package without `pip install -e`, and the helpers
    if p not in sys.path:
        sys.path.insert(0, p)

from skillcache_fakes import FakeServer  # noqa: E402


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


@pytest.fixture
def skills_dir() -> Path:
    return SKILLS_DIR
