"""service/runtime/allocator.py: glibc's malloc keeps freed memory (the settings apply here), and a C library
without mallopt is left as it is."""

import ctypes
import platform

import pytest

from service.runtime import allocator


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_glibc_takes_the_settings():
    assert allocator.keep_freed_memory()


def test_a_libc_without_mallopt_is_left_alone(monkeypatch):
    class NoMallopt:
        def __init__(self, *_):
            pass

    monkeypatch.setattr(ctypes, "CDLL", NoMallopt)
    assert allocator.keep_freed_memory() is False


def test_a_refused_setting_is_reported(monkeypatch):
    class Refusing:
        def __init__(self, *_):
            self.mallopt = lambda param, value: 0 if param == allocator.M_MMAP_THRESHOLD else 1

    monkeypatch.setattr(ctypes, "CDLL", Refusing)
    assert allocator.keep_freed_memory() is False
