"""The overflow ring (``compressed_activations(overflow_ring=...)``, ``buddy.ring``): packs ahead write their overflow
into regions of a buffer on the device, and a drain kernel on the copy stream copies it to buddy memory.

Checked on the CPU: the training step bit-exact with the native engine, the same bytes in buddy memory as without a
ring (and the reserve's three cases: test_native, test_emulator), the drain kernel under the emulator with exactly
the bytes it copies, and the ordering with the stand-in streams of ``test_streams`` (events complete only when a
test says so). Nothing here says which is faster on a GPU: the runbook measures that.
"""

from __future__ import annotations

import functools
import shutil

import pytest
import torch
from conftest import MiB, assert_bitexact
from test_ahead import MIN, batch, mlp, train
from test_streams import Chain, FakeStreams, chain_input, grads

import buddy
from buddy import engines, pipeline, streams
from buddy.engines import cuda as bcuda
from buddy.engines import native
from buddy.layout import Layout
from buddy.ring import OverflowRing, check_ring_bytes

pytestmark = [
    pytest.mark.library_defaults,
    pytest.mark.filterwarnings("ignore:buddy. this step's overflow passed its policy's bound"),
]


def sessions(**kwargs):
    """Sessions of one run packed ahead: one tracker and store for all its steps."""
    tracker, store = buddy.Tracker(), buddy.BuddyStore(capacity_bytes=256 << 20, pin=False)
    return functools.partial(
        buddy.compressed_activations, tracker=tracker, store=store, min_bytes=MIN, strict=False, **kwargs
    )  # fmt: skip


@pytest.fixture
def fake():
    with streams.use(FakeStreams(), "cpu") as ops:
        yield ops


# ---------------------------------------------------------------------------
# a training step
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_a_step_through_the_ring_trains_bit_identically_and_reads_twice(kind):
    _, plain = train(kind, 4)
    stats, weights = train(kind, 4, sessions(overflow_ring=2 * MiB))
    assert all(all(torch.equal(a, b) for a, b in zip(w, v)) for w, v in zip(weights, plain))
    direct, _ = train(kind, 4, sessions())
    for st, without in zip(stats[1:], direct[1:]):
        packed = sum(r.codec not in ("kept", "left") for r in st.rows)
        assert st.host_reads == 2 and st.ring_drained == packed > 0 and st.ring_bytes == 2 * MiB
        # the same slots and overflow as without a ring; the ring's bytes count against capacity
        assert [(r.device_bytes, r.buddy_bytes) for r in st.rows] == [
            (r.device_bytes, r.buddy_bytes) for r in without.rows
        ]  # fmt: skip
        assert st.effective_capacity == st.original_bytes / (st.device_bytes + st.reserve_bytes + 2 * MiB)
        assert "overflow ring 2.00 MiB" in str(st)
    assert stats[0].ring_bytes == 0  # (the first step sizes every tensor: nothing staged)


def test_a_ring_smaller_than_a_tensors_worst_case_packs_it_as_without_one():
    stats, _ = train("mlp", 3, sessions(overflow_ring=4096))
    st = stats[-1]
    packed = sum(r.codec not in ("kept", "left") for r in st.rows)
    assert st.ring_too_large == packed and st.ring_drained == 0 and st.host_reads == 2


def test_a_memory_target_plans_the_peak_lower_by_the_ring():
    """The ring's bytes, like the stash's, are held beside the saved tensors: the step's profile, which a
    ``MemoryTarget`` takes them from (test_overlap), counts both."""
    tracker = buddy.Tracker()
    with buddy.compressed_activations(tracker=tracker, overflow_ring=3 * MiB, overlap=buddy.Overlap(stash_bytes=MiB)):
        pass
    assert tracker.last_profile.stash_bytes == 4 * MiB


def test_the_ring_argument_is_checked():
    assert check_ring_bytes(0) == 0 and check_ring_bytes(32) == 32
    for bad, error in ((-1, ValueError), (16, ValueError), (True, TypeError), (1.5, TypeError), ("1M", TypeError)):
        with pytest.raises(error, match="overflow_ring"):
            buddy.compressed_activations(overflow_ring=bad)
    with pytest.raises(ValueError, match="at least one sector"):
        OverflowRing(torch.device("cpu"), 0)


