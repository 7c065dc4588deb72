"""The native CPU engine: the kernel sources built for the host, byte for byte against the torch reference.

:mod:`buddy.engines.native` compiles ``csrc/buddy_kernels.cu`` (the sources
NVRTC compiles for the GPU, through the shim the block emulator uses) into a
library per codec and entry size and runs it with a fast runtime
(``csrc/host/native.cpp``: one warp a block, lanes as fibers in a fixed
order, blocks over host threads; every kernel, the fits too, from the
codec's build of one lane a warp). Here, as the emulator's tests do for the
emulated kernels:

* every codec on real activations (float32, bfloat16, float64, int64, text
  bytes; partial last entries; slots that overflow and the zero slot): the
  reference's histogram, metadata, table, slots and overflow exactly, each
  decoding the other's buffers; one host thread and several alike;
* tensors of one entry; random tensors of every dtype (the fuzz corpus's);
* every golden vector of every format version: written (sets still written)
  and decoded;
* damaged buffers: flagged (``CorruptDataError``) exactly where the reference
  raises;
* the engine table: the native engine is the CPU default of
  :data:`~buddy.engines.native.DEFAULT_CODECS` once its self-test passed, the
  reference elsewhere; ``BUDDY_BACKEND=reference`` and ``BUDDY_NATIVE=0``
  turn it off; no compiler, or a build that fails, leaves the reference
  running and says why; a forked child and concurrent threads run it too.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import stat
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_bitexact, fuzz_settings, ids, stream_bytes
from hypothesis import given
from hypothesis import strategies as st
from kernel_cases import (
    CASES,
    _same_buffers,
    check_damage_flagged,
    check_golden,
    check_reference_buffers,
    check_tensors_of_one_entry,
    straddling_entries,
)
from test_device_codecs import tensor_ends
from test_fuzz import tensors
from test_golden import CASES as GOLDEN_CASES
from test_golden import SETS as GOLDEN_SETS
from test_golden import load_vectors

import buddy
from buddy import dispatch, selftest, spec
from buddy import format as bformat
from buddy.codecs import fpe_device
from buddy.codecs.fpe import FPECodec
from buddy.engines import native
from buddy.engines import sources as bsources
from buddy.layout import Layout

pytestmark = pytest.mark.skipif(native.why_unusable() is not None, reason=f"{native.why_unusable()}")

CODECS = tuple(bsources.KERNEL_CODECS)
TABLED = bsources.TABLED_KERNELS


@pytest.mark.parametrize("codec", CODECS, ids=[f"codec={c}" for c in CODECS])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_native_writes_and_reads_the_reference_buffers(codec, case, activations, store):
    t = case.tensor(activations)
    e = case.entry_bytes
    slot, got = check_reference_buffers("native", codec, t, e, case.slot_for, store, codec in TABLED)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one host thread runs every block: the same bytes
    try:
        ratio = spec.ratio_for_slot(slot, e)
        one = buddy.compress(t, ratio, codec, entry_bytes=e, backend="native", store=store)
        want = buddy.compress(t, ratio, codec, entry_bytes=e, backend="reference", store=store)
        assert one.backend == "native"
        _same_buffers(one, want)
        assert_bitexact(one.decompress(), t)
    finally:
        torch.set_num_threads(threads)
    one.free()
    want.free()


@pytest.mark.parametrize("entry_bytes", [128, 4096, 65536])  # one-byte and two-byte metadata words
def test_the_ends_kernel_is_the_formats_prefix_sum(entry_bytes):
    """The overflow's prefix sums by the ends kernel (one launch, the engine's only way to them) against the
    format's, on every slot's edge, for counts of entries around its runs (a run of entries a thread)."""
    gen = torch.Generator().manual_seed(entry_bytes)
    engine = native.NativeEngine(buddy.get_codec("auto2"))
    for n in (1, 3, 255, 256, 257, 1000):
        layout = Layout(entry_bytes, n * entry_bytes, 4)
        meta = torch.randint(0, 256, (layout.meta_bytes,), dtype=torch.uint8, generator=gen)
        for slot in (0, 1, entry_bytes // 64, entry_bytes // 32 - 1, entry_bytes // 32):
            got = engine._ends(meta, slot, layout)
            assert got.dtype == torch.int64 and torch.equal(got, tensor_ends(meta, slot, entry_bytes)), (n, slot)


@pytest.mark.parametrize("threads", [1, 4])
def test_the_sizes_kernel_is_measure_then_ends(threads, monkeypatch):
    """The sizes kernel (measure, and the prefix sums in the block done last), its blocks on host threads at once:
    measure's metadata and histogram and the ends kernel's sums, every time, its count of blocks done the grid."""
    monkeypatch.setenv(native.ENV_THREADS, str(threads))
    t = torch.relu(torch.randn(300_001, generator=torch.Generator().manual_seed(threads)))
    engine = native.NativeEngine(buddy.get_codec("zvc"))
    layout = Layout(512, t.numel() * 4, 4)
    data, tail = engine._entries(t.view(torch.uint8), layout)
    measured = engine.measure(t.view(torch.uint8), layout)
    for slot in (0, 5, 16) * 4:
        meta, ends = torch.empty(layout.meta_bytes, dtype=torch.uint8), torch.empty(layout.n_entries, dtype=torch.int64)
        histogram, place = torch.zeros(layout.bins, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
        engine.kernels.sizes(layout, data, tail, meta, histogram, slot, ends, place)
        assert torch.equal(meta, measured.meta) and tuple(histogram.tolist()) == measured.histogram
        assert torch.equal(ends, tensor_ends(meta, slot, 512)), slot
        assert place.tolist() == [int(ends[-1]), 0, 0, native._grid("sizes", layout.n_entries, threads)]
        assert place[3] > 1


@pytest.mark.parametrize("room", [0, 40, 1 << 40])
@pytest.mark.parametrize("reserve_sectors", [0, 20, 4096])
def test_the_reserve_takes_the_overflow_past_the_room_and_unpack_finds_it(room, reserve_sectors):
    """The sizes kernel places a tensor's overflow: its first sectors in buddy memory, as many as ``room`` less what
    the step sent there before; the next in the step's reserve on the device, as many as it has left; the rest in
    buddy memory again. Pack writes each where it is placed (nothing else of the reserve), the step's state counts
    them, and unpack reads them back bit-exact. A placement that would read past the reserve is flagged."""
    t = torch.relu(torch.randn(300_001, generator=torch.Generator().manual_seed(room % 97 + reserve_sectors)))
    engine = native.NativeEngine(buddy.get_codec("zvc"))
    layout, slot, b = Layout(512, t.numel() * 4, 4), 5, 32
    whole = buddy.compress(t, codec="zvc", entry_bytes=512, target_ratio=512 / (slot * b), backend="native")
    want = whole.buffers()[2]
    total = want.numel() // b
    sizes = torch.zeros(4 + layout.bins, dtype=torch.int64)
    step = torch.tensor([10, 3], dtype=torch.int64)  # the step's tensors before it: 10 sectors sent, 3 reserved
    reserve = torch.full((reserve_sectors * b,), 0xAB, dtype=torch.uint8)
    into = torch.zeros(layout.slots_bytes(16) - layout.slots_bytes(slot), dtype=torch.uint8)
    _, meta, slots, ends = engine.pack_ahead(
        t.view(torch.uint8), layout, slot, sizes, into, room=room, step=step, reserve=reserve
    )  # fmt: skip
    cap = min(total, max(room - 10, 0))
    r = min(total - cap, max(reserve_sectors - 3, 0)) if reserve_sectors else 0
    assert sizes[:3].tolist() == [cap, r, 3 if r else 0] and sizes[4:].tolist() == list(whole.histogram)
    assert step.tolist() == [10 + total - r, 3 + (total - cap if reserve_sectors else 0)]
    held = into[: (total - r) * b]
    assert torch.equal(held[: cap * b], want[: cap * b]) and torch.equal(held[cap * b :], want[(cap + r) * b :])
    assert torch.equal(reserve[3 * b : (3 + r) * b], want[cap * b : (cap + r) * b])
    untouched = torch.cat((reserve[: 3 * b], reserve[(3 + r) * b :]))
    assert bool((untouched == 0xAB).all())
    place = sizes[:4] if reserve_sectors else None
    placed = {} if place is None else {"place": place, "reserve": reserve}
    out = engine.unpack(meta, slots, held.clone(), slot, layout, check=True, ends=ends, **placed)
    assert torch.equal(out, t.view(torch.uint8))
    # through an overflow ring: packed into a region of it, then drained into buddy memory -- the same bytes there,
    # the same in the reserve, nothing written past them
    staged, drained = torch.full_like(into, 0xCD), torch.full_like(into, 0xEF)
    sizes2, step2 = torch.zeros_like(sizes), torch.tensor([10, 3], dtype=torch.int64)
    reserve2 = torch.full_like(reserve, 0xAB)
    _, _, _, ends2 = engine.pack_ahead(
        t.view(torch.uint8), layout, slot, sizes2, staged, room=room, step=step2, reserve=reserve2
    )  # fmt: skip
    engine.drain(layout, staged, ends2, sizes2[:4], drained)
    assert torch.equal(sizes2, sizes) and torch.equal(step2, step) and torch.equal(reserve2, reserve)
    assert torch.equal(drained[: held.numel()], held) and bool((drained[held.numel() :] == 0xEF).all())
    if r:  # a placement past the end of the reserve: flagged, nothing read outside it
        bad = place.clone()
        bad[1] = reserve_sectors
        with pytest.raises(buddy.CorruptDataError, match="overflow"):
            engine.unpack(meta, slots, held.clone(), slot, layout, check=True, ends=ends, place=bad, reserve=reserve)
    whole.free()


def test_pack_writes_the_overflow_where_it_is_kept(store, monkeypatch):
    """The native engine's pack writes the overflow into the buffer it is given (buddy memory, the host's): the same
    bytes as into a buffer of its own; the reference takes no such buffer."""
    t = torch.relu(torch.randn(40_000, generator=torch.Generator().manual_seed(0)))
    m = buddy.measure(t, "auto2", entry_bytes=512, backend="native")
    assert m.engine.packs_into_host
    slot = 1  # most of every entry spills
    into = torch.full((m.overflow_bytes(slot),), 0xA5, dtype=torch.uint8)
    slots, overflow = m.engine.pack(m.flat, m.measurement, slot, m.layout, into=into)
    assert overflow is into and overflow.numel() > 0
    own_slots, own = m.engine.pack(m.flat, m.measurement, slot, m.layout)
    assert torch.equal(slots, own_slots) and torch.equal(overflow, own)
    copies = []
    monkeypatch.setattr(buddy.pipeline, "_offload", lambda *args: copies.append(args))
    bt = buddy.pack(m, slot, store=store)
    assert torch.equal(bt.buffers()[2], own) and not copies, "written in buddy memory: no copy to make"
    assert_bitexact(bt.decompress(), t)
    ref = buddy.measure(t, "auto2", entry_bytes=512, backend="reference")
    assert not ref.engine.packs_into_host
    with pytest.raises(ValueError, match="takes no `into`"):
        ref.engine.pack(ref.flat, ref.measurement, slot, ref.layout, into=into)


@pytest.mark.parametrize("codec", CODECS, ids=[f"codec={c}" for c in CODECS])
def test_tensors_of_one_entry(codec, activations, store):
    check_tensors_of_one_entry("native", codec, activations, store)


#: entry sizes of the random tensors (a build per codec and entry size: a few, the smallest and the default)
FUZZ_ENTRY_BYTES = (32, 128, 4096)


@pytest.mark.parametrize("codec", CODECS, ids=[f"codec={c}" for c in CODECS])
@fuzz_settings(0.3)
@given(data=st.data())
def test_random_tensors(codec, data):
    """The fuzz corpus's tensors (every dtype, awkward shapes and strides, special values): the reference's bytes."""
    t, _ = data.draw(tensors(), label="tensor")
    e = data.draw(st.sampled_from(FUZZ_ENTRY_BYTES), label="entry_bytes")
    store = buddy.BuddyStore()
    want = buddy.measure(t, codec, entry_bytes=e, backend="reference")
    slot = data.draw(st.integers(0, spec.sectors_per_entry(e)), label="slot")
    got = buddy.measure(t, codec, entry_bytes=e, backend="native")
    assert got.histogram == want.histogram
    a, b = buddy.pack(got, slot, store=store), buddy.pack(want, slot, store=store)
    try:
        _same_buffers(a, b)
        assert_bitexact(b.decompress(backend="native", check=True), t)
    finally:
        a.free()
        b.free()


@pytest.mark.parametrize("codec", CODECS, ids=[f"codec={c}" for c in CODECS])
def test_unpack_flags_damage_where_the_reference_raises(codec, activations, store):
    check_damage_flagged("native", codec, activations, store)


def _golden_groups():
    groups: dict[tuple, list[dict]] = {}
    for case in GOLDEN_CASES:
        if case["codec"] in CODECS:
            groups.setdefault((case["set"], case["entry_bytes"], case["codec"]), []).append(case)
    for (name, e, codec), cases in sorted(groups.items()):
        yield pytest.param(cases, id=f"{name}-E={e}-codec={codec}")


@pytest.mark.parametrize("cases", list(_golden_groups()))
def test_golden_vectors(cases, store):
    """The engine writes the golden bytes of every input (sets still written) and decodes all of them."""
    check_golden("native", cases, load_vectors(), GOLDEN_SETS, store)


# ---------------------------------------------------------------------------
# the engine table
# ---------------------------------------------------------------------------
@pytest.fixture
def fresh_choice(monkeypatch):
    """No self-test verdicts or warnings remembered, before and after the test; yields a MonkeyPatch for the
    compiler's environment, undone before the compiler is looked for again."""
    selftest.reset()
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.delenv(dispatch.ENV_BACKEND, raising=False)
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    with pytest.MonkeyPatch.context() as env:
        yield env
    native._compiler.cache_clear()
    selftest.reset()


