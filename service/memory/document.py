"""A user memory as text: Markdown lines, some of them labelled facts, split into blocks of whole lines. No tensors.

A labelled fact is a list item `- label: value`, optionally with a category, `- [category] label: value` (the
paper's memory format: `- [privacy] share_location: disabled (set in May)`). Its value is the rest of the line, and
an edit replaces it. Labels are unique within a memory. Any other line (a heading, free text) is kept as written.

Blocks: with `max_block_tokens`, the lines are cut into consecutive blocks of about that many tokens, each compiled
on its own, so an edit recompiles only its block. Lines that refer to each other stay in one block: a line that
names another fact's label (a whole word, any case) is never cut from that fact's line, since a fact split from the
one it refers to is read far worse (paper section 9.2, E4: agreement 0.46 vs 0.76). A heading stays with the line
after it. Where references leave no cut within the limit, a block grows past it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from service.errors import InvalidMemory

LABEL_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9_ .-]{0,63}"
_FACT_RE = re.compile(rf"^(?P<lead>\s*[-*+][ \t]+(?:\[(?P<cat>[^\]\n]{{1,64}})\][ \t]+)?)(?P<label>{LABEL_PATTERN}?)"
                      r"[ \t]*:(?P<gap>[ \t]?)(?P<value>.*)$")
MAX_VALUE_CHARS = 1024


@dataclass(frozen=True)
class Fact:
    label: str
    category: str | None
    value: str
    line: int  # index of its line in the text


def fact_of(line: str, index: int = 0) -> Fact | None:
    m = _FACT_RE.match(line)
    if m is None or not m.group("label").strip():
        return None
    return Fact(m.group("label").strip(), m.group("cat"), m.group("value"), index)


def parse_facts(text: str) -> list[Fact]:
    """The labelled facts of a memory text, in order; a label given twice is an error."""
    facts = [f for i, line in enumerate(text.split("\n")) if (f := fact_of(line, i)) is not None]
    seen: set[str] = set()
    for f in facts:
        if f.label in seen:
            raise InvalidMemory(f"the label {f.label!r} is given twice (line {f.line + 1}); labels must be unique")
        seen.add(f.label)
    return facts


def check_value(label: str, value: str) -> None:
    if "\n" in value or "\r" in value or len(value) > MAX_VALUE_CHARS:
        raise InvalidMemory(f"the value of {label!r} must be one line of at most {MAX_VALUE_CHARS} characters")


def _find(text: str, label: str) -> tuple[list[str], int, int, re.Match]:
    """(lines, index of the fact's line, character offset of that line, its match)."""
    lines, offset = text.split("\n"), 0
    for i, line in enumerate(lines):
        m = _FACT_RE.match(line)
        if m is not None and m.group("label").strip() == label:
            return lines, i, offset, m
        offset += len(line) + 1
    raise InvalidMemory(f"this memory has no fact labelled {label!r}")


def value_span(text: str, label: str) -> tuple[int, int]:
    """The character span [start, end) of the fact `label`'s value in `text`."""
    _, _, offset, m = _find(text, label)
    return offset + m.start("value"), offset + m.end("value")


def set_value(text: str, label: str, value: str) -> tuple[str, tuple[int, int]]:
    """`text` with the fact `label` set to `value`, and the character span [start, end) the value takes in it."""
    check_value(label, value)
    lines, i, offset, m = _find(text, label)
    head = lines[i][:m.start("gap")] + (m.group("gap") or " ")  # `label:value` becomes `label: value`
    lines[i] = head + value
    start = offset + len(head)
    return "\n".join(lines), (start, start + len(value))


def _links(lines: list[str], facts: list[Fact]) -> list[tuple[int, int]]:
    """(i, j), i < j: line i names the label of the fact on line j, or the other way round."""
    out = []
    for f in facts:
        word = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(f.label)}(?![A-Za-z0-9_])", re.IGNORECASE)
        for i, line in enumerate(lines):
            if i != f.line and word.search(line):
                out.append((min(i, f.line), max(i, f.line)))
    return out


def split_blocks(text: str, count_tokens: Callable[[str], int], max_block_tokens: int | None) -> list[str]:
    """The memory's blocks: consecutive runs of whole lines (joined by "\\n" they give `text` back), each with some
    text in it; one block when `max_block_tokens` is None."""
    lines = text.split("\n")
    if max_block_tokens is None or len(lines) < 2:
        return [text]
    links = _links(lines, parse_facts(text))
    # a cut after line k: not inside a reference, not after a heading, and the next block opens with text
    cuttable = [not any(i <= k < j for i, j in links) and not lines[k].lstrip().startswith("#")
                and lines[k + 1].strip() != "" for k in range(len(lines) - 1)]
    sizes = [count_tokens(line) + 1 for line in lines]  # +1: the newline (an estimate; blocks are tokenized whole)
    blocks, start = [], 0
    while start < len(lines):
        total, cut, k = 0, None, start
        while k < len(lines):
            total += sizes[k]
            if total > max_block_tokens and cut is not None:
                break
            if k < len(lines) - 1 and cuttable[k]:
                cut = k
            k += 1
        end = len(lines) if k == len(lines) or cut is None else cut + 1
        if blocks and not blocks[-1].strip():  # blank lines alone are no block: they open the next one
            blocks[-1] += "\n" + "\n".join(lines[start:end])
        else:
            blocks.append("\n".join(lines[start:end]))
        start = end
    return blocks


def labels_of_blocks(blocks: list[str]) -> list[list[str]]:
    return [[f.label for f in parse_facts(b)] for b in blocks]
