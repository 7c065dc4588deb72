"""Overlap: pack on a side stream while forward computes, originals held in a bounded stash until packed.

Without overlap, a session packs each saved tensor on the stream forward
runs on: forward's next kernels queue behind the pack. With
``compressed_activations(overlap=True)`` (or an :class:`Overlap`), on a
device whose work is asynchronous (CUDA):

* the pack runs on the device's pack stream (:meth:`StreamOps.pack_stream
  <buddy.streams.StreamOps.pack_stream>`), after an event that says forward
  has written the tensor; forward's next kernels run beside it;
* the original cannot be freed until its pack has read it, so the session
  holds it in a :class:`Stash` with the pack's event. The stash lets go of
  an original once its event has completed (asked without waiting, at every
  pack), and never holds more than ``stash_bytes``: past that, forward's
  stream waits on the device for the oldest pack (no host wait) and that
  original is released. These bytes count against a memory target
  (:class:`buddy.MemoryTarget` plans the step's peak that much lower);
* where forward ends, forward's stream waits for the last pack (again on
  the device) and the stash is emptied; backward's decompressions wait for
  their tensor's own pack as well, for a backward run inside the block.

Why a device-side wait is enough to release an original: the allocator
hands its memory again only to work on the stream it was allocated on
(forward's), which is then ordered after the pack. Every pack first waits
for an event forward recorded just before, so memory the pack stream
allocated (slots, staging) and the session freed is reused only after the
forward work issued before it, backward's decompressions included.

An original changed in place while its pack may still be reading it (a
change issued before the stash let it go) would be compressed with some of
the new bytes: backward then raises the error PyTorch raises for a saved
tensor changed in place, never returns a mix. On the host (CPU tensors)
nothing is asynchronous: overlap changes nothing there.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import streams

__all__ = ["Overlap", "Stash", "as_overlap"]

MiB = 1 << 20


@dataclass(frozen=True)
class Overlap:
    """Pack on a side stream (see :mod:`buddy.overlap`).

    Args:
        stash_bytes: at most this many bytes of originals held waiting for their packs (at least one tensor's:
            a tensor larger than the bound is held alone until the next pack or forward's end).
    """

    stash_bytes: int = 256 * MiB

    def __post_init__(self):
        value = self.stash_bytes
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"Overlap.stash_bytes must be a non-negative int, got {value!r}")


def as_overlap(value) -> Overlap | None:
    """``True`` -> the defaults, ``False``/``None`` -> off, an :class:`Overlap` as it is."""
    if value is None or value is False:
        return None
    if value is True:
        return Overlap()
    if isinstance(value, Overlap):
        return value
    raise TypeError(f"overlap must be a buddy.Overlap, True or False, got {value!r}")


class _Entry:
    __slots__ = ("tensor", "version", "event", "nbytes", "owner")

    def __init__(self, tensor: torch.Tensor, event, owner):
        self.tensor = tensor
        self.version = tensor._version
        self.event = event
        self.nbytes = tensor.untyped_storage().nbytes()
        self.owner = weakref.ref(owner)  # what autograd keeps for it: told if the tensor changed under its pack


class Stash:
    """The originals of one device's packs in flight, in the order packed, at most ``limit`` bytes.

    ``ops``: the device's stream operations; ``compute``: the stream forward runs on, which waits for a pack
    where the bound or forward's end says so.
    """

    def __init__(self, ops: streams.StreamOps, compute, limit: int):
        self.ops, self.compute, self.limit = ops, compute, limit
        self.entries: deque[_Entry] = deque()
        self.bytes = 0
        self.peak_bytes = 0  # the most it held at once
        self.waits = 0  # packs forward's stream waited for because the stash was full

    @contextlib.contextmanager
    def beside(self, device: torch.device) -> Iterator[None]:
        """Issue the block's work on ``device``'s pack stream, after forward's work so far (which wrote what the
        block reads)."""
        side = self.ops.pack_stream(device)
        written = self.ops.record(self.compute)
        with self.ops.activate(side):
            self.ops.wait(side, written)
            yield

    def add(self, tensor: torch.Tensor, event, owner) -> None:
        """Hold ``tensor`` until ``event`` (its pack) completes; ``owner`` (weakly): what autograd keeps for it,
        whose ``raced`` is set if the tensor is changed in place before it is let go."""
        self._drop_done()
        entry = _Entry(tensor, event, owner)
        self.entries.append(entry)
        self.bytes += entry.nbytes
        while self.bytes > self.limit and len(self.entries) > 1:
            oldest = self.entries[0]
            if not self.ops.done(oldest.event):
                self.ops.wait(self.compute, oldest.event)  # forward's next work waits for it, on the device
                self.waits += 1
            self._pop()
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def drain(self, last_event) -> None:
        """Forward's end: forward's stream waits for ``last_event`` (the pack stream's last work), then every
        original is let go."""
        if self.entries:
            self.ops.wait(self.compute, last_event)
        while self.entries:
            self._pop()

    def _drop_done(self) -> None:
        while self.entries and self.ops.done(self.entries[0].event):
            self._pop()

    def _pop(self) -> None:
        entry = self.entries.popleft()
        self.bytes -= entry.nbytes
        if entry.tensor._version != entry.version:  # changed while its pack could still be reading it
            owner = entry.owner()
            if owner is not None:
                owner.raced = True
