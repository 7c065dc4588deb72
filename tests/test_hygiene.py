"""Memory hygiene: long runs end where they started.

Thousands of compress/free cycles and hundreds of training steps leave the
host store (buddy bytes, blocks, reserved bytes), the device accounting and
the tracker at their baseline; host blocks are made once and reused; a
BuddyTensor that is garbage-collected without ``free()`` returns its memory;
reference cycles through the session or the graph keep nothing alive once
the graph is gone. The CI-sized variants run in seconds; the long ones are
marked ``slow``.
"""

from __future__ import annotations

import collections
import gc
import os
import types
import weakref

import pytest
import torch
from conftest import assert_bitexact, held, make_data
from small_training import (  # noqa: F401 - module_setup is a module-wide fixture
    MIN_BYTES,
    assert_clean,
    assert_same_training,
    make_batch,
    make_mlp,
    module_setup,
    train,
)

import buddy

#: the session under the suite's pinned zvc at E = 128 and under the library's own defaults
pytestmark = pytest.mark.both_defaults

KiB = 1 << 10
MiB = 1 << 20


class GrowCounter:
    """Counts the blocks a store creates (every new block goes through ``_grow``)."""

    def __init__(self, store: buddy.BuddyStore, monkeypatch):
        self.calls = 0
        real = store._grow

        def grow(size):
            self.calls += 1
            return real(size)

        monkeypatch.setattr(store, "_grow", grow)


def _snapshot(store: buddy.BuddyStore) -> dict:
    st, dev = store.stats(), buddy.ledger.default_ledger().stats()
    return {
        "buddy_bytes_held": st.buddy_bytes_held,
        "device_bytes_held": dev.device_bytes_held,
        "tensors_held": dev.tensors_held,
        "blocks": st.buddy_blocks,
        "reserved": st.buddy_reserved_bytes,
        "block_buffers": sorted(b.buffer.data_ptr() for b in store._blocks),
    }


def _cycle_data(gen) -> list[torch.Tensor]:
    """Small tensors of several dtypes, sizes and compressibilities (a few bytes to 16 KiB)."""
    specs = [
        ("random_bytes", 4000, torch.float32),
        ("relu", 3000, torch.float32),
        ("zeros", 500, torch.float32),
        ("special", 1, torch.float32),
        ("random_bytes", 5000, torch.bfloat16),
        ("relu", 777, torch.float64),
        ("random_bytes", 129, torch.int8),
        ("special", 2000, torch.float16),
    ]
    return [make_data(kind, n, dtype, gen) for kind, n, dtype in specs]


def _compress_free_cycles(cycles: int, gen, monkeypatch) -> None:
    store = buddy.BuddyStore(capacity_bytes=64 * MiB, block_bytes=64 * KiB, pin=False)
    grows = GrowCounter(store, monkeypatch)
    data = _cycle_data(gen)
    ratios = (4.0, 2.0, 4 / 3, float("inf"), None)
    window = collections.deque()  # up to 6 tensors alive at once, so ranges interleave and coalesce
    warmup = 10 * len(data) * len(ratios)
    steady = None
    for i in range(cycles):
        t = data[i % len(data)]
        window.append((buddy.compress(t, ratios[i % len(ratios)], store=store), t))
        if len(window) > 6:
            bt, original = window.popleft()
            if i % 13 == 0:
                assert_bitexact(bt.decompress(), original)
            if i % 7 == 0:
                del bt  # not freed: reference counting runs its finalizer
            else:
                bt.free()
        if i == warmup:
            steady = (grows.calls, _snapshot(store))
    assert steady is not None
    while window:
        window.popleft()[0].free()
    end = _snapshot(store)
    grows_then, then = steady
    assert grows.calls == grows_then, f"{grows.calls - grows_then} block(s) made after warm-up: blocks are not reused"
    assert end["block_buffers"] == then["block_buffers"], "blocks were replaced"
    assert end["reserved"] == then["reserved"] and end["blocks"] == then["blocks"]
    assert (end["buddy_bytes_held"], end["device_bytes_held"], end["tensors_held"]) == (0, 0, 0)
    assert_clean(store)
    assert store.trim() == end["reserved"] and store.reserved_bytes == 0


