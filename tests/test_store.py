"""The buddy store: accounting, reuse, coalescing, capacity, lifecycle of BuddyTensors."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import HAS_CUDA, MiB, assert_roundtrip, held, make_data

import buddy

KiB = 1 << 10


def _overflowing(gen, numel=8000, kind="random_bytes"):
    """float32 data whose overflow at 4x is large (3 of 4 sectors of every entry)."""
    return make_data(kind, numel, torch.float32, gen)


def _assert_empty(store: buddy.BuddyStore) -> None:
    st = store.stats()
    assert store.bytes_held == 0 and st.buddy_bytes_held == 0
    assert held(store) == (0, 0, 0)


# ---------------------------------------------------------------------------
# accounting
# ---------------------------------------------------------------------------
def test_accounting_returns_to_zero_after_free(store, gen):
    tensors = [_overflowing(gen, n) for n in (100, 5000, 8000, 1)]
    bts = [buddy.compress(t, target_ratio=4.0, store=store) for t in tensors]
    st, dev = store.stats(), buddy.ledger.default_ledger().stats()
    assert dev.tensors_held == 4
    assert st.buddy_bytes_held == store.bytes_held == sum(b.buddy_bytes for b in bts) > 0
    assert dev.device_bytes_held == sum(b.device_bytes for b in bts) > 0
    assert store.free_bytes == store.capacity_bytes - store.bytes_held
    for i, bt in enumerate(bts):
        bt.free()
        assert bt.freed
        assert buddy.ledger.default_ledger().tensors_held == 3 - i
        assert store.bytes_held == sum(b.buddy_bytes for b in bts[i + 1 :])
    _assert_empty(store)
    assert store.free_bytes == store.capacity_bytes


def test_peak_tracks_the_maximum(store, gen):
    a = buddy.compress(_overflowing(gen, 8000), target_ratio=4.0, store=store)
    b = buddy.compress(_overflowing(gen, 4000), target_ratio=4.0, store=store)
    both = a.buddy_bytes + b.buddy_bytes
    dev_both = a.device_bytes + b.device_bytes
    assert store.peak_bytes == both
    a.free()
    c = buddy.compress(_overflowing(gen, 1000), target_ratio=4.0, store=store)
    assert store.bytes_held == b.buddy_bytes + c.buddy_bytes < both
    assert store.peak_bytes == both, "the peak does not fall when memory is freed"
    st = store.stats()
    assert st.buddy_peak_bytes == both and buddy.ledger.default_ledger().peak_bytes == dev_both
    b.free()
    c.free()
    assert store.peak_bytes == both
    store.reset_peak()
    buddy.ledger.default_ledger().reset_peak()
    assert store.peak_bytes == 0 and buddy.ledger.default_ledger().peak_bytes == 0


def test_stats_snapshot_and_str(store, gen):
    bt = buddy.compress(_overflowing(gen), target_ratio=4.0, store=store)
    st = store.stats()
    assert st.buddy_capacity_bytes == store.capacity_bytes
    assert st.buddy_reserved_bytes == store.reserved_bytes >= st.buddy_bytes_held
    assert st.buddy_blocks >= 1 and st.pinned is False
    text = str(st)
    assert "buddy memory" in text and "pageable" in text
    dev = buddy.ledger.default_ledger().stats()
    assert "1 tensor" in str(dev)
    bt.free()
    assert dev.tensors_held == 1, "a snapshot does not change afterwards"
    assert "tensors=0" in repr(buddy.ledger.default_ledger())


# ---------------------------------------------------------------------------
# reuse and coalescing
# ---------------------------------------------------------------------------
def test_compress_free_cycles_reuse_blocks(gen):
    store = buddy.BuddyStore(capacity_bytes=64 * MiB, block_bytes=256 * KiB, pin=False)
    data = [_overflowing(gen, n) for n in (8000, 3000, 12000, 500)]
    bt = buddy.compress(data[2], target_ratio=4.0, store=store)  # the largest overflow
    bt.free()
    reserved = store.reserved_bytes
    assert reserved > 0
    for i in range(60):
        live = [buddy.compress(data[(i + j) % 4], target_ratio=4.0, store=store) for j in range(2)]
        for x in live:
            x.free()
        assert store.reserved_bytes == reserved, f"blocks grew on cycle {i}"
    assert store.stats().buddy_blocks == 1
    _assert_empty(store)


def test_allocations_coalesce():
    store = buddy.BuddyStore(capacity_bytes=MiB, block_bytes=4 * KiB, pin=False)
    a, b, c = (store.allocate(KiB) for _ in range(3))
    assert store.reserved_bytes == 4 * KiB, "three small allocations share one block"
    assert store.bytes_held == 3 * KiB
    offsets = sorted(x.offset for x in (a, b, c))
    assert offsets == [0, KiB, 2 * KiB]
    store.release(b)
    store.release(a)
    # a + b coalesced: a 2 KiB allocation fits where they were, without a new block
    ab = store.allocate(2 * KiB)
    assert ab.offset == 0 and store.reserved_bytes == 4 * KiB
    store.release(ab)
    store.release(c)
    assert store.bytes_held == 0
    # the whole block is one free range again: a block-sized allocation reuses it
    whole = store.allocate(4 * KiB)
    assert whole.offset == 0 and store.reserved_bytes == 4 * KiB
    store.release(whole)
    assert store.trim() == 4 * KiB
    assert store.reserved_bytes == 0


def test_coalesce_in_other_orders():
    store = buddy.BuddyStore(capacity_bytes=MiB, block_bytes=4 * KiB, pin=False)
    for order in ((0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2), (2, 0, 3, 1)):
        allocs = [store.allocate(KiB) for _ in range(4)]
        assert store.reserved_bytes == 4 * KiB
        for i in order:
            store.release(allocs[i])
        whole = store.allocate(4 * KiB)
        assert store.reserved_bytes == 4 * KiB, f"fragments left after releasing in order {order}"
        store.release(whole)


def test_allocation_data_views_are_disjoint():
    store = buddy.BuddyStore(capacity_bytes=MiB, block_bytes=4 * KiB, pin=False)
    allocs = [store.allocate(n) for n in (100, 32, 1000, 5000)]
    for i, x in enumerate(allocs):
        assert x.data.dtype == torch.uint8 and x.data.numel() == x.nbytes
        x.data.fill_(i + 1)
    for i, x in enumerate(allocs):
        assert bool((x.data == i + 1).all()), "allocations overlap"
    # sizes are rounded to sectors in the accounting
    assert store.bytes_held == 128 + 32 + 1024 + 5024
    for x in allocs:
        store.release(x)
    assert store.bytes_held == 0


def test_allocate_zero_and_negative():
    store = buddy.BuddyStore(capacity_bytes=0, pin=False)
    z = store.allocate(0)
    assert z.nbytes == 0 and z.data.numel() == 0
    assert store.bytes_held == 0 and store.reserved_bytes == 0
    store.release(z)
    with pytest.raises(ValueError):
        store.allocate(-1)


def test_release_twice_is_harmless_for_accounting():
    store = buddy.BuddyStore(capacity_bytes=MiB, block_bytes=4 * KiB, pin=False)
    a = store.allocate(KiB)
    store.release(a)
    store.release(a)
    assert store.bytes_held == 0


# ---------------------------------------------------------------------------
# capacity
# ---------------------------------------------------------------------------
def test_host_store_full_raises_and_leaks_nothing(gen):
    store = buddy.BuddyStore(capacity_bytes=4 * KiB, block_bytes=4 * KiB, pin=False)
    t = _overflowing(gen, 8000)  # ~24 KB of overflow at 4x
    before = t.clone()
    with pytest.raises(buddy.HostStoreFull) as info:
        buddy.compress(t, target_ratio=4.0, store=store, on_full="raise")
    assert "on_full" in str(info.value) and "capacity_bytes" in str(info.value)
    assert isinstance(info.value, MemoryError) and isinstance(info.value, buddy.BuddyError)
    _assert_empty(store)
    assert store.reserved_bytes <= store.capacity_bytes
    assert torch.equal(t.view(torch.uint8), before.view(torch.uint8))
    # a tensor that fits still compresses, and a held one counts against the capacity
    fits = _overflowing(gen, 300)
    small = buddy.compress(fits, target_ratio=4.0, store=store)
    assert 0 < small.buddy_bytes <= 4 * KiB
    with pytest.raises(buddy.HostStoreFull):
        buddy.compress(_overflowing(gen, 1500), target_ratio=4.0, store=store)
    assert buddy.ledger.default_ledger().tensors_held == 1 and store.bytes_held == small.buddy_bytes
    assert_roundtrip(small, fits)
    small.free()
    _assert_empty(store)


def test_capacity_is_never_exceeded(gen):
    store = buddy.BuddyStore(capacity_bytes=100 * KiB, block_bytes=64 * KiB, pin=False)
    held = []
    for i in range(40):
        try:
            held.append(buddy.compress(_overflowing(gen, 700 + 97 * i), target_ratio=4.0, store=store))
        except buddy.HostStoreFull:
            pass
        assert store.reserved_bytes <= store.capacity_bytes
        assert store.bytes_held <= store.capacity_bytes
        if i % 3 == 2 and held:
            held.pop(0).free()
    assert store.bytes_held == sum(b.buddy_bytes for b in held)


def test_zero_capacity_store_takes_tensors_without_overflow(gen):
    store = buddy.BuddyStore(capacity_bytes=0, pin=False)
    t = make_data("relu", 4000, torch.float32, gen)
    bt = buddy.compress(t, target_ratio=1.0, store=store)
    assert bt.buddy_bytes == 0
    assert_roundtrip(bt, t)
    with pytest.raises(buddy.HostStoreFull):
        buddy.compress(t, target_ratio=4.0, store=store)


def test_trim_releases_unused_blocks(gen):
    store = buddy.BuddyStore(capacity_bytes=64 * MiB, block_bytes=16 * KiB, pin=False)
    bts = [buddy.compress(_overflowing(gen, 4000), target_ratio=4.0, store=store) for _ in range(6)]
    reserved = store.reserved_bytes
    assert reserved >= sum(b.buddy_bytes for b in bts)
    assert store.trim() == 0, "no block is unused while every tensor is alive"
    keep, kept = bts[0], bts[0].decompress()
    for b in bts[1:]:
        b.free()
    released = store.trim()
    assert released > 0
    assert store.reserved_bytes == reserved - released
    assert store.reserved_bytes >= keep.buddy_bytes
    assert_roundtrip(keep, kept)  # trimming kept the live block
    keep.free()
    store.trim()
    assert store.reserved_bytes == 0 and store.stats().buddy_blocks == 0


def test_trim_really_releases_memory_of_freed_tensors_still_referenced(gen):
    """A freed BuddyTensor that is still referenced must not pin its block past trim()."""
    import weakref

    store = buddy.BuddyStore(capacity_bytes=64 * MiB, block_bytes=MiB, pin=False)
    bt = buddy.compress(_overflowing(gen), target_ratio=4.0, store=store)
    block_buffer = weakref.ref(store._blocks[0].buffer)
    bt.free()
    assert store.trim() == MiB
    gc.collect()
    assert bt.freed  # the object is alive, its memory is not
    assert block_buffer() is None, "the trimmed block is still referenced (by the freed tensor's overflow view)"


# ---------------------------------------------------------------------------
# lifecycle of a BuddyTensor
# ---------------------------------------------------------------------------
def test_free_twice_raises(store, gen):
    bt = buddy.compress(_overflowing(gen), target_ratio=4.0, store=store)
    bt.free()
    with pytest.raises(buddy.FreedTensorError):
        bt.free()
    _assert_empty(store)


def test_use_after_free_raises(store, gen):
    bt = buddy.compress(_overflowing(gen), target_ratio=4.0, store=store)
    bt.free()
    assert bt.freed
    with pytest.raises(buddy.FreedTensorError):
        bt.decompress()
    with pytest.raises(buddy.FreedTensorError):
        bt.buffers()
    assert isinstance(buddy.FreedTensorError("x"), RuntimeError)


def test_garbage_collected_tensor_releases_its_memory(store, gen):
    bt = buddy.compress(_overflowing(gen), target_ratio=4.0, store=store)
    assert store.bytes_held > 0
    del bt
    gc.collect()
    _assert_empty(store)


def test_garbage_collection_in_a_reference_cycle(store, gen):
    bt = buddy.compress(_overflowing(gen), target_ratio=4.0, store=store)
    bt.cycle = bt  # only the cycle collector can free it
    del bt
    gc.collect()
    _assert_empty(store)


def test_context_manager_frees(store, gen):
    t = _overflowing(gen)
    with buddy.compress(t, target_ratio=4.0, store=store) as bt:
        assert store.bytes_held == bt.buddy_bytes > 0
        assert_roundtrip(bt, t)
    assert bt.freed
    _assert_empty(store)
    # freeing inside the block is fine too
    with buddy.compress(t, target_ratio=4.0, store=store) as bt:
        bt.free()
    _assert_empty(store)


def test_context_manager_frees_on_exception(store, gen):
    with pytest.raises(KeyError):
        with buddy.compress(_overflowing(gen), target_ratio=4.0, store=store):
            raise KeyError("boom")
    _assert_empty(store)


def test_failed_compress_leaves_store_unchanged(store, gen):
    """An invalid slot choice fails before anything is allocated or accounted."""
    with pytest.raises(ValueError):
        buddy.pack(buddy.measure(_overflowing(gen)), 99, store=store)
    with pytest.raises(ValueError):
        buddy.compress(_overflowing(gen), store=store, max_overflow=2.0)
    _assert_empty(store)
    assert store.reserved_bytes == 0


# ---------------------------------------------------------------------------
# construction and the default store
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"capacity_bytes": -1}, id="capacity=-1"),
        pytest.param({"capacity_bytes": 1.5}, id="capacity=1.5"),
        pytest.param({"capacity_bytes": "1"}, id="capacity=str"),
        pytest.param({"capacity_bytes": True}, id="capacity=True"),
        pytest.param({"block_bytes": 0}, id="block=0"),
        pytest.param({"block_bytes": -4096}, id="block=-4096"),
        pytest.param({"block_bytes": 4096.0}, id="block=float"),
    ],
)
def test_invalid_constructor_args(kwargs):
    with pytest.raises(ValueError):
        buddy.BuddyStore(**kwargs)


@pytest.mark.skipif(HAS_CUDA, reason="pinning is allowed with CUDA")
def test_pin_without_cuda_is_a_value_error():
    with pytest.raises(ValueError):
        buddy.BuddyStore(capacity_bytes=MiB, pin=True)


def test_constructor_defaults():
    store = buddy.BuddyStore()
    assert store.capacity_bytes > 0
    assert store.pin == torch.cuda.is_available()
    assert store.bytes_held == store.reserved_bytes == store.peak_bytes == 0
    odd = buddy.BuddyStore(capacity_bytes=MiB, block_bytes=1000, pin=False)
    assert odd.block_bytes % 32 == 0 and odd.block_bytes >= 1000


def test_default_store(fresh_default_store, gen):
    s1 = buddy.default_store()
    assert isinstance(s1, buddy.BuddyStore)
    assert buddy.default_store() is s1
    bt = buddy.compress(_overflowing(gen), target_ratio=4.0)
    assert bt.store is s1 and s1.bytes_held == bt.buddy_bytes
    bt.free()

    mine = buddy.BuddyStore(capacity_bytes=8 * MiB, block_bytes=MiB, pin=False)
    buddy.set_default_store(mine)
    assert buddy.default_store() is mine
    bt = buddy.compress(_overflowing(gen), target_ratio=4.0)
    assert bt.store is mine and mine.bytes_held == bt.buddy_bytes > 0
    assert s1.bytes_held == 0
    bt.free()

    buddy.set_default_store(None)
    fresh = buddy.default_store()
    assert fresh is not mine and fresh is not s1
    with pytest.raises(TypeError):
        buddy.set_default_store("not a store")
    assert buddy.default_store() is fresh


# ---------------------------------------------------------------------------
# pinning (CUDA's calls recorded: the bookkeeping runs without a GPU)
# ---------------------------------------------------------------------------
def _recorded_pins(monkeypatch) -> list[tuple[str, int]]:
    from buddy import store as store_module

    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(store_module, "_cuda_call", lambda name, address, *rest: calls.append((name, address)))
    return calls


def _addresses(calls, name):
    return sorted(a for n, a in calls if n == name)


def test_a_dropped_store_unpins_every_block(monkeypatch):
    calls = _recorded_pins(monkeypatch)
    store = buddy.BuddyStore(capacity_bytes=MiB, block_bytes=64 * KiB, pin=True)
    kept = [store.allocate(1000), store.allocate(100 * KiB)]  # two blocks
    pinned = _addresses(calls, "cudaHostRegister")
    assert len(pinned) == 2 and _addresses(calls, "cudaHostUnregister") == []
    del kept, store
    gc.collect()
    assert _addresses(calls, "cudaHostUnregister") == pinned


def test_a_trimmed_block_is_unpinned_once(monkeypatch):
    calls = _recorded_pins(monkeypatch)
    store = buddy.BuddyStore(capacity_bytes=MiB, block_bytes=64 * KiB, pin=True)
    store.release(store.allocate(1000))
    assert store.trim() == 64 * KiB
    pinned = _addresses(calls, "cudaHostRegister")
    assert _addresses(calls, "cudaHostUnregister") == pinned
    del store
    gc.collect()
    assert _addresses(calls, "cudaHostUnregister") == pinned  # not again when the store goes


def test_a_refused_pin_says_which_error_and_clears_it(monkeypatch):
    from buddy import store as store_module

    class Runtime:
        def cudaHostRegister(self, *args):
            return 712

        def cudaGetErrorString(self, err):
            return "part or all of the requested memory range is already mapped"

    cleared = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", Runtime)
    monkeypatch.setattr(store_module, "_take_last_error", lambda: cleared.append(True))
    store = buddy.BuddyStore(capacity_bytes=MiB, block_bytes=64 * KiB, pin=True)
    with pytest.raises(buddy.HostStoreFull, match="CUDA error 712 .part or all of the requested memory range"):
        store.allocate(1000)
    assert cleared == [True, True] and store.stats().buddy_blocks == 0  # mapped refused, then plain pinning too


def test_a_block_is_pinned_unmapped_where_mapping_is_refused(monkeypatch):
    from buddy import store as store_module

    asked = []

    def register(name, address, *rest):
        asked.append((name, *rest))
        if name == "cudaHostRegister" and rest[-1] & 2:  # cudaHostRegisterMapped
            raise RuntimeError("cudaHostRegister failed: CUDA error 1 (invalid argument)")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(store_module, "_cuda_call", register)
    store = buddy.BuddyStore(capacity_bytes=MiB, block_bytes=64 * KiB, pin=True)
    alloc = store.allocate(1000)
    assert alloc.block.pinned and not alloc.block.mapped and store.stats().buddy_pinned_bytes == 64 * KiB
    registered = [a for a in asked if a[0] == "cudaHostRegister"]
    assert registered == [("cudaHostRegister", 64 * KiB, 3), ("cudaHostRegister", 64 * KiB, 1)]
    # such a block's pages are pinned (torch says so), not mapped: an unpack copies its overflow, never reads it
    # where it is (a kernel's loads there would be an illegal address)
    from buddy.engines import cuda as bcuda
    from buddy.engines import pinned
    from buddy.engines.tuning import Tuning

    zero_copy = Tuning(zero_copy=True)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    monkeypatch.setattr(bcuda, "_takes_host_pointers", lambda index: True)
    assert pinned.is_unmapped(alloc.data.untyped_storage().data_ptr())
    assert not bcuda.reads_overflow_in_place(alloc.data, torch.device("cuda", 0), zero_copy)
    mapped = buddy.BuddyStore(capacity_bytes=MiB, block_bytes=64 * KiB, pin=True)
    with monkeypatch.context() as m:
        m.setattr(store_module, "_cuda_call", lambda *a: None)  # a runtime that maps it
        other = mapped.allocate(1000)
    assert other.block.mapped and bcuda.reads_overflow_in_place(other.data, torch.device("cuda", 0), zero_copy)
    address = alloc.block.buffer.data_ptr()
    del alloc, store
    gc.collect()  # unpinned while CUDA's calls are still the recorded ones
    assert [a[0] for a in asked].count("cudaHostUnregister") == 1
    assert not pinned.is_unmapped(address)  # unpinned: the address may be a mapped block's next
    del other, mapped
    gc.collect()

