"""The composition plan both engines execute (service/kv/plan.py): what is copied, what is computed, what is exact."""

from service.kv.plan import Op, merge_spans, plan_ops
from service.runtime.prompt import Segment

ANCHOR = [1, 2, 3]


def skill(i: int, n: int, recompute=None) -> Segment:
    return Segment("skill", list(range(100 * (i + 1), 100 * (i + 1) + n)), i, recompute or [])


def test_the_anchor_and_a_first_skill_after_it_are_exact_copies_the_next_skill_is_rotated_after_its_seam():
    segs = [Segment("text", ANCHOR), skill(0, 10), Segment("text", [7, 7]), skill(1, 8), Segment("text", [9])]
    p = plan_ops(segs, [3, 3], 2, ANCHOR)
    assert p.ops == [Op("copy", 0, 3, 0, 0, exact=True), Op("copy", 3, 10, 0, 3, exact=True),
                     Op("compute", 13, 4), Op("copy", 17, 6, 1, 3 + 2), Op("compute", 23, 1)]
    assert p.seams == {0: 0, 1: 2} and p.n_exact == 17  # everything before the first rotated copy is exact
    assert sum(op.n for op in p.ops) == sum(len(s.ids) for s in segs)  # the ops tile the prompt


def test_after_an_exact_prefix_there_is_no_anchor_rule_and_per_block_seams_apply():
    segs = [Segment("text", [5, 6]), skill(0, 4), skill(1, 6), Segment("text", [9])]
    p = plan_ops(segs, [0, 3], [1, 10], ANCHOR, start=20)
    assert p.ops == [Op("compute", 20, 3), Op("copy", 23, 3, 0, 1), Op("compute", 26, 7)]
    assert p.seams == {0: 1, 1: 6} and p.n_exact == 23  # a seam longer than its block computes all of it


def test_a_prompt_without_blocks_is_one_computed_run_and_spans_merge():
    p = plan_ops([Segment("text", [1, 2]), Segment("text", [3])], [], 4, ANCHOR)
    assert p.ops == [Op("compute", 0, 3)] and p.n_exact is None
    assert merge_spans([(5, 9), (0, 2), (1, 3), (9, 9), (8, 12)]) == [(0, 3), (5, 12)]
