"""An overflow ring: packs ahead write their overflow on the device, and the copy stream drains it to buddy memory.

Without a ring (the default), the pack kernel of a tensor packed ahead
(:func:`buddy.pipeline.pack_ahead`) writes its overflow straight into its
range of buddy memory: on a GPU, pinned host memory mapped into the device's
address space, so each of the kernel's overflow stores crosses the bus as it
runs, on forward's stream. With a ring (``compressed_activations(
overflow_ring=nbytes)``) the pack writes it into a region of a buffer on the
device instead, and a drain kernel on the copy stream copies it from there
to the same range of buddy memory while forward's next kernels run: forward's
stream never waits on the bus, at the cost of the ring's device bytes and one
more launch a tensor. Which is faster is a question for a GPU (the runbook
measures both); the bytes are the same either way.

Nothing is read back. The host knows each tensor's worst case (every entry
raw, ``original - slots``) but not its overflow, so a region is as large as
the worst case, and the drain kernel reads the overflow's size on the device
(``ends[-1]`` less the sectors the step's reserve took). Regions are handed
out in order around the ring; one that would overlap regions still being
drained makes the stream that packs next wait, on the device, for the last
of their drains (drains run in order on one copy stream, so that one ends
after every earlier one). A tensor whose worst case is larger than the ring
is packed as without one.

Each drain is recorded as the write of its range of buddy memory
(:meth:`buddy.store.BuddyAllocation.written_by`): its readers -- backward's
decompression, the look-ahead's copy back -- wait for it, and the store
reuses the range only after it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from . import spec, streams
from .ledger import DeviceLedger

__all__ = ["OverflowRing", "Region", "check_ring_bytes"]


def check_ring_bytes(nbytes) -> int:
    """``nbytes`` as an overflow ring's size: a whole number of bytes, 0 (no ring) or at least one sector.
    ``TypeError`` or ``ValueError`` otherwise."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"overflow_ring is a number of bytes (0: none), got {nbytes!r}")
    if nbytes < 0 or 0 < nbytes < spec.SECTOR_BYTES:
        raise ValueError(f"overflow_ring is 0 (none) or at least {spec.SECTOR_BYTES} bytes, got {nbytes}")
    return nbytes


@dataclass
class Region:
    """A region of a ring, ``[start, end)`` bytes of its buffer (``data``): written by one pack, read by its
    drain, whose event (``drained``: ``None`` until it is issued, or where already complete) frees it."""

    start: int
    end: int
    data: torch.Tensor
    drained: object = None


class OverflowRing:
    """``nbytes`` (whole sectors) on ``device`` that packs ahead stage their overflow in and the copy stream drains.

    :meth:`stage` hands out a region for a pack, :meth:`drain` issues its copy to buddy memory. The buffer is made
    at the first region and held on ``ledger`` while the ring lives. Counts: :attr:`drained` (tensors drained),
    :attr:`waits` (regions that waited for earlier drains), :attr:`too_large` (worst cases larger than the ring).
    """

    def __init__(self, device: torch.device, nbytes: int, *, ledger: DeviceLedger | None = None):
        nbytes = check_ring_bytes(nbytes)
        if not nbytes:
            raise ValueError("an overflow ring holds at least one sector")
        self.device = torch.device(device)
        self.nbytes = nbytes - nbytes % spec.SECTOR_BYTES
        self.ops = streams.for_device(self.device)
        self._ledger = ledger
        self._buffer: torch.Tensor | None = None
        self._live: collections.deque[Region] = collections.deque()  # in the order they were handed out
        self._head = 0  # where the next region starts, if it fits before the end
        self.drained = self.waits = self.too_large = 0

    @property
    def buffer(self) -> torch.Tensor:
        """The ring's bytes on its device (made at first use)."""
        if self._buffer is None:
            self._buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            if self._ledger is not None:
                self._ledger.hold(self.nbytes).release_when_collected(self._buffer)
        return self._buffer

    @property
    def held_bytes(self) -> int:
        """Device bytes the ring holds (none before its first region)."""
        return 0 if self._buffer is None else self.nbytes

    def stage(self, nbytes: int) -> Region | None:
        """A region of at least ``nbytes`` for the next pack, on the stream work is issued on now; ``None`` where
        the ring is smaller. Regions still being drained that it overlaps make that stream wait (on the device)
        for the last of their drains."""
        size = -(-nbytes // spec.SECTOR_BYTES) * spec.SECTOR_BYTES
        if size > self.nbytes:
            self.too_large += 1
            return None
        start = self._head if self._head + size <= self.nbytes else 0
        end = start + size
        last = None  # the newest live region it overlaps: its drain ends after every earlier one
        for i, region in enumerate(self._live):
            if region.start < end and start < region.end:
                last = i
        if last is not None:
            waited = self._live[last].drained
            for _ in range(last + 1):
                self._live.popleft()
            if waited is not None:
                self.ops.wait(self.ops.current(self.device), waited)
                self.waits += 1
        region = Region(start, end, self.buffer[start:end])
        self._live.append(region)
        self._head = end
        return region

    def drain(self, region: Region, engine, layout, ends: torch.Tensor, place: torch.Tensor, into) -> None:
        """Copy what the pack just issued on the current stream wrote into ``region`` to ``into`` (a
        :class:`~buddy.store.BuddyAllocation`, reserved at the worst case) on the copy stream, after that pack:
        ``engine.drain`` with the pack's ``ends`` and placement words (``place``). The drain's event frees the
        region and is the range's write."""
        ops, device = self.ops, self.device
        packed = ops.record(ops.current(device))
        copy = ops.copy_stream(device)
        ops.wait(copy, packed)
        for t in (self.buffer, ends, place):  # read on the copy stream: not reused before the drain ends
            ops.keep_for(t, copy)
        with ops.activate(copy):
            engine.drain(layout, region.data, ends, place, into.data)
        region.drained = ops.record(copy)
        into.written_by(ops, region.drained)
        self.drained += 1

    def abandon(self, region: Region) -> None:
        """A region whose pack failed: free once the work issued on the current stream so far has completed."""
        region.drained = self.ops.record(self.ops.current(self.device))

    def __repr__(self) -> str:
        return f"OverflowRing({self.device}, {self.nbytes} bytes, {len(self._live)} region(s) live)"
