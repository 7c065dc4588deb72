"""The buddy store: the one owner of buddy memory (host RAM).

Buddy memory is host RAM that holds overflow sectors, allocated in large
blocks once and sub-allocated per tensor. A block is an anonymous memory
mapping of exactly its size; with CUDA it is page-locked with
``cudaHostRegister`` -- once, when the block is made, never per tensor --
so the pinned bytes are exactly the blocks' bytes (torch's pinned-memory
allocator would round each request up to a power of two and keep it for
good). :meth:`BuddyStore.trim` unregisters and unmaps unused blocks: their
memory goes back to the OS. Without CUDA the blocks are plain host memory
with the same accounting.

Capacity: the store never holds more than ``capacity_bytes`` of blocks. An
allocation that cannot fit -- or a block the OS will not give (pinned memory
is limited) -- raises :class:`~buddy.errors.HostStoreFull` before anything is
written; :func:`buddy.compress` then either re-raises or, with
``on_full="device"``, keeps the whole tensor in device slots (no overflow).
Nothing is ever dropped silently.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ._deferred import DeferredLock
from ._process_default import ProcessDefault
from .engines import pinned
from .errors import HostStoreFull
from .spec import SECTOR_BYTES

__all__ = ["BuddyStore", "BuddyAllocation", "StoreStats", "default_store", "set_default_store"]

MiB = 1 << 20
DEFAULT_BLOCK_BYTES = 64 * MiB


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume a small machine
        return 8 << 30


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
#: cudaHostRegisterMapped: mapped into the devices' address space too, so a kernel may read the overflow where it
#: is (buddy.engines.cuda.reads_overflow_in_place); asked for first, and left out where the runtime refuses it
_CUDA_HOST_REGISTER_MAPPED = 2


def _cuda_call(name: str, *args) -> None:
    cudart = torch.cuda.cudart()
    err = getattr(cudart, name)(*args)
    if int(err) != 0:
        _take_last_error()
        raise RuntimeError(f"{name} failed: CUDA error {int(err)} ({cudart.cudaGetErrorString(err)})")


def _take_last_error() -> None:
    """Clear the CUDA runtime's last error of this thread after a failed call.

    A runtime call that fails also leaves its error as the thread's last error, and PyTorch's
    check after its next kernel launch (``cudaGetLastError``) would raise it there, as that
    kernel's error: a refused pin, answered here with :class:`HostStoreFull`, would fail an
    unrelated operation later. The runtime PyTorch loaded is asked by its soname; where it
    cannot be found (not loaded, another platform), nothing is cleared.
    """
    major = (torch.version.cuda or "").split(".")[0]
    try:
        runtime = ctypes.CDLL(f"libcudart.so.{major}", mode=os.RTLD_NOLOAD)
        runtime.cudaGetLastError()
    except (OSError, AttributeError):
        pass


def _unpin(address: int) -> None:
    """Unregister a block's pages: at its release, or when it is collected without one."""
    pinned.forget(address)
    try:
        _cuda_call("cudaHostUnregister", address)
    except Exception:  # a finalizer must not raise: the context is gone (interpreter exit), nothing is left to unpin
        pass