# ---------------------------------------------------------------------------
# the ring's regions and their order
# ---------------------------------------------------------------------------
def test_regions_go_round_the_ring_and_wait_only_for_drains_they_overlap(fake):
    ring = OverflowRing(torch.device("cpu"), 1000)  # whole sectors: 992 bytes
    assert ring.nbytes == 992 and ring.held_bytes == 0
    a = ring.stage(300)  # 320 bytes
    b = ring.stage(320)
    assert (a.start, a.end, b.start, b.end) == (0, 320, 320, 640) and ring.held_bytes == 992
    a.drained, b.drained = fake.record("copy"), fake.record("copy")
    c = ring.stage(352)  # 640 + 352 = 992: fits before the end, overlaps neither
    assert (c.start, c.end) == (640, 992) and ring.waits == 0
    c.drained = fake.record("copy")
    d = ring.stage(600)  # from the start again: over a and b, the forward stream waits for b's drain (after a's)
    assert (d.start, d.end) == (0, 608) and ring.waits == 1
    assert fake.log[-1] == ("wait", "compute", b.drained)
    d.drained = fake.record("copy")
    e = ring.stage(64)  # after d, under c: waits for c's drain
    assert (e.start, e.end) == (608, 672) and fake.log[-1] == ("wait", "compute", c.drained)
    assert ring.stage(993) is None and ring.too_large == 1
    assert torch.equal(d.data, ring.buffer[0:608]) and d.data.data_ptr() == ring.buffer.data_ptr()
    assert all(kind != "sync" for kind, *_ in fake.log)  # never on the host


def test_an_abandoned_region_is_free_after_the_work_issued_before(fake):
    ring = OverflowRing(torch.device("cpu"), 1024)
    a = ring.stage(1024)
    ring.abandon(a)
    assert a.drained.stream == "compute"
    ring.stage(32)
    assert fake.log[-1] == ("wait", "compute", a.drained)


