"""Where a training step's memory peaks, and which saved tensors, compressed, lower that peak the most.

A session records its step as a sequence of **events** (:class:`StepProfile`):
each tensor it takes is *saved* (one event, in forward), forward *ends* (one
event), and each tensor is *used* (one event: its first unpack in backward).
A tensor is held on the device from its save to its use. Compressed, it holds
its device bytes (slots, metadata) instead of its original's strictly between
the two: at its save its original is still alive (the op that saved it holds
it), at its use the decompressed tensor is. So compressing a tensor lowers
the step's memory at the events strictly inside its span, and nowhere else.

The memory at each event is **modeled** from the saved tensors alone: what
the step holds of them (the original of each tensor left as it is, the
device bytes of each compressed one). On a CUDA device the profile also
samples the allocator (``torch.cuda.memory_allocated``, a host-side counter:
no wait for the device) at every event; the difference to the model is the
memory the step holds beside its saved tensors (parameters, optimizer state,
gradients, the forward's live outputs), kept as the **base** of each event.

:func:`plan` picks the tensors to compress: again and again, at the event
where the modeled memory is highest (the latest of equal ones: a peak that
recurs later, where a tensor is used, cannot be lowered by that tensor), the
tensor that frees the most bytes there per modeled second of its compression,
until the memory meets a target, or the time allowed is spent, or nothing
left can lower the peak. A tensor saved at the step's peak (a language
model's loss over the whole vocabulary, saved last and used first) is never
picked: where the step peaks, it is alive in full either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["Saved", "StepProfile", "Plan", "plan"]


@dataclass
class Saved:
    """A tensor a step took: its size, and where it was saved and used among the step's events."""

    key: str
    original_bytes: int
    device_bytes: int | None  # compressed: what it held on the device; left as it is: the last known, or None
    compressed: bool
    dtype: torch.dtype
    device: torch.device
    codec: str
    saved_at: int
    used_at: int | None = None  # its first unpack; None: not (yet) used

    @property
    def saving(self) -> int:
        """Bytes compressing it frees while it is held (0 where its compressed size is unknown)."""
        return 0 if self.device_bytes is None else max(0, self.original_bytes - self.device_bytes)


@dataclass
class StepProfile:
    """One step's saves, uses and memory, as a session records them (see the module doc)."""

    saved: list[Saved] = field(default_factory=list)
    #: per event, the allocator's bytes (CUDA), else None
    memory: list[int | None] = field(default_factory=list)
    forward_end: int | None = None
    #: host seconds the session measured in its hooks (compress and decompress)
    measured_seconds: float = 0.0
    #: seconds from this step's start to the next's (None until the next step starts): the whole step's period
    period: float | None = None
    #: the most bytes of originals the session's stash may hold beside the saved tensors (buddy.overlap; 0: none)
    stash_bytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    _sample: Callable[[], int] | None = None

    @property
    def events(self) -> int:
        return len(self.memory)

    def _event(self, device: torch.device | None = None) -> int:
        if self._sample is None and device is not None and device.type == "cuda":
            self._sample = lambda: torch.cuda.memory_allocated(device)
        self.memory.append(None if self._sample is None else self._sample())
        return len(self.memory) - 1

    def save(self, item: Saved) -> int:
        """Record ``item`` saved now (its ``saved_at`` is set here); returns its index."""
        item.saved_at = self._event(item.device)
        self.saved.append(item)
        return len(self.saved) - 1

    def use(self, index: int) -> None:
        """The tensor at ``index`` is unpacked now (its first unpack counts)."""
        item = self.saved[index]
        if item.used_at is None:
            item.used_at = self._event(item.device)

    def end_forward(self) -> None:
        if self.forward_end is None:
            self.forward_end = self._event()

    def finish(self, now: float | None = None) -> None:
        """The next step starts: this one's period is known."""
        if self.period is None:
            self.period = (time.perf_counter() if now is None else now) - self.started

    def spans(self) -> list[tuple[int, int]]:
        """Per tensor, the events its compressed form is held at: ``range(*span)``."""
        end = self.events
        return [(s.saved_at + 1, end if s.used_at is None else s.used_at) for s in self.saved]

    def held(self, compressed: set[int] | None = None) -> np.ndarray:
        """Modeled bytes of saved tensors held at each event, with the tensors at the indices ``compressed``
        compressed (default: as the step compressed them) and the others as they are."""
        chosen = {i for i, s in enumerate(self.saved) if s.compressed} if compressed is None else compressed
        out = np.zeros(self.events, dtype=np.float64)
        end = self.events
        for i, (s, (lo, hi)) in enumerate(zip(self.saved, self.spans(), strict=True)):
            out[s.saved_at : end if s.used_at is None else s.used_at + 1] += s.original_bytes
            if i in chosen:
                out[lo:hi] -= s.saving
        return out

    def base(self) -> np.ndarray:
        """Per event, what the allocator held beside the saved tensors (0 where it was not sampled)."""
        sampled = np.array([np.nan if m is None else m for m in self.memory], dtype=np.float64)
        if not np.isfinite(sampled).any():
            return np.zeros(self.events, dtype=np.float64)
        base = sampled - self.held()
        return np.nan_to_num(base, nan=float(np.nanmin(base)))


