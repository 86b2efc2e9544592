"""Store exceptions: ServiceErrors like every other, with their HTTP status and stable `error_type`."""

from __future__ import annotations

from service.errors import ServiceError

# Stable reasons for CorruptBlock (also the `reason` label of STORE_CORRUPT).
REASON_FORMAT = "format"  # not a parsable safetensors payload / manifest, or fields missing
REASON_LAYOUT = "layout"  # stored layout_version differs from the key's
REASON_FINGERPRINT = "fingerprint"  # stored model fingerprint differs from the key's
REASON_KEY = "key"  # stored namespace / content hash differs from the key's
REASON_SHAPE = "shape"  # tensor names, ranks or sizes inconsistent
REASON_DTYPE = "dtype"  # tensors of mixed or unexpected dtype
REASON_CHECKSUM = "checksum"  # tensor bytes do not match the stored sha256
REASON_CHUNKS = "chunks"  # Redis: a chunk missing, or size / sha256 of the payload wrong
REASON_STALE = "stale"  # written by an older payload format: a clean miss, never counted as corruption


class StoreError(ServiceError):
    """Base of every store error."""

    status, error_type = 503, "store_error"


class StoreUnavailable(StoreError):
    """A backend cannot be reached (Redis down, timeout, unreadable disk)."""

    status, error_type = 503, "store_unavailable"


class StoreWriteError(StoreError):
    """A backend refused a write (disk full, read-only, permission, Redis OOM). Reads may still work."""

    status, error_type = 507, "store_write_failed"


class CorruptBlock(StoreError):
    """A stored block failed verification. `reason` is one of the REASON_* strings."""

    status, error_type = 503, "corrupt_block"

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"corrupt block ({reason}){': ' + detail if detail else ''}")
        self.reason = reason
        self.detail = detail


class StaleBlock(CorruptBlock):
    """A block in an older payload format: dropped and recompiled like a corrupt one, but logged at info
    and not counted in STORE_CORRUPT (an upgrade is not damage)."""

    def __init__(self, detail: str = "") -> None:
        super().__init__(REASON_STALE, detail)