def _chosen(codec: str) -> dispatch.Choice:
    (row,) = dispatch.chosen(codec, device="cpu")
    return row


def test_the_cpu_default_of_its_codecs_after_its_self_test(fresh_choice, store):
    t = torch.relu(torch.randn(3000, generator=torch.Generator().manual_seed(1)))
    for codec in CODECS:
        bt = buddy.compress(t, 2.0, codec, store=store)
        expected = "native" if codec in native.DEFAULT_CODECS else "reference"
        assert bt.backend == expected, codec
        assert _chosen(codec).backend == expected
        assert_bitexact(bt.decompress(), t)
        bt.free()
    assert _chosen("auto2").why.startswith("self-test passed")
    assert {i.codec for i in dispatch.implementations(device="cpu", backend="native")} == set(CODECS)
    assert buddy.codecs.DEFAULT_CODEC in native.DEFAULT_CODECS  # the default codec runs natively


def test_turned_off(fresh_choice, monkeypatch, store):
    t = torch.randn(1000)
    monkeypatch.setenv(dispatch.ENV_BACKEND, "reference")
    assert buddy.compress(t, 1.5, "auto2", store=store).backend == "reference"
    assert _chosen("auto2").why == "BUDDY_BACKEND=reference"
    monkeypatch.delenv(dispatch.ENV_BACKEND)
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native.why_unusable() == "BUDDY_NATIVE=0"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # turned off on purpose: nothing to warn about
        assert buddy.compress(t, 1.5, "auto2", store=store).backend == "reference"
    assert _chosen("auto2").why == "BUDDY_NATIVE=0"
    with pytest.raises(buddy.MissingDependencyError, match="native CPU engine of codec 'zvc' cannot run here"):
        buddy.compress(t, 1.5, "zvc", store=store, backend="native")


