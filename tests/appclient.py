"""An in-process app (TestClient, lifespan run) on a tiny random-weight model."""

from fastapi.testclient import TestClient

from service.config import Settings
from service.main import create_app
from tiny import tiny_runtime


def make_client(tmp_path, runtime=None, **overrides) -> TestClient:
    settings = Settings(home=tmp_path, store="disk", skills_dir=None, **overrides)
    return TestClient(create_app(settings, runtime=runtime or tiny_runtime("llama")))
