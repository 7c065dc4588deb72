"""Packing beside forward (``buddy.overlap``): the pack stream's ordering, the stash's bound, and what is released
when -- checked on the CPU with the stand-in streams of ``test_streams`` (events complete only when a test says
so), never anything about speed."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn
from conftest import MiB, assert_bitexact
from test_streams import Chain, FakeEvent, FakeStreams, chain_input, grads

import buddy
from buddy import streams
from buddy.budget import MemoryTarget
from buddy.overlap import Overlap, Stash
from buddy.peak import Saved, StepProfile

MIN = 4096


@pytest.fixture
def fake():
    with streams.use(FakeStreams(), "cpu") as ops:
        yield ops


def overlapping(store, tracker, **kwargs):
    kwargs.setdefault("policy", buddy.FixedRatio(4.0))
    kwargs.setdefault("overlap", True)
    return buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN, **kwargs)


def learned(store, model, x) -> buddy.Tracker:
    """A tracker that has seen a step of ``model`` (its keys have plans: the next step packs ahead)."""
    tracker = buddy.Tracker()
    grads(model, x, overlapping(store, tracker, overlap=False))
    return tracker


# ---------------------------------------------------------------------------
# the stash on its own
# ---------------------------------------------------------------------------
def tensors(n: int, nbytes: int) -> list[torch.Tensor]:
    return [torch.zeros(nbytes // 4) for _ in range(n)]


class Owner:
    raced = False


def test_the_stash_lets_go_of_an_original_once_its_pack_completed(fake):
    stash = Stash(fake, "compute", 10 * MiB)
    a, b = tensors(2, MiB)
    ra = weakref.ref(a)
    first = fake.record("pack")
    stash.add(a, first, Owner())
    del a
    assert ra() is not None  # its pack has not read it yet
    first.complete = True
    stash.add(b, fake.record("pack"), Owner())  # (asked at the next pack, never waited for)
    assert ra() is None and stash.bytes == MiB
    assert all(kind != "sync" for kind, *_ in fake.log) and stash.waits == 0


def test_the_stash_never_holds_more_than_its_bound(fake):
    stash = Stash(fake, "compute", int(2.5 * MiB))
    events = []
    for t in tensors(6, MiB):
        events.append(fake.record("pack"))
        stash.add(t, events[-1], Owner())
        assert stash.bytes <= 2.5 * MiB
    assert stash.peak_bytes == 2 * MiB and stash.waits == 4
    waited = [e for kind, stream, e in (x for x in fake.log if x[0] == "wait")]
    assert waited == events[:4]  # forward's stream waited for the oldest packs, in order, on the device
    assert all(stream == "compute" for kind, stream, *_ in fake.log if kind == "wait")
    assert all(kind != "sync" for kind, *_ in fake.log)  # never on the host


def test_a_tensor_larger_than_the_bound_is_held_alone(fake):
    stash = Stash(fake, "compute", MiB // 2)
    big = tensors(2, MiB)
    stash.add(big[0], fake.record("pack"), Owner())
    assert stash.bytes == MiB  # the one in flight stays
    stash.add(big[1], fake.record("pack"), Owner())
    assert stash.bytes == MiB and stash.waits == 1


def test_draining_waits_for_the_last_pack_and_lets_go_of_everything(fake):
    stash = Stash(fake, "compute", 10 * MiB)
    held = tensors(3, MiB)
    refs = [weakref.ref(t) for t in held]
    for t in held:
        stash.add(t, fake.record("pack"), Owner())
    del held, t
    last = fake.record("pack")
    stash.drain(last)
    assert fake.log[-1] == ("wait", "compute", last)
    assert stash.bytes == 0 and all(r() is None for r in refs)


def test_a_change_while_packing_marks_the_owner(fake):
    stash = Stash(fake, "compute", 10 * MiB)
    changed, kept = tensors(2, MiB)
    owners = Owner(), Owner()
    stash.add(changed, fake.record("pack"), owners[0])
    stash.add(kept, fake.record("pack"), owners[1])
    changed.add_(1)  # issued while its pack could still be reading it
    stash.drain(fake.record("pack"))
    assert owners[0].raced and not owners[1].raced


# ---------------------------------------------------------------------------
# a session packing beside forward
# ---------------------------------------------------------------------------
def test_a_training_step_packs_on_the_pack_stream_bit_exact(fake, store):
    model, x = Chain(), chain_input()
    expected = grads(model, x)
    tracker = learned(store, model, x)
    fake.finish()  # the step before's copies have landed
    fake.log.clear()
    s = overlapping(store, tracker)
    got = grads(model, x, s)
    for a, b in zip(got, expected):
        assert_bitexact(a, b)
    st = s.stats()
    compressed = sum(r.codec not in ("kept", "left") for r in st.rows)
    assert compressed == 7 and st.overlapped == compressed  # the input and six ReLU outputs
    assert st.host_reads <= 2  # packing beside forward adds no read
    log = fake.log
    # each pack waits first for what forward recorded just before it ...
    starts = [i for i, e in enumerate(log) if e[:2] == ("wait", "pack")]
    assert len(starts) == compressed
    for i in starts:
        assert log[i - 1] == ("record", "compute", log[i][2])
    # ... forward's end waits for the pack stream's last work ...
    drained = [e for e in log if e[:2] == ("wait", "compute") and e[2].stream == "pack"]
    assert drained
    # ... and no host wait anywhere
    assert all(e[0] != "sync" for e in log)


def test_backward_waits_for_each_pack(fake, store, monkeypatch):
    model, x = Chain(), chain_input()
    tracker = learned(store, model, x)
    packed_events = []
    real = buddy.saved._Compressed._after_pack

    def after_pack(self, stream):
        if self.packed is not None:
            packed_events.append((stream, self.packed[1]))
        return real(self, stream)

    monkeypatch.setattr(buddy.saved._Compressed, "_after_pack", after_pack)
    s = overlapping(store, tracker, prefetch=False)
    grads(model, x, s)
    assert len(packed_events) == s.stats().decompressions == 7
    for stream, event in packed_events:
        assert stream == "compute" and event.stream == "pack"
        assert ("wait", "compute", event) in fake.log


def test_the_stash_bound_holds_in_a_step(fake, store, monkeypatch):
    model, x = Chain(), chain_input()
    tracker = learned(store, model, x)
    seen = []
    real = Stash.add

    def add(self, *args):
        real(self, *args)
        seen.append(self.bytes)

    monkeypatch.setattr(Stash, "add", add)
    s = overlapping(store, tracker, overlap=Overlap(stash_bytes=2 * MiB + MiB // 2))  # two 1 MiB originals
    grads(model, x, s)
    st = s.stats()
    assert max(seen) <= 2.5 * MiB and st.stash_peak_bytes == max(seen)
    assert st.stash_waits == st.overlapped - 2  # nothing completes by itself here: every third pack waits
    assert "overlap: 7 packed beside forward" in str(st)


def test_originals_are_released_where_forward_ends(fake, store):
    model, x = Chain(), chain_input()
    tracker = learned(store, model, x)
    refs = []

    def keep_refs(module, inputs, output):
        refs.append(weakref.ref(output))

    handles = [layer.register_forward_hook(keep_refs) for layer in model.layers]
    with overlapping(store, tracker) as s:
        y = model(x)
        assert s._stashes  # in flight: held
    for h in handles:
        h.remove()
    gc.collect()
    assert all(r() is None for r in refs)  # the Linear outputs (fed to ReLU, saved by nobody else) are gone
    assert not s._stashes
    y.square().sum().backward()


def test_a_range_freed_while_its_pack_runs_waits_for_the_pack(fake, store):
    """A graph dropped during forward frees its compressed tensors while their packs may still write their ranges
    of buddy memory: the store hands those ranges to no one else until the packs' events complete."""
    model, x = Chain(), chain_input()
    tracker = learned(store, model, x)
    fake.finish()
    with overlapping(store, tracker) as s:
        y = model(x)
        held = [e.bt._overflow for e in (r() for r in s._schedule._entries) if e is not None]
        assert held and all(a.written is not None and a.written.stream == "pack" for a in held)
        del y  # the graph goes: every compressed tensor is freed now
        gc.collect()
        store.trim()
        assert all(a.busy for a in held)  # ... their ranges wait for their packs
        assert s.stats().overlapped == len(held)
    fake.finish()
    store.trim()
    assert store.bytes_held == 0


