"""Policies that compress only where it pays: a memory target, or a time budget.

Compressing every saved tensor costs kernel time on every tensor, while the
memory it buys counts only where the step peaks: a tensor saved after the
peak, or used before it, frees nothing there. These policies choose which
tensors to compress from the step before (its :class:`~buddy.peak.StepProfile`,
which the session records on its tracker) and the modeled cost of each
(:mod:`buddy.cost`), with :func:`buddy.peak.plan`; what they compress gets
:class:`~buddy.OverflowBudget`'s slots and keeps its overflow bound. The
tensors they leave are kept as they are (``session.stats()`` lists them with
the reason).

* :class:`MemoryTarget` -- the fewest modeled seconds that bring the step's
  peak to a target: a number of bytes, or a fraction of the peak the saved
  tensors would make uncompressed.
* :class:`TimeBudget` -- the lowest peak within a time budget: seconds a
  step, or a fraction of the step's time without buddy.

A step with no step before it (the first, or a new model) compresses every
tensor: the tracker learns how each compresses, the profile where the step
peaks. A tensor whose compressed size is not yet known is compressed too.
Create the policy once and pass it to every step (or give it to the
:class:`~buddy.Tracker`): it plans each step from the one before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import cost
from .peak import Plan, StepProfile, plan
from .slots import DEFAULT_MAX_OVERFLOW
from .stats import format_bytes
from .tracker import OverflowBudget, Tracker

__all__ = ["MemoryTarget", "TimeBudget"]

RatesOf = Callable[[torch.device, str, torch.dtype], cost.Rates]

#: :class:`TimeBudget`: the weight of a step's own estimate of a plain step's time in the running one
PLAIN_DECAY = 0.5


class _Selective(OverflowBudget):
    """An :class:`OverflowBudget` over the tensors :meth:`_limits` and :func:`buddy.peak.plan` choose."""

    def __init__(self, max_overflow: float, rates: RatesOf | None):
        super().__init__(max_overflow)
        if rates is not None and not callable(rates):
            raise TypeError(f"rates must be a function (device, codec, dtype) -> buddy.cost.Rates, got {rates!r}")
        self._rates: RatesOf = rates if rates is not None else cost.rates
        self._left: dict[str, str] = {}
        self.last_plan: Plan | None = None  # what the step now open was planned with (None: no step before it)

    def begin_step(self, tracker: Tracker) -> None:
        super().begin_step(tracker)
        self._left, self.last_plan = {}, None
        profile = tracker.last_profile
        if profile is None or not profile.saved:
            return
        seconds = self._modeled(profile)
        limits = self._limits(profile)
        if limits is None:
            return
        self.last_plan = chosen = plan(profile, seconds, **limits)
        self._left = {
            profile.saved[i].key: why for i, why in chosen.left.items() if profile.saved[i].device_bytes is not None
        }

    def _modeled(self, profile: StepProfile) -> list[float]:
        """Per tensor of ``profile``, the modeled seconds its compression costs: its kernels' (the rates'), and the
        host's work a tensor as the step before measured it -- the session's time in its hooks over the tensors it
        compressed, less their kernels' time where the device runs them inside the hooks (not CUDA's)."""
        rates = [self._rates(s.device, s.codec, s.dtype) for s in profile.saved]
        kernels = [r.seconds(s.original_bytes) - r.host for r, s in zip(rates, profile.saved, strict=True)]
        done = [i for i, s in enumerate(profile.saved) if s.compressed]
        if not done:  # nothing measured: the calibration's host cost
            return [k + r.host for k, r in zip(kernels, rates, strict=True)]
        inside = sum(kernels[i] for i in done if profile.saved[i].device.type != "cuda")
        host = max(0.0, profile.measured_seconds - inside) / len(done)
        return [k + host for k in kernels]

    def leaves(self, key: str) -> str | None:
        return self._left.get(key)

    def _limits(self, profile: StepProfile) -> dict | None:
        """:func:`buddy.peak.plan`'s ``target``, ``budget`` and ``with_base`` for the step after ``profile``;
        ``None``: compress every tensor."""
        raise NotImplementedError

    def describe(self) -> str | None:
        p = self.last_plan
        if p is None:
            return None
        return (
            f"{type(self).__name__}: planned {len(p.compress)} tensor(s) compressed, {len(self._left)} left; "
            f"modeled peak {format_bytes(p.peak_plain)} uncompressed, {format_bytes(p.peak)} with the plan; "
            f"modeled cost {p.seconds * 1e3:.1f} ms{self._limit_text()}"
        )

    def _limit_text(self) -> str:
        return ""


class MemoryTarget(_Selective):
    """Compress the tensors that bring the step's peak to a target at the least modeled time.

    Exactly one of ``nbytes`` (the step's peak: on a CUDA device what the
    allocator holds, as ``torch.cuda.max_memory_allocated`` counts it, sampled
    at the step's saves and uses; elsewhere the saved tensors' bytes) and
    ``fraction`` (of the peak the saved tensors would make uncompressed, in
    ``(0, 1]``). Where the target cannot be met, every tensor that lowers the
    peak is compressed. ``max_overflow``: the compressed tensors' overflow
    bound, as :class:`~buddy.OverflowBudget`'s. ``rates``: the cost model
    (default :func:`buddy.cost.rates`, measured at first use).
    """

    def __init__(
        self,
        nbytes: int | None = None,
        *,
        fraction: float | None = None,
        max_overflow: float = DEFAULT_MAX_OVERFLOW,
        rates: RatesOf | None = None,
    ):
        if (nbytes is None) == (fraction is None):
            raise ValueError("give MemoryTarget exactly one of nbytes (bytes) and fraction (of the uncompressed peak)")
        if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
            raise ValueError(f"MemoryTarget's nbytes is a number of bytes, got {nbytes!r}")
        if fraction is not None and not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
            raise ValueError(f"MemoryTarget's fraction is in (0, 1], got {fraction!r}")
        super().__init__(max_overflow, rates)
        self.nbytes, self.fraction = nbytes, fraction

    def _limits(self, profile: StepProfile) -> dict:
        # the originals an overlapping session's stash may hold at the peak count against the target
        if self.nbytes is not None:
            return {"target": float(self.nbytes - profile.stash_bytes), "with_base": True}
        held = profile.held(set())
        want = float(self.fraction or 0.0) * float(held.max() if held.size else 0.0)
        return {"target": want - profile.stash_bytes, "with_base": False}

    def _limit_text(self) -> str:
        want = format_bytes(self.nbytes) if self.nbytes is not None else f"{self.fraction:.0%} of the uncompressed"
        return f"; target {want}"

    def __repr__(self) -> str:
        what = f"{self.nbytes}" if self.nbytes is not None else f"fraction={self.fraction}"
        return f"MemoryTarget({what}, max_overflow={self.max_overflow})"


class TimeBudget(_Selective):
    """Compress the tensors that lower the step's peak the most within a time budget.

    Exactly one of ``fraction`` (of the step's time without buddy: the step
    before's period, less the time its hooks took) and ``seconds`` (a step).
    The time is modeled (:mod:`buddy.cost`); ``session.stats()`` shows it
    beside the time measured. ``max_overflow``, ``rates``: as
    :class:`MemoryTarget`'s.
    """

    def __init__(
        self,
        fraction: float | None = None,
        *,
        seconds: float | None = None,
        max_overflow: float = DEFAULT_MAX_OVERFLOW,
        rates: RatesOf | None = None,
    ):
        if (fraction is None) == (seconds is None):
            raise ValueError("give TimeBudget exactly one of fraction (of a step without buddy) and seconds")
        for name, value in (("fraction", fraction), ("seconds", seconds)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"TimeBudget's {name} is zero or more, got {value!r}")
        super().__init__(max_overflow, rates)
        self.fraction, self.budget_seconds = fraction, seconds
        self._budget: float | None = None
        self._plain: float | None = None  # a plain step's seconds, as estimated over the steps so far

    def _limits(self, profile: StepProfile) -> dict | None:
        if self.budget_seconds is not None:
            self._budget = float(self.budget_seconds)
        elif profile.period is None or self.fraction is None:
            return None
        else:  # a plain step's time, estimated each step and smoothed: one noisy step does not move the plan
            plain = max(0.0, profile.period - profile.measured_seconds)
            self._plain = plain if self._plain is None else (1 - PLAIN_DECAY) * self._plain + PLAIN_DECAY * plain
            self._budget = self.fraction * self._plain
        return {"budget": self._budget, "with_base": True}

    def _limit_text(self) -> str:
        return "" if self._budget is None else f"; budget {self._budget * 1e3:.1f} ms"

    def __repr__(self) -> str:
        what = f"seconds={self.budget_seconds}" if self.budget_seconds is not None else f"{self.fraction}"
        return f"TimeBudget({what}, max_overflow={self.max_overflow})"