class _Block:
    """One large host buffer -- an anonymous mapping, pinned with CUDA -- and its free ranges, sorted by offset."""

    def __init__(self, nbytes: int, pin: bool):
        self._map = mmap.mmap(-1, nbytes)  # page-aligned, exactly nbytes, unmapped with its last reference
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = False
        #: pinned and mapped into the devices' address space (see _CUDA_HOST_REGISTER_MAPPED)
        self.mapped = False
        self._unpin: weakref.finalize | None = None
        if pin:
            portable, mapped = _CUDA_HOST_REGISTER_PORTABLE, _CUDA_HOST_REGISTER_MAPPED
            try:
                try:
                    _cuda_call("cudaHostRegister", self.buffer.data_ptr(), nbytes, portable | mapped)
                    self.mapped = True
                except RuntimeError:
                    _cuda_call("cudaHostRegister", self.buffer.data_ptr(), nbytes, portable)
                    pinned.unmapped(self.buffer.data_ptr())  # pinned, not mapped: never read in place
            except BaseException:
                self.release()
                raise
            self.pinned = True
            # A block collected without release() (its store dropped) must unpin too: its pages go back
            # to the OS, and a later mapping at the same address would be refused as already registered.
            self._unpin = weakref.finalize(self, _unpin, self.buffer.data_ptr())
            self._unpin.atexit = False
        self.nbytes = nbytes
        self.free_starts = [0]
        self.free_sizes = [nbytes]

    def release(self) -> None:
        """Unpin, and give the memory back to the OS as soon as no view of it is left.

        Never unmapped by hand: a view handed out earlier (``BuddyTensor.buffers()``) would
        point at nothing. The mapping goes when its last reference does -- at once when the
        block is unused and no one kept a view.
        """
        if self.pinned:
            assert self._unpin is not None
            self._unpin()  # once: the finalizer is spent
            self.pinned = False
        self.buffer = self._map = None  # type: ignore[assignment]  # released: the block is never used again

    @property
    def unused(self) -> bool:
        return self.free_sizes == [self.nbytes]

    def take(self, nbytes: int) -> int | None:
        """First-fit: offset of a range of ``nbytes``, or ``None``."""
        for i, size in enumerate(self.free_sizes):
            if size >= nbytes:
                start = self.free_starts[i]
                if size == nbytes:
                    del self.free_starts[i], self.free_sizes[i]
                else:
                    self.free_starts[i] += nbytes
                    self.free_sizes[i] -= nbytes
                return start
        return None

    def give(self, start: int, nbytes: int) -> None:
        """Return a range and merge it with its free neighbours."""
        i = bisect.bisect_left(self.free_starts, start)
        if i < len(self.free_starts) and start + nbytes > self.free_starts[i]:
            raise RuntimeError("buddy store: double free or overlapping range")
        if i > 0 and self.free_starts[i - 1] + self.free_sizes[i - 1] > start:
            raise RuntimeError("buddy store: double free or overlapping range")
        self.free_starts.insert(i, start)
        self.free_sizes.insert(i, nbytes)
        if i + 1 < len(self.free_starts) and start + nbytes == self.free_starts[i + 1]:
            self.free_sizes[i] += self.free_sizes.pop(i + 1)
            self.free_starts.pop(i + 1)
        if i > 0 and self.free_starts[i - 1] + self.free_sizes[i - 1] == start:
            self.free_sizes[i - 1] += self.free_sizes.pop(i)
            self.free_starts.pop(i)


#: the data of an allocation of no bytes, shared (it has none to write)
_NOTHING = torch.empty(0, dtype=torch.uint8)