def ring_step(fake, store, **kwargs):
    """A step of :class:`Chain` packed ahead through a ring, after one sized step, with the stand-in streams:
    (its session, the tensors it packed ahead), its gradients checked bit-exact against training without buddy."""
    model, x = Chain(), chain_input()
    expected = grads(model, x)
    tracker, policy = buddy.Tracker(), buddy.FixedRatio(4.0)
    grads(model, x, buddy.compressed_activations(policy=policy, tracker=tracker, store=store, min_bytes=4096))
    fake.finish()
    fake.log.clear()
    s = buddy.compressed_activations(
        policy=policy, tracker=tracker, store=store, min_bytes=4096, overflow_ring=8 * MiB, **kwargs
    )  # fmt: skip
    made: list = []
    real = pipeline.pack_ahead
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(buddy.autograd, "pack_ahead", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
        got = grads(model, x, s)
    for a, b in zip(got, expected):
        assert_bitexact(a, b)
    assert s.stats().ring_drained == len(made) == 7 and s.stats().host_reads <= 2
    assert all(e[0] != "sync" for e in fake.log)  # never a wait on the host
    return s, made


def test_a_step_drains_on_the_copy_stream_after_each_pack_and_readers_wait_for_the_drain(fake, store):
    s, made = ring_step(fake, store, prefetch=False)
    log = fake.log
    copies = [i for i, e in enumerate(log) if e[:2] == ("wait", "copy")]
    assert len(copies) == 7
    for i in copies:  # each drain waits for what forward's stream recorded just after its pack
        assert log[i - 1] == ("record", "compute", log[i][2])
        assert [e[:2] for e in log[i + 1 : i + 4]] == [("keep", "copy")] * 3  # the ring, the sums, the placement
    drains = [e[2] for e in log if e[:2] == ("record", "copy")]
    assert [bt._overflow.written for bt in made] == drains  # each range's write: its drain
    waited = {id(e[2]) for e in log if e[0] == "wait" and e[1] != "copy"}
    assert all(id(event) in waited for event in drains)  # backward read each overflow after its drain


def test_with_overlap_a_drain_follows_its_pack_and_writes_the_range(fake, store):
    s, made = ring_step(fake, store, overlap=True)
    assert s.stats().overlapped == 7
    log = fake.log
    drains = [i for i, e in enumerate(log) if e[:2] == ("wait", "copy") and e[2].stream == "pack"]
    assert len(drains) == 7 and all(log[i - 1] == ("record", "pack", log[i][2]) for i in drains)
    assert all(bt._overflow.written.stream == "copy" for bt in made)  # the drain's event, not the pack's


# ---------------------------------------------------------------------------
# the drain kernel
# ---------------------------------------------------------------------------
def packed_into_region(engine, slot: int = 2):
    t = torch.relu(torch.randn(20_000, generator=torch.Generator().manual_seed(3)))
    layout = Layout(512, t.numel() * 4, 4)
    sizes = torch.zeros(engines.PLACE_WORDS + layout.bins, dtype=torch.int64)
    worst = layout.slots_bytes(layout.sectors_per_entry) - layout.slots_bytes(slot)
    staged = torch.zeros(worst, dtype=torch.uint8)
    _, meta, slots, ends = engine.pack_ahead(t.view(torch.uint8), layout, slot, sizes, staged)
    return t, layout, sizes, staged, ends


def test_a_drain_copies_what_the_placement_counts_and_never_past_either_buffer():
    engine = native.NativeEngine(buddy.get_codec("zvc"))
    t, layout, sizes, staged, ends = packed_into_region(engine)
    total = int(ends[-1]) * 32
    assert 0 < total < staged.numel()
    into = torch.full_like(staged, 0xEF)
    engine.drain(layout, staged, ends, sizes[:4], into)
    assert torch.equal(into[:total], staged[:total]) and bool((into[total:] == 0xEF).all())
    for r, copied in ((int(ends[-1]) + 5, 0), (-(1 << 40), 64 * 32)):  # a count below zero; past the buffers
        place = sizes[:4].clone()
        place[1] = r
        into = torch.full((64 * 32,), 0xEF, dtype=torch.uint8)
        engine.drain(layout, staged, ends, place, into)
        assert torch.equal(into[:copied], staged[:copied]) and bool((into[copied:] == 0xEF).all())
    with pytest.raises(ValueError, match="place"):
        engine.drain(layout, staged, ends, sizes[:3], into)


@pytest.mark.emulator
def test_the_emulator_catches_a_drain_that_copies_a_sector_too_many(tmp_path):
    """The drain kernel's source changed to copy one sector past its count: under the emulator, given exactly the
    bytes it should copy, ASan reports the access (so the exact-size launches of the other tests mean something)."""
    if shutil.which("g++") is None:
        pytest.skip("the emulator needs g++")
    from emulator import CSRC, Emulator, EmulatorError

    old = "const long long words = sectors * (BUDDY_SECTOR_BYTES / 8);"
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    source = csrc / "buddy_kernels.cu"
    assert source.read_text().count(old) == 1
    source.write_text(
        source.read_text().replace(old, "const long long words = (sectors + 1) * (BUDDY_SECTOR_BYTES / 8);")
    )
    for sources, caught in ((CSRC, False), (csrc, True)):
        with Emulator("asan", seed=1, csrc=sources, codecs="zvc") as emu:
            engine = bcuda.CudaEngine(buddy.get_codec("zvc"), launch=emu, device_type="cpu")
            t, layout, sizes, staged, ends = packed_into_region(engine)
            into = torch.zeros_like(staged)
            try:
                engine.drain(layout, staged, ends, sizes[:4], into)
            except EmulatorError as error:
                assert caught and error.what == "memory", error
                continue
            assert not caught, "not caught"
            assert torch.equal(into, staged)


@pytest.mark.emulator
def test_a_step_through_the_ring_under_the_emulator():
    """The kernel sources, unchanged, under the emulator: each pack writes its region and each drain copies exactly
    the bytes its sums say, and the step is bit-exact."""
    from conftest import emulated_cpu_kernels

    with emulated_cpu_kernels("zvc", seed=7) as emu:
        run = sessions(overflow_ring=MiB, policy=buddy.FixedRatio(2.0), codec="zvc")
        model, (x, _) = mlp(), batch("mlp")
        model, x = model[:5], x[:64]
        for _ in range(2):
            with run() as s:
                loss = model(x).square().mean()
            loss.backward()
            got = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            model(x).square().mean().backward()
            assert all(
                torch.equal(a.view(torch.int32), p.grad.view(torch.int32)) for a, p in zip(got, model.parameters())
            )
            model.zero_grad()
        assert s.stats().ring_drained == sum(r.codec == "zvc" for r in s.stats().rows) > 0
        assert sum("drain" in launch[0] for launch in emu.launches) >= s.stats().ring_drained