def test_without_a_compiler_the_reference_runs(fresh_choice, tmp_path, store):
    fresh_choice.setenv("CXX", str(tmp_path / "no-such-compiler"))
    native._compiler.cache_clear()
    assert native.why_unusable() == f"no C++ compiler found ({tmp_path / 'no-such-compiler'}; set CXX)"
    t = torch.randn(1000)
    with pytest.warns(RuntimeWarning, match=r"native CPU engine cannot run here \(no C\+\+ compiler found") as caught:
        bt = buddy.compress(t, 1.5, "auto2", store=store)
        buddy.compress(t, 1.5, "fpe", store=store).free()
    assert len(caught) == 1  # one line, whatever the codecs
    assert bt.backend == "reference" and _chosen("auto2").why.startswith("no C++ compiler found")


def test_a_failed_build_warns_once_and_the_reference_runs(fresh_choice, tmp_path, store):
    broken = tmp_path / "c++"
    broken.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo broken 1.0; exit 0; fi\necho 'no' >&2\nexit 1\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    fresh_choice.setenv("CXX", str(broken))
    fresh_choice.setenv(native.ENV_CACHE, str(tmp_path / "cache"))
    fresh_choice.setattr(native, "_libraries", {})
    native._compiler.cache_clear()
    t = torch.randn(1000)
    with pytest.warns(RuntimeWarning, match="native CPU engine of codec 'auto2' failed their self-test"):
        assert buddy.compress(t, 1.5, "auto2", store=store).backend == "reference"
    assert "the native engine's build failed" in _chosen("auto2").why
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        assert buddy.compress(t, 1.5, "auto2", store=store).backend == "reference"


