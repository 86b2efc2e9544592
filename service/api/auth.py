"""API keys, tenants and roles; per-key rate limits.

Keys come from `SKILLCACHE_API_KEYS_FILE`, a JSON list of `{"key" | "key_sha256", "namespace", "role"}`,
read once at startup. A request sends `Authorization: Bearer <key>` (or `x-api-key: <key>`, as the anthropic SDK
does); the key's SHA-256 is compared with
every configured digest in constant time (hmac.compare_digest), so neither timing nor the plain keys in
memory reveal which key matched. A key binds the request to its namespace (skills, blocks, sessions and
the `namespace` metric label) and to a role:

    user   compose, chat completions, sessions, list and read skills, /v1/models
    admin  everything `user` may do, plus register and delete skills

No key or an unknown key: 401 `unauthorized` with `WWW-Authenticate: Bearer`. A role that may not do the
action: 403 `forbidden`. Another tenant's skill is simply not in the caller's namespace: 404.

Modes (`SKILLCACHE_AUTH`, default: `keys` when a keys file is set, else `off`):
    keys  every /v1 request needs a key; starting without a readable, valid, non-empty file fails.
    off   no keys: every caller is admin of the namespace "default". Served only on a loopback address
          unless `SKILLCACHE_ALLOW_NO_AUTH=1` (check_exposure, called by `python -m service`).
`/livez`, `/readyz`, `/metrics` and the OpenAPI document are always open.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import math
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.config import Settings
from service.errors import Forbidden, RateLimited, Unauthorized

log = logging.getLogger(__name__)

ROLES = {"user": 1, "admin": 2}  # a role may do what any lower one may
OPEN_NAMESPACE = "default"
MIN_KEY_CHARS = 16
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# A tenant namespace: no dots, so it never collides with internal ones such as "<ns>.sessions".
_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_KEY_CHARS = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII, no spaces: survives an HTTP header intact
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


class AuthConfigError(Exception):
    """The auth settings or the keys file are unusable: the service must not start."""


@dataclass(frozen=True)
class ApiKey:
    digest: bytes  # sha256 of the key
    namespace: str
    role: str

    @property
    def key_id(self) -> str:
        """A short, non-secret id of the key (log lines, rate-limit buckets)."""
        return self.digest.hex()[:12]


@dataclass(frozen=True)
class Principal:
    """Who is calling: their namespace, role and key id (None when auth is off)."""

    namespace: str
    role: str
    key_id: str | None = None

    def may(self, role: str) -> bool:
        return ROLES[self.role] >= ROLES[role]


def load_keys(path: Path) -> list[ApiKey]:
    """Parse and validate a keys file. Raises AuthConfigError naming the entry at fault."""
    def no_repeats(pairs: list[tuple[str, object]]) -> dict:
        names = [name for name, _ in pairs]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:  # json keeps the last silently: a merge slip could widen a role or move a key to another tenant
            raise ValueError(f"an entry gives {repeated} more than once")
        return dict(pairs)

    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"), object_pairs_hook=no_repeats)
    except OSError as e:
        raise AuthConfigError(f"SKILLCACHE_API_KEYS_FILE {path}: cannot read it: {e}") from e
    except ValueError as e:
        raise AuthConfigError(f"SKILLCACHE_API_KEYS_FILE {path}: not valid JSON: {e}") from e
    if not isinstance(raw, list) or not raw:
        raise AuthConfigError(f"SKILLCACHE_API_KEYS_FILE {path}: must be a non-empty JSON list of key entries")
    keys: list[ApiKey] = []
    for i, entry in enumerate(raw):
        where = f"SKILLCACHE_API_KEYS_FILE {path}, entry {i}"
        if not isinstance(entry, dict):
            raise AuthConfigError(f"{where}: must be an object")
        unknown = set(entry) - {"key", "key_sha256", "namespace", "role", "name", "comment"}
        if unknown:
            raise AuthConfigError(f"{where}: unknown fields {sorted(unknown)}")
        if ("key" in entry) == ("key_sha256" in entry):
            raise AuthConfigError(f"{where}: give exactly one of 'key' and 'key_sha256'")
        if "key" in entry:
            key = entry["key"]
            if not isinstance(key, str) or len(key) < MIN_KEY_CHARS or not _KEY_CHARS.fullmatch(key):
                raise AuthConfigError(
                    f"{where}: 'key' must be at least {MIN_KEY_CHARS} printable ASCII characters without spaces")
            digest = hashlib.sha256(key.encode()).digest()
        else:
            hexd = entry["key_sha256"]
            if not isinstance(hexd, str) or not _HEX64.fullmatch(hexd.lower()):
                raise AuthConfigError(f"{where}: 'key_sha256' must be 64 hex digits (sha256 of the key)")
            digest = bytes.fromhex(hexd)
        namespace = entry.get("namespace")
        if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
            raise AuthConfigError(f"{where}: 'namespace' must match {_NAMESPACE.pattern} (1-64 letters, digits, "
                                  "'_' or '-'; dots are reserved)")
        role = entry.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise AuthConfigError(f"{where}: 'role' must be one of {sorted(ROLES)}, not {role!r}")
        if any(hmac.compare_digest(digest, k.digest) for k in keys):
            raise AuthConfigError(f"{where}: the same key appears twice")
        keys.append(ApiKey(digest, namespace, role))
    return keys


def auth_mode(settings: Settings) -> str:
    """"keys" or "off", from SKILLCACHE_AUTH and SKILLCACHE_API_KEYS_FILE. Raises on a contradiction."""
    mode = settings.auth or ("keys" if settings.api_keys_file else "off")
    if mode == "keys" and not settings.api_keys_file:
        raise AuthConfigError("SKILLCACHE_AUTH=keys needs SKILLCACHE_API_KEYS_FILE (a JSON list of keys)")
    if mode == "off" and settings.api_keys_file:
        raise AuthConfigError(
            "SKILLCACHE_AUTH=off and SKILLCACHE_API_KEYS_FILE are both set: unset one of them")
    return mode


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(settings: Settings, host: str) -> None:
    """Refuse to serve without keys on anything but a loopback address, unless explicitly allowed."""
    if auth_mode(settings) == "off" and not is_loopback(host) and not settings.allow_no_auth:
        raise AuthConfigError(
            f"refusing to listen on {host} without authentication: set SKILLCACHE_API_KEYS_FILE (API keys), "
            "bind to 127.0.0.1, or set SKILLCACHE_ALLOW_NO_AUTH=1 to run open on purpose")


class RateLimiter:
    """A token bucket per caller: `rps` tokens a second, at most `burst` saved up. Bounded in callers."""

    def __init__(self, rps: float, burst: int = 0, max_buckets: int = 10_000) -> None:
        self.rps = float(rps)
        self.burst = float(burst or max(1, math.ceil(rps)))
        self.max_buckets = max_buckets
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # who -> (tokens, at)

    def acquire(self, who: str, now: float | None = None) -> float:
        """Take one token: 0.0 if granted, else the seconds until one is available."""
        now = time.monotonic() if now is None else now
        tokens, at = self._buckets.pop(who, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rps)
        granted = tokens >= 1.0
        if granted:
            tokens -= 1.0
        self._buckets[who] = (tokens, now)  # most recently used last
        while len(self._buckets) > self.max_buckets:
            self._buckets.popitem(last=False)  # forgetting an idle caller only refills its bucket
        return 0.0 if granted else (1.0 - tokens) / self.rps


class Authenticator:
    """Built once per app (create_app), so a bad keys file stops the start instead of the first request."""

    def __init__(self, settings: Settings) -> None:
        self.mode = auth_mode(settings)
        self.keys: list[ApiKey] = load_keys(settings.api_keys_file) if self.mode == "keys" else []
        self.limiter = RateLimiter(settings.rate_limit_rps, settings.rate_limit_burst) \
            if settings.rate_limit_rps > 0 else None
        if self.mode == "keys":
            log.info("auth: %d API keys, namespaces %s", len(self.keys), sorted({k.namespace for k in self.keys}))
        else:
            log.warning("auth: off; every caller is admin of namespace %r", OPEN_NAMESPACE)

    def lookup(self, presented: str) -> ApiKey | None:
        """The entry for `presented`, comparing digests in constant time against every entry."""
        digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        found = None
        for k in self.keys:  # no early exit: the time does not depend on which entry matched
            if hmac.compare_digest(digest, k.digest):
                found = k
        return found

    def authenticate(self, token: str | None, client: str | None) -> Principal:
        if self.mode == "off":
            principal = Principal(OPEN_NAMESPACE, "admin")
            bucket = f"client:{client or '?'}"
        else:
            if not token:
                raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'", headers=_CHALLENGE)
            entry = self.lookup(token)
            if entry is None:
                raise Unauthorized("unknown API key", headers=_CHALLENGE)
            principal = Principal(entry.namespace, entry.role, entry.key_id)
            bucket = f"key:{entry.key_id}"
        if self.limiter is not None:
            wait = self.limiter.acquire(bucket)
            if wait > 0:
                raise RateLimited(
                    f"rate limit of {self.limiter.rps:g} requests/s exceeded (SKILLCACHE_RATE_LIMIT_RPS)",
                    retry_after_s=max(1, math.ceil(wait)),
                )
        return principal


_bearer = HTTPBearer(auto_error=False, description="An API key from SKILLCACHE_API_KEYS_FILE")


async def authenticate(
    request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The dependency every /v1 router carries (main.py). Also records the caller for the metrics label."""
    principal = getattr(request.state, "principal", None)
    if principal is None:
        auth: Authenticator = request.app.state.auth
        client = request.client.host if request.client else None
        # the anthropic SDK sends its key as `x-api-key` (the Messages API): the same keys, the same check
        key = creds.credentials if creds else request.headers.get("x-api-key")
        principal = auth.authenticate(key, client)
        request.state.principal = principal
    return principal


def require_role(role: str):
    """A dependency that admits callers whose role is `role` or higher (403 otherwise)."""

    async def check(principal: Annotated[Principal, Depends(authenticate)]) -> Principal:
        if not principal.may(role):
            raise Forbidden(f"this API key's role {principal.role!r} may not do this; it needs {role!r}")
        return principal

    return check


RequireAdmin = Depends(require_role("admin"))
