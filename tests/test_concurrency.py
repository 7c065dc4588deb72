"""Concurrency: threads sharing one BuddyStore, sessions per thread, CUDA streams.

What is defined (see ``BuddyStore`` and :mod:`buddy.autograd`):

* a BuddyStore is shared freely: allocation, release, trim and stats from any
  number of threads give disjoint ranges, bit-exact round trips and, once
  every call has returned, exact accounting; a release (a BuddyTensor freed or
  collected, possibly by the garbage collector in the middle of another
  store call) never waits for the store's lock;
* a compressed_activations session packs only in the thread that opened it;
  threads run their own sessions side by side (sharing a store and a tracker
  if they like, with distinct key prefixes); one session object is open in
  one thread at a time: opening it again elsewhere raises, and only the
  opening thread may close it;
* on CUDA, a tensor compressed on one stream decompresses on another once
  that stream waits for the first.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import threading
import time

import pytest
import torch
from conftest import MiB, assert_bitexact, make_data
from small_training import (  # noqa: F401 - module_setup is a module-wide fixture
    MIN_BYTES,
    assert_clean,
    assert_same_training,
    make_batch,
    make_mlp,
    module_setup,
    plain_run,
    train,
)

import buddy

KiB = 1 << 10
THREADS = 4


def run_threads(target, n: int = THREADS, timeout: float = 120.0) -> None:
    """Run ``target(i)`` in ``n`` threads started together; re-raise the first failure; a hang fails."""
    barrier = threading.Barrier(n)
    errors = []

    def body(i):
        try:
            barrier.wait()
            target(i)
        except BaseException as exc:  # surfaced in the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"threads still running after {timeout} s: a deadlock?"
    if errors:
        raise errors[0]


def _thread_data(i: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    specs = [("random_bytes", 3000), ("relu", 2000), ("zeros", 300), ("special", 1500), ("random_bytes", 17)]
    return [make_data(kind, n, torch.float32, g) for kind, n in specs]


def _check_store(store: buddy.BuddyStore) -> None:
    st = store.stats()
    assert 0 <= st.buddy_bytes_held <= st.buddy_reserved_bytes <= store.capacity_bytes
    dev = buddy.ledger.default_ledger().stats()
    assert dev.tensors_held >= 0 and dev.device_bytes_held >= 0


# ---------------------------------------------------------------------------
# one store, many threads
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [64 * MiB, 48 * KiB], ids=["roomy", "full-at-times"])
def test_threads_compress_decompress_free_through_one_store(capacity):
    """Four threads, 80 tensors each, three alive at a time; small blocks so they also grow and trim."""
    store = buddy.BuddyStore(capacity_bytes=capacity, block_bytes=16 * KiB, pin=False)
    ratios = (4.0, 2.0, None, 4 / 3, float("inf"))

    def work(i):
        data = _thread_data(i)
        alive = collections.deque()
        for k in range(80):
            t = data[k % len(data)]
            alive.append((buddy.compress(t, ratios[(k + i) % len(ratios)], store=store, on_full="device"), t))
            if len(alive) > 3:
                bt, original = alive.popleft()
                assert_bitexact(bt.decompress(), original)
                bt.free()
            if k % 20 == 0:
                _check_store(store)
                store.trim()
        for bt, original in alive:
            assert_bitexact(bt.decompress(), original)
            bt.free()

    run_threads(work)
    assert store.peak_bytes <= capacity
    assert_clean(store)


def test_threads_allocate_and_release_disjoint_ranges():
    """Raw allocations filled with a per-thread pattern: a range given twice would overwrite another's."""
    store = buddy.BuddyStore(capacity_bytes=64 * MiB, block_bytes=8 * KiB, pin=False)

    def work(i):
        g = torch.Generator().manual_seed(i)
        alive = collections.deque()
        for k in range(400):
            nbytes = int(torch.randint(1, 3000, (1,), generator=g))
            alloc = store.allocate(nbytes)
            mark = (16 * i + k % 16) % 256
            alloc.data.fill_(mark)
            alive.append((alloc, mark))
            if len(alive) > 6:
                alloc, mark = alive.popleft()
                assert bool((alloc.data == mark).all()), "another allocation wrote into this range"
                store.release(alloc)
        for alloc, mark in alive:
            assert bool((alloc.data == mark).all())
            store.release(alloc)

    run_threads(work)
    assert_clean(store)
    assert store.trim() > 0 and store.reserved_bytes == 0


