"""Fault injection: a fault may fail an operation, never lose, leak or corrupt a tensor.

Each fault is injected where it would really strike -- the host store full
(or the OS refusing it a block), the device out of memory, a codec raising in encode or decode, a
KeyboardInterrupt in the size pass, the store or the pack pass, an exception
in user code -- and each test checks three things:

* no leak: the store's buddy bytes, device accounting and tensor count, the
  tracker's held bytes, and every block's free list are back to where they
  were, and no BuddyTensor is left alive;
* nothing half-written that could pass for valid: the failed call returns no
  BuddyTensor, and a BuddyTensor that exists still decompresses bit-exact;
* inside training under ``compressed_activations``: the original tensor is
  kept, so losses, gradients and parameters are the very bits of a run
  without buddy; a fault that cannot be absorbed (decode failing during
  backward, an interrupt) raises, with no wrong data, and leaves nothing held
  once the graph is gone.
"""

from __future__ import annotations

import collections
import gc

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bitexact, held, make_data
from small_training import (  # noqa: F401 - module_setup is a module-wide fixture
    MIN_BYTES,
    Run,
    assert_clean,
    assert_same_training,
    live_buddy_tensors,
    make_batch,
    make_mlp,
    module_setup,
    plain_run,
    train,
)

import buddy
import buddy.autograd
import buddy.engines.reference
import buddy.store
from buddy.codecs import Analysis, Codec

#: the session under the suite's pinned zvc at E = 128 and under the library's own defaults
pytestmark = pytest.mark.both_defaults

KiB = 1 << 10
FAULTY = "faulty-test"


class _FaultyAnalysis(Analysis):
    """zvc's analysis of a block, whose streams go through the ``encode`` fault point."""

    def __init__(self, codec: FaultyCodec, inner: Analysis):
        self.codec, self.inner = codec, inner
        self.sectors, self.modes = inner.sectors, inner.modes

    def streams(self, rows=None):
        self.codec._call("encode")
        return self.inner.streams(rows)


class FaultyCodec(Codec):
    """``zvc`` with a fault injected into chosen calls of the size pass, the stream writing or ``decode``.

    ``"sizes"`` faults strike in :meth:`analyse` (measure, before buddy
    memory is allocated); ``"encode"`` faults where streams are written
    (pack, after it was allocated: block by block through :meth:`encode`, or
    from a one-block tensor's analysis).
    """

    name = FAULTY

    def __init__(self):
        self.inner = buddy.get_codec("zvc")
        self.calls = collections.Counter()
        self.faults = {}  # method -> (calls that fail (1-based; None: all), exception factory)

    def fail(self, method: str, exc, at=None) -> None:
        self.faults[method] = (None if at is None else set(at), exc)

    def heal(self) -> None:
        self.faults.clear()

    def _call(self, method: str) -> None:
        self.calls[method] += 1
        fault = self.faults.get(method)
        if fault is not None and (fault[0] is None or self.calls[method] in fault[0]):
            raise fault[1]()

    def analyse(self, entries, word_bytes):
        self._call("sizes")
        return _FaultyAnalysis(self, self.inner.analyse(entries, word_bytes))

    def encode(self, entries, word_bytes, modes):
        self._call("encode")
        return self.inner.encode(entries, word_bytes, modes)

    def decode(self, payload, sectors, modes, word_bytes):
        self._call("decode")
        return self.inner.decode(payload, sectors, modes, word_bytes)


def oom():
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")


def interrupt():
    return KeyboardInterrupt()


class _DeviceAllocations:
    """Stands in for ``torch`` inside the engines (the reference, and the kernels' glue the native CPU engine runs):
    chosen device allocations run out of memory.

    A device allocation is a ``torch.empty`` with ``device=`` (metadata when
    measuring and slots when packing, the output when decompressing).
    """

    def __init__(self):
        self.count = 0
        self.fail_at = set()  # 1-based; empty: never

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *args, **kwargs):
        if "device" in kwargs:
            self.count += 1
            if self.count in self.fail_at:
                raise oom()
        return torch.empty(*args, **kwargs)