def _child(conn) -> None:
    torch.set_num_threads(1)  # torch's own OpenMP threads do not survive a fork (its ops would hang)
    os.environ[native.ENV_THREADS] = "2"  # the engine's pool: a new one in the child
    t = torch.relu(torch.randn(5000, generator=torch.Generator().manual_seed(2)))
    bt = buddy.compress(t, 2.0, "auto2", backend="native")
    conn.send(bool(torch.equal(bt.decompress().view(torch.int32), t.view(torch.int32))))


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_a_forked_child_runs_it(store):
    t = torch.relu(torch.randn(50000))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(native.ENV_THREADS, "2")
        buddy.compress(t, 2.0, "auto2", backend="native", store=store).free()  # the parent's pool has started
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child, args=(child,))
    p.start()
    try:
        assert parent.poll(120) and parent.recv() is True
    finally:
        p.join(30)
    assert p.exitcode == 0


def test_threads_compress_at_once(store):
    g = torch.Generator().manual_seed(3)
    inputs = [torch.relu(torch.randn(20000 + 777 * i, generator=g)) for i in range(6)]

    def roundtrip(t):
        bt = buddy.compress(t, 2.0, "auto2", backend="native", store=store)
        try:
            return torch.equal(bt.decompress().view(torch.int32), t.view(torch.int32))
        finally:
            bt.free()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(roundtrip, inputs))


@pytest.mark.parametrize("codec", ("auto", "auto2"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.int64))
def test_auto_choice_with_early_stops(codec, dtype, store):
    """auto's and auto2's one-lane measure stop sizing bpc (and fpe) once it cannot win: on entries made so the
    members' sizes straddle each other, every entry's metadata (mode and k) and the slots are the reference's."""
    check_reference_buffers("native", codec, straddling_entries(dtype, 1024), 1024, lambda h: 12, store, codec in TABLED)