class BuddyAllocation:
    """A range of buddy memory owned by one BuddyTensor.

    ``data`` is a ``uint8`` view of exactly ``nbytes`` bytes. Every
    asynchronous copy that touches it is recorded (:meth:`written_on` for the
    copy that fills it, :meth:`used_on` for any that reads it), so that
    readers wait for the write and the store hands the range to no one else
    before every such copy is done. Events come from the
    :class:`~buddy.streams.StreamOps` of the tensor's own device.
    """

    __slots__ = ("store", "block", "offset", "nbytes", "data", "ops", "written", "uses")

    def __init__(self, store: BuddyStore, block: _Block | None, offset: int, nbytes: int):
        self.store = store
        self.block = block
        self.offset = offset
        self.nbytes = nbytes
        self.data = block.buffer[offset : offset + nbytes] if block is not None else _NOTHING
        self.ops: Any = None  # the stream operations of the copies (buddy.streams), once one was issued
        self.written = None  # the event of the copy that fills the range
        self.uses: list = []  # events of every copy touching the range that may not have completed

    def written_on(self, ops, stream) -> None:
        """The copy that fills the range was just issued on ``stream``."""
        self.written_by(ops, ops.record(stream))

    def written_by(self, ops, event) -> None:
        """The work that fills the range completes with ``event``."""
        self.ops = ops
        self.written = event
        self.uses.append(event)

    def used_on(self, ops, stream) -> None:
        """A copy reading the range was just issued on ``stream``: the range stays busy until it ends."""
        self.ops = ops
        self.uses = [e for e in self.uses if not ops.done(e)]
        self.uses.append(ops.record(stream))

    def wait_written(self, stream) -> None:
        """Make ``stream``'s later work wait until the range has been filled (no host wait)."""
        if self.ops is not None:
            self.ops.wait(stream, self.written)

    def synchronize_written(self) -> None:
        """Wait on the host until the range has been filled (before the host reads it)."""
        if self.ops is not None:
            self.ops.synchronize(self.written)

    @property
    def busy(self) -> bool:
        """Whether a copy touching the range may still be in flight."""
        return self.ops is not None and not all(self.ops.done(e) for e in self.uses)

    def synchronize(self) -> None:
        """Wait on the host until no copy touches the range."""
        for event in self.uses:
            self.ops.synchronize(event)

    def __repr__(self) -> str:
        return f"BuddyAllocation(nbytes={self.nbytes}, offset={self.offset})"


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of a store's accounting; all values in bytes except counts."""

    buddy_capacity_bytes: int
    buddy_bytes_held: int
    buddy_peak_bytes: int
    buddy_free_bytes: int
    buddy_reserved_bytes: int
    buddy_blocks: int
    pinned: bool
    #: host bytes page-locked for the store: exactly its blocks' bytes when pinned, else 0
    buddy_pinned_bytes: int = 0

    def __str__(self) -> str:
        mib = lambda b: f"{b / MiB:,.2f} MiB"  # noqa: E731 - local formatter
        return (
            f"buddy memory: {mib(self.buddy_bytes_held)} held (peak {mib(self.buddy_peak_bytes)}), "
            f"{mib(self.buddy_free_bytes)} free of {mib(self.buddy_capacity_bytes)}, "
            f"{mib(self.buddy_reserved_bytes)} reserved in {self.buddy_blocks} "
            f"{'pinned' if self.pinned else 'pageable'} block(s)"
            + (f", {mib(self.buddy_pinned_bytes)} page-locked" if self.pinned else "")
        )


