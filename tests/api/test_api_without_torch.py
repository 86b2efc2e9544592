"""The API stage never imports torch (nor transformers, safetensors, numpy): the app module and every route import
with those blocked. Tensor work is reached through the engine, imported where a model is bound."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = """
import importlib, importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "transformers", "safetensors", "numpy"):
            raise ImportError(f"{name} is blocked: the API must import without it")
sys.meta_path.insert(0, Block())
import pkgutil, service.api
for m in ["service.main", *(i.name for i in pkgutil.walk_packages(service.api.__path__, "service.api."))]:
    importlib.import_module(m)  # every module of the API, the new ones too
print("imported", sorted(k for k in sys.modules if k.split(".")[0] in ("torch", "transformers")))
"""


def test_the_api_imports_without_torch():
    out = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "imported []"
