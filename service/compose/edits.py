"""Field edits on cached skills (the erratum of arXiv 2606.17107, "Models Take Notes at Prefill"): which tokens to
recompute, which errata to add.

Modes, per skill whose requested field values differ from the compiled defaults:
  erratum        keep the cached block, append one [STATE UPDATE] line per changed field (default)
  field+erratum  also recompute the field's tokens in place (only when the new value keeps the
                 token layout; otherwise falls back to erratum and says so), then the erratum
  in_place       recompute the field's tokens only (the research baseline: models read their notes
                 on later tokens, so this alone barely moves decisions)
  recompile      compile a variant block with the new values (cached under its own text hash)
A declared field that the text never uses gets its erratum line in every mode: there is nothing to recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.errors import InvalidField
from service.registry.skill import SkillRecord, render_spans

EDIT_MODES = ("erratum", "field+erratum", "in_place", "recompile")


@dataclass
class SkillEdit:
    """What one skill's block looks like in the prompt after its field edits."""

    text: str  # text whose block is used (defaults, or the variant for recompile)
    ids: list[int] | None = None  # prompt ids when they differ from the block's (in-place edits)
    recompute: list[tuple[int, int]] = field(default_factory=list)  # block spans to run, not copy
    errata: list[str] = field(default_factory=list)
    report: list[dict] = field(default_factory=list)


def check_fields(records: list[SkillRecord], values: dict[str, str]) -> None:
    declared = {f for r in records for f in r.fields}
    unknown = sorted(set(values) - declared)
    if unknown:
        raise InvalidField(f"unknown fields {unknown}; the requested skills declare {sorted(declared) or 'no fields'}")


def plan_edit(prompts, rec: SkillRecord, values: dict[str, str], mode: str, template: str) -> SkillEdit:
    """`prompts`: the runtime's PromptBuilder (tokenization); `values`: the request's field values;
    `template`: the erratum line, with {field} and {value} (Settings.erratum_template)."""
    changed = {f: v for f, v in values.items() if f in rec.fields and rec.fields[f] != v}
    if not changed:
        return SkillEdit(text=rec.default_text)
    errata = [template.format(field=f, value=v) for f, v in changed.items()]
    old_text, old_chars = render_spans(rec.text, rec.fields)
    # a declared field the text never uses: neither a recompile nor an in-place edit can carry its value
    absent = [f for f in changed if not old_chars.get(f)]
    if absent and mode in ("in_place", "recompile"):
        note = f"fields {absent} do not appear in the skill's text: applied as errata lines"
        edit = plan_edit(prompts, rec, {f: v for f, v in changed.items() if f not in absent}, mode, template)
        lines = [template.format(field=f, value=changed[f]) for f in absent]
        return SkillEdit(edit.text, edit.ids, edit.recompute, edit.errata + lines,
                         edit.report + [{"mode": "erratum", "requested": mode, "fields": sorted(absent),
                                         "lines": lines, "fallback": note}])
    new_values = {**rec.fields, **changed}
    if mode == "recompile":
        text, _ = render_spans(rec.text, new_values)
        return SkillEdit(text=text, report=[{"mode": "recompile", "fields": sorted(changed)}])
    if mode == "erratum":
        return SkillEdit(text=rec.default_text, errata=errata,
                         report=[{"mode": "erratum", "fields": sorted(changed), "lines": errata}])
    new_text, new_chars = render_spans(rec.text, new_values)
    old_ids, old_spans = prompts.encode_spans(old_text, [s for f in changed for s in old_chars.get(f, [])])
    new_ids, new_spans = prompts.encode_spans(new_text, [s for f in changed for s in new_chars.get(f, [])])
    inside = {i for s, e in new_spans for i in range(s, e)}
    same_layout = (
        len(old_ids) == len(new_ids) and old_spans == new_spans
        and all(a == b for i, (a, b) in enumerate(zip(old_ids, new_ids)) if i not in inside)
    )
    if not same_layout:
        note = "the new value changes the token layout: applied as an erratum instead"
        return SkillEdit(text=rec.default_text, errata=errata,
                         report=[{"mode": "erratum", "requested": mode, "fields": sorted(changed),
                                  "lines": errata, "fallback": note}])
    report = {"mode": mode, "fields": sorted(changed), "recomputed_field_tokens": len(inside)}
    if mode == "field+erratum":
        report["lines"] = errata
        return SkillEdit(rec.default_text, new_ids, new_spans, errata, [report])
    return SkillEdit(rec.default_text, new_ids, new_spans, [], [report])
