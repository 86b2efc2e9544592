"""Every Prometheus metric, defined once. Names: skillcache_<noun>_<unit>; counters end in _total."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

REQUESTS = Counter("skillcache_requests_total", "HTTP requests (namespace: the caller's; empty when unauthenticated)",
                   ["route", "status", "namespace"])
ERRORS = Counter("skillcache_errors_total", "Errors returned, by stable error_type", ["error_type"])
TTFT = Histogram("skillcache_ttft_seconds", "Time to first token", ["mode"], buckets=_LATENCY_BUCKETS)
STAGE = Histogram(
    "skillcache_stage_seconds", "Time per request stage (compile, store, prefill, decode)", ["stage"],
    buckets=_LATENCY_BUCKETS,
)
TOKENS = Counter("skillcache_prompt_tokens_total", "Prompt tokens by how they were obtained", ["kind"])
SKILL_HITS = Counter("skillcache_skill_hits_total", "Skill blocks served, by tier", ["tier"])
COMPILES = Counter("skillcache_compiles_total", "Skill blocks compiled")
QUEUE_DEPTH = Gauge("skillcache_queue_depth", "Requests waiting for the inference worker")

# store
STORE_OPS = Histogram(
    "skillcache_store_op_seconds", "Store operation latency", ["tier", "op"], buckets=_LATENCY_BUCKETS
)
STORE_CORRUPT = Counter(
    "skillcache_store_corrupt_total", "Blocks rejected on load (checksum, shape, fingerprint, chunks)",
    ["tier", "reason"],
)
STORE_ERRORS = Counter("skillcache_store_errors_total", "Backend errors (I/O, connection)", ["tier"])
STORE_UP = Gauge("skillcache_store_up", "1 when a backend is reachable", ["tier"])
MEMORY_BYTES = Gauge("skillcache_memory_tier_bytes", "Bytes held by the memory tier")
STORE_EVICTIONS = Counter("skillcache_store_evictions_total", "Blocks evicted to stay within a tier's size cap",
                          ["tier"])

# fidelity: calibration and shadow verification
CALIBRATIONS = Counter("skillcache_calibrations_total", "Seam calibrations run", ["result"])
SHADOW_CHECKS = Counter("skillcache_shadow_checks_total", "Compose requests re-run in full off the hot path",
                        ["result"])
SHADOW_COSINE = Histogram("skillcache_shadow_cosine", "First-token logit cosine, compose vs full (shadow)",
                          buckets=(0.9, 0.99, 0.995, 0.999, 0.9995, 0.9999, 1.0))
REFINED_PREFIXES = Counter("skillcache_refined_prefixes_total",
                           "Repeated skill sequences prefilled in full when idle, kept as exact prefixes")
DEGRADED_SKILLS = Gauge("skillcache_degraded_skills", "Skills served by full prefill after a failed shadow check")

# sessions
SESSIONS_EXPIRED = Counter("skillcache_sessions_expired_total",
                           "Saved sessions deleted after SKILLCACHE_SESSION_STORE_TTL_S with no turn")
