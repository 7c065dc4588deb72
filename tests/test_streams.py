"""Buddy traffic off the critical path: copy stream, events, prefetch in backward, pinned memory, compressed offload.

The ordering and bookkeeping are checked on the CPU with :class:`FakeStreams`,
a stand-in for CUDA's streams and events installed for CPU tensors
(``buddy.streams.use``): it logs every event recorded, every wait and every
``keep_for``, and its events complete only when a test says so -- exactly
the state a GPU can be in while copies are in flight. It proves the logic,
never anything about speed; the ``gpu`` tests in ``test_gpu.py`` and
``test_concurrency.py`` run the real thing.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
from conftest import MiB, assert_bitexact, make_data

import buddy
from buddy import streams
from buddy.prefetch import Prefetch

MIN = 4096


class FakeEvent:
    def __init__(self, stream: str, n: int):
        self.stream, self.n, self.complete = stream, n, False

    def __repr__(self) -> str:
        return f"<event {self.n} on {self.stream}{' done' if self.complete else ''}>"


class FakeStreams(streams.StreamOps):
    """Streams named ``"compute"``, ``"copy"`` and ``"pack"``; nothing completes until :meth:`finish` or a host
    wait."""

    def __init__(self):
        self.now = "compute"
        self.log: list[tuple] = []
        self.events: list[FakeEvent] = []

    def current(self, device):
        return self.now

    def copy_stream(self, device):
        return "copy"

    def pack_stream(self, device):
        return "pack"

    @contextlib.contextmanager
    def activate(self, stream):
        before, self.now = self.now, stream
        try:
            yield
        finally:
            self.now = before

    def record(self, stream):
        event = FakeEvent(stream, len(self.events))
        self.events.append(event)
        self.log.append(("record", stream, event))
        return event

    def wait(self, stream, event) -> None:
        self.log.append(("wait", stream, event))

    def keep_for(self, tensor, stream) -> None:
        self.log.append(("keep", stream, tensor.data_ptr()))

    def done(self, event) -> bool:
        return event is None or event.complete

    def synchronize(self, event) -> None:
        self.log.append(("sync", event))
        if event is not None:
            event.complete = True

    def finish(self) -> None:
        """Every stream has caught up."""
        for event in self.events:
            event.complete = True

    def kinds(self) -> list[tuple[str, str]]:
        return [(entry[0], entry[1] if entry[0] != "sync" else "host") for entry in self.log]


@pytest.fixture
def fake():
    with streams.use(FakeStreams(), "cpu") as ops:
        yield ops


def relu_data(nbytes: int, gen) -> torch.Tensor:
    return make_data("relu", nbytes // 4, torch.float32, gen)


# ---------------------------------------------------------------------------
# forward: the offload
# ---------------------------------------------------------------------------
def test_overflow_copy_runs_on_the_copy_stream_after_the_pack(fake, store, gen):
    t = relu_data(MiB, gen)
    bt = buddy.compress(t, target_ratio=4.0, store=store)
    assert bt.buddy_bytes > 0
    assert fake.kinds() == [("record", "compute"), ("wait", "copy"), ("record", "copy"), ("keep", "copy")]
    packed, written = fake.log[0][2], fake.log[2][2]
    assert fake.log[1][2] is packed  # the copy waits for the pack kernel, on the device
    assert written.stream == "copy"
    assert not fake.events[1].complete  # compress returned with its copy still in flight: nothing waited


def test_no_overflow_no_copy(fake, store):
    bt = buddy.compress(torch.zeros(MiB // 4), target_ratio=4.0, store=store)
    assert bt.buddy_bytes == 0 and fake.log == []


def test_a_range_is_reused_only_after_its_copies(fake, store, gen):
    a = buddy.compress(relu_data(MiB, gen), target_ratio=4.0, store=store)
    held = store.bytes_held
    a.free()  # its copy to buddy memory is still in flight
    assert store.bytes_held == held  # not given back yet
    b = buddy.compress(relu_data(MiB, gen), target_ratio=4.0, store=store)
    assert store.bytes_held == held + _rounded(b.buddy_bytes)  # b got another range
    fake.finish()
    b.free()
    store.trim()
    assert store.bytes_held == 0


def _rounded(n: int) -> int:
    return -(-n // 32) * 32


def test_a_failed_compress_keeps_its_range_until_the_copy_lands(fake, store, gen, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("refused")

    monkeypatch.setattr(buddy.pipeline, "BuddyTensor", refuse)  # fails after the overflow's copy was issued
    with pytest.raises(RuntimeError, match="refused"):
        buddy.compress(relu_data(MiB, gen), target_ratio=4.0, store=store)
    assert ("record", "copy") in fake.kinds()
    assert store.bytes_held > 0  # the queued copy still writes into it
    fake.finish()
    store.trim()
    assert store.bytes_held == 0


def test_buffers_wait_for_the_copy_to_land(fake, store, gen):
    bt = buddy.compress(relu_data(MiB, gen), target_ratio=4.0, store=store)
    written = fake.log[2][2]
    assert not written.complete
    bt.buffers()
    assert written.complete and fake.log[-1] == ("sync", written)


# ---------------------------------------------------------------------------
# backward: reading buddy memory
# ---------------------------------------------------------------------------
def test_decompress_waits_on_the_device_and_marks_the_range_busy(fake, store, gen):
    t = relu_data(MiB, gen)
    bt = buddy.compress(t, target_ratio=4.0, store=store)
    written = fake.log[2][2]
    fake.log.clear()
    out = bt.decompress()
    assert_bitexact(out, t)
    assert ("wait", "compute", written) in fake.log  # the stream waits for the copy: no host wait
    assert not any(k == "sync" for k, *_ in fake.log)
    read = [e for k, s, e in fake.log if k == "record" and s == "compute"]
    assert len(read) == 1  # the read of buddy memory is recorded ...
    written.complete = True
    bt.free()
    assert store.bytes_held > 0  # ... and keeps the range until it has ended
    fake.finish()
    store.trim()
    assert store.bytes_held == 0


def test_prefetch_brings_the_overflow_back_on_the_copy_stream(fake, store, gen):
    t = relu_data(MiB, gen)
    bt = buddy.compress(t, target_ratio=4.0, store=store)
    written = fake.log[2][2]
    fake.log.clear()
    assert bt.prefetch() == bt.buddy_bytes and bt.prefetched
    assert fake.kinds() == [("wait", "copy"), ("record", "copy"), ("record", "copy")]
    assert fake.log[0][2] is written  # read back only once it is there
    arrived = fake.log[2][2]
    assert bt.prefetch() == 0  # once
    fake.log.clear()
    assert_bitexact(bt.decompress(), t)
    assert ("wait", "compute", arrived) in fake.log  # the decode waits for the copy back, on the device
    assert not bt.prefetched  # used once


def test_an_unused_prefetch_is_dropped_and_decompress_reads_buddy_memory(fake, store, gen):
    t = relu_data(MiB, gen)
    bt = buddy.compress(t, target_ratio=4.0, store=store)
    bt.prefetch()
    assert bt.drop_prefetch() == bt.buddy_bytes and not bt.prefetched
    assert bt.drop_prefetch() == 0
    assert_bitexact(bt.decompress(), t)


def test_prefetch_does_nothing_on_the_host(store, gen):
    bt = buddy.compress(relu_data(MiB, gen), target_ratio=4.0, store=store)
    assert bt.prefetch() == 0 and not bt.prefetched


# ---------------------------------------------------------------------------
# the session's look-ahead
# ---------------------------------------------------------------------------
class Chain(nn.Module):
    """``layers`` Linear+ReLU pairs: each saves a ~1 MiB half-zero activation, compressed with overflow."""

    def __init__(self, layers: int = 6, width: int = 512):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def grads(model: nn.Module, x: torch.Tensor, session=None) -> list[torch.Tensor]:
    model.zero_grad()
    with session if session is not None else contextlib.nullcontext():
        y = model(x)
    y.square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def chain_input() -> torch.Tensor:
    return torch.randn(512, 512, generator=torch.Generator().manual_seed(5))


def session(store, **kwargs):
    """A session sized first (strict=True): its pack writes the overflow on the device and the copy stream takes it
    to buddy memory, the path these tests follow (packed ahead, the kernel writes buddy memory itself)."""
    kwargs.setdefault("policy", buddy.FixedRatio(4.0))
    kwargs.setdefault("strict", True)
    return buddy.compressed_activations(tracker=buddy.Tracker(), store=store, min_bytes=MIN, **kwargs)


@pytest.fixture
def watch(monkeypatch):
    """Records, at every prefetch, the overflow bytes and tensors on the device ahead of use."""
    seen: list[weakref.ref] = []
    peaks = {"bytes": 0, "tensors": 0}
    real = buddy.BuddyTensor.prefetch

    def prefetch(self):
        moved = real(self)
        seen.append(weakref.ref(self))
        live = [bt for bt in (r() for r in seen) if bt is not None and not bt.freed and bt.prefetched]
        peaks["bytes"] = max(peaks["bytes"], sum(bt.buddy_bytes for bt in live))
        peaks["tensors"] = max(peaks["tensors"], len(live))
        return moved

    monkeypatch.setattr(buddy.BuddyTensor, "prefetch", prefetch)
    return peaks


@pytest.mark.parametrize("ahead", [1, 2, 4])
def test_backward_prefetches_the_next_tensors_within_the_bounds(fake, store, watch, ahead):
    model, x = Chain(), chain_input()
    expected = grads(model, x)
    s = session(store, prefetch=Prefetch(tensors=ahead, overflow_bytes=64 * MiB))
    got = grads(model, x, s)
    for a, b in zip(got, expected):
        assert_bitexact(a, b)
    st = s.stats()
    compressed = sum(r.codec != "kept" for r in st.rows)
    assert compressed == 7 and st.decompressions == compressed  # the input and six ReLU outputs
    assert st.prefetch.prefetched == compressed  # each brought back once, ahead of its use
    assert st.prefetch.ready == compressed  # and found there by autograd
    assert 1 <= watch["tensors"] <= ahead + 1  # the one being unpacked and `ahead` more
    assert all(k != "sync" for k, *_ in fake.log)  # backward never waited on the host


def test_the_byte_bound_holds(fake, store, watch):
    model, x = Chain(), chain_input()
    s = session(store, prefetch=Prefetch(tensors=6, overflow_bytes=int(1.5 * MiB)))
    grads(model, x, s)
    st = s.stats()
    per_tensor = max(r.buddy_bytes for r in st.rows)
    assert MiB > per_tensor > MiB // 2  # at most one tensor's overflow fits the bound, then two ...
    assert 0 < watch["bytes"] <= 1.5 * MiB
    assert st.prefetch.prefetched >= 4  # ... and the look-ahead still worked within it


def test_the_block_closing_prefetches_what_backward_needs_first(fake, store):
    model, x = Chain(), chain_input()
    with session(store, prefetch=Prefetch(tensors=2)) as s:
        y = model(x)
    assert s.stats().prefetch.prefetched == 2
    last = s.stats().rows[-2:]
    assert all(r.buddy_bytes for r in last)
    y.sum().backward()


def test_no_prefetch(fake, store):
    model, x = Chain(), chain_input()
    s = session(store, prefetch=False)
    grads(model, x, s)
    st = s.stats()
    assert st.prefetch.prefetched == st.prefetch.ready == 0
    assert ("record", "copy") in fake.kinds()  # the offload still ran on the copy stream


def test_nothing_to_prefetch_on_the_host(store):
    model, x = Chain(), chain_input()
    expected = grads(model, x)
    s = session(store)
    got = grads(model, x, s)
    for a, b in zip(got, expected):
        assert_bitexact(a, b)
    st = s.stats()
    assert st.prefetch.prefetched == st.prefetch.unpacked_ahead == st.prefetch.ready == 0


def test_unpack_ahead_hands_the_tensor_over_on_the_device(fake, store):
    model, x = Chain(), chain_input()
    expected = grads(model, x)
    s = session(store, prefetch=Prefetch(tensors=2, unpack_bytes=4 * MiB))
    got = grads(model, x, s)
    for a, b in zip(got, expected):
        assert_bitexact(a, b)
    st = s.stats()
    assert st.prefetch.unpacked_ahead >= 5 and st.prefetch.ready == st.decompressions
    handed = [i for i, e in enumerate(fake.log) if e[:2] == ("keep", "compute")]
    assert handed  # the tensor decompressed on the copy stream is kept for the compute stream ...
    for i in handed:
        j = i - 1
        while fake.log[j][:2] == ("keep", "compute"):  # a kernel engine's error flag is kept beside its tensor
            j -= 1
        kind, stream, event = fake.log[j]
        assert (kind, stream) == ("wait", "compute") and event.stream == "copy"  # ... which waits for it first


def test_unpack_ahead_bound(fake, store, monkeypatch):
    live: list[weakref.ref] = []
    peak = [0]
    real = buddy.prefetch.Ahead.__init__

    def made(self, *args):
        real(self, *args)
        live.append(weakref.ref(self))
        peak[0] = max(peak[0], sum(r() is not None for r in live))

    monkeypatch.setattr(buddy.prefetch.Ahead, "__init__", made)
    model, x = Chain(), chain_input()
    s = session(store, prefetch=Prefetch(tensors=4, unpack_bytes=MiB))  # room for one 1 MiB tensor
    grads(model, x, s)
    st = s.stats()
    assert peak[0] == 1  # never two decompressed ahead at once
    assert st.prefetch.unpacked_ahead >= 1 and st.prefetch.prefetched >= 1  # the rest: overflow only
    assert st.prefetch.ready == st.decompressions


def test_a_second_backward_prefetches_again(fake, store):
    model, x = Chain(), chain_input()
    expected = grads(model, x)
    model.zero_grad()
    with session(store, prefetch=Prefetch(tensors=2)) as s:
        y = model(x).square().sum()
    y.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    y.backward()
    for a, b, c in zip(first, [p.grad for p in model.parameters()], expected):
        assert_bitexact(a, c)
        assert_bitexact(b, c)
    st = s.stats()
    assert st.decompressions == 14
    assert st.prefetch.ready == 13  # all but the second backward's first unpack, which nothing foresaw


def test_a_partial_backward_drops_what_it_never_asks_for(fake, store):
    torch.manual_seed(0)
    layers = [nn.Linear(512, 512) for _ in range(8)]
    x = chain_input().requires_grad_(True)
    with session(store, prefetch=Prefetch(tensors=2)) as s:
        h = x
        for layer in layers[:2]:
            h = torch.relu(layer(h))
        mid = h
        for layer in layers[2:]:
            h = torch.relu(layer(h))
    (gx,) = torch.autograd.grad(mid.sum(), x)  # the tail's tensors, prefetched as the block closed, are not needed
    plain = x.detach().requires_grad_(True)
    h = plain
    for layer in layers[:2]:
        h = torch.relu(layer(h))
    (expected,) = torch.autograd.grad(h.sum(), plain)
    assert_bitexact(gx, expected)
    assert s.stats().prefetch.dropped == 2
    del h, mid
    fake.finish()
    gc.collect()
    store.trim()
    assert store.bytes_held == 0


def test_out_of_order_unpack_is_correct(fake, store, gen):
    """Saved tensors unpacked in pack order (the opposite of the guess) cost only the wrong guesses."""
    xs = [relu_data(MiB, gen).requires_grad_(True) for _ in range(4)]
    with session(store, prefetch=Prefetch(tensors=2)) as s:
        ys = [torch.sigmoid(x) for x in xs]  # each saves its output
    for x, y in zip(xs, ys):  # first packed, first unpacked
        y.sum().backward()
        expected = torch.sigmoid(x.detach())
        assert_bitexact(x.grad, expected * (1 - expected))
    assert s.stats().decompressions == 4


def test_prefetch_arguments_are_checked(store):
    with pytest.raises(ValueError, match="tensors"):
        Prefetch(tensors=-1)
    with pytest.raises(ValueError, match="overflow_bytes"):
        Prefetch(overflow_bytes=1.5)
    with pytest.raises(TypeError, match="prefetch"):
        session(store, prefetch="yes")


def test_a_failing_prefetch_costs_the_look_ahead_not_the_step(fake, store, monkeypatch):
    def broken(self):
        raise RuntimeError("copy engine on fire")

    monkeypatch.setattr(buddy.BuddyTensor, "prefetch", broken)
    model, x = Chain(), chain_input()
    expected = grads(model, x)
    with pytest.warns(RuntimeWarning, match="could not prefetch"):
        got = grads(model, x, session(store))
    for a, b in zip(got, expected):
        assert_bitexact(a, b)


# ---------------------------------------------------------------------------
# compressed offload
# ---------------------------------------------------------------------------
def test_compressed_offload_keeps_only_metadata_on_the_device(fake, store):
    model, x = Chain(), chain_input()
    expected = grads(model, x)
    s = session(store, policy=buddy.CompressedOffload())
    got = grads(model, x, s)
    for a, b in zip(got, expected):
        assert_bitexact(a, b)
    st = s.stats()
    for row in st.rows:
        assert row.target_ratio == float("inf")
        assert row.device_bytes < row.original_bytes / 100  # metadata only
    assert st.buddy_bytes == st.ideal_bytes  # the link carries the compressed bytes ...
    assert st.buddy_bytes < 0.75 * st.original_bytes  # ... fewer than an uncompressed offload
    assert st.prefetch.ready == st.decompressions  # and backward found them back on the device


def test_device_budget_slides_down_to_compressed_offload(store):
    """A budget of just the metadata is compressed offload, reached by DeviceBudget's own plan, with no warning."""
    model, x = Chain(), chain_input()
    tracker = buddy.Tracker()
    offload = buddy.compressed_activations(buddy.CompressedOffload(), tracker=tracker, store=store, min_bytes=MIN)
    grads(model, x, offload)
    metadata = offload.stats().device_bytes
    budgets = []
    for _ in range(3):
        s = buddy.compressed_activations(buddy.DeviceBudget(metadata), tracker=tracker, store=store, min_bytes=MIN)
        with warnings.catch_warnings():
            warnings.simplefilter("error", buddy.BudgetExceededWarning)
            grads(model, x, s)
        budgets.append(s.stats())
    assert all(st.device_bytes <= metadata for st in budgets)
    assert budgets[-1].buddy_bytes == budgets[-1].ideal_bytes