@pytest.fixture
def faulty(temporary_codec) -> FaultyCodec:
    return temporary_codec(FaultyCodec())


@pytest.fixture
def device_memory(monkeypatch) -> _DeviceAllocations:
    fake = _DeviceAllocations()
    monkeypatch.setattr(buddy.engines.reference, "torch", fake)
    monkeypatch.setattr(buddy.engines.kernel_engine, "torch", fake)  # the kernels' engine and its launches' glue
    monkeypatch.setattr(buddy.engines.kernels, "torch", fake)
    return fake


@pytest.fixture
def many_chunks(monkeypatch):
    """Blocks of 4 KiB: a 64 KiB tensor is measured in 16 blocks, then packed in 16 blocks."""
    monkeypatch.setattr(buddy.format, "BLOCK_BYTES", 4 * KiB)


def _overflowing(gen, numel=16 * KiB):
    """64 KiB of float32 whose 4x slot overflows: ReLU'd, so zvc codes most entries in 3 of 4 sectors.

    Coded entries, not raw ones: the codec is called to write and to read
    them (the format layer copies raw entries itself), so its faults strike.
    """
    return make_data("relu", numel, torch.float32, gen)


def _assert_still_works(store, gen) -> None:
    """The store takes, returns and frees a new tensor normally after the fault."""
    t = _overflowing(gen, 3000)
    with buddy.compress(t, target_ratio=4.0, store=store) as bt:
        assert bt.buddy_bytes > 0
        assert_bitexact(bt.decompress(), t)
    assert_clean(store)


def _session(store, tracker, policy=None, **kwargs):
    policy = policy if policy is not None else buddy.FixedRatio(4.0)  # every compressed tensor overflows
    return lambda step: buddy.compressed_activations(
        policy, tracker=tracker, store=store, min_bytes=MIN_BYTES, **kwargs
    )


