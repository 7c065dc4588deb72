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
    spill = _spill(histogram, make=False)  # (a histogram asked once, a tensor's measured one, is summed as it is)
    if spill is not None:
        found = spill.overflow.get(slot_sectors)
        if found is None:
            found = spill.overflow[slot_sectors] = _overflow_sectors(histogram, slot_sectors)
        return found
    return _overflow_sectors(histogram, slot_sectors)


def _overflow_sectors(histogram: Sequence[float], slot_sectors: int) -> float:
    first = max(slot_sectors + 1, 0)  # the bins past the slot, summed in order as before (the same bits)
    past = histogram[first:]  # (map and operator.mul: the generator's products and sum, without its frames)
    return sum(map(operator.mul, range(first - slot_sectors, first - slot_sectors + len(past)), past))


def larger_than(histogram: Sequence[float]) -> list[float]:
    """``out[s]``: the entries larger than ``s`` sectors, each spilling one more sector when the slot goes to ``s``."""
    spill = _spill(histogram)
    if spill is not None:
        return list(spill.larger)
    return _Spill(histogram).larger


def slot_for_overflow(histogram: Sequence[float], max_overflow: float, budget_bytes: float) -> int:
    """The smallest slot whose overflow is at most ``max_overflow * budget_bytes``.

    ``budget_bytes`` is the tensor's size in bytes. The full slot (``E/32``)
    always qualifies, so this never fails. A sector less spills one more
    sector of every entry larger than the new slot: the overflow at each
    slot is summed down from the full slot, once per histogram
    (:class:`_Spill`), and the slot found by bisection.
    """
    limit = check_max_overflow(max_overflow) * budget_bytes
    spill = _spill(histogram) or _Spill(histogram)
    at = spill.spilled  # at[s - 1]: the overflow at slot s - 1, non-increasing in s where no bin is negative
    if not spill.monotone:  # the largest s with at[s - 1] * 32 > limit, scanned down from the full slot
        return next((s for s in range(len(histogram) - 1, 0, -1) if at[s - 1] * spec.SECTOR_BYTES > limit), 0)
    lo, hi = 0, len(histogram) - 1  # the answer: the largest s in [1, hi] with at[s - 1] * 32 > limit, else 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if at[mid - 1] * spec.SECTOR_BYTES > limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def tightest_slot(histogram: Sequence[float]) -> int:
    """The smallest slot with no overflow at all (the largest ``k`` present)."""
    spill = _spill(histogram)
    if spill is not None:
        return spill.tightest
    return max((k for k, n in enumerate(histogram) if n), default=0)


class _Spill:
    """A histogram's overflow at every slot, made in one pass down from the full slot.

    ``larger[s]``: the entries larger than ``s`` sectors; ``spilled[s]``: the sectors spilled with a slot of ``s``.
    Both are running sums in the one order a pass down from the full slot adds them (a sector less spills one more
    sector of every entry larger than the new slot), the same floats whatever asks. ``monotone``: no bin is
    negative, so ``spilled`` is non-increasing in ``s`` (the sums only grow), which the bisection of
    :func:`slot_for_overflow` needs; it holds for any histogram of counts and any prediction from them.
    ``overflow``: :func:`overflow_sectors`'s results by slot.
    """

    __slots__ = ("larger", "spilled", "tightest", "monotone", "overflow")

    def __init__(self, histogram: Sequence[float]):
        n = len(histogram)
        larger, spilled = [0.0] * n, [0.0] * n
        running, total, tightest = 0.0, 0.0, 0
        for s in range(n - 1, 0, -1):
            larger[s] = running
            count = histogram[s]
            if count and not tightest:
                tightest = s
            running += count
            total += running  # (the loop's ``spilled + larger``: the same addition)
            spilled[s - 1] = total
        if n:
            larger[0] = running
        self.larger, self.spilled, self.tightest = larger, spilled, tightest
        self.monotone = not histogram or min(histogram) >= 0
        self.overflow: dict[int, float] = {}


#: id -> (histogram, its _Spill) of the tuples seen last (a predicted histogram is asked again and again in a step:
#: by the plan, by each tensor's slot and its overflow); cleared when full
_SPILLS: dict[int, tuple[tuple, _Spill]] = {}
_SPILLS_HELD = 2048


def _spill(histogram: Sequence[float], *, make: bool = True) -> _Spill | None:
    """``histogram``'s :class:`_Spill`, made once per tuple (immutable: its id names it while the cache holds it);
    ``None`` for another sequence (it may change between calls), and with ``make=False`` for one not made yet."""
    if type(histogram) is not tuple:
        return None
    hit = _SPILLS.get(id(histogram))
    if hit is not None and hit[0] is histogram:
        return hit[1]
    if not make:
        return None
    if len(_SPILLS) >= _SPILLS_HELD:
        _SPILLS.clear()
    made = _Spill(histogram)
    _SPILLS[id(histogram)] = (histogram, made)
    return made
