"""Memory records: a tenant's named memory, its blocks, and how each block's K/V is made. No tensors here.

A block's K/V is compiled from `base` (its text when last compiled), then changed by the in-place edits in
`patches`, in order: each names the block text after it and the character span of the value it recomputed.
`kv_text` is what the K/V spells. Erratum edits leave the K/V alone: `errata` holds the values that the turn
states in [MEMORY UPDATE] lines after the memory. `text` is what the block says now, every edit applied.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from service.memory.document import fact_of, parse_facts, set_value
from service.registry.skill import text_hash
from service.runtime.prompt import LATE_JOINER


@dataclass
class MemoryBlock:
    base: str
    patches: list[dict] = field(default_factory=list)  # [{"text": kv text after it, "span": [start, end]}]
    errata: dict[str, str] = field(default_factory=dict)  # label -> value, told by an erratum line
    n_tokens: int = 0  # of kv_text

    @property
    def kv_text(self) -> str:
        return self.patches[-1]["text"] if self.patches else self.base

    @property
    def text(self) -> str:
        out = self.kv_text
        for label, value in self.errata.items():
            out, _ = set_value(out, label, value)
        return out

    def kv_value(self, label: str) -> str | None:
        return next((f.value for f in parse_facts(self.kv_text) if f.label == label), None)

    def recipes(self) -> list[str]:
        """The content hash of the K/V after compiling and after each in-place edit (the last is the block's)."""
        out = [text_hash(self.base)]
        for p in self.patches:
            payload = f"{out[-1]}\x00{p['text']}\x00{p['span'][0]}:{p['span'][1]}"
            out.append("inplace-" + text_hash(payload))
        return out

    def erratum_lines(self, template: str) -> list[str]:
        """One line per erratum value, in the order of the facts in the block (current value only)."""
        order = [f.label for f in parse_facts(self.kv_text)]
        return [template.format(label=label, value=self.errata[label]) for label in order if label in self.errata]


@dataclass
class MemoryRecord:
    namespace: str
    name: str
    blocks: list[MemoryBlock]
    revision: int = 1
    max_block_tokens: int | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)

    @property
    def text(self) -> str:
        return LATE_JOINER.join(b.text for b in self.blocks)

    def block_of(self, label: str) -> int | None:
        return next((i for i, b in enumerate(self.blocks) if b.kv_value(label) is not None), None)

    def to_doc(self) -> dict:
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: dict) -> "MemoryRecord":
        blocks = [MemoryBlock(**b) for b in doc["blocks"]]
        return cls(**{**{k: doc[k] for k in cls.__dataclass_fields__ if k in doc}, "blocks": blocks})

    def public(self) -> dict:
        facts, line = [], 0
        for i, b in enumerate(self.blocks):
            for text_line in b.text.split("\n"):
                if (f := fact_of(text_line, line)) is not None:
                    facts.append({"label": f.label, "category": f.category, "value": f.value, "block": i})
                line += 1
        blocks = [{"index": i, "n_tokens": b.n_tokens, "content_hash": b.recipes()[-1],
                   "in_place_edits": len(b.patches), "errata": dict(b.errata)} for i, b in enumerate(self.blocks)]
        return {"name": self.name, "revision": self.revision, "text": self.text, "n_tokens": self.n_tokens,
                "max_block_tokens": self.max_block_tokens, "facts": facts, "blocks": blocks,
                "created_at": self.created_at, "updated_at": self.updated_at}

    @property
    def n_tokens(self) -> int:
        return sum(b.n_tokens for b in self.blocks)
