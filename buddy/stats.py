"""What a compressed-activations session held, per key and in total."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .prefetch import PrefetchStats

__all__ = ["KeyRow", "SessionStats", "format_bytes"]


def format_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``; binary units."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n:,.2f} GiB"


def _ratio(num: float, den: float) -> float:
    return num / den if den else (math.inf if num else 1.0)


@dataclass
class KeyRow:
    """One compressed tensor of a step (bytes unless said otherwise)."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    codec: str
    target_ratio: float
    original_bytes: int
    device_bytes: int
    buddy_bytes: int
    ideal_bytes: int  # sum(k) * 32: the size with entries compacted
    predicted_overflow_bytes: int | None  # None: new key, decided from its size pass
    saves: int = 1  # how many saves autograd made of it (dedup)
    compress_seconds: float = 0.0
    corrected: bool = False  # the policy's bound widened the slot its history planned (buddy.tracker.SlotChoice)
    reserve_bytes: int = 0  # overflow kept on the device in its step's reserve, past the step's bound (strict=False)
    left: str | None = None  # why the policy kept it as it is, uncompressed (codec "left"; see buddy.budget)

    @property
    def offloaded(self) -> bool:
        """Sent wholly to buddy memory (the zero slot): only metadata stays on the device."""
        return self.target_ratio == math.inf

    @property
    def effective_capacity(self) -> float:
        return _ratio(self.original_bytes, self.device_bytes)

    @property
    def overflow_fraction(self) -> float:
        return _ratio(self.buddy_bytes, self.original_bytes) if self.original_bytes else 0.0