# ---------------------------------------------------------------------------
# pinned memory that means what it says
# ---------------------------------------------------------------------------
@pytest.fixture
def fake_cudart(monkeypatch):
    """Pinning without a GPU: ``cudaHostRegister``/``Unregister`` recorded instead of run."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(buddy.store, "_cuda_call", lambda name, *args: calls.append((name, *args)))
    return calls


def test_pinned_bytes_are_exactly_the_blocks(fake_cudart, gen):
    store = buddy.BuddyStore(capacity_bytes=64 * MiB, block_bytes=3 * MiB + 96, pin=True)
    bts = [buddy.compress(relu_data(MiB, gen), target_ratio=4.0, store=store) for _ in range(8)]
    st = store.stats()
    assert st.buddy_pinned_bytes == st.buddy_reserved_bytes == sum(a[2] for a in fake_cudart)
    assert all(name == "cudaHostRegister" and size % 32 == 0 for name, _, size, _ in fake_cudart)
    assert len(fake_cudart) == st.buddy_blocks  # once per block, never per tensor
    assert "page-locked" in str(st)
    for bt in bts:
        bt.free()
    assert store.trim() == st.buddy_reserved_bytes
    assert [c[0] for c in fake_cudart].count("cudaHostUnregister") == st.buddy_blocks
    assert store.stats().buddy_pinned_bytes == 0


def test_a_refused_pin_is_a_full_store(monkeypatch, gen):
    def refuse(name, *args):
        raise RuntimeError(f"{name} failed: cudaErrorMemoryAllocation")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(buddy.store, "_cuda_call", refuse)
    store = buddy.BuddyStore(capacity_bytes=64 * MiB, block_bytes=MiB, pin=True)
    with pytest.raises(buddy.HostStoreFull, match="pinned"):
        buddy.compress(relu_data(MiB, gen), target_ratio=4.0, store=store)
    assert store.stats().buddy_reserved_bytes == 0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="Linux /proc")
def test_trim_gives_memory_back_to_the_os(gen):
    store = buddy.BuddyStore(capacity_bytes=1 << 30, block_bytes=64 * MiB, pin=False)
    t = make_data("random_bytes", 128 * MiB // 4, torch.float32, gen)  # incompressible: 128 MiB of overflow
    gc.collect()
    before = _rss_bytes()
    bt = buddy.compress(t, target_ratio=4.0, store=store)
    grown = _rss_bytes()
    assert grown - before > 64 * MiB  # the blocks were written: resident
    bt.free()
    assert store.trim() >= 96 * MiB
    assert grown - _rss_bytes() > 64 * MiB  # unmapped: back to the OS