def test_a_release_never_waits_for_the_lock(store, gen, monkeypatch):
    """A tensor freed while another thread is inside ``allocate`` returns at once; the holder applies it."""
    victim = buddy.compress(make_data("random_bytes", 4000, torch.float32, gen), 4.0, store=store)
    inside, go = threading.Event(), threading.Event()
    real_take = store._take

    def take(size):  # the allocating thread holds the lock here
        inside.set()
        assert go.wait(30)
        return real_take(size)

    monkeypatch.setattr(store, "_take", take)
    allocated = []
    holder = threading.Thread(target=lambda: allocated.append(store.allocate(1000)), daemon=True)
    holder.start()
    assert inside.wait(30)
    freer = threading.Thread(target=victim.free, daemon=True)
    freer.start()
    freer.join(10)
    waited = freer.is_alive()
    go.set()
    holder.join(30)
    freer.join(30)
    assert not waited, "freeing a BuddyTensor waited for the store's lock"
    assert allocated and store.bytes_held == 1024  # the victim's range was returned before allocate let go
    dev = buddy.ledger.default_ledger().stats()
    assert dev.tensors_held == 0 and dev.device_bytes_held == 0
    store.release(allocated[0])
    assert_clean(store)


def test_a_finalizer_inside_allocate_is_applied_after_it(store, gen, monkeypatch):
    """The collector frees a BuddyTensor in the middle of ``allocate`` (same thread, lock held).

    The release is queued, not applied to the free lists being walked, and
    applied before ``allocate`` returns.
    """
    garbage = buddy.compress(make_data("random_bytes", 4000, torch.float32, gen), 4.0, store=store)
    garbage.me = garbage  # only the collector can free it
    del garbage
    real_take = store._take
    seen = {}

    def take(size):
        lists = [(list(b.free_starts), list(b.free_sizes)) for b in store._blocks]
        seen["collected"] = gc.collect()
        seen["unchanged"] = lists == [(list(b.free_starts), list(b.free_sizes)) for b in store._blocks]
        return real_take(size)

    monkeypatch.setattr(store, "_take", take)
    alloc = store.allocate(100)
    assert seen["collected"] > 0, "the garbage tensor was collected inside allocate"
    assert seen["unchanged"], "a finalizer changed a free list in the middle of allocate"
    assert store.bytes_held == 128 and buddy.ledger.default_ledger().tensors_held == 0
    store.release(alloc)
    assert_clean(store)


def test_garbage_collection_storm_across_threads():
    """Cyclic garbage collected at any allocation, in any thread, while others use the store."""
    store = buddy.BuddyStore(capacity_bytes=64 * MiB, block_bytes=16 * KiB, pin=False)
    threshold = gc.get_threshold()
    gc.set_threshold(50, 100, 1000)  # young collections (and finalizers) all the time
    try:

        def work(i):
            data = _thread_data(i)
            for k in range(80):
                t = data[k % len(data)]
                bt = buddy.compress(t, 4.0, store=store)
                if k % 2:
                    bt.me = bt  # left to the collector, which runs wherever it likes
                else:
                    assert_bitexact(bt.decompress(), t)
                    bt.free()
                del bt

        run_threads(work)
    finally:
        gc.set_threshold(*threshold)
    assert_clean(store)


# ---------------------------------------------------------------------------
# compressed_activations in threads
# ---------------------------------------------------------------------------
def test_threads_train_side_by_side_with_their_own_sessions():
    """Two threads train under their own sessions (one store, one tracker), a third trains without one.

    Every thread gets the run without buddy bit for bit; each session saw
    exactly the saves of its own thread.
    """
    store = buddy.BuddyStore(capacity_bytes=64 * MiB, block_bytes=64 * KiB, pin=False)
    tracker = buddy.Tracker()
    plain = plain_run(3)
    alone = train(
        make_mlp(), 1, lambda s: buddy.compressed_activations(tracker=buddy.Tracker(), store=store, min_bytes=MIN_BYTES)
    )
    saves_per_step = alone.sessions[0].stats().saves
    results = {}

    def work(i):
        session_fn = None
        if i < 2:
            session_fn = lambda step: buddy.compressed_activations(  # noqa: E731
                buddy.FixedRatio(4.0) if i else None,
                tracker=tracker,
                store=store,
                min_bytes=MIN_BYTES,
                key_prefix=f"t{i}/",
            )
        results[i] = train(make_mlp(), 3, session_fn, batch=make_batch())

    run_threads(work, 3)
    for i in range(3):
        assert_same_training(plain, results[i])
    for i in range(2):
        for session in results[i].sessions:
            st = session.stats()
            assert st.saves == saves_per_step, "a session packed another thread's tensors"
            assert st.rows and all(r.key.startswith(f"t{i}/") for r in st.rows)
    assert not results[2].sessions
    results.clear()  # the sessions, and nothing else, are still referenced
    assert_clean(store, tracker)