def test_compress_free_cycles_return_to_baseline(gen, monkeypatch):
    """3,000 cycles (CI-sized): no growth after warm-up, everything back at the end."""
    _compress_free_cycles(3_000, gen, monkeypatch)


@pytest.mark.slow
def test_compress_free_cycles_return_to_baseline_long(gen, monkeypatch):
    _compress_free_cycles(30_000, gen, monkeypatch)


def test_blocks_are_made_once_across_sizes(gen, monkeypatch):
    """A store that once held the largest tensor serves every smaller one from the same block."""
    store = buddy.BuddyStore(capacity_bytes=16 * MiB, block_bytes=256 * KiB, pin=False)
    grows = GrowCounter(store, monkeypatch)
    big = make_data("random_bytes", 60_000, torch.float32, gen)  # ~180 KiB of overflow at 4x
    buddy.compress(big, 4.0, store=store).free()
    assert grows.calls == 1
    for n in (1, 31, 1000, 20_000, 60_000, 5):
        with buddy.compress(big[:n], 4.0, store=store):
            pass
    assert grows.calls == 1 and store.stats().buddy_blocks == 1
    assert_clean(store)


def test_garbage_collected_tensors_release_their_memory(store, gen):
    """300 BuddyTensors dropped without free(): plainly, in self-cycles and in pairs referring to each other."""
    data = _cycle_data(gen)
    before = _snapshot(store)
    for i in range(300):
        bt = buddy.compress(data[i % len(data)], 4.0, store=store)
        if i % 3 == 1:
            bt.me = bt
        elif i % 3 == 2:
            other = buddy.compress(data[(i + 1) % len(data)], 2.0, store=store)
            bt.other, other.other = other, bt
            del other
        del bt
    gc.collect()
    after = _snapshot(store)
    for key in ("buddy_bytes_held", "device_bytes_held", "tensors_held"):
        assert after[key] == before[key] == 0, key
    assert_clean(store)


def _training_hygiene(steps: int, monkeypatch, compare: bool) -> None:
    store = buddy.BuddyStore(capacity_bytes=64 * MiB, block_bytes=256 * KiB, pin=False)
    tracker = buddy.Tracker()
    grows = GrowCounter(store, monkeypatch)
    batch = make_batch(rows=16)
    sessions = []
    marks = {}

    def session(step):
        policy = (buddy.BuddyThreshold(0.1), buddy.FixedRatio(4.0), buddy.DeviceBudget(48 * KiB))[step % 3]
        s = buddy.compressed_activations(policy, tracker=tracker, store=store, min_bytes=MIN_BYTES)
        sessions.append(weakref.ref(s))
        return s

    def after_step(step):
        assert held(store) == (0, 0, 0), step
        assert tracker.held_device_bytes == 0, f"step {step}: the tracker counts {tracker.held_device_bytes} B held"
        if step == 5:  # every policy ran twice: the steady state
            gc.collect()
            marks.update(grows=grows.calls, store=_snapshot(store), keys=len(tracker.histories()))
            marks["finalizers"] = len(weakref.finalize._registry)

    run = train(make_mlp(), steps, session, batch=batch, after_step=after_step)
    assert all(s.stats().rows for s in run.sessions)
    run.sessions.clear()
    gc.collect()
    end = _snapshot(store)
    assert grows.calls == marks["grows"], "blocks were made after the first steps"
    assert end["block_buffers"] == marks["store"]["block_buffers"] and end["reserved"] == marks["store"]["reserved"]
    assert len(tracker.histories()) == marks["keys"], "keys are not stable across steps"
    assert len(weakref.finalize._registry) <= marks["finalizers"], "finalizers pile up step after step"
    assert sum(ref() is not None for ref in sessions) == 0, "a session outlived its step"
    assert_clean(store, tracker)
    if compare:
        assert_same_training(train(make_mlp(), steps, batch=batch), run)


def test_training_steps_return_to_baseline(monkeypatch):
    """300 steps (CI-sized) under three policies: nothing held between steps, no growth, same bits."""
    _training_hygiene(300, monkeypatch, compare=True)


@pytest.mark.slow
def test_training_steps_return_to_baseline_long(monkeypatch):
    _training_hygiene(3_000, monkeypatch, compare=True)