def test_fpe_runs_one_lane_a_warp(monkeypatch, store):
    """fpe's and auto2's kernels run from their builds of one lane a warp (no fibers), their fits too; the bytes are
    the reference's (the tests above; the fits' tables: test_one_lane_fits_are_the_warps)."""
    ran: list[tuple[str, str]] = []
    launch = native._Library.launch

    def spy(self, name, grid, shared, args, threads):
        ran.append(("solo" if "-solo-" in self.path.name else "warp", name))
        return launch(self, name, grid, shared, args, threads)

    monkeypatch.setattr(native._Library, "launch", spy)
    t = torch.relu(torch.randn(5000, generator=torch.Generator().manual_seed(3)))
    for codec in ("fpe", "auto2", "bpc"):
        bt = buddy.compress(t, 2.0, codec, backend="native", store=store)
        assert_bitexact(bt.decompress(), t)
        bt.free()
    assert ran == [
        ("solo", "buddy_fpe_count"), ("solo", "buddy_fpe_fit"), ("solo", "buddy_fpe_measure"),
        ("solo", "buddy_fpe_ends"), ("solo", "buddy_fpe_pack"), ("solo", "buddy_fpe_ends"),
        ("solo", "buddy_fpe_unpack"),
        ("solo", "buddy_auto2_count"), ("solo", "buddy_auto2_fit"), ("solo", "buddy_auto2_measure"),
        ("solo", "buddy_auto2_ends"), ("solo", "buddy_auto2_pack"), ("solo", "buddy_auto2_ends"),
        ("solo", "buddy_auto2_unpack"),
        ("solo", "buddy_bpc_measure"), ("solo", "buddy_bpc_ends"), ("solo", "buddy_bpc_pack"),
        ("solo", "buddy_bpc_ends"), ("solo", "buddy_bpc_unpack"),
    ]  # fmt: skip
    for codec in ("fpe", "auto2"):
        solo = native.library(codec, 4096, solo=True)
        for op in ("count", "fit", "measure", "ends", "pack", "unpack"):
            solo.kernel(f"buddy_{codec}_{op}")  # (raises for a kernel the build lacks)
    built = []
    build = native._build
    monkeypatch.setattr(native, "_build", lambda *a: built.append(a) or build(*a))
    monkeypatch.setattr(native, "_libraries", {})
    native.library("auto2", 4096, solo=True)
    assert built == [("auto2", 4096, True)]  # no build of 32 lanes made beside it
    with pytest.raises(ValueError, match="raw's kernels tile 32 lanes a warp"):
        native.library("raw", 4096, solo=True)


def _fit_counts(word: int, kind: int, gen: torch.Generator) -> torch.Tensor:
    """Symbol counts of one kind: dense, a few symbols, heavy tails, zeros only, coarse, powers of two."""
    from buddy.codecs.fpe import n_symbols

    s = n_symbols(word)
    c = torch.zeros(s, dtype=torch.int64)
    regular = s - 2
    if kind == 0:
        c[:regular] = torch.randint(0, 1000, (regular,), generator=gen)
    elif kind == 1:
        idx = torch.randint(0, regular, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen)
        c[idx] = torch.randint(1, 10**6, idx.shape, generator=gen)
    elif kind == 2:
        scale = 10 ** torch.randint(0, 9, (regular,), generator=gen).double()
        c[:regular] = (torch.randn(regular, generator=gen).abs() * scale).long()
    elif kind == 3:
        c[0] = 5
    elif kind == 4:
        coarse = torch.randint(0, 3, (regular,), generator=gen)
        c[:regular] = coarse * torch.randint(0, 2**19, (regular,), generator=gen)
    else:
        some = torch.rand(regular, generator=gen) < 0.3
        c[:regular] = (2 ** torch.randint(0, 30, (regular,), generator=gen)) * some
    c[s - 2] += 10**9 if kind == 3 else int(torch.randint(0, 1000, (1,), generator=gen))
    return c


@pytest.mark.parametrize("word", ids("word", [1, 2, 4]))
def test_one_lane_fits_are_the_warps(word):
    """The fit of one lane (sorts where a warp's lanes rank, the rounds in turn where each lane tries one) writes
    the device table and the serialized table of the fit of 32 lanes (the GPU's code, here as fibers), byte for
    byte, and the serialized table is the host's Table.from_counts -- of counts and of the weights a prior makes
    (fpe.fit_weights), with more regular symbols than get codes and fewer."""
    from buddy.codecs.fpe import Table, fit_weights

    solo, warp = native.library("auto2", 4096, solo=True), native.library("auto2", 4096, solo=False)

    def fit(lib, counts, weighted):
        work = torch.empty(fpe_device.FIT_WORK_BYTES, dtype=torch.uint8)
        table = torch.zeros(fpe_device.DEVICE_TABLE_BYTES, dtype=torch.uint8)
        serial = torch.zeros(fpe_device.FIT_SERIAL_BYTES, dtype=torch.uint8)
        lib.launch("buddy_auto2_fit", 1, 0, (counts, work, table, serial, np.int32(weighted), np.int32(word)), 1)
        return table, serial

    gen = torch.Generator().manual_seed(word)
    for trial in range(24):
        counts = _fit_counts(word, trial % 6, gen)
        host = Table.from_counts(counts, word).to_bytes()
        for weighted in (0, 1):
            given = fit_weights(counts, word) if weighted else counts
            got, want = fit(solo, given.clone(), weighted), fit(warp, given.clone(), weighted)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (trial, weighted)
            assert torch.equal(got[1][: host.numel()], host) and not got[1][host.numel() :].any(), (trial, weighted)


def test_a_table_is_laid_out_once_however_many_a_step_holds(monkeypatch, store):
    """Each fitted table keeps the kernels' layout of it (Table.laid_out): decompressing more tensors than the 64
    laid-out tables kept by key lays none out again (on an H200 a step of 172 tensors laid every table out again at
    its decompress, 0.7 ms each on the host)."""
    from buddy.codecs.fpe import Table

    laid = []
    lookups = Table.lookups
    monkeypatch.setattr(Table, "lookups", lambda self, *a: laid.append(self) or lookups(self, *a))
    gen = torch.Generator().manual_seed(7)
    tensors = [torch.randn(3000, generator=gen) ** (1 + i % 3) * 2.0 ** (i % 23 - 11) + i / 7 for i in range(80)]
    packed = [buddy.compress(t, 1.5, "auto2", backend="native", store=store) for t in tensors]
    assert len({bytes(bt.table.tolist()) for bt in packed}) > 64  # more tables than are kept by key
    for t, bt in zip(reversed(tensors), reversed(packed)):
        assert_bitexact(bt.decompress(), t)
    assert laid == [], f"{len(laid)} tables laid out again"
    for bt in packed:
        bt.free()