def test_a_session_belongs_to_the_thread_that_opened_it(store):
    session = buddy.compressed_activations(tracker=buddy.Tracker(), store=store, min_bytes=MIN_BYTES)
    opened, attempt_done = threading.Event(), threading.Event()
    seen = {}

    def other():
        assert opened.wait(30)
        try:
            with pytest.raises(RuntimeError, match="already open"):
                session.__enter__()
            with pytest.raises(RuntimeError, match="thread that opened it"):
                session.__exit__(None, None, None)
        except BaseException as exc:
            seen["error"] = exc
        attempt_done.set()

    t = threading.Thread(target=other, daemon=True)
    t.start()
    x = torch.randn(64, 1024, requires_grad=True)
    with session:
        opened.set()
        assert attempt_done.wait(30)
        y = torch.relu(x)  # still packed by the session: the other thread changed nothing
    t.join(30)
    assert "error" not in seen, seen.get("error")
    assert session.stats().saves == 1 and session._hooks is None
    y.sum().backward()
    assert torch.equal(x.grad, (x > 0).to(x.dtype))

    def reuse():  # closed, it may be opened by another thread for its own step
        with session:
            torch.relu(torch.randn(64, 1024, requires_grad=True))
        seen["saves"] = session.stats().saves

    t = threading.Thread(target=reuse, daemon=True)
    t.start()
    t.join(30)
    assert seen["saves"] == 1
    assert_clean(store)


def test_threads_racing_to_open_one_session_admit_one(store):
    session = buddy.compressed_activations(tracker=buddy.Tracker(), store=store, min_bytes=MIN_BYTES)
    outcome = []

    def race(i):
        try:
            session.__enter__()
        except RuntimeError:
            outcome.append("refused")
            return
        outcome.append("opened")
        deadline = time.monotonic() + 10
        while len(outcome) < THREADS and time.monotonic() < deadline:  # the others try while it is open
            time.sleep(0.001)
        session.__exit__(None, None, None)

    for _ in range(10):
        outcome.clear()
        run_threads(race)
        assert sorted(outcome) == ["opened"] + ["refused"] * (THREADS - 1)
        assert session._hooks is None


# ---------------------------------------------------------------------------
# CUDA streams
# ---------------------------------------------------------------------------
@pytest.mark.gpu
def test_compress_on_one_stream_decompress_on_another(cuda):
    store = buddy.BuddyStore(capacity_bytes=256 * MiB, block_bytes=4 * MiB, pin=True)
    g = torch.Generator().manual_seed(7)
    t = make_data("relu", 3 << 20, torch.float32, g).to(cuda)
    expected = t.cpu()
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    producer.wait_stream(torch.cuda.current_stream())  # t was written on the default stream
    with torch.cuda.stream(producer):
        bt = buddy.compress(t, target_ratio=4.0, store=store)  # slots written, overflow copied, on producer
        packed = producer.record_event()
    t.record_stream(producer)  # t was read on producer: its memory must outlive that work
    assert bt.buddy_bytes > 0
    del t
    consumer.wait_event(packed)  # the slots are written before the consumer reads them
    with torch.cuda.stream(consumer):
        out = bt.decompress()  # waits for the overflow's copy to the host by itself
        done = consumer.record_event()
    torch.cuda.current_stream().wait_event(done)  # out was written on consumer
    out.record_stream(torch.cuda.current_stream())
    assert_bitexact(out.cpu(), expected)
    torch.cuda.synchronize()  # nothing in flight before the slots and the overflow go back
    bt.free()
    assert_clean(store)


@pytest.mark.gpu
def test_threads_with_their_own_streams_share_a_pinned_store(cuda):
    store = buddy.BuddyStore(capacity_bytes=256 * MiB, block_bytes=1 * MiB, pin=True)

    def work(i):
        stream = torch.cuda.Stream()
        data = [d.to(cuda) for d in _thread_data(i)]
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            for k in range(60):
                t = data[k % len(data)]
                bt = buddy.compress(t, (4.0, 2.0, None)[k % 3], store=store)
                assert_bitexact(bt.decompress(), t)  # ordered on this thread's stream
                stream.synchronize()
                bt.free()

    run_threads(work, 2)
    torch.cuda.synchronize()
    assert_clean(store)