# ---------------------------------------------------------------------------
# a. the host store is full
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("half_held", [False, True], ids=["empty-store", "store-half-held"])
def test_store_full_raise_writes_nothing(half_held, gen):
    kept, t = _overflowing(gen, 2000), _overflowing(gen)
    measured = [buddy.measure(x) for x in (kept, t)]
    kept_bytes, t_bytes = (m.overflow_bytes(buddy.spec.slot_for_ratio(4.0, m.entry_bytes)) for m in measured)
    assert 0 < kept_bytes < t_bytes
    # room for the first tensor's overflow, not for the second's
    store = buddy.BuddyStore(capacity_bytes=kept_bytes + t_bytes // 8, block_bytes=1024, pin=False)
    keep = buddy.compress(kept, target_ratio=4.0, store=store) if half_held else None
    before = held(store)
    copy = t.clone()
    with pytest.raises(buddy.HostStoreFull, match="on_full"):
        buddy.compress(t, target_ratio=4.0, store=store, on_full="raise")
    after = store.stats()
    assert held(store) == before
    assert after.buddy_reserved_bytes <= store.capacity_bytes
    assert len(live_buddy_tensors(store)) == (1 if half_held else 0)
    assert_bitexact(t, copy)  # the source is untouched
    if keep is not None:
        assert_bitexact(keep.decompress(), kept)
        keep.free()
    assert_clean(store)


def test_store_full_in_wrap_records_nothing(gen, tracker):
    store = buddy.BuddyStore(capacity_bytes=0, pin=False)
    with pytest.raises(buddy.HostStoreFull):
        buddy.wrap(_overflowing(gen), "cache/x", policy=buddy.FixedRatio(4.0), tracker=tracker, store=store)
    assert tracker.history("cache/x") is None  # the tracker learns no outcome that did not happen
    assert_clean(store, tracker)


def test_store_full_device_keeps_the_tensor_whole(gen):
    store = buddy.BuddyStore(capacity_bytes=0, pin=False)
    t = make_data("relu", 16 * KiB, torch.float32, gen)
    bt = buddy.compress(t, target_ratio=4.0, store=store, on_full="device")
    assert bt.buddy_bytes == 0 and store.bytes_held == 0 and store.reserved_bytes == 0
    assert bt.slot_sectors == buddy.slots.tightest_slot(bt.histogram)  # the smallest slot with no overflow
    assert_bitexact(bt.decompress(), t)
    bt.free()
    assert_clean(store)


@pytest.mark.parametrize("capacity", [0, 32 * KiB], ids=["capacity=0", "capacity=32KiB"])
def test_store_full_in_training_keeps_tensors_on_the_device(capacity, tracker):
    store = buddy.BuddyStore(capacity_bytes=capacity, block_bytes=16 * KiB, pin=False)
    plain = plain_run(3)
    full = train(make_mlp(), 3, _session(store, tracker))
    assert_same_training(plain, full)
    rows = [r for s in full.sessions for r in s.stats().rows if r.codec != "kept"]
    assert rows and all(s.stats().failed == 0 for s in full.sessions)
    if capacity == 0:
        assert all(r.buddy_bytes == 0 for r in rows)  # everything stayed whole on the device
    else:
        assert any(r.buddy_bytes > 0 for r in rows) and any(r.buddy_bytes == 0 for r in rows)
    assert store.peak_bytes <= capacity and store.reserved_bytes <= capacity
    assert_clean(store, tracker)


class _RefusedBlock:
    """The OS refuses a new block (pinning page-locked memory fails past the system's limit)."""

    def __init__(self, nbytes, pin):
        raise RuntimeError("CUDA error: out of memory (pinning host memory; injected by the test)")


@pytest.mark.parametrize("on_full", ["raise", "device"])
def test_a_block_the_os_refuses_is_a_full_store(on_full, store, gen, monkeypatch):
    monkeypatch.setattr(buddy.store, "_Block", _RefusedBlock)
    t = _overflowing(gen)
    if on_full == "raise":
        with pytest.raises(buddy.HostStoreFull, match="could not get a block"):
            buddy.compress(t, target_ratio=4.0, store=store, on_full="raise")
    else:
        with buddy.compress(t, target_ratio=4.0, store=store, on_full="device") as bt:
            assert bt.buddy_bytes == 0
            assert_bitexact(bt.decompress(), t)
    assert_clean(store)
    assert store.reserved_bytes == 0


def test_a_block_the_os_refuses_in_training(store, tracker, monkeypatch):
    monkeypatch.setattr(buddy.store, "_Block", _RefusedBlock)
    run = train(make_mlp(), 3, _session(store, tracker))
    assert_same_training(plain_run(3), run)
    assert all(s.stats().failed == 0 and s.stats().buddy_bytes == 0 for s in run.sessions)  # whole on the device
    assert_clean(store, tracker)


# ---------------------------------------------------------------------------
# b. the device runs out of memory
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "where",
    ["slots", "metadata", "size-pass", "pack-pass"],
    ids=lambda w: f"oom={w}",
)
def test_oom_while_compressing_holds_nothing(where, store, gen, faulty, device_memory, many_chunks):
    t = _overflowing(gen)
    if where == "metadata":
        device_memory.fail_at = {1}  # measure allocates the metadata
    elif where == "slots":
        device_memory.fail_at = {2}  # pack allocates the slots
    elif where == "size-pass":
        faulty.fail("sizes", oom, at=[3])
    else:
        faulty.fail("encode", oom, at=[5])  # chunk 5 of the pack pass: its overflow is allocated by then
    with pytest.raises(torch.OutOfMemoryError):
        buddy.compress(t, target_ratio=4.0, codec=FAULTY, store=store)
    if where not in ("size-pass", "metadata"):  # measure runs before the buddy memory is allocated
        assert store.peak_bytes > 0, "the fault was meant to strike after the buddy memory was allocated"
    assert_clean(store)
    device_memory.fail_at = set()
    faulty.heal()
    _assert_still_works(store, gen)


