"""The tracker and its policies, on hand-made histograms."""

from __future__ import annotations

import pytest
import torch
from conftest import tracker_step

import buddy
from buddy import spec
from buddy.layout import Layout
from buddy.slots import overflow_sectors, slot_for_overflow, tightest_slot
from buddy.tracker import Decision

E = 128


def record(tracker, key, hist, slot=4):
    return tracker.record(
        key, hist, slot=slot, layout=Layout(E, sum(hist) * E), predicted_overflow_bytes=None
    )


def test_new_key_is_decided_from_its_size_pass():
    tr = buddy.Tracker(buddy.BuddyThreshold(0.0))
    slot, predicted = tr.choose("a", [0, 100, 0, 0, 0], layout=Layout(E, 100 * E))
    assert (slot, predicted) == (1, None)


def test_the_bound_is_checked_against_the_current_tensor_and_the_prediction_recorded():
    """The history said every entry needs 3 sectors; this tensor needs 1: its slot is 1, the history's guess kept."""
    tr = buddy.Tracker(buddy.BuddyThreshold(0.0))
    record(tr, "a", [0, 0, 0, 100, 0])
    slot, predicted = tr.choose("a", [0, 100, 0, 0, 0], layout=Layout(E, 100 * E))
    assert slot == 1 and predicted == 2 * 100 * spec.SECTOR_BYTES  # the history: 2 sectors an entry would spill
    # and the other way: a tensor worse than its history gets the wider slot, no overflow past the bound
    slot, predicted = tr.choose("a", [0, 0, 0, 0, 100], layout=Layout(E, 100 * E))
    assert slot == 4 and predicted == 0


def test_prediction_weights_recent_steps_more():
    tr = buddy.Tracker(decay=0.5)
    record(tr, "a", [100, 0, 0, 0, 0])
    record(tr, "a", [0, 0, 0, 0, 100])
    pred = tr.history("a").predicted()
    assert pred == pytest.approx((100 / 3, 0, 0, 0, 200 / 3))


def test_prediction_follows_the_window_at_every_step():
    """The prediction, asked after every step, is the decayed mean of the window's histograms as they are then --
    long after the window is full, when its length no longer changes."""
    tr = buddy.Tracker(decay=0.5, window=3)
    seen = []
    for step in range(12):
        x, y = step % 7, (3 * step) % 5
        hist = [x, 20 - x - y, y, 0, 0]  # 20 entries every step: the same tensor, other sizes
        record(tr, "a", hist)
        seen.append(hist)
        weights = [0.5**age for age in range(len(seen[-3:]))]
        expected = [
            sum(w * h[j] for w, h in zip(weights, reversed(seen[-3:]))) / sum(weights) for j in range(len(hist))
        ]
        assert tr.history("a").predicted() == pytest.approx(expected, rel=1e-12, abs=0), f"step {step}"


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
    slot, predicted = tr.choose("a", [0, 0, 0, 0, 100], layout=Layout(E, 100 * E))
    obs = tr.record(
        "a", [0, 0, 0, 0, 100], slot=slot, layout=Layout(E, 100 * E), predicted_overflow_bytes=predicted
    )
    assert slot == 1 and predicted == 0 and obs.overflow_bytes == 300 * spec.SECTOR_BYTES
    assert tr.history("a").prediction_errors() == [pytest.approx(300 * 32 / (100 * E))]


@pytest.mark.parametrize("ratio,slot", [(1, 4), (4 / 3, 3), (2, 2), (4, 1), (float("inf"), 0)])
def test_fixed_ratio(ratio, slot):
    tr = buddy.Tracker(buddy.FixedRatio(ratio))
    assert tr.choose("k", [5, 5, 5, 5, 5], layout=Layout(E, 25 * E))[0] == slot


