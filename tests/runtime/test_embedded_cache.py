"""The embedded model's converted directory: named for the GGUF's content, so a reinstall of the same package
(same bytes, new mtime, maybe a new venv path) keeps it and other bytes get another one."""

import os
import shutil

from service.runtime.gguf import GGUFSource, conversion_dir
from service.runtime.loader import EMBEDDED_NAME, gguf_source


def test_embedded_is_a_gguf_source_like_any_other():
    src = gguf_source("embedded")
    assert src.name == EMBEDDED_NAME and src.origin == "embedded" and src.path.suffix == ".gguf"


def test_conversion_dir_survives_a_reinstall(tmp_path):
    gguf = tmp_path / "venv1" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"x" * 1000)
    cache = tmp_path / "fingerprints.json"
    before = conversion_dir(GGUFSource(gguf, EMBEDDED_NAME, "embedded"), tmp_path, cache)
    assert before.name.startswith(f"{EMBEDDED_NAME}-") and len(before.name) == len(EMBEDDED_NAME) + 17
    os.utime(gguf, (1, 1))  # a reinstall of the same version rewrites the file with a new mtime
    moved = tmp_path / "venv2" / "model.gguf"  # or a new venv
    moved.parent.mkdir()
    shutil.copy(gguf, moved)
    for path in (gguf, moved):
        assert conversion_dir(GGUFSource(path, EMBEDDED_NAME, "embedded"), tmp_path, cache) == before
    gguf.write_bytes(b"y" * 1000)  # other bytes, same size: another conversion
    assert conversion_dir(GGUFSource(gguf, EMBEDDED_NAME, "embedded"), tmp_path, cache) != before
