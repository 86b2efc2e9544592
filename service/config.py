"""All settings, read once from SKILLCACHE_* environment variables (or a .env file)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SKILLCACHE_", env_file=".env", extra="ignore")

    # model
    model: str = Field("embedded", description="'embedded' (SmolLM2-135M-Instruct), a .gguf file (converted once "
                       "into model_cache), a HF id or a local directory")
    chat_template: str | None = Field(None, description="override the tokenizer's chat template: a Jinja file or "
                                      "chatml, gemma, llama3. Unset: the tokenizer's; none there: plain text")
    device: str = Field("auto", description="'auto' (cuda if present), 'cpu', 'cuda', 'cuda:1'...")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["none", "int8", "w8a8"] = Field(
        "none", description="CPU weight formats of the linear layers: int8 (weights int8 per output channel, "
        "activations bfloat16), w8a8 (int8 weights and int8 activations with one scale per token); norms, "
        "attention and K/V stay in `dtype`. docs/BENCHMARKS.md 'CPU weight formats' has speed and quality")
    packed_decode: bool = Field(True, description="CPU, float32: linears whose weights are exactly GGUF Q4_1/Q8_0 "
                                "blocks (the embedded model's) run inputs of up to 8 rows (decode steps, seams) on the "
                                "blocks through a C++ kernel, prefill chunks on float32 matmuls; the same weights in "
                                "float32 arithmetic. About 2x per one-row decode step (docs/BENCHMARKS.md, 'Packed "
                                "decode'). Built at the first start (~35 s) with a C++ compiler and ninja; without "
                                "them the service logs a warning and stays on float32 matmuls")
    attention_kernel: bool = Field(True, description="CPU, sdpa models: decode steps' attention (float32) on a C++ "
                                   "kernel that reads each key and value once for the query heads sharing it, and "
                                   "masked prefills (tails, seams) on sdpa's grouped-query path instead of copying "
                                   "K/V per query head (docs/BENCHMARKS.md, 'Decode attention'); built with packed "
                                   "decode's kernel. Off, or without a compiler: transformers' sdpa as it is")
    shared_kv_reads: bool = Field(True, description="with the attention kernel: decode batch rows that hold the "
                                  "same K/V in whole 256-token chunks (requests on the same skills, up to where "
                                  "their texts part) read those chunks from one row, so they come from memory once "
                                  "a step; the same numbers, bitwise (docs/BENCHMARKS.md, 'Serving engine'). Off: "
                                  "each row reads its own copy, for A/B")
    home: Path = Field(Path("~/.cache/skillcache").expanduser(), description="model cache and disk store")
    model_cache: Path | None = Field(None, description="converted models (default <home>/models)")
    torch_threads: int = Field(0, ge=0, description="torch intra-op CPU threads of the model's thread (every other "
                               "thread gets one); 0: one per CPU this process may run on. Set it to the cores this "
                               "replica really has when several share a machine")

    # engine (service/engines/): who runs the prompt after composition
    engine: Literal["embedded", "vllm"] = Field(
        "embedded", description="embedded: this process's model thread (make run); vllm: a vLLM server runs the "
        "model (make run-vllm, docs/OPERATIONS.md 'vLLM engine'). Composition then runs inside vLLM: vLLM compiles "
        "each block once and computes the seams and the turn, skillcache's KV connector copies the saved K/V "
        "re-rotated; skillcache plans it and runs no forward pass per request")
    vllm_url: str = Field("http://127.0.0.1:8100", description="the vLLM servers' base URLs, comma-separated "
                          "(engine=vllm): one, or several replicas; a composition goes to the first of them in its "
                          "rendezvous-hash order that answers (service/vllm/client.py, VllmPool)")
    vllm_shared_spans: bool = Field(False, description="engine vllm: the connectors share their saved records "
                                    "through Redis (SKILLCACHE_REDIS_URL) behind each replica's spans dir, and "
                                    "skillcache asks that Redis whether a block is saved before it has vLLM compile "
                                    "it: a block compiled through one replica is loaded by the others. Off: each "
                                    "replica's spans dir alone")
    vllm_model: str | None = Field(None, description="the model name vLLM serves; unset: the first of its /v1/models")
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the dtype vLLM runs in (its --dtype; make run-vllm passes this). auto: the one vLLM runs "
        "fastest here: bfloat16 on a GPU or a CPU with AVX-512 BF16 or AMX, float32 on other CPUs (bfloat16 there ran "
        "a 2.3k-token prefill 4-5x slower: docs/BENCHMARKS.md, 'vLLM engine'); the choice is logged at start")
    vllm_venv: Path = Field(Path(".venv-vllm"), description="the venv `make run-vllm`, the tests and bench start vLLM "
                            "from (scripts/install-vllm.sh; relative: to the checkout). Another release's venv runs "
                            "the vLLM tests against it (make test-vllm-matrix; docs/SUPPORT.md)")
    vllm_spans_dir: Path = Field(Path("/dev/shm/skillcache-spans"), description="where vLLM's connector keeps the K/V "
                                 "it saved (blocks in their canonical context, composition steps): a directory every "
                                 "vLLM rank on the host sees, a tmpfs by default (the connector's spans_dir)")
    vllm_refine_after: int = Field(64, ge=0, description="engine vllm: a skill order composed this many times goes "
                                   "out exact on its next request (vLLM prefills the whole prompt, at live priority, "
                                   "as vLLM alone would) and is served from vLLM's own prefix cache from then on; "
                                   "0: never. Refinement buys vLLM's own numbers, not speed: the refining request is a "
                                   "cold prefill (~10x a composed first token on CPU) and a refined repeat computes "
                                   "up to one vLLM block more than a composed one (docs/BENCHMARKS.md), so only an "
                                   "order seen often is refined")
    vllm_background_chunk: int = Field(256, ge=0, description="engine vllm: new tokens per background prefill "
                                       "request (compiles ahead, calibrations, shadow checks): a live request that "
                                       "arrives meanwhile waits behind one such step at most; 0: one request each")
    vllm_timeout_s: float = Field(300.0, gt=0, description="a whole vLLM request, connect to last token")

    # store
    store: Literal["disk", "redis", "memory"] = "disk"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_ttl_s: int | None = None
    redis_chunk_bytes: int = 32 * 1024 * 1024
    memory_cache_bytes: int = 2 * 1024**3
    disk_cache_bytes: int = Field(0, ge=0, description="cap on the disk tier's block files, least recently "
                                  "used evicted first (compiled again on next use); 0: no cap")
    compile_lock_timeout_s: float = 60.0
    kv_compression: Literal["none", "int8"] = Field(
        "none", description="stored K/V in the disk and Redis tiers: as computed, or int8 with per-channel "
        "key / per-token value scales (about 2x smaller than bf16, 4x than fp32; dequantized on read)")

    # skills shipped with the service, registered at startup ("" to disable)
    skills_dir: Path | None = Path("skills")

    # composition
    seam_tokens: int = Field(4, ge=0, description="seam when not calibrated (seam_auto off, or not yet)")
    seam_auto: bool = Field(True, description="calibrate each skill's seam after compiling it (when idle)")
    seam_candidates: list[int] = [0, 1, 2, 4, 8, 16, 32, 64]
    fidelity_min_cosine: float = Field(0.999, description="first-token logit cosine vs full recompute")
    fidelity_tie_margin: float = Field(0.05, description="top-1 counts only when p1 - p2 >= this")
    refine_after: int = Field(1, ge=0, description="prefill a prompt head (two skills or more, in order, and the "
                              "system turn) in full in the background once it has been composed this many times; "
                              "later requests opening with it copy it as an exact prefix. 0: off")
    refine_from_full: bool = Field(True, description="a mode=full request whose prompt opens with a head that "
                                   "refinement wants keeps its K/V as that head's exact prefix (no background prefill)")
    background_chunk_tokens: int = Field(128, ge=1, description="tokens per step of a background full prefill "
                                         "(calibration, shadow checks, refinement): a live request waits behind one "
                                         "step at most")
    shadow_sample_rate: float = Field(0.02, ge=0.0, le=1.0, description="compose requests re-run in full, idle")

    # automatic reuse (service/compose/auto.py): exact K/V of repeated prompt heads, nothing registered
    auto_reuse: bool = Field(True, description="keep the exact K/V of every prompt's head (embedded engine) and serve "
                             "the longest one a later prompt of the same tenant opens with, copied, as an exact "
                             "prefix; usage counts it as cached (auto_tokens). Off: only registered skills and refined "
                             "heads are reused")
    auto_cache_bytes: int = Field(1024**3, ge=0, description="budget of the kept heads (process memory, apart from "
                                  "memory_cache_bytes and kv_budget_bytes), least recently used first out; 0: off")
    auto_min_tokens: int = Field(64, ge=1, description="shortest head kept or served")
    auto_sections: Literal["headings", "paragraphs", "off"] = Field(
        "headings", description="with auto_reuse: cut system prompts into sections (service/compose/sections.py), "
        "each compiled in the background on first sight and composed at any position afterwards; headings: at "
        "the top-level headings (blank lines when there are none), paragraphs: at every blank line, off: never")
    auto_section_min_tokens: int = Field(128, ge=1, description="smallest section made a block (smaller parts "
                                         "stay text)")
    auto_blocks_after: int = Field(1, ge=1, description="sightings of a section before it is compiled (1: on "
                                   "first sight)")

    # edits: one line per changed field, appended after the skill blocks ({field}, {value})
    erratum_template: str = (
        "[STATE UPDATE] {field} has changed to {value}; this overrides any earlier value. Apply the current value."
    )

    # user memories (service/memory/): placed late, before the user turn, re-rotated there with a seam
    memory_seam_tokens: int = Field(1, ge=0, description="first tokens of each memory block recomputed in context "
                                    "(the paper's memory agent: 1)")
    max_memory_tokens: int = Field(16384, ge=1, description="tokens of one memory, all its blocks together")
    memory_erratum_template: str = (
        "[MEMORY UPDATE] {label} has changed to {value}; this overrides any earlier value AND any earlier "
        "conclusion. Apply the current value."
    )

    # sessions: live KV bounded in bytes and idle time; persisted to the store for other replicas
    session_max_bytes: int = 2 * 1024**3
    session_ttl_s: float = 3600.0
    max_sessions: int = Field(256, description="live sessions per tenant")
    session_persist: bool = True
    session_store_ttl_s: float = Field(
        86400.0, ge=0, description="saved sessions with no turn for longer are deleted from the store (swept "
        "in the background by every replica; a resume past it is 404); 0 keeps them until DELETE")

    # stored responses and conversations (Responses API: store, previous_response_id, conversation), kept per tenant
    # in the definition store so that any replica can resume them (service/api/responses_store.py)
    responses_ttl_s: Annotated[float, Field(ge=0, description="a stored response, or a conversation with no "
                                            "response for longer, is no longer served (404) and is swept from the "
                                            "store in the background; 0 keeps them until DELETE")] = 86400.0
    responses_max_per_tenant: Annotated[int, Field(ge=1, description="stored responses per tenant, and "
                                                   "conversations per tenant: past it the least recently saved is "
                                                   "deleted")] = 10000

    # limits
    max_skill_tokens: int = 16384
    max_skills_per_request: int = 16
    max_tokens_cap: int = 2048
    max_body_bytes: int = 4 * 1024 * 1024
    queue_size: int = Field(32, ge=1, description="live work waiting to be admitted; beyond it 429 overloaded")

    # the serving engine (service/runtime/serving): iteration-level scheduling
    max_running_seqs: int = Field(16, ge=1, description="sequences decoding together in one batch; 1 serves one "
                                  "request at a time (the serial engine, for A/B)")
    step_token_budget: int = Field(1024, ge=2, description="tokens per engine step: one per running sequence, the "
                                   "rest for live prefill chunks")
    prefill_chunk_tokens: int = Field(512, ge=1, description="a live prefill runs in forwards of at most this many "
                                      "tokens, so running sequences keep decoding between them")
    kv_budget_bytes: int = Field(4 * 1024**3, ge=1, description="K/V of the running sequences (decode batch and "
                                 "prefill caches); a request that does not fit waits; one that never could is 413")
    background_share: float = Field(0.1, ge=0.0, le=1.0, description="share of the engine's busy time that "
                                    "background work (calibration, shadow checks, refinement) gets under load")
    background_idle_ms: float = Field(100.0, ge=0.0, description="background work starts only this long after "
                                      "live work last finished (idle or under load; on vLLM too): a client's next "
                                      "request, sent right after a response, does not wait behind a background step")
    shutdown_grace_s: float = Field(20.0, gt=0, description="on SIGTERM, how long open responses (streams) may "
                                    "finish before they are cut and shutdown runs; below the orchestrator's grace")

    # auth and limits (service/api/auth.py; docs/OPERATIONS.md section 4, "Authentication and tenants")
    auth: Literal["off", "keys"] | None = Field(
        None, description="keys: every /v1 request needs a key; off: open, one namespace 'default'. "
        "Unset: keys when api_keys_file is set, else off")
    api_keys_file: Path | None = Field(None, description='JSON list of {"key"|"key_sha256", "namespace", "role"}')
    allow_no_auth: bool = Field(False, description="let auth=off serve on a non-loopback address")
    rate_limit_rps: float = Field(0.0, ge=0, description="per-key requests per second (token bucket); 0 = off")
    rate_limit_burst: int = Field(0, ge=0, description="bucket size; 0 = max(1, ceil(rate_limit_rps))")

    @field_validator("api_keys_file", mode="before")
    @classmethod
    def _empty_path_is_none(cls, v):
        """An empty variable means unset, not the current directory."""
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("chat_template", mode="before")
    @classmethod
    def _empty_is_unset(cls, v):
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("skills_dir", mode="before")
    @classmethod
    def _empty_disables(cls, v):
        return None if isinstance(v, str) and not v.strip() else v

    @property
    def vllm_urls(self) -> list[str]:
        """SKILLCACHE_VLLM_URL split on commas: the vLLM replicas (routing does not depend on their order)."""
        urls = [u.strip().rstrip("/") for u in self.vllm_url.split(",") if u.strip()]
        return list(dict.fromkeys(urls))

    @property
    def vllm_spans_redis(self) -> str | None:
        """The Redis of the shared spans tier (SKILLCACHE_VLLM_SHARED_SPANS), or None: local spans dirs only."""
        return self.redis_url if self.vllm_shared_spans else None

    @property
    def store_dir(self) -> Path:
        return self.home / "store"

    @property
    def models_dir(self) -> Path:
        return self.model_cache or self.home / "models"
