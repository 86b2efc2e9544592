"""Crash-safe file writes (temp + fsync + rename + dir fsync) and OSError -> StoreWriteError mapping."""

from __future__ import annotations

import errno
import logging
import os
import secrets
import time
from pathlib import Path

from service.store.errors import StoreWriteError

log = logging.getLogger(__name__)

# Indirections so tests can inject the kernel's errors (ENOSPC, EROFS) without patching `os` globally.
_write = os.write
_replace = os.replace

TEMP_SUFFIX = ".tmp"  # temp files are ".<final name>.<random>.tmp"; readers never look at them


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename / create inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_dir(path: Path) -> None:
    """mkdir -p, fsyncing the parent of every directory it creates."""
    missing: list[Path] = []
    p = path
    while not p.is_dir():
        if p.exists() and not p.is_dir():  # not a bare exists(): another thread may have just created it
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(p))
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            if not d.is_dir():
                raise
            continue
        fsync_dir(d.parent)


def atomic_write(path: Path, data: bytes | memoryview) -> None:
    """Write `data` to `path` so that a reader (or a crash) sees the old file or the new one, never half."""
    ensure_dir(path.parent)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}{TEMP_SUFFIX}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                n = _write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        _replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_error(exc: OSError, root: Path, what: str) -> StoreWriteError:
    """A StoreWriteError whose message says what is wrong with `root` and what to do about it."""
    code = exc.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        hint = "no space left on device: free space there or set SKILLCACHE_HOME to a larger volume"
    elif code == errno.EROFS:
        hint = "the filesystem is read-only: remount it read-write or set SKILLCACHE_HOME to a writable directory"
    elif code in (errno.EACCES, errno.EPERM):
        hint = "permission denied: make it writable by this user or set SKILLCACHE_HOME elsewhere"
    elif code in (errno.ENOTDIR, errno.EEXIST):
        hint = "a path component is a file, not a directory: remove it or set SKILLCACHE_HOME elsewhere"
    else:
        hint = f"{exc.strerror or exc}"
    err = StoreWriteError(f"{what} at {root} cannot be written ({errno.errorcode.get(code or 0, code)}): {hint}")
    err.errno = code  # type: ignore[attr-defined]
    return err


def sweep_temp(root: Path, max_age_s: float = 3600.0) -> int:
    """Remove temp files older than `max_age_s` left by a crash mid-write. Returns how many."""
    removed = 0
    cutoff = time.time() - max_age_s
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            if f.startswith(".") and f.endswith(TEMP_SUFFIX):
                p = Path(dirpath) / f
                try:
                    if p.stat().st_mtime < cutoff:
                        p.unlink()
                        removed += 1
                except OSError:
                    pass
    if removed:
        log.info("removed %d stale temp files under %s", removed, root)
    return removed