def test_builds_are_cached_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv(native.ENV_CACHE, str(tmp_path))
    monkeypatch.setattr(native, "_libraries", {})
    first = native.library("zvc", 256).path
    assert first.parent == tmp_path and first.exists()
    monkeypatch.setattr(native, "_libraries", {})
    mtime = os.stat(first).st_mtime_ns
    assert native.library("zvc", 256).path == first and os.stat(first).st_mtime_ns == mtime  # not built again


@pytest.mark.parametrize("codec", ("fpe", "auto2"))
def test_a_build_without_avx512_writes_the_same_bytes(codec, activations, monkeypatch, store):
    """The one-lane builds take AVX-512 paths where ``-march=native`` allows them (fpe's encode of 2- and 4-byte
    words: its tails compacted, its codes' table entries gathered, 16 words at a time; its decode of two entries at
    once); built without them, the plain loops run. Both write and read the reference's bytes (on a host without
    AVX-512 both builds are the plain loops)."""
    monkeypatch.setattr(native, "_FLAGS", (*native._FLAGS, "-mno-avx512f"))
    monkeypatch.setattr(native, "_libraries", {})
    g = torch.Generator().manual_seed(3)
    relu = activations["f32"]
    for t, e in (
        (relu[: 20000].clone(), 4096), (relu[: 3000].clone(), 128), (relu[: 700].clone(), 32),
        (torch.randn(30000, generator=g), 4096), (torch.randn(30000, generator=g).bfloat16(), 4096),
    ):  # fmt: skip
        check_reference_buffers("native", codec, t, e, CASES[0].slot_for, store, True)
    assert native._libraries  # (the builds of these flags ran it: the engine's table of builds was emptied first)


