"""A lock whose updates never wait: the store's and the ledger's shared discipline.

Releases and accounting changes come from finalizers, which the garbage
collector runs at any allocation -- in another thread, or in this one in the
middle of a locked section. Waiting for the lock there could deadlock (the
same thread, or a thread that holds it and waits for one the finalizer's
thread holds), and applying the change at once could corrupt what the locked
section is in the middle of (a free list being walked, an integer being
read-modified-written). So an update is queued (``deque.append`` is atomic)
and applied at once when the lock is free, else by the thread holding it
before it lets go. When no locked section is in progress, every update has
been applied.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["DeferredLock"]


class DeferredLock:
    """A ``threading.Lock`` plus a queue of updates applied under it by ``apply(item)``."""

    def __init__(self, apply: Callable[[Any], None]):
        self._apply = apply
        self._lock = threading.Lock()  # never taken twice by one thread
        self._inbox: collections.deque = collections.deque()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the lock, with every queued update applied first (and any queued meanwhile applied after)."""
        self._lock.acquire()
        try:
            self._drain()
            yield
        finally:
            self._unlock()

    def submit(self, item: object) -> None:
        """Queue ``item`` and apply it now unless the lock is taken (then its holder does); never waits."""
        self._inbox.append(item)
        self.flush()

    def flush(self) -> None:
        """Apply what is queued unless the lock is taken; never waits."""
        if self._lock.acquire(blocking=False):
            self._unlock()

    def _drain(self) -> None:
        while self._inbox:
            self._apply(self._inbox.popleft())

    def _unlock(self) -> None:
        """Apply what was queued while the lock was held, then let it go."""
        while True:
            try:
                self._drain()
            finally:
                self._lock.release()
            # Something queued after the last look found the lock taken: apply it too.
            if not self._inbox or not self._lock.acquire(blocking=False):
                return
