"""Prefetch in backward: bring compressed activations back before autograd asks for them.

Backward unpacks saved tensors roughly in the reverse of the order forward
packed them. A :class:`Schedule` remembers that order for one step (a
``compressed_activations`` block). When backward unpacks the tensor at
position *i* -- and once when the block closes, for the tensors backward
needs first -- it looks at the next tensors in backward order (*i-1*,
*i-2*, ...) and, within the bounds of a :class:`Prefetch`:

* starts copying their overflow from buddy memory to the device on the
  device's copy stream (:meth:`BuddyTensor.prefetch`), so the host-to-device
  copy overlaps backward's kernels instead of stalling them;
* where ``unpack_bytes`` allows, also decompresses them ahead on the copy
  stream, so autograd finds the tensor ready.

A wrong guess costs time, never correctness: a tensor unpacked out of
order decompresses as if nothing had been prefetched; work done ahead for a
tensor that backward then skips is dropped once backward has moved more than
``tensors`` positions past it (or with the tensor); a second backward
(``retain_graph=True``) prefetches again. On the host (CPU tensors) there is
nothing to overlap and prefetching does nothing.

The schedule refers to the step's tensors weakly and to nothing of the
session's, so it never keeps the graph or its buddy memory alive.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from . import streams

__all__ = ["Prefetch", "Schedule", "PrefetchStats"]

MiB = 1 << 20


@dataclass(frozen=True)
class Prefetch:
    """How far backward looks ahead (see :mod:`buddy.prefetch`).

    Args:
        tensors: how many tensors ahead of the one being unpacked to prepare.
        overflow_bytes: at most this many overflow bytes brought back to the
            device ahead of use at any time.
        unpack_bytes: at most this many bytes of tensors decompressed ahead
            of use at any time (device memory backward would need a moment
            later anyway); 0 brings back overflow only.
    """

    tensors: int = 2
    overflow_bytes: int = 256 * MiB
    unpack_bytes: int = 0

    def __post_init__(self):
        for name in ("tensors", "overflow_bytes", "unpack_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Prefetch.{name} must be a non-negative int, got {value!r}")


#: no look-ahead at all
OFF = Prefetch(tensors=0, overflow_bytes=0, unpack_bytes=0)


def as_prefetch(value) -> Prefetch:
    """``True``/``None`` -> the defaults, ``False`` -> off, a :class:`Prefetch` as it is."""
    if value is None or value is True:
        return Prefetch()
    if value is False:
        return OFF
    if isinstance(value, Prefetch):
        return value
    raise TypeError(f"prefetch must be a buddy.Prefetch, True or False, got {value!r}")


@dataclass
class PrefetchStats:
    """What a step's look-ahead did (tensors, bytes)."""

    prefetched: int = 0  # overflows brought back to the device ahead of use
    prefetched_bytes: int = 0
    unpacked_ahead: int = 0  # tensors decompressed ahead of use
    ready: int = 0  # unpacks that found work done ahead (the overflow on the device or the tensor itself)
    dropped: int = 0  # work done ahead for tensors backward did not ask for in time


class Ahead:
    """A tensor decompressed ahead of use on ``stream`` (its copy stream), ready once ``event`` has completed."""

    __slots__ = ("tensor", "event", "ops", "flag", "__weakref__")

    def __init__(self, tensor: torch.Tensor, event, ops: streams.StreamOps, flag: torch.Tensor | None = None):
        self.tensor = tensor
        self.event = event
        self.ops = ops
        self.flag = flag  # the decompression's error bits (on the device), read by whoever takes it

    def take(self, stream) -> torch.Tensor:
        """Hand the tensor to ``stream``: it waits for the decompression, and the tensor's memory for it."""
        self.ops.wait(stream, self.event)  # decompressed on the copy stream: done before stream reads it
        self.ops.keep_for(self.tensor, stream)  # allocated on the copy stream, used on stream from now on
        if self.flag is not None:
            self.ops.keep_for(self.flag, stream)
        return self.tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class Schedule:
    """One step's pack order and backward's look-ahead over it.

    Entries are the session's ``_Compressed`` objects: they have ``bt`` (a
    :class:`~buddy.BuddyTensor`), ``ahead`` (an :class:`Ahead` or ``None``)
    and ``cached()`` (the tensor last handed to autograd, if alive).
    """

    def __init__(self, config: Prefetch):
        self.config = config
        self.stats = PrefetchStats()
        self._entries: list[weakref.ref] = []
        self._holding: dict[int, weakref.ref] = {}  # positions with work done ahead and not yet used
        self._lock = threading.Lock()

    def add(self, entry) -> int:
        """Append ``entry`` (packed just now); returns its position."""
        with self._lock:
            self._entries.append(weakref.ref(entry))
            return len(self._entries) - 1

    def __len__(self) -> int:
        return len(self._entries)

    def begin_backward(self) -> None:
        """The block closed: prepare the tensors backward will unpack first."""
        self.advance(len(self._entries))

    def advance(self, position: int) -> None:
        """Backward is unpacking the tensor at ``position``: prepare the next ones within the bounds."""
        if not self.config.tensors:
            return
        with self._lock:
            self._drop_stale(position)
            overflow, unpacked = self._in_flight()
            for j in range(position - 1, max(position - 1 - self.config.tensors, -1), -1):
                entry = self._entries[j]()
                if entry is None or entry.bt.freed or entry.cached() is not None:
                    continue
                overflow, unpacked = self._prepare(j, entry, overflow, unpacked)

    def used(self, position: int, ready: bool) -> None:
        """The tensor at ``position`` was unpacked; ``ready``: with work done ahead."""
        with self._lock:
            self._holding.pop(position, None)
            self.stats.ready += ready

    # ---- under the lock -----------------------------------------------------------
    def _prepare(self, j: int, entry, overflow: int, unpacked: int) -> tuple[int, int]:
        bt, cfg = entry.bt, self.config
        if entry.ahead is None and cfg.unpack_bytes and unpacked + bt.original_bytes <= cfg.unpack_bytes:
            had_overflow = bt.prefetched
            entry.unpack_ahead()
            if entry.ahead is not None:
                self.stats.unpacked_ahead += 1
                self._holding[j] = self._entries[j]
                overflow -= bt.buddy_bytes if had_overflow else 0  # the device copy was consumed
                return overflow, unpacked + entry.ahead.nbytes
        if entry.ahead is None and not bt.prefetched and overflow + bt.buddy_bytes <= cfg.overflow_bytes:
            moved = bt.prefetch()
            if moved:
                self.stats.prefetched += 1
                self.stats.prefetched_bytes += moved
                self._holding[j] = self._entries[j]
                overflow += moved
        return overflow, unpacked

    def _in_flight(self) -> tuple[int, int]:
        """Overflow bytes on the device ahead of use, and bytes of tensors decompressed ahead."""
        overflow = unpacked = 0
        for j, ref in list(self._holding.items()):
            entry = ref()
            if entry is None or entry.bt.freed:
                del self._holding[j]
            elif entry.ahead is not None:
                unpacked += entry.ahead.nbytes
            elif entry.bt.prefetched:
                overflow += entry.bt.buddy_bytes
            else:
                del self._holding[j]
        return overflow, unpacked

    def _drop_stale(self, position: int) -> None:
        """Backward went more than ``tensors`` past these without asking for them: give their memory back."""
        for j in [j for j in self._holding if j > position + self.config.tensors]:
            entry = self._holding.pop(j)()
            if entry is not None and not entry.bt.freed:
                entry.drop_ahead()
                self.stats.dropped += 1
