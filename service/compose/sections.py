"""The sections of a system prompt: where an unregistered prompt is cut into content-addressed blocks
(SKILLCACHE_AUTO_SECTIONS).

Agents send long system prompts made of parts that move: a policy after another preamble, documents in another
order, a tool guide added or dropped. Each part is cut out as a block of its own (compiled once in the background,
then composed at any position like a skill: service/compose/autoblocks.py). The rule is content-defined, so a
section is cut the same way whatever comes before or after it:

- Cut points are blank lines (a "\\n\\n" after some text, the last of a longer run of newlines: the rest stays with
  the part before, so files that end in a newline and are joined by a blank line cut the same in any order) that
  open a heading line of the prompt's top level:
  a Markdown heading (`# `..`###### `: the fewest `#` that open a paragraph) or, above any Markdown level, a line
  that opens an XML-style tag (`<document index="1">`, `<policy>`). With no such heading ("headings" mode), or in
  "paragraphs" mode, every blank line is a cut point.
- The pieces between cut points are the prompt's parts; the "\\n\\n" between them is the joiner the prompt builder
  writes between its system parts (BLOCK_JOINER), so joining the parts gives the text back exactly.
- A part of at least SKILLCACHE_AUTO_SECTION_MIN_TOKENS tokens (and at most the block limit) is a section: a block
  candidate. Smaller parts stay text; nothing is merged, since merging would make a section depend on its
  neighbours.
Every part is tokenized alone, whether its block is held or not, so a prompt's ids never change when a block
becomes available (the automatic heads and `mode=full` see the same ids).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

JOINER = "\n\n"  # service/runtime/prompt.py BLOCK_JOINER
_HEADING = re.compile(r"(?<=[\s\S])\n\n(?=(#{1,6}) |<[A-Za-z][\w.:-]*(?:\s[^<>\n]*)?>)")
_PARAGRAPH = re.compile(r"(?<=[\s\S])\n\n(?=[^\n])")
MODES = ("headings", "paragraphs", "off")


@dataclass(frozen=True)
class Part:
    text: str
    ids: list[int]
    section: bool  # a block candidate (big enough, small enough)


def cut_points(text: str, mode: str) -> list[int]:
    """Offsets of the joiners the text is cut at (each `JOINER` long)."""
    if mode == "off":
        return []
    if mode == "headings":
        found = [(m.start(), m.group(1)) for m in _HEADING.finditer(text)]
        if found:
            tags = [at for at, hashes in found if hashes is None]  # XML-style tags rank above Markdown headings
            if tags:
                return tags
            top = min(len(h) for _, h in found)
            return [at for at, hashes in found if len(hashes) == top]
    return [m.start() for m in _PARAGRAPH.finditer(text)]


def split_parts(text: str, mode: str, encode, min_tokens: int, max_tokens: int) -> list[Part]:
    """The text's parts in order (JOINER.join of their texts is `text`); `encode`: text -> ids (as a block's)."""
    cuts = cut_points(text, mode)
    starts, ends = [0] + [at + len(JOINER) for at in cuts], cuts + [len(text)]
    out, seen = [], set()
    for s, e in zip(starts, ends):
        piece = text[s:e]
        ids = encode(piece)
        ok = min_tokens <= len(ids) <= max_tokens and piece not in seen  # a repeat within the prompt stays text
        seen.add(piece)
        out.append(Part(piece, ids, ok))
    return out