class BuddyStore:
    """Owns buddy memory: host RAM for the overflow of compressed tensors.

    Args:
        capacity_bytes: most host bytes of blocks the store may hold. Default:
            half of physical memory.
        block_bytes: size of one block (bytes); larger allocations get a
            dedicated block rounded up to a multiple of it. Default 64 MiB.
        pin: pin blocks (page-locked, for fast and asynchronous copies to and
            from the GPU). Default: pin when CUDA is available.

    Thread-safe. One lock guards the blocks' free lists and the list of
    ranges waiting for a copy; :meth:`allocate`, :meth:`trim` and
    :meth:`stats` take it. Releases (:meth:`release`, from BuddyTensor
    finalizers) never wait for it: they are queued and applied by whoever
    holds or next takes it (see :mod:`buddy._deferred`). When no call is in
    progress, every release has been applied. Device bytes are counted by
    :class:`~buddy.ledger.DeviceLedger`, not here.
    """

    def __init__(
        self, capacity_bytes: int | None = None, *, block_bytes: int = DEFAULT_BLOCK_BYTES, pin: bool | None = None
    ):
        if capacity_bytes is None:
            capacity_bytes = _physical_memory_bytes() // 2
        for name, value in (("capacity_bytes", capacity_bytes), ("block_bytes", block_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int (bytes), got {value!r}")
        if block_bytes == 0:
            raise ValueError("block_bytes must be positive")
        if pin is None:
            pin = torch.cuda.is_available()
        if pin and not torch.cuda.is_available():
            raise ValueError("pin=True needs CUDA (pinned memory is page-locked for GPU copies)")
        self.capacity_bytes = capacity_bytes
        self.block_bytes = _round_up(block_bytes, SECTOR_BYTES)
        self.pin = bool(pin)
        self._blocks: list[_Block] = []
        self._pending: list[BuddyAllocation] = []  # freed, waiting for their last copy
        self._deferred = DeferredLock(self._apply_release)  # see the class docstring
        self._held = 0
        self._peak = 0

    # ---- buddy memory ---------------------------------------------------
    def allocate(self, nbytes: int) -> BuddyAllocation:
        """A range of ``nbytes`` of buddy memory, or :class:`HostStoreFull`."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        if nbytes == 0:
            return BuddyAllocation(self, None, 0, 0)
        size = _round_up(nbytes, SECTOR_BYTES)
        with self._locked():
            self._reclaim(wait=False)
            place = self._take(size)
            if place is None and self._pending:
                self._reclaim(wait=True)
                place = self._take(size)
            if place is None:
                place = self._grow(size)
            try:
                alloc = BuddyAllocation(self, *place, nbytes)
            except BaseException:  # KeyboardInterrupt included: the range must not leak
                place[0].give(place[1], size)
                raise
            self._held += size
            self._peak = max(self._peak, self._held)
            return alloc

    def shrink(self, alloc: BuddyAllocation, nbytes: int) -> None:
        """Keep only the first ``nbytes`` of ``alloc`` (a range reserved at its worst case, then written with less):
        the rest goes back to the store. Only once nothing may still write past ``nbytes``."""
        if not 0 <= nbytes <= alloc.nbytes:
            raise ValueError(f"cannot shrink an allocation of {alloc.nbytes} bytes to {nbytes}")
        with self._locked():
            if alloc.block is None:  # (an empty one, or freed)
                if nbytes:
                    raise ValueError("cannot shrink a freed or empty allocation to a non-zero size")
                return
            keep, size = _round_up(nbytes, SECTOR_BYTES), _round_up(alloc.nbytes, SECTOR_BYTES)
            if keep < size:
                alloc.block.give(alloc.offset + keep, size - keep)
                self._held -= size - keep
            alloc.nbytes = nbytes
            if keep:
                alloc.data = alloc.data[:nbytes]
            else:  # nothing kept: an empty allocation, as allocate(0) makes
                alloc.block, alloc.data = None, _NOTHING

    def release(self, alloc: BuddyAllocation) -> None:
        """Return an allocation's range. Safe while a copy is in flight, from any thread, and twice."""
        if alloc.block is not None:
            self._deferred.submit(alloc)

    def _locked(self):
        return self._deferred.locked()

    def _flush(self) -> None:
        self._deferred.flush()

    def _apply_release(self, alloc: BuddyAllocation) -> None:
        if alloc.block is not None and not any(p is alloc for p in self._pending):
            if alloc.busy:
                self._pending.append(alloc)  # reused once its copies have finished
            else:
                self._give(alloc)

    def _take(self, size: int) -> tuple[_Block, int] | None:
        for block in self._blocks:
            offset = block.take(size)
            if offset is not None:
                return block, offset
        return None

    def _grow(self, size: int) -> tuple[_Block, int]:
        new_bytes = _round_up(size, self.block_bytes)
        if self._reserved() + new_bytes > self.capacity_bytes:
            self._trim()
        # Near the capacity a whole block may not fit where the allocation does:
        # then the last block is cut to the room that is left.
        room = (self.capacity_bytes - self._reserved()) // SECTOR_BYTES * SECTOR_BYTES
        new_bytes = min(new_bytes, room)
        if new_bytes < size:
            raise HostStoreFull(
                f"buddy store is full: {size:,} bytes of overflow needed, {self._held:,} of "
                f"{self.capacity_bytes:,} bytes held ({self._reserved():,} reserved). Raise "
                f"BuddyStore(capacity_bytes=...), free BuddyTensors you no longer need, pick a "
                f"less aggressive target_ratio, or pass on_full='device' to keep such tensors "
                f"whole on the device."
            )
        try:
            block = _Block(new_bytes, self.pin)
        except (RuntimeError, MemoryError, OSError) as exc:  # the OS refused the memory (pinning is limited): full too
            raise HostStoreFull(
                f"buddy store could not get a block of {new_bytes:,} bytes of "
                f"{'pinned' if self.pin else 'host'} memory ({type(exc).__name__}: {exc}); "
                f"{self._held:,} bytes held. Free BuddyTensors you no longer need, lower "
                f"BuddyStore(capacity_bytes=...), or pass on_full='device' to keep such tensors whole on the device."
            ) from exc
        self._blocks.append(block)
        offset = block.take(size)
        assert offset is not None  # a new block of at least `size` bytes, all free
        return block, offset

    def _give(self, alloc: BuddyAllocation) -> None:
        size = _round_up(alloc.nbytes, SECTOR_BYTES)
        assert alloc.block is not None, "given back twice"  # release() gives each allocation back once
        alloc.block.give(alloc.offset, size)
        self._held -= size
        alloc.block = None
        alloc.data = _NOTHING  # a view would keep the whole block alive past trim()

    def _reclaim(self, wait: bool) -> None:
        still = []
        for alloc in self._pending:
            if wait:
                alloc.synchronize()  # the store is out of room: wait for in-flight copies
            if wait or not alloc.busy:
                self._give(alloc)
            else:
                still.append(alloc)
        self._pending = still

    def trim(self) -> int:
        """Give wholly unused blocks back to the OS; returns the bytes released."""
        with self._locked():
            return self._trim()

    def _trim(self) -> int:
        self._reclaim(wait=False)
        keep = [b for b in self._blocks if not b.unused]
        released = [b for b in self._blocks if b.unused]
        self._blocks = keep
        for block in released:  # unpinned and unmapped: back to the OS
            block.release()
        return sum(b.nbytes for b in released)

    def _reserved(self) -> int:
        return sum(b.nbytes for b in self._blocks)

    # ---- reporting --------------------------------------------------------
    @property
    def bytes_held(self) -> int:
        """Buddy bytes held by live allocations."""
        self._flush()
        return self._held

    @property
    def peak_bytes(self) -> int:
        """Most buddy bytes held at once since creation (or :meth:`reset_peak`)."""
        self._flush()
        return self._peak

    @property
    def reserved_bytes(self) -> int:
        """Host bytes of blocks (held or not)."""
        self._flush()
        return self._reserved()

    @property
    def free_bytes(self) -> int:
        """Buddy bytes that can still be held before the capacity is reached."""
        self._flush()
        return self.capacity_bytes - self._held

    def reset_peak(self) -> None:
        with self._locked():
            self._peak = self._held

    def stats(self) -> StoreStats:
        with self._locked():
            return StoreStats(
                buddy_capacity_bytes=self.capacity_bytes,
                buddy_bytes_held=self._held,
                buddy_peak_bytes=self._peak,
                buddy_free_bytes=self.capacity_bytes - self._held,
                buddy_reserved_bytes=self._reserved(),
                buddy_blocks=len(self._blocks),
                pinned=self.pin,
                buddy_pinned_bytes=sum(b.nbytes for b in self._blocks if b.pinned),
            )

    def __repr__(self) -> str:
        return (
            f"BuddyStore(held={self._held:,} B, capacity={self.capacity_bytes:,} B, "
            f"blocks={len(self._blocks)}, pinned={self.pin})"
        )


_default = ProcessDefault(BuddyStore, BuddyStore)


def default_store() -> BuddyStore:
    """The process-wide store used when none is passed (created on first use)."""
    return _default.get()


def set_default_store(value: BuddyStore | None) -> BuddyStore | None:
    """Replace the process-wide store (``None``: a fresh one on next use); returns the previous one."""
    return _default.set(value)
