"""What a request asks of skillcache's connector inside vLLM: spans to copy into its cache, a span to save from it.

Travels as `kv_transfer_params={"skillcache": Transfer.to_dict()}`; built by the vLLM engine
(service/engines/vllm.py), read by the connector (service/vllm/connector.py). Plain data, no torch: both processes
import it.

    load  pieces that tile the prompt's tokens [0, n) in order: piece (name, lo, hi, at) copies the saved record
          `name`'s tokens computed at positions [lo, hi) to positions [at, at + hi - lo); keys are re-rotated by
          at - lo. vLLM computes the prompt from n on.
    save  (name, lo, hi): once vLLM holds the prompt's tokens [lo, hi) (computed or loaded), they are saved as record
          `name` (service/vllm/spans.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class TransferError(ValueError):
    """Parameters that do not describe a load or a save."""


@dataclass(frozen=True)
class Piece:
    name: str
    lo: int  # positions the record's tokens were computed at: [lo, hi)
    hi: int
    at: int  # where they go in this prompt

    @property
    def delta(self) -> int:
        return self.at - self.lo

    @property
    def end(self) -> int:
        return self.at + self.hi - self.lo


@dataclass(frozen=True)
class Save:
    name: str
    lo: int
    hi: int


@dataclass(frozen=True)
class Transfer:
    load: tuple[Piece, ...] = field(default_factory=tuple)
    save: Save | None = None

    @property
    def n_load(self) -> int:
        return self.load[-1].end if self.load else 0

    def to_dict(self) -> dict:
        d: dict = {"load": [[p.name, p.lo, p.hi, p.at] for p in self.load]}
        if self.save is not None:
            d["save"] = [self.save.name, self.save.lo, self.save.hi]
        return d

    @classmethod
    def from_dict(cls, d: object) -> "Transfer":
        try:
            assert isinstance(d, dict)
            load = tuple(Piece(str(n), int(lo), int(hi), int(at)) for n, lo, hi, at in d.get("load") or [])
            s = d.get("save")
            save = Save(str(s[0]), int(s[1]), int(s[2])) if s else None
        except (AssertionError, TypeError, ValueError, LookupError) as e:  # LookupError: a save too short, or a dict
            raise TransferError(f"bad skillcache transfer {d!r}") from e
        at = 0
        for p in load:
            if p.at != at or p.hi <= p.lo or p.lo < 0:
                raise TransferError(f"pieces must tile the prompt from 0 in order: {p} at {at}")
            at = p.end
        if save is not None and not 0 <= save.lo < save.hi:
            raise TransferError(f"bad save span {save}")
        return cls(load, save)

    def clip(self, start: int, end: int) -> list[Piece]:
        """The pieces' parts that land in [start, end)."""
        out = []
        for p in self.load:
            a, b = max(p.at, start), min(p.end, end)
            if a < b:
                out.append(Piece(p.name, p.lo + a - p.at, p.lo + b - p.at, a))
        return out