@pytest.mark.parametrize("where", ["output", "decode"], ids=lambda w: f"oom={w}")
def test_oom_while_decompressing_leaves_the_tensor_intact(where, store, gen, faulty, device_memory):
    t = _overflowing(gen)
    bt = buddy.compress(t, target_ratio=4.0, codec=FAULTY, store=store)
    held = store.stats()
    if where == "output":
        device_memory.fail_at = {device_memory.count + 1}
    else:
        faulty.fail("decode", oom)
    with pytest.raises(torch.OutOfMemoryError):
        bt.decompress()
    assert not bt.freed and store.stats() == held  # nothing freed, nothing taken
    faulty.heal()
    assert_bitexact(bt.decompress(), t)  # the memory came back: the data is all there
    bt.free()
    assert_clean(store)


def test_oom_while_compressing_in_training_keeps_the_originals(store, tracker, device_memory):
    plain = plain_run(3)
    device_memory.fail_at = set(range(1, 10_000, 2))  # every compress allocates metadata, then slots: metadata fails
    with pytest.warns(RuntimeWarning, match="OutOfMemoryError"):
        run = train(make_mlp(), 3, _session(store, tracker))
    assert_same_training(plain, run)
    assert all(s.stats().failed > 0 for s in run.sessions)
    assert_clean(store, tracker)


def _step(model, opt, x, y, session):
    opt.zero_grad(set_to_none=True)
    with session:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach().clone()


def _run(model, losses) -> Run:
    grads = [p.grad.detach().clone() for p in model.parameters()]
    return Run(losses, grads, [p.detach().clone() for p in model.parameters()], [])


@pytest.mark.parametrize(
    "exc, raised",
    [(oom, torch.OutOfMemoryError), (lambda: RuntimeError("decode exploded"), Exception)],
    ids=["oom", "codec-error"],
)
def test_decode_failure_in_backward_raises_and_the_step_can_be_rerun(exc, raised, store, tracker, faulty):
    """Backward raises the decoder's exception (an out-of-memory error stays one), with a note naming the key.

    No data is returned.
    The compressed copies are freed with the graph; running the step again
    gives the run without buddy, bit for bit.
    """
    plain = plain_run(3)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = make_batch()
    session = buddy.compressed_activations(
        buddy.FixedRatio(4.0), tracker=tracker, store=store, min_bytes=MIN_BYTES, codec=FAULTY
    )
    losses = [_step(model, opt, x, y, session)]
    faulty.fail("decode", exc, at=[faulty.calls["decode"] + 2])  # the second decompression of step 2
    opt.zero_grad(set_to_none=True)
    with session:
        loss = F.cross_entropy(model(x), y)
    assert buddy.ledger.default_ledger().tensors_held > 0
    with pytest.raises(raised, match="out of memory|decode exploded") as info:
        loss.backward()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "buddy: decompressing the saved activation" in notes and "run the step again" in notes
    assert any(row.key in notes for row in session.stats().rows)
    del loss, info
    assert_clean(store, tracker)  # the graph is gone: so is everything it held
    faulty.heal()
    losses += [_step(model, opt, x, y, session) for _ in range(2)]  # the step, run again, and one more
    assert_same_training(plain, _run(model, losses))
    assert_clean(store, tracker)


# ---------------------------------------------------------------------------
# c. a codec raises in encode or decode
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["size-pass", "pack-pass"])
def test_encode_error_holds_nothing(where, store, gen, faulty, many_chunks):
    if where == "size-pass":
        faulty.fail("sizes", lambda: ValueError("encode exploded"), at=[2])
    else:
        faulty.fail("encode", lambda: ValueError("encode exploded"), at=[3])
    with pytest.raises(ValueError, match="encode exploded"):
        buddy.compress(_overflowing(gen), target_ratio=4.0, codec=FAULTY, store=store)
    assert_clean(store)
    faulty.heal()
    _assert_still_works(store, gen)