#: :func:`plan`'s preference for what the step compressed (see its ``sticky``)
STICKY = 1.25


@dataclass
class Plan:
    """What :func:`plan` chose: the indices of the tensors to compress, why each other one is left, the modeled
    peak with nothing compressed and with the choice, and the modeled seconds the choice costs."""

    compress: set[int]
    left: dict[int, str]
    peak_plain: float
    peak: float
    seconds: float


def plan(
    profile: StepProfile,
    seconds: list[float],
    *,
    target: float | None = None,
    budget: float | None = None,
    with_base: bool = True,
    sticky: float = STICKY,
) -> Plan:
    """Choose the tensors of ``profile`` to compress (see the module doc).

    ``seconds``: per tensor, the modeled seconds its compression costs. ``target``: stop once the modeled peak is
    at most this many bytes; ``budget``: spend at most this many modeled seconds; either, both or neither (then:
    every tensor that lowers the peak). ``with_base``: the memory is the saved tensors' and the base's (bytes the
    allocator counts, on CUDA); else the saved tensors' alone. ``sticky``: a tensor the step compressed counts its
    bytes freed a second this many times over (1: no preference): a choice that holds from step to step keeps
    its key's plan (a key newly compressed has none, and is sized first: a read), where a plan moved by the
    noise of a step's measured time would not.
    """
    if len(seconds) != len(profile.saved):
        raise ValueError(f"seconds has {len(seconds)} values for {len(profile.saved)} tensors")
    memory = profile.held(set()) + (profile.base() if with_base else 0.0)
    spans = profile.spans()
    savings = [s.saving for s in profile.saved]
    # bytes freed a second, what the step compressed favoured (``sticky``)
    score = [(sticky if s.compressed else 1.0) * s.saving / max(t, 1e-12) for s, t in zip(profile.saved, seconds)]
    peak_plain = float(memory.max()) if memory.size else 0.0
    chosen: set[int] = set()
    spent, stop = 0.0, "peak"
    while memory.size:
        top = float(memory.max())
        at = int(np.flatnonzero(memory == top)[-1])
        if target is not None and top <= target:
            stop = "target"
            break
        held_there = [i for i, (lo, hi) in enumerate(spans) if lo <= at < hi and i not in chosen and savings[i] > 0]
        affordable = [i for i in held_there if budget is None or spent + seconds[i] <= budget]
        if not affordable:
            stop = "budget" if held_there else "peak"
            break
        best = max(affordable, key=lambda i: (score[i], savings[i]))
        lo, hi = spans[best]
        memory[lo:hi] -= savings[best]
        chosen.add(best)
        spent += seconds[best]
    at = int(np.flatnonzero(memory == memory.max())[-1]) if memory.size else 0
    peak = float(memory.max()) if memory.size else 0.0
    return Plan(chosen, _reasons(profile, spans, chosen, at, stop), peak_plain, peak, spent)


def _reasons(profile: StepProfile, spans: list[tuple[int, int]], chosen: set[int], at: int, stop: str) -> dict:
    """Why each tensor not ``chosen`` is left, the plan's peak at the event ``at``, its loop ended by ``stop``."""
    left = {}
    for i, s in enumerate(profile.saved):
        if i in chosen:
            continue
        lo, hi = spans[i]
        if s.device_bytes is None:
            left[i] = "its compressed size is unknown"
        elif not s.saving:
            left[i] = "it does not compress"
        elif not lo <= at < hi:
            left[i] = "it is not held at the peak"
        else:
            left[i] = {"target": "the target is met", "budget": "the time budget is spent"}.get(stop, "")
    return left
