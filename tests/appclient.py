"""An in-process app (TestClient, lifespan run) on a tiny random-weight model."""

from fastapi.testclient import TestClient

from service.config import Settings
from service.main import create_app
from tiny import tiny_runtime


def make_client(tmp_path, runtime=None, **overrides) -> TestClient:
    # fidelity guard off by default here: random weights say nothing about fidelity (tests/test_guard.py)
    base = {"home": tmp_path, "store": "disk", "skills_dir": None, "seam_auto": False, "shadow_sample_rate": 0.0}
    settings = Settings(**{**base, **overrides})
    return TestClient(create_app(settings, runtime=runtime or tiny_runtime("llama")))
