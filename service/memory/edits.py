"""Edits of a memory's facts, one by one, each in its own mode (the paper's section 9, E3):

  erratum    the block's K/V stays; each later turn states the value in one line after the memory:
             `[MEMORY UPDATE] {label} has changed to {value}; this overrides any earlier value AND any earlier
             conclusion. Apply the current value.` (current value only; none once the K/V says it again)
  in_place   the fact's value tokens are recomputed inside the block, after the tokens before them; the tokens
             after keep their K/V (stale: they read the old value), moved if the length changed. Needs the
             tokens around the value to stay as they were; otherwise the block is recompiled, and the report says so
  recompile  the block is compiled again from its current text (its pending errata folded in)

Only the block that holds the fact is touched. No tensors here: this works out the new record and what to say;
service/memory/kv.py makes the K/V.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from service.errors import InvalidMemory
from service.memory.document import check_value, set_value, value_span
from service.memory.record import MemoryBlock, MemoryRecord

EDIT_MODES = ("erratum", "in_place", "recompile")


@dataclass
class FactEdit:
    label: str
    value: str
    mode: str = "erratum"


def inplace_layout(prompts, old_text: str, new_text: str, label: str) -> tuple[list[int], int, int, int] | str:
    """(new ids, start, old end, new end) of the value's tokens when only they differ between the two texts'
    tokenizations (the tokens after may shift by the change in length); otherwise the reason, for the report."""
    old_ids, [(s_old, e_old)] = prompts.encode_spans(old_text, [value_span(old_text, label)])
    new_ids, [(s_new, e_new)] = prompts.encode_spans(new_text, [value_span(new_text, label)])
    if e_new <= s_new or e_old <= s_old:
        return "an empty value has no tokens to recompute"
    if s_old != s_new or old_ids[:s_old] != new_ids[:s_new] or old_ids[e_old:] != new_ids[e_new:]:
        return "the new value changes the tokens around it"
    return new_ids, s_new, e_old, e_new


def apply_edits(prompts, rec: MemoryRecord, edits: list[FactEdit], template: str) -> tuple[MemoryRecord, list[dict]]:
    """The record after `edits` (in order; revision not bumped) and one report per edit. `template`: the erratum
    line, with {label} and {value}."""
    new = copy.deepcopy(rec)
    reports, recompile = [], set()
    for e in edits:
        if e.mode not in EDIT_MODES:
            raise InvalidMemory(f"unknown edit mode {e.mode!r}; use one of {list(EDIT_MODES)}")
        check_value(e.label, e.value)
        i = new.block_of(e.label)
        if i is None:
            raise InvalidMemory(f"this memory has no fact labelled {e.label!r}; PUT the memory to add facts")
        b = new.blocks[i]
        report = {"label": e.label, "block": i, "mode": e.mode}
        kv_value = b.kv_value(e.label)
        if e.value == b.errata.get(e.label, kv_value):
            reports.append({**report, "mode": "unchanged"})
            continue
        if e.mode == "in_place" and e.value == kv_value:  # the K/V says it already: only its erratum goes
            b.errata.pop(e.label, None)
            report["recomputed_tokens"] = 0
        elif e.mode == "in_place":
            report.update(_in_place(prompts, b, e))
        if report["mode"] == "recompile":
            b.errata[e.label] = e.value  # folded into the block's text by the recompile below
            recompile.add(i)
        elif report["mode"] == "erratum":
            if e.value == kv_value:
                b.errata.pop(e.label, None)
                report["lines"] = []  # the K/V says it already: no line needed any more
            else:
                b.errata[e.label] = e.value
                report["lines"] = [template.format(label=e.label, value=e.value)]
        reports.append(report)
    for i in recompile:
        b = new.blocks[i]
        new.blocks[i] = MemoryBlock(base=b.text)
    for r in reports:  # edits that a recompile of their block in this request folded into its K/V
        if r["block"] in recompile and r["mode"] in ("in_place", "erratum"):
            r["note"] = "the block was recompiled by another edit in this request"
            if r["mode"] == "erratum":
                r["lines"] = []
    return new, reports


def _in_place(prompts, b: MemoryBlock, e: FactEdit) -> dict:
    old_text = b.kv_text
    new_text, span = set_value(old_text, e.label, e.value)
    layout = inplace_layout(prompts, old_text, new_text, e.label)
    if isinstance(layout, str):
        return {"mode": "recompile", "requested": "in_place", "fallback": layout + ": the block was recompiled"}
    _, start, _, end = layout
    b.patches.append({"text": new_text, "span": list(span), "label": e.label})
    b.errata.pop(e.label, None)
    return {"recomputed_tokens": end - start}