def test_encode_error_in_training_keeps_that_tensor(store, tracker, faulty):
    plain = plain_run(3)
    faulty.fail("encode", lambda: ValueError("encode exploded"), at=[2, 7])  # one tensor in steps 1 and 2
    with pytest.warns(RuntimeWarning, match="encode exploded") as record:
        run = train(make_mlp(), 3, _session(store, tracker, codec=FAULTY))
    assert sum("encode exploded" in str(w.message) for w in record) == 1  # once per cause
    assert_same_training(plain, run)
    failed = [s.stats().failed for s in run.sessions]
    assert failed[0] == 1 and sum(failed) == 2
    assert all(s.stats().rows for s in run.sessions)  # the others were compressed
    assert_clean(store, tracker)


def test_decode_error_leaves_the_tensor_intact(store, gen, faulty):
    t = _overflowing(gen)
    bt = buddy.compress(t, target_ratio=4.0, codec=FAULTY, store=store)
    faulty.fail("decode", lambda: RuntimeError("decode exploded"))
    with pytest.raises(Exception, match="decode exploded"):
        bt.decompress()
    faulty.heal()
    assert_bitexact(bt.decompress(), t)
    del bt  # garbage, not freed: the finalizer returns everything
    assert_clean(store)


def test_decoder_output_of_the_wrong_size_is_an_error(store, gen, faulty, monkeypatch):
    """A decoder that returns too few bytes raises; it never yields a tensor."""
    t = _overflowing(gen, 1000)
    bt = buddy.compress(t, target_ratio=4.0, codec=FAULTY, store=store)
    monkeypatch.setattr(faulty, "decode", lambda payload, sectors, modes, word: payload[:, :-1])
    with pytest.raises(RuntimeError):
        bt.decompress()
    bt.free()
    assert_clean(store)


# ---------------------------------------------------------------------------
# d. KeyboardInterrupt while compressing
# ---------------------------------------------------------------------------
class _InterruptedAllocation(buddy.store.BuddyAllocation):
    """The interrupt lands right after the store took a range, before the allocation is handed out."""

    __slots__ = ()

    def __init__(self, store, block, offset, nbytes):
        if block is not None:
            raise KeyboardInterrupt
        super().__init__(store, block, offset, nbytes)


@pytest.mark.parametrize("where", ["size-pass", "store-grow", "store-after-take", "pack-pass", "single-chunk"])
def test_keyboard_interrupt_propagates_and_holds_nothing(where, store, gen, faulty, monkeypatch, many_chunks):
    t = _overflowing(gen) if where != "single-chunk" else _overflowing(gen, 500)
    copy = t.clone()
    if where == "store-after-take":
        warm = buddy.compress(t, target_ratio=4.0, store=store)  # a block to take a range from
        warm.free()
    if where == "size-pass":
        faulty.fail("sizes", interrupt, at=[4])
    elif where == "store-grow":

        def grow(size):
            raise KeyboardInterrupt

        monkeypatch.setattr(store, "_grow", grow)
    elif where == "store-after-take":
        monkeypatch.setattr(buddy.store, "BuddyAllocation", _InterruptedAllocation)
    elif where == "pack-pass":
        faulty.fail("encode", interrupt, at=[8])
    else:  # one block: pack writes the streams from the size pass's analysis
        faulty.fail("encode", interrupt, at=[1])
    with pytest.raises(KeyboardInterrupt):
        buddy.compress(t, target_ratio=4.0, codec=FAULTY, store=store)
    if where == "pack-pass":
        assert store.peak_bytes > 0, "the interrupt was meant to land after the buddy memory was allocated"
    assert_clean(store)
    assert_bitexact(t, copy)
    monkeypatch.undo()
    _assert_still_works(store, gen)


def test_keyboard_interrupt_while_building_the_buddy_tensor(store, gen, monkeypatch, ledger):
    """The last step of compress: the interrupt lands as the BuddyTensor holds its device bytes."""

    def hold(nbytes):
        raise KeyboardInterrupt

    monkeypatch.setattr(ledger, "hold", hold)
    with pytest.raises(KeyboardInterrupt):
        buddy.compress(_overflowing(gen), target_ratio=4.0, store=store)
    assert store.peak_bytes > 0
    assert_clean(store)
    monkeypatch.undo()
    _assert_still_works(store, gen)