def _warm(store: buddy.BuddyStore, like: torch.Tensor, target_ratio: float) -> None:
    """The test's work once first, on the same tensor: grow the store, load buddy's kernels and every torch kernel
    the compress and the forward's work (``like * 2``) launch. Nothing below may block for a first-time set-up:
    under CUDA's lazy loading (the default) a kernel's first launch may wait for the whole context, so the compute
    stream would wait for the held-up copy stream. (On the H200 the test failed, alone too, after a warm-up that
    compressed other data of half the size and ran no multiply; the same compress, after such a warm-up and with
    no multiply, did not wait.)"""
    warm = buddy.compress(like, target_ratio=target_ratio, store=store)
    _ = like * 2
    torch.cuda.synchronize(like.device)
    warm.free()


@pytest.mark.gpu
def test_forward_never_waits_for_its_offload(cuda):
    """The copy stream is held up on purpose: the compute stream runs ahead of it."""
    store = buddy.BuddyStore(capacity_bytes=256 * MiB, block_bytes=64 * MiB, pin=True)
    t = make_data("random_bytes", 8 * MiB // 4, torch.float32, torch.Generator().manual_seed(3)).to(cuda)
    _warm(store, t, 4.0)
    expected = t.cpu()
    copy = buddy.streams.for_device(cuda).copy_stream(cuda)
    with torch.cuda.stream(copy):
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of the copy stream's time
    bt = buddy.compress(t, target_ratio=4.0, store=store)
    assert bt.buddy_bytes > 0
    y = t * 2  # more forward work
    torch.cuda.current_stream().synchronize()  # forward is done ...
    assert not copy.query()  # ... while its offload still waits behind the sleep: forward did not wait
    del t, y
    assert_bitexact(bt.decompress().cpu(), expected)  # waits for the copy on the device, by itself
    torch.cuda.synchronize()
    bt.free()
    assert_clean(store)


@pytest.mark.gpu
def test_a_tensor_on_a_non_current_device(cuda):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    store = buddy.BuddyStore(capacity_bytes=256 * MiB, block_bytes=4 * MiB, pin=True)
    g = torch.Generator().manual_seed(9)
    other = torch.device("cuda", 1)
    t = make_data("relu", 3 << 20, torch.float32, g).to(other)
    expected = t.cpu()
    with torch.cuda.device(0):  # cuda:0 current, the tensor on cuda:1
        bt = buddy.compress(t, target_ratio=4.0, store=store)
        assert bt.device == other and bt.buddy_bytes > 0
        assert bt.prefetch() == bt.buddy_bytes
        out = bt.decompress()
        assert out.device == other
    assert_bitexact(out.cpu(), expected)
    torch.cuda.synchronize(other)
    bt.free()
    assert_clean(store)


def _linear_relu_step(cuda):
    """A training step of eight Linear+ReLU pairs on ``cuda`` (each saves a 8 MiB activation): ``step(session=None)``
    runs one, in ``session`` when given, and returns the gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(1024, 1024), torch.nn.ReLU())]).to(cuda)
    x = torch.randn(2048, 1024, device=cuda)

    def step(session=None):
        model.zero_grad()
        with session if session is not None else contextlib.nullcontext():
            loss = model(x).square().sum()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    return step


@pytest.mark.gpu
@pytest.mark.parametrize(
    "policy, prefetch",
    [
        (buddy.FixedRatio(4.0), buddy.Prefetch()),
        (buddy.FixedRatio(4.0), buddy.Prefetch(tensors=3, unpack_bytes=64 * MiB)),
        (buddy.CompressedOffload(), buddy.Prefetch(tensors=4)),
        (buddy.CompressedOffload(), False),
    ],
    ids=["prefetch", "unpack-ahead", "offload", "offload-no-prefetch"],
)
def test_backward_with_look_ahead_is_bit_exact_on_the_gpu(cuda, policy, prefetch):
    store = buddy.BuddyStore(capacity_bytes=1 << 30, block_bytes=64 * MiB, pin=True)
    step = _linear_relu_step(cuda)

    expected = step()
    s = buddy.compressed_activations(
        policy, tracker=buddy.Tracker(), store=store, prefetch=prefetch, min_bytes=MIN_BYTES
    )
    got = step(s)
    for a, b in zip(got, expected):
        assert_bitexact(a, b)
    st = s.stats()
    assert st.buddy_bytes > 0
    if prefetch is not False:
        assert st.prefetch.ready >= st.decompressions - 1
    torch.cuda.synchronize()
    store.trim()  # ranges freed during backward, busy then, are reclaimed once their copies are done
    assert_clean(store)


def _learned_linear_relu_step(cuda):
    """:func:`_linear_relu_step` with a pinned store and a tracker that has seen two steps of it (its keys sized
    first, then packed ahead): ``(store, step, tracker, the gradients of a plain step)``."""
    store = buddy.BuddyStore(capacity_bytes=1 << 30, block_bytes=64 * MiB, pin=True)
    step, tracker = _linear_relu_step(cuda), buddy.Tracker()
    expected = step()
    for _ in range(2):
        step(buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN_BYTES))
    torch.cuda.synchronize()
    return store, step, tracker, expected


def _bitexact_without_host_waits(step, session, expected) -> None:
    """``step(session)`` under sync debug mode "error" (a host wait but the session's counted reads raises), its
    gradients bit-identical to ``expected``."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = step(session)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a, b in zip(got, expected):
        assert_bitexact(a, b)


@pytest.mark.gpu
def test_packing_beside_forward_is_bit_exact_and_never_waits_on_the_host(cuda):
    """overlap=True on a real device: packs on the pack stream, the stash's waits on the device, the step's
    gradients bit-identical to a plain step's, and no host wait in the step but the session's counted reads."""
    store, step, tracker, expected = _learned_linear_relu_step(cuda)
    for stash_bytes in (256 * MiB, 8 * MiB):  # room for every original, then for one (forward waits on the device)
        s = buddy.compressed_activations(
            tracker=tracker, store=store, min_bytes=MIN_BYTES, overlap=buddy.Overlap(stash_bytes=stash_bytes)
        )
        _bitexact_without_host_waits(step, s, expected)
        st = s.stats()
        assert st.overlapped == sum(r.codec not in ("kept", "left") for r in st.rows) > 0
        assert st.stash_peak_bytes <= max(stash_bytes, 8 * MiB)
    torch.cuda.synchronize()
    store.trim()
    assert_clean(store)


@pytest.mark.gpu
def test_a_step_through_the_overflow_ring_is_bit_exact_and_never_waits_on_the_host(cuda):
    """overflow_ring on a real device: each pack writes its region of the ring, a drain kernel on the copy stream
    writes buddy memory over the bus, decompression waits for its drain. A ring of 256 MiB (room for every
    tensor's worst case), one of 24 MiB (three 8 MiB worst cases: packs wait on the device for earlier drains),
    and the large one with packing beside forward: gradients bit-identical to a plain step's, no host wait in the
    step but the session's counted reads."""
    store, step, tracker, expected = _learned_linear_relu_step(cuda)
    for ring_bytes, overlap in ((256 * MiB, False), (24 * MiB, False), (256 * MiB, True)):
        s = buddy.compressed_activations(
            tracker=tracker, store=store, min_bytes=MIN_BYTES, overflow_ring=ring_bytes, overlap=overlap
        )  # fmt: skip
        _bitexact_without_host_waits(step, s, expected)
        st = s.stats()
        assert st.ring_drained == sum(r.codec not in ("kept", "left") for r in st.rows) > 0, str(st)
        assert st.ring_bytes == ring_bytes and (st.ring_waits > 0) == (ring_bytes < 256 * MiB), str(st)
    torch.cuda.synchronize()
    store.trim()
    assert_clean(store)


@pytest.mark.gpu
def test_pinned_bytes_are_what_the_store_reserves(cuda):
    store = buddy.BuddyStore(capacity_bytes=256 * MiB, block_bytes=3 * MiB + 96, pin=True)
    g = torch.Generator().manual_seed(4)
    bts = [
        buddy.compress(make_data("random_bytes", MiB // 4, torch.float32, g).to(cuda), 4.0, store=store)
        for _ in range(8)
    ]
    st = store.stats()
    assert st.buddy_pinned_bytes == st.buddy_reserved_bytes > 0
    overflow = bts[0].buffers()[2]
    assert overflow.is_pinned()
    torch.cuda.synchronize()
    for bt in bts:
        bt.free()
    del overflow
    assert store.trim() == st.buddy_reserved_bytes
    assert store.stats().buddy_pinned_bytes == 0
