"""Choosing a tensor's slot size from its entry-size histogram.

A histogram ``h`` has ``E/32 + 1`` bins: ``h[j]`` entries compress to ``j``
sectors. It is all the slot choice needs, whether it comes from this tensor's
size pass or from the tracker's history of the same key.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import spec

__all__ = ["DEFAULT_MAX_OVERFLOW", "overflow_sectors", "slot_for_overflow", "tightest_slot"]

#: default bound on buddy bytes / tensor bytes when no target ratio is given
DEFAULT_MAX_OVERFLOW = 0.10


def overflow_sectors(histogram: Sequence[int], slot_sectors: int) -> int:
    """Sectors that go to buddy memory with a slot of ``slot_sectors``."""
    return sum((k - slot_sectors) * int(n) for k, n in enumerate(histogram) if k > slot_sectors)


def slot_for_overflow(histogram: Sequence[int], max_overflow: float, budget_bytes: int) -> int:
    """The smallest slot whose overflow is at most ``max_overflow * budget_bytes``.

    ``budget_bytes`` is the tensor's size in bytes. The full slot (``E/32``)
    always qualifies, so this never fails.
    """
    if not 0.0 <= max_overflow <= 1.0:
        raise ValueError(f"max_overflow must be a fraction in [0, 1], got {max_overflow}")
    limit = max_overflow * budget_bytes
    for s in range(len(histogram)):
        if overflow_sectors(histogram, s) * spec.SECTOR_BYTES <= limit:
            return s
    return len(histogram) - 1


def tightest_slot(histogram: Sequence[int]) -> int:
    """The smallest slot with no overflow at all (the largest ``k`` present)."""
    return max((k for k, n in enumerate(histogram) if n), default=0)