def test_a_backward_inside_the_block_waits_for_the_packs(fake, store):
    model, x = Chain(), chain_input()
    expected = grads(model, x)
    tracker = learned(store, model, x)
    model.zero_grad()
    with overlapping(store, tracker) as s:
        model(x).square().sum().backward()
        assert not s._stashes  # the first unpack let every original go, after a wait on the device
    for p, e in zip(model.parameters(), expected):
        assert_bitexact(p.grad, e)


class ChangesItsOutput(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(512, 512)

    def forward(self, x, change: bool):
        y = torch.sigmoid(self.linear(x))  # saves its output
        if change:
            y.mul_(2)  # changed in place after its save
        return y


def test_a_tensor_changed_while_its_pack_runs_raises_in_backward(fake, store):
    model, x = ChangesItsOutput(), chain_input()
    tracker = buddy.Tracker()
    with overlapping(store, tracker, overlap=False):
        y = model(x, False)
    y.sum().backward()
    with overlapping(store, tracker) as s:
        y = model(x, True)
    assert s.stats().overlapped == 2  # the input and the output changed
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_overlap_changes_nothing_on_the_host(store):
    model, x = Chain(), chain_input()
    expected = grads(model, x)
    tracker = learned(store, model, x)
    s = overlapping(store, tracker)
    got = grads(model, x, s)
    for a, b in zip(got, expected):
        assert_bitexact(a, b)
    assert s.stats().overlapped == 0 and not s._stashes


def test_overlap_arguments_are_checked(store):
    assert buddy.compressed_activations(overlap=True).overlap == Overlap()
    assert buddy.compressed_activations(overlap=False).overlap is None
    with pytest.raises(ValueError, match="stash_bytes"):
        Overlap(stash_bytes=-1)
    with pytest.raises(ValueError, match="stash_bytes"):
        Overlap(stash_bytes=True)
    with pytest.raises(TypeError, match="overlap"):
        buddy.compressed_activations(overlap="yes")


def test_a_memory_target_counts_the_stash():
    profile = StepProfile()
    index = profile.save(Saved("m/0:x", 8 * MiB, 2 * MiB, True, torch.float32, torch.device("cpu"), "auto2", 0))
    profile.end_forward()
    profile.use(index)
    plain = MemoryTarget(fraction=0.5)._limits(profile)["target"]
    profile.stash_bytes = MiB
    assert MemoryTarget(fraction=0.5)._limits(profile)["target"] == plain - MiB
    assert MemoryTarget(nbytes=10 * MiB)._limits(profile)["target"] == 9 * MiB
    assert isinstance(FakeEvent("pack", 0), FakeEvent)
