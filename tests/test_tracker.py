"""The tracker and its policies, on hand-made histograms."""

from __future__ import annotations

import pytest

import buddy
from buddy import spec
from buddy.slots import overflow_sectors
from buddy.tracker import Decision

E = 128


def record(tracker, key, hist, slot=4):
    return tracker.record(
        key, hist, slot=slot, entry_bytes=E, original_bytes=sum(hist) * E, predicted_overflow_bytes=None
    )


def test_new_key_is_decided_from_its_size_pass():
    tr = buddy.Tracker(buddy.BuddyThreshold(0.0))
    slot, predicted = tr.choose("a", [0, 100, 0, 0, 0], entry_bytes=E, original_bytes=100 * E)
    assert (slot, predicted) == (1, None)


def test_known_key_is_decided_from_history_not_the_current_tensor():
    tr = buddy.Tracker(buddy.BuddyThreshold(0.0))
    record(tr, "a", [0, 0, 0, 100, 0])
    slot, predicted = tr.choose("a", [0, 100, 0, 0, 0], entry_bytes=E, original_bytes=100 * E)
    assert slot == 3 and predicted == 0


def test_prediction_weights_recent_steps_more():
    tr = buddy.Tracker(decay=0.5)
    record(tr, "a", [100, 0, 0, 0, 0])
    record(tr, "a", [0, 0, 0, 0, 100])
    pred = tr.history("a").predicted()
    assert pred == pytest.approx((100 / 3, 0, 0, 0, 200 / 3))


def test_window_bounds_history_and_shape_change_restarts():
    tr = buddy.Tracker(window=2)
    for _ in range(5):
        record(tr, "a", [10, 0, 0, 0, 0])
    assert len(tr.history("a").histograms) == 2 and tr.history("a").steps == 5
    record(tr, "a", [20, 0, 0, 0, 0])  # a different tensor under the same name
    assert tr.history("a").steps == 1


def test_prediction_error_is_recorded():
    tr = buddy.Tracker(buddy.FixedRatio(4.0))
    record(tr, "a", [0, 100, 0, 0, 0])
    slot, predicted = tr.choose("a", [0, 0, 0, 0, 100], entry_bytes=E, original_bytes=100 * E)
    obs = tr.record(
        "a", [0, 0, 0, 0, 100], slot=slot, entry_bytes=E, original_bytes=100 * E, predicted_overflow_bytes=predicted
    )
    assert slot == 1 and predicted == 0 and obs.overflow_bytes == 300 * spec.SECTOR_BYTES
    assert tr.history("a").prediction_errors() == [pytest.approx(300 * 32 / (100 * E))]


@pytest.mark.parametrize("ratio,slot", [(1, 4), (4 / 3, 3), (2, 2), (4, 1), (float("inf"), 0)])
def test_fixed_ratio(ratio, slot):
    tr = buddy.Tracker(buddy.FixedRatio(ratio))
    assert tr.choose("k", [5, 5, 5, 5, 5], entry_bytes=E, original_bytes=25 * E)[0] == slot


@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.1, 0.3, 1.0])
def test_threshold_picks_most_aggressive_slot_within_bound(threshold):
    hist = [10, 20, 30, 25, 15]
    nbytes = sum(hist) * E
    slot = buddy.BuddyThreshold(threshold).choose(
        Decision("k", E, sum(hist), nbytes, tuple(hist), None, 0), buddy.Tracker()
    )
    assert overflow_sectors(hist, slot) * 32 <= threshold * nbytes
    if slot > 0:
        assert overflow_sectors(hist, slot - 1) * 32 > threshold * nbytes


def test_budget_plan_fits_and_prefers_compressible_keys():
    tr = buddy.Tracker()
    record(tr, "sparse", [0, 1000, 0, 0, 0])  # fits 4x with no overflow
    record(tr, "dense", [0, 0, 0, 500, 500])  # half the entries need the raw slot
    per_entry_meta = spec.meta_bytes(E)
    budget = 1000 * (32 + per_entry_meta) + 1000 * (128 + per_entry_meta)
    policy = buddy.DeviceBudget(budget)
    plan = policy.plan(tr)
    assert plan == {"sparse": 1, "dense": 4}
    # one slot step tighter: shrinking "dense" spills 500 sectors, "sparse" would spill 1000
    plan = buddy.DeviceBudget(budget - 1000 * 32).plan(tr)
    assert plan == {"sparse": 1, "dense": 3}


def test_budget_shrinks_slot_to_what_is_left():
    tr = buddy.Tracker()
    policy = buddy.DeviceBudget(100 * (64 + 1))
    d = Decision("k", E, 100, 100 * E, (0, 0, 0, 0, 100), None, held_device_bytes=0)
    assert policy.choose(d, tr) == 2
    d = Decision("k", E, 100, 100 * E, (0, 0, 0, 0, 100), None, held_device_bytes=100 * 33)
    assert policy.choose(d, tr) == 0


def test_bad_tracker_arguments():
    with pytest.raises(ValueError):
        buddy.Tracker(decay=0)
    with pytest.raises(ValueError):
        buddy.Tracker(window=0)
    with pytest.raises(TypeError):
        buddy.set_default_tracker("x")
