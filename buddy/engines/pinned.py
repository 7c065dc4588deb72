"""Which pinned host buffers the devices cannot reach where they are.

The store pins its blocks and asks CUDA to map them into the devices'
address space; where the runtime refuses the mapping it pins them without
it, and says so here (:func:`unmapped`). The kernels' engine asks before a
kernel reads or writes buddy memory in place (:mod:`buddy.engines.cuda`):
such a buffer is copied instead. A block unpinned is forgotten, so that an
address used again by a mapped block is not taken for it.
"""

from __future__ import annotations

import threading

__all__ = ["unmapped", "forget", "is_unmapped"]

_lock = threading.Lock()
_unmapped: set[int] = set()  # start addresses of buffers pinned without the mapping


def unmapped(address: int) -> None:
    """The buffer that starts at ``address`` is pinned without the mapping: no kernel reaches it in place."""
    with _lock:
        _unmapped.add(address)


def forget(address: int) -> None:
    """The buffer that started at ``address`` is unpinned (nothing if it was mapped)."""
    with _lock:
        _unmapped.discard(address)


def is_unmapped(address: int) -> bool:
    """Whether the buffer that starts at ``address`` is pinned without the mapping."""
    with _lock:
        return address in _unmapped
