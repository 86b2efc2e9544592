"""What a request asks of the connector (service/vllm/transfer.py) and how a composed head becomes a chain of vLLM
steps (service/vllm/chain.py): plain data, no torch, no vLLM."""

from __future__ import annotations

import pytest

from service.runtime.prompt import Segment
from service.vllm.chain import Chain, Op, head_ops
from service.vllm.transfer import Piece, Save, Transfer, TransferError

ANCHOR = [1, 2, 3, 4]


def text(n: int, start: int = 500) -> Segment:
    return Segment("text", list(range(start, start + n)))


def skill(i: int, n: int, recompute=None) -> Segment:
    return Segment("skill", list(range(100 * (i + 1), 100 * (i + 1) + n)), i, list(recompute or []))


# ---- transfer ---------------------------------------------------------------------------------


def test_a_transfer_survives_its_dict_and_keeps_its_pieces():
    t = Transfer((Piece("blk-a", 0, 10, 0), Piece("blk-b", 4, 20, 10), Piece("step-x-0", 26, 30, 26)),
                 Save("step-x-1", 30, 41))
    assert Transfer.from_dict(t.to_dict()) == t
    assert t.n_load == 30 and t.load[1].delta == 6 and t.load[1].end == 26
    bare = Transfer((Piece("blk-a", 0, 10, 0),))
    assert Transfer.from_dict(bare.to_dict()) == bare and "save" not in bare.to_dict()
    assert Transfer.from_dict({}) == Transfer() and Transfer().n_load == 0


@pytest.mark.parametrize("d", [
    {"load": [["a", 0, 10, 2]]},  # does not start at 0
    {"load": [["a", 0, 10, 0], ["b", 0, 5, 11]]},  # a hole between pieces
    {"load": [["a", 0, 10, 0], ["b", 0, 5, 8]]},  # overlapping pieces
    {"load": [["a", 5, 5, 0]]},  # an empty piece
    {"load": [["a", -2, 3, 0]]},  # before position 0
    {"load": [], "save": ["s", 7, 7]},  # an empty save
    {"load": [], "save": ["s", -1, 4]},
    "not a dict", None, {"load": 5}, {"load": [["a", 0, 10]]}, {"load": [["a", "x", 10, 0]]}, {"load": [None]},
    {"save": ["s", 1]}, {"save": {"name": "s"}}, {"load": {"a": 1}},
])
def test_parameters_that_do_not_tile_from_zero_or_are_not_a_transfer_are_refused(d):
    with pytest.raises(TransferError):
        Transfer.from_dict(d)


def test_clip_keeps_the_pieces_parts_inside_the_window_at_their_own_positions():
    t = Transfer((Piece("a", 0, 10, 0), Piece("b", 4, 20, 10), Piece("c", 50, 54, 26)))
    assert t.clip(0, 30) == list(t.load)
    assert t.clip(5, 12) == [Piece("a", 5, 10, 5), Piece("b", 4, 6, 10)]
    assert t.clip(12, 28) == [Piece("b", 6, 20, 12), Piece("c", 50, 52, 26)]
    assert t.clip(10, 26) == [Piece("b", 4, 20, 10)]
    assert t.clip(30, 40) == [] and t.clip(7, 7) == []
    for p in t.clip(3, 29):
        assert p.delta == next(q.delta for q in t.load if q.name == p.name)  # a clip never changes the move


# ---- head ops -----------------------------------------------------------------------------------


def test_the_first_skill_after_its_anchor_is_one_exact_copy_anchor_included():
    segs = [Segment("text", list(ANCHOR)), skill(0, 30), text(5)]
    ops = head_ops(segs, bases=[len(ANCHOR)], seams=[3], anchor=ANCHOR)
    assert ops == [Op("copy", 0, 34, 0, 0, exact=True)]  # no seam: exact where compiled; the trailing text is vLLM's


def test_a_first_skill_with_other_text_before_it_is_not_copied_whole():
    segs = [Segment("text", [1, 2, 9, 4]), skill(0, 30)]
    ops = head_ops(segs, bases=[len(ANCHOR)], seams=[3], anchor=ANCHOR)
    assert ops == [Op("compute", 0, 7), Op("copy", 7, 27, 0, 7)]  # the text and the seam merge into one run


def test_a_second_skill_gets_its_seam_computed_then_the_rest_copied_from_base_plus_seam():
    segs = [Segment("text", list(ANCHOR)), skill(0, 30), skill(1, 20)]
    ops = head_ops(segs, bases=[4, 4], seams=[3, 5], anchor=ANCHOR)
    assert ops == [Op("copy", 0, 34, 0, 0, exact=True), Op("compute", 34, 5), Op("copy", 39, 15, 1, 4 + 5)]
    assert ops[-1].end == sum(len(s.ids) for s in segs)


