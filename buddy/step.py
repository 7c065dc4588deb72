"""What a training step keeps on the device for the host to read once: counters a tensor gets a slice of.

A step that reads nothing back per tensor (:mod:`buddy.autograd`, ``strict=False``) still needs, from the device,
every compressed tensor's entry-size histogram (its overflow's size, the tracker's learning, the stats) and every
decompressed tensor's error bits. Each tensor is given a slice of a buffer made once for the step, and the host
reads a buffer whole where the step ends: one read where forward ends, one where backward ends.

:class:`Counters` hands out the slices, zeroed, on any device; :meth:`Counters.read` brings what was handed out to
the host in one read per device (:func:`buddy.engines.to_host`, which counts it).
"""

from __future__ import annotations

import threading

import torch

from . import engines

__all__ = ["Counters"]


class Counters:
    """Zeroed ``dtype`` slices of buffers made a chunk at a time, per device, read back together.

    ``chunk``: the elements a buffer starts with; a step that needs more makes a larger one (at least the last
    step's total), so a steady step makes one buffer and reads it once. Every slice starts 16-byte aligned (the
    kernels' arguments are).
    """

    def __init__(self, dtype: torch.dtype, chunk: int):
        if chunk < 1:
            raise ValueError(f"chunk must be at least one element, got {chunk}")
        self.dtype = dtype
        self._align = max(1, _ALIGN_BYTES // dtype.itemsize)
        self._chunk = chunk
        self._lock = threading.Lock()
        self._buffers: dict[torch.device, list[torch.Tensor]] = {}
        self._used: dict[torch.device, int] = {}  # elements of the device's last buffer handed out (padded)
        self._taken: dict[torch.device, list[tuple[int, int, int]]] = {}  # per slice: (buffer, start, elements)

    def taken(self, device: torch.device) -> int:
        """Slices handed out on ``device`` this step: the place in :meth:`read`'s list of the next one taken."""
        with self._lock:
            return len(self._taken.get(device, ()))

    def take(self, n: int, device: torch.device) -> torch.Tensor:
        """``n`` zero elements on ``device``, a slice of the step's buffer (no allocation but a buffer's)."""
        padded = -(-n // self._align) * self._align
        with self._lock:
            buffers = self._buffers.setdefault(device, [])
            used = self._used.get(device, 0)
            if not buffers or used + padded > buffers[-1].numel():
                size = max(self._chunk, padded, sum(b.numel() for b in buffers))
                buffers.append(torch.zeros(size, dtype=self.dtype, device=device))
                used = 0
            self._used[device] = used + padded
            self._taken.setdefault(device, []).append((len(buffers) - 1, used, n))
            return buffers[-1][used : used + n]

    def read(self, device: torch.device) -> list[list[int]]:
        """Every slice handed out on ``device``, in order, on the host: one read."""
        with self._lock:
            buffers = self._buffers.get(device, [])
            taken = list(self._taken.get(device, []))
            used = self._used.get(device, 0)
        if not buffers:
            return []
        parts = buffers[:-1] + [buffers[-1][:used]]
        values = engines.to_host(parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
        starts = [0]
        for part in parts[:-1]:
            starts.append(starts[-1] + part.numel())
        return [values[starts[b] + at : starts[b] + at + n] for b, at, n in taken]

    @property
    def devices(self) -> list[torch.device]:
        with self._lock:
            return list(self._buffers)

    def next_step(self) -> None:
        """Start over for the next step: its first buffer holds what this step used (it never holds a slice
        handed out before: the old buffers live on with whoever holds them)."""
        with self._lock:
            used = max((sum(b.numel() for b in bs[:-1]) + self._used[d] for d, bs in self._buffers.items()), default=0)
            self._chunk = max(self._chunk, used)
            self._buffers, self._used, self._taken = {}, {}, {}


#: where a slice starts (bytes): the kernels load their arguments 16 bytes at a time
_ALIGN_BYTES = 16
