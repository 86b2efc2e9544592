"""BlockKey: the identity of one stored KV block (never a skill name alone)."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Every component becomes a path segment and part of a Redis hash tag: keep it to a safe alphabet.
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(value: str, what: str = "name") -> str:
    """Return `value` if it is a safe path segment / key component, else raise ValueError."""
    if not isinstance(value, str) or not SAFE_NAME.fullmatch(value):
        raise ValueError(f"invalid {what} {value!r}: must match {SAFE_NAME.pattern}")
    return value


@dataclass(frozen=True)
class BlockKey:
    """Model fingerprint + layout version + namespace + content hash of the skill text."""

    model_fingerprint: str
    layout_version: int
    namespace: str
    content_hash: str

    def __post_init__(self) -> None:
        check_name(self.model_fingerprint, "model_fingerprint")
        check_name(self.namespace, "namespace")
        check_name(self.content_hash, "content_hash")
        if not isinstance(self.layout_version, int) or isinstance(self.layout_version, bool) \
                or self.layout_version < 0:
            raise ValueError(f"invalid layout_version {self.layout_version!r}")

    def to_str(self) -> str:
        """Stable string form: `v<layout>/<namespace>/<model_fp>/<content_hash>`."""
        return f"v{self.layout_version}/{self.namespace}/{self.model_fingerprint}/{self.content_hash}"

    @classmethod
    def from_str(cls, s: str) -> "BlockKey":
        """Inverse of to_str(); raises ValueError on anything else."""
        parts = s.split("/")
        if len(parts) != 4 or not parts[0].startswith("v") or not parts[0][1:].isdigit():
            raise ValueError(f"not a block key: {s!r}")
        return cls(model_fingerprint=parts[2], layout_version=int(parts[0][1:]),
                   namespace=parts[1], content_hash=parts[3])

    def __str__(self) -> str:
        return self.to_str()
