"""The embedded model's converted directory: one per package version, not one per install."""

import os

from service.runtime.loader import EMBEDDED_NAME, embedded_cache_name, remove_stale_conversions


def test_cache_name_survives_a_reinstall(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"x" * 1000)
    before = embedded_cache_name(gguf)
    os.utime(gguf, (1, 1))  # a reinstall of the same version rewrites the file with a new mtime
    assert embedded_cache_name(gguf) == before and before.startswith(f"{EMBEDDED_NAME}-1000-v")
    gguf.write_bytes(b"x" * 1001)  # other bytes: another conversion
    assert embedded_cache_name(gguf) != before


def test_stale_conversions_are_removed(tmp_path):
    keep = tmp_path / f"{EMBEDDED_NAME}-98362432-v0.1.2"
    stale = [tmp_path / f"{EMBEDDED_NAME}-98362432-1795943429", tmp_path / f"{EMBEDDED_NAME}-98362432-v0.1.1"]
    other = tmp_path / "Qwen3-8B"  # not ours
    for d in [keep, *stale, other]:
        d.mkdir()
        (d / "config.json").write_text("{}")
    assert remove_stale_conversions(tmp_path, keep) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([keep.name, other.name])