# ---------------------------------------------------------------------------
# reference cycles through the session and the graph
# ---------------------------------------------------------------------------
def _forward(store, tracker):
    model = make_mlp()
    x, y = make_batch()
    with buddy.compressed_activations(buddy.FixedRatio(4.0), tracker=tracker, store=store, min_bytes=MIN_BYTES) as s:
        loss = torch.nn.functional.cross_entropy(model(x), y)
    assert buddy.ledger.default_ledger().tensors_held > 0
    return model, loss, s


def test_cycle_between_the_loss_and_its_session(store, tracker):
    _, loss, session = _forward(store, tracker)
    loss.session, session.loss = session, loss  # only the collector can free these two
    del loss, session
    assert_clean(store, tracker)


def test_session_kept_for_its_stats_holds_no_buffers(store, tracker):
    model, loss, session = _forward(store, tracker)
    loss.backward()
    del loss
    assert held(store) == (0, 0, 0), "a session kept for its stats holds its tensors"
    assert session.stats().rows and session.stats().decompressions > 0
    assert_clean(store, tracker)


def test_cycle_through_a_traceback(store, tracker):
    """A frame that keeps its own exception (frame -> traceback -> frame) with the graph in its locals."""

    def failing_step():
        _, loss, _ = _forward(store, tracker)
        try:
            raise RuntimeError("boom")
        except RuntimeError as exc:
            kept = exc  # noqa: F841 - the cycle under test
        return weakref.ref(loss)

    ref = failing_step()
    assert_clean(store, tracker)
    assert ref() is None


def test_retained_graph_backward_twice_then_dropped(store, tracker):
    model, loss, _ = _forward(store, tracker)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    held = buddy.ledger.default_ledger().tensors_held
    assert held > 0, "a retained graph keeps its compressed tensors"
    model.zero_grad(set_to_none=True)
    loss.backward()
    for a, p in zip(first, model.parameters()):
        assert torch.equal(a.view(torch.uint8), p.grad.view(torch.uint8))  # decompressed again, bit-exact
    del loss
    assert_clean(store, tracker)


class _TrainerPolicy(buddy.BuddyThreshold):
    """A policy that refers to the trainer, which holds the step's loss: graph -> ... -> policy -> graph."""

    def __init__(self, trainer):
        super().__init__(0.1)
        self.trainer = trainer


@pytest.mark.parametrize("owner", ["session", "tracker"], ids=lambda o: f"policy-of={o}")
def test_policy_referring_back_to_the_graph(owner, store):
    """The graph owns what it saved; what that refers to must not lead back to the graph.

    The cycle would run through the graph's C++ nodes, where the collector
    cannot follow it: the graph and its buddy memory would never be freed.
    """
    trainer = types.SimpleNamespace()
    policy = _TrainerPolicy(trainer)
    tracker = buddy.Tracker(policy if owner == "tracker" else None)
    x, y = make_batch()
    session = buddy.compressed_activations(
        policy if owner == "session" else None, tracker=tracker, store=store, min_bytes=MIN_BYTES
    )
    with session:
        trainer.loss = torch.nn.functional.cross_entropy(make_mlp()(x), y)
    trainer.session = session
    assert buddy.ledger.default_ledger().tensors_held > 0
    del trainer, policy, session
    if owner == "session":
        assert_clean(store, tracker)
    else:
        del tracker  # it refers to the trainer through its policy
        assert_clean(store)


# ---------------------------------------------------------------------------
# process memory
# ---------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the RSS from /proc (Linux)")
def test_process_rss_does_not_grow(gen):
    """After warm-up, 10,000 more cycles add (next to) nothing to the process's resident memory."""
    store = buddy.BuddyStore(capacity_bytes=64 * MiB, block_bytes=256 * KiB, pin=False)
    data = _cycle_data(gen)

    def cycles(n):
        for i in range(n):
            bt = buddy.compress(data[i % len(data)], (4.0, 2.0, None)[i % 3], store=store)
            if i % 5 == 0:
                bt.decompress()
            bt.free()

    cycles(1_000)
    gc.collect()
    before = _rss_bytes()
    cycles(10_000)
    gc.collect()
    grown = _rss_bytes() - before
    assert grown < 16 * MiB, f"RSS grew by {grown / MiB:.1f} MiB over 10,000 cycles"
    assert_clean(store)