@pytest.mark.parametrize("where", ["size-pass", "store", "pack-pass"])
def test_keyboard_interrupt_in_training_closes_the_session(where, store, tracker, faulty, monkeypatch, many_chunks):
    """The interrupt leaves the block, which closes the session; the partial step is freed with its graph.

    The same session object then runs the next steps, bit-identical to a
    run without buddy (the interrupted step never reached backward).
    """
    plain = plain_run(2)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = make_batch()
    session = buddy.compressed_activations(
        buddy.FixedRatio(4.0), tracker=tracker, store=store, min_bytes=MIN_BYTES, codec=FAULTY
    )
    if where == "size-pass":
        faulty.fail("sizes", interrupt, at=[20])  # the second compressed tensor (16 chunks each)
    elif where == "store":
        real, calls = store.allocate, []

        def allocate(nbytes):
            calls.append(nbytes)
            if len(calls) == 2:  # the second compressed tensor
                raise KeyboardInterrupt
            return real(nbytes)

        store.allocate = allocate  # this store only, undone below
    else:
        faulty.fail("encode", interrupt, at=[20])  # the pack pass of the second tensor
    with pytest.raises(KeyboardInterrupt) as info:
        with session:
            model(x)
    assert session._hooks is None, "the session is closed"
    assert session.stats().rows, "the first tensor was compressed before the interrupt"
    saves = session.stats().saves
    torch.relu(torch.randn(64, 1024, requires_grad=True))  # saved outside the session now: not packed
    assert session.stats().saves == saves
    del info  # the traceback held the partial graph
    assert_clean(store, tracker)
    faulty.heal()
    store.__dict__.pop("allocate", None)
    assert_same_training(plain, _run(model, [_step(model, opt, x, y, session) for _ in range(2)]))
    assert_clean(store, tracker)


# ---------------------------------------------------------------------------
# e. an exception in user code inside the block
# ---------------------------------------------------------------------------
def _forward_then_fail(model, x, y, session):
    with session:
        loss = F.cross_entropy(model(x), y)  # the activations are compressed here
        assert loss.grad_fn is not None
        raise ValueError("user code failed")


def test_user_exception_in_the_block_frees_everything(store, tracker):
    model = make_mlp()
    x, y = make_batch()
    session = buddy.compressed_activations(buddy.FixedRatio(4.0), tracker=tracker, store=store, min_bytes=MIN_BYTES)
    with pytest.raises(ValueError, match="user code failed") as info:
        _forward_then_fail(model, x, y, session)
    assert buddy.ledger.default_ledger().tensors_held > 0, "the traceback still holds the partial graph"
    assert session._hooks is None
    del info
    assert_clean(store, tracker)


@pytest.mark.parametrize("retain_graph", [None, True], ids=["no-backward", "retain-graph"])
def test_a_graph_dropped_without_backward_frees_everything(retain_graph, store, tracker):
    """Dropping the graph frees its compressed tensors at once, with no garbage collection.

    Outputs saved as they are (the logits, tensors under ``min_bytes``) once
    referred to their own ``grad_fn`` -- a cycle through C++ the collector
    cannot break -- so a graph that never ran backward was never freed.
    """
    model = make_mlp()
    x, y = make_batch()
    gc.disable()  # prove that reference counting alone frees the graph
    try:
        # zvc at 128 B keeps the dense exp() output as it is: the kind of save that made the cycle
        session = buddy.compressed_activations(
            tracker=tracker, store=store, min_bytes=MIN_BYTES, codec="zvc", entry_bytes=128
        )
        with session:
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y) + logits.exp().mean()
        assert any(r.codec == "kept" for r in session.stats().rows), "an output is kept as it is"
        assert buddy.ledger.default_ledger().tensors_held > 0
        if retain_graph:
            loss.backward(retain_graph=True)
        del logits, loss
        assert held(store) == (0, 0, 0) and tracker.held_device_bytes == 0
    finally:
        gc.enable()
    assert_clean(store, tracker)
