"""The ledger of device bytes: what buddy keeps on the device, counted once.

Every compressed tensor holds its slots and metadata on its device, and a
training session may keep a saved tensor as it is (the tracker gave it the
raw slot); both hold device bytes for as long as they live. Each takes a
:class:`Hold` on a :class:`DeviceLedger` when it is made and releases it
when it is freed, so the ledger always knows the device bytes held, their
peak and how many things hold them. :class:`~buddy.DeviceBudget` plans
against it; experiments that simulate training hold bytes on one of their
own.

The process has a default ledger (:func:`default_ledger`); a tracker, and
what is packed through it, use the tracker's ledger (by default the same
one). Host memory (buddy memory) is the store's business, not the ledger's.

Thread-safe; holds may be released from finalizers at any time (see
:mod:`buddy._deferred`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from ._deferred import DeferredLock
from ._process_default import ProcessDefault

__all__ = ["DeviceLedger", "Hold", "LedgerStats", "default_ledger", "set_default_ledger"]

MiB = 1 << 20


@dataclass(frozen=True)
class LedgerStats:
    """A snapshot of a ledger (bytes, except the count)."""

    device_bytes_held: int
    device_peak_bytes: int
    tensors_held: int

    def __str__(self) -> str:
        return (
            f"device: {self.device_bytes_held / MiB:,.2f} MiB held (peak {self.device_peak_bytes / MiB:,.2f} MiB) "
            f"by {self.tensors_held} tensor(s)"
        )


class Hold:
    """``nbytes`` of device memory counted on a ledger until :meth:`release` (which is idempotent)."""

    __slots__ = ("nbytes", "_ledger", "__weakref__")

    def __init__(self, ledger: DeviceLedger, nbytes: int):
        self.nbytes = nbytes
        self._ledger: DeviceLedger | None = ledger

    @property
    def released(self) -> bool:
        return self._ledger is None

    def release(self) -> None:
        """Stop counting these bytes; a second call does nothing."""
        ledger, self._ledger = self._ledger, None
        if ledger is not None:
            ledger._deferred.submit((-self.nbytes, -1))

    def release_when_collected(self, owner: object) -> weakref.finalize:
        """Release when ``owner`` is garbage-collected (or when the returned finalizer is called)."""
        return weakref.finalize(owner, self.release)

    def __repr__(self) -> str:
        return f"Hold({self.nbytes:,} B{', released' if self.released else ''})"


class DeviceLedger:
    """Device bytes held by compressed tensors and by tensors kept as they are."""

    def __init__(self) -> None:
        self._deferred = DeferredLock(self._apply)
        self._held = 0
        self._peak = 0
        self._count = 0

    def hold(self, nbytes: int) -> Hold:
        """Count ``nbytes`` (a non-negative int) as held until the returned hold is released."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"a hold is a non-negative number of bytes, got {nbytes!r}")
        held = Hold(self, nbytes)
        self._deferred.submit((nbytes, 1))
        return held

    def _apply(self, item) -> None:
        nbytes, count = item
        self._held += nbytes
        self._count += count
        self._peak = max(self._peak, self._held)

    @property
    def bytes_held(self) -> int:
        self._deferred.flush()
        return self._held

    @property
    def peak_bytes(self) -> int:
        self._deferred.flush()
        return self._peak

    @property
    def tensors_held(self) -> int:
        self._deferred.flush()
        return self._count

    def reset_peak(self) -> None:
        with self._deferred.locked():
            self._peak = self._held

    def stats(self) -> LedgerStats:
        with self._deferred.locked():
            return LedgerStats(self._held, self._peak, self._count)

    def __repr__(self) -> str:
        return f"DeviceLedger(held={self._held:,} B, peak={self._peak:,} B, tensors={self._count})"


_default = ProcessDefault(DeviceLedger, DeviceLedger)


def default_ledger() -> DeviceLedger:
    """The process-wide ledger (created on first use)."""
    return _default.get()


def set_default_ledger(value: DeviceLedger | None) -> DeviceLedger | None:
    """Replace the process-wide ledger (``None``: a fresh one on next use); returns the previous one."""
    return _default.set(value)