def test_edited_spans_inside_a_block_are_computed_runs_and_text_between_blocks_is_computed():
    segs = [Segment("text", list(ANCHOR)), skill(0, 30), text(6), skill(1, 40, recompute=[(10, 14), (30, 33)]),
            text(8)]
    ops = head_ops(segs, bases=[4, 4], seams=[2, 2], anchor=ANCHOR)
    b = 34 + 6  # the second block's first position
    assert ops == [
        Op("copy", 0, 34, 0, 0, exact=True),
        Op("compute", 34, 6 + 2),  # the text between the blocks and the block's seam: adjacent runs merge
        Op("copy", b + 2, 8, 1, 4 + 2),
        Op("compute", b + 10, 4),
        Op("copy", b + 14, 16, 1, 4 + 14),
        Op("compute", b + 30, 3),
        Op("copy", b + 33, 7, 1, 4 + 33),
    ]  # the trailing text is not part of the head


def test_an_edit_that_overlaps_the_seam_or_the_block_end_merges_and_trailing_runs_are_dropped():
    segs = [Segment("text", list(ANCHOR)), skill(0, 10), skill(1, 20, recompute=[(1, 6), (15, 20)]), text(3)]
    ops = head_ops(segs, bases=[4, 4], seams=[0, 3], anchor=ANCHOR)
    assert ops == [Op("copy", 0, 14, 0, 0, exact=True), Op("compute", 14, 6), Op("copy", 20, 9, 1, 4 + 6)]
    assert all(op.n > 0 for op in ops)


def test_an_edited_first_skill_is_not_copied_whole_and_nothing_to_copy_is_no_head():
    segs = [Segment("text", list(ANCHOR)), skill(0, 10, recompute=[(4, 6)])]
    ops = head_ops(segs, bases=[4], seams=[0], anchor=ANCHOR)
    # the anchor and the skill up to its edit are one piece of its record, but not exact (stale after the edit)
    assert ops == [Op("copy", 0, 8, 0, 0), Op("compute", 8, 2), Op("copy", 10, 4, 0, 10)]
    assert head_ops([text(5), Segment("skill", [7, 8], 0, [(0, 2)])], [0], [0], ANCHOR) == []
    assert head_ops([text(5)], [], [], ANCHOR) == []


# ---- chain ----------------------------------------------------------------------------------------


def test_the_chain_has_one_step_per_computed_run_each_loading_everything_before_it_and_saving_it():
    ops = [Op("copy", 0, 34, 0, 0, exact=True), Op("compute", 34, 8), Op("copy", 42, 8, 1, 6), Op("compute", 50, 4),
           Op("copy", 54, 16, 1, 18)]
    ch = Chain.build(ops, ["blk-a", "blk-b"], "d1")
    assert ch.n_head == 70 and ch.n_copied == 34 + 8 + 16 and ch.digest == "d1"
    assert [n for n, _ in ch.steps] == [42, 54]  # each step's prompt ends with the run it computes
    (n0, t0), (n1, t1) = ch.steps
    assert t0 == Transfer((Piece("blk-a", 0, 34, 0),), Save("step-d1-0", 34, 42))
    assert t1 == Transfer((Piece("blk-a", 0, 34, 0), Piece("step-d1-0", 34, 42, 34), Piece("blk-b", 6, 14, 42)),
                          Save("step-d1-1", 50, 54))
    for n, t in ch.steps:
        assert t.save is not None and t.n_load == t.save.lo and t.save.hi == n
        assert Transfer.from_dict(t.to_dict()) == t  # each one tiles from 0: what the connector accepts
    assert ch.final.save is None and ch.final.n_load == ch.n_head
    assert Transfer.from_dict(ch.final.to_dict()) == ch.final
    assert [p.name for p in ch.final.load] == ["blk-a", "step-d1-0", "blk-b", "step-d1-1", "blk-b"]
    assert ch.final.load[-1] == Piece("blk-b", 18, 34, 54)  # moved by 36 positions


def test_a_chain_of_copies_alone_has_no_steps_and_one_that_opens_with_a_run_loads_nothing_first():
    ch = Chain.build([Op("copy", 0, 20, 0, 0)], ["blk-a"], "d")
    assert ch.steps == () and ch.final == Transfer((Piece("blk-a", 0, 20, 0),)) and ch.n_head == 20
    ch = Chain.build([Op("compute", 0, 7), Op("copy", 7, 27, 0, 7)], ["blk-a"], "e")
    assert ch.steps == ((7, Transfer((), Save("step-e-0", 0, 7))),)
    assert ch.final == Transfer((Piece("step-e-0", 0, 7, 0), Piece("blk-a", 7, 34, 7)))
    assert Chain.build([], [], "z").n_head == 0


def test_head_ops_feed_a_chain_whose_final_transfer_tiles_the_head():
    segs = [Segment("text", list(ANCHOR)), skill(0, 30), text(6), skill(1, 40, recompute=[(10, 14)]), text(8),
            skill(2, 12), text(3)]
    ops = head_ops(segs, bases=[4, 4, 4], seams=[2, 2, 3], anchor=ANCHOR)
    ch = Chain.build(ops, ["blk-0", "blk-1", "blk-2"], "dd")
    n_head = 4 + 30 + 6 + 40 + 8 + 12
    assert ch.n_head == n_head and Transfer.from_dict(ch.final.to_dict()).n_load == n_head
    assert len(ch.steps) == sum(op.kind == "compute" for op in ops) == 3
    assert ch.n_copied + sum(op.n for op in ops if op.kind == "compute") == n_head