@dataclass
class SessionStats:
    """Totals over the unique storages a session compressed, plus per-key rows.

    ``original_bytes`` counts each storage once (what PyTorch would really
    hold), ``device_bytes`` is slots + metadata, ``buddy_bytes`` the overflow
    in host memory. Times are host wall-clock seconds spent in the pack and
    unpack hooks.
    """

    rows: list[KeyRow] = field(default_factory=list)
    original_bytes: int = 0
    device_bytes: int = 0
    buddy_bytes: int = 0
    ideal_bytes: int = 0
    saves: int = 0  # pack-hook calls
    deduplicated: int = 0  # saves that reused an already-compressed storage
    skipped: int = 0  # parameters, small or unsupported tensors, kept as they are
    skipped_bytes: int = 0  # bytes of those saves, one count per save
    kept_bytes: int = 0  # bytes of saved activations (not parameters) left uncompressed: small, unsupported, failed
    failed: int = 0  # packing raised: the original tensor was kept
    captured: int = 0  # saves kept as they are (among ``skipped``) while a CUDA graph was being captured
    #: saves made while a backward pass ran (among ``skipped``: a checkpointed region's recomputation, used at once)
    in_backward: int = 0
    compress_seconds: float = 0.0
    decompress_seconds: float = 0.0
    decompressions: int = 0
    #: backward's look-ahead (:mod:`buddy.prefetch`): what was brought back or decompressed ahead of use
    prefetch: PrefetchStats = field(default_factory=PrefetchStats)
    #: the policy's overflow bound, a fraction of the bytes compressed (``None``: the policy states none)
    overflow_bound: float | None = None
    #: tensors whose slot the bound widened from what the history planned (the plan was wrong for them)
    corrected: int = 0
    #: ``strict=False``: device bytes the step set aside for overflow past its bound (the reserve, sized from recent
    #: steps), the overflow it held, and the overflow past the bound it had no room for (sent to buddy memory: the
    #: step passes its bound by that much)
    reserve_bytes: int = 0
    reserved_bytes: int = 0
    reserve_short_bytes: int = 0
    #: reads of the device by the host in the step (forward's, and backward's checks once it ran): one per
    #: compressed tensor with ``strict=True``, at most two a step (where forward ends, where backward ends) once
    #: every key has a plan with ``strict=False`` (:func:`buddy.engines.to_host` counts them, on every device)
    host_reads: int = 0
    #: bytes of the tensors the policy kept as they are (rows of codec ``"left"``: :mod:`buddy.budget`)
    left_bytes: int = 0
    #: what the policy planned for the step (:meth:`buddy.Policy.describe`; ``None``: nothing to say)
    plan: str | None = None
    #: with overlap (:mod:`buddy.overlap`): tensors packed on the pack stream, the most bytes of originals the
    #: stash held at once, and how often forward's stream waited for a pack because the stash was full
    overlapped: int = 0
    stash_peak_bytes: int = 0
    stash_waits: int = 0
    #: with an overflow ring (:mod:`buddy.ring`): its device bytes, the tensors whose overflow it drained to buddy
    #: memory, how often a pack waited for earlier drains to free its region, and the tensors whose worst case was
    #: larger than the ring (packed as without one)
    ring_bytes: int = 0
    ring_drained: int = 0
    ring_waits: int = 0
    ring_too_large: int = 0
    #: saved copies of parameters in another dtype (autocast's casts of weights) made again from the parameter in
    #: backward, not held (``rederive_casts``): their saves, and their bytes (one count per save; not among the bytes
    #: compressed or kept)
    rederived: int = 0
    rederived_bytes: int = 0

    @property
    def within_bound(self) -> bool:
        """Whether the step's overflow kept the policy's bound (``True`` when it states none): over the bytes of
        the tensors the policy placed, not of those it left."""
        if self.overflow_bound is None:
            return True
        return self.buddy_bytes <= self.overflow_bound * sum(r.original_bytes for r in self.rows if r.left is None)

    @property
    def effective_capacity(self) -> float:
        """original bytes / device bytes of what was compressed (with the step's device reserve and overflow ring)."""
        return _ratio(self.original_bytes, self.device_bytes + self.reserve_bytes + self.ring_bytes)

    @property
    def overflow_fraction(self) -> float:
        """buddy bytes / original bytes."""
        return self.buddy_bytes / self.original_bytes if self.original_bytes else 0.0

    @property
    def ideal_ratio(self) -> float:
        """original bytes / compacted bytes: the codec's ratio with no slot rounding."""
        return _ratio(self.original_bytes, self.ideal_bytes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            effective_capacity=self.effective_capacity,
            overflow_fraction=self.overflow_fraction,
            ideal_ratio=self.ideal_ratio,
            within_bound=self.within_bound,
        )
        return d

    def _plan_lines(self) -> list[str]:
        """What the policy planned, and why the tensors it left are left (:mod:`buddy.budget`)."""
        if self.plan is None:
            return []
        reasons: dict[str, int] = {}
        for r in self.rows:
            if r.left is not None:
                reasons[r.left] = reasons.get(r.left, 0) + 1
        if not reasons:
            return [self.plan]
        return [self.plan, "left as they are: " + "; ".join(f"{n} because {why}" for why, n in reasons.items())]

    def __str__(self) -> str:
        # keys name their model ("ResNet-1a2b3c4d/12:float32[64, 256, 56, 56]"): wide enough for the longest
        w = min(max([28, *(len(r.key) for r in self.rows)]), 64)
        header = f"{'key':<{w}} {'codec':<5} {'target':>6} {'original':>12} {'device':>12} {'buddy':>12} {'capacity':>8} {'overflow':>8} {'pred.ovf':>8}"
        lines = [header, "-" * len(header)]
        for r in self.rows:
            pred = (
                "left" if r.left is not None else "new"
                if r.predicted_overflow_bytes is None
                else f"{_ratio(r.predicted_overflow_bytes, r.original_bytes):.1%}"
            )
            # a tensor sent wholly to buddy memory keeps only metadata on the device: say so, not "infx"
            target = "offload" if r.offloaded else f"{r.target_ratio:>5.2f}x"
            capacity = "offload" if r.offloaded else f"{r.effective_capacity:>7.2f}x"
            lines.append(
                f"{r.key[:w]:<{w}} {r.codec:<5} {target:>6} {format_bytes(r.original_bytes):>12} "
                f"{format_bytes(r.device_bytes):>12} {format_bytes(r.buddy_bytes):>12} "
                f"{capacity:>8} {r.overflow_fraction:>8.1%} {pred:>8}{' corrected' if r.corrected else ''}"
            )
        lines.append("-" * len(header))
        lines.append(
            f"{'total (unique storages)':<{w}} {'':<5} {'':>6} {format_bytes(self.original_bytes):>12} "
            f"{format_bytes(self.device_bytes):>12} {format_bytes(self.buddy_bytes):>12} "
            f"{self.effective_capacity:>7.2f}x {self.overflow_fraction:>8.1%}"
        )
        lines.append(
            f"saves {self.saves}: {sum(r.codec not in ('kept', 'left') for r in self.rows)} compressed, "
            f"{sum(r.codec == 'kept' for r in self.rows)} incompressible kept, "
            f"{sum(r.left is not None for r in self.rows)} left by the policy ({format_bytes(self.left_bytes)}), "
            f"{self.deduplicated} deduplicated, "
            f"{self.skipped} skipped ({format_bytes(self.kept_bytes)} of activations kept as is), {self.failed} failed; "
            f"compress {self.compress_seconds * 1e3:.1f} ms, decompress {self.decompress_seconds * 1e3:.1f} ms "
            f"({self.decompressions} unpacks); ideal ratio {self.ideal_ratio:.2f}x; {self.host_reads} read(s) of the "
            f"device"
        )
        if self.overflow_bound is not None:
            lines.append(
                f"overflow {self.overflow_fraction:.1%} against the policy's bound of {self.overflow_bound:.1%}: "
                f"{'within it' if self.within_bound else 'PAST IT'}; {self.corrected} slot(s) corrected from the "
                f"history's plan on the tensors' own sizes"
            )
        lines += self._plan_lines()
        lines += self._traffic_lines()
        return "\n".join(lines)

    def _traffic_lines(self) -> list[str]:
        """The reserve, packing beside forward, what was kept and why, and backward's look-ahead: where any."""
        lines = []
        if self.reserve_bytes or self.reserve_short_bytes:
            lines.append(
                f"device reserve {format_bytes(self.reserve_bytes)}: held {format_bytes(self.reserved_bytes)} of "
                f"overflow past the bound, {format_bytes(self.reserve_short_bytes)} found no room in it"
            )
        if self.overlapped:
            lines.append(
                f"overlap: {self.overlapped} packed beside forward; the stash held at most "
                f"{format_bytes(self.stash_peak_bytes)} of originals, forward waited for {self.stash_waits} pack(s)"
            )
        if self.ring_bytes:
            lines.append(
                f"overflow ring {format_bytes(self.ring_bytes)}: drained {self.ring_drained} overflow(s) to buddy "
                f"memory, {self.ring_waits} pack(s) waited for a region, {self.ring_too_large} too large for it"
            )
        if self.rederived:
            lines.append(
                f"{self.rederived} save(s) of parameters' casts ({format_bytes(self.rederived_bytes)}) made again "
                f"in backward, not held"
            )
        if self.captured:
            lines.append(f"{self.captured} save(s) kept as they are: a CUDA graph was being captured")
        if self.in_backward:
            lines.append(f"{self.in_backward} save(s) made in backward (a checkpoint's recomputation) kept as they are")
        p = self.prefetch
        if p.prefetched or p.unpacked_ahead:
            lines.append(
                f"look-ahead: {p.prefetched} overflows prefetched ({format_bytes(p.prefetched_bytes)}), "
                f"{p.unpacked_ahead} tensors decompressed ahead, {p.ready} unpacks found them ready, "
                f"{p.dropped} dropped unused"
            )
        return lines