@pytest.mark.parametrize("word", ids("word", [2, 4]))
@pytest.mark.parametrize("at", ids("at", [0, 1, 6, 8, 16]))
@pytest.mark.parametrize("gap", ids("gap", [False, True]))
def test_hostile_fpe_streams_among_others_flag_like_the_reference(word, at, gap):
    """The hand-made streams of the split layout (test_device_codecs: escapes of coded symbols, codes a table lacks,
    wrong lengths, a bit set between the codes and the tails), each at entry ``at`` of 17 entries of a valid stream,
    cut at their k sectors: the native engine raises where the reference does, else decodes its words. The walk
    table is made (blocks of 8 and 9 entries), and on a host with AVX-512 the entries of the split layout are decoded
    two at a time, the walks of a pair's two entries in one loop: the damaged one first or second of its pair, or (8,
    the last of a block of 9) alone; with a ``gap``, the entry after the damaged one is a zero entry (k = 0), which
    does not decode in a pair: the damaged one then decodes alone or second of its pair."""
    from test_device_codecs import fpe_hostile_streams

    e, n = 128, 17
    raw = e // spec.SECTOR_BYTES
    dtype = {2: torch.bfloat16, 4: torch.float32}[word]
    groups: dict[int, list] = {}
    for case in fpe_hostile_streams(word, e):
        if case[0].startswith("split:"):
            groups.setdefault(id(case[1]), []).append(case)
    seen = 0
    for cases in groups.values():
        table = cases[0][1]
        filler = next(c for c in cases if c[4] is False)  # a valid stream of this table
        for name, _, bits, k, _ in cases:
            rows, ks = [], []
            for i in range(n):
                b, ki = (bits, k) if i == at else (filler[2], filler[3])
                if gap and i == at + 1:
                    b, ki = "", 0  # a zero entry: no payload
                row = torch.tensor(stream_bytes(b, e), dtype=torch.uint8)
                row[ki * spec.SECTOR_BYTES :] = 0  # (a slot's bytes past k sectors are zero, or the tensor is damaged)
                rows.append(row[: (raw - 1) * spec.SECTOR_BYTES])
                ks.append(ki)
            k_all = torch.tensor(ks, dtype=torch.int32)
            meta = bformat.encode_meta(k_all, torch.zeros_like(k_all), e)
            args = dict(codec=FPECodec(table), entry_bytes=e, slot_sectors=raw - 1, shape=(n * e // word,),
                        dtype=dtype, table=FPECodec(table).table)  # fmt: skip
            out = {}
            for backend in ("reference", "native"):
                try:
                    out[backend] = buddy.unpack(meta, torch.cat(rows), torch.zeros(0, dtype=torch.uint8),
                                                backend=backend, **args)  # fmt: skip
                except buddy.CorruptDataError:
                    out[backend] = None
            if out["reference"] is None:
                assert out["native"] is None, f"{name}: the reference raises, the native engine decodes"
            else:
                assert out["native"] is not None, f"{name}: the native engine raises, the reference decodes"
                assert_bitexact(out["native"], out["reference"])
            seen += 1
    assert seen >= 8


#: a dtype of each word size, for unpacking streams made by hand
_DTYPE_OF_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _rows_decoded(codec: str, payload: torch.Tensor, k, word: int, e: int, backend: str) -> list:
    """Each row of ``payload`` (k[i] sectors of a ``codec`` entry, mode 0) unpacked alone by ``backend``: its
    words, or ``None`` where it raises CorruptDataError. Rows of k = E/32 sectors (raw entries) are left out
    (``...``)."""
    raw = e // spec.SECTOR_BYTES
    out: list = []
    for row, ki in zip(payload, [int(x) for x in k]):
        if ki >= raw:
            out.append(...)
            continue
        row = row.clone()
        row[ki * spec.SECTOR_BYTES :] = 0  # (a slot's bytes past k sectors are zero, or the tensor is damaged)
        meta = bformat.encode_meta(torch.tensor([ki], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), e)
        try:
            out.append(buddy.unpack(meta, row[: (raw - 1) * spec.SECTOR_BYTES], torch.zeros(0, dtype=torch.uint8),
                                    codec=codec, entry_bytes=e, slot_sectors=raw - 1, shape=(e // word,),
                                    dtype=_DTYPE_OF_WORD[word], backend=backend))  # fmt: skip
        except buddy.CorruptDataError:
            out.append(None)
    return out


def _decode_like_the_reference(codec: str, payload: torch.Tensor, k, word: int, e: int) -> tuple[int, int]:
    """The native engine's words or raise for each row, against the reference's; (rows raised, rows decoded)."""
    raised = decoded = 0
    native, reference = (_rows_decoded(codec, payload, k, word, e, b) for b in ("native", "reference"))
    for i, (got, want) in enumerate(zip(native, reference)):
        if want is None:
            assert got is None, f"E={e} row {i}: the reference raises, the native engine decodes"
            raised += 1
        elif want is not ...:
            assert got is not None, f"E={e} row {i}: the native engine raises, the reference decodes"
            assert_bitexact(got, want)
            decoded += 1
    return raised, decoded


@pytest.mark.parametrize("word", ids("word", [1, 2, 4, 8]))
def test_fpx_streams_of_every_kind_decode_like_the_reference(word):
    """fpx's hand-made entries (every code width in both zmodes, escapes, streams at a sector's edge, ties) through
    the native engine's one-lane build: the reference's bytes; and damaged streams of each kind the reference
    rejects, decoded one entry at a time: the words the reference decodes, or a raise where it raises."""
    from test_device_codecs import fpx_boundary_entries, fpx_crafted_entries, fpx_damaged_cases, fpx_tie_entries

    raised = decoded = 0
    for e in (128, 4096):
        g = torch.Generator().manual_seed(11 * e + word)
        entries = torch.cat([f(word, e, g) for f in (fpx_crafted_entries, fpx_boundary_entries, fpx_tie_entries)])
        t = entries.reshape(-1).view({1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[word])
        store = buddy.BuddyStore()
        got = buddy.compress(t, 1.0, "fpx", entry_bytes=e, backend="native", store=store)
        want = buddy.compress(t, 1.0, "fpx", entry_bytes=e, backend="reference", store=store)
        _same_buffers(got, want)
        assert_bitexact(got.decompress(backend="native"), t)
        payload, k = fpx_damaged_cases(word, e, g)
        r, d = _decode_like_the_reference("fpx", payload, k, word, e)
        raised, decoded = raised + r, decoded + d
        got.free()
        want.free()
    assert raised >= 8 and decoded >= 8, (raised, decoded)


@pytest.mark.parametrize("word", ids("word", [1, 2, 4]))
def test_fpe_tables_of_every_shape(word, activations, store):
    """fpe with tables of every shape (test_device_codecs: with and without ZERO, 12-bit codes, the most symbols
    coded, an incomplete code, ESC alone, table format 1) through the native engine's one-lane build: the
    reference's histogram, metadata and buffers, and its words back."""
    from test_device_codecs import fpe_tables

    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}[word]
    t = activations["f32"][:40_000].to(dtype) if word > 1 else activations["f32"][:40_000].view(torch.uint8)
    for name, table in fpe_tables(word, t.view(torch.uint8)).items():
        for e in (128, 4096):
            got = buddy.compress(t, 1.5, FPECodec(table), entry_bytes=e, backend="native", store=store)
            want = buddy.compress(t, 1.5, FPECodec(table), entry_bytes=e, backend="reference", store=store)
            assert got.backend == "native", name
            _same_buffers(got, want)
            assert_bitexact(got.decompress(), t)
            got.free()
            want.free()


@pytest.mark.parametrize("word", ids("word", [1, 2, 4, 8]))
def test_bpc_hostile_streams_decode_like_the_reference(word):
    """bpc's entries built plane by plane (every plane code) through the native engine's one-lane build: the
    reference's bytes; and its hand-made streams (test_device_codecs: runs, raw planes, positions and pairs at the
    planes' edges, DBP-zero codes where they may and may not stand, wrong lengths, a bit set after the stream),
    decoded one entry at a time by the one-lane decoder (its own walk and checks): the reference's words, or a
    raise where it raises."""
    from test_device_codecs import bpc_hostile_streams, bpc_plane_entries

    raised = decoded = 0
    for e in (128, 512):
        t = bpc_plane_entries(word, e, 24, torch.Generator().manual_seed(e + word)).reshape(-1)
        store = buddy.BuddyStore()
        got = buddy.compress(t, 1.0, "bpc", entry_bytes=e, backend="native", store=store)
        want = buddy.compress(t, 1.0, "bpc", entry_bytes=e, backend="reference", store=store)
        _same_buffers(got, want)
        assert_bitexact(got.decompress(backend="native"), t)
        got.free()
        want.free()
        cases = bpc_hostile_streams(e, word)
        payload = torch.stack([torch.tensor(stream_bytes(bits, e), dtype=torch.uint8) for _, bits, _, _ in cases])
        r, d = _decode_like_the_reference("bpc", payload, [k for _, _, k, _ in cases], word, e)
        raised, decoded = raised + r, decoded + d
    assert raised >= 16 and decoded >= 12, (raised, decoded)


@pytest.mark.skipif(
    sys.platform != "linux" or "OpenMP" not in torch.__config__.parallel_info(), reason="torch built with OpenMP"
)
def test_launches_run_on_torchs_openmp_runtime(store):
    """Built with OpenMP, the engine's launches run on the process's one OpenMP runtime -- torch's -- and not on
    threads of their own beside torch's spinning ones."""
    assert native._openmp_flags() == ("-fopenmp",)
    t = torch.relu(torch.randn(50000, generator=torch.Generator().manual_seed(4)))
    bt = buddy.compress(t, 2.0, "auto2", backend="native", store=store)
    assert_bitexact(bt.decompress(), t)
    with open("/proc/self/maps") as maps:  # the runtime the library was linked to, by its soname
        runtimes = {line.split()[-1] for line in maps if line.rstrip().endswith("/libgomp.so.1")}
    bundled = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    assert runtimes == ({str(bundled)} if bundled.exists() else runtimes) and len(runtimes) == 1, runtimes


def test_a_compiler_without_openmp_builds_without_it(monkeypatch, tmp_path, store):
    real = native._compiler()
    if isinstance(real, str):
        pytest.skip(real)
    wrapper = tmp_path / "c++"
    wrapper.write_text(
        f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && {{ echo "no OpenMP" >&2; exit 1; }}; done\n'
        f'exec "{real[0]}" "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv(native.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_libraries", {})
    native._compiler.cache_clear()
    try:
        assert native._openmp_flags() == ()
        t = torch.relu(torch.randn(50000, generator=torch.Generator().manual_seed(5)))
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(native.ENV_THREADS, "2")  # the engine's own pool
            bt = buddy.compress(t, 2.0, "auto2", backend="native", store=store)
            assert_bitexact(bt.decompress(), t)
    finally:
        monkeypatch.undo()
        native._compiler.cache_clear()


@pytest.mark.parametrize("codec", ("fpe", "auto2"))
@pytest.mark.parametrize("kept_from", ("fpe", "auto2"))
def test_a_prior_keeps_a_table_as_the_reference_does(codec, kept_from, store):
    """With learned statistics and an earlier step's codec to keep (of this codec or, after a change of codec,
    of the other), the native engine keeps or fits the table exactly as the reference's fit does."""
    t = torch.relu(torch.randn(60_000, generator=torch.Generator().manual_seed(6)))
    other = torch.relu(torch.randn(60_000, generator=torch.Generator().manual_seed(7)) * 37)
    stats = [buddy.measure(x, "fpe", backend="reference").statistics.double() for x in (t, other)]
    before, drift = (s / s.sum() for s in stats)
    kept = buddy.measure(t, kept_from, backend="reference", prior=before).codec
    prior = 0.995 * before + 0.005 * drift  # drifted a little: a table fitted to it differs, the old one still fits
    got = buddy.measure(t, codec, backend="native", prior=prior, keep=kept)
    want = buddy.measure(t, codec, backend="reference", prior=prior, keep=kept)
    # fpe keeps an fpe codec's table, auto2 an auto2 codec's fpe member's or an fpe codec's (Codec.fit)
    assert torch.equal(want.table, kept.table) == (codec == "auto2" or kept_from == "fpe")
    assert torch.equal(got.table, want.table) and got.histogram == want.histogram
    assert torch.equal(got.measurement.meta, want.measurement.meta)
    assert torch.equal(got.statistics, want.statistics)


def test_kernel_seconds_count_the_launches(store):
    """native.kernel_seconds: each operation's launches add their wall time (what experiments.step_cost reports)."""
    t = torch.relu(torch.randn(50_000, generator=torch.Generator().manual_seed(8)))
    buddy.compress(t, 2.0, "auto2", backend="native", store=store).free()  # built
    before = native.kernel_seconds()
    bt = buddy.compress(t, 2.0, "auto2", backend="native", store=store)
    bt.decompress()
    after = native.kernel_seconds()
    grew = {op for op in after if after[op] > before.get(op, 0.0)}
    assert {"count", "fit", "measure", "ends", "pack", "unpack"} <= grew, (before, after)
    bt.free()
