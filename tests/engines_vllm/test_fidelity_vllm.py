"""Fidelity on vLLM from top-k logprobs (service/vllm/fidelity.py): the top-1 rule, near-ties, the distance."""

import math

import pytest

from service.vllm.fidelity import top_agreement


def lp(*pairs):
    return [(t, math.log(p)) for t, p in pairs]


def test_the_same_top1_passes_and_identical_distributions_are_at_distance_zero():
    a = lp(("Yes", 0.7), ("No", 0.2), ("Maybe", 0.1))
    out = top_agreement(a, a, 0.05)
    assert out["ok"] and out["top1_agree"] and out["decisive"] and out["tv"] == pytest.approx(0.0)


def test_a_different_top1_fails_when_the_full_prefill_is_decisive_not_on_a_near_tie():
    full = lp(("Yes", 0.6), ("No", 0.3))
    out = top_agreement(lp(("No", 0.6), ("Yes", 0.3)), full, 0.05)
    assert not out["ok"] and out["decisive"] and out["tv"] == pytest.approx(0.3)
    tie = lp(("Yes", 0.41), ("No", 0.40))
    assert top_agreement(lp(("No", 0.42), ("Yes", 0.40)), tie, 0.05)["ok"]  # p1 - p2 = 0.01: not decisive


def test_tokens_missing_from_one_side_count_as_zero_and_no_logprobs_is_an_error():
    out = top_agreement(lp(("A", 0.5), ("C", 0.5)), lp(("A", 0.5), ("B", 0.5)), 0.05)
    assert out["tv"] == pytest.approx(0.5) and out["ok"] and not out["decisive"]
    with pytest.raises(ValueError):
        top_agreement([], lp(("A", 1.0)), 0.05)