@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.1, 0.3, 1.0])
def test_threshold_picks_most_aggressive_slot_within_bound(threshold):
    hist = [10, 20, 30, 25, 15]
    nbytes = sum(hist) * E
    slot = buddy.BuddyThreshold(threshold).choose(
        Decision("k", Layout(E, nbytes), tuple(hist), None, 0), buddy.Tracker()
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
    d = Decision("k", Layout(E, 100 * E), (0, 0, 0, 0, 100), None, held_device_bytes=0)
    assert policy.choose(d, tr) == 2
    d = Decision("k", Layout(E, 100 * E), (0, 0, 0, 0, 100), None, held_device_bytes=100 * 33)
    assert policy.choose(d, tr) == 0


def test_budget_counts_the_codec_table():
    """A tensor's table is device bytes whatever its slot: the slot shrinks to leave room for it."""
    tr = buddy.Tracker()
    policy = buddy.DeviceBudget(100 * (64 + 1))
    d = Decision("k", Layout(E, 100 * E), (0, 0, 0, 0, 100), None, held_device_bytes=0, table_bytes=775)
    assert d.device_bytes(2) == 100 * (64 + 1) + 775 and d.device_bytes(0) == 100 + 775
    assert policy.choose(d, tr) == 1, "two sectors and the table do not fit; one sector and the table do"
    place = tr.plan("k", (0, 0, 0, 0, 100), layout=Layout(E, 100 * E), policy=policy, table_bytes=775)
    assert place.slot == 1 and place.device_bytes == 100 * (32 + 1) + 775
    record(tr, "k", [0, 0, 0, 0, 100])
    tr.history("k").fitted = buddy.get_codec("fpe").fit(torch.ones(100 * E // 4).view(torch.uint8), 4)
    table = tr.history("k").fitted.table.numel()
    assert buddy.DeviceBudget(100 * (32 + 1) + table).plan(tr) == {"k": 1}
    assert buddy.DeviceBudget(100 * (32 + 1) + table - 1).plan(tr) == {"k": 0}


def _step(tracker, policy, tensors, entry_bytes):
    """One training step through ``tracker``: plan and record every ``(key, histogram)``; the slots."""
    return {key: place.slot for key, _, place in tracker_step(tracker, policy, tensors, entry_bytes)}


def _dense(k: int, n: int = 100, entry_bytes: int = 512) -> list[int]:
    hist = [0] * (entry_bytes // 32 + 1)
    hist[k] = n
    return hist


def test_overflow_budget_spends_what_whole_sector_slots_leave():
    """Two dense tensors (every entry 11 of 16 sectors): the per-tensor rule gives both slot 10 (6.25 % each);
    the step's 10 % allows one of them slot 9 too."""
    tensors = [("a", _dense(11)), ("b", _dense(11))]
    threshold, budget = buddy.BuddyThreshold(0.10), buddy.OverflowBudget(0.10)
    tr = buddy.Tracker()
    assert _step(tr, threshold, tensors, 512) == {"a": 10, "b": 10}
    first = _step(buddy.Tracker(), budget, tensors, 512)
    assert first == {"a": 10, "b": 10}, "no history yet: the per-tensor rule"
    tr = buddy.Tracker()
    _step(tr, budget, tensors, 512)
    slots = _step(tr, budget, tensors, 512)
    assert sorted(slots.values()) == [9, 10]
    spilled = sum(overflow_sectors(h, slots[k]) * 32 for k, h in tensors)
    assert spilled <= 0.10 * 2 * 100 * 512 < spilled + 100 * 32, "within the step's 10 %, no room for another sector"


def test_overflow_budget_takes_the_cheapest_spill_first():
    """A sector of slot costs 5 spilled entries in "skewed" (down to 4) and 100 in "dense": skewed shrinks first,
    then the two alike (the step's 10 %: 320 sectors; skewed 12 -> 4 spills 40, dense 8 -> 6 200 more)."""
    skewed = [0] * 17
    skewed[4], skewed[12] = 95, 5
    tensors = [("dense", _dense(8)), ("skewed", skewed)]
    tr, policy = buddy.Tracker(), buddy.OverflowBudget(0.10)
    _step(tr, policy, tensors, 512)
    slots = _step(tr, policy, tensors, 512)
    # "dense" comes first: the running bound lets it spill 10 % of itself (160 sectors), so 8 -> 7 (100);
    # "skewed" then takes the rest: 12 -> 3 spills 140, 240 in all. The same device bytes as 6 and 4.
    assert slots == {"dense": 7, "skewed": 3}
    held = sum(100 * s for s in slots.values())
    each = buddy.OverflowBudget(0.10)
    assert held <= sum(100 * buddy.BuddyThreshold(0.10).choose(
        Decision(k, Layout(512, 100 * 512), tuple(h), tuple(h), 0), tr) for k, h in tensors
    ), "never more device bytes than the per-tensor rule"  # fmt: skip
    assert repr(each) == "OverflowBudget(max_overflow=0.1)"
    with pytest.raises(ValueError):
        buddy.OverflowBudget(1.5)


def test_overflow_budget_plan_is_the_same_with_its_room_as_a_list_or_an_array(monkeypatch):
    """Many keys keep the plan's running room in a numpy array, a few in a list: the same slots either way, on
    histories of random, skewed histograms (ties of cost included: shared histograms)."""
    gen = torch.Generator().manual_seed(5)
    shapes = [torch.rand(17, generator=gen) ** 4 for _ in range(6)]
    tensors = [
        (f"m/{i}", [int(v) for v in (shapes[i % 6] * (40 + i % 7 * 30)).round().tolist()]) for i in range(60)
    ]  # fmt: skip
    tr, policy = buddy.Tracker(), buddy.OverflowBudget(0.10)
    for _ in range(3):
        _step(tr, policy, tensors, 512)
    plans = {}
    for threshold in (1, 10**9):  # every plan as an array, and every plan as a list
        monkeypatch.setattr(buddy.tracker, "PLAN_ARRAY_KEYS", threshold)
        plans[threshold] = policy.plan(tr)
    assert plans[1] == plans[10**9] and len(plans[1]) == 60
    # (a plan of many slots, most keys stepped down from their tightest: the room was spent and checked)
    below = sum(plans[1][key] < tightest_slot(hist) for key, hist in tensors)
    assert len(set(plans[1].values())) > 3 and below > 30


def test_overflow_budget_holds_the_step_to_its_bound_when_the_history_is_wrong():
    """Planned on a step where every entry took 8 sectors; the next step's "a" takes 12 and "b" 4.

    Planned slots would spill 4 sectors an entry of "a" (25 % of the step):
    "a" gets what its allowance and nothing more spills, then "b" -- smaller
    than predicted -- gets a slot tighter than planned with what is left
    (allowance carried over, never beyond the step's 10 %)."""
    tr, policy = buddy.Tracker(), buddy.OverflowBudget(0.10)
    _step(tr, policy, [("a", _dense(8)), ("b", _dense(8))], 512)
    planned = policy.plan(tr)
    assert planned == {"a": 7, "b": 6} or planned == {"a": 6, "b": 7}
    tensors = [("a", _dense(12)), ("b", _dense(4))]
    slots = _step(tr, policy, tensors, 512)
    spilled = sum(overflow_sectors(h, slots[k]) * 32 for k, h in tensors)
    assert spilled <= 0.10 * 2 * 100 * 512, "the step's bound, though the history was wrong"
    assert slots["a"] > planned["a"], "wider than planned: it compresses worse than its history"
    assert slots["b"] < 4, "tighter than it needs for no overflow: the allowance it was planned, and a's leftovers"
    allowance = sum(overflow_sectors(_dense(8), planned[k]) * 32 for k in planned)
    assert allowance - 100 * 32 < spilled, "what was planned is spent, to within a sector of one tensor"
    # without a plan (buddy.wrap's case), each tensor gets the per-tensor rule on its own histogram
    fresh = buddy.OverflowBudget(0.10)
    assert fresh.choose(Decision("a", Layout(512, 100 * 512), tuple(_dense(12)), tuple(_dense(8)), 0), tr).slot == 11


def test_bad_tracker_arguments():
    with pytest.raises(ValueError):
        buddy.Tracker(decay=0)
    with pytest.raises(ValueError):
        buddy.Tracker(window=0)
    with pytest.raises(TypeError):
        buddy.set_default_tracker("x")


def test_slot_for_overflow_is_the_smallest_slot_within_the_limit():
    """The one-pass search against the definition, on histograms of every entry size's bin count, ints and floats."""
    g = torch.Generator().manual_seed(0)
    for bins in (2, 5, 17, 129, 2049):
        for trial in range(40 if bins < 1000 else 6):  # the definition is quadratic in the bins
            hist = (torch.rand(bins, generator=g) < 0.3) * torch.randint(0, 50, (bins,), generator=g)
            hist = hist.tolist() if trial % 2 else (hist * 0.37).tolist()  # predicted histograms are floats
            nbytes = max(1, int(sum(hist))) * 32 * (bins - 1)
            for share in (0.0, 0.01, 0.1, 0.5, 1.0):
                limit = share * nbytes
                want = min(s for s in range(bins) if overflow_sectors(hist, s) * spec.SECTOR_BYTES <= limit)
                assert slot_for_overflow(hist, share, nbytes) == want
    assert slot_for_overflow([0, 0, 0, 0, 0], 0.0, 0) == 0 and slot_for_overflow([7], 0.0, 10) == 0


def test_the_earlier_keywords_still_give_the_layout():
    """plan/choose/record take ``entry_bytes=`` and ``original_bytes=`` as before, the same as ``layout=``."""
    hist = [0, 40, 30, 20, 10]
    old, new = buddy.Tracker(buddy.BuddyThreshold(0.1)), buddy.Tracker(buddy.BuddyThreshold(0.1))
    for tr, kw in ((old, {"entry_bytes": E, "original_bytes": 100 * E}), (new, {"layout": Layout(E, 100 * E)})):
        tr.record("a", hist, slot=2, predicted_overflow_bytes=None, **kw)
    assert old.choose("a", hist, entry_bytes=E, original_bytes=100 * E) == new.choose("a", hist, layout=Layout(E, 100 * E))
    assert old.plan("a", hist, entry_bytes=E, original_bytes=100 * E) == new.plan("a", hist, layout=Layout(E, 100 * E))
    assert old.history("a").layout == new.history("a").layout == Layout(E, 100 * E)
    with pytest.raises(TypeError, match="layout"):
        old.choose("a", hist, entry_bytes=E)
    with pytest.raises(TypeError, match="not both"):
        old.choose("a", hist, layout=Layout(E, 100 * E), entry_bytes=E)
    with pytest.raises(ValueError, match="entry_bytes"):
        old.plan("a", hist, entry_bytes=100, original_bytes=100 * E)


def test_the_reserve_is_a_guess_from_the_bound_then_learned_from_recent_steps():
    """Tracker.reserve_sectors: a quarter more than the most a group's last RESERVE_STEPS steps sent past their
    bound (none where they sent none), and until that many were packed ahead, at least a quarter of what the bound
    allows its latest step's bytes. Groups apart; forget() starts over."""
    t = buddy.Tracker()
    layout = Layout(4096, 64 << 10, 4)
    for key in ("m/0", "m/1"):
        t.record(key, [0] * 64 + [16] + [0] * 64, slot=64, layout=layout, predicted_overflow_bytes=None)
    assert t.reserve_sectors("m", 0.1) == int(0.1 * (128 << 10) / 4) // 32 == 102
    assert t.reserve_sectors("other", 0.1) == 0  # nothing seen
    for sectors in (8, 40, 0):
        t.record_excess("m", sectors)
        assert t.reserve_sectors("m", 0.1) == 102  # (fewer than four steps: the guess, larger)
    t.record_excess("m", 0)
    assert t.reserve_sectors("m", 0.1) == 50  # the most of the last four, a quarter more
    t.record_excess("m", 0)  # 8 leaves the window
    assert t.reserve_sectors("m", 0.1) == 50
    t.record_excess("m", 0)  # and 40
    assert t.reserve_sectors("m", 0.1) == 0
    with pytest.raises(ValueError, match="non-negative int"):
        t.record_excess("m", -1)
    t.forget()
    assert t.reserve_sectors("m", 0.1) == 0
