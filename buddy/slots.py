"""Choosing a tensor's slot size from its entry-size histogram.

A histogram ``h`` has ``E/32 + 1`` bins: ``h[j]`` entries compress to ``j``
sectors. It is all the slot choice needs, whether it comes from this tensor's
size pass or from the tracker's history of the same key.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import overload

from . import spec

__all__ = [
    "DEFAULT_MAX_OVERFLOW",
    "check_max_overflow",
    "larger_than",
    "overflow_sectors",
    "slot_for_overflow",
    "tightest_slot",
]

#: default bound on buddy bytes / tensor bytes when no target ratio is given
DEFAULT_MAX_OVERFLOW = 0.10


def check_max_overflow(max_overflow: float) -> float:
    """Validate a bound on buddy bytes / tensor bytes: a real number in ``[0, 1]``, returned as a float.

    ``TypeError`` for anything that is not an int or float (``bool`` and
    strings included), ``ValueError`` for NaN and values outside ``[0, 1]``.
    """
    if isinstance(max_overflow, bool) or not isinstance(max_overflow, (int, float)):
        raise TypeError(
            f"max_overflow must be a number in [0, 1] (a fraction of the tensor's bytes), got {max_overflow!r}"
        )
    if not 0.0 <= max_overflow <= 1.0:  # NaN fails the comparison too
        raise ValueError(
            f"max_overflow must be a fraction in [0, 1] of the tensor's bytes (0.1 = at most 10 % of it in "
            f"buddy memory), got {max_overflow}"
        )
    return float(max_overflow)


@overload
def overflow_sectors(histogram: Sequence[int], slot_sectors: int) -> int: ...


@overload
def overflow_sectors(histogram: Sequence[float], slot_sectors: int) -> float: ...


def overflow_sectors(histogram: Sequence[float], slot_sectors: int) -> float:
    """Sectors that go to buddy memory with a slot of ``slot_sectors`` (a float for a predicted, float histogram)."""
    first = max(slot_sectors + 1, 0)  # the bins past the slot, summed in order as before (the same bits)
    past = histogram[first:]  # (map and operator.mul: the generator's products and sum, without its frames)
    return sum(map(operator.mul, range(first - slot_sectors, first - slot_sectors + len(past)), past))


def larger_than(histogram: Sequence[float]) -> list[float]:
    """``out[s]``: the entries larger than ``s`` sectors, each spilling one more sector when the slot goes to ``s``."""
    out, running = [0.0] * len(histogram), 0.0
    for s in range(len(histogram) - 1, -1, -1):
        out[s] = running
        running += histogram[s]
    return out


def slot_for_overflow(histogram: Sequence[float], max_overflow: float, budget_bytes: float) -> int:
    """The smallest slot whose overflow is at most ``max_overflow * budget_bytes``.

    ``budget_bytes`` is the tensor's size in bytes. The full slot (``E/32``)
    always qualifies, so this never fails. One pass down from the full slot:
    a sector less spills one more sector of every entry larger than the new
    slot.
    """
    limit = check_max_overflow(max_overflow) * budget_bytes
    spilled, larger = 0.0, 0.0
    for s in range(len(histogram) - 1, 0, -1):
        larger += histogram[s]  # entries of at least s sectors: each spills one more at slot s - 1
        if (spilled + larger) * spec.SECTOR_BYTES > limit:
            return s
        spilled += larger
    return 0


def tightest_slot(histogram: Sequence[float]) -> int:
    """The smallest slot with no overflow at all (the largest ``k`` present)."""
    return max((k for k, n in enumerate(histogram) if n), default=0)
