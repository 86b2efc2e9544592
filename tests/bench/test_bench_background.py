"""bench/background.py's alternate arm: requests and the engine's busy time are counted by the state of the
background switch they fall in; a request sent in one window and answered in the next counts in neither."""

import sys

import pytest

from embedded_model import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import background  # noqa: E402


def _m(live: float, bg: float) -> dict:
    return {"refined": 0.0, "busy_live": live, "busy_background": bg}


def test_the_alternate_arm_splits_requests_and_busy_time_by_the_switch():
    windows = [{"paused": False, "m": _m(0, 0)}, {"paused": True, "m": _m(9, 1)}, {"paused": False, "m": _m(19, 1)},
               {"paused": None, "m": _m(28, 2)}]  # on: 9 + 9 s live, 1 + 1 s background; off: 10 s live
    rows = [{"ttft_s": t, "paused": p, "spans_switch": s} for t, p, s in [
        (0.3, False, False), (0.5, False, False), (0.4, True, False), (0.6, True, False), (9.0, True, True)]]
    parts = background.switched(rows, windows)
    assert parts["on"]["windows"] == 2 and parts["off"]["windows"] == 1
    assert parts["on"]["ttfts"] == [0.3, 0.5] and parts["off"]["ttfts"] == [0.4, 0.6]  # the 9 s one spans a switch
    assert (parts["on"]["live_s"], parts["on"]["background_s"]) == (18, 2)
    assert (parts["off"]["live_s"], parts["off"]["background_s"]) == (10, 0)
    assert parts["off"]["answered"] == 3  # engine time a request: every request sent in the state, spanning too

    pooled = background.by_switch([{"switched": parts}, {"switched": parts}])
    assert pooled["on"]["requests"] == 4 and pooled["on"]["background_share"] == pytest.approx(0.1)
    assert pooled["on"]["live_engine_s_per_request"] == pytest.approx(36 / 4)
    assert pooled["p90_rise"] == pytest.approx(0.5 / 0.6 - 1)
